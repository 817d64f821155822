"""The spec tables of model/modes.py and objectives/: every kind of exit rule, KV policy and
objective is one entry, complete, and every command offers exactly the entries."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import get_args

import pytest

from megaloop.cli import build_parser
from megaloop.evaluation.settings import EXITS, EvalError, GenerateBenchSettings, HaltSettings
from megaloop.model.modes import EXIT_RULES, KV_POLICIES, EarlyExit, KVPolicy
from megaloop.objectives import OBJECTIVES, ObjectiveConfig


def choices(path: tuple, flag: str):
    """The action of `flag` in the command at `path` of megaloop's parser."""
    parser = build_parser()
    for name in path:
        (group,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = group.choices[name]
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return action


@pytest.mark.parametrize("table", [EXIT_RULES, KV_POLICIES, OBJECTIVES])
def test_every_entry_fills_every_field(table):
    for name, spec in table.items():
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if field.default is dataclasses.MISSING:  # what the entry must say
                assert value not in (None, "", ()), f"{name}: {field.name} is empty"


def test_exit_rules_thresholds_lie_in_their_scores_range():
    for name, rule in EXIT_RULES.items():
        low, high = rule.bounds
        assert low < high, name
        assert list(rule.thresholds) == sorted(set(rule.thresholds)), name
        assert all(low < t <= high and math.isfinite(t) for t in rule.thresholds), name


def test_the_mode_types_are_the_tables_names():
    assert get_args(EarlyExit) == ("none", *EXIT_RULES)
    assert get_args(KVPolicy) == tuple(KV_POLICIES)


def test_every_command_offers_exactly_the_specs_exit_rules_and_kv_policies():
    assert set(choices(("eval", "downstream"), "--exit").choices) == set(EXIT_RULES)
    assert set(choices(("halt",), "--exit").choices) == set(EXIT_RULES)
    assert (
        set(choices(("generate",), "--exit").choices)
        == set(EXITS)
        == {
            *EXIT_RULES,
            "fixed",
            "none",
        }
    )
    assert set(choices(("generate",), "--kv").choices) == set(KV_POLICIES)
    assert choices(("bench", "generate"), "--kv").default.split(",") == list(KV_POLICIES)
    for rule in EXIT_RULES:  # bench generate's --exit is a list, checked by its settings
        GenerateBenchSettings(model="m", data="d", rules=(rule,))
        HaltSettings(model="m", data="d", rule=rule)
        assert rule in choices(("generate",), "--exit").help
    with pytest.raises(EvalError, match="give one or more of " + ", ".join(EXIT_RULES)):
        GenerateBenchSettings(model="m", data="d", rules=("nonesuch",))


def test_the_objective_kinds_are_the_tables():
    for kind in OBJECTIVES:
        ObjectiveConfig(kind=kind).validate()
    hint = ObjectiveConfig.__dataclass_fields__["kind"].type
    assert hint == "ObjectiveKind"
    from megaloop.objectives import ObjectiveKind

    assert get_args(ObjectiveKind) == tuple(OBJECTIVES)
