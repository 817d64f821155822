"""`megaloop demo`: norm vs raw readouts on a tiny model, trained here, as a table."""

from __future__ import annotations

import sys

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train norm vs raw readouts on a tiny model, print a table")
    p.add_argument("--text", help="train on this text file instead of the built-in corpus")
    p.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json path")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 400)")
    p.add_argument("--out", default="runs/demo", help="run directories go here")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument(
        "--seeds",
        type=int,
        default=4,
        help="seeds to train (seed, seed+1, ...); only what holds in all of them "
        "is stated as a finding",
    )
    p.set_defaults(fn=run)


def run(args) -> int:
    from megaloop.demo import run_demo

    if args.seeds < 1:
        print("megaloop: error: --seeds must be >= 1", file=sys.stderr)
        return 2
    from megaloop import _cpu_compat

    run_demo(
        text=args.text,
        steps=args.steps,
        out=args.out,
        tokenizer=args.tokenizer,
        seed=args.seed,
        seeds=args.seeds,
        workers=2,
        initializer=_cpu_compat.apply,
    )
    return 0
