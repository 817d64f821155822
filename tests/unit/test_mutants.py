"""The mutation check's patches stay live: each applies to today's tree and names tests that
exist, so a mutant goes stale here, in the fast tier, not silently in tests/mutants/run.py."""

import importlib.util
import re
import subprocess
import sys

import pytest

from support import ROOT

_spec = importlib.util.spec_from_file_location("mutants_run", ROOT / "tests/mutants/run.py")
mutants_run = sys.modules["mutants_run"] = importlib.util.module_from_spec(_spec)  # dataclasses
_spec.loader.exec_module(mutants_run)

PATCHES = sorted((ROOT / "tests/mutants").glob("*.patch"))


def test_there_are_mutants():
    assert len(PATCHES) >= 17


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_each_mutant_applies_and_names_existing_tests(patch):
    mutant = mutants_run.Mutant.read(patch)
    assert mutant.behaviour and mutant.tier in ("in-process", "multiprocess")
    check = subprocess.run(
        ["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode == 0, f"{patch.name} no longer applies: {check.stderr}"
    for node in mutant.tests:
        path, _, name = node.partition("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{node} does not exist"
