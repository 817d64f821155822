"""Two long-lived worker processes that run a bench's training runs and measurements in-process.

A bench grid is many short runs; started one process a run, each paid the import of torch and
megatron-core again (about 5 s of CPU here, more than a toy run trains). The two workers pay it
once, run one thing at a time with one thread each (two cores, two lanes) and leave nothing
behind between calls: the world of each run is torn down as `megaloop train` tears it down.
A run gives the same numbers here as a one-process run, bit for bit
(tests/unit/bench/test_bench_workers.py).

The bench hands its workers its own arguments and gets back plain values: nothing read from a
file crosses the pipe.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import threading
import traceback
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from bench import common

LANES = 2
ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

_pool: ProcessPoolExecutor | None = None
_lock = threading.Lock()


def megaloop(argv: list, log: Path | None = None) -> int:
    """`python -m megaloop ARGV` in a worker, its output into `log` (stdout dropped without
    one): the command's exit code, 1 (with the traceback in the log) where it raised."""
    return call(command, [str(a) for a in argv], log=log)


def each(fn, items) -> list:
    """`fn` of every item, two at a time (a lane each): the benches' grid of runs and of
    measurements, each `fn` handing its run to a worker (`megaloop`, `call`)."""
    with ThreadPoolExecutor(LANES) as pool:
        return list(pool.map(fn, items))


def call(fn, *args, log: Path | None = None):
    """fn(*args) in a worker (fn defined at a module's top level): its value. Its output goes
    into `log`; without one stdout is dropped and stderr is the bench's. What fn raises is
    raised here as a RuntimeError, its traceback written where stderr goes."""
    try:
        future = _workers().submit(_run, fn, args, None if log is None else str(log))
        ok, value = future.result()
    except BrokenProcessPool as e:
        raise SystemExit(
            f"bench: a worker process died running {fn.__name__}{args}; rerun the bench "
            f"(finished runs are kept)"
        ) from e
    if not ok:
        raise RuntimeError(
            f"bench: {fn.__name__}{args} raised {value}" + (f"; see {log}" if log else "")
        )
    return value


def _workers() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
            context.set_executable(os.environ.get("PYTHON", sys.executable))
            _pool = ProcessPoolExecutor(
                LANES, mp_context=context, initializer=_start, initargs=(common.SMOKE,)
            )
            atexit.register(_pool.shutdown)
        return _pool


def _start(smoke: bool) -> None:
    """Before a worker imports a bench: its sizes are read from SMOKE at import, as here."""
    common.SMOKE = smoke
    os.environ.update(ENV)
    import torch

    torch.set_num_threads(1)


def command(argv: list[str]) -> int:
    """`megaloop ARGV` in this process (a worker): its exit code, 1 where it raised."""
    from megaloop.cli import main

    try:
        return main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except Exception:
        traceback.print_exc()
        return 1


def _run(fn, args: tuple, log: str | None) -> tuple[bool, object]:
    sys.stdout.flush()
    sys.stderr.flush()
    fds = (1, 2) if log else (1,)
    saved = [os.dup(fd) for fd in fds]
    out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd in fds:
        os.dup2(out, fd)
    os.close(out)
    try:
        return True, fn(*args)
    except (Exception, SystemExit) as e:
        traceback.print_exc()
        return False, f"{type(e).__name__}: {e}"
    finally:
        if "megaloop.parallel.distributed" in sys.modules:
            from megaloop.parallel import distributed

            distributed.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip(fds, saved):
            os.dup2(copy, fd)
            os.close(copy)
