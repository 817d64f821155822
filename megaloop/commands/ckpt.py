"""`megaloop ckpt consolidate CHECKPOINT OUT`: one safetensors file from any layout."""

from __future__ import annotations

import sys
from pathlib import Path

BUILDS_MODEL = True


def add_parser(sub) -> None:
    actions = sub.add_parser("ckpt", help="checkpoint tools").add_subparsers(
        dest="ckpt_command", required=True, metavar="ACTION"
    )
    p = actions.add_parser(
        "consolidate",
        help="one safetensors file of the whole model from a checkpoint of any layout",
    )
    p.add_argument("checkpoint", help="a run directory or a checkpoints/step_* folder")
    p.add_argument("out", help="output folder (model.safetensors, config.json)")
    p.set_defaults(fn=consolidate)


def consolidate(args) -> int:
    from megaloop import experiment
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    try:
        path = experiment.consolidate(Path(args.checkpoint), Path(args.out))
    except ValueError as e:
        print(f"megaloop: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
