"""train.nonfinite: a NaN in a loop's loss or an inf in the gradients, injected at a chosen step
(tests/faults.py), is never applied: `skip` counts the step and goes on with unchanged
weights, `stop` saves and stops (exit 65) naming the step and the loop. Under TP2 x PP2 every
rank decides the same (a rank that stepped alone would hang the next collective)."""

import math
import re
import subprocess

import pytest
import torch

from faults import NonFiniteAt
from megaloop import experiment
from megaloop.config import ConfigError
from megaloop.train import checkpoint
from megaloop.train.watchdog import EXIT_UNHEALTHY, STOP_MARKER, UnhealthyRun
from multiproc import BASE, command, metrics
from support import TINY, env


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trainer(run_dir, fault: str, *overrides):
    """A trainer of the tiny config with the fault STEP:LOOP or STEP:grad."""
    cfg = experiment.load(TINY, [*BASE, f"train.dir={run_dir}", "train.steps=6", *overrides])
    t = experiment.build_trainer(cfg)
    at, what = fault.split(":")
    t.add_callback(NonFiniteAt(int(at), what))
    return t


def weights(t) -> list:
    return [p.detach().clone() for p in t.engine.module.parameters()]


@pytest.mark.parametrize("fault, what", [("4:3", "loop 3's loss"), ("4:grad", "the gradients")])
def test_skip_leaves_the_weights_as_they_were(tmp_path, one_thread, fault, what):
    t = trainer(tmp_path, fault, "train.nonfinite=skip")
    for _ in range(3):
        assert "skipped" not in t.train_step()
    before = weights(t)
    record = t.train_step()
    assert record["skipped"] and record["step"] == 4
    if what.startswith("loop"):
        assert [math.isfinite(c) for c in record["ce"]] == [True, True, False, False]
    else:
        assert all(math.isfinite(c) for c in record["ce"]) and not math.isfinite(
            record["grad_norm"]
        )
    assert all(torch.equal(a, b) for a, b in zip(before, weights(t)))
    record = t.train_step()
    assert "skipped" not in record and math.isfinite(record["loss"])
    assert not all(torch.equal(a, b) for a, b in zip(before, weights(t)))
    assert all(torch.isfinite(p).all() for p in weights(t))


def test_skip_is_counted_and_logged(tmp_path, one_thread, capsys):
    result = trainer(tmp_path, "3:2", "train.nonfinite=skip").fit()
    m = metrics(tmp_path, finite=False)  # step 3's NaN is logged as it was
    assert [s["step"] for s in m["skipped_steps"]] == [3]
    assert all(math.isfinite(s["loss"]) for s in m["steps"] if s["step"] != 3)
    assert "loop 2's loss" in m["skipped_steps"][0]["what"]
    assert "step 3 skipped: non-finite loop 2's loss" in capsys.readouterr().out
    assert len(m["steps"]) == 6 and all(math.isfinite(c) for c in result["ce"])


def test_stop_saves_and_names_the_step_and_the_loop(tmp_path, one_thread):
    with pytest.raises(UnhealthyRun, match="stopped at step 4: non-finite loop 2's loss"):
        trainer(tmp_path, "4:2").fit()
    assert (tmp_path / STOP_MARKER).is_file()
    folder = checkpoint.find_latest(tmp_path / "checkpoints")
    assert folder.name == "step_0000004"
    state = experiment.consolidated(folder)[0]  # the weights saved are the last good ones
    assert all(torch.isfinite(v).all() for v in state.values())


def test_deepspeed_refuses_skip():
    with pytest.raises(
        ConfigError,
        match=re.escape("config key 'train.nonfinite': got 'skip'; skip needs engine=megatron"),
    ):
        experiment.load(TINY, [*BASE, "engine=deepspeed", "train.nonfinite=skip"])


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (4, ["parallel.tp=2", "parallel.pp=2"]),
        (2, ["engine=deepspeed", "deepspeed.zero_stage=2"]),
    ],
)
def test_every_rank_stops_at_the_same_step(tmp_path, nproc, overrides):
    proc = subprocess.run(
        command(nproc, tmp_path, [*overrides, "train.save_every=0"], ["--nonfinite-at", "3:4"]),
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )
    assert proc.returncode != 0
    assert "stopped at step 3: non-finite loop 4's loss" in proc.stderr
    assert checkpoint.find_latest(tmp_path / "checkpoints").name == "step_0000003"
    assert f"exiting with {EXIT_UNHEALTHY} (not requeued)" in proc.stderr
    assert f"exitcode  : {EXIT_UNHEALTHY}" in proc.stderr  # torchrun's report of the first rank
