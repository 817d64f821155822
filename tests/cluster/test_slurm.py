"""Slurm jobs: the launcher's checks, and real jobs on a local cluster (slurm/local/up.sh):
DP=2 training across two nodes, a time limit that requeues a run from its checkpoint, and a
datatrove prep job array."""

import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from faults import SCRIPT as FAULTS
from megaloop import slurm
from megaloop.parallel.launch import LaunchError, task_env
from multiproc import BASE
from multiproc import metrics as read_metrics
from support import ROOT, TINY, article, megaloop

# -- without a cluster --------------------------------------------------------------------------


def srun_env(**kw) -> dict:
    return {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        **kw,
    }


def test_ranks_come_from_the_slurm_task_environment():
    env = srun_env()
    task_env(env)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("3", "1", "4")
    torchrun = srun_env(RANK="0", WORLD_SIZE="2")  # torchrun under srun: torchrun's values
    task_env(torchrun)
    assert (torchrun["RANK"], torchrun["WORLD_SIZE"]) == ("0", "2")
    batch_shell = {k: v for k, v in srun_env().items() if k != "SLURM_STEP_ID"}
    task_env(batch_shell)
    assert "RANK" not in batch_shell


@pytest.mark.parametrize(
    "env, message",
    [
        (srun_env(MASTER_ADDR=""), "MASTER_ADDR not set for a 4-task srun step"),
        ({k: v for k, v in srun_env().items() if k != "MASTER_PORT"}, "MASTER_PORT not set"),
        (srun_env(SLURM_PROCID="4"), "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
        ({k: v for k, v in srun_env().items() if k != "SLURM_NTASKS"}, "'SLURM_NTASKS'"),
    ],
)
def test_inconsistent_slurm_environments_are_named(env, message):
    with pytest.raises(LaunchError, match=message):
        task_env(env)


def test_a_rank_without_master_address_fails_in_one_line():
    task = srun_env(MASTER_ADDR="", SLURM_PROCID="0", SLURM_NTASKS="2")
    proc = megaloop("train", TINY, *BASE, extra_env={"RANK": None, "WORLD_SIZE": None, **task})
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("megaloop: error: MASTER_ADDR not set for a 2-task srun step")
    )


@pytest.mark.parametrize(
    "time_limit, seconds",
    [("30", 1800), ("5:30", 330), ("2:00:00", 7200), ("1-12", 129600), ("2-00:00:00", 172800)],
)
def test_slurm_time_formats(time_limit, seconds):
    assert slurm.time_limit_seconds(time_limit) == seconds


def submit_1p4b(capsys, *args) -> SimpleNamespace:
    """`megaloop slurm submit` of the 1.4B config on 16 nodes x 8 GPUs, in this process."""
    from megaloop.cli import main

    rc = main(
        [
            "slurm",
            "submit",
            str(ROOT / "configs/experiments/fineweb/1p4b_42b_tokens.yaml"),
            "--nodes",
            "16",
            "--gpus-per-node",
            "8",
            *args,
        ]
    )
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def test_dry_run_of_the_1p4b_run_on_16_nodes_of_8_gpus(capsys):
    proc = submit_1p4b(capsys, "--partition", "gpu", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    for line in (
        "#SBATCH --nodes=16",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@300",
        "parallel.tp=2 parallel.pp=1",
        'scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in script
    assert "{{" not in script
    # K=4 loops of 24 layers at 4,096 tokens: ~66 GiB of activations per sequence (`megaloop
    # plan`), so without recompute even 80 GiB GPUs need TP=2; with it, DP alone fits
    assert "layout: TP=2 PP=1 DP=64" in proc.stderr
    full = submit_1p4b(capsys, "--gpu-mem", "24", "--dry-run", "train.recompute=full")
    assert full.returncode == 0, full.stderr
    assert "layout: TP=1 PP=1 DP=128" in full.stderr
    small = submit_1p4b(capsys, "--gpu-mem", "16", "--dry-run", "train.recompute=full")
    assert "layout: TP=2 PP=1 DP=64" in small.stderr
    explicit = submit_1p4b(capsys, "--dry-run", "parallel.tp=2", "parallel.pp=2")
    assert "layout: TP=2 PP=2 DP=32" in explicit.stderr and "given on the command line" in (
        explicit.stderr
    )


def test_program_is_what_each_rank_runs(capsys):
    default = submit_1p4b(capsys, "--dry-run")
    assert f'srun --kill-on-bad-exit=1 {sys.executable} -m megaloop train "${{RUN[@]}}"' in (
        default.stdout
    )
    wrapped = submit_1p4b(capsys, "--dry-run", "--program", "apptainer exec 'my image.sif' ml")
    assert wrapped.returncode == 0, wrapped.stderr
    line = "srun --kill-on-bad-exit=1 apptainer exec 'my image.sif' ml train \"${RUN[@]}\""
    assert line in wrapped.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--time", "1", "--warning-seconds", "60"], "--warning-seconds 60 must lie in [1, 60)"),
        (["--time", "soon"], "--time 'soon'"),
        (["--gpu-mem", "1"], "nothing fits 1 GiB per GPU: the closest is"),
        (["--tasks-per-node", "4"], "--tasks-per-node 4 with --gpus-per-node 8"),
        (["--cpus-per-task", "0"], "--cpus-per-task must be >= 1"),
        (["--program", "'python -m megaloop"], '--program "\'python -m megaloop": No closing'),
        (["--program", " "], "--program is empty"),
    ],
)
def test_bad_job_requests_fail_before_submitting(capsys, args, message):
    proc = submit_1p4b(capsys, *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "submitted" not in proc.stdout


# -- a real local cluster -----------------------------------------------------------------------

SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two emulated nodes, n1 and n2; always torn down (by pid files), also when a test fails."""
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    if missing:
        if os.environ.get("MEGALOOP_REQUIRE_SLURM"):
            pytest.fail(f"{', '.join(missing)} not installed (make test installs Slurm)")
        pytest.skip(f"Slurm not installed ({', '.join(missing)}); `make test` installs it")
    state = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(
        [ROOT / "slurm/local/up.sh", state], capture_output=True, text=True, timeout=60
    )
    assert up.returncode == 0, up.stderr
    env = {
        **os.environ,
        "SLURM_CONF": str(state / "slurm.conf"),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
    }
    try:
        yield env
    finally:
        subprocess.run([ROOT / "slurm/local/down.sh", state], timeout=60)


def job_state(env, job_id: str) -> dict:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, env=env
    ).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_job(env, job_id: str, timeout: float) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = job_state(env, job_id)
        if state.get("JobState") in (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "BOOT_FAIL",
            "DEADLINE",
        ):
            return state
        time.sleep(1)
    pytest.fail(f"job {job_id} still {job_state(env, job_id).get('JobState')} after {timeout} s")


def wait_queue_empty(env, timeout: float, name: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not subprocess.run(
            ["squeue", "-h", "--name", name], capture_output=True, text=True, env=env
        ).stdout.strip():
            return
        time.sleep(1)
    pytest.fail(f"jobs still queued after {timeout} s")


LAST = 100
"""Each training job's steps: the loss falls by more than 1 nat by then (5.5 to 2.8). The time
limit lands while attempt 0 waits at step 50 (limit_while_held), not at a step count that
outlasts slurmctld's 30 s checks: these jobs' ranks share the cores with the tests beside them."""
STEPS = [f"train.steps={LAST}", f"train.save_every={LAST}", "train.log_every=10"]


def submit(env, run_dir: Path, *args) -> str:
    proc = megaloop(
        "slurm",
        "submit",
        TINY,
        "--nodes",
        "2",
        "--tasks-per-node",
        "1",
        "--gpus-per-node",
        "0",
        *args,
        *BASE,
        *STEPS,
        f"train.dir={run_dir}",
        extra_env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "TP=1 PP=1 DP=2" in proc.stdout
    return proc.stdout.split("submitted job ")[1].split(";")[0]


def logs(run_dir: Path) -> str:
    return "\n".join(
        f"== {p.name}\n{p.read_text()}" for p in sorted((run_dir / "logs").glob("attempt-*.log"))
    )


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Everything the tests below check, submitted at once as a cluster's users would: the same
    training run twice (uninterrupted, and with a time limit that lands while it waits at step
    50; each node has a CPU for each), and a prep job array that starts when CPUs free up."""
    uninterrupted, limited, prep, swept = (
        tmp_path_factory.mktemp(name) for name in ("uninterrupted", "limited", "prep", "sweep")
    )
    limited_job = submit(
        cluster,
        limited,
        "--time",
        "10",
        "--warning-seconds",
        "10",
        "--program",
        f"{sys.executable} {FAULTS} --hold-at-step 50",
    )
    clock = threading.Thread(
        target=limit_while_held, args=(cluster, limited_job, limited, 50), daemon=True
    )
    clock.start()
    return {
        "uninterrupted": (uninterrupted, submit(cluster, uninterrupted, "--time", "10")),
        "limited": (limited, limited_job),
        "limited_clock": clock,
        "prep": (prep, submit_prep(cluster, prep)),
        "sweep": (swept, submit_sweep(cluster, swept)),
    }


CLOCK_ERRORS: list[str] = []


def limit_while_held(env, job: str, run_dir: Path, step: int) -> None:
    """A time limit that lands mid-run however fast the machine is: attempt 0 waits at `step`
    for the warning signal (a test hook); only then is the job's limit cut to end about a
    minute later, and once the job has requeued it gets 10 minutes again, so no attempt races
    the clock."""
    from megaloop.train.metrics import read

    def scontrol_update(minutes: int) -> None:
        cmd = ["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr}")

    try:
        end = time.monotonic() + 900
        while not any(r["step"] == step for r in (read(run_dir) or {"steps": []})["steps"]):
            if time.monotonic() > end:
                raise RuntimeError(f"attempt 0 never reached step {step}")
            time.sleep(0.2)
        run_time = [int(x) for x in job_state(env, job)["RunTime"].split("-")[-1].split(":")]
        elapsed = run_time[0] * 3600 + run_time[1] * 60 + run_time[2]
        scontrol_update(-(-(elapsed + 30) // 60))  # at least 30 s ahead: the warning is 10 s
        first = run_dir / "logs/attempt-0.log"
        while not (first.is_file() and "requeueing" in first.read_text()):
            if time.monotonic() > end:
                raise RuntimeError("attempt 0 did not requeue")
            time.sleep(0.2)
        scontrol_update(10)
    except Exception as e:  # the test names it
        CLOCK_ERRORS.append(repr(e))


@pytest.fixture(scope="module")
def uninterrupted(cluster, jobs):
    run_dir, job = jobs["uninterrupted"]
    state = wait_job(cluster, job, timeout=240)
    assert state["JobState"] == "COMPLETED", logs(run_dir)
    return run_dir, state


def metrics(run_dir: Path) -> dict:
    return read_metrics(run_dir)


@pytest.mark.slurm
def test_training_job_runs_dp2_across_two_nodes(uninterrupted):
    run_dir, state = uninterrupted
    assert state["NodeList"] == "n[1-2]" and state["NumTasks"] == "2"
    assert state["Restarts"] == "0"
    log = (run_dir / "logs/attempt-0.log").read_text()
    assert "2 ranks on n[1-2], master 127.0.0.1:" in log
    assert "attempt 0 ended with 0" in log
    m = metrics(run_dir)
    assert m["layout"]["dp"] == 2
    assert [s["step"] for s in m["steps"]][-1] == LAST
    assert m["steps"][-1]["loss"] < m["steps"][0]["loss"] - 1.0
    assert m["evals"][-1]["step"] == LAST
    latest = (run_dir / "checkpoints/latest").read_text().strip()
    assert latest.endswith(f"step_{LAST:07d}")
    assert (run_dir / f"checkpoints/step_{LAST:07d}/manifest.json").is_file()


@pytest.mark.slurm
def test_time_limit_requeues_and_finishes_from_the_checkpoint(cluster, jobs, uninterrupted):
    tmp_path, job = jobs["limited"]
    state = wait_job(cluster, job, timeout=900)
    jobs["limited_clock"].join(timeout=60)
    assert not CLOCK_ERRORS, CLOCK_ERRORS
    assert state["JobState"] == "COMPLETED", logs(tmp_path)
    assert int(state["Restarts"]) >= 1, logs(tmp_path)
    first = (tmp_path / "logs/attempt-0.log").read_text()
    assert "USR1: time limit near" in first and "requeueing" in first
    preempted = int(first.split("preempted at step ")[1].split()[0])
    assert preempted == 50
    resumed = (tmp_path / "logs/attempt-1.log").read_text()
    assert f"resumed from {tmp_path}/checkpoints/step_{preempted:07d}" in resumed
    final = logs(tmp_path).rsplit("== ", 1)[1]
    assert final.startswith("attempt-1.log") and "ended with 0" in final  # 10 minutes: enough
    reference, got = metrics(uninterrupted[0]), metrics(tmp_path)
    assert got["steps"][-1]["step"] == LAST
    assert got["steps"][-1]["loss"] == reference["steps"][-1]["loss"]
    assert got["evals"][-1]["ce"] == reference["evals"][-1]["ce"]


SWEEP = [
    "sweep",
    TINY,
    "--seeds",
    "0,1",
    "--executor",
    "slurm",
    "--nodes",
    "1",
    "--gpus-per-node",
    "0",
    "--job-name",
    "test-sweep",
    "--time",
    "10",
    *BASE,
    "train.steps=4",
    "train.save_every=2",
]


def submit_sweep(env, root: Path) -> str:
    """`megaloop sweep` of the tiny config over seeds 0 and 1 as one job array."""
    proc = megaloop(*SWEEP, extra_env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert "2 run(s), one per array task" in proc.stdout
    return proc.stdout.split("submitted job ")[1].split(":")[0]


@pytest.mark.slurm
def test_sweep_is_one_job_array_and_skips_what_it_finished(cluster, jobs):
    root, job = jobs["sweep"]
    script = next((root / "runs/sweep-logs").glob("sweep-*.sbatch")).read_text()
    assert "#SBATCH --array=0-1" in script and script.count("train.seed=") == 2
    wait_queue_empty(cluster, timeout=420, name="test-sweep")
    for seed in (0, 1):
        run_dir = root / f"runs/tiny/seed{seed}"
        m = metrics(run_dir)
        assert m["config"]["train"]["seed"] == seed and m["evals"][-1]["step"] == 4, logs(run_dir)
        assert all(np.isfinite(r["loss"]) for r in m["steps"])
        assert "ended with 0" in (run_dir / "logs/attempt-0.log").read_text()
    again = megaloop(*SWEEP, extra_env=cluster, cwd=root)
    assert again.returncode == 0 and "all 2 runs are finished" in again.stdout, again.stderr


def submit_prep(env, root: Path) -> list:
    """A datatrove job array over two JSONL files; returns the command (run it again when the
    array is done to write the manifest)."""
    from data_prep.common import train_bpe

    rng = random.Random(5)
    source = root / "source"
    source.mkdir()
    for i in range(2):
        with open(source / f"part{i}.jsonl", "w") as f:
            for _ in range(6):
                f.write(json.dumps({"text": article(rng, 3)}) + "\n")
    tokenizer = train_bpe([article(rng) for _ in range(20)], 300, root / "tok.json")
    command = [
        "prep",
        "fineweb",
        "--source",
        str(source),
        "--tokenizer",
        str(tokenizer),
        "--seq-len",
        "64",
        "--shard-size",
        "16",
        "--out",
        str(root / "slurm"),
        "--executor",
        "slurm",
        "--partition",
        "debug",
        "--workers",
        "2",
        "--job-name",
        "test-prep",
    ]
    submitted = megaloop(*command, extra_env=env)
    assert submitted.returncode == 0, submitted.stderr
    assert "run the same command again when they are done" in submitted.stdout
    return command


@pytest.mark.slurm
def test_datatrove_prep_job_array_matches_a_local_run(cluster, jobs):
    root, command = jobs["prep"]
    assert "#SBATCH --array=0-1" in (root / "slurm/logs/launch_script.slurm").read_text()
    import data_prep

    data_prep.run(
        data_prep.FineWebConfig(
            source=str(root / "source"),
            tokenizer=str(root / "tok.json"),
            out=str(root / "local"),
            seq_len=64,
            shard_size=16,
            execution=data_prep.ExecutorConfig(workers=2),
        )
    )
    wait_queue_empty(cluster, timeout=240, name="test-prep")
    finished = megaloop(*command, extra_env=cluster)
    assert finished.returncode == 0, finished.stderr
    a, b = (json.loads((root / d / "manifest.json").read_text()) for d in ("slurm", "local"))
    for key in ("documents_read", "documents_kept", "tokens", "sequences", "dropped", "shards"):
        assert a[key] == b[key], key
    assert a["documents_kept"] > 0
    for shard in a["shards"]:
        assert members(root / "slurm/shards" / shard) == members(root / "local/shards" / shard)


def members(tar: Path) -> dict:
    with tarfile.open(tar) as f:
        return {m.name: f.extractfile(m).read() for m in f.getmembers() if m.isfile()}
