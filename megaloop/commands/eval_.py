"""`megaloop eval downstream|compare`: lm-eval tasks on a model, paired bootstrap CIs."""

from __future__ import annotations

import json
from pathlib import Path

from megaloop.commands.options import settings_flags
from megaloop.evaluation.settings import RESAMPLES, DownstreamSettings
from megaloop.extras import require
from megaloop.flags import from_flags

BUILDS_MODEL = False  # `eval compare` builds none; `eval downstream` says it does (builds_model)


def add_parser(sub) -> None:
    actions = sub.add_parser("eval", help="evaluate models on downstream tasks").add_subparsers(
        dest="eval_command", required=True, metavar="ACTION"
    )
    down = actions.add_parser("downstream", help="lm-eval multiple-choice tasks at K loops")
    settings_flags(down, DownstreamSettings)
    down.set_defaults(fn=downstream, builds_model=True)  # a run is exported: megatron-core
    cmp = actions.add_parser("compare", help="paired bootstrap CIs between two results folders")
    cmp.add_argument("a", help="results folder of the first model (A), from eval downstream")
    cmp.add_argument("b", help="results folder of the second model (B); the table is B - A")
    cmp.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples")
    cmp.add_argument("--seed", type=int, default=0, help="seed of the bootstrap's random draws")
    cmp.add_argument(
        "--out",
        help="file: the table (.md) or the numbers (.json) (default: the table is printed only)",
    )
    cmp.set_defaults(fn=compare)


def downstream(args) -> int:
    require("eval", "megaloop eval downstream")
    from megaloop.evaluation import adaptive_downstream, downstream

    settings = from_flags(DownstreamSettings, args)
    if settings.exit is not None:
        print(adaptive_downstream.table(adaptive_downstream.run(settings)))
        print(f"runs in {args.out}/<run>/, adaptive.json|md and accuracy_vs_depth.png beside")
        return 0
    print(downstream.table(downstream.run(settings)))
    print(f"results and samples in {args.out}")
    return 0


def compare(args) -> int:
    from megaloop.evaluation import compare

    result = compare.compare(Path(args.a), Path(args.b), args.resamples, args.seed)
    text = compare.table(result, Path(args.a).name, Path(args.b).name)
    print(text)
    if args.out:
        Path(args.out).write_text(
            json.dumps(result, indent=1) if args.out.endswith(".json") else text + "\n"
        )
    return 0
