"""The step loop: data → forward-backward over micro-batches → optimizer step, then the
callbacks (megaloop/train/callbacks.py): the non-finite policy, the memory report, the scale
watchdog, the progress log, validation, preemption and checkpoints, each beside its concern.

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
from megaloop.train import checkpoint, run_lock
from megaloop.train.callbacks import Callback, ordered
from megaloop.train.checkpoint import Checkpointing
from megaloop.train.metrics import MemoryReport, MetricsLogger, ProgressLog
from megaloop.train.nonfinite import NonFinitePolicy
from megaloop.train.preemption import PreemptionCheck
from megaloop.train.start import start
from megaloop.train.watchdog import STOP_MARKER, ScaleAlarms, UnhealthyRun, write_stop_marker


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
    """The step and the run's state; `fit` calls `callbacks` (megaloop/train/callbacks.py) for
    everything else."""

    def __init__(
        self,
        cfg,
        engine,
        dataset,
        callbacks: Sequence[Callback] = (),
        log: bool = True,
        resume_from: Path | None = None,
    ):
        self.cfg = cfg
        self.resume_from = resume_from  # verified by start.check_start; None: no checkpoint
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
        self.callbacks = ordered(list(callbacks))
        self.logger: MetricsLogger | None = None
        self.final_eval: dict | None = None

    def add_callback(self, callback: Callback) -> None:
        self.callbacks = ordered([*self.callbacks, callback])

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def train_step(self) -> dict:
        start = time.perf_counter()
        self.engine.train()
        self._call("pre_step")
        try:
            outputs, grad_norm, lr, applied = self.engine.train_step(self.batches.next_step())
        except NonFiniteUpdate as e:  # DeepSpeed's: every rank stops before the update
            self.step += 1
            self.stop_unhealthy("nonfinite", f"{e} (step {self.step})", save=False)
        finally:
            self._call("post_batch")
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
        """Continue from `resume_from`, else start from train.init_from's weights, if any."""
        folder, position = start(self.resume_from, self.cfg.train.init_from, self.engine)
        if position is not None:
            self.step = position["step"]
            self.batches.consumed_samples = position["consumed_samples"]
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

    def start(self) -> None:
        """Write the engine's run files, resume, run the callbacks' pre_train, open the run's
        metrics."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            for name, text in self.engine.run_files().items():
                (self.run_dir / name).write_text(text)
        self._clear_stop_marker()
        resumed = self.resume()
        if resumed is not None and self.log_enabled:
            print(f"megaloop: resumed from {resumed} (step {self.step})", flush=True)
        self._call("pre_train")
        t = self.cfg.train
        self.logger = MetricsLogger(
            self.run_dir,
            self.cfg.to_dict(),
            self.cfg.wandb,
            t.steps,
            start_step=self.step,
            enabled=self.log_enabled,
        )

    def fit(self) -> dict:
        """Step to train.steps; everything but the step itself is a callback's. Returns the
        final validation record."""
        self.start()
        try:
            while self.step < self.cfg.train.steps:
                record = self.train_step()
                self._call("post_step", record)
            self._call("post_train")
        finally:
            self._call("close")
            self.logger.close()
            if self.is_main:
                run_lock.release(self.run_dir)
        return self.final_eval


class Validation(Callback):
    """Validation every train.eval_every steps and after the last step (fit's result)."""

    priority = 60

    def post_step(self, trainer, record: dict) -> None:
        every, step = trainer.cfg.train.eval_every, trainer.step
        if every and step % every == 0 and step < trainer.cfg.train.steps:
            trainer.logger.log(trainer.evaluate(), kind="evals")

    def post_train(self, trainer) -> None:
        trainer.final_eval = trainer.evaluate()
        trainer.logger.log(trainer.final_eval, kind="evals")


def default_callbacks(cfg) -> list[Callback]:
    """Every run's callbacks, from its config, in the order they run."""
    return [
        NonFinitePolicy(),
        MemoryReport(),
        ScaleAlarms(cfg.train.scale_alarm),
        ProgressLog(),
        Validation(),
        PreemptionCheck(),
        Checkpointing(),
    ]
