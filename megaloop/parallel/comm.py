"""megaloop's own collectives (megatron-core and DeepSpeed run theirs): the one place that
decides the device of a tensor handed to torch.distributed.

NCCL, the backend on GPUs, takes CUDA tensors of the rank's own device; gloo takes CPU tensors.
A tensor built anywhere else and handed to a collective passes every CPU test and kills a GPU
run at its first step, so every collective of megaloop goes through here
(tests/unit/parallel/test_comm.py checks the package's source for any other). Without a process
group (one process, no init) each is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def device() -> torch.device:
    """Where a tensor for a collective of the default process group must live."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any. No shortcut for a world of one: a one-GPU
    run then exercises the same NCCL path as many GPUs (bench/gpu.sh)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def barrier() -> None:
    if dist.is_initialized():
        cuda = device().type == "cuda"
        dist.barrier(device_ids=[torch.cuda.current_device()] if cuda else None)


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank (pickled by torch.distributed: only between our own
    ranks, never from a file)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
