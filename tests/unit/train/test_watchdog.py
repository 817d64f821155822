"""The scale watchdog: per-loop hidden-RMS percentiles in every record, alarms that warn or stop
(exit 65, a checkpoint, RUN_DIR/STOPPED), and a job script that never requeues a stop."""

import json
import math
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch

from megaloop import experiment
from megaloop.config import ConfigError
from megaloop.model.looped import LoopOutput
from megaloop.objectives import ObjectiveConfig, compute
from megaloop.parallel.distributed import reduce_terms
from megaloop.train.watchdog import EXIT_UNHEALTHY, ScaleAlarmConfig, ScaleWatchdog
from multiproc import metrics as read_metrics
from support import ROOT, TINY, megaloop

SHORT = ["data.seq_len=32", "train.log_every=1", "wandb.mode=disabled"]


def assert_finite(metrics: dict) -> None:
    assert metrics["steps"] and all(math.isfinite(r["loss"]) for r in metrics["steps"])


def test_percentiles_and_max_per_loop_by_hand():
    # per-token RMS of loop 1 = 1..100 (b=1, s=100); loop 2 twice that
    rms = torch.arange(1.0, 101.0)
    hidden = [(scale * rms).view(100, 1, 1).expand(100, 1, 4) for scale in (1.0, 2.0)]
    out = LoopOutput(hidden=hidden, token_ce=[torch.zeros(1, 100)] * 2)
    _, terms = compute(ObjectiveConfig(), out)
    assert terms["hidden_rms_p50"].tolist() == pytest.approx([50.5, 101.0])
    assert terms["hidden_rms_p99"].tolist() == pytest.approx([99.01, 198.02])
    assert terms["hidden_rms_max"].tolist() == pytest.approx([100.0, 200.0])
    mask = (rms <= 10).float().view(1, 100)  # only the masked tokens count
    _, terms = compute(ObjectiveConfig(), out, loss_mask=mask)
    assert terms["hidden_rms_max"].tolist() == pytest.approx([10.0, 20.0])
    assert terms["hidden_rms_p50"].tolist() == pytest.approx([5.5, 11.0])


def test_reduce_takes_the_max_of_maxes_and_the_mean_of_the_rest():
    outputs = [
        {"hidden_rms_max": torch.tensor([1.0, 5.0]), "hidden_rms_p99": torch.tensor([1.0, 4.0])},
        {"hidden_rms_max": torch.tensor([3.0, 2.0]), "hidden_rms_p99": torch.tensor([3.0, 2.0])},
    ]
    reduced = reduce_terms(outputs, holds_terms=True)
    assert reduced == {"hidden_rms_max": [3.0, 5.0], "hidden_rms_p99": [2.0, 3.0]}


def record(step, means, maxes=None):
    return {"step": step, "hidden_rms": means, "hidden_rms_max": maxes or means}


def test_rules_fire_once_per_loop_until_cleared():
    dog = ScaleWatchdog(ScaleAlarmConfig(max_rms=10.0))
    assert dog.check(record(1, [1.0, 2.0], [5.0, 12.0]))[0].what() == (
        "loop 2: max hidden RMS 12 > train.scale_alarm.max_rms=10"
    )
    assert dog.check(record(2, [1.0, 2.0], [5.0, 13.0])) == []  # still firing: no repeat
    assert dog.check(record(3, [1.0, 2.0], [5.0, 9.0])) == []  # cleared
    assert [a.loop for a in dog.check(record(4, [1.0, 2.0], [11.0, 14.0]))] == [1, 2]
    assert [a.loop for a in ScaleWatchdog(dog.cfg).check(record(5, [1.0], [math.nan]))] == [1]
    dog = ScaleWatchdog(ScaleAlarmConfig(growth=2.0, window=2))
    assert dog.check(record(1, [1.0, 1.0])) == dog.check(record(2, [1.5, 1.0])) == []
    alarms = dog.check(record(3, [2.0, 1.9]))  # loop 1: 2.0 / 1.0 over 2 steps
    assert [(a.loop, a.rule, a.value, a.window) for a in alarms] == [(1, "growth", 2.0, 2)]
    assert dog.check(record(4, [2.5, 1.9])) == []  # 2.5 / 1.5 < 2: cleared


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.scale_alarm.max_rms=0", ["train.scale_alarm.max_rms", "must be > 0"]),
        ("train.scale_alarm.growth=1", ["train.scale_alarm.growth", "must be > 1"]),
        ("train.scale_alarm.window=0", ["train.scale_alarm.window", ">= 1"]),
        ("train.scale_alarm.action=halt", ["train.scale_alarm.action", "warn, stop"]),
        ("train.scale_alarm.max=3", ["train.scale_alarm.max", "unknown key", "max_rms"]),
    ],
)
def test_bad_alarm_config_is_one_clear_error(override, words):
    with pytest.raises(ConfigError) as err:
        experiment.load(TINY, [override])
    for word in words:
        assert word in str(err.value), str(err.value)


def test_records_hold_per_loop_percentiles_in_order(tmp_path):
    cfg = experiment.load(TINY, [f"train.dir={tmp_path}", "train.steps=3", *SHORT])
    experiment.build_trainer(cfg).fit()
    metrics = read_metrics(tmp_path)
    assert_finite(metrics)
    for r in metrics["steps"] + metrics["evals"]:
        assert len(r["hidden_rms_p50"]) == len(r["hidden_rms_p99"]) == len(r["hidden_rms_max"]) == 4
        for mean, p50, p99, top in zip(
            r["hidden_rms"], r["hidden_rms_p50"], r["hidden_rms_p99"], r["hidden_rms_max"]
        ):
            assert 0 < p50 <= p99 <= top and mean <= top
    assert metrics["alarms"] == []


def test_warn_logs_the_alarm_and_keeps_training(tmp_path, capsys):
    # at initialisation the tiny model's hidden RMS is ~0.05 at loop 1 and ~0.14 at loop 4
    cfg = experiment.load(
        TINY,
        [
            f"train.dir={tmp_path}",
            "train.steps=3",
            "data.seq_len=32",
            "train.log_every=3",
            "wandb.mode=offline",
            "train.scale_alarm.max_rms=0.1",
        ],
    )
    experiment.build_trainer(cfg).fit()
    metrics = read_metrics(tmp_path)
    assert_finite(metrics)
    logged = {r["step"]: r for r in metrics["steps"]}
    assert 1 in logged and 3 in logged  # log_every=3, and the alarm's step
    assert metrics["evals"][-1]["step"] == 3 and not (tmp_path / "STOPPED").exists()
    alarms = metrics["alarms"]
    assert alarms[0]["step"] == 1 and 4 in {a["loop"] for a in alarms if a["step"] == 1}
    for a in alarms:
        assert a["rule"] == "max_rms" and a["value"] > 0.1
        assert a["value"] == logged[a["step"]]["hidden_rms_max"][a["loop"] - 1]
    out = capsys.readouterr().out
    assert "scale alarm at step 1, loop 4: max hidden RMS" in out
    import wandb

    wandb.teardown()  # finish() may return before wandb's service has flushed the run file
    run_file = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    assert b"megaloop scale alarm, loop 4" in run_file and b"scale_alarm/max_rms/loop4" in run_file


def test_stop_saves_marks_and_exits_with_its_own_code(tmp_path, capsys):
    run = tmp_path / "run"
    proc = megaloop(
        "train",
        TINY,
        f"train.dir={run}",
        "train.steps=5",
        *SHORT,
        "train.scale_alarm.max_rms=0.1",
        "train.scale_alarm.action=stop",
    )
    assert proc.returncode == EXIT_UNHEALTHY == 65, proc.stderr[-3000:]
    assert "megaloop: stopped at step 1: scale alarm, " in proc.stderr
    assert "loop 4: max hidden RMS" in proc.stderr and "not requeued" in proc.stderr
    assert (run / "checkpoints/latest").read_text() == "step_0000001"
    marker = json.loads((run / "STOPPED").read_text())
    assert marker["reason"] == "scale_alarm" and marker["step"] == 1
    assert marker["checkpoint"] == str(run / "checkpoints/step_0000001")
    assert 4 in [a["loop"] for a in marker["alarms"]] and "loop 4" in marker["message"]
    metrics = read_metrics(run)
    assert_finite(metrics)
    assert [r["step"] for r in metrics["steps"]] == [1] and metrics["evals"] == []
    # a rerun (here without the alarm) resumes from the stop and clears the marker
    cfg = experiment.load(TINY, [f"train.dir={run}", "train.steps=2", *SHORT])
    experiment.build_trainer(cfg).fit()
    out = capsys.readouterr().out
    assert "an earlier attempt stopped (scale alarm, " in out and "resumed from" in out
    assert not (run / "STOPPED").exists()
    assert_finite(read_metrics(run))


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("warned", [False, True])
def test_job_script_never_requeues_an_unhealthy_stop(tmp_path, warned):
    """slurm/train.sbatch under bash with stub srun/scontrol: srun reports a rank killed (137)
    after the run wrote STOPPED, with and without the time-limit warning."""
    from megaloop import slurm

    run_dir, bin_dir = tmp_path / "run", tmp_path / "bin"
    (run_dir / "logs").mkdir(parents=True)
    bin_dir.mkdir()
    (run_dir / "STOPPED").write_text('{"message": "stale, from an earlier job"}')
    started = tmp_path / "srun_started"
    stub(
        bin_dir,
        "srun",
        f"touch {started}; sleep 3; "
        f'echo \'{{"message": "loop 4"}}\' > {run_dir}/STOPPED; exit 137\n',
    )
    stub(
        bin_dir,
        "scontrol",
        f'[ "$1" = requeue ] && touch {tmp_path}/requeued\n'
        f'[ "$2" = hostnames ] && echo n1\n'
        f'[ "$2" = node ] && echo "NodeName=n1 NodeAddr=127.0.0.1"\n'
        f"exit 0\n",
    )
    script = slurm.render(
        ROOT / "slurm/train.sbatch",
        {
            "job_name": "t",
            "nodes": 1,
            "tasks_per_node": 1,
            "cpus_per_task": 1,
            "time": "10",
            "warning_seconds": 5,
            "output": str(run_dir / "logs/slurm.out"),
            "sbatch_lines": "",
            "program": "python -m megaloop",
            "runs": f"RUN_DIR={run_dir}; RUN=(c.yaml)",
        },
    )
    (tmp_path / "job.sh").write_text(script)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_NTASKS": "1",
    }
    job = subprocess.Popen(["bash", str(tmp_path / "job.sh")], env=env)
    if warned:  # while srun runs (the script's trap is set before it starts)
        deadline = time.time() + 30
        while not started.exists():
            assert job.poll() is None and time.time() < deadline
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=30) == 65
    assert not (tmp_path / "requeued").exists()
    log = (run_dir / "logs/attempt-0.log").read_text()
    assert "stopped unhealthy (srun exit 137), not requeueing" in log and "loop 4" in log
    assert "stale" not in log
    assert ("USR1: time limit near" in log) == warned


@pytest.mark.multiprocess
def test_max_is_reduced_as_a_max_over_ranks_and_micro_batches(tmp_path):
    """One process reading each global batch as one micro-batch gives the step's exact token
    max; DP=2 and PP=2 (torchrun, gloo) split it into two micro-batches (on two ranks, or on one
    pipeline) and must report the same max (a mean of maxes would come out lower), the same
    mean, and validation over the same 8 windows with the same CE."""
    from multiproc import metrics, train, train_here

    common = ["train.steps=3", "train.save_every=0"]
    train_here(tmp_path / "one", [*common, "train.micro_batch_size=4", "train.eval_batches=2"])
    split = [*common, "train.micro_batch_size=2", "train.eval_batches=4"]
    train(2, tmp_path / "dp2", split)
    train(2, tmp_path / "pp2", [*split, "parallel.pp=2"])
    one = metrics(tmp_path / "one")
    assert_finite(one)
    for name in ("dp2", "pp2"):
        run = metrics(tmp_path / name)
        assert_finite(run)
        assert len(run["steps"]) == 3
        for a, b in zip(one["steps"], run["steps"]):
            for key in ("hidden_rms_max", "hidden_rms"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (name, a["step"], key)
            assert all(
                p50 <= p99 <= top
                for p50, p99, top in zip(
                    b["hidden_rms_p50"], b["hidden_rms_p99"], b["hidden_rms_max"]
                )
            )
        assert run["evals"][-1]["valid_windows"] == one["evals"][-1]["valid_windows"] == 8
        assert run["evals"][-1]["ce"] == pytest.approx(one["evals"][-1]["ce"], rel=1e-5)
