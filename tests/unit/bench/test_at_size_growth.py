"""The study benches' growth per step (bench/common/study.py), on a norm that grows by a known
rate: between two marks whose 5-step windows are full, (ln L2(b) - ln L2(a)) / (b - a) is that
rate exactly; and bench/study_at_size's precision and verdict table."""

import math

import pytest

from bench import study_at_size
from bench.common import study
from support import ROOT


def test_growth_per_step_is_the_rate_of_an_exponential_norm():
    rate, steps = 0.03, list(range(1, 61))  # 60 steps: mark 100 is past the run
    t = {
        "train_steps": steps,
        "train_l2_loops": [[math.exp(rate * s), 2 * math.exp(rate * s)] for s in steps],
    }
    g = study.growth(t, (1, 10, 50, 100))
    assert g["marks"] == [1, 10, 50]
    window = sum(math.exp(rate * s) for s in range(46, 51)) / 5  # steps 46..50
    assert g["l2"][0][2] == pytest.approx(window) and g["l2"][1][2] == pytest.approx(2 * window)
    assert g["l2"][0][0] == pytest.approx(math.exp(rate))  # one step logged by step 1
    for k in (0, 1):
        assert g["per_step"][k][1] == pytest.approx(rate)  # 10 -> 50: full windows
        assert g["per_step"][k][0] < rate  # 1 -> 10: step 1's L2 against a 6..10 mean


def test_the_runs_train_in_the_presets_bf16_unless_fp32_is_asked_for(monkeypatch):
    """No STUDY_PRECISION: the preset's bf16, so precision is not an override; fp32 is one."""
    assert study_at_size.PRECISION == "bf16"  # this test process sets no STUDY_PRECISION
    assert not any(o.startswith("train.bf16") for o in study_at_size.AT_SIZE)
    monkeypatch.setenv("STUDY_PRECISION", "fp32")
    import importlib

    try:
        importlib.reload(study)
        assert "train.bf16=false" in importlib.reload(study_at_size).AT_SIZE
    finally:
        monkeypatch.delenv("STUDY_PRECISION")
        importlib.reload(study)
        importlib.reload(study_at_size)


def test_the_verdict_table_gains_the_long_miniatures_column_once_it_has_run(tmp_path, monkeypatch):
    """The cross-scale table reads docs/study_mini_long's figures at its last step, penalty and
    final-norm rows included, and has no such column before that bench has run."""
    import json

    info = json.loads((ROOT / "docs/study_at_size/study_at_size.json").read_text())
    monkeypatch.setattr(study_at_size, "ROOT", tmp_path)
    study_at_size.write_report(info, tmp_path)
    assert "2000 steps" not in (tmp_path / "report.md").read_text()

    run = {"l2_first": 10.0, "l2_last": 50.0, "l2_final": 50.0}
    figures = {
        "per_loop_norm": {"42": {**run, "ppl": {"1": 100.0, "4": 100.0}, "ppl4": 100.0}},
        "final_norm": {"42": {**run, "ppl": {"1": 150.0, "4": 90.0}, "ppl4": 90.0}},
    }
    long = tmp_path / "docs/study_mini_long"
    long.mkdir(parents=True)
    (long / "study_mini_long.json").write_text(
        json.dumps({"steps": 2000, "figures": {"250": {}, "2000": figures}})
    )
    study_at_size.write_report(info, tmp_path)
    text = (tmp_path / "report.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| claim |"))
    assert "| d = 96, 2000 steps | 44m, 300 steps |" in header
    final_norm = next(line for line in text.splitlines() if line.startswith("| final_norm stays"))
    assert "| 0.9 (seeds 42): **follows** | – | – |" in final_norm
