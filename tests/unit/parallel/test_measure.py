"""Activation recompute (train.recompute) changes memory, not arithmetic: losses and gradient
norms equal the run without it on one process (under TP2 x PP2, each option rides on one of
tests/multiprocess/test_parallel.py's layout runs); and it really drops saved activations
(measured with saved-tensor hooks)."""

import dataclasses

import pytest
import torch

from conftest import build
from megaloop.parallel.measure import saved_activation_bytes
from multiproc import metrics, train_here

OPTIONS = ["selective", "full", "loop"]
REL = 1e-6


def assert_same_run(got: dict, want: dict) -> None:
    assert len(got["steps"]) == len(want["steps"])
    for a, b in zip(got["steps"], want["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=REL), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=REL), a["step"]
        assert a["hidden_rms"] == pytest.approx(b["hidden_rms"], rel=REL), a["step"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    runs = {}
    for option in ["none", *OPTIONS]:
        run_dir = tmp_path_factory.mktemp(f"recompute-{option}")
        train_here(
            run_dir,
            [
                "objective.kind=exit_weighted",
                "model.exit_gate=true",
                f"train.recompute={option}",
                "train.save_every=0",
            ],
        )
        runs[option] = metrics(run_dir)
    return runs


@pytest.mark.parametrize("option", OPTIONS)
def test_recompute_equals_no_recompute_on_one_process(one_process, option):
    assert_same_run(one_process[option], one_process["none"])


def test_full_and_loop_recompute_keep_fewer_activations(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, num_layers=4)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    sizes = {}
    for option in ("none", "full", "loop"):
        model = build(cfg)
        model.recompute = option
        model.train()
        sizes[option] = saved_activation_bytes(model, tokens)
    assert sizes["loop"] < sizes["full"] < sizes["none"], sizes


def test_selective_turns_on_megatron_cores_core_attention_recompute(tiny_cfg):
    """Its equality test above would also pass if the option did nothing."""
    from megaloop.model.looped import build_model

    for option, expected in (("none", False), ("selective", True)):
        model = build_model(tiny_cfg, recompute=option)
        assert model.layers[0].self_attention.checkpoint_core_attention is expected
