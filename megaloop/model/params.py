"""Parameter counts of a model config, from the real model built on the meta device (no memory)."""

from __future__ import annotations

import torch

from megaloop.model.looped import LoopedLM, ModelConfig
from megaloop.model.specs import transformer_config


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    with torch.device("meta"):
        model = LoopedLM(cfg, transformer_config(cfg, use_cpu_initialization=True))
    return model.num_parameters()
