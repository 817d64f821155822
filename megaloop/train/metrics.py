"""Where per-step records go: RUN_DIR/metrics.jsonl, a progress bar or progress lines, wandb.

`metrics.jsonl` holds one JSON object a line, appended as the run goes, so a log call costs the
same at step 50,000 as at step 10: first `{"kind": "config", "config": {...}}`, then records of
kind `step` (`{"step", "loss", "ce": [per loop], "hidden_rms": [per loop], "hidden_rms_p50",
"hidden_rms_p99", "hidden_rms_max", "lr", "grad_norm", "tokens_per_s", "mfu" on a GPU whose peak
megaloop knows (parallel/cost.py PEAK_BF16_TFLOPS), ...}`), `eval`, `alarm`
(megaloop/train/watchdog.py), `skipped` and `layout` (the per-rank memory report). A resumed run
first rewrites the file without the records past the checkpoint it resumes from (and measures
its memory report again). `read` gives a
run's records back as one dict, also for a run directory of an older megaloop (metrics.json).

On a terminal the progress is a bar; otherwise (a Slurm log, a pipe) one line every
`train.log_every` steps in the manner of Megatron-LM's iteration line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from megaloop.config import Config
from megaloop.train.callbacks import Callback

METRICS = "metrics.jsonl"
KINDS = {"step": "steps", "eval": "evals", "alarm": "alarms", "skipped": "skipped_steps"}
"""A record's kind in the file, and the list it is read into."""


@dataclass
class WandbConfig(Config):
    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline writes the run under RUN_DIR/wandb for a later `wandb sync`."""
    project: str = "megaloop"
    """The wandb project the run is logged under."""
    entity: str | None = None
    """The wandb user or team; null: wandb's default."""
    name: str | None = None
    """The run's name in the wandb UI; null: the config's path and the seed. The run's id is
    RUN_DIR/wandb_id, made at the first start and kept by every resume and requeue."""


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read(run_dir: Path) -> dict | None:
    """{"config", "steps", "evals", "alarms", "skipped_steps", "layout"} of a run directory, or
    None when it holds no metrics. A torn last line (the run was killed mid-write) is left out."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS
    if not path.is_file():
        old = run_dir / "metrics.json"  # megaloop before metrics.jsonl
        return json.loads(old.read_text()) if old.is_file() else None
    data = {"config": None, **{name: [] for name in KINDS.values()}}
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {n + 1} is not JSON") from None
        kind = record.pop("kind")
        if kind == "config":
            data["config"] = record["config"]
        elif kind == "layout":
            data["layout"] = record["layout"]
        else:
            data[KINDS[kind]].append(record)
    return data


def finished(run_dir: Path, steps: int | None = None) -> bool:
    """The run logged the final validation of its step count: `steps` when given (another count
    is not this run), else the one its saved config resolved."""
    m = read(run_dir)
    if m is None or not m["evals"]:
        return False
    planned = m["config"]["train"]["steps"]
    return (steps is None or steps == planned) and m["evals"][-1]["step"] == planned


def _kept(history: dict | None, start_step: int) -> dict:
    """What a run resuming at `start_step` keeps of its history: the records up to that step
    (the memory report is measured again, by every rank alike)."""
    kept = {name: [] for name in KINDS.values()}
    if history:
        for name in KINDS.values():
            kept[name] = [r for r in history[name] if r["step"] <= start_step]
    return kept


def flatten(record: dict) -> dict:
    """wandb wants scalars: `ce: [a, b]` becomes `ce/loop1`, `ce/loop2`."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, list):
            flat.update({f"{key}/loop{k}": v for k, v in enumerate(value, start=1)})
        elif key != "step":
            flat[key] = value
    return flat


class MetricsLogger:
    """Rank 0's record of the run (`enabled` false on the other ranks: then it does nothing)."""

    def __init__(
        self,
        run_dir: Path,
        config: dict,
        wandb_cfg: WandbConfig,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
    ):
        self.enabled, self.total, self.start_step = enabled, total_steps, start_step
        self.started = time.monotonic()
        self.has_layout, self.skipped_count = False, 0
        self.last_step: int | None = None
        self.wandb = self.file = None
        if not enabled:
            return
        self.path = run_dir / METRICS
        kept = _kept(read(run_dir) if start_step else None, start_step)
        self.skipped_count = len(kept["skipped_steps"])
        lines = [{"kind": "config", "config": config}]
        records = [(r, kind) for kind, name in KINDS.items() for r in kept[name]]
        lines += [{"kind": kind, **r} for r, kind in sorted(records, key=lambda x: x[0]["step"])]
        tmp = self.path.with_name(METRICS + ".tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
        os.replace(tmp, self.path)
        (run_dir / "metrics.json").unlink(missing_ok=True)  # an older megaloop's, now in .jsonl
        self.file = open(self.path, "a")
        self.terminal = sys.stderr.isatty()
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not self.terminal,
        )
        if wandb_cfg.mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name,
                mode=wandb_cfg.mode,
                dir=str(run_dir),
                config=config,
                resume="allow",
                id=wandb_id(run_dir),
                settings=wandb.Settings(silent=True),
            )

    def _append(self, kind: str, record: dict) -> None:
        self.file.write(json.dumps({"kind": kind, **record}) + "\n")
        self.file.flush()

    def _say(self, line: str) -> None:
        if self.terminal:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.enabled:
            self.bar.update(steps)

    def layout(self, report: dict) -> None:
        """The per-rank memory report, once (measured after the first step)."""
        self.has_layout = True
        if self.enabled:
            self._append("layout", {"layout": report})

    def log(self, record: dict, kind: str = "steps") -> None:
        """A step's record is written once, however many callbacks ask (the cadence, an
        alarm)."""
        if not self.enabled or (kind == "steps" and record["step"] == self.last_step):
            return
        if kind == "steps":
            self.last_step = record["step"]
        self._append("step" if kind == "steps" else "eval", record)
        if self.wandb is not None:
            prefix = "" if kind == "steps" else "valid/"
            self.wandb.log({prefix + k: v for k, v in flatten(record).items()}, step=record["step"])
        if kind == "steps":
            ce = " ".join(f"{c:.3f}" for c in record["ce"])
            rms = " ".join(f"{r:.3g}" for r in record["hidden_rms"])
            top = " ".join(f"{r:.3g}" for r in record["hidden_rms_max"])
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4f} | CE/loop {ce} | RMS/loop {rms} | max {top}"
            )
            if not self.terminal:
                self._say(self.progress_line(record))
        else:
            self._say(
                f"step {record['step']}: valid CE/loop "
                + " ".join(f"{c:.4f}" for c in record["ce"])
                + f" ({record['valid_windows']} windows, {record['valid_tokens']} "
                f"tokens)"
            )

    def progress_line(self, record: dict) -> str:
        """Megatron-LM's iteration line, megaloop's terms: step/total, loss, CE and RMS per
        loop, lr, grad norm, tokens/s, MFU where known, elapsed and ETA of this attempt."""
        step = record["step"]
        elapsed = time.monotonic() - self.started
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        width = len(str(self.total))
        parts = [
            f"step {step:>{width}}/{self.total}",
            f"loss {record['loss']:.4f}",
            "CE/loop " + " ".join(f"{c:.3f}" for c in record["ce"]),
            "RMS/loop " + " ".join(f"{r:.3g}" for r in record["hidden_rms"]),
            f"lr {record['lr']:.3e}",
            f"grad norm {record['grad_norm']:.3f}",
            f"{record['tokens_per_s']:,.0f} tok/s",
        ]
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        parts += [f"elapsed {_clock(elapsed)}", f"ETA {_clock(eta)}"]
        return " | ".join(parts)

    def alarm(self, alarm: dict, message: str) -> None:
        """A scale alarm: a log line, a record, and in wandb a value `scale_alarm/RULE/loopK`
        and an alert (kept in an offline run's file for `wandb sync`)."""
        if not self.enabled:
            return
        self._append("alarm", alarm)
        self._say(f"megaloop: {message}")
        if self.wandb is not None:
            self.wandb.log(
                {f"scale_alarm/{alarm['rule']}/loop{alarm['loop']}": alarm["value"]},
                step=alarm["step"],
            )
            self.wandb.alert(
                title=f"megaloop scale alarm, loop {alarm['loop']}", text=message, level="WARN"
            )

    def skipped(self, step: int, what: str) -> None:
        """A step whose update was not applied (train.nonfinite=skip): a `skipped` record, a
        log line, and `skipped_steps` in wandb."""
        if not self.enabled:
            return
        self.skipped_count += 1
        self._append("skipped", {"step": step, "what": what})
        self._say(f"megaloop: step {step} skipped: non-finite {what}")
        if self.wandb is not None:
            self.wandb.log({"skipped_steps": self.skipped_count}, step=step)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


class ProgressLog(Callback):
    """The progress bar's step, and the step's record every train.log_every steps and at the
    last one."""

    priority = 70

    def post_step(self, trainer, record: dict) -> None:
        trainer.logger.advance()
        t = trainer.cfg.train
        if trainer.step % t.log_every == 0 or trainer.step == t.steps:
            trainer.logger.log(record)


class MemoryReport(Callback):
    """The per-rank memory report, once: after the first step (the optimizer's state exists
    then), or at the end of a run resumed with no step left. Every rank measures it."""

    priority = 90

    def post_step(self, trainer, record: dict) -> None:
        self.report(trainer)

    def post_train(self, trainer) -> None:
        self.report(trainer)

    @staticmethod
    def report(trainer) -> None:
        if not trainer.logger.has_layout:
            trainer.logger.layout(trainer.engine.memory_report())


def _clock(seconds: float) -> str:
    if seconds != seconds:  # nan: nothing measured yet
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def wandb_id(run_dir: Path) -> str:
    """The run's wandb id: RUN_DIR/wandb_id, made once (random) and reused by every resume and
    requeue, so two runs never share an id whatever their folders are called."""
    import secrets

    path = run_dir / "wandb_id"
    if not path.is_file():
        tmp = path.with_name("wandb_id.tmp")
        tmp.write_text(secrets.token_hex(8) + "\n")
        os.replace(tmp, path)
    return path.read_text().strip()
