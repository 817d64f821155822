"""`megaloop import ouro SOURCE OUT`: a published checkpoint as a megaloop checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

BUILDS_MODEL = True


def add_parser(sub) -> None:
    formats = sub.add_parser(
        "import", help="a published checkpoint of another format as a megaloop checkpoint"
    ).add_subparsers(dest="import_command", required=True, metavar="FORMAT")
    p = formats.add_parser(
        "ouro", help="an Ouro folder (config.json + safetensors, e.g. ByteDance/Ouro-1.4B)"
    )
    p.add_argument("source", help="the Ouro folder")
    p.add_argument("out", help="a new checkpoint folder")
    p.set_defaults(fn=ouro)


def ouro(args) -> int:
    from megaloop.ouro import import_ouro
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    try:
        out = import_ouro(Path(args.source), Path(args.out))
    except ValueError as e:
        print(f"megaloop: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {out}: a megaloop checkpoint (megaloop export {out} OUT, megaloop depth "
        f"{out} ..., or train.init_from={out})"
    )
    return 0
