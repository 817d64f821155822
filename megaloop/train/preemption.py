"""Preemption: SIGTERM or SIGUSR1 (Slurm's warning signal) asks the trainer to finish the
current step, save a checkpoint and exit with EXIT_PREEMPTED, which a job script turns into a
requeue; the next start resumes from that checkpoint."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"


class Preempted(Exception):
    """Raised after the preemption checkpoint is written."""


class PreemptionWatch:
    def __init__(self):
        self._signal = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self._signal = signum

    def requested(self) -> bool:
        """Collective: true on every rank if any rank was signalled."""
        flag = torch.tensor([self._signal], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
