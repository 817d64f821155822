"""`megaloop params CONFIG [--world N]`: parameter counts, and model state per rank."""

from __future__ import annotations

from megaloop.commands.options import load_config, with_config

BUILDS_MODEL = False


def add_parser(sub) -> None:
    p = with_config(
        sub.add_parser(
            "params", help="print embedding / non-embedding parameter counts (and memory per rank)"
        )
    )
    p.add_argument(
        "--world",
        type=int,
        help="also show memory per rank for the config's parallel.tp/pp on this many ranks "
        "(default: the counts only)",
    )
    p.set_defaults(fn=run)


def run(args) -> int:
    cfg = load_config(args)
    from megaloop.parallel.cost import parameter_counts, state_bytes
    from megaloop.parallel.layout import data_parallel_size

    counts = parameter_counts(cfg.model)
    for name in ("embedding", "non_embedding", "total"):
        print(f"{name:>14}: {counts[name]:>15,}")
    if args.world:
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        dp = data_parallel_size(cfg, args.world)
        state = state_bytes(cfg, tp, pp, dp)
        gib = {k: state[k] / 2**30 for k in ("weights", "grads", "optimizer")}
        print(
            f"per rank at TP={tp} PP={pp} DP={dp} (largest stage, engine={cfg.engine}): "
            f"{state['params']:,} params; weights {gib['weights']:.2f} GiB + grads "
            f"{gib['grads']:.2f} GiB + optimizer {gib['optimizer']:.2f} GiB = "
            f"{sum(gib.values()):.2f} GiB (activations: `megaloop plan`)"
        )
    return 0
