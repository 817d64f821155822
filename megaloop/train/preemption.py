"""Preemption: SIGTERM or SIGUSR1 (Slurm's warning signal), or a `PREEMPT` file in the run
directory, asks the trainer to finish the current step, save a checkpoint and exit with
EXIT_PREEMPTED, which a job script turns into a requeue; the next start resumes from there.

The file is how slurm/train.sbatch passes on the warning signal its shell receives: unlike a
signal, it cannot arrive before a rank has installed its handler."""

from __future__ import annotations

import signal
from pathlib import Path

from megaloop.parallel import comm

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"


class Preempted(Exception):
    """Raised after the preemption checkpoint is written."""


class PreemptionWatch:
    def __init__(self, stop_file: Path | None = None):
        self.stop_file = stop_file
        self._signal = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self._signal = signum

    def requested(self) -> bool:
        """Collective: true on every rank if any rank was signalled."""
        asked = self._signal or (self.stop_file is not None and self.stop_file.exists())
        return comm.any_rank(bool(asked))
