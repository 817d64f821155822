"""What a looped model is, as config: its shape, readout, recurrence, exit gate and norms.

Torch-free, so that commands which only read configs (`megaloop params`, `plan`, `slurm submit`)
start without importing torch or megatron-core. The mode types come from modes.py, the
torch-free half of the model's semantics that exports ship too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megaloop.config import Config, check
from megaloop.model.modes import (
    DampingShape,
    GateInput,
    LayerNorms,
    LoopNorm,
    PositionEmbedding,
    ReadoutMode,
    RecurrenceMode,
)

Recompute = Literal["none", "selective", "full", "loop"]
Init = Literal["megatron", "pytorch"]


TRAINING_ONLY = (
    "init",
    "init_std",
    "embedding_init_std",
    "dropout",
    "damping_init",
    "attention",
    "fp32_residual",
)
"""ModelConfig's fields that say how the model is trained, not what it computes: an export does
not carry them. Every other field reaches the exported config's table (configuration_megaloop
.FIELDS; tests/unit/test_export.py changes each one and looks for it there)."""


@dataclass
class ModelConfig(Config):
    vocab_size: int = 20480
    """Rows of the token embedding (and of W_out); at least the tokenizer's vocabulary."""
    hidden_size: int = 512
    """d, the width of the hidden state H_k."""
    num_heads: int = 8
    """Attention (query) heads; hidden_size must divide by it."""
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); None = one per query head."""
    num_layers: int = 8
    """L: layers in the shared stack (applied num_loops times)."""
    ffn_hidden_size: int | None = None
    """SwiGLU hidden size; None = 4 * hidden_size."""
    num_loops: int = 4
    """K_train, the depth trained at; any K >= 1 can be asked for at inference (checkpoints and
    exports record it as `num_loops_trained`)."""
    max_seq_len: int = 1024
    """The longest sequence; with `learned` positions, the rows of the position table."""
    position_embedding: PositionEmbedding = "rope"
    """`rope` (rotary, in attention) or `learned`: an absolute position table added to the token
    embedding (the study's released 44M/129M code)."""
    rope_base: float = 10000.0
    """The rotary base θ (`rope` positions)."""
    norm_eps: float = 1e-5
    """ε of every RMSNorm."""
    init: Init = "megatron"
    """`megatron`: N(0, init_std²), the sublayer output projections scaled by 1/√(2L), the exit
    gate at zero; `pytorch`: PyTorch's module defaults, as the study's released code leaves them:
    embeddings N(0, 1) (a tied W_out too), Linear and the exit gate U(±1/√fan_in)."""
    init_std: float = 0.02
    """`init=megatron`'s standard deviation."""
    embedding_init_std: float | None = None
    """The token embedding's (and a tied W_out's) std, whatever `init` says of the rest; None:
    `init`'s. (N(0, 1) here under `megatron` tells the embedding's scale from the rest's.)"""
    dropout: float = 0.0
    """Dropout on the embedding output H_0, the attention probabilities and the FFN output, where
    the study's code applies it (not on the attention output projection)."""
    tie_embeddings: bool = True
    """Tie W_out to the token embedding."""
    readout: ReadoutMode = "norm"
    """How each exit reads H_k: `norm` (RMSNorm then W_out, scale-blind), `raw` (W_out on H_k),
    `final_norm` (raw exits, RMSNorm from the trained depth on, at any K run) or `last_norm` (raw
    exits, RMSNorm at the last loop of whatever K is run: the study's released code). The last
    two train alike at K = K_train and read other depths differently."""
    recurrence: RecurrenceMode = "none"
    """What loop k > 1 receives of H_{k-1}: `none` (H_{k-1} itself), `rmsnorm` (RMSNorm(H_{k-1}),
    the scale removed) or `damping` (a learned factor in (0, 1), spectral damping)."""
    damping_init: float = 0.9
    """Initial factor of the `damping` recurrence, in (0, 1)."""
    damping_shape: DampingShape = "channel"
    """`damping`: one learned factor per channel, or one `scalar` for the whole state."""
    exit_gate: bool = False
    """Ouro's per-token exit gate λ_k (needed by the exit-weighted objective)."""
    exit_gate_input: GateInput = "normed"
    """What the gate reads: H_k/‖H_k‖_rms (`normed`, no weights: CE stays blind to scale through
    the gate) or H_k (`raw`, the study's released gate: the exit-weighted CE sees scale
    through λ_k)."""
    fp32_residual: bool = False
    """Under bf16 autocast (train.bf16), keep the residual stream in fp32: each sublayer's bf16
    output is added to the fp32 H, as the study's released code does under autocast. Off:
    megatron-core's bias-dropout-add casts the sum to bf16, so H is bf16 between sublayers and
    loops, and an update below H's bf16 spacing (|H|/256) is lost. Nothing changes in fp32. On:
    about two H-sized tensors a layer application kept for backward at 4 bytes, not 2 (+4% of
    the study's 44M activations, bench/residual_memory.py)."""
    layer_norms: LayerNorms = "pre"
    """`pre`: x + f(N(x)) per sublayer; `sandwich`: x + N₂(f(N₁(x))), Ouro's four norms a layer."""
    loop_norm: LoopNorm = "separate"
    """`separate`: the recurrence and the readout have their own norms (if any); `shared`: Ouro's
    one norm after every loop, feeding the next loop, the exit gate and a normalising readout
    (readout=raw then reads H_k before it: the study's no-readout-norm 1.4B model)."""
    attention: Literal["sdpa", "megatron"] = "sdpa"
    """Core attention: torch SDPA, or megatron-core's local DotProductAttention."""

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def key_value_heads(self) -> int:
        return self.num_query_groups or self.num_heads

    def validate(self, prefix: str = "") -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_heads",
            "num_layers",
            "num_loops",
            "max_seq_len",
        ):
            check(getattr(self, name) >= 1, prefix + name, getattr(self, name), "must be >= 1")
        check(
            self.hidden_size % self.num_heads == 0,
            prefix + "num_heads",
            self.num_heads,
            f"must divide hidden_size={self.hidden_size}",
        )
        check(
            self.num_query_groups is None or self.num_query_groups >= 1,
            prefix + "num_query_groups",
            self.num_query_groups,
            "must be >= 1 (or null: one per query head)",
        )
        groups = self.num_query_groups or self.num_heads
        check(
            self.num_heads % groups == 0,
            prefix + "num_query_groups",
            self.num_query_groups,
            f"must divide num_heads={self.num_heads}",
        )
        check(self.rope_base > 0, prefix + "rope_base", self.rope_base, "must be > 0")
        check(
            self.position_embedding != "rope" or (self.hidden_size // self.num_heads) % 2 == 0,
            prefix + "num_heads",
            self.num_heads,
            "head dimension hidden_size/num_heads must be even for RoPE",
        )
        check(
            self.ffn_hidden_size is None or self.ffn_hidden_size >= 1,
            prefix + "ffn_hidden_size",
            self.ffn_hidden_size,
            "must be >= 1 or null",
        )
        check(
            0.0 < self.damping_init < 1.0,
            prefix + "damping_init",
            self.damping_init,
            "must lie in (0, 1)",
        )
        check(self.norm_eps > 0, prefix + "norm_eps", self.norm_eps, "must be > 0")
        shared = self.loop_norm == "shared"
        check(
            not shared or self.recurrence == "none",
            prefix + "recurrence",
            self.recurrence,
            "model.loop_norm=shared is itself the inter-loop norm: set model.recurrence=none",
        )
        check(
            not shared or self.exit_gate_input == "normed",
            prefix + "exit_gate_input",
            self.exit_gate_input,
            "with model.loop_norm=shared the gate reads the shared loop "
            "norm's output; leave exit_gate_input at normed",
        )
        check(self.init_std > 0, prefix + "init_std", self.init_std, "must be > 0")
        check(
            self.embedding_init_std is None or self.embedding_init_std > 0,
            prefix + "embedding_init_std",
            self.embedding_init_std,
            "must be > 0 (or null: the std `model.init` gives it)",
        )
        check(0 <= self.dropout < 1, prefix + "dropout", self.dropout, "must lie in [0, 1)")
