"""`megaloop ckpt consolidate CHECKPOINT --out DIR`: one safetensors file from any layout."""

from __future__ import annotations

from pathlib import Path

from megaloop.commands.options import checked_out, out_folder, staged

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
    out_folder(p, "output folder: model.safetensors and config.json", overwrite=True)
    p.set_defaults(fn=consolidate)


def consolidate(args) -> int:
    out = checked_out(args, args.checkpoint)
    from megaloop import experiment
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    with staged(out) as folder:
        name = experiment.consolidate(Path(args.checkpoint), folder).name
    print(f"wrote {out / name}")
    return 0
