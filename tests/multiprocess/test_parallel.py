"""Tensor × pipeline × data parallel runs equal one process; checkpoints resume exactly, in any
layout; a corrupt checkpoint is skipped; SIGTERM saves and exits for a requeue.

Every run here is a real `megaloop train` with gloo on the CPU, its ranks started as torchrun
starts them (multiproc.launch; torchrun itself in the kill -9 test).
"""

import shutil
import signal
import subprocess

import pytest

from megaloop import experiment
from megaloop.parallel.cost import params_per_rank, state_bytes
from multiproc import (
    BASE,
    OBJECTIVES,
    assert_same_curve,
    command,
    kill_9_then_resume,
    metrics,
    train,
    train_here,
    wait_for_step,
)
from support import TINY, env

pytestmark = pytest.mark.multiprocess

LAYOUTS = {  # name: (processes, overrides)
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2xpp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "dp2": (2, []),
    "dp2xpp2": (4, ["parallel.pp=2"]),
}
REL = 1e-5  # fp32; measured differences are ~1e-7
RECOMPUTE = {  # objective: train.recompute of its TP x PP run (one option each)
    "exit_weighted": "loop",
    "exit_mixture": "selective",
    "study": "full",
}
"""Recompute changes memory, not arithmetic (tests/unit/parallel/test_measure.py, on one
process), so these runs must still equal one process without it: each option meets TP's RNG
and all-reduces and PP's stages here, without launches of its own. per_loop+penalty and the
untied W_out run TP x PP without recompute."""


def recompute(objective: str, layout: str) -> str:
    return RECOMPUTE.get(objective, "none") if layout == "tp2xpp2" else "none"


def layout_overrides(objective: str, layout: str) -> list[str]:
    option = recompute(objective, layout)
    return [*OBJECTIVES[objective], *LAYOUTS[layout][1], f"train.recompute={option}"]


@pytest.fixture(scope="module")
def run(reference_run, tmp_path_factory):
    """run(objective, layout) → (run_dir, metrics), each trained once per test module."""
    cache = {}

    def get(objective: str, layout: str = "one"):
        if layout == "one":
            return reference_run(objective)
        if (objective, layout) not in cache:
            run_dir = tmp_path_factory.mktemp(f"{objective}-{layout}")
            train(LAYOUTS[layout][0], run_dir, layout_overrides(objective, layout))
            cache[objective, layout] = (run_dir, metrics(run_dir))
        return cache[objective, layout]

    return get


@pytest.mark.parametrize(
    "objective, layout",
    [
        (objective, layout)
        for objective in OBJECTIVES
        for layout in LAYOUTS
        # every objective under TP x PP at once (its TP and its pipeline code); one objective
        # through every layout, TP or PP alone included (the engine's steps, which objectives
        # share); a second under DP, its penalty averaged over the ranks' different batches
        if objective == "exit_weighted"
        or layout == "tp2xpp2"
        or (objective == "per_loop+penalty" and layout == "dp2")
    ],
)
def test_layout_equals_one_process(run, objective, layout, memory_report):
    _, reference = run(objective)
    _, parallel = run(objective, layout)
    assert len(parallel["steps"]) == 10
    assert parallel["config"]["train"]["recompute"] == recompute(objective, layout)
    assert_same_curve(parallel, reference, REL)
    report = parallel["layout"]
    memory_report(f"{objective} {layout}", report)
    model = experiment.load(TINY, [*BASE, *OBJECTIVES[objective]]).model
    cfg = experiment.load(TINY, [*BASE, *layout_overrides(objective, layout)])
    planned = state_bytes(cfg, report["tp"], report["pp"], report["dp"])
    by_position = {}
    for r in report["ranks"]:  # the planner's per-rank figures are what the ranks hold
        held = params_per_rank(model, report["tp"], report["pp"], r["pp_rank"])
        assert r["params"] == held and r["param_bytes"] == 4 * held
        if r["params"] == planned["params"]:  # the largest stage is the planner's
            assert r["param_bytes"] == planned["weights"]
            # the distributed optimizer's shards: 1/DP each, up to 64-value alignment padding
            assert r["optimizer_bytes"] == pytest.approx(planned["optimizer"], rel=0.01)
        by_position.setdefault((r["tp_rank"], r["pp_rank"]), []).append(r["optimizer_bytes"])
        assert r["grad_bytes"] >= 4 * held  # the grad buffer, padded for the sharding
    for (_, pp_rank), shards in by_position.items():  # Adam's two moments, exactly, over DP
        assert sum(shards) == 8 * params_per_rank(model, report["tp"], report["pp"], pp_rank)
    if report["pp"] == 2:  # each stage holds its half of the shared stack, once
        one = reference["layout"]["ranks"][0]["layer_params"]
        per_stage = {r["pp_rank"]: r["layer_params"] for r in report["ranks"]}
        assert per_stage[0] == per_stage[1]
        assert per_stage[0] == one // 2 if report["tp"] == 1 else per_stage[0] < one // 2


def test_untied_w_out_at_tp2xpp2_equals_one_process(tmp_path):
    """W_out as its own matrix (model.tie_embeddings=false): on the last pipeline stage, split
    over the TP ranks like the tied copy. The final_norm readout reads exits 1..K-1 raw and exit
    K normalised, so one run covers both forms every readout is made of (the norm readout alone,
    with Ouro's untied W_out, in test_layout_equals_one_process[exit_mixture-tp2xpp2])."""
    overrides = [
        "objective.kind=per_loop",
        "model.tie_embeddings=false",
        "model.readout=final_norm",
    ]
    train_here(tmp_path / "one", overrides)
    train(4, tmp_path / "tp2xpp2", [*overrides, *LAYOUTS["tp2xpp2"][1]])
    reference, parallel = metrics(tmp_path / "one"), metrics(tmp_path / "tp2xpp2")
    assert len(parallel["steps"]) == 10
    assert_same_curve(parallel, reference, REL)
    model = experiment.load(TINY, [*BASE, *overrides]).model
    assert not model.tie_embeddings
    last_stage = [r for r in parallel["layout"]["ranks"] if r["pp_rank"] == 1]
    assert all(r["params"] == params_per_rank(model, 2, 2, 1) for r in last_stage)


def test_the_study_preset_with_dropout_trains_at_tp2xpp2(run, tmp_path):
    """Dropout draws other masks in another layout, so no curve to equal: the run trains (finite,
    its loss falls) and differs from the same run without dropout."""
    _, without = run("study", "tp2xpp2")
    dropout = [*OBJECTIVES["study"], "model.dropout=0.1", "train.steps=5", "train.save_every=0"]
    train(4, tmp_path, [*dropout, *LAYOUTS["tp2xpp2"][1]])
    losses = [r["loss"] for r in metrics(tmp_path)["steps"]]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert losses[1:] != [r["loss"] for r in without["steps"]][1:5]


def copy_run(source, run_dir, drop_after: int):
    """A copy of a finished run without its checkpoints after step `drop_after`."""
    shutil.copytree(source, run_dir)
    for folder in (run_dir / "checkpoints").glob("step_*"):
        if int(folder.name.split("_")[1]) > drop_after:
            shutil.rmtree(folder)


@pytest.mark.parametrize("objective", ["exit_weighted", "study"])
def test_reshard_tp2xpp2_checkpoint_into_one_process(run, objective, tmp_path, capsys):
    """Another layout, and recompute off where the TP x PP run had it on (RECOMPUTE)."""
    source, _ = run(objective, "tp2xpp2")
    _, reference = run(objective)
    copy_run(source, tmp_path / "run", drop_after=5)
    train_here(tmp_path / "run", OBJECTIVES[objective])
    assert f"resumed from {tmp_path}/run/checkpoints/step_0000005" in capsys.readouterr().out
    assert_same_curve(metrics(tmp_path / "run"), reference, REL)


def test_reshard_one_process_checkpoint_into_pp2(run, tmp_path):
    source, reference = run("per_loop+penalty")
    copy_run(source, tmp_path / "run", drop_after=5)
    out = train(2, tmp_path / "run", [*OBJECTIVES["per_loop+penalty"], "parallel.pp=2"])
    assert f"resumed from {tmp_path}/run/checkpoints/step_0000005" in out.stdout
    assert_same_curve(metrics(tmp_path / "run"), reference, REL)


def test_kill_9_then_resume_continues_exactly(run, tmp_path):
    _, reference = run("exit_weighted", "pp2")
    kill_9_then_resume(tmp_path / "run", [*OBJECTIVES["exit_weighted"], "parallel.pp=2"], reference)


@pytest.mark.parametrize("fp32_residual", ["true", "false"])
def test_the_pipeline_under_bf16_equals_one_process(tmp_path, fp32_residual):
    """bf16 autocast through the circular pipeline. Every rank receives into megatron-core's
    pipeline_dtype (fp32): an fp32 residual stream passes as it is, a bf16 one as its exact fp32
    copy (before that cast, a bf16 tensor sent into an fp32 buffer made the first loss
    non-finite). Not bitwise: the pipeline sums a loop's gradients in another order (1e-7 in
    fp32, test_layout_equals_one_process) and bf16's roundings of the next activations carry
    that on; measured here 2e-6 of the loss and 1.2e-4 of one loop's RMS, against 1e-3."""
    overrides = [
        *OBJECTIVES["per_loop+penalty"],
        "train.bf16=true",
        f"model.fp32_residual={fp32_residual}",
        "train.steps=4",
        "train.save_every=0",
    ]
    train(1, tmp_path / "one", overrides)  # a rank of its own, as the pipeline's ranks
    train(2, tmp_path / "pp2", [*overrides, "parallel.pp=2"])
    reference, piped = metrics(tmp_path / "one"), metrics(tmp_path / "pp2")
    assert len(piped["steps"]) == 4
    assert_same_curve(piped, reference, 1e-3)


def test_corrupt_or_partial_checkpoints_are_reported_and_skipped(run, tmp_path, capsys):
    source, reference = run("per_loop+penalty")
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    ckpts = run_dir / "checkpoints"
    shard = next((ckpts / "step_0000010").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    partial = ckpts / "step_0000009"
    shutil.copytree(ckpts / "step_0000005", partial)
    (partial / "manifest.json").unlink()  # never finished
    (ckpts / ".tmp_step_0000011").mkdir()  # an interrupted save
    train_here(run_dir, OBJECTIVES["per_loop+penalty"])
    out = capsys.readouterr().out
    assert f"skipping checkpoint {ckpts}/step_0000010: {shard.name} has" in out
    assert f"skipping checkpoint {partial}: no manifest.json" in out
    assert f"resumed from {ckpts}/step_0000005" in out
    assert_same_curve(metrics(run_dir), reference, 1e-12)


def test_sigterm_saves_exits_75_and_resumes(run, tmp_path):
    _, reference = run("per_loop+penalty")
    run_dir = tmp_path / "run"
    overrides = [*OBJECTIVES["per_loop+penalty"], "train.save_every=0"]
    # the run waits at step 3 for the signal (the hold-at-step fault): no race with its speed
    proc = subprocess.Popen(
        command(1, run_dir, overrides, ["--hold-at-step", "3"]),
        text=True,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_0000003"
    assert "preempted at step 3" in err
    train_here(run_dir, overrides)
    assert_same_curve(metrics(run_dir), reference, 1e-12)
