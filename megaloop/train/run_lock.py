"""One writer per run directory. Rank 0 holds an exclusive lock on RUN_DIR/.lock for the life of
the run; a second run on the same directory (a manual relaunch over a live Slurm job, two sweep
workers given one seed) stops before any compute, naming the holder. The lock is the kernel's
(flock), so it goes when its process does: kill -9, an OOM kill or a lost node leave nothing to
clean by hand, and a requeued job or a relaunch after a crash proceeds.

On a shared filesystem flock must reach every node: NFSv4 and Lustre mounted with `flock` do;
where the filesystem refuses locks the run says so and goes on unguarded.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from megaloop.config import ConfigError

LOCK = ".lock"
_held: dict[Path, int] = {}
"""This process's locks, by resolved run directory (an in-process rerun reuses its own)."""


def _close_in_forked_child() -> None:
    """A forked child (megatron-core's checkpoint writers are forks) drops its copies: flock
    belongs to the open file, so a copy would hold the lock past this process's release, or its
    kill -9."""
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


class RunDirBusy(ConfigError):
    """Another live run holds the run directory."""


def hold(run_dir: Path, probe_only: bool = False) -> None:
    """Rank 0 takes the lock (`probe_only`: only checks that no live run holds it, as a dry run
    does, creating and writing nothing); every rank stops if it could not (collective), before
    anything is read or written in the run directory."""
    from megaloop.parallel import comm, distributed

    busy = None
    if distributed.is_main():
        try:
            (probe if probe_only else acquire)(run_dir)
        except RunDirBusy as e:
            busy = e
    if comm.any_rank(busy is not None):
        raise busy or RunDirBusy(f"train.dir={run_dir} is in use by another run (rank 0 names it)")


def acquire(run_dir: Path) -> None:
    """Hold RUN_DIR/.lock until this process ends (or `release`); RunDirBusy if another holds
    it. The holder's host, pid, start time and Slurm job are written into the file."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            holder = _holder(fd)
            os.close(fd)
            raise _busy(run_dir, holder) from None
        os.close(fd)
        print(
            f"megaloop: warning: {run_dir} cannot be locked ({e.strerror}: the filesystem "
            f"refuses flock); nothing stops a second run from writing into it",
            file=sys.stderr,
        )
        return
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held[run_dir] = fd


def probe(run_dir: Path) -> None:
    """RunDirBusy if a live run holds RUN_DIR/.lock. The lock file is only opened for reading
    and a shared lock taken for an instant, so the directory is left exactly as it was."""
    run_dir = Path(run_dir).resolve()
    lock = run_dir / LOCK
    if run_dir in _held or not lock.is_file():
        return
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise _busy(run_dir, _holder(fd)) from None
    finally:
        os.close(fd)


def _busy(run_dir: Path, holder: str) -> RunDirBusy:
    return RunDirBusy(
        f"train.dir={run_dir} is in use by another run ({holder}); two runs writing "
        f"one directory would mix their checkpoints and metrics. Wait for it to end, "
        f"stop it (its checkpoints stay and a relaunch resumes from them), or give "
        f"this run another train.dir"
    )


def release(run_dir: Path) -> None:
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, OSError):
        info = {}
    if not info:
        return "holder not yet recorded: it is starting"
    job = f", Slurm job {info['slurm_job']}" if info.get("slurm_job") else ""
    return f"pid {info.get('pid')} on {info.get('host')}{job}, since {info.get('since')}"
