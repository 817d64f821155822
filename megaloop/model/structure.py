"""The looped model's parameters from its config alone: the name, shape and part of every tensor
LoopedLM holds, on any pipeline stage and tensor-parallel rank.

Torch-free, so that `megaloop params` and `plan` count parameters and state bytes without
building anything; tests/unit/model/test_structure.py holds it to the real model's
named_parameters() in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megaloop.model import modes
from megaloop.model.config import ModelConfig

Part = Literal["embedding", "layer", "recurrence", "loop_norm", "exit_gate", "readout"]


def readout_normalizes(cfg: ModelConfig, loop: int) -> bool:
    """Whether exit `loop` (1-based) reads a normalised H_k."""
    return modes.READOUT_NORMALIZES[cfg.readout](loop, cfg.num_loops, cfg.num_loops)


@dataclass(frozen=True)
class Param:
    name: str
    """As LoopedLM.named_parameters() names it on the stage that holds it."""
    shape: tuple[int, ...]
    """On one tensor-parallel rank."""
    part: Part

    @property
    def numel(self) -> int:
        out = 1
        for n in self.shape:
            out *= n
        return out


def layer_params(cfg: ModelConfig, index: int, tp: int = 1) -> list[Param]:
    """One transformer layer of the shared stack (megatron-core's, model/specs.py)."""
    d, ffn = cfg.hidden_size, cfg.ffn_size
    kv = (cfg.num_query_groups or cfg.num_heads) * (d // cfg.num_heads)
    shapes = {
        "input_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (d, d // tp),
        "self_attention.linear_qkv.weight": ((d + 2 * kv) // tp, d),
        "pre_mlp_layernorm.weight": (d,),
        "mlp.linear_fc1.weight": (2 * ffn // tp, d),
        "mlp.linear_fc2.weight": (d, ffn // tp),
    }
    if cfg.layer_norms == "sandwich":
        shapes["self_attention.linear_proj.post_norm.weight"] = (d,)
        shapes["mlp.linear_fc2.post_norm.weight"] = (d,)
    return [Param(f"layers.{index}.{name}", shape, "layer") for name, shape in shapes.items()]


def parameters(
    cfg: ModelConfig,
    tp: int = 1,
    first: bool = True,
    last: bool = True,
    layers: int | None = None,
) -> list[Param]:
    """The parameters of one rank of a stage holding `layers` layers (all by default), the
    embedding and recurrence if `first`, the loop norm, exit gate and readout if `last`. W_out
    tied to the embedding is the embedding's tensor on a stage holding both, a copy on the last
    stage otherwise."""
    d, vocab = cfg.hidden_size, cfg.vocab_size
    out = []
    if first:
        out.append(Param("embedding.word_embeddings.weight", (vocab // tp, d), "embedding"))
        if cfg.position_embedding == "learned":
            out.append(
                Param("embedding.position_embeddings.weight", (cfg.max_seq_len, d), "embedding")
            )
    for i in range(cfg.num_layers if layers is None else layers):
        out += layer_params(cfg, i, tp)
    if first:
        params = modes.RECURRENCE_PARAMS[cfg.recurrence](cfg.hidden_size, cfg.damping_shape)
        for name, size in params.items():
            out.append(Param(f"recurrence.{name}", (size,), "recurrence"))
    if not last:
        return out
    if modes.SHARES_LOOP_NORM[cfg.loop_norm]:
        out.append(Param("loop_norm.weight", (d,), "loop_norm"))
    if cfg.exit_gate:
        out.append(Param("exit_gate.proj.weight", (1, d), "exit_gate"))
        out.append(Param("exit_gate.proj.bias", (1,), "exit_gate"))
    if modes.readout_owns_norm(cfg.readout, cfg.num_loops, cfg.loop_norm):
        out.append(Param("readout.norm.weight", (d,), "readout"))
    if not (cfg.tie_embeddings and first):
        out.append(Param("readout.output_layer.weight", (vocab // tp, d), "embedding"))
    return out


def count(params: list[Param]) -> int:
    return sum(p.numel for p in params)
