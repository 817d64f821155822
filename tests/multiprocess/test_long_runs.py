"""Long runs as users run them: one writer per run directory, a wandb run of its own, progress
lines in a log, Ctrl-C that saves (docs/reliability.md, "Long runs"). Every run held at a step
waits on a fault of tests/faults.py (--pause-at-step, --hold-at-step), never on time."""

import os
import re
import signal
import socket
import subprocess
import time

import pytest
import torch

from megaloop import experiment, known_warnings
from megaloop.train.metrics import read as read_metrics
from megaloop.train.preemption import INTERRUPT_ECHO_S
from multiproc import (
    OBJECTIVES,
    assert_same_curve,
    command,
    metrics,
    stop_groups,
    train_here,
    wait_for_step,
)
from support import env

pytestmark = pytest.mark.multiprocess
OVERRIDES = [*OBJECTIVES["per_loop+penalty"], "train.save_every=2"]


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_run_outlives_its_test():
    """A failed assertion must not leave a run paused at its fault for ever."""
    yield
    stop_groups(STARTED)
    STARTED.clear()


def start(run_dir, overrides=OVERRIDES, nproc=1, faults=()):
    proc = subprocess.Popen(
        command(nproc, run_dir, overrides, faults),
        text=True,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    STARTED.append(proc)
    return proc


def consolidated(run_dir, tmp_path, name):
    out = tmp_path / name
    experiment.consolidate(run_dir, out)
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


@pytest.mark.one_at_a_time
def test_a_second_run_on_a_live_run_directory_stops_before_any_compute(tmp_path):
    train_here(tmp_path / "undisturbed", OVERRIDES)
    run_dir = tmp_path / "run"
    first = start(run_dir, faults=["--pause-at-step", "3"])
    wait_for_step(run_dir, 3, first)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    second = subprocess.run(
        command(1, run_dir, OVERRIDES), capture_output=True, text=True, env=env(), timeout=120
    )
    assert second.returncode == 2, second.stderr[-3000:]
    message = second.stderr.strip().splitlines()[-1]
    assert message.startswith(f"megaloop: error: train.dir={run_dir} is in use by another run")
    assert f"pid {first.pid} on {socket.gethostname()}" in message and "Traceback" not in message
    assert "step 1" not in second.stdout  # no step was taken
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing removed
    (run_dir / "CONTINUE").touch()
    _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-3000:]
    reference = metrics(tmp_path / "undisturbed")
    assert_same_curve(metrics(run_dir), reference, 0)
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert steps == sorted(p.name for p in (tmp_path / "undisturbed/checkpoints").glob("step_*"))
    mine = consolidated(run_dir, tmp_path, "a")
    theirs = consolidated(tmp_path / "undisturbed", tmp_path, "b")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.one_at_a_time
def test_after_kill_9_of_the_holder_a_relaunch_proceeds(tmp_path):
    run_dir = tmp_path / "run"
    first = start(run_dir, faults=["--pause-at-step", "3"])
    wait_for_step(run_dir, 3, first)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    relaunch = subprocess.run(
        command(1, run_dir, OVERRIDES), capture_output=True, text=True, env=env(), timeout=240
    )
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_0000002" in relaunch.stdout
    records = read_metrics(run_dir)
    assert records["evals"][-1]["step"] == 10
    assert [r["step"] for r in records["steps"]] == list(range(1, 11))  # step 3 logged once


@pytest.mark.one_at_a_time
def test_wandb_ids_are_per_run_directory_and_kept_on_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    other = tmp_path / "other.yaml"
    other.write_text("defaults: [" + str(experiment.CONFIG_ROOT / "experiments/tiny.yaml") + "]\n")
    ids = {}
    for name, config in (("tiny", "experiments/tiny"), ("other", str(other))):
        cfg = experiment.load(config, ["train.steps=2", "train.eval_batches=1"])
        assert cfg.train.seed == 0 and cfg.wandb.name.endswith(f"{name} seed0")
        cfg.train.dir = str(tmp_path / name / "seed0")  # both end in seed0, as by default
        cfg.wandb.mode = "offline"
        experiment.build_trainer(cfg).fit()
        ids[name] = (tmp_path / name / "seed0/wandb_id").read_text().strip()
    assert ids["tiny"] != ids["other"] and all(
        re.fullmatch(r"[0-9a-f]{16}", i) for i in ids.values()
    )
    cfg = experiment.load("experiments/tiny", ["train.steps=4", "train.eval_batches=1"])
    cfg.train.dir, cfg.wandb.mode = str(tmp_path / "tiny/seed0"), "offline"
    experiment.build_trainer(cfg).fit()  # resumes from step 2
    assert (tmp_path / "tiny/seed0/wandb_id").read_text().strip() == ids["tiny"]
    offline = sorted(p.name for p in (tmp_path / "tiny/seed0/wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(ids["tiny"]) for name in offline), offline


def test_progress_lines_off_a_terminal_and_no_known_warnings(tmp_path):
    """Two ranks, stdout and stderr pipes: rank 0 prints a line every log_every steps; none of
    the dependencies' known warnings, and no dependency warning twice."""
    run_dir = tmp_path / "run"
    overrides = [*OVERRIDES, "train.log_every=2", "train.save_every=0"]
    proc = start(run_dir, overrides, nproc=2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    progress = [line for line in lines if " | loss " in line]
    assert [int(re.match(r"step +(\d+)/10 ", line)[1]) for line in progress] == [2, 4, 6, 8, 10]
    for line in progress:
        for field in ("CE/loop", "RMS/loop", "lr ", "grad norm", "tok/s", "elapsed", "ETA"):
            assert field in line, line
    everything = out + err
    for known in known_warnings.KNOWN:
        assert not re.search(known.message, everything), known.message
    warned = [line for line in err.splitlines() if "Warning:" in line]
    assert len(warned) == len(set(warned)), warned


@pytest.mark.one_at_a_time
def test_ctrl_c_saves_exits_75_and_the_relaunch_continues(tmp_path):
    train_here(tmp_path / "undisturbed", OVERRIDES)
    run_dir = tmp_path / "run"
    proc = start(run_dir, faults=["--hold-at-step", "3"])
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    assert "Ctrl-C: finishing this step, saving" in err and "preempted at step 3 (Ctrl-C)" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_0000003"
    train_here(run_dir, OVERRIDES)
    assert_same_curve(metrics(run_dir), metrics(tmp_path / "undisturbed"), 1e-12)


@pytest.mark.one_at_a_time
def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, faults=["--pause-at-step", "3"])
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGINT)  # the request: the pause fault keeps the run waiting
    said = ""
    while "Ctrl-C: finishing this step" not in said:  # the first press has been handled
        line = proc.stderr.readline()
        assert line, "the run ended before it acknowledged Ctrl-C"
        said += line
    time.sleep(1.5 * INTERRUPT_ECHO_S)  # after the handler ran: a second press, not an echo
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "aborted (Ctrl-C)" in err and "Traceback" not in err
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_0000002"


def test_ctrl_c_under_torchrun_saves_on_every_rank(tmp_path):
    """Ctrl-C to torchrun: it forwards SIGINT to every rank, and each saves at the step it was
    asked at (a terminal's Ctrl-C also reaches the ranks directly, INTERRUPT_ECHO_S before or
    after torchrun's copy: one request)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, [*OVERRIDES, "parallel.pp=2"], nproc=2, faults=["--hold-at-step", "3"])
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_0000003"
    assert err.count("preempted at step 3 (Ctrl-C)") == 2, err[-4000:]
    assert "aborted" not in err
