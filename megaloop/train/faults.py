"""Faults on demand, for tests and drills: set in the environment, each acts at a chosen step, so
a test never races the run it checks.

    MEGALOOP_TEST_HOLD_AT_STEP=N        after step N, wait until a preemption is requested
    MEGALOOP_TEST_PAUSE_AT_STEP=N       after step N, wait until RUN_DIR/CONTINUE exists (then
                                        remove it and go on: the run is as if never paused)
    MEGALOOP_TEST_NONFINITE_AT=N:K      during step N, loop K's hidden state becomes NaN
    MEGALOOP_TEST_NONFINITE_AT=N:grad   during step N, the gradients become inf (losses finite)
    MEGALOOP_TEST_FILE_LIMIT_AT=N:BYTES after step N, no file may grow past BYTES (a full disk:
                                        writes fail with EFBIG, as they would with ENOSPC)
"""

from __future__ import annotations

import os
import resource
import signal
import time
from contextlib import contextmanager

import torch

from megaloop.parallel import comm


def hold_at_step() -> int:
    return int(os.environ.get("MEGALOOP_TEST_HOLD_AT_STEP", -1))


def pause_at_step() -> int:
    return int(os.environ.get("MEGALOOP_TEST_PAUSE_AT_STEP", -1))


def pause(run_dir) -> None:
    """Wait until RUN_DIR/CONTINUE appears (rank 0 removes it)."""
    marker = run_dir / "CONTINUE"
    while not marker.exists():
        time.sleep(0.2)
    comm.barrier()
    if int(os.environ.get("RANK", 0)) == 0:
        marker.unlink()


def file_limit(step: int) -> None:
    """After the configured step, cap every file this process writes (SIGXFSZ ignored, so a
    write past the cap fails with an OSError instead of killing the process)."""
    at, _, size = os.environ.get("MEGALOOP_TEST_FILE_LIMIT_AT", "").partition(":")
    if at and int(at) == step:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (int(size), resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )


@contextmanager
def nonfinite(module, step: int):
    """Inject the configured fault into `module` (one rank's LoopedLM) while step `step` runs."""
    spec = os.environ.get("MEGALOOP_TEST_NONFINITE_AT", "")
    at, _, what = spec.partition(":")
    if not spec or int(at) != step:
        yield
        return
    hooks, poisoned = [], what != "grad" and module.post_process  # exits: the last stage
    if what == "grad":
        hooks = [p.register_hook(lambda g: g * float("inf")) for p in module.parameters()]
    elif poisoned:
        loop, exit_ = int(what), module.exit

        def exit_with_nan(out, h, k, *args, **kwargs):
            return exit_(out, h * float("nan") if k == loop else h, k, *args, **kwargs)

        module.exit = exit_with_nan
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        if poisoned:
            del module.exit


def first_nonfinite(record: dict) -> str:
    """What went non-finite in a step's logged record: the first loop's CE, or the gradients."""
    ce = record.get("ce") or []
    bad = [k for k, c in enumerate(ce, 1) if not torch.isfinite(torch.tensor(c))]
    if bad:
        return f"loop {bad[0]}'s loss (CE per loop: {', '.join(f'{c:.4g}' for c in ce)})"
    if not torch.isfinite(torch.tensor(record.get("loss", 0.0))):
        return "the loss"
    return f"the gradients (norm {record.get('grad_norm')})"
