"""Initialisation that does not depend on the parallel layout.

A parameter's initial value is a function of (seed, its name in the whole one-device model),
drawn at its full shape; a tensor-parallel rank keeps its shard and a pipeline stage only builds
its own layers. So one process, TP2, PP2 or DP2 start from the same weights, and a shard's
fan-in is the full matrix's.

                                model.init=megatron          model.init=pytorch
    norms                       ones                         ones
    embeddings (token, position) N(0, std²)                  N(0, 1)
    linear_proj, linear_fc2     N(0, (std / sqrt(2L))²)      U(±1/√fan_in)
    other linears, untied W_out N(0, std²)                   U(±1/√fan_in)
    exit gate                   zeros (λ = 0.5 at the start)  U(±1/√d), bias too
    damping                     logit(damping_init)          logit(damping_init)

`pytorch` is what nn.Embedding and nn.Linear give by themselves, the study's released code;
model.embedding_init_std overrides the token embedding's std under either.
"""

from __future__ import annotations

import hashlib
import math

import torch
from megatron.core import parallel_state


def initial_value(name: str, shape: tuple, cfg, seed: int) -> torch.Tensor:
    """The full (unsharded) initial tensor of parameter `name`."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name == "recurrence.damping_logit":
        return torch.full(shape, math.log(cfg.damping_init / (1 - cfg.damping_init)))
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    if name == "embedding.word_embeddings.weight" and cfg.embedding_init_std is not None:
        return torch.randn(shape, generator=generator) * cfg.embedding_init_std
    if cfg.init == "pytorch":
        if name.startswith("embedding."):
            return torch.randn(shape, generator=generator)
        fan_in = cfg.hidden_size if name.startswith("exit_gate.") else shape[-1]
        bound = 1.0 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=generator) * 2 - 1) * bound
    if name.startswith("exit_gate."):
        return torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std /= math.sqrt(2.0 * cfg.num_layers)
    return torch.randn(shape, generator=generator) * std


def local_shard(
    full: torch.Tensor, param: torch.nn.Parameter, name: str, gated: bool
) -> torch.Tensor:
    """This tensor-parallel rank's part of `full`, laid out as megatron-core's layer holds it."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    rank = parallel_state.get_tensor_model_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    dim = param.partition_dim
    if gated and name.endswith("mlp.linear_fc1.weight"):
        # SwiGLU's fc1 is [gate; up]; each rank holds [its gate rows; its up rows]
        return torch.cat([half.chunk(size, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


@torch.no_grad()
def init_weights(model, seed: int) -> None:
    """Overwrite megatron-core's initialisation (which also marks the tensor-parallel
    attributes this reads, so the model must be built with perform_initialization=True)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= tp
        full_name = model.global_name(name)
        with torch.device("cpu"):  # CPU generators: the same draws whatever the model's device
            full = initial_value(full_name, tuple(shape), model.cfg, seed)
        param.copy_(local_shard(full, param, full_name, model.config.gated_linear_unit))
