"""Which parameters weight decay reaches: never 1-D ones; the token embedding and W_out only
with optim.decay_embeddings (both engines group parameters by OptimConfig.decays)."""

import pytest
import torch
from safetensors.torch import load_file

from megaloop import experiment
from megaloop.model import build_model
from megaloop.train.metrics import read as read_metrics
from megaloop.train.optim import OptimConfig
from support import tiny_config

LR, WD, STEPS = 1e-2, 0.5, 3


@pytest.mark.parametrize("tie", [True, False])
def test_decays_names_the_embedding_and_w_out(tie):
    model = build_model(tiny_config(num_layers=1, max_seq_len=1024, tie_embeddings=tie))
    named = dict(model.named_parameters())
    embeddings = {"embedding.word_embeddings.weight"} | (
        set() if tie else {"readout.output_layer.weight"}
    )
    assert embeddings <= set(named)
    for decay_embeddings in (True, False):
        cfg = OptimConfig(decay_embeddings=decay_embeddings)
        decayed = {n for n, p in named.items() if cfg.decays(n, p)}
        matrices = {n for n, p in named.items() if p.ndim > 1}
        assert decayed == (matrices if decay_embeddings else matrices - embeddings)
        assert (
            cfg.decays(
                "module.module." + "embedding.word_embeddings.weight",
                named["embedding.word_embeddings.weight"],
            )
            == decay_embeddings
        )  # under DDP / DeepSpeed wrappers too


def train_untied(tmp_path, decay_embeddings: bool):
    run = tmp_path / f"decay_embeddings={decay_embeddings}"
    cfg = experiment.load(
        "experiments/tiny",
        [
            f"train.dir={run}",
            f"train.steps={STEPS}",
            "train.log_every=1",
            "train.eval_batches=1",
            "model.tie_embeddings=false",
            f"optim.lr={LR}",
            f"optim.min_lr={LR}",
            "optim.warmup_steps=0",
            f"optim.weight_decay={WD}",
            f"optim.decay_embeddings={str(decay_embeddings).lower()}",
        ],
    )
    experiment.build_trainer(cfg, log=False).fit()
    experiment.consolidate(run, run / "consolidated")
    return cfg, load_file(run / "consolidated" / "model.safetensors")


def test_undecayed_embedding_moves_only_by_its_gradient(tmp_path):
    """Rows of byte tokens the addition corpus never uses get no gradient: without decay they
    keep their initial values bit for bit; with it they shrink by (1 − lr·wd) a step, no more."""
    cfg, kept = train_untied(tmp_path, decay_embeddings=False)
    _, decayed = train_untied(tmp_path, decay_embeddings=True)
    init = build_model(cfg.model, cfg.train.seed).state_dict()
    name = "embedding.word_embeddings.weight"
    unseen = (kept[name] == init[name]).all(dim=1)
    assert 100 < int(unseen.sum()) < cfg.model.vocab_size  # the corpus uses a few dozen bytes
    shrink = (1 - LR * WD) ** STEPS  # a constant learning rate: no warmup, min_lr = lr
    torch.testing.assert_close(
        decayed[name][unseen], init[name][unseen] * shrink, rtol=1e-5, atol=0
    )
    # W_out (untied) is decayed in one run only: its values differ
    w_out = "readout.output_layer.weight"
    assert not torch.equal(kept[w_out], decayed[w_out])


def test_decay_all_reaches_every_parameter_and_refuses_an_embedding_exemption():
    from megaloop.config import ConfigError

    model = build_model(tiny_config(num_layers=1, max_seq_len=1024, exit_gate=True))
    cfg = OptimConfig(decay="all")
    assert all(cfg.decays(n, p) for n, p in model.named_parameters())
    with pytest.raises(ConfigError, match="'optim.decay_embeddings'.*optim.decay=all"):
        experiment.load("experiments/tiny", ["optim.decay=all", "optim.decay_embeddings=false"])


def one_step(tmp_path, *overrides) -> dict:
    run = tmp_path / "-".join(overrides)
    cfg = experiment.load(
        "experiments/tiny",
        [
            f"train.dir={run}",
            "train.steps=1",
            "train.log_every=1",
            "train.eval_batches=1",
            "model.exit_gate=true",
            f"optim.lr={LR}",
            "optim.warmup_steps=0",
            "optim.schedule=constant",
            f"optim.weight_decay={WD}",
            *overrides,
        ],
    )
    experiment.build_trainer(cfg, log=False).fit()
    experiment.consolidate(run, run / "consolidated")
    return load_file(run / "consolidated" / "model.safetensors")


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_decay_all_shrinks_norms_and_biases_too(tmp_path, engine):
    """One AdamW step from the same weights and gradients: decay=all moves a 1-D parameter by
    −lr·wd·p more than decay=matrices does, and leaves the matrices' step as it was."""
    matrices = one_step(tmp_path, f"engine={engine}", "optim.decay=matrices")
    every = one_step(tmp_path, f"engine={engine}", "optim.decay=all")
    init = build_model(experiment.load("experiments/tiny", ["model.exit_gate=true"]).model, 0)
    init = init.state_dict()
    for name in ("layers.0.input_layernorm.weight", "exit_gate.proj.bias"):
        torch.testing.assert_close(
            every[name] - matrices[name], -LR * WD * init[name], rtol=1e-4, atol=1e-7
        )
    # (DeepSpeed's flat buffers round differently with one group than with two: ~1e-8; a decay
    # the matrices did not get would be lr·wd·|w| ~ 1e-4)
    name = "layers.0.mlp.linear_fc1.weight"
    torch.testing.assert_close(every[name], matrices[name], rtol=0, atol=1e-7)


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_both_engines_follow_megatron_cores_schedule(schedule, warmup):
    """The DeepSpeed engine's LambdaLR factor is megatron-core's OptimizerParamScheduler, step
    for step; `constant` holds lr after the warmup."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megaloop.parallel.deepspeed import megatron_lr

    o = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=warmup, schedule=schedule)
    steps = 12
    group = {"params": [torch.zeros(1)], "max_lr": o.lr, "min_lr": o.min_lr}
    optimizer = torch.optim.SGD([group], lr=0.0)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=max(steps, o.warmup_steps + 1),
        lr_decay_style=o.schedule,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )
    factor = megatron_lr(o, steps)
    lrs = []
    for n in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        assert lrs[-1] == pytest.approx(o.lr * factor(n), rel=1e-12, abs=1e-15), n
        scheduler.step(1)
    if schedule == "constant":
        assert lrs[warmup:] == [o.lr] * (steps - warmup)
    else:
        assert lrs[-1] < lrs[warmup] == o.lr


def test_a_constant_schedule_does_not_depend_on_the_runs_length(tmp_path):
    """bench/drift_drivers reads bench/study_mini's runs at an earlier step as runs of that
    length: under a constant learning rate (and dropout drawn from the seed) they are the same
    run, record for record; a cosine schedule is not."""

    def run(steps: int, schedule: str) -> list:
        cfg = experiment.load(
            "experiments/tiny",
            [
                f"train.dir={tmp_path / f'{schedule}{steps}'}",
                f"train.steps={steps}",
                "train.log_every=1",
                "train.eval_every=3",
                "train.eval_batches=1",
                f"train.save_every={steps}",
                "model.dropout=0.1",
                "optim.warmup_steps=0",
                f"optim.schedule={schedule}",
            ],
        )
        experiment.build_trainer(cfg).fit()
        m = read_metrics(tmp_path / f"{schedule}{steps}")
        return [r["loss"] for r in m["steps"][:3]] + [m["evals"][0]["ce"]]

    assert run(3, "constant") == run(6, "constant")
    assert run(3, "cosine") != run(6, "cosine")
