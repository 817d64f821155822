"""A looped language model in plain PyTorch, for transformers (remote code of an export).

    H_0 = Embed(x) (+ a learned position table, where RoPE is not used)
    H_k = Stack(R(H_{k-1}))          k = 1..K, R = recurrence (identity for k = 1)
    logits = Readout(H_K)            (or, with early exit, each token's exit loop)

What R, the readout, the clamp, the exit gate and early exit do is semantics.py, the training
model's own definition, copied beside this file; it also holds every iteration over loops, each
driving `step`, the one place this model applies its stack. The KV cache of early exit and the
decoders that run rows at their own loops are decoding.py, copied beside it too. With a shared
loop norm (Ouro's wiring) one RMSNorm `norm` is R, the gate's input and the normalising
readout's norm.

`embed`, `loops`, `readout` and `exit_probability` are the pieces `forward` is made of; the
measurement commands (megaloop depth/halt/diagnose) read them one loop at a time.

The stack is L pre-norm layers (RMSNorm, causal attention with RoPE unless positions are
learned, SwiGLU; with sandwich norms a second RMSNorm on each sublayer's output), the same
layers megatron-core runs in training; `megaloop export` converts their weights. The KV cache
holds one entry per (loop, layer), as Ouro's code does: loop k's layer l attends to the keys
loop k's layer l computed for earlier tokens. With early exit the cache is a LoopCache, and a
token that exits at loop k runs no loop after it; its KV policy says what the loops it skipped
hold (docs/generation.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import decoding
from .configuration_megaloop import MegaloopConfig
from .decoding import AsyncDecoding, LoopCache, allowed_keys
from .semantics import (
    Loop,
    Loops,
    Recurrence,
    exit_lambda,
    first_exits,
    gate_input,
    loop_norm,
    readout_input,
    readout_norm,
    trajectory,
)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE as megatron-core computes it (halves rotated, not interleaved). The frequencies are
    made per call, not kept in a buffer: from_pretrained builds modules on the meta device and
    does not recompute non-persistent buffers."""

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        self.head_dim, self.base = head_dim, base

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, s] → cos, sin [b, 1, s, head_dim] (broadcast over heads)."""
        exponents = (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device)
            / self.head_dim
        )
        freqs = positions.float()[..., None] / (self.base**exponents)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos(), emb.sin()


class NoRotary(nn.Module):
    """Learned positions: attention rotates nothing. Tables of the identity rotation (cos 1,
    sin 0, exact), so every path that carries rotary tables carries these unchanged."""

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ones = torch.ones(*positions.shape, 1, device=positions.device)[:, None]
        return ones, torch.zeros_like(ones)


class Attention(nn.Module):
    def __init__(self, config: MegaloopConfig):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)

    def forward(
        self, x, cos, sin, cache: Cache | None, cache_index: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, cache_index)
        if mask is None and k.shape[2] != s and s > 1:  # new tokens after cached ones
            mask = allowed_keys(None, s, k.shape[2], x.device)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and s > 1,  # one new token sees every cached key
            scale=self.head_dim**-0.5,
            enable_gqa=self.kv_heads != self.heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: MegaloopConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: MegaloopConfig):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        sandwich = config.layer_norms == "sandwich"
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.self_attn = Attention(config)
        self.input_layernorm_2 = nn.RMSNorm(d, eps=eps) if sandwich else nn.Identity()
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.mlp = MLP(config)
        self.post_attention_layernorm_2 = nn.RMSNorm(d, eps=eps) if sandwich else nn.Identity()

    def forward(self, x, cos, sin, cache, cache_index, mask):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, cache_index, mask)
        x = x + self.input_layernorm_2(attn)
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


@dataclass
class LoopedOutput(CausalLMOutputWithPast):
    """The causal LM output, and each new token's exit loop [b, s] when a rule chose one."""

    exit_loops: torch.LongTensor | None = None


class MegaloopForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegaloopConfig
    base_model_prefix = "megaloop"
    _no_split_modules = ["Layer"]
    _supports_sdpa = True
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    def __init__(self, config: MegaloopConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        learned = config.position_embedding == "learned"
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size) if learned else None
        )
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        d, eps = config.hidden_size, config.rms_norm_eps
        self.recurrence = Recurrence(config.recurrence, d, eps, damping_shape=config.damping_shape)
        self.rotary = (
            NoRotary() if learned else Rotary(d // config.num_attention_heads, config.rope_theta)
        )
        self.norm = loop_norm(config.loop_norm, d, eps)
        self.readout_norm = readout_norm(
            config.readout, d, eps, config.loop_norm, config.num_loops_trained
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.exit_gate = nn.Linear(config.hidden_size, 1) if config.exit_gate else None
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def embed(
        self, input_ids: torch.LongTensor, position_ids: torch.LongTensor | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """H_0 and the rotary tables for `loop` (positions 0..s-1 unless given, [b or 1, s])."""
        if position_ids is None:  # [1, s]: the tables broadcast over any batch (rows may leave)
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.embed_at(input_ids, position_ids), self.rotary(position_ids)

    def embed_at(self, input_ids: torch.LongTensor, positions: torch.LongTensor) -> torch.Tensor:
        """H_0 of tokens at `positions` (broadcast with input_ids): the token embedding, plus the
        learned position table's rows where the model has one."""
        h = self.embed_tokens(input_ids)
        if self.embed_positions is None:
            return h
        rows = self.embed_positions.num_embeddings
        if positions.numel() and int(positions.max()) >= rows:
            raise ValueError(
                f"position {int(positions.max())} is past the learned position table's {rows} "
                f"rows (max_position_embeddings): this model reads at most {rows} tokens"
            )
        return h + self.embed_positions(positions)

    def step(
        self,
        h: torch.Tensor,
        loops: Loops,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """H_k of rows at `loops.loop` from H_{k-1} (H_0 at loop 1): what the loop receives (the
        recurrence, or the shared loop norm), the shared stack, the clamp where it is on. The
        only application of the stack: every path of this model and its decoders steps here. A
        cache of rows at one loop k takes entry (k − 1)·L + l; one of rows at their own loops
        (decoding.RowSlots) takes the layer and finds each row's slot by its loop."""
        h = loops.enter(h)
        first = (loops.loop - 1) * len(self.layers) if isinstance(loops.loop, int) else 0
        for i, layer in enumerate(self.layers):
            h = layer(h, *rope, cache, first + i, mask)
        return loops.hold(h)

    def feed_back(self, h: torch.Tensor) -> torch.Tensor:
        """R(H_{k-1}), what loop k > 1 receives: the recurrence, or the shared loop norm."""
        return self.recurrence(h) if self.norm is None else self.norm(h)

    def loops(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        num_loops: int,
        clamp: bool = False,
        cache: Cache | None = None,
        mask: torch.Tensor | None = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(k, H_k) for k = 1..num_loops from H_0; with `clamp`, every H_k (k ≥ 2) is held at
        its loop-1 RMS before it is read out or fed back."""
        step = lambda x, loops: self.step(x, loops, rope, cache, mask)  # noqa: E731
        return trajectory(step, h, Loops(self, num_loops, clamp=clamp))

    @property
    def exit_norm(self) -> nn.Module | None:
        """The RMSNorm an exit reads through where READOUT_NORMALIZES says so: the shared loop
        norm if the model has one, else the readout's own (None for a raw readout)."""
        return self.readout_norm if self.norm is None else self.norm

    def readout(self, h: torch.Tensor, loop: Loop, last: int) -> torch.Tensor:
        """Exit `loop`'s logits (one loop, or one per row) in a run whose last loop is `last`,
        read the way semantics.READOUTS says (`final_norm` normalises from the trained depth on,
        whatever K the model runs at; `last_norm` the run's last loop only)."""
        c = self.config
        return self.lm_head(
            readout_input(c.readout, h, loop, c.num_loops_trained, last, self.exit_norm)
        )

    def exit_probability(self, h: torch.Tensor) -> torch.Tensor:
        """λ_k [b, s, 1] from the gate, which reads H_k/‖H_k‖_rms (or H_k: exit_gate_input), or
        the shared loop norm's output."""
        normed = self.norm(h) if self.norm is not None else None
        x = gate_input(self.config.exit_gate_input, h, self.config.rms_norm_eps, normed)
        return exit_lambda(self.exit_gate, x)[..., None]

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        num_loops: int | None = None,
        logits_to_keep: int = 0,
        kv_policy: str | None = None,
        prefill_exit: bool = False,
        **kwargs,
    ) -> LoopedOutput:
        """`kv_policy` (a new cache's; default config.kv_policy) and `prefill_exit` (a prompt of
        more than one token exits early too, instead of running at full depth) concern early
        exit with a cache only."""
        K, L = num_loops or self.config.num_loops, self.config.num_hidden_layers
        use_cache = self.config.use_cache if use_cache is None else use_cache
        exiting = use_cache and (
            self.config.early_exit != "none" or isinstance(past_key_values, LoopCache)
        )
        if exiting:
            past_key_values = decoding.loop_cache(past_key_values, kv_policy, self.config.kv_policy)
        elif use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        cache = past_key_values if use_cache else None
        if cache is not None and not exiting and hasattr(cache, "layers"):
            while len(cache.layers) < K * L:  # generate() sizes its cache for L layers
                cache.layers.append(DynamicLayer())
        b, s = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        padded = attention_mask is not None and not bool(attention_mask.all())
        if position_ids is None and padded:  # left padding: positions count tokens only
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -s:]
        elif position_ids is None:
            position_ids = torch.arange(past, past + s, device=input_ids.device)[None]
        key_mask = attention_mask if padded else None

        exit_loops = None
        if exiting:
            positions = position_ids.expand(b, s)
            logits, exit_loops = decoding.exiting(
                self, input_ids, positions, cache, key_mask, K, prefill_exit
            )
        else:
            mask = allowed_keys(key_mask, s, past + s, input_ids.device) if padded else None
            h, rope = self.embed(input_ids, position_ids)
            path = self.loops(h, rope, K, self.config.clamp, cache, mask)
            if self.config.early_exit != "none":
                c = self.config
                rule = Loops(self, K, c.early_exit, c.exit_threshold)
                logits, exit_loops = first_exits(path, rule)
            else:
                logits = next(self.readout(h, k, K) for k, h in path if k == K)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return LoopedOutput(
            loss=loss,
            logits=logits,
            past_key_values=cache if use_cache else None,
            exit_loops=exit_loops,
        )

    def cache_bytes_per_token(
        self, kv_policy: str | None = None, num_loops: int | None = None
    ) -> int:
        """The exiting cache's memory per cached token under a KV policy (default
        config.kv_policy), at K loops (default config.num_loops)."""
        c = self.config
        return decoding.bytes_per_token(
            c, self.dtype.itemsize, kv_policy or c.kv_policy, num_loops or c.num_loops
        )

    def decode_async(self, prompt: torch.LongTensor, *args, **kwargs) -> AsyncDecoding:
        """Depth-asynchronous batched decoding after a full-depth prefill: decoding.decode_async."""
        return decoding.decode_async(self, prompt, *args, **kwargs)
