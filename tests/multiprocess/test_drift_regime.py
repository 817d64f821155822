"""bench/drift_regime keeps working: its whole flow (prep, the grid of norm/raw pairs, the long
run, the measurements, the extra cells, the report) at a toy size on generated WikiText-like text
(the full run takes up to 2 hours and is not run here)."""

import json
import math
import subprocess

import pytest

from support import ROOT, bench_env, miniature_source


@pytest.mark.multiprocess  # two training processes at a time
def test_smoke_run_of_drift_regime_writes_the_report(tmp_path):
    source = miniature_source(tmp_path, seed=5)
    out = tmp_path / "report"
    env = bench_env(
        REPRO_SOURCE=source,
        DRIFT_WORK=tmp_path / "work",
        DRIFT_BUDGET_MIN="600",  # every step of the flow, however slow the machine
    )
    proc = subprocess.run(
        [str(ROOT / "bench/drift_regime"), "--smoke", "--out", str(out)],
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
    # the extra cells vary the most drifting one (wd0, tied or not at toy size), named for what
    # they run: the undecayed cell decays the matrices by 0.1
    best = max(info["cells"], key=lambda c: c["min_ratio"])["cell"]
    extra = [c["cell"] for c in info["extra_cells"]]
    assert extra == [f"{best}-L8", f"wd0.1-{best.removeprefix('wd0-')}-emb-undecayed"], extra
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
    assert f"| {best}-long/norm/seed0 |" in report  # the long run's local slopes
    assert "raw growth, last quarter" in report
    assert {p.name for p in out.glob("*.png")} == {
        "curves.png",
        "ratio.png",
        "curves_extra.png",
        "growth.png",
    }
    # the report reads only what the JSON holds: --report rewrites it the same from the JSON
    (out / "report.md").unlink()
    rerun = [str(ROOT / "bench/drift_regime"), "--report", "--out", str(out)]
    subprocess.run(rerun, check=True, capture_output=True, env=env, timeout=300)
    rewritten = (out / "report.md").read_text()
    assert "Rewritten from drift_regime.json alone" in rewritten
    assert rewritten.split("\n")[3:] == report.split("\n")[3:]  # all but the header


def test_growth_is_described_by_local_slopes_and_one_pooled_fit_up_to_each_peak():
    from bench import drift_regime_report

    steps = list(range(100, 1201, 100))
    law = {"eval_steps": steps, "eval_rms": [0.5 * s**1.5 for s in steps]}
    assert drift_regime_report.local_slopes(law) == pytest.approx([1.5] * 11)  # a law: one slope
    # seed 1 rises by the same law to its peak at 600 and falls after it: the fall is not fitted
    bent = [r if s <= 600 else law["eval_rms"][5] * 600 / s for s, r in zip(steps, law["eval_rms"])]
    fit = drift_regime_report.rising_fit({0: law, 1: {"eval_steps": steps, "eval_rms": bent}})
    assert fit["b"] == pytest.approx(1.5) and fit["a"] == pytest.approx(0.5)
    assert fit["r2"] == pytest.approx(1)
    assert [s for s, _ in fit["residuals"][1]] == [100, 200, 300, 400, 500, 600]
    assert all(abs(e) < 1e-9 for part in fit["residuals"].values() for _, e in part)
    # a curve that bends on log-log axes leaves residuals of one sign pattern: under, over, under
    curved = {"eval_steps": steps, "eval_rms": [math.exp(-((math.log(s) - 7) ** 2)) for s in steps]}
    residuals = [e for _, e in drift_regime_report.rising_fit({0: curved})["residuals"][0]]
    assert residuals[0] < 0 and max(residuals) > 0 and residuals[-1] < 0
    falling = {"eval_steps": steps, "eval_rms": [1000.0 / s for s in steps]}  # no rising part
    assert drift_regime_report.rising_fit({0: falling}) is None
