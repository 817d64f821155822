"""Launching real multi-process runs (gloo) of `megaloop train` from tests: under torchrun, or
as ranks started here with the environment torchrun and srun give theirs."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from faults import SCRIPT as FAULTS
from megaloop.train.metrics import read as read_metrics
from support import ROOT, TINY, env

# L=4, K=4, tiny widths: 10 steps of 4 micro-batches of 1 sequence, checkpoints at 5 and 10
BASE = [
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.num_layers=4",
    "model.num_loops=4",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "train.steps=10",
    "train.log_every=1",
    "train.eval_batches=4",
    "train.save_every=5",
    "train.keep_last=3",
    "optim.lr=1e-3",
    "optim.warmup_steps=2",
    "wandb.mode=disabled",
]


def stop_groups(procs: Sequence[subprocess.Popen]) -> None:
    """Kill what is left of each process started with start_new_session, helpers too:
    megatron-core's checkpoint writer starts a multiprocessing Manager that outlives a rank
    killed by -9 (Slurm would end it with the job's cgroup)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(nproc: int, run_dir: Path, overrides: list[str], faults: Sequence[str] = ()) -> list:
    """`megaloop train` of the tiny config, or with `faults` (options of tests/faults.py, e.g.
    ["--hold-at-step", "3"]) the same run through tests/faults.py."""
    program = [FAULTS, *faults] if faults else ["-m", "megaloop"]
    args = [*program, "train", TINY, *BASE, f"train.dir={run_dir}", *overrides]
    if nproc == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        *args,
    ]


# A DeepSpeed launch occasionally aborts in a C++ destructor after all its work is done.
EXIT_ABORT = "terminate called without an active exception"


def finished(run_dir: Path) -> bool:
    """The run wrote its final validation record."""
    data = read_metrics(run_dir)
    if data is None:
        return False
    steps = data["config"]["train"]["steps"]
    return bool(data["evals"]) and data["evals"][-1]["step"] == steps


def launch(nproc: int, args: list, timeout: float) -> subprocess.CompletedProcess:
    """`nproc` ranks of `python ARGS`, each with the env:// variables torchrun gives its workers
    (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; srun's tasks get the same from
    megaloop.parallel.launch), started here: torchrun's agent imports torch before it starts
    any rank, about 2 s of every launch on 2 cores. As the agent does, the first rank to fail
    stops the others. stdout and stderr are the ranks' own, in rank order."""
    port, procs, logs = free_port(), [], []
    for rank in range(nproc):
        task = {**env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc)}
        task.update(LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        logs.append((out, err))
        procs.append(
            subprocess.Popen(
                [sys.executable, *args], env=task, stdout=out, stderr=err, start_new_session=True
            )
        )
    deadline, failed = time.monotonic() + timeout, None
    try:
        while failed is None and any(p.poll() is None for p in procs):
            failed = next((p for p in procs if p.poll() not in (None, 0)), None)
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(args, timeout)
            time.sleep(0.05)
    finally:
        stop_groups(procs)  # what is left: the others after a failure, a rank's helpers
    code = failed.returncode if failed else next((p.returncode for p in procs if p.returncode), 0)
    text = [[f.seek(0) or f.read() for f in pair] for pair in logs]
    for pair in logs:
        for f in pair:
            f.close()
    return subprocess.CompletedProcess(
        args, code, "".join(o for o, _ in text), "".join(e for _, e in text)
    )


def train(
    nproc: int, run_dir: Path, overrides: list[str], timeout: int = 300
) -> subprocess.CompletedProcess:
    """Run to completion; a run is judged by its result file, so an abort at process exit
    after the work is done does not fail the test (the abort is still required to be that).
    More than one process: ranks started by `launch` (torchrun itself: `command`)."""
    if nproc == 1:
        proc = subprocess.run(
            command(1, run_dir, overrides),
            capture_output=True,
            text=True,
            env=env(),
            timeout=timeout,
        )
    else:
        proc = launch(nproc, command(1, run_dir, overrides)[1:], timeout)
    ok = proc.returncode == 0 or (finished(run_dir) and EXIT_ABORT in proc.stderr)
    assert ok and finished(run_dir), proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def train_here(run_dir: Path, overrides: list[str]) -> None:
    """A one-process run inside the test process (no second import of torch and megatron),
    single-threaded like a torchrun rank, so it matches a one-process subprocess bit for bit."""
    import torch

    from megaloop import experiment

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = experiment.load(TINY, [*BASE, f"train.dir={run_dir}", *overrides])
        experiment.build_trainer(cfg).fit()
    finally:
        torch.set_num_threads(threads)


def study_overrides() -> list[str]:
    """The study preset's (configs/experiments/study/) model and optimizer settings on the tiny
    shape: learned positions, PyTorch's initialisation, its norm epsilon, constant lr, decay of
    every parameter; dropout off, which a parallel layout draws differently."""
    from megaloop import experiment

    study = experiment.load(ROOT / "configs/experiments/study/44m/per_loop_norm.yaml")
    model = ("position_embedding", "init", "norm_eps", "tie_embeddings")
    return [
        "objective.kind=per_loop",
        "model.dropout=0",
        *(f"model.{k}={str(getattr(study.model, k)).lower()}" for k in model),
        *(f"optim.{k}={str(v).lower()}" for k, v in study.optim.to_dict().items()),
    ]


OBJECTIVES = {
    "per_loop+penalty": ["objective.kind=per_loop", "objective.norm_penalty=0.01"],
    "exit_weighted": [
        "objective.kind=exit_weighted",
        "model.exit_gate=true",
        "objective.entropy_beta=0.1",
    ],
    # Ouro's architecture and label path: sandwich norms, the shared loop norm, untied W_out
    "exit_mixture": [
        "objective.kind=exit_mixture",
        "model.exit_gate=true",
        "model.layer_norms=sandwich",
        "model.loop_norm=shared",
        "model.tie_embeddings=false",
    ],
    "study": study_overrides(),
}


def metrics(run_dir: Path, finite: bool = True) -> dict:
    """A run's records (metrics.jsonl, read by megaloop.train.metrics.read); by default every
    logged loss and per-loop CE must be finite (a NaN run must not pass as a run that trained)."""
    data = read_metrics(run_dir)
    assert data is not None, f"{run_dir}: no metrics.jsonl"
    if finite:
        for record in data["steps"] + data["evals"]:
            values = [record.get("loss", 0.0), *record.get("ce", [])]
            assert all(math.isfinite(v) for v in values), (run_dir, record)
    return data


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def assert_same_curve(run: dict, ref: dict, rel: float, steps=None) -> None:
    """Per-step loss and per-loop hidden RMS of `run` equal `ref` within `rel` (relative)."""
    ref_steps = {r["step"]: r for r in ref["steps"]}
    checked = 0
    for r in run["steps"]:
        if steps is not None and r["step"] not in steps:
            continue
        expected = ref_steps[r["step"]]
        assert close(r["loss"], expected["loss"], rel), (r["step"], r["loss"], expected["loss"])
        # one value per loop on both sides: zip() alone would stop at the shorter list
        got_rms, want_rms = r["hidden_rms"], expected["hidden_rms"]
        assert len(got_rms) == len(want_rms) > 0, (r["step"], got_rms, want_rms)
        for k, (got, want) in enumerate(zip(got_rms, want_rms, strict=True)):
            assert close(got, want, rel), (r["step"], k, got, want)
        checked += 1
    assert checked == (len(steps) if steps is not None else len(ref["steps"]))


def kill_9_then_resume(run_dir: Path, overrides: list[str], reference: dict) -> None:
    """SIGKILL a 2-rank run (torchrun and every rank, as when a node dies) while it waits at
    step 8 (the hold-at-step fault: step 7, its one checkpoint, is the newest, whatever the
    machine's speed), rerun it, and check it resumed from step 7 and repeated the uninterrupted
    run's remaining steps bit for bit (same layout, same arithmetic)."""
    import psutil

    proc = subprocess.Popen(
        command(2, run_dir, [*overrides, "train.save_every=7"], ["--hold-at-step", "8"]),
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_step(run_dir, 8, proc)
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.kill()
    proc.wait()
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_0000007"
    out = train(2, run_dir, [*overrides, "train.save_every=7"])
    assert f"resumed from {run_dir}/checkpoints/step_0000007" in out.stdout
    assert_same_curve(metrics(run_dir), reference, 1e-12, steps=range(8, 11))


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until the run has logged `step` (log_every=1); fails if it ends first."""
    import time

    deadline = time.time() + timeout
    while True:
        data = read_metrics(run_dir)  # None until the run has written its first record
        if data is not None and any(s["step"] == step for s in data["steps"]):
            return
        assert proc.poll() is None, f"the run ended before step {step}"
        assert time.time() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.05)
