"""bench/repro_mini keeps working: its whole flow (prep, sweep, depth/halt/diagnose, report) at a
toy size on generated WikiText-like text (the full run takes ~30 minutes and is not run here)."""

import json
import subprocess

import pytest

from support import ROOT, bench_env, miniature_source


@pytest.mark.multiprocess  # two training processes at a time
def test_smoke_run_of_repro_mini_writes_the_report(tmp_path):
    source = miniature_source(tmp_path, seed=3)
    out = tmp_path / "report"
    env = bench_env(REPRO_SOURCE=source, REPRO_WORK=tmp_path / "work")
    proc = subprocess.run(
        [str(ROOT / "bench/repro_mini"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (out / "report.md").read_text()
    for variant in ("per_loop_norm", "per_loop_raw"):  # two seeds each, pooled
        assert f"| {variant} | 2 |" in text
    assert "No `megaloop" not in text
    # its inputs relative to the scratch folder (REPRO_WORK lies outside the repository here)
    assert str(tmp_path) not in text and "- run `runs/repro_mini/per_loop_norm/seed0`" in text
    assert {p.name for p in out.glob("*.png")} == {
        "ppl_vs_k.png",
        "frontier.png",
        "rollout.png",
        "scale_sweep.png",
        "norm_distribution.png",
    }
    info = json.loads((out / "repro_mini.json").read_text())
    assert info["smoke"] and info["variants"] == ["per_loop_norm", "per_loop_raw"]
    # the texts were linked, never copied
    links = tmp_path / "work/source"
    assert (links / "wiki.train.raw").resolve() == (source / "wiki.test.raw").resolve()
