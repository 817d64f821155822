"""The cost of one log call as a run grows: megaloop's append-only metrics.jsonl against the
whole-file rewrite of metrics.json that megaloop used before (the reference), at 100, 10,000 and
50,000 records (a 1.4B config logging every step for 50,000 steps).

    python -m bench metrics_log [--records 100,10000,50000] [--calls 20]

Prints the median seconds of one call at each size, each side's ratio of its largest size to
100 records (append: ~1, the goal <= 2; rewrite: grows with the run), and append / rewrite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from megaloop.train.metrics import MetricsLogger, WandbConfig, write_json_atomic

LOOPS = 4


def record(step: int) -> dict:
    per_loop = [5.0 - 0.001 * step + 0.01 * k for k in range(LOOPS)]
    return {
        "step": step,
        "loss": per_loop[-1],
        "ce": per_loop,
        "hidden_rms": per_loop,
        "hidden_rms_p50": per_loop,
        "hidden_rms_p99": per_loop,
        "hidden_rms_max": per_loop,
        "norm_penalty": [0.0] * LOOPS,
        "lr": 3e-4,
        "grad_norm": 0.9,
        "tokens_per_s": 12345.6,
        "step_time_s": 0.5,
    }


def append_side(sizes: list[int], calls: int, folder: Path) -> dict[int, float]:
    logger = MetricsLogger(folder, {"model": {}}, WandbConfig(mode="disabled"), max(sizes) + calls)
    logger._say = lambda line: None  # progress lines off: the file is what is measured
    step, timings = 0, {}
    for size in sorted(sizes):
        while step < size:
            step += 1
            logger.log(record(step))
        samples = []
        for _ in range(calls):
            step += 1
            began = time.perf_counter()
            logger.log(record(step))
            samples.append(time.perf_counter() - began)
        timings[size] = statistics.median(samples)
    logger.close()
    return timings


def rewrite_side(sizes: list[int], calls: int, folder: Path) -> dict[int, float]:
    data = {"config": {"model": {}}, "steps": [], "evals": [], "alarms": [], "skipped_steps": []}
    path, timings = folder / "metrics.json", {}
    for size in sorted(sizes):
        data["steps"] = [record(s) for s in range(1, size + 1)]
        samples = []
        for i in range(calls):
            began = time.perf_counter()
            data["steps"].append(record(size + i + 1))
            write_json_atomic(path, data)
            samples.append(time.perf_counter() - began)
            data["steps"].pop()
        timings[size] = statistics.median(samples)
    return timings


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", default="100,10000,50000")
    p.add_argument("--calls", type=int, default=20, help="timed calls at each size")
    args = p.parse_args(argv)
    sizes = sorted(int(s) for s in args.records.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a").mkdir()
        (Path(tmp) / "b").mkdir()
        append = append_side(sizes, args.calls, Path(tmp) / "a")
        rewrite = rewrite_side(sizes, min(args.calls, 5), Path(tmp) / "b")
    print(
        "| records | append (metrics.jsonl) | rewrite (metrics.json, before) | append / rewrite |"
    )
    print("|---|---|---|---|")
    for size in sizes:
        print(
            f"| {size:,} | {append[size] * 1e6:,.0f} µs | {rewrite[size] * 1e6:,.0f} µs "
            f"| {append[size] / rewrite[size]:.4f}x |"
        )
    first, last = sizes[0], sizes[-1]
    grew = {side: t[last] / t[first] for side, t in (("append", append), ("rewrite", rewrite))}
    print(
        f"\none call at {last:,} records / at {first:,}: append {grew['append']:.2f}x "
        f"(goal <= 2), rewrite {grew['rewrite']:.1f}x"
    )
