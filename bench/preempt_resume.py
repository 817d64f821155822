"""A preemption round trip under torchrun on whatever one device this machine has: NCCL on a GPU,
gloo on a CPU. One rank still runs every per-step collective of a many-rank run (megaloop's
have no world-of-one shortcut), so one GPU catches what a tensor on the wrong device would do
to a cluster.

    python -m bench preempt_resume --out OUT [--steps 20 --at 10] [key=value ...]

1. an uninterrupted run of `--steps` steps (the reference);
2. the same run held at step `--at` (tests/faults.py --hold-at-step as torchrun's worker: no
   race with the signal) until a SIGUSR1 reaches its worker: it must save, exit for a requeue
   and say so;
3. the relaunch resumes from that checkpoint and finishes;
and prints both loss curves side by side. Exit status 1 if a loss differs by more than --rel.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT
from megaloop.train.metrics import read as read_metrics

CONFIG = "configs/experiments/tiny.yaml"
FAULTS = str(ROOT / "tests/faults.py")


def launch(run_dir: Path, overrides: list, env: dict, log, hold_at: int | None = None):
    """torchrun of one rank; with `hold_at`, the worker waits at that step for the signal."""
    program = [FAULTS, "--hold-at-step", str(hold_at)] if hold_at else ["-m", "megaloop"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        *program,
        "train",
        CONFIG,
        *overrides,
        f"train.dir={run_dir}",
    ]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def steps_logged(run_dir: Path) -> list:
    data = read_metrics(run_dir)
    return data["steps"] if data else []


def worker_of(agent: int) -> int:
    """The training process: torchrun's child. SIGUSR1 to torchrun's agent itself would kill it,
    as the signal's default action. Found by parent, not by environment: a LOCAL_RANK that the
    caller's own environment carries (DeepSpeed's one-process default sets one) reaches the agent
    too."""
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == agent:  # the field after the state: ppid
            return int(proc.name)
    raise RuntimeError(f"no worker process under torchrun (pid {agent})")


def main(argv: list[str], out: Path | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--at", type=int, default=10)
    p.add_argument(
        "--rel",
        type=float,
        default=1e-5,
        help="largest relative loss difference accepted (fp32: the same kernels on "
        "the same inputs; a resume restores RNG and data position exactly)",
    )
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("overrides", nargs="*")
    if out is None:
        sys.exit("preempt_resume: give --out DIR, the folder of its runs and logs")
    args = p.parse_intermixed_args(argv)  # [--steps N --at N] key=value ...: options between
    overrides = [
        f"train.steps={args.steps}",
        "train.log_every=1",
        "train.save_every=0",
        "train.eval_batches=1",
        "wandb.mode=disabled",
        *args.overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    out.mkdir(parents=True, exist_ok=True)
    reference, held = out / "reference", out / "preempted"
    for run_dir in (reference, held):  # this bench's own runs: a rerun starts them afresh
        shutil.rmtree(run_dir, ignore_errors=True)
    with open(out / "reference.log", "w") as log:
        if launch(reference, overrides, env, log).wait(args.timeout) != 0:
            sys.exit(f"the reference run failed: {out / 'reference.log'}")
    with open(out / "preempted.log", "w") as log:
        run = launch(held, overrides, env, log, hold_at=args.at)
        deadline = time.monotonic() + args.timeout
        while len(steps_logged(held)) < args.at:
            if run.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the run ended or stalled before step {args.at}: {out / 'preempted.log'}")
            time.sleep(0.2)
        os.kill(worker_of(run.pid), signal.SIGUSR1)
        first = run.wait(args.timeout)
    text = (out / "preempted.log").read_text()
    if f"preempted at step {args.at}" not in text:
        sys.exit(
            f"no preemption checkpoint at step {args.at} (exit {first}): {out / 'preempted.log'}"
        )
    with open(out / "preempted.log", "a") as log:
        if launch(held, overrides, env, log).wait(args.timeout) != 0:
            sys.exit(f"the resumed run failed: {out / 'preempted.log'}")
    if (
        f"resumed from {held}/checkpoints/step_{args.at:07d}"
        not in (out / "preempted.log").read_text()
    ):
        sys.exit("the relaunch did not resume from the preemption checkpoint")
    want, got = steps_logged(reference), steps_logged(held)
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    print(f"one rank under torchrun ({backend}), SIGUSR1 at step {args.at}, resumed:\n")
    print("| step | uninterrupted | preempted + resumed | rel. difference |")
    print("|---|---|---|---|")
    worst = 0.0
    for a, b in zip(want, got):
        rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
        worst = max(worst, rel)
        print(f"| {a['step']} | {a['loss']:.6f} | {b['loss']:.6f} | {rel:.1e} |")
    ok = len(got) == len(want) == args.steps and worst <= args.rel
    print(
        f"\nlargest relative difference {worst:.1e} (accepted: {args.rel:g}): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1
