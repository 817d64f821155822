"""bf16 autocast against fp32 on the same run: the loss curves side by side, checked against a
stated tolerance, and the step-time ratio, each precision in processes of its own, alternated.

    python -m bench bf16 [--smoke] [--config configs/experiments/tiny.yaml] [--steps 30]
        [--pairs 3] [--tolerance 0.02] [--json PATH] [key=value ...]

Both sides train `config` from the same seed on the same synthetic data (a function of seed and
sample index) for `steps` steps; only `train.bf16` differs (autocast of the forward pass;
parameters, gradients, optimizer and the CE stay fp32). Every process of a side must give the
same curve (one thread, deterministic), so the curves compared are the first pair's.

Tolerance: per step |loss_bf16 - loss_fp32| <= 2% of loss_fp32; past it the script prints FAIL
and exits 1. bf16 keeps 8 significant bits, a relative rounding of 2^-8 = 0.4% per matmul
output; a loss averages thousands of tokens, so independent roundings cancel, and what remains
is the drift of two trajectories that differ by those roundings at every step. 2% is five bf16
roundings: a curve that stays within it trains the same; an autocast bug (a matmul out of range,
a CE taken in bf16, a missed cast) shows as a gap of tens of percent. The step time is the
median over steps after `--warmup`. On a CPU without native bf16 arithmetic (AVX-512 BF16 or
AMX) bf16 autocast is usually slower than fp32 (casts around every matmul); with it, and on a
GPU, faster.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from bench import common
from bench.common.alternation import (
    alternate,
    megaloop_trainer,
    report,
    set_threads,
    summary,
)
from bench.common.report import span
from megaloop import experiment

SMOKE_OVERRIDES = [
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.num_layers=1",
    "model.num_loops=2",
    "data.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]


def median_step_ms(step, warmup, steps):
    """Every step runs (the loss curve needs them all); the median leaves out the warm-up."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[warmup:] or times)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/experiments/tiny.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step time")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="largest |Δloss| per step, as a fraction of the fp32 loss",
    )
    p.add_argument(
        "--json", metavar="PATH", help="also write both curves, the per-step Δ and the verdict here"
    )
    p.add_argument("--side", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args(argv)
    if common.SMOKE and not args.side:  # tiny shapes, one pair, three steps (passed to the sides)
        args.pairs, args.steps, args.warmup = 1, 3, 1
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]
    return args


def side(args) -> None:
    """One process of a side: its losses and median step time, as the RESULT line."""
    set_threads()
    losses = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = megaloop_trainer(
            [*args.overrides, f"train.bf16={args.side == 'bf16'}"],
            args.steps,
            run_dir,
            config=args.config,
        )

        def step():
            losses.append(trainer.train_step()["loss"])

        ms = median_step_ms(step, args.warmup, args.steps)
    report(step_ms=ms, losses=losses)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.side:
        side(args)
        return
    child = ["--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    results = alternate("bf16", ("fp32", "bf16"), args.pairs, [*child, *args.overrides])
    fp32, bf16 = results["fp32"][0]["losses"], results["bf16"][0]["losses"]
    repeatable = all(r["losses"] == fp32 for r in results["fp32"]) and all(
        r["losses"] == bf16 for r in results["bf16"]
    )
    diffs = [b - a for a, b in zip(fp32, bf16)]
    rel = [abs(d) / a for d, a in zip(diffs, fp32)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    m = experiment.load(args.config, args.overrides).model
    print(
        f"{' '.join([args.config, *args.overrides])}: d={m.hidden_size}, L={m.num_layers}, "
        f"K={m.num_loops}, V={m.vocab_size}; {args.steps} steps, seed 0, 1 thread a process; "
        f"{args.pairs} pairs of processes (fp32, bf16, ...)\n"
    )
    print("| step | loss fp32 | loss bf16 | Δ | Δ / fp32 |")
    print("|---|---|---|---|---|")
    for i, (a, b, d, r) in enumerate(zip(fp32, bf16, diffs, rel), 1):
        print(f"| {i} | {a:.4f} | {b:.4f} | {d:+.4f} | {100 * r:.2f}% |")
    verdict = "PASS" if rel[worst] <= args.tolerance else "FAIL"
    print(
        f"\nmax |Δloss| {max(map(abs, diffs)):.4f} nats; max |Δloss|/loss_fp32 "
        f"{100 * rel[worst]:.2f}% (step {worst + 1}); mean |Δloss| "
        f"{statistics.mean(map(abs, diffs)):.4f}; final loss fp32 {fp32[-1]:.4f}, bf16 "
        f"{bf16[-1]:.4f}; tolerance {100 * args.tolerance:g}% a step: {verdict}"
    )
    print(
        f"curves identical across each side's {args.pairs} processes: "
        f"{'yes' if repeatable else 'no'}"
    )
    print_step_times(results)
    if args.json:
        figures = {"loss_fp32": fp32, "loss_bf16": bf16, "delta": diffs, "relative": rel}
        with open(args.json, "w") as f:
            json.dump({**figures, "tolerance": args.tolerance, "verdict": verdict}, f, indent=1)
    if verdict == "FAIL":
        sys.exit(1)


def print_step_times(results: dict) -> None:
    t32 = [r["step_ms"] for r in results["fp32"]]
    t16 = [r["step_ms"] for r in results["bf16"]]
    ratio, low, high, _ = summary([b / a for a, b in zip(t32, t16)])
    print(
        f"step time: fp32 {statistics.median(t32):.1f} ms ({span(t32)}), bf16 "
        f"{statistics.median(t16):.1f} ms ({span(t16)}); bf16 / fp32: {ratio:.3f}x "
        f"(median of per-pair ratios, min..max {low:.3f}..{high:.3f}; "
        f"{'CPU' if not torch.cuda.is_available() else torch.cuda.get_device_name()})"
    )
