"""`python -m bench final_norm_scale` keeps working: its flow (prep, the tied and untied
final_norm runs, the per-run measurement, the table) at a toy size on generated WikiText-like
text."""

import json
import math
import subprocess
import sys

import pytest

from support import ROOT, bench_env, miniature_source


@pytest.mark.multiprocess  # two training processes at a time
def test_smoke_run_of_final_norm_scale_writes_its_table(tmp_path):
    source = miniature_source(tmp_path, seed=11)
    out = tmp_path / "out"
    env = bench_env(REPRO_SOURCE=source, FINAL_NORM_WORK=tmp_path / "work")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "final_norm_scale", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "final_norm_scale.json").read_text())
    assert sorted(results) == ["tied/seed0", "tied/seed1", "untied/seed0", "untied/seed1"]
    for r in results.values():
        assert len(r["ce"]) == 4 and all(math.isfinite(c) for c in r["ce"])
        assert r["ppl"] == pytest.approx([math.exp(c) for c in r["ce"]])
        assert r["ce_at_t_star"] <= r["ce"][3] + 1e-9  # t = 1 is on the grid
        assert r["gamma_mean"] > 0 and r["rms"][3] > 0
    table = (out / "final_norm_scale.md").read_text()
    assert table.count("| tied/seed") == 2 and table.count("| untied/seed") == 2
