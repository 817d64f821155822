"""Run directories that cannot collide: names from the config and the seed, resumes that refuse
another experiment, train.steps never silently replaced, and `megaloop sweep`."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megaloop import experiment
from megaloop.config import ConfigError
from multiproc import metrics as read_metrics
from support import ROOT, TINY

QUICK = ["train.steps=3", "data.seq_len=32", "train.log_every=1", "wandb.mode=disabled"]


def test_two_seeds_of_one_config_get_two_run_directories():
    path = ROOT / "configs/experiments/wikitext103/44m/per_loop_norm.yaml"
    dirs = {experiment.load(path, [f"train.seed={s}"]).train.dir for s in (0, 1, 2)}
    assert dirs == {f"runs/wikitext103/44m/per_loop_norm/seed{s}" for s in (0, 1, 2)}
    assert experiment.load(TINY).train.dir == "runs/tiny/seed0"
    assert experiment.load(TINY, ["train.dir=elsewhere"]).train.dir == "elsewhere"


def test_a_sweep_refuses_one_config_and_seed_twice(tmp_path):
    from megaloop import sweep

    with pytest.raises(ConfigError, match="seed 1 more than once"):
        sweep.plan([str(TINY)], [0, 1, 1], QUICK, tmp_path)
    with pytest.raises(ConfigError, match="one run directory"):
        sweep.plan([str(TINY), str(TINY)], [0], QUICK, tmp_path)
    assert len(sweep.plan([str(TINY)], [0, 1], QUICK, tmp_path)) == 2


def train(run_dir: Path, *overrides) -> None:
    cfg = experiment.load(TINY, [*QUICK, f"train.dir={run_dir}", *overrides])
    experiment.build_trainer(cfg).fit()
    steps = read_metrics(run_dir)["steps"]
    assert all(np.isfinite(r["loss"]) for r in steps)


def test_a_resume_with_another_model_stops_naming_the_key(tmp_path, capsys):
    from megaloop.cli import main

    run = tmp_path / "run"
    train(run)
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    code = main(
        ["train", str(TINY), *QUICK, f"train.dir={run}", "model.readout=raw", "train.seed=1"]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if "megaloop" in line]
    assert code == 2 and len(err) == 1 and err[0].startswith("megaloop: error: train.dir=")
    assert 'model.readout: "norm" -> "raw"' in err[0] and "train.seed: 0 -> 1" in err[0]
    assert (run / "metrics.jsonl").read_text() == before  # nothing written
    # the keys a resume may change: length, cadence, layout
    train(run, "train.steps=5", "train.log_every=2", "parallel.tp=1")
    assert read_metrics(run)["evals"][-1]["step"] == 5


@pytest.fixture
def indexed(tmp_path):
    """A prepared indexed split of 1,000 tokens (megatron-core's builder)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "train.bin"), dtype=np.uint16)
    for doc in np.split(np.arange(1000) % 200 + 1, [300, 700]):
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(str(tmp_path / "train.idx"))
    return ["data.kind=indexed", f"data.path={tmp_path / 'train'}", "data.seq_len=32"]


def test_an_explicit_train_steps_wins_over_data_epochs_and_says_so(indexed):
    cfg = experiment.load(TINY, [*indexed, "data.epochs=2", "train.steps=null"])
    assert experiment.resolve_steps(cfg) is None
    assert cfg.train.steps == (2 * 1000 - 1) // 32 // 16  # two passes, 16 sequences a step
    cfg = experiment.load(TINY, [*indexed, "data.epochs=2", "train.steps=3"])
    note = experiment.resolve_steps(cfg)
    assert cfg.train.steps == 3 and "train.steps=3" in note and "data.epochs=2" in note
    with pytest.raises(ConfigError, match="train.steps"):
        experiment.resolve_steps(experiment.load(TINY, ["train.steps=null"]))


def sweep(cwd: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "megaloop", "sweep", str(TINY), *args, *QUICK],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=600,
    )


def test_sweep_trains_each_seed_once_and_skips_finished_runs(tmp_path):
    first = sweep(tmp_path, "--seeds", "0,1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "sweep: 2 of 2 run(s) trained" in first.stdout
    runs = [tmp_path / f"runs/tiny/seed{s}" for s in (0, 1)]
    metrics = [read_metrics(r) for r in runs]
    assert [m["config"]["train"]["seed"] for m in metrics] == [0, 1]
    assert metrics[0]["steps"][0]["loss"] != metrics[1]["steps"][0]["loss"]
    stamps = [(r / "metrics.jsonl").stat().st_mtime_ns for r in runs]
    again = sweep(tmp_path, "--seeds", "0,1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("is finished; skipped") == 2 and "all 2 runs are finished" in (
        again.stdout
    )
    assert [(r / "metrics.jsonl").stat().st_mtime_ns for r in runs] == stamps
    refused = sweep(tmp_path, "--seeds", "0", "train.dir=x")
    assert refused.returncode == 2 and "train.dir cannot be given to a sweep" in refused.stderr


def refuse_children(monkeypatch) -> None:
    """Any child process (a training run, sbatch) fails the test: the sweeps below start none."""

    def run(*args, **kwargs):
        raise AssertionError(f"the sweep started {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "run", run)


def sweep_here(capsys, runs: Path, seeds: str, *args) -> tuple[int, str, str]:
    """`megaloop sweep TINY --seeds SEEDS --out RUNS ARGS` (QUICK's overrides) in this process:
    (exit status, stdout, stderr)."""
    from megaloop.cli import main

    capsys.readouterr()
    code = main(["sweep", TINY, "--seeds", seeds, "--out", str(runs), *args, *QUICK])
    out, err = capsys.readouterr()
    return code, out, err


SLURM = ["--executor", "slurm", "--nodes", "1", "--gpus-per-node", "0"]


@pytest.mark.parametrize("executor", [[], SLURM], ids=["local", "slurm"])
def test_a_dry_run_trains_writes_and_submits_nothing(tmp_path, capsys, monkeypatch, executor):
    refuse_children(monkeypatch)
    runs = tmp_path / "runs"
    code, out, err = sweep_here(capsys, runs, "0,1", "--dry-run", *executor)
    assert code == 0, err
    assert not runs.exists()  # no run directory, no sweep-logs
    said = err if executor else out  # under slurm stdout is the script alone
    for seed in (0, 1):
        assert f"sweep: {runs}/tiny/seed{seed}: {TINY} seed {seed}: would train (does not " in said
    assert "2 of 2 run(s) would train" in said and "nothing trained, written or submitted" in said
    if executor:
        assert out.startswith("#!/bin/bash") and "#SBATCH --array=0-1" in out
    else:  # each run's command
        assert said.count(f"  megaloop train {TINY} ") == 2
        assert f"train.seed=1 train.dir={runs}/tiny/seed1\n" in said


def test_a_finished_run_is_skipped_only_for_the_config_it_ran(tmp_path, capsys, monkeypatch):
    """A finished run in the directory a sweep would train in counts as this run only when the
    config it recorded is the one asked for, up to the keys a resume may change; another config
    stops the sweep before any run starts, naming the directory and the keys."""
    runs = tmp_path / "runs"
    run = runs / "tiny/seed0"
    train(run)
    before = (run / "metrics.jsonl").read_bytes()
    refuse_children(monkeypatch)
    code, out, err = sweep_here(capsys, runs, "0,1", "model.hidden_size=48", "optim.lr=1e-3")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"megaloop: error: {run} holds a run of another config")
    assert "model.hidden_size: 128 -> 48; optim.lr: 0.003 -> 0.001" in err
    assert not (runs / "tiny/seed1").exists()  # seed 1 is new, yet nothing started
    for dry in ([], ["--dry-run"]):
        code, out, err = sweep_here(capsys, runs, "0,1", *dry, "model.hidden_size=48")
        assert code == 2 and "model.hidden_size: 128 -> 48" in err
    # the same config, its logging and eval cadence changed (they leave the model as it was)
    cadence = ["train.log_every=2", "train.eval_every=2"]
    code, out, err = sweep_here(capsys, runs, "0", "--dry-run", *cadence)
    assert code == 0 and f"sweep: {run}: {TINY} seed 0: finished; would be skipped" in out
    code, out, err = sweep_here(capsys, runs, "0", *cadence)
    assert code == 0, err
    assert f"sweep: {run} is finished; skipped" in out and "all 1 runs are finished" in out
    assert (run / "metrics.jsonl").read_bytes() == before
