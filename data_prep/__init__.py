"""Data preparation recipes (datatrove pipelines), one module per corpus, run by `megaloop prep`.

The command-line options live here so that `megaloop --help` (and every training rank) does
not import datatrove; a corpus module is imported only when it runs. Each recipe's options are
a typed config (data_prep/config.py), whose fields are its flags (megaloop.flags).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

from data_prep.config import (
    DEFAULT_VOCAB,
    EOS,
    ExecutorConfig,
    FineWebConfig,
    Prepared,
    PrepError,
    RecipeConfig,
    WikiTextConfig,
)
from megaloop.flags import add_flags

__all__ = [
    "DEFAULT_VOCAB",
    "EOS",
    "ExecutorConfig",
    "FineWebConfig",
    "PrepError",
    "Prepared",
    "RecipeConfig",
    "WikiTextConfig",
    "config_from_args",
    "prepared",
    "run",
]


def _corpus(sub, config: type[RecipeConfig], help: str):
    module = importlib.util.find_spec(f"data_prep.{config.recipe}")
    doc = _module_doc(module.origin)
    p = sub.add_parser(
        config.recipe,
        help=help,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(prep_config=config)
    return p


def _module_doc(path: str) -> str:
    import ast

    with open(path) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def add_parsers(sub) -> list[argparse.ArgumentParser]:
    """A parser per recipe: its config's flags, then the executor's."""
    parsers = []
    for config, help in (
        (WikiTextConfig, "WikiText-103 → megatron-core indexed datasets"),
        (FineWebConfig, "web text → filtered, packed webdataset shards"),
    ):
        p = add_flags(_corpus(sub, config, help), config)
        add_flags(p.add_argument_group("execution (datatrove)"), ExecutorConfig)
        parsers.append(p)
    return parsers


def config_from_args(args: argparse.Namespace) -> RecipeConfig:
    """The typed config of `megaloop prep NAME ...`: the one place flags become a config."""
    return args.prep_config.from_args(args)


def run(config: RecipeConfig) -> dict:
    """Run one recipe; returns what it wrote in its manifest(s)."""
    return importlib.import_module(f"data_prep.{config.recipe}").prepare(config)


def prepared(config: RecipeConfig) -> Prepared | None:
    """What config.out holds once the recipe has finished there; None while it has not (Slurm
    tasks still queued or running)."""
    return importlib.import_module(f"data_prep.{config.recipe}").prepared(config)
