"""`megaloop generate MODEL (--prompt TEXT | --prompts FILE)`: text with per-token early exit."""

from __future__ import annotations

from megaloop.commands.options import deprecated, settings_flags
from megaloop.evaluation.settings import GenerateSettings
from megaloop.extras import require
from megaloop.flags import from_flags

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="text from a model, each new token stopping at its exit loop"
    )
    settings_flags(p, GenerateSettings)
    deprecated(p, "--json", "--out", dest="out")
    p.set_defaults(fn=run)


def run(args) -> int:
    settings = from_flags(GenerateSettings, args)
    require("eval", "megaloop generate", ("transformers",))
    from megaloop.evaluation import generation

    generation.run(settings)
    return 0
