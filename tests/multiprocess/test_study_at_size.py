"""bench/study_at_size keeps working: its whole flow (the study's word tokens, the 44M and 129M
presets' rows trained two at a time, depth/halt/diagnose in bf16, the report) at a toy size on
generated WikiText-like text; every run is the preset but for the overrides the report lists,
and the figures it reports are recomputed here from the runs' own records."""

import json
import math
import subprocess

import pytest

from megaloop import experiment
from megaloop.train.metrics import read
from support import ROOT, bench_env, miniature_source

JSON_REL = 1e-5  # the JSON keeps 6 significant digits (study_mini.write_json)
ALLOWED = {
    "train.bf16",
    "train.micro_batch_size",
    "train.global_batch_size",
    "train.eval_every",
    "train.eval_batches",
    "train.log_every",
    "train.save_every",
    "wandb.mode",
}
"""What issue 55 lets the runs change: batch, steps, evaluation cadence, precision (and what is
logged and saved)."""
SMOKE_MODEL = {
    f"model.{k}"
    for k in (
        "hidden_size",
        "num_heads",
        "num_layers",
        "ffn_hidden_size",
        "max_seq_len",
        "vocab_size",
    )
} | {"data.seq_len", "data.stride"}


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.multiprocess  # two training processes at a time
def test_smoke_run_of_study_at_size(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    env = bench_env(
        STUDY_PRECISION="fp32",  # the cheap one on any CPU; the default is the study's bf16
        REPRO_SOURCE=miniature_source(tmp_path, seed=5),
        STUDY_WORK=work,
    )
    script = str(ROOT / "bench/study_at_size")
    proc = subprocess.run(
        [script, "--smoke", "--out", str(out)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((out / "study_at_size.json").read_text())
    assert info["seeds"] == {"44m": [42, 101], "129m": [42]}
    for scale, seeds in info["seeds"].items():
        marks = [m for m in (1, 2, 4, 6) if m <= info["steps"][scale]]
        for row in ("per_loop_norm", "per_loop_raw"):
            preset = ROOT / f"configs/experiments/study/{scale}/{row}.yaml"
            for seed in seeds:
                run = read(work / "runs" / scale / row / f"seed{seed}")
                # the preset's every key but batch, steps, evaluation cadence, precision, logging
                # and the data's location (and the toy model under --smoke), each one listed
                listed = {o.split("=")[0] for o in info["overrides"]}
                assert listed == ALLOWED | SMOKE_MODEL
                listed |= {"data.path", "data.valid_path", "train.steps", "train.seed", "train.dir"}
                listed |= {"wandb.name"}  # the config's path and the seed
                want = flatten(experiment.load(preset).to_dict())
                got = flatten(run["config"])
                changed = {k for k in want if got.get(k) != want[k]}
                assert changed <= listed, changed - listed
                assert run["config"]["train"]["bf16"] is False
                given = dict(o.split("=") for o in info["overrides"])  # a rerun resumes from
                assert run["config"]["train"]["save_every"] == int(given["train.save_every"])
                # the report's figures, from the run's own per-step records
                d = run["config"]["model"]["hidden_size"]
                steps = {r["step"]: r["hidden_rms"] for r in run["steps"]}
                l2 = [
                    math.sqrt(d)
                    * sum(steps[s][-1] for s in range(m - 4, m + 1) if s in steps)
                    / len([s for s in range(m - 4, m + 1) if s in steps])
                    for m in marks
                ]
                g = info["growth"][f"{scale}/{row}"][str(seed)]
                assert g["marks"] == marks and g["l2"][-1] == pytest.approx(l2, rel=JSON_REL)
                slopes = [
                    math.log(b / a) / (mb - ma)
                    for a, b, ma, mb in zip(l2, l2[1:], marks, marks[1:])
                ]
                assert g["per_step"][-1] == pytest.approx(slopes, rel=1e-4, abs=1e-6)
                final = math.sqrt(d) * run["evals"][-1]["hidden_rms"][-1]
                t = info["trajectories"][f"{scale}/{row}"][str(seed)]
                assert t["final_l2"] == pytest.approx(final, rel=JSON_REL)
                f = info["figures"][scale][row][str(seed)]  # what the verdicts read
                assert f["l2_final"] == pytest.approx(final, rel=JSON_REL)
                assert f["ppl4"] > 1 and 1 <= f["halt_mean_loops"] <= 4
                measured = work / "measure" / scale / row / f"seed{seed}"
                assert (
                    json.loads((measured / "diagnose.json").read_text())["settings"]["dtype"]
                    == "bfloat16"
                )
    report = (out / "report.md").read_text()
    assert "**SMOKE run" in report and "- `train.bf16=false`" in report
    assert report.count("| d = 96 (study_mini) |") == 2  # the committed miniature, beside
    verdict_lines = [line for line in report.splitlines() if line.startswith("| per-loop CE th")]
    # d = 96 at 200 steps and (docs/study_mini_long's) at 2,000, 44M, 129M
    assert len(verdict_lines) == 1 and verdict_lines[0].count("**") == 8
    assert (out / "growth.png").is_file() and (out / "loops.png").is_file()
    assert str(tmp_path) not in (out / "measurements/report.md").read_text()
    (out / "report.md").unlink()
    again = subprocess.run(
        [script, "--report", "--out", str(out)], capture_output=True, text=True, env=env
    )
    assert again.returncode == 0 and (out / "report.md").read_text() == report
