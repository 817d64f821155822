"""bench/study_mini_long keeps working: its whole flow (the miniature's rows trained two at a
time with a checkpoint kept at every save, depth and halt of the checkpoints it measures,
diagnose of the last, the report) at a toy size on generated WikiText-like text; the depth use
and growth it reports are recomputed here from the runs' and measurements' own records."""

import json
import math
import subprocess

import pytest

from megaloop.train.metrics import read
from support import ROOT, bench_env, miniature_source

JSON_REL = 1e-5  # the JSON keeps 6 significant digits (study_mini.write_json)
MEASURE_AT, STEPS, MARKS = (4, 8), 8, (1, 2, 4, 6, 8)  # the bench's --smoke sizes


@pytest.mark.multiprocess  # two training processes at a time
def test_smoke_run_of_study_mini_long(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    env = bench_env(
        STUDY_PRECISION="fp32", REPRO_SOURCE=miniature_source(tmp_path, seed=6), STUDY_WORK=work
    )
    script = str(ROOT / "bench/study_mini_long")
    proc = subprocess.run(
        [script, "--smoke", "--out", str(out)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((out / "study_mini_long.json").read_text())
    assert info["rows"] == {
        "per_loop_norm": [42, 101],
        "per_loop_raw": [42, 101],
        "per_loop_norm_penalty": [42],
        "final_norm": [42],
    }
    for row, seeds in info["rows"].items():
        for seed in seeds:
            run_dir = work / "runs/long" / row / f"seed{seed}"
            run = read(run_dir)
            assert run["steps"][-1]["step"] == STEPS and run["config"]["train"]["bf16"] is False
            assert run["config"]["train"]["global_batch_size"] == 8  # LONG: half the miniature's
            for step in MEASURE_AT:  # every measured checkpoint was kept and measured
                assert (run_dir / "checkpoints" / f"step_{step:07d}").is_dir()
                measured = work / "measure/long" / row / f"seed{seed}" / f"step_{step:07d}"
                depth = json.loads((measured / "depth.json").read_text())
                assert depth["model"]["step"] == step
                ppl = {r["loops"]: r["ppl"] for r in depth["rows"]}
                halt = json.loads((measured / "halt.json").read_text())
                use = info["depth_use"][row][str(seed)][str(step)]
                assert use["k1_over_k4"] == pytest.approx(ppl[1] / ppl[4], rel=JSON_REL)
                mean_loops = halt["benchmark"]["dynamic"]["mean_loops"]
                assert use["halt_mean_loops"] == pytest.approx(mean_loops, rel=JSON_REL)
                assert (measured / "diagnose.json").is_file() == (step == STEPS)
            # the growth, from the run's own per-step records: 5-step means at each mark
            d = run["config"]["model"]["hidden_size"]
            final = {r["step"]: math.sqrt(d) * r["hidden_rms"][-1] for r in run["steps"]}
            l2 = [sum(final[s] for s in final if m - 5 < s <= m) / min(m, 5) for m in MARKS]
            g = info["growth"][row][str(seed)]
            assert g["l2"][-1] == pytest.approx(l2, rel=JSON_REL)
            rate = math.log(l2[-1] / l2[-2]) / (MARKS[-1] - MARKS[-2])
            assert g["per_step"][-1][-1] == pytest.approx(rate, rel=1e-4, abs=1e-6)
    report = (out / "report.md").read_text()
    assert "**SMOKE run" in report
    (drift,) = [line for line in report.splitlines() if line.startswith("| per-loop CE th")]
    assert drift.count("**") == 4  # a verdict at the first measured step and at the last
    for name in ("growth.png", "depth_use.png", "measurements/report.md"):
        assert (out / name).is_file(), name
    assert str(tmp_path) not in (out / "measurements/report.md").read_text()
    (out / "report.md").unlink()
    again = subprocess.run(
        [script, "--report", "--out", str(out)], capture_output=True, text=True, env=env
    )
    assert again.returncode == 0 and (out / "report.md").read_text() == report
