"""docs/config.md, the config-key reference, is the generator's output for the code as it is, and
the generator leaves out no field: a new config field fails here until the page is regenerated."""

import dataclasses
import re
import typing

import pytest

from megaloop import config_reference
from megaloop.config import Config
from megaloop.data import KINDS, DataConfig
from megaloop.experiment import ExperimentConfig
from support import ROOT

PAGE = ROOT / config_reference.PAGE
ROW_KEY = re.compile(r"^\| `([^`]+)` \|", re.M)


def config_keys(cls: type, prefix: str = ""):
    """Every dotted key under `cls`, every data kind's included: walked here, apart from the
    generator's own walk, so that a key the generator skips shows."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if hint is DataConfig:
            for kind in KINDS.values():
                yield from config_keys(kind, f"{prefix}{f.name}.")
        elif isinstance(hint, type) and issubclass(hint, Config):
            yield from config_keys(hint, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def config_classes(cls: type = Config):
    """Every config section megaloop defines (the tests' own classes left out)."""
    for sub in cls.__subclasses__():
        if sub.__module__.startswith("megaloop."):
            yield sub
        yield from config_classes(sub)


def test_the_committed_page_is_the_generators_output():
    regenerate = f"regenerate it: `{config_reference.REGENERATE}` ({config_reference.COMMAND})"
    if not PAGE.is_file():
        pytest.fail(f"{config_reference.PAGE} is missing; {regenerate}")
    committed = PAGE.read_text().splitlines()
    expected = config_reference.render().splitlines()
    if committed != expected:
        line = next(
            (i for i, (a, b) in enumerate(zip(committed, expected)) if a != b),
            min(len(committed), len(expected)),
        )
        pytest.fail(
            f"{config_reference.PAGE} is stale (it differs from the config dataclasses from "
            f"line {line + 1} on); {regenerate}"
        )


def test_every_key_of_every_section_is_on_the_page():
    documented = set(ROW_KEY.findall(config_reference.render()))
    missing = sorted(set(config_keys(ExperimentConfig)) - documented)
    assert not missing, f"keys missing from the reference: {missing}"
    leaves = {key.rsplit(".", 1)[-1] for key in documented}
    for cls in config_classes():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            nested = isinstance(hints[f.name], type) and issubclass(hints[f.name], Config)
            assert nested or f.name in leaves, (
                f"{cls.__module__}.{cls.__name__}.{f.name} is on no row of the reference: is "
                f"{cls.__name__} a section of ExperimentConfig?"
            )


def test_rows_carry_the_types_defaults_and_docstrings():
    page = config_reference.render()
    assert "| `train.eval_batches` | int or `all` | `4` | Validation micro-batches:" in page
    assert "| `model.readout` | `norm`, `raw`, `final_norm` or `last_norm` | `norm` |" in page
    assert "| `train.scale_alarm.window` | int | `100` | Steps over which" in page
    assert "| `data.stride` | int or `null` | `null` | The study's samples:" in page
