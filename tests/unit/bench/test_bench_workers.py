"""bench/common/workers.py: a run trained in a worker that already trained another gives the
numbers of a fresh one-process run, bit for bit (the bench smokes and full runs rely on it), and
a failure comes back as an exit code or an error naming its log, not as a hung or dead bench."""

import contextlib
import os
import sys

import pytest
import torch

from bench.common import workers
from megaloop.parallel import distributed
from multiproc import BASE, OBJECTIVES, metrics, train_here
from support import TINY


@pytest.fixture
def one_worker(monkeypatch):
    monkeypatch.setattr(workers, "LANES", 1)
    monkeypatch.setattr(workers, "_pool", None)
    yield
    workers._pool.shutdown()


def records(run_dir) -> list:
    m = metrics(run_dir)
    return [(r["step"], r["loss"], r["hidden_rms"]) for r in m["steps"] + m["evals"]]


def fail(message: str) -> None:
    raise ValueError(message)


def speak(value):
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    os.write(2, b"straight to fd 2\n")  # as a library's C code or a child process writes
    return value


@contextlib.contextmanager
def worker_streams():
    """sys.stdout and sys.stderr writing to file descriptors 1 and 2, as in a worker process
    (pytest's capture sets its own at the start of a test's call, so a fixture's would not
    hold)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (open(fd, "w", closefd=False) for fd in (1, 2))  # noqa: SIM115
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.close()
        sys.stdout, sys.stderr = saved


def test_a_calls_stdout_and_stderr_reach_its_log(tmp_path):
    """What a worker does with one call, run here: its stdout and stderr (Python's and the file
    descriptor's), a raised error's traceback and a command's error line go into the log."""
    log = tmp_path / "call.log"
    with worker_streams():
        said = workers._run(speak, (3,), str(log))
    assert said == (True, 3)
    assert log.read_text() == "to stdout\nto stderr\nstraight to fd 2\n"
    with worker_streams():
        failed = workers._run(fail, ("no data",), str(log))
    assert failed == (False, "ValueError: no data")
    text = log.read_text()
    assert text.startswith("Traceback") and text.endswith("ValueError: no data\n")
    with worker_streams():
        code = workers._run(workers.command, (["train", TINY, "model.num_loops=0"],), str(log))
    assert code == (True, 2) and "megaloop: error: config key 'model.num_loops'" in log.read_text()


@pytest.mark.multiprocess
@pytest.mark.one_at_a_time  # one worker, then one process: never two busy at once
def test_a_run_in_a_used_worker_equals_a_one_process_run(tmp_path, one_worker):
    pid = workers.call(os.getpid)
    # the first run leaves what a run can leave behind: another objective, seed and dropout
    first = ["train", TINY, *BASE, f"train.dir={tmp_path / 'first'}", "train.seed=3"]
    first += [*OBJECTIVES["exit_weighted"], "model.dropout=0.1", "train.steps=4"]
    assert workers.megaloop(first, tmp_path / "first.log") == 0
    workers.call(distributed.init, 7)  # as a measurement does, which does not tear it down
    compared = [*OBJECTIVES["study"], "model.dropout=0.1", "train.seed=1"]
    argv = ["train", TINY, *BASE, f"train.dir={tmp_path / 'worker'}", *compared]
    assert workers.megaloop(argv, tmp_path / "worker.log") == 0
    assert workers.call(os.getpid) == pid, "both runs were to share one worker process"
    assert "valid_ce" in (tmp_path / "worker.log").read_text()  # its output went to its log

    train_here(tmp_path / "fresh", compared)  # equals a one-process torchrun run bit for bit
    assert records(tmp_path / "worker") == records(tmp_path / "fresh")
    assert len(records(tmp_path / "fresh")) > 10


@pytest.mark.multiprocess
@pytest.mark.one_at_a_time
def test_failures_come_back_as_exit_codes_and_errors(tmp_path, one_worker):
    log = tmp_path / "bad.log"
    assert workers.megaloop(["train", TINY, "model.num_loops=0"], log) == 2
    assert "model.num_loops" in log.read_text()
    with pytest.raises(RuntimeError, match=f"raised ValueError: no data; see {log}"):
        workers.call(fail, "no data", log=log)
    assert "Traceback" in log.read_text()
    assert workers.call(abs, -3) == 3  # the worker survived both
    assert workers.call(torch.get_num_threads) == 1  # two lanes, one core each
