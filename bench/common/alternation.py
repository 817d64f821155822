"""Timing in alternated processes, which every step-time bench here shares: each side of a
comparison runs in processes of its own (`--side S`), A B A B ..., so drift in the machine's load
falls on both alike; a child prints one RESULT line (`report`), the parent reads it
(`run_child`), pairs them (`alternate`) and summarises the per-pair ratios (`summary`,
`sign_test`). `time_steps` is a child's step timer.

Used by overhead, norm_penalty and bf16, which also share the trainer they time
(`megaloop_trainer`) and its shape.
"""

import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from bench import common

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
SHAPE = dict(hidden=256, heads=4, layers=4, loops=4, seq=256, batch=4, vocab=8192)
SMOKE_SHAPE = dict(hidden=32, heads=4, layers=2, loops=2, seq=16, batch=2, vocab=256)
"""The step-time benches' optimizer and model shape (overhead's plain-PyTorch step uses the same
settings), and the shape of their --smoke runs."""


def set_threads(threads=1):
    torch.set_num_threads(threads)


def time_steps(step, warmup, steps):
    """Over `steps` calls after `warmup` calls: the median wall and CPU milliseconds of a step
    and the last loss. With one thread, CPU time leaves out the time other processes take the
    core, so it spreads less than wall time on a shared machine (contention for caches and
    memory still shows)."""
    wall, cpu = [], []
    for i in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = step()
        if i >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return {
        "step_ms": 1e3 * statistics.median(wall),
        "cpu_ms": 1e3 * statistics.median(cpu),
        "loss": loss,
    }


def report(**result):
    """The child's one line for the parent."""
    print("RESULT " + json.dumps(result), flush=True)


def run_child(bench, args, threads=1):
    """`python -m bench BENCH ARGS` (with --smoke under it) with `threads` threads: its RESULT."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "WANDB_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(common.ROOT), os.getenv("PYTHONPATH")])),
    }
    argv = [sys.executable, "-m", "bench", bench, *(["--smoke"] if common.SMOKE else []), *args]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(
            f"{bench} {' '.join(args)} failed "
            f"(exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def alternate(bench, sides, pairs, args, threads=1):
    """Run `python -m bench BENCH --side S ARGS` for each side in turn, `pairs` times (A B A B
    ...), one process each with `threads` threads; the children's results per side, in order."""
    results = {side: [] for side in sides}
    for i in range(pairs):
        for side in sides:
            results[side].append(run_child(bench, ["--side", side, *args], threads))
            last = results[side][-1]
            cpu = f" ({last['cpu_ms']:.1f} ms CPU)" if "cpu_ms" in last else ""
            print(
                f"pair {i + 1}/{pairs} {side}: {last['step_ms']:.1f} ms{cpu}",
                file=sys.stderr,
                flush=True,
            )
    return results


def summary(ratios, resamples=2000, seed=0):
    """(median, min, max, 95% bootstrap interval of the median) of per-pair ratios."""
    import random

    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return (
        statistics.median(ratios),
        min(ratios),
        max(ratios),
        (medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]),
    )


def sign_test(ratios):
    """Two-sided sign-test p-value of "ratio 1": how often pairs split this unevenly by chance."""
    n, above = len(ratios), sum(r > 1 for r in ratios)
    tail = sum(math.comb(n, i) for i in range(min(above, n - above) + 1)) / 2**n
    return min(1.0, 2 * tail)


# -- the real trainer, which the step-time benches time ----------------------------------------


def megaloop_overrides(shape):
    return [
        f"model.hidden_size={shape['hidden']}",
        f"model.num_heads={shape['heads']}",
        f"model.num_layers={shape['layers']}",
        f"model.num_loops={shape['loops']}",
        f"model.vocab_size={shape['vocab']}",
        f"model.max_seq_len={shape['seq']}",
        f"data.seq_len={shape['seq']}",
        f"train.micro_batch_size={shape['batch']}",
        f"train.global_batch_size={shape['batch']}",
        f"optim.lr={LR}",
        f"optim.beta1={BETAS[0]}",
        f"optim.beta2={BETAS[1]}",
        f"optim.eps={EPS}",
        f"optim.weight_decay={WEIGHT_DECAY}",
        f"optim.clip_grad={CLIP}",
        "optim.warmup_steps=0",
    ]


def megaloop_trainer(overrides, steps, run_dir, config=None, eval_batches=1):
    """The real trainer of `config` + `overrides` on synthetic data, for `steps` steps."""
    from megaloop import _cpu_compat, experiment

    _cpu_compat.apply()
    cfg = experiment.load(
        config,
        [
            *overrides,
            "data.kind=synthetic",
            f"train.steps={steps}",
            f"train.dir={run_dir}",
            "wandb.mode=disabled",
            f"train.eval_batches={eval_batches}",
        ],
    )
    return experiment.build_trainer(cfg, log=False)
