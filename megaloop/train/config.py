"""The training loop's settings (the `train:` section), torch-free so that a config loads and
checks without importing the training stack."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megaloop.config import Config, check
from megaloop.train.watchdog import ScaleAlarmConfig


@dataclass
class TrainConfig(Config):
    dir: str | None = None
    """The run directory (checkpoints/, metrics.jsonl, wandb/); null: built from the config
    file's path and the seed, runs/<path under configs/experiments>/seed<seed>, so seeds and
    variants never share one (megaloop.experiment.default_run_dir)."""
    steps: int | None = None
    """Optimizer steps. Null with data.epochs set: as many as those epochs take. Given together
    with data.epochs, train.steps wins (and the run says so)."""
    seed: int = 0
    """Seeds the initialisation, the data order and dropout."""
    init_from: str | None = None
    """A checkpoint folder or run directory (e.g. a `megaloop import ouro` folder) whose model
    weights a new run starts from: weights only, fresh optimizer, any layout. A run directory
    that already holds a checkpoint resumes from that instead."""
    micro_batch_size: int = 8
    """Samples a forward and backward pass takes on one data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step (micro-batches are accumulated to reach it)."""
    log_every: int = 10
    """Print and record training metrics every N steps."""
    eval_every: int = 0
    """Validation every N steps; 0 = only after the last step."""
    eval_batches: int | Literal["all"] = 4
    """Validation micro-batches: the first N·micro_batch_size windows of the validation split in
    file order, or `all` of it (the longest prefix that splits evenly over DP and PP)."""
    save_every: int = 0
    """Checkpoint every N steps; 0 = only after the last step."""
    keep_last: int = 2
    """Loadable checkpoints kept; older ones are deleted once a newer one is complete."""
    recompute: Literal["none", "selective", "full", "loop"] = "none"
    """Activation recompute: `selective` (megatron-core's, core attention only: little to gain
    with SDPA, which keeps no score matrix), `full` (every layer keeps only its input), `loop`
    (every loop keeps only its input; under PP each stage's share of a lap)."""
    bf16: bool = False
    """bf16 autocast of the forward pass (parameters and optimizer stay fp32)."""
    nonfinite: Literal["skip", "stop"] = "stop"
    """A NaN or inf in any loop's loss or in the gradients: the update is never applied; `stop`
    saves and stops (exit 65, never requeued, like a scale alarm), `skip` counts the step and
    goes on with the next batch (its schedule step is not taken). Our choice: stop."""
    scale_alarm: ScaleAlarmConfig = field(default_factory=ScaleAlarmConfig)
    """Alarms on the per-loop hidden RMS (megaloop/train/watchdog.py); off by default."""

    def validate(self, prefix: str = "") -> None:
        for name in ("micro_batch_size", "global_batch_size", "log_every", "keep_last"):
            check(getattr(self, name) >= 1, prefix + name, getattr(self, name), "must be >= 1")
        check(0 <= self.seed < 2**63, prefix + "seed", self.seed, "must be in [0, 2**63)")
        check(
            self.steps is None or self.steps >= 1,
            prefix + "steps",
            self.steps,
            "must be >= 1 (or null to train for data.epochs)",
        )
        check(
            self.eval_batches == "all" or self.eval_batches >= 1,
            prefix + "eval_batches",
            self.eval_batches,
            "must be >= 1, or `all`",
        )
        for name in ("eval_every", "save_every"):
            check(getattr(self, name) >= 0, prefix + name, getattr(self, name), "must be >= 0")
        check(
            self.global_batch_size % self.micro_batch_size == 0,
            prefix + "global_batch_size",
            self.global_batch_size,
            f"must be a multiple of train.micro_batch_size={self.micro_batch_size}",
        )
