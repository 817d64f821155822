"""Launching real multi-process runs (torchrun, gloo) of `megaloop train` from tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs/experiments/tiny.yaml")

# L=4, K=4, tiny widths: 10 steps of 4 micro-batches of 1 sequence, checkpoints at 5 and 10
BASE = ["model.hidden_size=32", "model.num_heads=4", "model.num_layers=4", "model.num_loops=4",
        "model.max_seq_len=32", "data.seq_len=32", "train.micro_batch_size=1",
        "train.global_batch_size=4", "train.steps=10", "train.log_every=1", "train.eval_batches=4",
        "train.save_every=5", "train.keep_last=3", "optim.lr=1e-3", "optim.warmup_steps=2",
        "wandb.mode=disabled"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(nproc: int, run_dir: Path, overrides: list[str]) -> list[str]:
    args = ["-m", "megaloop", "train", TINY, *BASE, f"train.dir={run_dir}", *overrides]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", *args]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


# A DeepSpeed launch occasionally aborts in a C++ destructor after all its work is done.
EXIT_ABORT = "terminate called without an active exception"


def finished(run_dir: Path) -> bool:
    """The run wrote its final validation record (metrics.json is rewritten atomically)."""
    path = run_dir / "metrics.json"
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    steps = data["config"]["train"]["steps"]
    return bool(data["evals"]) and data["evals"][-1]["step"] == steps


def train(nproc: int, run_dir: Path, overrides: list[str], timeout: int = 300
          ) -> subprocess.CompletedProcess:
    """Run to completion; a run is judged by its result file, so an abort at process exit
    after the work is done does not fail the test (the abort is still required to be that)."""
    proc = subprocess.run(command(nproc, run_dir, overrides), capture_output=True, text=True,
                          env=env(), timeout=timeout)
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


OBJECTIVES = {
    "per_loop+penalty": ["objective.kind=per_loop", "objective.norm_penalty=0.01"],
    "exit_weighted": ["objective.kind=exit_weighted", "model.exit_gate=true",
                      "objective.entropy_beta=0.1"],
    # Ouro's architecture and label path: sandwich norms, the shared loop norm, untied W_out
    "exit_mixture": ["objective.kind=exit_mixture", "model.exit_gate=true",
                     "model.layer_norms=sandwich", "model.loop_norm=shared",
                     "model.tie_embeddings=false"],
}


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


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
        for k, (got, want) in enumerate(zip(r["hidden_rms"], expected["hidden_rms"])):
            assert close(got, want, rel), (r["step"], k, got, want)
        checked += 1
    assert checked == (len(steps) if steps is not None else len(ref["steps"]))


def kill_9_then_resume(run_dir: Path, overrides: list[str], reference: dict) -> None:
    """SIGKILL a 2-rank run (torchrun and every rank, as when a node dies) once it has saved
    step 7, rerun it, and check it resumed from the newest checkpoint and repeated the
    uninterrupted run's remaining steps bit for bit (same layout, same arithmetic)."""
    import time

    import psutil

    proc = subprocess.Popen(command(2, run_dir, [*overrides, "train.save_every=1"]), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = run_dir / "checkpoints/latest"
    deadline = time.time() + 240
    while not (latest.exists() and latest.read_text() >= "step_0000007"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before step 7"
        time.sleep(0.02)
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.kill()
    proc.wait()
    killed_at = int(latest.read_text().split("_")[1])
    assert 7 <= killed_at < 10
    out = train(2, run_dir, [*overrides, "train.save_every=1"])
    assert f"resumed from {run_dir}/checkpoints/step_{killed_at:07d}" in out.stdout
    assert_same_curve(metrics(run_dir), reference, 1e-12, steps=range(killed_at + 1, 11))

