"""The configuration of an exported megaloop model (transformers remote code).

Loop count, readout, recurrence, clamp, the early-exit rule and its KV policy are plain fields,
so they can be changed at load time:
`from_pretrained(path, trust_remote_code=True, num_loops=8, clamp=True)`.
Every field is one row of FIELDS: its name here, its default, the `ModelConfig` field an export
takes it from (megaloop/export.py reads the table, so a new model option is one row), the modes
it may take (modes.py's, copied beside this file with semantics.py, which computes them).
"""

from dataclasses import dataclass
from typing import Any, get_args

from transformers import PretrainedConfig

from .modes import (
    SHARES_LOOP_NORM,
    DampingShape,
    EarlyExit,
    GateInput,
    KVPolicy,
    LayerNorms,
    LoopNorm,
    PositionEmbedding,
    ReadoutMode,
    RecurrenceMode,
    gate_missing,
)


@dataclass(frozen=True)
class Field:
    name: str
    default: Any
    trained: str | None = None
    """The ModelConfig field an export writes here; None: a setting of inference alone."""
    modes: Any = None
    """The Literal of the values it may take."""
    shape: bool = False
    """Part of the model's shape, which Ouro's config.json shares."""


FIELDS = (
    Field("vocab_size", 20480, "vocab_size", shape=True),
    Field("hidden_size", 512, "hidden_size", shape=True),
    Field("intermediate_size", 2048, "ffn_size", shape=True),
    Field("num_hidden_layers", 8, "num_layers", shape=True),
    Field("num_attention_heads", 8, "num_heads", shape=True),
    Field("num_key_value_heads", None, "key_value_heads", shape=True),
    # K: applications of the shared stack, any K >= 1
    Field("num_loops", 4, "num_loops"),
    # K_train, the depth trained at (where `final_norm` normalises from); None: num_loops
    Field("num_loops_trained", None, "num_loops"),
    Field("max_position_embeddings", 1024, "max_seq_len", shape=True),
    # rope: rotary, in attention; learned: a table of max_position_embeddings rows added to H_0
    Field("position_embedding", "rope", "position_embedding", PositionEmbedding),
    Field("rope_theta", 10000.0, "rope_base", shape=True),
    Field("rms_norm_eps", 1e-5, "norm_eps", shape=True),
    # what exit k reads (semantics.READOUTS): norm, W_out·RMSNorm(H_k); raw, W_out·H_k;
    # final_norm, raw for k < num_loops_trained, normalised from there on; last_norm, raw but
    # at the last loop of the K run (the study's released code)
    Field("readout", "norm", "readout", ReadoutMode),
    # what H_k becomes before re-entering the stack: as is, RMSNorm (Ouro), or damped
    Field("recurrence", "none", "recurrence", RecurrenceMode),
    # damping: one learned factor per channel, or one scalar
    Field("damping_shape", "channel", "damping_shape", DampingShape),
    Field("exit_gate", False, "exit_gate"),
    # normed: the gate reads H_k/‖H_k‖_rms; raw: H_k (shared loop norm: its output)
    Field("exit_gate_input", "normed", "exit_gate_input", GateInput),
    # pre: x + f(N(x)) per sublayer; sandwich: x + N₂(f(N₁(x))) (Ouro's layer)
    Field("layer_norms", "pre", "layer_norms", LayerNorms),
    # separate: recurrence and readout norms of their own; shared: Ouro's one norm after every
    # loop, read by the next loop, the gate and a normalising readout
    Field("loop_norm", "separate", "loop_norm", LoopNorm),
    Field("tie_word_embeddings", True, "tie_embeddings", shape=True),
    # the inference-time recurrent-scale clamp: each token's H_k held at its loop-1 RMS
    Field("clamp", False),
    # each token's exit loop: none, all at K; an exit rule (modes.EXIT_RULES), the first loop
    # whose score reaches exit_threshold. Its logits are that loop's; with a cache, it runs no
    # loop after it (docs/generation.md)
    Field("early_exit", "none", modes=EarlyExit),
    Field("exit_threshold", 0.5),
    # what early exit's cache holds at the loops a token skipped (modes.KV_POLICIES). A
    # forward's `kv_policy` overrides it for a new cache
    Field("kv_policy", "copy", modes=KVPolicy),
    Field("use_cache", True),
)


def exported(model) -> dict[str, Any]:
    """The fields of an export of `model` (a ModelConfig), by FIELDS; the rest their defaults."""
    return {f.name: getattr(model, f.trained) if f.trained else f.default for f in FIELDS}


def check(values: dict[str, Any]) -> None:
    for f in FIELDS:
        if f.modes is not None and values[f.name] not in get_args(f.modes):
            modes = ", ".join(get_args(f.modes))
            raise ValueError(f"{f.name}={values[f.name]!r}: use one of {modes}")
    if SHARES_LOOP_NORM[values["loop_norm"]] and values["recurrence"] != "none":
        raise ValueError("loop_norm='shared' is the inter-loop norm; recurrence must be none")
    why = gate_missing(values["early_exit"], values["exit_gate"], "the model", "early_exit")
    if why:
        raise ValueError(why)
    if values["num_loops"] < 1:
        raise ValueError(f"num_loops={values['num_loops']}: must be >= 1")


class MegaloopConfig(PretrainedConfig):
    model_type = "megaloop"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, **kwargs):
        values = {f.name: kwargs.pop(f.name, f.default) for f in FIELDS}
        check(values)
        values["num_key_value_heads"] = (
            values["num_key_value_heads"] or values["num_attention_heads"]
        )
        values["num_loops_trained"] = values["num_loops_trained"] or values["num_loops"]
        tie = values.pop("tie_word_embeddings")
        for name, value in values.items():
            setattr(self, name, value)
        super().__init__(tie_word_embeddings=tie, **kwargs)
