"""Checkpoint safety on one process: a directory whose checkpoints are all unreadable stops
with each one named (it never trains from step 0 beside them), and pruning counts only
loadable checkpoints (a corrupt one never pushes out a good one)."""

from pathlib import Path

import pytest

from megaloop import experiment
from megaloop.config import ConfigError
from megaloop.train import checkpoint
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
