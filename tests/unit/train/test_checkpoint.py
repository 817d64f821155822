"""Checkpoint safety on one process: a resumed run continues exactly where it stopped, a
directory whose checkpoints are all unreadable stops with each one named (it never trains from
step 0 beside them), and pruning counts only loadable checkpoints (a corrupt one never pushes
out a good one)."""

from pathlib import Path

import pytest
import torch

from megaloop import experiment
from megaloop.config import ConfigError
from megaloop.train import checkpoint
from megaloop.train.callbacks import Callback
from megaloop.train.preemption import Preempted
from multiproc import metrics as read_metrics
from support import TINY


class FileEngine:
    """An engine whose state is one small file: what `checkpoint.save` needs of an engine."""

    name = "file"

    def layout(self) -> dict:
        return {"tp": 1, "pp": 1, "dp": 1}

    def save_state(self, folder: Path, position: dict) -> None:
        (folder / "state.bin").write_bytes(bytes([position["step"]]) * 64)


def save(root: Path, step: int) -> None:
    checkpoint.save(
        root,
        FileEngine(),
        {"step": step, "consumed_samples": step},
        {"model": {"num_loops": 4}},
        keep_last=2,
    )


def corrupt(folder: Path) -> None:
    (folder / "state.bin").write_bytes(b"\0" * 64)  # same size, other bytes


def loadable(root: Path) -> list[str]:
    return [f.name for f in sorted(root.glob("step_*")) if checkpoint.verify(f) is None]


def test_pruning_counts_only_loadable_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 1)
    save(root, 2)
    corrupt(root / "step_0000002")
    save(root, 3)  # keep_last=2 loadable: 3 and 1 (the corrupt 2 does not count)
    assert loadable(root) == ["step_0000001", "step_0000003"]
    save(root, 4)  # loadable 4 and 3 kept; everything older goes, the corrupt 2 included
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000003", "step_0000004"]
    assert checkpoint.find_latest(root).name == "step_0000004"


def test_all_checkpoints_corrupt_stops_naming_each_and_trains_nothing(tmp_path, capsys):
    overrides = [
        f"train.dir={tmp_path}",
        "train.steps=4",
        "train.save_every=2",
        "data.seq_len=32",
        "wandb.mode=disabled",
    ]
    experiment.build_trainer(experiment.load(TINY, overrides)).fit()
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4):
        shard = next((ckpts / f"step_000000{step}").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-100])

    def files():  # but the run lock, whose holder record each start rewrites
        return {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} | {
            tmp_path / ".lock": None
        }

    before = files()
    with pytest.raises(ConfigError) as err:
        experiment.build_trainer(experiment.load(TINY, [*overrides, "train.steps=6"]))
    message = str(err.value)
    assert "2 checkpoint(s) and none is loadable" in message and "another train.dir" in message
    assert "step_0000004: " in message and "step_0000002: " in message
    assert files() == before
    assert read_metrics(tmp_path)["steps"][-1]["step"] == 4


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """From step 3 on no file may grow past 64 KiB (a full disk, as RLIMIT_FSIZE makes it): the
    step-4 save fails with one message, the step-2 checkpoint stays the newest and loadable, no
    half-written folder is left, and a relaunch resumes from step 2."""
    import subprocess

    from multiproc import command, env, train

    run = tmp_path / "run"
    proc = subprocess.run(
        command(1, run, ["train.save_every=2"], ["--file-limit-at", "3:65536"]),
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "saving checkpoint step_0000004" in proc.stderr and "GiB free there" in proc.stderr
    assert "the previous checkpoint step_0000002 is intact" in proc.stderr
    assert "Traceback" not in proc.stderr
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_0000002"
    assert not list(root.glob(".tmp_*")) and checkpoint.verify(root / "step_0000002") is None
    out = train(1, run, ["train.save_every=2"])
    assert f"resumed from {root}/step_0000002" in out.stdout
    assert [s["step"] for s in read_metrics(run)["steps"]] == list(range(1, 11))


class PreemptAfter(Callback):
    """Asks for a preemption after step `step` (the PREEMPT file Slurm's warning writes): the
    trainer saves that step and raises Preempted."""

    def __init__(self, step: int):
        self.step = step

    def post_step(self, trainer, record: dict) -> None:
        if trainer.step == self.step:
            (trainer.run_dir / "PREEMPT").touch()


class StateAt(Callback):
    """The data position and AdamW's moments once the trainer stands at step `step`: after
    that step of a run, or right after a resume from it."""

    def __init__(self, step: int):
        self.step, self.consumed_samples, self.moments = step, None, None

    def pre_train(self, trainer) -> None:
        self.take(trainer)

    def post_step(self, trainer, record: dict) -> None:
        self.take(trainer)

    def take(self, trainer) -> None:
        if trainer.step != self.step:
            return
        self.consumed_samples = trainer.batches.consumed_samples
        self.moments = {}  # (optimizer, group, index) -> (exp_avg, exp_avg_sq)
        for i, opt in enumerate(trainer.engine.optimizer.chained_optimizers):
            for g, group in enumerate(opt.optimizer.param_groups):
                for n, param in enumerate(group["params"]):
                    state = opt.optimizer.state[param]
                    self.moments[i, g, n] = (
                        state["exp_avg"].clone(),
                        state["exp_avg_sq"].clone(),
                    )


def test_a_resumed_run_continues_bit_exactly(tmp_path):
    """4 steps straight against 2 steps, preempted (checkpoint), resumed for 2 more: the same
    4 losses to the bit, and at the resume the data position and AdamW's moments of every
    parameter are those of the straight run after step 2 (a resume that restarted the data at
    sample 0 or left the optimizer's state unloaded would train on from other ones)."""

    def trainer(run: Path, *callbacks: Callback):
        overrides = [
            f"train.dir={run}",
            "train.steps=4",  # both halves: the learning-rate schedule spans the same 4 steps
            "train.log_every=1",
            "train.eval_batches=1",
            "data.seq_len=32",
            "wandb.mode=disabled",
        ]
        built = experiment.build_trainer(experiment.load(TINY, overrides))
        for callback in callbacks:
            built.add_callback(callback)
        return built

    straight = StateAt(2)
    straight_eval = trainer(tmp_path / "straight", straight).fit()
    run = tmp_path / "resumed"
    with pytest.raises(Preempted):
        trainer(run, PreemptAfter(2)).fit()
    assert checkpoint.find_latest(run / "checkpoints").name == "step_0000002"
    resumed = StateAt(2)
    resumed_eval = trainer(run, resumed).fit()

    assert straight.consumed_samples == 2 * 16  # train.global_batch_size=16
    assert resumed.consumed_samples == straight.consumed_samples
    assert resumed.moments.keys() == straight.moments.keys() and straight.moments
    assert all(m.any() for pair in straight.moments.values() for m in pair)  # not all zeros
    for key, (exp_avg, exp_avg_sq) in straight.moments.items():
        assert torch.equal(resumed.moments[key][0], exp_avg), f"exp_avg of parameter {key}"
        assert torch.equal(resumed.moments[key][1], exp_avg_sq), f"exp_avg_sq of parameter {key}"

    losses = {
        name: [(r["step"], r["loss"]) for r in read_metrics(tmp_path / name)["steps"]]
        for name in ("straight", "resumed")
    }
    assert [step for step, _ in losses["straight"]] == [1, 2, 3, 4]
    assert losses["resumed"] == losses["straight"]  # ==: bit-equal floats (JSON round-trips)
    assert resumed_eval == straight_eval


class FailingEngine:
    """An engine whose save fails with `error` (the checkpoint's own files are never written)."""

    name = "megatron"

    def __init__(self, error: OSError):
        self.error = error

    def save_state(self, folder, position):
        raise self.error

    def layout(self) -> dict:
        return {}


def test_a_broken_pipe_during_a_save_is_named_not_blamed_on_the_disk(tmp_path):
    """A save that fails on EPIPE (a launcher or `| tee` gone with the signal that stops the run)
    says so and does not ask for disk space; ENOSPC keeps the disk's message. Either way no
    half-written folder is left."""
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    root, position = tmp_path / "checkpoints", {"step": 3, "consumed_samples": 48}
    config = {"model": {"num_loops": 2}}
    with pytest.raises(checkpoint.CheckpointError) as pipe:
        checkpoint.save(
            root, FailingEngine(BrokenPipeError(32, "Broken pipe")), position, config, 2
        )
    message = str(pipe.value)
    assert message.startswith(f"saving checkpoint step_0000003 in {root} failed: a write to a pipe")
    assert "(Broken pipe)" in message and "not the disk (" in message
    assert message.endswith("no earlier checkpoint exists. Relaunch to resume from it")
    full = FailingEngine(OSError(28, "No space left on device"))
    with pytest.raises(checkpoint.CheckpointError) as disk:
        checkpoint.save(root, full, position, config, 2)
    assert "([Errno 28] No space left on device; " in str(disk.value)
    assert str(disk.value).endswith("Free space and relaunch to resume from it")
    assert list(root.iterdir()) == []
