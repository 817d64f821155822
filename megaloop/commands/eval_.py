"""`megaloop eval downstream|compare`: lm-eval tasks on a model, paired bootstrap CIs."""

from __future__ import annotations

import json
from pathlib import Path

from megaloop.commands.options import batch_size
from megaloop.evaluation.settings import EXIT_RULES, MODEL_KINDS, SPLITS, scores
from megaloop.extras import require

BUILDS_MODEL = False  # `eval compare` builds none; `eval downstream` says it does (builds_model)


def add_parser(sub) -> None:
    actions = sub.add_parser("eval", help="evaluate models on downstream tasks").add_subparsers(
        dest="eval_command", required=True, metavar="ACTION"
    )
    down = actions.add_parser("downstream", help="lm-eval multiple-choice tasks at K loops")
    down.add_argument("model", help=MODEL_KINDS)
    down.add_argument(
        "--loops",
        type=int,
        required=True,
        help="K, the loops every token runs (K_max under --exit)",
    )
    down.add_argument("--tasks", help="comma-separated lm-eval tasks (default: the study's nine)")
    down.add_argument(
        "--limit", type=int, help="at most this many examples per task (default: all of them)"
    )
    down.add_argument(
        "--data-dir",
        help="run the built-in tasks from DIR/<task>/<split>.jsonl (hub schema) instead of the hub "
        "(default: the hub)",
    )
    batch_size(down, 8, help="examples per forward pass")
    down.add_argument(
        "--split",
        choices=list(SPLITS),
        default="validation",
        help="validation (the study: every task's validation split) or default "
        "(the split lm-eval evaluates each task on)",
    )
    down.add_argument(
        "--exit",
        choices=list(EXIT_RULES),
        help="also score with adaptive depth under this exit rule (K_max = --loops), "
        "once per --threshold, beside fixed K (default: fixed K only)",
    )
    down.add_argument(
        "--threshold",
        help=f"the --exit rule's thresholds, comma-separated, on its score: {scores()} "
        "(required with --exit)",
    )
    down.add_argument(
        "--out", required=True, help="folder of the results (results, samples, summary)"
    )
    down.set_defaults(fn=downstream, builds_model=True)  # a run is exported: megatron-core
    cmp = actions.add_parser("compare", help="paired bootstrap CIs between two results folders")
    cmp.add_argument("a", help="results folder of the first model (A), from eval downstream")
    cmp.add_argument("b", help="results folder of the second model (B); the table is B - A")
    cmp.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    cmp.add_argument("--seed", type=int, default=0, help="seed of the bootstrap's random draws")
    cmp.add_argument(
        "--out",
        help="file: the table (.md) or the numbers (.json) (default: the table is printed only)",
    )
    cmp.set_defaults(fn=compare)


def downstream(args) -> int:
    require("eval", "megaloop eval downstream")
    from megaloop.evaluation import adaptive_downstream, downstream
    from megaloop.evaluation.settings import DownstreamSettings, parse_thresholds

    settings = DownstreamSettings(
        model=args.model,
        loops=args.loops,
        tasks=tuple(t for t in args.tasks.split(",") if t) if args.tasks else None,
        out=args.out,
        limit=args.limit,
        data_dir=args.data_dir,
        batch_size=args.batch_size,
        split=args.split,
        exit=args.exit,
        thresholds=parse_thresholds(args.threshold) if args.threshold is not None else (),
    )
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
