"""`megaloop prep CORPUS ...`: prepare a corpus with datatrove (the recipes: data_prep/), then
say what the folder holds and the command that trains on it."""

from __future__ import annotations

import shlex
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

    config = data_prep.config_from_args(args)
    try:
        data_prep.run(config)
    except PrepError as e:
        print(f"megaloop prep: error: {e}", file=sys.stderr)
        return 2
    done = data_prep.prepared(config)
    if done is not None:
        print(summary(done))
    return 0


def summary(done) -> str:
    """A data_prep.Prepared in a paragraph: the folder, what it holds, its vocabulary, and the
    `megaloop train` command that reads it (the overrides where the experiment's own values
    differ)."""
    return (
        f"megaloop prep: {done.out} holds {done.holds}; a vocabulary of {done.vocab_size:,} "
        f"tokens.\nnext: {shlex.join(['megaloop', 'train', *train_command(done)])}"
    )


def train_command(done) -> list[str]:
    """The experiment and the overrides that train it on the prepared folder."""
    from megaloop import experiment

    cfg = experiment.load(done.config)
    overrides = [
        f"data.{key}={'null' if value is None else value}"
        for key, value in done.data.items()
        if getattr(cfg.data, key) != value
    ]
    if cfg.model.vocab_size != done.vocab_size:
        overrides.append(f"model.vocab_size={done.vocab_size}")
    return [done.config, *overrides]
