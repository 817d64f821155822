"""`megaloop export SOURCE --out DIR [--format ouro]`: a checkpoint as a transformers model."""

from __future__ import annotations

from pathlib import Path

from megaloop.commands.options import checked_out, out_folder, staged
from megaloop.extras import require

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="a checkpoint as a transformers model folder "
        "(trust_remote_code, safetensors, tokenizer)",
    )
    p.add_argument(
        "source", help="a run directory or a checkpoints/step_* folder (any layout or engine)"
    )
    out_folder(p, "output folder: the transformers model", overwrite=True)
    p.add_argument(
        "--format",
        choices=("megaloop", "ouro"),
        default="megaloop",
        help="megaloop: our remote code, any variant; ouro: Ouro's names and "
        "config, loaded by its published code (Ouro's architecture only)",
    )
    p.set_defaults(fn=run)


def run(args) -> int:
    out = checked_out(args, args.source)
    require("eval", "megaloop export", ("transformers",))
    from megaloop.export import export
    from megaloop.ouro import export_ouro
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    with staged(out) as folder:
        (export_ouro if args.format == "ouro" else export)(Path(args.source), folder)
    code = " (Ouro's code from the hub)" if args.format == "ouro" else ""
    print(
        f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}, "
        f"trust_remote_code=True){code}"
    )
    return 0
