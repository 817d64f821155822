"""The step loop: data → forward-backward over micro-batches → optimizer step → metrics/ckpt.

The trainer sees an engine (megaloop.parallel) that owns the model, its wrapping and its
schedule; it never touches parallelism itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megaloop.config import Config, check
from megaloop.train import checkpoint
from megaloop.train.metrics import MetricsLogger
from megaloop.train.preemption import Preempted, PreemptionWatch


@dataclass
class TrainConfig(Config):
    dir: str = "runs/default"
    """The run directory: checkpoints/, metrics.json, wandb/."""
    steps: int = 1000
    seed: int = 0
    micro_batch_size: int = 8
    global_batch_size: int = 8
    """Samples per optimizer step (micro-batches are accumulated to reach it)."""
    log_every: int = 10
    eval_every: int = 0
    """Validation every N steps; 0 = only after the last step."""
    eval_batches: int = 4
    save_every: int = 0
    """Checkpoint every N steps; 0 = only after the last step."""
    keep_last: int = 2
    bf16: bool = False
    """bf16 autocast of the forward pass (parameters and optimizer stay fp32)."""

    def validate(self, prefix: str = "") -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size", "log_every",
                     "eval_batches", "keep_last"):
            check(getattr(self, name) >= 1, prefix + name, getattr(self, name), "must be >= 1")
        for name in ("eval_every", "save_every"):
            check(getattr(self, name) >= 0, prefix + name, getattr(self, name), "must be >= 0")
        check(self.global_batch_size % self.micro_batch_size == 0, prefix + "global_batch_size",
              self.global_batch_size,
              f"must be a multiple of train.micro_batch_size={self.micro_batch_size}")


class Trainer:
    def __init__(self, cfg, engine, dataset, log: bool = True):
        self.cfg = cfg
        self.engine = engine
        self.dataset = dataset
        self.run_dir = Path(cfg.train.dir)
        self.batches = dataset.batches(cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                       dp_rank=engine.dp_rank, dp_size=engine.dp_size)
        self.step = 0
        self.log_enabled = log

    def train_step(self) -> dict:
        start = time.perf_counter()
        self.engine.train()
        outputs, grad_norm, lr = self.engine.train_step(self.batches.next_step())
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = self.cfg.train.global_batch_size * self.dataset.seq_len
        record = {"step": self.step, **self.engine.reduce(outputs)}
        record.update(lr=lr, grad_norm=grad_norm, tokens_per_s=tokens / elapsed,
                      step_time_s=elapsed)
        return record

    @torch.no_grad()
    def evaluate(self, num_loops: Optional[int] = None) -> dict:
        """Validation terms per loop over `eval_batches` fixed micro-batches (the same ones every
        time), split over data-parallel ranks."""
        self.engine.train(False)
        mbs, dp = self.cfg.train.micro_batch_size, self.engine.dp_size
        microbatches = [self.dataset.batch(range(i * mbs, (i + 1) * mbs), split="valid")
                        for i in range(self.engine.dp_rank, self.cfg.train.eval_batches, dp)]
        outputs = self.engine.step(microbatches, forward_only=True, num_loops=num_loops)
        return {"step": self.step, **self.engine.reduce(outputs)}

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self) -> Path:
        position = {"step": self.step, "consumed_samples": self.batches.consumed_samples}
        return checkpoint.save(self.checkpoints, self.engine, position, self.cfg.to_dict(),
                               self.cfg.train.keep_last)

    def resume(self) -> Optional[Path]:
        """Continue from the newest complete checkpoint of the run directory, if any."""
        folder = checkpoint.find_latest(self.checkpoints)
        if folder is not None:
            position = checkpoint.load(folder, self.engine)
            self.step = position["step"]
            self.batches.consumed_samples = position["consumed_samples"]
        return folder

    def _history(self) -> Optional[dict]:
        path = self.run_dir / "metrics.json"
        return json.loads(path.read_text()) if self.step and path.is_file() else None

    def fit(self) -> dict:
        t = self.cfg.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed = self.resume()
        if resumed is not None and self.log_enabled:
            print(f"megaloop: resumed from {resumed} (step {self.step})", flush=True)
        preemption = PreemptionWatch(stop_file=self.run_dir / "PREEMPT")
        layout = self.engine.memory_report()
        logger = MetricsLogger(self.run_dir, self.cfg.to_dict(), self.cfg.wandb, t.steps,
                               start_step=self.step, enabled=self.log_enabled,
                               history=self._history() if self.log_enabled else None)
        logger.data["layout"] = layout
        try:
            while self.step < t.steps:
                record = self.train_step()
                logger.advance()
                if self.step % t.log_every == 0 or self.step == t.steps:
                    logger.log(record)
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                    logger.log(self.evaluate(), kind="evals")
                if preemption.requested():
                    self.save()
                    if self.log_enabled:
                        (self.run_dir / "PREEMPT").unlink(missing_ok=True)
                    raise Preempted(f"preempted at step {self.step}; checkpoint saved")
                if t.save_every and self.step % t.save_every == 0 and self.step < t.steps:
                    self.save()
            final_eval = self.evaluate()
            logger.log(final_eval, kind="evals")
            self.save()
        finally:
            logger.close()
        return final_eval
