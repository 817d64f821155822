"""Preemption: SIGTERM or SIGUSR1 (Slurm's warning signal), or a `PREEMPT` file in the run
directory, asks the trainer to finish the current step, save a checkpoint and exit with
EXIT_PREEMPTED, which a job script turns into a requeue; the next start resumes from there.

Ctrl-C (SIGINT) is the same request: the first finishes the step, saves and exits 75; a second
one, more than INTERRUPT_ECHO_S later, aborts at once (no checkpoint of that step). Under
torchrun every rank gets the terminal's SIGINT and then the launcher's copy of it; the window
keeps the copy from counting as a second press. torchrun kills its workers 30 s after it
forwards a signal, so a longer save is cut short there (the previous checkpoint stays).

The file is how slurm/train.sbatch passes on the warning signal its shell receives: unlike a
signal, it cannot arrive before a rank has installed its handler."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from megaloop.parallel import comm
from megaloop.train.callbacks import Callback

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"


class Preempted(Exception):
    """Raised after the preemption checkpoint is written."""


INTERRUPT_ECHO_S = 2.0


class PreemptionWatch:
    def __init__(self, stop_file: Path | None = None, announce: bool = True):
        self.stop_file = stop_file
        self.announce = announce
        self._signal = 0
        self._interrupted_at: float | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)
        signal.signal(signal.SIGINT, self._interrupt)

    def _handler(self, signum, frame) -> None:
        self._signal = signum

    def _interrupt(self, signum, frame) -> None:
        now = time.monotonic()
        if self._interrupted_at is None:
            self._interrupted_at, self._signal = now, signum
            if self.announce:
                print(
                    "\nmegaloop: Ctrl-C: finishing this step, saving a checkpoint and stopping "
                    "(exit 75); press Ctrl-C again to abort at once",
                    file=sys.stderr,
                    flush=True,
                )
        elif now - self._interrupted_at > INTERRUPT_ECHO_S:
            raise KeyboardInterrupt

    @property
    def reason(self) -> str:
        if self._signal:
            return "Ctrl-C" if self._signal == signal.SIGINT else signal.Signals(self._signal).name
        return "a PREEMPT file or another rank's signal"

    def requested(self) -> bool:
        """Collective: true on every rank if any rank was signalled."""
        asked = self._signal or (self.stop_file is not None and self.stop_file.exists())
        return comm.any_rank(bool(asked))


class PreemptionCheck(Callback):
    """After each step, on every rank alike: if a preemption was asked for, save and raise
    Preempted. It runs after the other per-step callbacks and before the cadence save."""

    priority = -80

    def pre_train(self, trainer) -> None:
        self.watch = PreemptionWatch(trainer.run_dir / "PREEMPT", announce=trainer.is_main)

    def post_step(self, trainer, record: dict) -> None:
        if self.watch.requested():
            trainer.save()
            if trainer.log_enabled:
                (trainer.run_dir / "PREEMPT").unlink(missing_ok=True)
            raise Preempted(
                f"preempted at step {trainer.step} ({self.watch.reason}); checkpoint saved"
            )
