"""The scale watchdog: alarms on the per-loop hidden-state RMS of every training step.

The readout blind spot lets ‖H_k‖_rms drift without any sign in the loss; this watches it. Each
rule is checked per loop k on every step's record (terms reduced over micro-batches and DP
replicas, so every rank decides the same):

    max_rms   hidden_rms_max[k] > max_rms
              the largest per-token ‖H_k‖_rms of the step's tokens (exact max over ranks)
    growth    hidden_rms[k] / (hidden_rms[k] `window` steps earlier) >= growth
              hidden_rms = the token mean of ‖H_k‖_rms; checked from step window+1 of each
              process (a resumed run starts its window again)

A non-finite value fires either rule. `warn` reports an alarm once when a rule starts firing for
a loop (again only after it has cleared): a line in the log and a `scale_alarm/...` value and an
alert in wandb. `stop` saves a checkpoint, writes RUN_DIR/STOPPED (why, as JSON) and ends the run
with EXIT_UNHEALTHY, which job scripts never requeue: rerunning would repeat it.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from megaloop.config import Config, check
from megaloop.train.callbacks import Callback

EXIT_UNHEALTHY = 65
"""Exit code of a run stopped because its numbers went bad (a scale alarm; also meant for
non-finite losses): EX_DATAERR, next to preemption's EX_TEMPFAIL (75). Never requeued."""
STOP_MARKER = "STOPPED"
"""RUN_DIR/STOPPED: written by an unhealthy stop, read by slurm/train.sbatch (a launcher may
report another exit code, e.g. torchrun's 1 or srun's for a rank it killed)."""


class UnhealthyRun(Exception):
    """Raised after the stop checkpoint and the marker are written; the CLI exits with
    EXIT_UNHEALTHY."""


def write_stop_marker(run_dir: Path, reason: str, message: str, **details) -> Path:
    """RUN_DIR/STOPPED: why the run stopped, for people and job scripts (rank 0 only)."""
    path = run_dir / STOP_MARKER
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"reason": reason, "message": message, **details}, indent=1) + "\n")
    tmp.replace(path)
    return path


@dataclass
class ScaleAlarmConfig(Config):
    max_rms: float | None = None
    """Alarm when a loop's largest per-token ‖H_k‖_rms in a step exceeds this; null = off."""
    growth: float | None = None
    """Alarm when a loop's mean ‖H_k‖_rms has grown by this factor (> 1) over `window` steps;
    null = off."""
    window: int = 100
    """Steps over which `growth` is measured."""
    action: Literal["warn", "stop"] = "warn"
    """warn: log it and go on; stop: save a checkpoint and exit with EXIT_UNHEALTHY (65)."""

    def validate(self, prefix: str = "") -> None:
        check(
            self.max_rms is None or self.max_rms > 0,
            prefix + "max_rms",
            self.max_rms,
            "must be > 0, or null to turn the rule off",
        )
        check(
            self.growth is None or self.growth > 1,
            prefix + "growth",
            self.growth,
            "is a growth factor and must be > 1, or null to turn the rule off",
        )
        check(self.window >= 1, prefix + "window", self.window, "must be >= 1 (steps)")


@dataclass
class Alarm:
    step: int
    loop: int
    """1-based, as in the logs (ce/loop1 ...)."""
    rule: Literal["max_rms", "growth"]
    value: float
    """max_rms: the token max; growth: the factor over the window."""
    limit: float
    window: int | None = None
    """growth: the steps the factor is measured over."""

    def what(self) -> str:
        if self.rule == "max_rms":
            return (
                f"loop {self.loop}: max hidden RMS {self.value:.4g} > "
                f"train.scale_alarm.max_rms={self.limit:g}"
            )
        return (
            f"loop {self.loop}: mean hidden RMS grew x{self.value:.4g} over {self.window} "
            f"steps (train.scale_alarm.growth={self.limit:g})"
        )

    def message(self) -> str:
        return f"scale alarm at step {self.step}, {self.what()}"

    def to_dict(self) -> dict:
        return asdict(self)


class ScaleWatchdog:
    """Called by the trainer once per step with the step's record; returns new alarms."""

    def __init__(self, cfg: ScaleAlarmConfig):
        self.cfg = cfg
        self.means: deque = deque(maxlen=cfg.window + 1)
        self.firing: set[tuple[str, int]] = set()

    def check(self, record: dict) -> list[Alarm]:
        cfg, step = self.cfg, record["step"]
        active = []
        if cfg.max_rms is not None:
            for k, value in enumerate(record["hidden_rms_max"], start=1):
                if not value <= cfg.max_rms:
                    active.append(Alarm(step, k, "max_rms", value, cfg.max_rms))
        if cfg.growth is not None:
            self.means.append(record["hidden_rms"])
            if len(self.means) == self.means.maxlen:
                for k, (now, then) in enumerate(zip(record["hidden_rms"], self.means[0]), 1):
                    factor = now / then if then > 0 else math.inf
                    if not factor < cfg.growth:
                        active.append(Alarm(step, k, "growth", factor, cfg.growth, cfg.window))
        new = [a for a in active if (a.rule, a.loop) not in self.firing]
        self.firing = {(a.rule, a.loop) for a in active}
        return new


class ScaleAlarms(Callback):
    """The watchdog on every step's record: a new alarm is logged with the step's record
    (whatever train.log_every says); with action=stop the run saves and stops."""

    priority = 80

    def __init__(self, cfg: ScaleAlarmConfig):
        self.cfg = cfg

    def pre_train(self, trainer) -> None:
        self.watchdog = ScaleWatchdog(self.cfg)

    def post_step(self, trainer, record: dict) -> None:
        alarms = self.watchdog.check(record)
        if not alarms:
            return
        trainer.logger.log(record)
        for alarm in alarms:
            trainer.logger.alarm(alarm.to_dict(), alarm.message())
        if self.cfg.action == "stop":
            trainer.stop_unhealthy(
                "scale_alarm",
                "scale alarm, " + "; ".join(a.what() for a in alarms),
                alarms=[a.to_dict() for a in alarms],
            )
