"""The CPU compatibility layer: applied by entry points only, version-locked, each patch named;
and the version guard the megatron engine's own patch shares with it."""

import re
import sys

import pytest
import torch

from megaloop import _cpu_compat
from megaloop.parallel import versions
from support import ROOT

PACKAGE = ROOT / "megaloop"


def test_every_patch_names_a_file_and_line_of_a_version_locked_library():
    for patch in _cpu_compat.PATCHES:
        assert re.search(r"[\w/]+\.py:\d+", patch.where), patch.where
        assert patch.replaces and patch.library in versions.TESTED
    assert {p.library for p in _cpu_compat.PATCHES} == {"megatron-core", "deepspeed"}


def test_nothing_but_entry_points_imports_it():
    importers = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "_cpu_compat" in p.read_text() and p.name != "_cpu_compat.py"
    }
    assert importers == {"cli.py", "commands/demo.py"}  # demo: its worker processes


TESTED = {"megatron-core": "0.16.1", "deepspeed": "0.19.8"}


def test_the_tested_versions_are_the_pinned_ones():
    root = PACKAGE.parent
    pins = (root / "requirements.txt").read_text() + (root / "pyproject.toml").read_text()
    assert versions.TESTED == TESTED
    for distribution, version in TESTED.items():
        assert f"{distribution}=={version}" in pins
        assert versions.installed(distribution) == version


@pytest.mark.parametrize("distribution", ["megatron-core", "deepspeed"])
def test_refuses_an_untested_version_naming_both(distribution):
    fake = {**TESTED, distribution: "9.9.9"}
    with pytest.raises(
        versions.UntestedVersion,
        match=rf"CPU compatibility layer was tested with {distribution} "
        rf"{re.escape(TESTED[distribution])}, but 9\.9\.9 is installed.*"
        rf"Install {distribution}=={re.escape(TESTED[distribution])}",
    ):
        _cpu_compat.check_versions(fake)
    _cpu_compat.check_versions(TESTED)
    _cpu_compat.check_versions({**TESTED, "deepspeed": None})  # not installed: nothing to patch


def test_apply_refuses_before_any_patch_applies(monkeypatch):
    applied = []
    monkeypatch.setattr(_cpu_compat, "_applied", False)
    monkeypatch.setattr(_cpu_compat.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        _cpu_compat, "installed", lambda d: "0.17.0" if d == "deepspeed" else "0.16.1"
    )
    monkeypatch.setattr(
        _cpu_compat, "PATCHES", [_cpu_compat.Patch("x.py:1", "x", lambda: applied.append(1))]
    )
    with pytest.raises(versions.UntestedVersion, match=r"deepspeed 0\.19\.8, but 0\.17\.0"):
        _cpu_compat.apply()
    assert applied == [] and _cpu_compat._applied is False


def test_the_megatron_engine_refuses_an_untested_megatron_core_before_building(monkeypatch):
    from megaloop.parallel import megatron

    monkeypatch.setattr(megatron, "installed", lambda d: "0.17.0")
    with pytest.raises(
        versions.UntestedVersion, match=r"megatron engine was tested with megatron-core 0\.16\.1"
    ):
        megatron.MegatronEngine(cfg=None, seq_len=0, micro_batch_size=0)


def test_a_patch_of_a_lazy_module_runs_once_it_is_imported(tmp_path, monkeypatch):
    (tmp_path / "megaloop_probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    _cpu_compat._AfterImport("megaloop_probe_module", lambda m: seen.append(m.VALUE)).install()
    assert seen == []
    import megaloop_probe_module  # noqa: F401

    assert seen == [1]
    assert not [f for f in sys.meta_path if getattr(f, "name", "") == "megaloop_probe_module"]
    _cpu_compat._AfterImport("megaloop_probe_module", lambda m: seen.append(2)).install()
    assert seen == [1, 2]  # already imported: runs at once
    del sys.modules["megaloop_probe_module"]


def test_does_nothing_when_cuda_is_present(monkeypatch):
    monkeypatch.setattr(_cpu_compat, "_applied", False)
    monkeypatch.setattr(_cpu_compat.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_cpu_compat, "installed", lambda d: "0.0.0")  # refused on a CPU
    _cpu_compat.apply()
    assert _cpu_compat._applied is False


def test_megatron_cores_fusions_stay_eager_and_import_no_compiler():
    """A fresh process: after apply(), megatron-core's jit_fuser hands a function back unchanged
    and neither torch._dynamo nor inductor has been imported (they cost ~2.5 s a process)."""
    import subprocess

    code = (
        "import sys; from megaloop import _cpu_compat; _cpu_compat.apply(); "
        "import megaloop.parallel.megatron; from megatron.core import jit; "
        "f = lambda x: x; "
        "print(jit.jit_fuser(f) is f, 'torch._dynamo' in sys.modules, "
        "'torch._inductor' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "False"], out.stdout


def test_checkpoint_results_stay_in_the_saving_process(tmp_path):
    """megatron-core gathers a save's results through a spawned manager, a fresh interpreter
    that imports torch in every saving process; here the queue is an in-process one, and a save
    still completes with it (tests/unit/train/test_checkpoint.py resumes from such saves)."""
    import multiprocessing
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megaloop.safe_load import untrusted

    before = set(multiprocessing.active_children())
    results = filesystem_async._get_write_results_queue()
    assert type(results) is queue.Queue and filesystem_async._get_write_results_queue() is results
    weight = torch.arange(6.0).reshape(2, 3)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path))
    assert set(multiprocessing.active_children()) == before and results.empty()
    with untrusted(tmp_path):
        loaded = dist_checkpointing.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}, str(tmp_path)
        )
    assert torch.equal(loaded["w"], weight)
