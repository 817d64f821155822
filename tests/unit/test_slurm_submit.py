"""`megaloop slurm submit`, in process: the job's name and the data check (the real cluster's
tests are tests/cluster/test_slurm.py)."""

import subprocess
from pathlib import Path

import pytest

from megaloop.cli import main
from megaloop.slurm import job_name
from support import ROOT

PRESET = str(ROOT / "configs/experiments/study/44m/per_loop_norm.yaml")
JOB = ["--nodes", "1", "--gpus-per-node", "0"]


@pytest.mark.parametrize(
    "run_dir, name",
    [
        ("/w/runs/study/44m/per_loop_norm/seed42", "megaloop-study-44m-per_loop_norm-seed42"),
        ("/w/runs/study/44m/terminal_raw/seed42", "megaloop-study-44m-terminal_raw-seed42"),
        ("/shared/runs/fineweb-1p4b", "megaloop-fineweb-1p4b"),
        ("/scratch/sweep/per_loop_norm/seed1", "megaloop-per_loop_norm-seed1"),
        ("/scratch/my-run", "megaloop-my-run"),
    ],
)
def test_each_run_has_a_job_name_of_its_own(run_dir, name):
    """Named after the run directory below its `runs` folder: two rows of one seed differ."""
    assert job_name(Path(run_dir)) == name


def test_data_missing_here_is_said_by_the_dry_run_and_refused_by_submit(
    tmp_path, capsys, monkeypatch
):
    def sbatch(*args, **kwargs):
        raise AssertionError("sbatch was called")

    monkeypatch.setattr(subprocess, "run", sbatch)
    monkeypatch.chdir(tmp_path)  # the preset's data/wikitext103_study is not here
    assert main(["slurm", "submit", PRESET, *JOB, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash")
    run = tmp_path / "runs/study/44m/per_loop_norm/seed42"
    assert "#SBATCH --job-name=megaloop-study-44m-per_loop_norm-seed42\n" in out
    (warning,) = [line for line in err.splitlines() if line.startswith("megaloop: warning:")]
    assert "'data.path'" in warning and "data/wikitext103_study/train" in warning
    assert warning.endswith(
        "(checked on this machine: `slurm submit` without --dry-run refuses it)"
    )
    assert main(["slurm", "submit", PRESET, *JOB]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("megaloop: error: ") and "'data.path'" in line
    assert line.endswith("(checked on this machine; nothing submitted)")
    assert not run.exists()  # no logs folder either
