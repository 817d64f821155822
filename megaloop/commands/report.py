"""`megaloop report RUN_OR_RESULT... --out DIR`: the study's tables and figures."""

from __future__ import annotations

from pathlib import Path

BUILDS_MODEL = False


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="the study's tables and figures from runs and measurement results"
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="RUN_OR_RESULT",
        help="run directories (metrics.jsonl) and folders or JSON files written by "
        "depth / halt / diagnose",
    )
    p.add_argument("--out", required=True, help="folder: writes OUT/report.md and OUT/*.png")
    p.set_defaults(fn=run)


def run(args) -> int:
    from megaloop.evaluation import report

    path = report.build([Path(p) for p in args.inputs], Path(args.out))
    print(f"wrote {path} and its figures")
    return 0
