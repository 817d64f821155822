"""Process groups: torch.distributed plus megatron-core's model-parallel state.

Under torchrun the rank and world size come from its environment; under srun (one task per
rank, slurm/train.sbatch) from Slurm's (megaloop/slurm.py). A plain `megaloop` process is a
world of one, with an in-memory store (no port to pick).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megaloop import slurm
from megaloop.parallel import comm


def init(seed: int, tp: int = 1, pp: int = 1, virtual_pp: int | None = None) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    slurm.task_env()
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=virtual_pp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """The world this process belongs to (before or after init)."""
    if dist.is_initialized():
        return dist.get_world_size()
    slurm.task_env()
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class NonFiniteUpdate(RuntimeError):
    """An engine applied an update with non-finite gradients: the weights in memory are lost."""


def terms_finite(outputs: list[dict]) -> bool:
    """This rank's logged terms (losses, per-loop CE) are all finite."""
    return all(bool(torch.isfinite(v).all()) for o in outputs for v in o.values()
               if torch.is_tensor(v))


def reduce_terms(outputs: list[dict], holds_terms: bool) -> dict:
    """The logged terms pooled over micro-batches and data-parallel replicas, on every rank.
    Ranks that hold terms (last pipeline stage, one tensor-parallel rank) contribute them.

    A `*_max` term is the max over micro-batches and replicas, so the step's max is exact.
    Every other term is the mean: exact token means for means (micro-batches hold equal token
    counts), and for the percentiles (`hidden_rms_p50`, `hidden_rms_p99`) the mean of each
    micro-batch's own token percentile, not the percentile of all the step's tokens (that would
    need every token's value gathered)."""
    def pool(key: str, values: torch.Tensor) -> list:
        return (values.amax(0) if key.endswith("_max") else values.mean(0)).tolist()

    local = None
    if outputs and holds_terms:
        local = {key: pool(key, torch.stack([o[key] for o in outputs]).double())
                 for key in outputs[0]}
    replicas = [g for g in comm.all_gather_object(local) if g is not None]
    return {key: pool(key, torch.tensor([r[key] for r in replicas], dtype=torch.float64))
            for key in replicas[0]}
