"""`python -m bench NAME`: the one way a bench runs. A name is a module of bench/ (a hyphen for an
underscore), --smoke of a bench that writes docs/ needs --out, and --out is refused where a
bench writes no folder."""

import os
import shutil
import subprocess
import sys

import pytest

from support import ROOT


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_without_a_name_it_lists_the_benches():
    proc = bench()
    assert proc.returncode == 2 and "study_mini, study_mini_long" in proc.stdout
    assert "_report" not in proc.stdout and "common" not in proc.stdout.split("NAME:")[-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "no bench 'nope'"),
        (["study-mini", "--smoke"], "study_mini: --smoke needs an OUT folder"),
        (["adaptive_depth", "--smoke"], "adaptive_depth: --smoke needs an OUT folder"),
        (["metrics_log", "--out", "x"], "writes no folder: no --out"),
    ],
)
def test_it_refuses_before_any_work(args, message):
    proc = bench(*args)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "name", ["drift_drivers", "drift_regime", "adaptive_depth", "study_mini", "study_mini_long"]
)
def test_report_rewrites_from_the_json_and_runs_nothing(name, tmp_path):
    """`--report` ends once the report is rewritten: no data prepared, no run trained (a bench
    that went on would start its full run here), and the report is the committed one."""
    out = tmp_path / name
    shutil.copytree(ROOT / "docs" / name, out)
    env_work = {f"{key}_WORK": tmp_path / "work" for key in ("STUDY", "DRIFT", "ADAPTIVE")}
    env_work["REPRO_SOURCE"] = tmp_path / "missing"  # a bench that went on fails at once
    proc = subprocess.run(
        [sys.executable, "-m", "bench", name, "--report", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **{k: str(v) for k, v in env_work.items()}},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith(f"rewritten from {out / f'{name}.json'}"), proc.stdout
    assert not (tmp_path / "work").exists()
    for page in ("report.md", "README.md"):
        if (ROOT / "docs" / name / page).is_file():
            assert (out / page).read_text() == (ROOT / "docs" / name / page).read_text(), page
