"""`megaloop plan`: its parameter counts are the real model's, its activation figures are within
15% of what autograd keeps (saved-tensor hooks), and its choices follow from the figures. The
engines' measured weights and optimizer state are held to the planner in test_parallel.py and
test_deepspeed.py, where the real multi-process runs are."""

import re

import pytest
import torch

from megaloop import experiment
from megaloop.config import ConfigError
from megaloop.model.looped import build_model
from megaloop.parallel import cost, measure, planner
from support import ROOT, TINY

SHAPE = [
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_layers=2",
    "model.vocab_size=512",
    "model.max_seq_len=64",
    "data.seq_len=64",
    "train.micro_batch_size=2",
]
TOLERANCE = 0.15


def measured(cfg) -> int:
    model = build_model(cfg.model, 0, recompute=cfg.train.recompute)
    model.train()
    tokens = torch.randint(
        0,
        cfg.model.vocab_size,
        (cfg.train.micro_batch_size, cfg.data.seq_len),
        generator=torch.Generator().manual_seed(0),
    )
    return measure.saved_activation_bytes(model, tokens)


@pytest.mark.parametrize("loops", [1, 2, 4])
@pytest.mark.parametrize("recompute", ["none", "selective", "full", "loop"])
def test_activation_figures_are_within_15_percent_of_the_measurement(loops, recompute):
    cfg = experiment.load(
        TINY, [*SHAPE, f"model.num_loops={loops}", f"train.recompute={recompute}"]
    )
    b = cfg.train.micro_batch_size
    planned = cost.activation_bytes(cfg, tp=1, pp=1, dp=1, micro_batch=b)["total"]
    assert planned == pytest.approx(measured(cfg), rel=TOLERANCE)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.num_query_groups=2", "model.ffn_hidden_size=96"],
        [
            "model.layer_norms=sandwich",
            "model.loop_norm=shared",
            "model.exit_gate=true",
            "objective.kind=exit_mixture",
        ],
        ["model.readout=raw", "train.recompute=full"],
        ["model.readout=final_norm", "model.num_layers=4"],
        ["model.attention=megatron"],
        ["model.attention=megatron", "train.recompute=selective"],
    ],
)
def test_activation_figures_follow_the_architecture(overrides):
    cfg = experiment.load(TINY, [*SHAPE, "model.num_loops=2", *overrides])
    b = cfg.train.micro_batch_size
    planned = cost.activation_bytes(cfg, tp=1, pp=1, dp=1, micro_batch=b)["total"]
    assert planned == pytest.approx(measured(cfg), rel=TOLERANCE)


@pytest.mark.parametrize("attention", ["sdpa", "megatron"])
def test_dropout_masks_are_counted(attention, monkeypatch):
    """The dropout masks of H_0, each FFN output (and megatron attention's probabilities), as
    many elements as the CPU keeps. The CPU keeps float masks (4 bytes, CUDA a bool: the
    planner's DROPOUT_MASK_BYTES) and runs SDPA's dropout in its math kernel, which keeps the
    s×s probabilities that CUDA's flash kernels do not: both are set to CUDA's way here."""
    monkeypatch.setattr(cost, "DROPOUT_MASK_BYTES", 4)
    cfg = experiment.load(
        TINY,
        [*SHAPE, "model.num_loops=2", "model.dropout=0.1", f"model.attention={attention}"],
    )
    model = build_model(cfg.model, 0)
    model.train()
    if attention == "sdpa":
        for layer in model.layers:
            layer.self_attention.core_attention.dropout = 0.0
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, 64))
    without = experiment.load(TINY, [*SHAPE, "model.num_loops=2", f"model.attention={attention}"])
    planned = {
        c.model.dropout: cost.activation_bytes(c, tp=1, pp=1, dp=1, micro_batch=2)["total"]
        for c in (cfg, without)
    }
    kept = measure.saved_activation_bytes(model, tokens)
    assert planned[0.1] == pytest.approx(kept, rel=TOLERANCE)
    # what dropout adds, on its own: the masks' elements exactly
    added = kept - measure.saved_activation_bytes(build_model(without.model, 0).train(), tokens)
    assert planned[0.1] - planned[0.0] == pytest.approx(added, rel=0.01)


def real_counts(model_cfg) -> dict:
    with torch.device("meta"):
        model = build_model(model_cfg, seed=None, use_cpu_initialization=True)
    return model.num_parameters()


@pytest.mark.parametrize(
    "path, overrides, total",
    [
        ("configs/model/44m.yaml", [], 44_048_896),
        ("configs/model/129m.yaml", [], 128_994_048),
        # Ouro-1.4B exactly (the count of its published checkpoint) ...
        ("configs/model/1p4b.yaml", [], 1_434_652_673),
        # ... less the second norm of each sublayer (2 x 24 x d), the shared loop norm and the gate
        (
            "configs/model/1p4b.yaml",
            [
                "model.layer_norms=pre",
                "model.loop_norm=separate",
                "model.readout=raw",
                "model.exit_gate=false",
            ],
            1_434_652_673 - 2 * 24 * 2048 - 2048 - 2049,
        ),
        ("configs/model/44m.yaml", ["model.recurrence=damping"], 44_048_896 + 512),
        (
            "configs/model/44m.yaml",
            ["model.recurrence=damping", "model.damping_shape=scalar"],
            44_048_896 + 1,
        ),
        (
            "configs/model/44m.yaml",
            ["model.recurrence=rmsnorm", "model.tie_embeddings=false", "model.num_query_groups=2"],
            None,
        ),
    ],
)
def test_parameter_counts_are_the_real_models(path, overrides, total):
    model = experiment.load(path, overrides).model
    counts = cost.parameter_counts(model)
    assert counts == real_counts(model)
    if total is not None:
        assert counts["total"] == total


def test_flops_count_every_exit_forward_and_the_loss_exits_backward():
    cfg = experiment.load(TINY, [*SHAPE, "model.num_loops=4"])
    m = cfg.model
    readout = 2 * m.hidden_size * m.vocab_size
    per_loop = cost.flops_per_token(m, 64, 4)
    terminal = cost.flops_per_token(m, 64, 1)
    assert per_loop - terminal == pytest.approx(2 * readout * 3)
    # one loop's stack: 6 x (matmul parameters) + 12 s d L, by hand
    d, f, L = 64, m.ffn_size, 2
    stack = 6 * L * (4 * d * d + 3 * d * f) + 12 * 64 * d * L
    assert cost.flops_per_token(m, 64, 0) == pytest.approx(4 * stack + 4 * readout)


def plan_1p4b(*overrides, gpus=128, mem=80.0):
    cfg = experiment.load("configs/experiments/fineweb/1p4b_42b_tokens.yaml", list(overrides))
    return planner.plan(cfg, gpus, mem, 989.4, 0.4)


def test_plan_of_the_1p4b_run():
    p = plan_1p4b()
    assert p.params == 1_434_652_673 and p.dp == 128
    assert p.weights == p.grads == 4 * p.params and p.optimizer == 8 * p.params / 128
    # K=4 loops of 24 layers at 4,096 tokens keep more than one 80 GiB GPU holds: recompute fits
    assert not p.fits(80) and p.max_micro_batch == 0
    full = plan_1p4b("train.recompute=full")
    assert full.fits(80) and full.activations < p.activations / 5 and full.max_micro_batch >= 4
    assert full.step_seconds > p.step_seconds
    # twice the GPUs: half the step time at the same MFU
    assert plan_1p4b("train.eval_batches=256", gpus=256).step_seconds == pytest.approx(
        p.step_seconds / 2
    )
    tp2 = plan_1p4b("parallel.tp=2")
    assert tp2.weights == pytest.approx(p.weights / 2, rel=0.01) and tp2.dp == 64


def test_search_ranks_only_layouts_that_fit_and_names_the_rest():
    cfg = experiment.load("configs/experiments/fineweb/1p4b_42b_tokens.yaml")
    plans, left_out = planner.search(cfg, 128, 80.0, 989.4, 0.4)
    assert plans and all(p.fits(80) for p in plans)
    assert [p.step_seconds for p in plans] == sorted(p.step_seconds for p in plans)
    assert any(
        "megatron, TP=1 PP=1 DP=128, micro-batch 1, recompute=none" in why for why in left_out
    )
    assert all(p.pp == 1 for p in plans if p.engine == "deepspeed")


def test_plan_cli(capsys):
    from megaloop.cli import main

    assert (
        main(
            [
                "plan",
                "configs/experiments/fineweb/1p4b_42b_tokens.yaml",
                "--gpus",
                "128",
                "--gpu-mem",
                "80",
                "train.recompute=full",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "parameters: 1,434,652,673" in out and "DP=128" in out and ": fits in 90%" in out
    assert (
        main(
            [
                "plan",
                "configs/experiments/fineweb/1p4b_42b_tokens.yaml",
                "--gpus",
                "12",
                "--gpu-mem",
                "80",
                "parallel.tp=8",
            ]
        )
        == 2
    )
    assert "world size 12 must be a multiple of tp*pp=8" in capsys.readouterr().err
    assert (
        main(
            [
                "plan",
                TINY,
                "--gpus",
                "2",
                "--gpu-mem",
                "1",
                "--search",
                "train.micro_batch_size=2",
                "train.global_batch_size=4",
                "train.eval_batches=4",
            ]
        )
        == 0
    )
    assert "| 1 | " in capsys.readouterr().out


# -- the planner's proposal: what `plan` prints and `slurm submit` launches --------------------

STUDY_44M = "configs/experiments/study/44m/per_loop_norm.yaml"
BASELINE_1P4B = "configs/experiments/fineweb/1p4b_baseline.yaml"


def plan_lines(capsys, config, gpus, mem, *rest) -> tuple[int, str, str]:
    from megaloop.cli import main

    rc = main(["plan", config, "--gpus", str(gpus), "--gpu-mem", str(mem), *rest])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("gpus, share", [(4, 16), (8, 8)])
def test_plan_proposes_the_micro_batch_that_splits_the_study_batch(capsys, gpus, share):
    """The study's 44M rows run 64 windows in one micro-batch of 64 (its released configs'
    batch_size); on `gpus` data-parallel GPUs each rank holds 64 / gpus windows, so that is the
    largest micro-batch, and the override that applies it is printed."""
    rc, out, err = plan_lines(capsys, STUDY_44M, gpus, 80)
    assert rc == 0, err
    assert f"layout: megatron, TP=1 PP=1 DP={gpus}, micro-batch {share}, recompute=none" in out
    assert f"applies with: train.micro_batch_size={share} (" in out


def test_plan_of_the_1p4b_baseline_on_64_gpus_takes_tp_4():
    """16 sequences a step split over DP = 64 / (TP x PP) only where DP divides 16: TP=4 (DP=16)
    is the smallest model-parallel degree that runs, and one sequence a micro-batch fits."""
    cfg = experiment.load(BASELINE_1P4B)
    assert cfg.train.global_batch_size == 16 and cfg.parallel.tp == cfg.parallel.pp == 1
    p = planner.propose(cfg, 64, 80.0, 8)
    assert (p.plan.tp, p.plan.pp, p.plan.dp, p.plan.micro_batch) == (4, 1, 16, 1)
    assert p.changes == {"parallel.tp": 4} and p.overrides == ["parallel.tp=4"]
    with pytest.raises(ConfigError, match=r"16 windows a step do not split over DP=64"):
        planner.propose(cfg, 64, 80.0, 8, fixed=True)


def test_a_layout_that_does_not_fit_exits_nonzero_with_the_next_step(capsys):
    rc, out, err = plan_lines(capsys, BASELINE_1P4B, 8, 2, "parallel.tp=1")
    assert rc == 2
    assert "does NOT fit in 90% of 2 GiB" in out  # the breakdown of what was asked for
    (line,) = err.strip().splitlines()
    assert line.startswith("megaloop: error: nothing fits 2 GiB per GPU: the closest is ")
    assert "use GPUs with more memory, more GPUs" in line and "--search" in line


def test_plan_turns_recompute_on_only_where_nothing_fits_without():
    """The 1.4B run (4,096 tokens, K=4 x 24 layers) keeps ~66 GiB of activations a sequence:
    with TP=1 fixed nothing fits 80 GiB without recompute (test_plan_of_the_1p4b_run), and
    selective keeps the same stack activations; full recompute fits."""
    cfg = experiment.load("configs/experiments/fineweb/1p4b_42b_tokens.yaml")
    p = planner.propose(cfg, 128, 80.0, 8, fixed=True)
    assert p.changes == {"train.recompute": "full"} and p.plan.fits(80)
    assert "recompute=full: nothing fits with none or selective" in p.why
    free = planner.propose(cfg, 128, 80.0, 8)  # free to shard instead: TP=2, no recompute
    assert (free.plan.tp, free.plan.recompute) == (2, "none")


def test_search_offers_each_layout_at_its_own_micro_batch_once(capsys):
    rc, out, err = plan_lines(capsys, STUDY_44M, 4, 80, "--search")
    assert rc == 0, err
    rows = [line.split("|")[2:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    rows = [[cell.strip() for cell in row] for row in rows]
    # engine, TP, PP, DP, recompute, micro-batch: DP=4 at 16 windows, DP=2 at 32, DP=1 at 64
    assert ["megatron", "1", "1", "4", "none", "16"] == rows[0][:6]
    assert {(r[3], r[5]) for r in rows if r[2] == "1"} <= {("4", "16"), ("2", "32"), ("1", "64")}
    # a pipeline of PP stages needs a multiple of PP micro-batches: PP=4 at DP=1 runs 4 x 16
    assert {(r[3], r[5]) for r in rows if r[2] == "4"} == {("1", "16")}
    figures = [tuple(r[1:]) for r in rows]  # all but the engine
    assert len(figures) == len(set(figures)), "two rows repeat the same figures"
    # at DP=1 the ZeRO stages shard nothing: one row for the layout, not five
    cfg = experiment.load(BASELINE_1P4B)
    plans, left_out = planner.search(cfg, 8, 80.0, 989.4, 0.4)
    tp8 = [p for p in plans if (p.tp, p.pp, p.recompute) == (8, 1, "none")]
    assert len(tp8) == 1
    same = "TP=8 PP=1 DP=1, micro-batch 1, recompute=none: the same figures as"
    assert sum(same in why for why in left_out) == 4


@pytest.mark.parametrize(
    "config, nodes, gpus_per_node, overrides",
    [
        (STUDY_44M, 1, 4, []),
        (BASELINE_1P4B, 8, 8, []),
        ("configs/experiments/fineweb/1p4b_42b_tokens.yaml", 16, 8, []),
        ("configs/experiments/fineweb/1p4b_42b_tokens.yaml", 16, 8, ["parallel.tp=1"]),
    ],
)
def test_plan_and_slurm_submit_choose_the_same(
    capsys, monkeypatch, tmp_path, config, nodes, gpus_per_node, overrides
):
    """One choice (planner.propose) for both: the layout `plan` prints for N GPUs is the one
    `slurm submit` launches on N GPUs, with the same overrides in its job script."""
    from megaloop.cli import main

    monkeypatch.chdir(tmp_path)  # the dry run writes nothing; its data check only warns
    rc, out, err = plan_lines(capsys, str(ROOT / config), nodes * gpus_per_node, 80, *overrides)
    assert rc == 0, err
    planned = re.search(r"^layout: \S+ TP=(\d+) PP=(\d+) DP=(\d+), micro-batch (\d+)", out, re.M)
    applies = re.search(r"^applies with: (.*?) \(", out, re.M)
    job = ["--nodes", str(nodes), "--gpus-per-node", str(gpus_per_node), "--dry-run"]
    assert main(["slurm", "submit", str(ROOT / config), *job, *overrides]) == 0
    script, summary = capsys.readouterr()
    tp, pp, dp, micro = planned.groups()
    assert f"layout: TP={tp} PP={pp} DP={dp} on {nodes} node(s)" in summary
    words = script.replace("'", "").split()
    assert f"parallel.tp={tp}" in words and f"parallel.pp={pp}" in words
    for override in applies.group(1).split() if applies else []:
        assert override in words
    assert any(w.startswith("train.micro_batch_size=") for w in words) == (
        applies is not None and f"train.micro_batch_size={micro}" in applies.group(1)
    )
