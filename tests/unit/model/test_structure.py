"""megaloop/model/structure.py is the real model's definition: the same parameter names and
shapes as LoopedLM.named_parameters() in every combination of the config's modes (taken from
their Literal types, so a new mode is covered here without an edit), on the whole model and on
a first and a last pipeline stage."""

import itertools
from typing import get_args

import pytest
import torch

from megaloop.config import ConfigError
from megaloop.model import config as model_config
from megaloop.model import structure
from megaloop.model.looped import build_model

SHAPE = dict(vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, max_seq_len=16)
MODES = {
    "readout": get_args(model_config.ReadoutMode),
    "recurrence": get_args(model_config.RecurrenceMode),
    "damping_shape": get_args(model_config.DampingShape),
    "exit_gate": (False, True),
    "exit_gate_input": get_args(model_config.GateInput),
    "loop_norm": get_args(model_config.LoopNorm),
    "layer_norms": get_args(model_config.LayerNorms),
    "tie_embeddings": (True, False),
    "position_embedding": get_args(model_config.PositionEmbedding),
}


def valid_configs():
    for values in itertools.product(*MODES.values()):
        modes = dict(zip(MODES, values))
        try:
            yield model_config.ModelConfig.from_dict({**SHAPE, **modes})
        except ConfigError:  # a contradiction the config refuses (e.g. shared loop norm + rmsnorm)
            continue


CONFIGS = list(valid_configs())


def build_meta(cfg, **stage):
    with torch.device("meta"):
        return build_model(cfg, seed=None, use_cpu_initialization=True, **stage)


def real(cfg, **stage) -> dict:
    return {name: tuple(p.shape) for name, p in build_meta(cfg, **stage).named_parameters()}


def name(cfg) -> str:
    return "-".join(str(getattr(cfg, key)) for key in MODES)


def described(params) -> dict:
    return {p.name: p.shape for p in params}


def test_every_mode_is_covered():
    assert len(CONFIGS) > 100
    for key, values in MODES.items():
        assert {getattr(cfg, key) for cfg in CONFIGS} == set(values), key


@pytest.mark.parametrize("cfg", CONFIGS, ids=name)
def test_the_structure_is_the_real_models(cfg):
    model = build_meta(cfg)
    assert described(structure.parameters(cfg)) == {
        n: tuple(p.shape) for n, p in model.named_parameters()
    }
    assert structure.count(structure.parameters(cfg)) == model.num_parameters()["total"]


@pytest.mark.parametrize("cfg", CONFIGS[::7], ids=name)
def test_first_and_last_stages_are_the_real_ones(cfg):
    first = dict(pre_process=True, post_process=False, layer_ids=range(0, 1))
    last = dict(pre_process=False, post_process=True, layer_ids=range(1, 2))
    assert described(structure.parameters(cfg, first=True, last=False, layers=1)) == real(
        cfg, **first
    )
    assert described(structure.parameters(cfg, first=False, last=True, layers=1)) == real(
        cfg, **last
    )
