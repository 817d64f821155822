"""The CPU compatibility layer: applied by entry points only, version-locked, each patch named."""

import re
from pathlib import Path

import megatron.core
import pytest

from megaloop import _cpu_compat

PACKAGE = Path(__file__).resolve().parent.parent / "megaloop"


def test_every_patch_names_a_megatron_core_file_and_line():
    for patch in _cpu_compat.PATCHES:
        assert re.search(r"[\w/]+\.py:\d+", patch.where), patch.where
        assert patch.replaces


def test_nothing_but_entry_points_imports_it():
    importers = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "_cpu_compat" in p.read_text() and p.name != "_cpu_compat.py"
    }
    assert importers == {"cli.py"}


def test_refuses_an_untested_megatron_core(monkeypatch):
    monkeypatch.setattr(_cpu_compat, "_applied", False)
    monkeypatch.setattr(_cpu_compat.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match=r"tested with megatron-core 0\.16\.1, but 0\.17\.0"):
        _cpu_compat.apply()


def test_does_nothing_when_cuda_is_present(monkeypatch):
    monkeypatch.setattr(_cpu_compat, "_applied", False)
    monkeypatch.setattr(_cpu_compat.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron.core, "__version__", "0.0.0")  # would be refused on a CPU
    _cpu_compat.apply()
    assert _cpu_compat._applied is False
