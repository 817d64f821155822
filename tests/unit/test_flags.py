"""A command's flags are its settings dataclass's fields (megaloop/flags.py): every parser
offers each field once, with the field's default and choices, and builds the settings back."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from data_prep.config import ExecutorConfig, FineWebConfig, WikiTextConfig
from megaloop.cli import build_parser
from megaloop.commands.options import Deprecated, Renamed
from megaloop.evaluation.settings import (
    DepthSettings,
    DiagnoseSettings,
    DownstreamSettings,
    FixedKSettings,
    GenerateBenchSettings,
    GenerateSettings,
    HaltSettings,
)
from megaloop.flags import docstrings, flag_name, flag_of, flags, from_flags, shown

SETTINGS = {
    "depth": (DepthSettings,),
    "halt": (HaltSettings,),
    "diagnose": (DiagnoseSettings,),
    "bench fixed-k": (FixedKSettings,),
    "bench generate": (GenerateBenchSettings,),
    "eval downstream": (DownstreamSettings,),
    "generate": (GenerateSettings,),
    "prep wikitext103": (WikiTextConfig, ExecutorConfig),
    "prep fineweb": (FineWebConfig, ExecutorConfig),
}
"""Every command whose options are a settings dataclass's, and its dataclasses."""
LEAST = {
    "generate": ["m", "--prompt", "p"],
    "eval downstream": ["m", "--loops", "2", "--out", "o"],
    "prep wikitext103": ["--out", "o"],
    "prep fineweb": ["--out", "o", "--source", "s", "--tokenizer", "t", "--seq-len", "8"],
}
"""The least each command takes (a measurement: MODEL, --data and --out)."""


def parser_of(path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in path.split():
        (group,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = group.choices[word]
    return parser


@pytest.mark.parametrize("path", list(SETTINGS))
def test_every_option_is_a_settings_field_with_its_default_and_choices(path):
    actions = {
        a.dest: a
        for a in parser_of(path)._actions
        if not isinstance(a, (argparse._HelpAction, Deprecated, Renamed))
    }
    fields = [f for cls in SETTINGS[path] for f in flags(cls)]
    assert sorted(actions) == sorted(f.name for f in fields), "an option no field declares"
    for field in fields:
        action, flag = actions[field.name], flag_of(field)
        name = flag_name(field)
        assert (action.option_strings or [action.dest])[0] == name
        assert action.default in (shown(field), False if action.nargs == 0 else shown(field))
        if flag.choices is not None:
            assert list(action.choices) == list(flag.choices)
        assert action.help, f"{path} {name}: no help (a docstring or Flag.help)"


@pytest.mark.parametrize("path", [p for p in SETTINGS if not p.startswith("prep")])
def test_defaults_parse_back_to_the_dataclasses_defaults(path):
    """Each flag left at its default gives the field's own default: the comma list a tuple is
    shown as parses back to the tuple."""
    (cls,) = SETTINGS[path]
    words = LEAST.get(path, ["m", "--data", "d", "--out", "o"])
    settings = from_flags(cls, build_parser().parse_args([*path.split(), *words]))
    for field in flags(cls):
        flag = flag_of(field)
        if field.default is not dataclasses.MISSING and flag.parse and field.default:
            assert flag.parse(shown(field)) == field.default, field.name
        if field.name not in ("model", "data", "out", "loops", "prompt", "dtype"):
            assert getattr(settings, field.name) == field.default, field.name


def test_prep_builds_its_recipe_and_executor_from_flags():
    args = build_parser().parse_args(["prep", "fineweb", *LEAST["prep fineweb"], "--workers", "3"])
    config = args.prep_config.from_args(args)
    assert isinstance(config, FineWebConfig) and config.seq_len == 8
    assert config.execution == ExecutorConfig(workers=3)
    assert config.shard_size == FineWebConfig.__dataclass_fields__["shard_size"].default


def test_field_docstrings_are_read_over_the_class_and_its_bases():
    docs = docstrings(HaltSettings)
    assert docs["rho"].startswith("PPL budget")  # its own
    assert docs["data"].startswith("held-out tokens")  # Measurement's
    assert docs["out"] == "folder: writes OUT/halt.json and OUT/halt.md"  # redeclared
