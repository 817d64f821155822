"""Norm-penalty overhead: the real megaloop training step with the default objective against the
same step with `objective.norm_penalty` on, each in processes of its own, alternated.

    python -m bench norm_penalty [--pairs 6] [--steps 3] [--warmup 1] [--penalty 1e-3]
        [--hidden 256 --heads 4 --layers 4 --loops 4 --seq 256 --batch 4 --vocab 8192]

The penalty adds λ·(1/K)·Σ_k E‖H_k‖²_rms to the loss; the ‖H_k‖² it reads are computed for the
logged diagnostics either way, so what it can add is their backward. Per-process step times on
2 shared cores spread by ±20%, so the figure is the median of per-pair ratios with its min..max
and a bootstrap interval, and the overhead counts as resolvable when the pairs agree on its
sign more often than chance (two-sided sign test, p < 0.05: with 6 pairs, all six must agree).
The same is reported for each process's CPU time, which one-thread processes do not lose to
other processes' turns on the cores.
"""

import argparse
import statistics
import tempfile

import torch

from bench import common
from bench.common.alternation import (
    SHAPE,
    SMOKE_SHAPE,
    alternate,
    megaloop_overrides,
    megaloop_trainer,
    report,
    set_threads,
    sign_test,
    summary,
    time_steps,
)
from bench.common.report import span


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--penalty",
        type=float,
        default=1e-3,
        help="λ when on (the wikitext103 *_norm_penalty configs' value)",
    )
    for key, value in SHAPE.items():
        p.add_argument(f"--{key}", type=int, default=value)
    p.add_argument("--side", choices=["off", "on"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape = SMOKE_SHAPE if common.SMOKE else {k: getattr(args, k) for k in SHAPE}
    if common.SMOKE:  # tiny shapes, one pair, one step
        args.pairs, args.steps, args.warmup = 1, 1, 1
    if args.side:
        set_threads()
        penalty = args.penalty if args.side == "on" else 0.0
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = megaloop_trainer(
                [*megaloop_overrides(shape), f"objective.norm_penalty={penalty}"],
                args.warmup + args.steps,
                run_dir,
            )
            records = []

            def step():
                records.append(trainer.train_step())
                return records[-1]["loss"]

            result = time_steps(step, args.warmup, args.steps)
        report(
            **result, penalty_term=sum(records[-1]["norm_penalty"]), threads=torch.get_num_threads()
        )
        return
    child = [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--penalty",
        str(args.penalty),
        *[a for k in SHAPE for a in (f"--{k}", str(shape[k]))],
    ]
    results = alternate("norm_penalty", ("off", "on"), args.pairs, child)
    assert all(r["penalty_term"] == 0 for r in results["off"])
    assert all(r["penalty_term"] > 0 for r in results["on"])
    print(
        f"d={shape['hidden']}, {shape['heads']} heads, L={shape['layers']}, "
        f"K={shape['loops']}, T={shape['seq']}, B={shape['batch']}, V={shape['vocab']}, "
        f"per-loop objective, fp32, 1 thread a process; {args.pairs} pairs of processes "
        f"(off, on, ...), each the median of {args.steps} steps after {args.warmup} warm-up\n"
    )
    print(
        "| objective.norm_penalty | step (ms) | per-process medians (ms) | CPU time (ms) | "
        "per-process CPU (ms) |"
    )
    print("|---|---|---|---|---|")
    for side, label in (("off", "0 (off)"), ("on", f"{args.penalty:g} (on)")):
        wall, cpu = ([r[k] for r in results[side]] for k in ("step_ms", "cpu_ms"))
        print(
            f"| {label} | {statistics.median(wall):.1f} | {span(wall)} | "
            f"{statistics.median(cpu):.1f} | {span(cpu)} |"
        )
    print()
    for key, label in (("step_ms", "on / off"), ("cpu_ms", "CPU time on / off")):
        ratios = [on[key] / off[key] for off, on in zip(results["off"], results["on"])]
        print(f"{label}: {verdict(ratios)}")


def verdict(ratios):
    """The median per-pair ratio, its spread, and whether the pairs resolve a difference."""
    ratio, low, high, (ci_low, ci_high) = summary(ratios)
    p_value = sign_test(ratios)
    slower = sum(r > 1 for r in ratios)
    return (
        f"{ratio:.3f}x (median of {len(ratios)} per-pair ratios, min..max "
        f"{low:.3f}..{high:.3f}, bootstrap 95% of the median {ci_low:.3f}..{ci_high:.3f}); "
        f"{slower} of {len(ratios)} pairs slower with the penalty, sign test p = "
        f"{p_value:.2f}: overhead {'resolvable' if p_value < 0.05 else 'not resolvable'} at 5%"
    )
