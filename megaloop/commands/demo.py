"""`megaloop demo`: norm vs raw readouts on a tiny model, trained here, as a table."""

from __future__ import annotations

from megaloop.commands.options import deprecated, seed_list, warn
from megaloop.config import ConfigError

BUILDS_MODEL = True

SEEDS = (0, 1, 2, 3)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train norm vs raw readouts on a tiny model, print a table")
    p.add_argument(
        "--text",
        help="train on this text file instead of the built-in corpus (default: the built-in "
        "addition corpus)",
    )
    p.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json path")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: 400)")
    p.add_argument("--out", default="runs/demo", help="folder the run directories go to")
    p.add_argument(
        "--seeds",
        help="seeds to train, comma-separated; only what holds in all of them is stated as a "
        f"finding (default: {','.join(map(str, SEEDS))})",
    )
    deprecated(p, "--seed", "--seeds", type=int, dest="first_seed", default=None)
    p.set_defaults(fn=run)


def seeds_of(args) -> list[int]:
    """--seeds as seeds. For one release the old spelling still works: `--seeds N` (one number,
    no comma) is N seeds from `--seed S` (default 0), with a warning; one seed is `--seeds S,`."""
    if args.seeds is not None and "," not in args.seeds and args.seeds.strip().isdigit():
        count = int(args.seeds)
        start = args.first_seed or 0
        warn(
            f"--seeds {count} as a count of seeds is deprecated: give the seeds, e.g. --seeds "
            f"{','.join(str(start + i) for i in range(max(count, 1)))}"
        )
        if count < 1:
            raise ConfigError("--seeds must be >= 1")
        return list(range(start, start + count))
    if args.seeds is None:
        start = args.first_seed or 0
        return [start + s for s in SEEDS]
    if args.first_seed is not None:
        raise ConfigError("--seed S (deprecated) counts from S: give the --seeds alone")
    seeds = seed_list(args.seeds)
    if seeds is None or len(set(seeds)) < len(seeds):
        raise ConfigError(f"--seeds {args.seeds!r}: give distinct seeds, comma-separated, e.g. 0,1")
    return seeds


def run(args) -> int:
    seeds = seeds_of(args)
    from megaloop import _cpu_compat
    from megaloop.demo import run_demo

    run_demo(
        text=args.text,
        steps=args.steps,
        out=args.out,
        tokenizer=args.tokenizer,
        seeds=seeds,
        workers=2,
        initializer=_cpu_compat.apply,
    )
    return 0
