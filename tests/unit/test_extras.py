"""A command whose optional dependency is missing says which extra installs it (pyproject.toml),
before it reads or writes anything."""

import pytest

from megaloop import extras
from megaloop.cli import main
from multiproc import BASE
from support import TINY


@pytest.fixture
def without(monkeypatch):
    def hide(*modules):
        real = extras.available
        monkeypatch.setattr(extras, "available", lambda m: m not in modules and real(m))

    return hide


@pytest.mark.parametrize(
    "modules, argv, extra",
    [
        (("transformers",), ["export", "{tmp}/run", "--out", "{tmp}/out"], "eval"),
        (
            ("lm_eval",),
            ["eval", "downstream", "{tmp}/m", "--loops", "4", "--out", "{tmp}/out"],
            "eval",
        ),
        (
            ("transformers",),
            ["depth", "{tmp}/out", "--data", "{tmp}/x.txt", "--out", "{tmp}/o"],
            "eval",
        ),
        (("datatrove",), ["prep", "wikitext103", "--out", "{tmp}/out"], "prep"),
        (
            ("deepspeed",),
            ["train", TINY, *BASE, "engine=deepspeed", "train.dir={tmp}/out"],
            "deepspeed",
        ),
    ],
)
def test_a_missing_extra_is_named_before_anything_is_written(
    without, tmp_path, capsys, modules, argv, extra
):
    without(*modules)
    code = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert f"needs {modules[0]}" in err and f"pip install 'megaloop[{extra}]'" in err
    assert not (tmp_path / "out").exists()
