"""`megaloop prep CORPUS ...`: prepare a corpus with datatrove (the recipes: data_prep/)."""

from __future__ import annotations

import sys

from megaloop.extras import require

BUILDS_MODEL = False


def add_parser(sub) -> None:
    import data_prep

    p = sub.add_parser("prep", help="prepare a corpus with datatrove (wikitext103, fineweb)")
    corpora = p.add_subparsers(dest="corpus", required=True, metavar="CORPUS")
    for recipe in data_prep.add_parsers(corpora):
        recipe.set_defaults(fn=run)


def run(args) -> int:
    require("prep", "megaloop prep")
    import data_prep
    from data_prep.common import PrepError

    try:
        data_prep.run(data_prep.config_from_args(args))
    except PrepError as e:
        print(f"megaloop prep: error: {e}", file=sys.stderr)
        return 2
    return 0
