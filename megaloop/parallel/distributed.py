"""Process groups: torch.distributed plus megatron-core's model-parallel state.

Under torchrun the rank and world size come from its environment; under srun (one task per
rank, slurm/train.sbatch) from Slurm's (megaloop/parallel/launch.py). A plain `megaloop`
process is a world of one, with an in-memory store (no port to pick).
"""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megaloop.parallel import comm
from megaloop.parallel.launch import task_env

_peers: list = []
"""(host, pid) of every rank, gathered at init: who to look for when a collective fails."""


def init(
    seed: int, tp: int = 1, pp: int = 1, virtual_pp: int | None = None, timeout_s: float = 600.0
) -> None:
    """Process groups whose collectives give up after `timeout_s` (parallel.timeout_s), so the
    ranks of a run with a dead rank exit instead of waiting for it forever."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    task_env()
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        _peers[:] = comm.all_gather_object((socket.gethostname(), os.getpid()))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=virtual_pp,
            distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def is_collective_failure(error: BaseException) -> bool:
    """A collective or the rendezvous store failed: a peer died or timed out (gloo raises plain
    RuntimeErrors naming itself; torch's c10d raises DistError)."""
    text = str(error)
    return dist.is_initialized() and (
        isinstance(error, dist.DistError)
        or (
            isinstance(error, RuntimeError)
            and any(
                word in text
                for word in (
                    "gloo",
                    "Connection closed",
                    "Connection reset",
                    "NCCL",
                    "timed out",
                    "Timed out",
                )
            )
        )
    )


def _alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting for its parent has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def missing_ranks() -> str:
    """Which ranks are gone, as far as this host can tell (a process on another host can
    only be reported unchecked)."""
    host = socket.gethostname()
    gone, unchecked = [], []
    for rank, (rank_host, pid) in enumerate(_peers):
        if rank_host != host:
            unchecked.append(rank)
            continue
        if not _alive(pid):
            gone.append(f"rank {rank} (pid {pid})")
    text = (
        ", ".join(gone) + (" is gone" if len(gone) == 1 else " are gone")
        if gone
        else ("no rank on this host is gone")
    )
    if unchecked:
        text += f"; ranks on other hosts not checked: {unchecked}"
    return text


def shutdown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """The world this process belongs to (before or after init)."""
    if dist.is_initialized():
        return dist.get_world_size()
    task_env()
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class NonFiniteUpdate(RuntimeError):
    """An engine applied an update with non-finite gradients: the weights in memory are lost."""


def terms_finite(outputs: list[dict]) -> bool:
    """This rank's logged terms (losses, per-loop CE) are all finite: one device sync a step."""
    checks = [torch.isfinite(v).all() for o in outputs for v in o.values() if torch.is_tensor(v)]
    return not checks or bool(torch.stack(checks).all())


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
        local = {
            key: pool(key, torch.stack([o[key] for o in outputs]).double()) for key in outputs[0]
        }
    replicas = [g for g in comm.all_gather_object(local) if g is not None]
    return {
        key: pool(key, torch.tensor([r[key] for r in replicas], dtype=torch.float64))
        for key in replicas[0]
    }
