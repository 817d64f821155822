"""The step loop: data → forward-backward over micro-batches → optimizer step → metrics/ckpt.

The trainer sees an engine (megaloop.parallel) that owns the model, its wrapping and its
schedule; it never touches parallelism itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megaloop.parallel.cost import flops_per_token, loss_exits, peak_tflops
from megaloop.parallel.distributed import NonFiniteUpdate
from megaloop.parallel.layout import eval_microbatches
from megaloop.train import checkpoint, faults, run_lock
from megaloop.train.metrics import MetricsLogger
from megaloop.train.preemption import Preempted, PreemptionWatch
from megaloop.train.watchdog import (
    STOP_MARKER,
    ScaleWatchdog,
    UnhealthyRun,
    write_stop_marker,
)


class ValidMicrobatches(Sequence):
    """This rank's validation micro-batches (j = dp_rank, dp_rank + DP, ...), read when the
    schedule asks for them, so a whole split is never held twice."""

    def __init__(self, dataset, ids: range, micro_batch_size: int):
        self.dataset, self.ids, self.size = dataset, ids, micro_batch_size

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        j = self.ids[i]
        return self.dataset.batch(range(j * self.size, (j + 1) * self.size), split="valid")


class Trainer:
    def __init__(self, cfg, engine, dataset, log: bool = True):
        self.cfg = cfg
        self.engine = engine
        self.dataset = dataset
        self.run_dir = Path(cfg.train.dir)
        self.batches = dataset.batches(
            cfg.train.global_batch_size,
            cfg.train.micro_batch_size,
            dp_rank=engine.dp_rank,
            dp_size=engine.dp_size,
        )
        self.eval_microbatches = eval_microbatches(
            cfg.train, dataset.valid_windows, engine.dp_size, engine.layout()["pp"]
        )
        peak = peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
        self.peak_flops = peak * 1e12 * dist.get_world_size() if peak else None
        self.flops_per_token = flops_per_token(cfg.model, self.dataset.seq_len, loss_exits(cfg))
        self.step = 0
        self.log_enabled = log
        self.is_main = dist.get_rank() == 0

    def train_step(self) -> dict:
        start = time.perf_counter()
        self.engine.train()
        with faults.nonfinite(self.engine.module, self.step + 1):
            outputs, grad_norm, lr, applied = self.engine.train_step(self.batches.next_step())
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = self.cfg.train.global_batch_size * self.dataset.seq_len
        record = {"step": self.step, **self.engine.reduce(outputs)}
        record.update(
            lr=lr, grad_norm=grad_norm, tokens_per_s=tokens / elapsed, step_time_s=elapsed
        )
        if self.peak_flops:
            record["mfu"] = tokens / elapsed * self.flops_per_token / self.peak_flops
        if not applied:
            record["skipped"] = True
        return record

    @torch.no_grad()
    def evaluate(self, num_loops: int | None = None) -> dict:
        """Validation terms per loop over the first `eval_microbatches` micro-batches of the
        validation split (the same windows every time, for every seed and layout), split over
        data-parallel ranks; the record states the prefix it covers."""
        self.engine.train(False)
        mbs, n = self.cfg.train.micro_batch_size, self.eval_microbatches
        mine = ValidMicrobatches(
            self.dataset, range(self.engine.dp_rank, n, self.engine.dp_size), mbs
        )
        outputs = self.engine.step(mine, forward_only=True, num_loops=num_loops)
        return {
            "step": self.step,
            **self.engine.reduce(outputs),
            "valid_windows": n * mbs,
            "valid_tokens": n * mbs * self.dataset.seq_len,
        }

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self) -> Path:
        position = {"step": self.step, "consumed_samples": self.batches.consumed_samples}
        return checkpoint.save(
            self.checkpoints, self.engine, position, self.cfg.to_dict(), self.cfg.train.keep_last
        )

    def resume(self) -> Path | None:
        """Continue from the newest complete checkpoint of the run directory, if any."""
        folder = checkpoint.find_latest(self.checkpoints)
        if folder is not None:
            position = checkpoint.load(folder, self.engine)
            self.step = position["step"]
            self.batches.consumed_samples = position["consumed_samples"]
        elif self.cfg.train.init_from:
            self.engine.load_weights(checkpoint.resolve(Path(self.cfg.train.init_from)))
        return folder

    def _clear_stop_marker(self) -> None:
        """A rerun of a stopped run is someone's decision to go on: report the old stop and
        remove its marker, so RUN_DIR/STOPPED always means this attempt stopped."""
        marker = self.run_dir / STOP_MARKER
        if self.is_main and marker.is_file():
            if self.log_enabled:
                why = json.loads(marker.read_text()).get("message", "")
                print(f"megaloop: an earlier attempt stopped ({why}); continuing", flush=True)
            marker.unlink()

    def stop_unhealthy(self, reason: str, message: str, save: bool = True, **details) -> None:
        """Save a checkpoint (unless the weights in memory are bad), write RUN_DIR/STOPPED and
        raise UnhealthyRun (every rank)."""
        folder = self.save() if save else checkpoint.find_latest(self.checkpoints)
        if self.is_main:
            write_stop_marker(
                self.run_dir, reason, message, step=self.step, checkpoint=str(folder), **details
            )
        kept = f"checkpoint {folder} saved" if save else f"newest checkpoint: {folder}"
        raise UnhealthyRun(f"stopped at step {self.step}: {message}; {kept}")

    def _nonfinite(self, record: dict, logger) -> None:
        """train.nonfinite: the update was not applied; count and go on, or save and stop."""
        what = faults.first_nonfinite(record)
        if self.cfg.train.nonfinite == "stop":
            self.stop_unhealthy("nonfinite", f"non-finite {what}; the update was not applied")
        logger.skipped(self.step, what)

    def fit(self) -> dict:
        t = self.cfg.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._clear_stop_marker()
        resumed = self.resume()
        if resumed is not None and self.log_enabled:
            print(f"megaloop: resumed from {resumed} (step {self.step})", flush=True)
        preemption = PreemptionWatch(stop_file=self.run_dir / "PREEMPT", announce=self.is_main)
        logger = MetricsLogger(
            self.run_dir,
            self.cfg.to_dict(),
            self.cfg.wandb,
            t.steps,
            start_step=self.step,
            enabled=self.log_enabled,
        )
        watchdog = ScaleWatchdog(t.scale_alarm)
        hold_at, pause_at = faults.hold_at_step(), faults.pause_at_step()
        try:
            while self.step < t.steps:
                try:
                    record = self.train_step()
                except NonFiniteUpdate as e:
                    self.step += 1
                    self.stop_unhealthy("nonfinite", f"{e} (step {self.step})", save=False)
                logger.advance()
                faults.file_limit(self.step)
                if record.get("skipped"):
                    self._nonfinite(record, logger)
                if not logger.has_layout:  # after a step: the optimizer's state exists
                    logger.layout(self.engine.memory_report())
                alarms = watchdog.check(record)
                if self.step % t.log_every == 0 or self.step == t.steps or alarms:
                    logger.log(record)
                for alarm in alarms:
                    logger.alarm(alarm.to_dict(), alarm.message())
                if alarms and t.scale_alarm.action == "stop":
                    self.stop_unhealthy(
                        "scale_alarm",
                        "scale alarm, " + "; ".join(a.what() for a in alarms),
                        alarms=[a.to_dict() for a in alarms],
                    )
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                    logger.log(self.evaluate(), kind="evals")
                if self.step == pause_at:  # a test's second run meets this one here
                    faults.pause(self.run_dir)
                if self.step == hold_at:  # a preemption at a chosen step, without a race
                    while not preemption.requested():
                        time.sleep(0.2)
                if preemption.requested():
                    self.save()
                    if self.log_enabled:
                        (self.run_dir / "PREEMPT").unlink(missing_ok=True)
                    raise Preempted(
                        f"preempted at step {self.step} ({preemption.reason}); checkpoint saved"
                    )
                if t.save_every and self.step % t.save_every == 0 and self.step < t.steps:
                    self.save()
            if not logger.has_layout:  # resumed with no step left
                logger.layout(self.engine.memory_report())
            final_eval = self.evaluate()
            logger.log(final_eval, kind="evals")
            self.save()
        finally:
            logger.close()
            if self.is_main:
                run_lock.release(self.run_dir)
        return final_eval
