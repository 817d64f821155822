"""Faults on demand, for tests and drills: callbacks that act at a chosen step, so a test never
races the run it checks. Production megaloop knows none of them; a test adds them to a trainer
it builds (`trainer.add_callback`), or runs this file in place of `python -m megaloop`: it
registers the faults its options name (megaloop.train.callbacks.register), then runs
megaloop.cli.main on the rest of its arguments. torchrun runs it as the worker script,
`megaloop slurm submit --launcher` in a job.

    python tests/faults.py [--hold-at-step N] [--pause-at-step N] [--nonfinite-at N:K|N:grad]
                           [--file-limit-at N:BYTES] train CONFIG key=value ...

    --hold-at-step N        after step N, wait until a preemption is requested
    --pause-at-step N       after step N, wait until RUN_DIR/CONTINUE exists (then remove it
                            and go on: the run is as if never paused)
    --nonfinite-at N:K      during step N, loop K's hidden state becomes NaN
    --nonfinite-at N:grad   during step N, the gradients become inf (losses finite)
    --file-limit-at N:BYTES after step N, no file may grow past BYTES (a full disk: writes fail
                            with EFBIG, as they would with ENOSPC)
"""

from __future__ import annotations

import argparse
import resource
import signal
import sys
import time
from pathlib import Path

from megaloop.train.callbacks import Callback, register

SCRIPT = str(Path(__file__).resolve())
"""What a subprocess runs in place of `-m megaloop`."""


class HoldAtStep(Callback):
    """After step `at`, wait until a preemption is requested (a signal or RUN_DIR/PREEMPT): the
    preemption then lands at that step, whatever the machine's speed."""

    def __init__(self, at: int):
        self.at = at

    def post_step(self, trainer, record: dict) -> None:
        from megaloop.train.preemption import PreemptionCheck

        if trainer.step == self.at:
            watch = next(c for c in trainer.callbacks if isinstance(c, PreemptionCheck)).watch
            while not watch.requested():
                time.sleep(0.2)


class PauseAtStep(Callback):
    """After step `at`, wait until RUN_DIR/CONTINUE appears (rank 0 removes it)."""

    def __init__(self, at: int):
        self.at = at

    def post_step(self, trainer, record: dict) -> None:
        if trainer.step != self.at:
            return
        from megaloop.parallel import comm

        marker = trainer.run_dir / "CONTINUE"
        while not marker.exists():
            time.sleep(0.2)
        comm.barrier()
        if trainer.is_main:
            marker.unlink()


class FileLimitAt(Callback):
    """After step `at`, cap every file this process writes at `size` bytes (SIGXFSZ ignored,
    so a write past the cap fails with an OSError instead of killing the process)."""

    def __init__(self, at: int, size: int):
        self.at, self.size = at, size

    def post_step(self, trainer, record: dict) -> None:
        if trainer.step == self.at:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.size, hard))


class NonFiniteAt(Callback):
    """During step `at`, loop `what`'s hidden state becomes NaN (on the last pipeline stage,
    which computes the exits), or with what="grad" every gradient becomes inf."""

    def __init__(self, at: int, what: str):
        self.at, self.what = at, what
        self.hooks, self.module = [], None

    def pre_step(self, trainer) -> None:
        if trainer.step + 1 != self.at:
            return
        module = trainer.engine.module
        if self.what == "grad":
            self.hooks = [p.register_hook(lambda g: g * float("inf")) for p in module.parameters()]
        elif module.post_process:
            loop, exit_ = int(self.what), module.exit

            def exit_with_nan(out, h, k, *args, **kwargs):
                return exit_(out, h * float("nan") if k == loop else h, k, *args, **kwargs)

            module.exit, self.module = exit_with_nan, module

    def post_batch(self, trainer) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.module is not None:
            del self.module.exit
            self.module = None

    close = post_batch


def step_and(value: str) -> tuple[int, str]:
    at, sep, rest = value.partition(":")
    if not (sep and at.isdigit() and rest):
        raise argparse.ArgumentTypeError(f"{value!r}: give STEP:VALUE, e.g. 3:2")
    return int(at), rest


def parse(argv: list[str]) -> tuple[list[Callback], list[str]]:
    """The faults named by the leading options, and the arguments left for megaloop."""
    p = argparse.ArgumentParser(prog="tests/faults.py", description=__doc__.splitlines()[0])
    p.add_argument("--hold-at-step", type=int)
    p.add_argument("--pause-at-step", type=int)
    p.add_argument("--nonfinite-at", type=step_and)
    p.add_argument("--file-limit-at", type=step_and)
    p.add_argument("megaloop", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    faults: list[Callback] = []
    if args.hold_at_step is not None:
        faults.append(HoldAtStep(args.hold_at_step))
    if args.pause_at_step is not None:
        faults.append(PauseAtStep(args.pause_at_step))
    if args.nonfinite_at is not None:
        faults.append(NonFiniteAt(*args.nonfinite_at))
    if args.file_limit_at is not None:
        at, size = args.file_limit_at
        faults.append(FileLimitAt(at, int(size)))
    return faults, args.megaloop


def main(argv: list[str]) -> int:
    faults, rest = parse(argv)
    for fault in faults:
        register(fault)
    from megaloop.cli import main as megaloop_main

    return megaloop_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
