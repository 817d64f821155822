"""The engine contract: what the trainer, the checkpoints and `megaloop plan` ask of an engine.

An engine owns the model of its rank (built by megaloop.model.build_model), its parallelism
and its optimizer; the trainer only calls what is written here. Both engines (megatron.py,
deepspeed.py) implement it; tests/unit/parallel/test_engines.py checks that they do, and the
multi-process tests hold their measured memory reports to megaloop.parallel.cost's figures. What an
engine supports (pipelines, resharding, its memory model) is its `spec`, readable without torch
(megaloop/parallel/engines.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from megaloop.parallel.engines import EngineSpec

RANK_REPORT_KEYS = frozenset(
    {
        "rank",
        "tp_rank",
        "pp_rank",
        "dp_rank",
        "params",
        "layer_params",
        "param_bytes",
        "grad_bytes",
        "optimizer_bytes",
    }
)
"""What every rank's entry of `memory_report()["ranks"]` holds (bytes are measured)."""


class StepResult(NamedTuple):
    outputs: list[dict]
    """The objective's terms per micro-batch on ranks that hold them (last stage), [] else."""
    grad_norm: float | None
    lr: float
    """The learning rate the step used."""
    applied: bool
    """False when a non-finite loss or gradient kept the update from being applied."""


@runtime_checkable
class TrainingEngine(Protocol):
    spec: EngineSpec
    """What the engine supports; config checks and `megaloop plan` read the same object."""
    name: str
    """Recorded in every checkpoint: a checkpoint resumes only in the engine that wrote it."""
    module: torch.nn.Module
    dp_rank: int
    dp_size: int

    def layout(self) -> dict:
        """{"tp", "pp", "dp", ...}: recorded in checkpoints; a change means resharding."""

    def train(self, mode: bool = True) -> None: ...

    def train_step(self, microbatches: list[torch.Tensor]) -> StepResult:
        """One optimizer step over this rank's micro-batches ([b, s+1] tokens each)."""

    def step(
        self,
        microbatches: list[torch.Tensor],
        forward_only: bool = True,
        num_loops: int | None = None,
    ) -> list[dict]:
        """Forward (validation) over this rank's micro-batches, at `num_loops` loops."""

    def reduce(self, outputs: list[dict]) -> dict:
        """The logged terms pooled over micro-batches and ranks, the same on every rank."""

    def memory_report(self) -> dict:
        """{"tp", "pp", "dp", ..., "ranks": [one dict per rank with RANK_REPORT_KEYS]},
        gathered on every rank: what each rank measures holding."""

    def run_files(self) -> dict[str, str]:
        """Files (name: text) the engine records in the run directory, written by the trainer
        when the run starts: building an engine writes nothing (`megaloop train --dry-run`)."""

    def save_state(self, folder: Path, position: dict) -> None: ...

    def load_state(self, folder: Path, same_layout: bool) -> None: ...

    def load_weights(self, folder: Path) -> None:
        """Only the model's weights of a checkpoint (train.init_from), fresh optimizer."""
