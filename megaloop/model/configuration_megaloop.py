"""The configuration of an exported megaloop model (transformers remote code).

Loop count, readout, recurrence, clamp, the early-exit rule and its KV policy are plain fields,
so they can be changed at load time:
`from_pretrained(path, trust_remote_code=True, num_loops=8, clamp=True)`.
The modes are modes.py's (copied beside this file, with semantics.py, which computes them).
"""

from typing import get_args

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
)


class MegaloopConfig(PretrainedConfig):
    model_type = "megaloop"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 20480,
        hidden_size: int = 512,
        intermediate_size: int = 2048,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        num_key_value_heads: int | None = None,
        num_loops: int = 4,
        num_loops_trained: int | None = None,
        max_position_embeddings: int = 1024,
        position_embedding: str = "rope",
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        readout: str = "norm",
        recurrence: str = "none",
        damping_shape: str = "channel",
        exit_gate: bool = False,
        exit_gate_input: str = "normed",
        layer_norms: str = "pre",
        loop_norm: str = "separate",
        clamp: bool = False,
        early_exit: str = "none",
        exit_threshold: float = 0.5,
        kv_policy: str = "copy",
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        **kwargs,
    ):
        for name, value, modes in (
            ("readout", readout, ReadoutMode),
            ("recurrence", recurrence, RecurrenceMode),
            ("damping_shape", damping_shape, DampingShape),
            ("exit_gate_input", exit_gate_input, GateInput),
            ("position_embedding", position_embedding, PositionEmbedding),
            ("layer_norms", layer_norms, LayerNorms),
            ("loop_norm", loop_norm, LoopNorm),
            ("early_exit", early_exit, EarlyExit),
            ("kv_policy", kv_policy, KVPolicy),
        ):
            if value not in get_args(modes):
                raise ValueError(f"{name}={value!r}: use one of {', '.join(get_args(modes))}")
        if SHARES_LOOP_NORM[loop_norm] and recurrence != "none":
            raise ValueError("loop_norm='shared' is the inter-loop norm; recurrence must be none")
        if early_exit == "gate" and not exit_gate:
            raise ValueError("early_exit='gate' needs a model trained with the exit gate")
        if num_loops < 1:
            raise ValueError(f"num_loops={num_loops}: must be >= 1")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.num_loops = num_loops
        """K: applications of the shared stack; any K >= 1."""
        self.num_loops_trained = num_loops_trained or num_loops
        """K_train, the depth the model was trained at (where `final_norm` normalises from)."""
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding = position_embedding
        """rope: rotary, in attention; learned: a table of max_position_embeddings rows added to
        the token embedding."""
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.readout = readout
        """What exit k reads (semantics.READOUTS): norm, W_out·RMSNorm(H_k); raw, W_out·H_k;
        final_norm, raw for k < num_loops_trained, normalised from there on."""
        self.recurrence = recurrence
        """What H_k becomes before re-entering the stack: as is, RMSNorm (Ouro), or damped."""
        self.damping_shape = damping_shape
        """damping: one learned factor per channel, or one scalar."""
        self.exit_gate = exit_gate
        self.exit_gate_input = exit_gate_input
        """normed: the gate reads H_k/‖H_k‖_rms; raw: H_k (shared loop norm: its output)."""
        self.layer_norms = layer_norms
        """pre: x + f(N(x)) per sublayer; sandwich: x + N₂(f(N₁(x))) (Ouro's layer)."""
        self.loop_norm = loop_norm
        """separate: recurrence and readout norms of their own; shared: Ouro's one norm after
        every loop, read by the next loop, the gate and a normalising readout."""
        self.clamp = clamp
        """The inference-time recurrent-scale clamp: each token's H_k held at its loop-1 RMS."""
        self.early_exit = early_exit
        """Each token's exit loop (semantics.EXIT_SCORES): none, all at K; gate, the first loop
        whose cumulative exit probability reaches exit_threshold; margin, the first whose top-1
        minus top-2 logit does (`megaloop halt`'s threshold as it is). Its logits are that
        loop's; with a cache, it runs no loop after it (docs/generation.md)."""
        self.exit_threshold = exit_threshold
        self.kv_policy = kv_policy
        """What early exit's cache holds at the loops a token skipped: copy, the exit loop's keys
        and values; share, one slot per layer (the last computed); recompute, computed when a
        later token needs them (exact). A forward's `kv_policy` overrides it for a new cache."""
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
