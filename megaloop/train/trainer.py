"""The step loop: data → forward-backward over micro-batches → optimizer step → metrics/ckpt.

The trainer sees an engine (megaloop.parallel) that owns the model, its wrapping and its
schedule; it never touches parallelism itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megaloop.config import Config, check
from megaloop.data import Batches
from megaloop.train import checkpoint
from megaloop.train.metrics import MetricsLogger


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
        self.optimizer, self.scheduler = cfg.optim.build(
            [engine.ddp], cfg.train.steps, distributed=engine.distributed_optimizer)
        self.batches = Batches(dataset, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                               dp_rank=engine.dp_rank, dp_size=engine.dp_size)
        self.step = 0
        self.log_enabled = log

    def autocast(self):
        if not self.cfg.train.bf16:
            return contextlib.nullcontext()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.autocast(device, dtype=torch.bfloat16)

    def forward_step(self, data_iterator, model, num_loops: Optional[int] = None):
        batch = next(data_iterator)
        with self.autocast():
            out = model(batch[:, :-1], labels=batch[:, 1:], num_loops=num_loops)
        return out, partial(self.loss_func)

    def loss_func(self, out):
        loss, terms = objectives.compute(self.cfg.objective, out)
        return loss, {"loss": loss.detach(), **terms}

    def train_step(self) -> dict:
        start = time.perf_counter()
        self.engine.train()
        self.optimizer.zero_grad()  # param.grad aliases the DDP buffer after a step: unlink it
        outputs = self.engine.step(self.batches.next_step())
        update_ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = self.cfg.train.global_batch_size * self.dataset.seq_len
        record = {"step": self.step, **self.engine.reduce(outputs)}
        record.update(lr=self.optimizer.param_groups[0]["lr"], grad_norm=grad_norm,
                      tokens_per_s=tokens / elapsed, step_time_s=elapsed)
        return record

    @torch.no_grad()
    def evaluate(self, num_loops: Optional[int] = None) -> dict:
        """Validation CE per loop over `eval_batches` fixed batches (the same ones every time)."""
        self.engine.train(False)
        mbs = self.cfg.train.micro_batch_size
        microbatches = [self.dataset.batch(range(i * mbs, (i + 1) * mbs), split="valid")
                        for i in range(self.cfg.train.eval_batches)]
        outputs = self.engine.step(microbatches, forward_only=True, num_loops=num_loops)
        return {"step": self.step, **self.engine.reduce(outputs)}

    def save(self) -> Path:
        meta = {"consumed_samples": self.batches.consumed_samples, "config": self.cfg.to_dict()}
        return checkpoint.save(self.run_dir / "checkpoints", self.step, self.engine.module, meta,
                               self.cfg.train.keep_last)

    def fit(self) -> dict:
        t = self.cfg.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        logger = MetricsLogger(self.run_dir, self.cfg.to_dict(), self.cfg.wandb, t.steps,
                               start_step=self.step, enabled=self.log_enabled)
        try:
            while self.step < t.steps:
                record = self.train_step()
                logger.advance()
                if self.step % t.log_every == 0 or self.step == t.steps:
                    logger.log(record)
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                    logger.log(self.evaluate(), kind="evals")
                if t.save_every and self.step % t.save_every == 0 and self.step < t.steps:
                    self.save()
            final_eval = self.evaluate()
            logger.log(final_eval, kind="evals")
            self.save()
        finally:
            logger.close()
        return final_eval
