"""`megaloop import ouro SOURCE --out DIR`: a published checkpoint as a megaloop checkpoint."""

from __future__ import annotations

from pathlib import Path

from megaloop.commands.options import need_out, out_folder

BUILDS_MODEL = True


def add_parser(sub) -> None:
    formats = sub.add_parser(
        "import", help="a published checkpoint of another format as a megaloop checkpoint"
    ).add_subparsers(dest="import_command", required=True, metavar="FORMAT")
    p = formats.add_parser(
        "ouro",
        help="a local Ouro folder (config.json + safetensors), e.g. a download of "
        "ByteDance/Ouro-1.4B from the hub: a path, not a hub id",
    )
    p.add_argument("source", help="the local Ouro folder (a path; nothing is fetched)")
    out_folder(p, "a new checkpoint folder")
    p.set_defaults(fn=ouro)


def ouro(args) -> int:
    folder = need_out(args)
    from megaloop.ouro import import_ouro
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    out = import_ouro(Path(args.source), Path(folder))
    print(
        f"wrote {out}: a megaloop checkpoint (megaloop export {out} --out DIR, megaloop depth "
        f"{out} ..., or train.init_from={out})"
    )
    return 0
