"""Training on one process: the loss falls, and a run directory holds what it promises."""

import fcntl
import json
import math
import os
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megaloop import experiment
from megaloop.cli import main
from megaloop.parallel.engines import ENGINES
from multiproc import metrics as read_metrics
from support import TINY, article, megaloop


def test_fifty_steps_of_the_tiny_config_reduce_the_loss(tmp_path):
    cfg = experiment.load(
        TINY,
        [
            f"train.dir={tmp_path}",
            "train.steps=50",
            "train.log_every=1",
            "data.seq_len=64",
            "wandb.mode=disabled",
        ],
    )
    trainer = experiment.build_trainer(cfg, log=True)
    trainer.fit()
    steps = read_metrics(tmp_path)["steps"]
    assert [r["step"] for r in steps] == list(range(1, 51))
    first = sum(r["loss"] for r in steps[:5]) / 5
    last = sum(r["loss"] for r in steps[-5:]) / 5
    assert first > 5.0  # ln(256) = 5.55 at initialisation
    assert last < 0.6 * first, (first, last)
    for r in steps:
        assert len(r["ce"]) == len(r["hidden_rms"]) == 4 and r["tokens_per_s"] > 0


def test_train_cli_writes_checkpoint_metrics_and_offline_wandb_run(tmp_path):
    run = tmp_path / "run"
    proc = megaloop(
        "train",
        TINY,
        f"train.dir={run}",
        "train.steps=6",
        "train.log_every=2",
        "train.save_every=3",
        "train.keep_last=1",
        "data.seq_len=32",
        "model.readout=raw",
        "objective.norm_penalty=0.01",
        extra_env={"WANDB_MODE": "offline", "OMP_NUM_THREADS": "2"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(run)
    assert metrics["config"]["model"]["readout"] == "raw"
    assert [r["step"] for r in metrics["steps"]] == [2, 4, 6]
    for key in ("loss", "ce", "hidden_rms", "norm_penalty", "tokens_per_s"):
        assert key in metrics["steps"][-1]
    assert metrics["evals"][-1]["step"] == 6
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert ckpts == ["step_0000006"]  # keep_last=1 removed step 3
    assert (run / "checkpoints/latest").read_text() == "step_0000006"
    ckpt = run / "checkpoints/step_0000006"
    assert {"meta.json", "manifest.json", "common.pt", ".metadata"} <= {
        p.name for p in ckpt.iterdir()
    }
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["consumed_samples"] == 6 * 16 and meta["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    out = tmp_path / "consolidated"
    proc = megaloop("ckpt", "consolidate", run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = load_file(out / "model.safetensors")
    assert weights["embedding.word_embeddings.weight"].shape == (256, 128)
    assert "readout.norm.weight" not in weights  # raw readout: no readout norm
    offline = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0


def test_bf16_autocast_follows_fp32(tmp_path):
    losses = {}
    for bf16 in (False, True):
        cfg = experiment.load(
            TINY,
            [
                f"train.dir={tmp_path / str(bf16)}",
                "train.steps=4",
                f"train.bf16={bf16}",
                "train.log_every=1",
                "data.seq_len=32",
                "wandb.mode=disabled",
            ],
        )
        experiment.build_trainer(cfg).fit()
        steps = read_metrics(tmp_path / str(bf16))["steps"]
        losses[bf16] = [r["loss"] for r in steps]
    # bf16 keeps ~3 significant digits; the trajectories agree to a percent over 4 steps
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)
    assert losses[True] != losses[False]


def objective_of(variant: str, r: dict) -> float:
    """The loss each variant optimises, from its logged terms (per-loop means over the step)."""
    ce = r["ce"]
    loss = {
        "terminal": ce[-1],
        "exit_weighted": sum(r.get("weighted_ce", [])) - 0.1 * r.get("exit_entropy", 0.0),
    }.get(variant, sum(ce) / len(ce))
    return loss + sum(r["norm_penalty"])  # λ/K·Σ_k E‖H_k‖²_rms, 0 when off


@pytest.mark.parametrize(
    "variant, objective, own",
    [
        ("terminal", ["objective.kind=terminal"], None),
        (
            "exit_weighted",
            ["objective.kind=exit_weighted", "model.exit_gate=true", "objective.entropy_beta=0.1"],
            "exit_gate.proj.weight",
        ),
        (
            "damping",
            ["model.recurrence=damping", "model.readout=final_norm"],
            "recurrence.damping_logit",
        ),
        (
            "norm_penalty",
            ["model.recurrence=rmsnorm", "objective.norm_penalty=0.1"],
            "recurrence.norm.weight",
        ),
    ],
)
def test_every_variant_takes_training_steps(tmp_path, variant, objective, own):
    """Three steps of each variant: finite, with a gradient, the logged loss the variant's own
    objective of its logged terms, and every weight moved, the variant's own parameter included
    (tiny.yaml has no weight decay, so only a gradient moves a weight; step 1's learning rate is
    0 in the warm-up, steps 2 and 3 move them)."""
    cfg = experiment.load(
        TINY,
        [
            f"train.dir={tmp_path}",
            "train.steps=3",
            "train.log_every=1",
            "data.seq_len=32",
            "wandb.mode=disabled",
            *objective,
        ],
    )
    assert cfg.optim.weight_decay == 0
    trainer = experiment.build_trainer(cfg)
    module = trainer.engine.module
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert own is None or own in before, sorted(before)
    result = trainer.fit()
    assert len(result["ce"]) == 4
    steps = read_metrics(tmp_path)["steps"]  # checks every loss and CE is finite
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert len(r["ce"]) == len(r["hidden_rms"]) == len(r["norm_penalty"]) == 4, r
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
        assert r["loss"] == pytest.approx(objective_of(variant, r), rel=1e-5), r
        if variant == "norm_penalty":
            assert all(p > 0 for p in r["norm_penalty"]), r
        else:
            assert r["norm_penalty"] == [0.0] * 4, r
        if variant == "exit_weighted":
            assert sum(r["exit_prob"]) == pytest.approx(1.0) and r["exit_entropy"] > 0, r
    assert steps[0]["lr"] == 0 and all(r["lr"] > 0 for r in steps[1:])
    still = [n for n, p in module.named_parameters() if torch.equal(p.detach(), before[n])]
    assert not still, f"not moved by 3 steps: {still}"


def test_terminal_logs_ce_k_unscaled_over_many_micro_batches(tmp_path):
    """The terminal loss is CE_K itself; megatron-core's schedule divides the returned loss by
    the number of micro-batches in place, which must not reach the logged CE_K (it did: 64
    validation micro-batches logged CE_K / 64)."""
    cfg = experiment.load(
        TINY,
        [
            f"train.dir={tmp_path}",
            "train.steps=2",
            "data.seq_len=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "train.eval_batches=8",
            "train.log_every=1",
            "objective.kind=terminal",
            "wandb.mode=disabled",
        ],
    )
    experiment.build_trainer(cfg).fit()
    metrics = read_metrics(tmp_path)
    for record in metrics["steps"] + metrics["evals"]:
        assert record["ce"][-1] == pytest.approx(record["loss"], rel=1e-6), record
        assert record["ce"][-1] > 4.0  # ~ln(256) this early


def test_stage_two_trains_the_exit_gate_alone(tmp_path):
    """objective.kind=gate_gain from a stage-1 checkpoint: the gate's weights move, every other
    weight is the checkpoint's, bit for bit; without train.init_from it is refused."""
    common = ["model.exit_gate=true", "data.seq_len=32", "wandb.mode=disabled"]
    stage1 = experiment.load(
        TINY,
        [
            *common,
            f"train.dir={tmp_path / 's1'}",
            "train.steps=2",
            "train.save_every=2",
            "objective.kind=exit_weighted",
        ],
    )
    experiment.build_trainer(stage1, log=False).fit()
    with pytest.raises(ValueError, match="train.init_from"):
        experiment.load(TINY, [*common, "objective.kind=gate_gain", f"train.dir={tmp_path}"])
    stage2 = experiment.load(
        TINY,
        [
            *common,
            f"train.dir={tmp_path / 's2'}",
            "train.steps=3",
            "train.save_every=3",
            "objective.kind=gate_gain",
            "optim.lr=1e-2",
            f"train.init_from={tmp_path / 's1/checkpoints/step_0000002'}",
        ],
    )
    experiment.build_trainer(stage2, log=False).fit()
    before, _, _ = experiment.consolidated(tmp_path / "s1")
    after, _, _ = experiment.consolidated(tmp_path / "s2")
    assert before.keys() == after.keys()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all("exit_gate." in name for name in moved), moved
    assert any("exit_gate.proj" in name for name in moved)


def tree(root: Path) -> dict:
    """Every path under `root` with its bytes (files) and modification time: what a dry run
    must leave as it found it."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in [root, *root.rglob("*")]
    }


def test_dry_run_builds_the_run_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(article(random.Random(s)) for s in range(100)))
    run = tmp_path / "run"
    args = ["data.kind=text", f"data.path={text}", "data.seq_len=32", f"train.dir={run}"]
    assert main(["train", TINY, *args, "train.steps=5", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["text.txt"]  # no run dir, metrics, wandb or lock
    assert "nothing trained" in out
    assert "parameters: 557,696 (embedding 32,768, non-embedding 524,928)" in out
    assert "the largest rank holds 557,696" in out  # the model was built
    assert "engine=megatron, 1 rank(s): TP=1 PP=1 DP=1" in out
    assert "steps: 5 = 80 training windows (2,560 tokens)" in out
    assert re.search(r"validation: 64 windows of the split's [\d,]+\n", out), out
    assert f"train.dir: {run} (does not exist yet" in out


def test_a_deepspeed_dry_run_writes_nothing_either(tmp_path, capsys):
    """DeepSpeed's deepspeed.json is written when the run starts, not when its engine is built."""
    run = tmp_path / "run"
    args = [f"train.dir={run}", "engine=deepspeed", "deepspeed.zero_stage=3", "data.seq_len=32"]
    assert main(["train", TINY, *args, "--dry-run"]) == 0
    assert "engine=deepspeed ZeRO-3, 1 rank(s): TP=1 PP=1 DP=1" in capsys.readouterr().out
    assert not run.exists()


def test_dry_run_leaves_an_existing_run_dir_as_it_was(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "notes.txt").write_text("mine\n")
    (run / ".lock").write_text('{"pid": 1, "host": "elsewhere"}\n')
    (run / "STOPPED").write_text('{"message": "an earlier stop"}\n')  # fit would remove it
    before = tree(run)
    args = ["train", TINY, f"train.dir={run}", "train.steps=3", "--dry-run"]
    assert main(args) == 0
    assert "exists, no checkpoint; starts fresh" in capsys.readouterr().out
    assert tree(run) == before
    holder = os.open(run / ".lock", os.O_RDONLY)  # a live run holding the lock
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        assert main(args) == 2
    finally:
        os.close(holder)
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "is in use by another run (pid 1 on elsewhere" in err
    assert tree(run) == before


def test_dry_run_of_a_run_that_can_resume_names_the_step_it_resumes_from(tmp_path, capsys):
    """Checkpoints at steps 2 and 4: the dry run says the run resumes, from step 4; the same
    without the `latest` marker (a run stopped between the rename and the marker), since the
    run itself resumes from the newest complete checkpoint; and from step 2 once step 4 is
    corrupt, as the run would."""
    run = tmp_path / "run"
    overrides = [f"train.dir={run}", "data.seq_len=32", "wandb.mode=disabled"]
    experiment.build_trainer(
        experiment.load(TINY, [*overrides, "train.steps=4", "train.save_every=2"])
    ).fit()
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000002", "step_0000004"]

    def says():
        assert main(["train", TINY, *overrides, "train.steps=8", "--dry-run"]) == 0
        out = capsys.readouterr().out.splitlines()
        (line,) = [x for x in out if "train.dir:" in x]
        skips = [x for x in out if x.startswith("megaloop: skipping checkpoint")]
        assert len(skips) <= 1, "the checkpoints were looked up more than once"
        return line

    resumes = f"  train.dir: {run} (exists; resumes from step {{}}, its newest complete checkpoint "
    assert says() == resumes.format(4) + f"{ckpts / 'step_0000004'})"
    (ckpts / "latest").unlink()
    assert says() == resumes.format(4) + f"{ckpts / 'step_0000004'})"
    shard = next((ckpts / "step_0000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    assert says() == resumes.format(2) + f"{ckpts / 'step_0000002'})"


def test_dry_run_with_a_missing_data_file_fails_before_any_compute(tmp_path, capsys, monkeypatch):
    def build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(type(ENGINES["megatron"]), "build", build)
    run, missing = tmp_path / "run", tmp_path / "missing.txt"
    args = ["data.kind=text", f"data.path={missing}", f"train.dir={run}"]
    assert main(["train", TINY, *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"megaloop: error: config key 'data.path': got '{missing}'; no such file"
    ]
    assert not run.exists()


# -- what `megaloop train` says at its start and end --------------------------------------------


def test_train_names_its_run_directory_first_and_last_and_labels_its_result(tmp_path, capsys):
    run = tmp_path / "run"
    args = [f"train.dir={run}", "train.steps=2", "data.seq_len=32", "train.eval_batches=1"]
    assert main(["train", TINY, *args, "train.log_every=1", "wandb.mode=disabled"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"run directory: {run}"
    final = read_metrics(run)["evals"][-1]
    assert lines[-3] == "megaloop train: finished at step 2"
    assert lines[-2].startswith(f"run directory: {run} (metrics.jsonl, checkpoints/)")
    label, _, record = lines[-1].partition(" ")
    assert label == "result:"
    assert json.loads(record) == {
        "valid_ce": final["ce"],
        "hidden_rms": final["hidden_rms"],
        "valid_windows": final["valid_windows"],
    }


def test_exit_aware_training_draws_exits_in_the_engines_forward(tmp_path):
    """objective.exit_kv=copy reaches the engine's model: step 1 (learning rate 0) logs loop 1's
    CE as a plain run does (every token runs loop 1 on its own keys) and every deeper loop's
    otherwise, as some tokens have exited before it."""
    ce = {}
    for name, exits in (
        ("plain", []),
        ("exits", ["objective.exit_kv=copy", "objective.exit_rate=0.5"]),
    ):
        cfg = experiment.load(
            TINY,
            [
                f"train.dir={tmp_path / name}",
                "train.steps=1",
                "train.log_every=1",
                "data.seq_len=32",
                "wandb.mode=disabled",
                *exits,
            ],
        )
        experiment.build_trainer(cfg).fit()
        ce[name] = read_metrics(tmp_path / name)["steps"][0]["ce"]
    assert ce["exits"][0] == pytest.approx(ce["plain"][0], rel=1e-6), ce
    assert all(abs(a - b) > 1e-4 for a, b in zip(ce["exits"][1:], ce["plain"][1:])), ce
