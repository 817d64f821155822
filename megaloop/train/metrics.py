"""Where per-step records go: a progress bar, `metrics.json` in the run directory, and wandb.

A record is `{"step", "loss", "ce": [per loop], "hidden_rms": [per loop], "hidden_rms_p50",
"hidden_rms_p99", "hidden_rms_max": [per loop], "tokens_per_s", ...}`; `metrics.json` holds the
resolved config, the lists of training and validation records and the scale alarms
(megaloop/train/watchdog.py), rewritten atomically so a killed run never leaves it half-written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from megaloop.config import Config


@dataclass
class WandbConfig(Config):
    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline writes the run under RUN_DIR/wandb for a later `wandb sync`."""
    project: str = "megaloop"
    entity: str | None = None
    name: str | None = None


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


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
    def __init__(
        self,
        run_dir: Path,
        config: dict,
        wandb_cfg: WandbConfig,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        history: dict | None = None,
    ):
        self.enabled = enabled
        self.path = run_dir / "metrics.json"
        self.data = {"config": config, "steps": [], "evals": [], "alarms": [], "skipped_steps": []}
        if history:
            for kind in ("steps", "evals", "alarms", "skipped_steps"):
                self.data[kind] = [r for r in history.get(kind, []) if r["step"] <= start_step]
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not enabled or None,
        )
        self.wandb = None
        if enabled and wandb_cfg.mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name,
                mode=wandb_cfg.mode,
                dir=str(run_dir),
                config=config,
                resume="allow",
                id=wandb_cfg.name or run_dir.resolve().name,
                settings=wandb.Settings(silent=True),
            )

    def advance(self, steps: int = 1) -> None:
        if self.enabled:
            self.bar.update(steps)

    def log(self, record: dict, kind: str = "steps") -> None:
        if not self.enabled:
            return
        self.data[kind].append(record)
        write_json_atomic(self.path, self.data)
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
        else:
            self.bar.write(
                f"step {record['step']}: valid CE/loop "
                + " ".join(f"{c:.4f}" for c in record["ce"])
                + f" ({record['valid_windows']} windows, {record['valid_tokens']} "
                f"tokens)"
            )

    def alarm(self, alarm: dict, message: str) -> None:
        """A scale alarm: a log line, an entry in metrics.json, and in wandb a value
        `scale_alarm/RULE/loopK` and an alert (kept in an offline run's file for `wandb sync`)."""
        if not self.enabled:
            return
        self.data["alarms"].append(alarm)
        write_json_atomic(self.path, self.data)
        self.bar.write(f"megaloop: {message}")
        if self.wandb is not None:
            self.wandb.log(
                {f"scale_alarm/{alarm['rule']}/loop{alarm['loop']}": alarm["value"]},
                step=alarm["step"],
            )
            self.wandb.alert(
                title=f"megaloop scale alarm, loop {alarm['loop']}", text=message, level="WARN"
            )

    def skipped(self, step: int, what: str) -> None:
        """A step whose update was not applied (train.nonfinite=skip): counted in metrics.json
        as `skipped_steps`, a log line, and `skipped_steps` in wandb."""
        if not self.enabled:
            return
        self.data["skipped_steps"].append({"step": step, "what": what})
        write_json_atomic(self.path, self.data)
        self.bar.write(f"megaloop: step {step} skipped: non-finite {what}")
        if self.wandb is not None:
            self.wandb.log({"skipped_steps": len(self.data["skipped_steps"])}, step=step)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            if self.wandb is not None:
                self.wandb.finish()
