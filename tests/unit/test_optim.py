"""Which parameters weight decay reaches: never 1-D ones; the token embedding and W_out only
with optim.decay_embeddings (both engines group parameters by OptimConfig.decays)."""

import pytest
import torch
from safetensors.torch import load_file

from megaloop import experiment
from megaloop.model import ModelConfig, build_model
from megaloop.train.optim import OptimConfig

LR, WD, STEPS = 1e-2, 0.5, 3


@pytest.mark.parametrize("tie", [True, False])
def test_decays_names_the_embedding_and_w_out(tie):
    model = build_model(
        ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=1, tie_embeddings=tie)
    )
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
