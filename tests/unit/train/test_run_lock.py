"""The run directory's lock (megaloop/train/run_lock.py) in one process; two processes in
tests/multiprocess/test_long_runs.py."""

import multiprocessing

from megaloop.train import run_lock


def _started_then_wait(started, done) -> None:
    started.set()
    done.wait(60)


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """flock belongs to the open file, so a forked child's copy of the descriptor (megatron-core's
    checkpoint writers are forks) would hold the lock past the run's
    release, or past a kill -9 of the run."""
    fork = multiprocessing.get_context("fork")
    run_lock.acquire(tmp_path)
    started, done = fork.Event(), fork.Event()
    child = fork.Process(target=_started_then_wait, args=(started, done))
    child.start()
    try:
        assert started.wait(60)
        run_lock.release(tmp_path)
        run_lock.probe(tmp_path)  # RunDirBusy while any copy holds it
        run_lock.acquire(tmp_path)
    finally:
        run_lock.release(tmp_path)
        done.set()
        child.join(timeout=60)
    assert child.exitcode == 0
