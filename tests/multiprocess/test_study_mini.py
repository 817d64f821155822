"""bench/study_mini and bench/drift_drivers keep working: their whole flow (the study's word
tokens, training two at a time, depth/halt/diagnose in bf16, the reports and verdicts) at a toy
size on generated WikiText-like text (the full runs take ~3 hours together and are not run
here); the reported norms are the runs' own."""

import json
import math
import subprocess

import pytest

from megaloop.train.metrics import read
from support import ROOT, bench_env, miniature_source


def bench(name: str, out, env, *flags: str) -> None:
    proc = subprocess.run(
        [str(ROOT / "bench" / name), "--smoke", *flags, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


JSON_REL = 1e-5
"""The benches' JSON keeps 6 significant digits (bench/common/report.py's write_json): a value
read back is within 5e-6 of the one computed, and a ratio of two such within 1e-5."""


@pytest.mark.multiprocess  # two training processes at a time
def test_smoke_runs_of_study_mini_and_drift_drivers(tmp_path):
    source = miniature_source(tmp_path, seed=4)
    work = tmp_path / "work"
    env = bench_env(REPRO_SOURCE=source, STUDY_WORK=work)
    study = tmp_path / "study"
    bench("study_mini", study, env)
    info = json.loads((study / "study_mini.json").read_text())
    manifest = json.loads((work / "data/train.manifest.json").read_text())
    assert manifest["layout"] == "stream" and info["vocab"] == manifest["vocab_size"]
    for row in ("per_loop_norm", "per_loop_raw"):
        for seed in (42, 101):  # the released seeds
            run = work / "runs/study" / row / f"seed{seed}"
            m = read(run)
            assert m["config"]["model"]["init"] == "pytorch"
            assert m["config"]["data"]["stride"] == info["stride"]
            final = m["evals"][-1]
            l2 = math.sqrt(info["width"]) * final["hidden_rms"][-1]  # the study's unit
            assert info["trajectories"][row][str(seed)]["final_l2"] == pytest.approx(
                l2, rel=JSON_REL
            )
            measured = work / "measure/study" / row / f"seed{seed}"
            diagnose = json.loads((measured / "diagnose.json").read_text())
            assert diagnose["settings"]["dtype"] == "bfloat16"
    claim = next(c for c in info["summary"]["claims"] if c["row"] == "per_loop_norm")
    norm, raw = info["trajectories"]["per_loop_norm"], info["trajectories"]["per_loop_raw"]
    expected = [norm[s]["final_l2"] / raw[s]["final_l2"] for s in ("42", "101")]
    assert claim["ratios"] == pytest.approx(expected, rel=JSON_REL)
    hit = all(r >= 5 for r in expected)
    assert (claim["verdict"] == "reproduced") == hit
    report = (study / "report.md").read_text()
    assert "| per_loop_norm | 2 |" in report and "## Verdicts" in report
    assert (study / "growth.png").is_file() and (study / "measurements/report.md").is_file()
    measurements = (study / "measurements/report.md").read_text()
    assert str(tmp_path) not in measurements  # its paths relative to STUDY_WORK
    assert "(model `runs/study/per_loop_norm/seed42`)" in measurements
    # --report rewrites the report from the JSON alone: the same text, once the runs are gone
    (study / "growth.png").unlink()
    (study / "report.md").rename(study / "report.first.md")
    bench("study_mini", study, {**env, "STUDY_WORK": str(tmp_path / "gone")}, "--report")
    assert (study / "report.md").read_text() == report and (study / "growth.png").is_file()

    drivers = tmp_path / "drivers"
    bench("drift_drivers", drivers, env)
    result = json.loads((drivers / "drift_drivers.json").read_text())
    cells = {c["cell"]: c for c in result["cells"]}
    assert set(cells) == {"study", "megatron-init"}
    # the study cell is bench/study_mini's runs, read at the same step
    for readout in ("norm", "raw"):
        for seed in ("42", "101"):
            got = cells["study"]["readouts"][readout][seed]["final_l2"]
            assert got == pytest.approx(
                info["trajectories"][f"per_loop_{readout}"][seed]["final_l2"], rel=JSON_REL
            )
    run = work / "runs/drivers/megatron-init/norm/seed42"
    assert read(run)["config"]["model"]["init"] == "megatron"
    assert [o["cell"] for o in result["onset"]] == ["lr0.0048"]
    assert "## The onset in docs/drift_regime's regime" in (drivers / "report.md").read_text()
    assert (drivers / "ratios.png").is_file() and (drivers / "growth.png").is_file()
