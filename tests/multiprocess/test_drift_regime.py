"""bench/drift_regime keeps working: its whole flow (prep, the grid of norm/raw pairs, the long
run, the measurements, the extra cells, the report) at a toy size on generated WikiText-like text
(the full run takes up to 2 hours and is not run here)."""

import json
import math
import os
import subprocess
import sys

import pytest

from support import ROOT, miniature_source


@pytest.mark.multiprocess  # two training processes at a time
def test_smoke_run_of_drift_regime_writes_the_report(tmp_path):
    source = miniature_source(tmp_path, seed=5)
    out = tmp_path / "report"
    env = {
        **os.environ,
        "SMOKE": "1",
        "REPRO_SOURCE": str(source),
        "DRIFT_WORK": str(tmp_path / "work"),
        "DRIFT_BUDGET_MIN": "600",  # every step of the flow, however slow the machine
        "PYTHON": sys.executable,
    }
    proc = subprocess.run(
        [str(ROOT / "bench/drift_regime"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped" not in proc.stdout, proc.stdout
    info = json.loads((out / "drift_regime.json").read_text())
    assert info["invocations"] == 1 and 0 < info["wall_minutes"] <= info["minutes"]
    assert info["smoke"] and [c["cell"] for c in info["cells"]] == [
        "wd0-tied-lr0.01",
        "wd0-untied-lr0.01",
    ]
    for cell in info["cells"]:
        for readout in ("norm", "raw"):
            finals = cell[readout]["final_rms"]
            assert len(finals) == 2 and all(x > 0 and math.isfinite(x) for x in finals), cell
        assert cell["ratios"] == pytest.approx(
            [n / r for n, r in zip(cell["norm"]["final_rms"], cell["raw"]["final_rms"])]
        )
        assert cell["drifts"] == (min(cell["ratios"]) >= 5)
    extra = [c["cell"].rsplit("-", 1)[-1] for c in info["extra_cells"]]
    assert extra == ["L8", "undecayed"], extra
    # a fit needs 3 logged steps between the warmup and the peak: at toy size there may be none
    for name, fit in info["fits"].items():
        assert fit["steps"] == (info["long_steps"] if "-long/" in name else info["steps"]), name
        assert math.isfinite(fit["b"]) and fit["rms_at_44m_steps"] > 0, name
        assert fit["fit_steps"][1] == fit["peak_step"], name
    long_curves = [c for name, c in info["curves"].items() if "-long/" in name]
    assert len(long_curves) == 2 and all(
        c["eval_steps"][-1] == info["long_steps"] for c in long_curves
    )
    measured = info["consequences"]
    assert {m["run"].split("/")[1] for m in measured} == {"norm", "raw"} and len(measured) >= 4
    for m in measured:
        assert m["ppl"]["1"] > 1 and 1 <= m["halt_mean_loops"] <= 4
        # a norm readout's radial share is a rounding floor, bf16's above fp32's
        if "/norm/" in m["run"]:
            assert m["r_bf16"][-1] > m["r_fp32"][-1]
    report = (out / "report.md").read_text()
    assert "| wd0-tied-lr0.01 | 2 |" in report and "RMS 1,733" in report
    assert {p.name for p in out.glob("*.png")} == {
        "curves.png",
        "ratio.png",
        "curves_extra.png",
        "long.png",
    }


def test_growth_law_is_fitted_to_the_growth_phase_up_to_the_peak():
    sys.path.insert(0, str(ROOT / "bench"))
    import drift_regime

    steps = list(range(20, 1201, 20))
    rms = [0.5 * s**1.5 if s <= 600 else 0.5 * 600**1.5 * (600 / s) for s in steps]
    fit = drift_regime.power_law({"steps": steps, "rms": rms, "warmup": 100})
    assert fit["b"] == pytest.approx(1.5) and fit["a"] == pytest.approx(0.5)
    assert fit["fit_steps"] == [100, 600] and fit["peak_step"] == 600
    assert fit["peak_rms"] == pytest.approx(0.5 * 600**1.5) and fit["last_rms"] == rms[-1]
    assert fit["rms_at_44m_steps"] == pytest.approx(0.5 * drift_regime.STEPS_44M**1.5)
    falling = [1000.0 / s for s in steps]  # peaks at the first step: no growth phase
    assert drift_regime.power_law({"steps": steps, "rms": falling, "warmup": 100}) is None
