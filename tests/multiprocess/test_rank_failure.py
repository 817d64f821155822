"""A dead rank: kill -9 of one rank of a TP2 x PP2 run started as bare processes with the
environment srun gives its tasks (as slurm/train.sbatch runs them; no torchrun agent to stop
the others). Every other rank exits non-zero long before parallel.timeout_s, says which rank is
gone, and a relaunch resumes from the newest complete checkpoint with the losses of the
session's uninterrupted one-process run."""

import os
import signal
import subprocess
import sys
import time

import pytest

from faults import SCRIPT as FAULTS
from multiproc import (
    BASE,
    OBJECTIVES,
    TINY,
    assert_same_curve,
    env,
    free_port,
    metrics,
    stop_groups,
    wait_for_step,
)

pytestmark = pytest.mark.multiprocess

# Why the bound proves the claim whatever the machine's speed: parallel.timeout_s is set far
# above any time the detection can take. The held ranks start a fresh collective every 0.2 s
# (the preemption poll at the held step), so one that gave up only when its collective timed
# out would run for about TIMEOUT_S after the kill, and no machine exits a timeout early.
# An exit within DETECTED_S (a fifth of it) can therefore only come from gloo reporting rank
# 3's closed connection; DETECTED_S is generous for a slow, loaded machine (measured: under 5 s
# on 2 shared cores). (It was 60 s against a timeout of 60 s: the two paths apart by nothing.)
TIMEOUT_S, DETECTED_S = 600, 120
LAYOUT = ["parallel.tp=2", "parallel.pp=2", "train.save_every=4", f"parallel.timeout_s={TIMEOUT_S}"]
OBJECTIVE = "exit_weighted"  # the session's one-process run of it is the uninterrupted curve
REL = 1e-5  # TP2 x PP2 against one process (tests/multiprocess/test_parallel.py's tolerance)


def srun_tasks(run_dir, faults: list[str]) -> list[subprocess.Popen]:
    """Four tasks as srun starts them: SLURM_PROCID/NTASKS/LOCALID, and the job script's
    MASTER_ADDR/PORT (with `faults`, through tests/faults.py)."""
    port = free_port()
    procs = []
    for rank in range(4):
        task = {
            **env(),
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            task.pop(key, None)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    *([FAULTS, *faults] if faults else ["-m", "megaloop"]),
                    "train",
                    TINY,
                    *BASE,
                    *OBJECTIVES[OBJECTIVE],
                    *LAYOUT,
                    f"train.dir={run_dir}",
                ],
                env=task,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a group per task, as Slurm's cgroup: see stop_groups
            )
        )
    return procs


def test_a_dead_rank_stops_the_others_and_the_relaunch_resumes(tmp_path, reference_run):
    _, reference = reference_run(OBJECTIVE)
    run_dir = tmp_path / "run"
    # the ranks wait at step 5 (the hold-at-step fault): step 4 is the newest checkpoint
    procs = srun_tasks(run_dir, ["--hold-at-step", "5"])
    try:
        wait_for_step(run_dir, 5, procs[0])
        dead = procs[3]
        os.kill(dead.pid, signal.SIGKILL)
        killed = time.monotonic()
        try:  # the ranks run concurrently: this waits for the last of them, at most DETECTED_S
            outputs = [p.communicate(timeout=DETECTED_S) for p in procs[:3]]
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"a rank still ran {DETECTED_S} s after rank 3 was killed: the closed "
                f"connection went unnoticed (parallel.timeout_s={TIMEOUT_S})"
            )
        exited_within = time.monotonic() - killed
    finally:
        stop_groups(procs)
    assert exited_within < DETECTED_S, exited_within  # see TIMEOUT_S, DETECTED_S above
    for p, (_, err) in zip(procs[:3], outputs, strict=True):
        assert p.returncode not in (0, 65, 75), err[-2000:]
        assert f"rank 3 (pid {dead.pid}) is gone" in err, err[-2000:]
        assert "a collective failed" in err and "Traceback" not in err
        failure = next(line for line in err.splitlines() if "a collective failed" in line)
        assert "timed out" not in failure.lower(), failure  # the connection, not the timeout
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_0000004"

    relaunch = srun_tasks(run_dir, [])
    try:
        outs = [p.communicate(timeout=300) for p in relaunch]
    finally:
        stop_groups(relaunch)
    assert all(p.returncode == 0 for p in relaunch), outs[0][1][-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_0000004" in outs[0][0]
    # metrics() also fails on any non-finite loss
    assert_same_curve(metrics(run_dir), reference, REL, steps=range(5, 11))
