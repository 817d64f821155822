"""A looped language model in plain PyTorch, for transformers (remote code of an export).

    H_0 = Embed(x) (+ a learned position table, where RoPE is not used)
    H_k = Stack(R(H_{k-1}))          k = 1..K, R = recurrence (identity for k = 1)
    logits = Readout(H_K)            (or, with early exit, each token's exit loop)

What R, the readout, the clamp, the exit gate and early exit do is semantics.py, the training
model's own definition, copied beside this file. With a shared loop norm (Ouro's wiring) one
RMSNorm `norm` is R, the gate's input and the normalising readout's norm.

`embed`, `loops`, `readout` and `exit_probability` are the pieces `forward` is made of; the
measurement commands (megaloop depth/halt/diagnose) drive them one loop at a time.

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
from typing import get_args

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megaloop import MegaloopConfig
from .modes import KEEPS_HIDDEN, KV_LOOP_SLOTS, READOUT_NORMALIZES, KVPolicy
from .semantics import (
    Clamp,
    ExitRule,
    Recurrence,
    exit_lambda,
    gate_input,
    loop_norm,
    readout_input,
    readout_norm,
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


def allowed_keys(key_mask: torch.Tensor | None, s: int, keys: int, device) -> torch.Tensor:
    """[b or 1, 1, s, keys] booleans: the last `s` of `keys` positions attend causally to the
    keys that `key_mask` [b, keys] marks as tokens (not padding)."""
    return attendable(key_mask, torch.arange(keys - s, keys, device=device)[None], keys)


def attendable(key_mask: torch.Tensor | None, queries: torch.Tensor, keys: int) -> torch.Tensor:
    """[b or 1, 1, s, keys] booleans: queries at positions `queries` [b or 1, s] attend causally
    to the keys that `key_mask` [b, keys] marks as tokens. A padding query still sees itself, so
    its row is never empty (an empty row would give NaN, and NaN times a zero attention weight
    still spreads to real tokens)."""
    query = queries[:, :, None]
    key = torch.arange(keys, device=queries.device)[None, None, :]
    allowed = key <= query
    if key_mask is not None:
        allowed = (allowed & key_mask.bool()[:, None, :]) | (key == query)
    return allowed[:, None]


@dataclass
class LoopedOutput(CausalLMOutputWithPast):
    """The causal LM output, and each new token's exit loop [b, s] when a rule chose one."""

    exit_loops: torch.LongTensor | None = None


class LoopCache(Cache):
    """Early exit's KV cache: (loop, layer) slots of keys and values [b, kv_heads, T, head_dim],
    as many per layer as the KV policy keeps (modes.KV_LOOP_SLOTS), and what the exiting forward
    counts: each new token's exit loop and loops run (`exit_loops`, `loops_run`: one [b, s] per
    forward) and every application of the stack to a token (`loop_applications`, recompute's
    catch-up included). `recompute` also keeps every token's latest hidden state (`tokens`)."""

    is_compileable = False

    def __init__(self, kv_policy: str = "copy"):
        if kv_policy not in get_args(KVPolicy):
            raise ValueError(f"kv_policy={kv_policy!r}: use one of {', '.join(get_args(KVPolicy))}")
        super().__init__(layers=[])
        self.kv_policy = kv_policy
        self.num_loops: int | None = None
        self.num_layers = 0
        self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.tokens: Tokens | None = None
        self.exit_loops: list[torch.Tensor] = []
        self.loops_run: list[torch.Tensor] = []
        self.loop_applications = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def slot(self, index: int) -> int:
        """The slot of cache entry (k - 1)·L + l: its own, or layer l's under `share`."""
        return index % self.num_layers if self.kv_policy == "share" else index

    def grow(self, s: int, num_loops: int, like: torch.Tensor, layers: int) -> None:
        """Room for s new positions in every slot (capacity doubled when full, so a decoded token
        copies no slot); the first call fixes K and the slots' shape from `like`
        [b, kv_heads, 0, head_dim]."""
        if self.num_loops is None:
            self.num_loops, self.num_layers = num_loops, layers
            slots = KV_LOOP_SLOTS[self.kv_policy](num_loops) * layers
            self.keys = [like.clone() for _ in range(slots)]
            self.values = [like.clone() for _ in range(slots)]
        elif num_loops != self.num_loops:
            raise ValueError(
                f"num_loops={num_loops}: this cache holds K={self.num_loops}; start a new cache "
                "to change K"
            )
        self.length += s
        b, heads, capacity, head_dim = self.keys[0].shape
        if self.length > capacity:
            room = self.keys[0].new_zeros(b, heads, max(capacity, self.length - capacity), head_dim)
            self.keys = [torch.cat([t, room], 2) for t in self.keys]
            self.values = [torch.cat([t, room], 2) for t in self.values]

    def copy_down(self, k: int, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """`copy`: loop k's keys and values of the tokens at (rows, positions) into every deeper
        loop's slots, which later tokens attend to at those loops."""
        L = self.num_layers
        for store in (self.keys, self.values):
            for layer in range(L):
                exit_entry = store[(k - 1) * L + layer][rows, :, positions]
                for deeper in range(k, self.num_loops):
                    store[deeper * L + layer][rows, :, positions] = exit_entry

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0] if self.keys else -1

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("an early-exit cache cannot be cropped: generate without an assistant")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the rows follow their beams (the per-forward counts stay as run)."""
        self.select_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(lambda t: t.repeat_interleave(repeats, 0))

    def select_rows(self, select) -> None:
        self.keys = [select(t) for t in self.keys]
        self.values = [select(t) for t in self.values]
        if self.tokens is not None:
            self.tokens = Tokens(*map(select, self.tokens.tensors()), self.tokens.offset)

    def bytes_per_token(self) -> float:
        """What the cache holds per cached position, measured from its tensors."""
        slots = sum(t.nbytes / t.shape[2] for t in [*self.keys, *self.values])
        hidden = sum(t.nbytes for t in self.tokens.tensors()) / self.length if self.tokens else 0
        return (slots + hidden) / self.keys[0].shape[0]


@dataclass
class Tokens:
    """The positions a forward may run loops on: each one's latest hidden state [b, P, d], loops
    run [b, P], clamp reference [b, P, 1] and rope position [b, P]; index 0 is cache position
    `offset`. `recompute` keeps all of them across forwards (a token resumes where it exited);
    the other policies only a forward's new tokens."""

    hidden: torch.Tensor
    depth: torch.Tensor
    reference: torch.Tensor
    positions: torch.Tensor
    offset: int

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden, self.depth, self.reference, self.positions]

    def extend(self, new: Tokens) -> Tokens:
        return Tokens(
            *(torch.cat([old, add], 1) for old, add in zip(self.tensors(), new.tensors())),
            self.offset,
        )


class ActiveSlots:
    """One loop's view of a LoopCache for the rows it runs: `update` writes the running tokens'
    keys and values at their positions and returns those rows' slots, as Cache.update does
    (without a copy when every row runs, with a slice when only the newest positions do)."""

    def __init__(self, cache: LoopCache, rows, positions, valid, new_only: bool):
        self.cache, self.rows, self.valid, self.new_only = cache, rows, valid, new_only
        self.all_rows = rows is None or len(rows) == cache.keys[0].shape[0]
        if not new_only:
            self.at = (rows[:, None].expand_as(positions)[valid], positions[valid])

    def update(self, k: torch.Tensor, v: torch.Tensor, index: int):
        slot, end = self.cache.slot(index), self.cache.length
        keys = self.cache.keys[slot][:, :, :end]
        values = self.cache.values[slot][:, :, :end]
        for store, new in ((keys, k), (values, v)):
            if self.new_only and self.all_rows:
                store[:, :, end - new.shape[2] :] = new
            elif self.new_only:
                store[self.rows, :, end - new.shape[2] :] = new
            else:
                store[self.at[0], :, self.at[1]] = new.transpose(1, 2)[self.valid]
        if self.all_rows:
            return keys, values
        return keys[self.rows], values[self.rows]


def gather_index(work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows with work [r], each one's working positions first [r, n] (n: the most any row
    has) and which of those are real [r, n], from `work` [b, P] booleans: the gather that runs a
    loop on the active rows only."""
    rows = work.any(1).nonzero().squeeze(1)
    of_rows = work[rows]
    n = int(of_rows.sum(1).max()) if len(rows) else 0
    idx = torch.argsort((~of_rows).to(torch.int8), dim=1, stable=True)[:, :n]
    return rows, idx, of_rows.gather(1, idx)


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

    def loop(
        self,
        h: torch.Tensor,
        k: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """H_k from H_{k-1} (H_0 for k = 1): the recurrence (or the shared loop norm), then the
        shared stack."""
        if k > 1:
            h = self.feed_back(h)
        L = len(self.layers)
        for i, layer in enumerate(self.layers):
            h = layer(h, *rope, cache, (k - 1) * L + i, mask)
        return h

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
        held = Clamp() if clamp else None
        for k in range(1, num_loops + 1):
            h = self.loop(h, k, rope, cache, mask)
            if held is not None:
                h = held(h)
            yield k, h

    @property
    def exit_norm(self) -> nn.Module | None:
        """The RMSNorm an exit reads through where READOUT_NORMALIZES says so: the shared loop
        norm if the model has one, else the readout's own (None for a raw readout)."""
        return self.readout_norm if self.norm is None else self.norm

    def readout(self, h: torch.Tensor, loop: int) -> torch.Tensor:
        """Exit `loop`'s logits, read the way semantics.READOUTS says (`final_norm` normalises
        from the trained depth on, whatever K the model runs at)."""
        return self.lm_head(
            readout_input(
                self.config.readout, h, loop, self.config.num_loops_trained, self.exit_norm
            )
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
            past_key_values = self.loop_cache(past_key_values, kv_policy)
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
            logits, exit_loops = self.exiting(
                input_ids, positions, cache, key_mask, K, prefill_exit
            )
        else:
            mask = allowed_keys(key_mask, s, past + s, input_ids.device) if padded else None
            h, rope = self.embed(input_ids, position_ids)
            trajectory = self.loops(h, rope, K, self.config.clamp, cache, mask)
            if self.config.early_exit != "none":
                logits, exit_loops = self.early_exit(trajectory, K)
            else:
                logits = next(self.readout(h, k) for k, h in trajectory if k == K)
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

    def early_exit(
        self, trajectory: Iterator[tuple[int, torch.Tensor]], K: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's logits at its exit loop (config.early_exit's rule), and that loop, with
        every loop run for every token: the no-cache reference of the exiting forward."""
        rule = ExitRule(self.config.early_exit, self.config.exit_threshold, K)
        logits, exit_loops = None, None
        for k, h in trajectory:
            lam = self.exit_probability(h)[..., 0] if rule.reads_gate else None
            logits_k = self.readout(h, k)
            stop = rule.stop(k, h, lam, logits_k)
            if logits is None:
                logits, exit_loops = logits_k, torch.zeros_like(stop, dtype=torch.long)
            take = stop & (exit_loops == 0)
            logits = torch.where(take[..., None], logits_k, logits)
            exit_loops = torch.where(take, k, exit_loops)
        return logits, exit_loops

    # ---- early exit with a cache: a token runs no loop after its exit -------------------------

    def loop_cache(self, cache: Cache | None, kv_policy: str | None) -> LoopCache:
        """The LoopCache of an exiting forward: the one given, or a new one in place of none
        or of the empty cache generate() makes."""
        if isinstance(cache, LoopCache):
            if kv_policy is not None and kv_policy != cache.kv_policy:
                raise ValueError(
                    f"kv_policy={kv_policy!r}: this cache was filled under "
                    f"{cache.kv_policy!r}; pass a new LoopCache to change policy"
                )
            return cache
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError(
                f"early exit needs a LoopCache, got a filled {type(cache).__name__}: pass "
                "past_key_values=LoopCache(kv_policy) or none"
            )
        return LoopCache(kv_policy or self.config.kv_policy)

    def cache_bytes_per_token(
        self, kv_policy: str | None = None, num_loops: int | None = None
    ) -> int:
        """The exiting cache's memory per cached token under a KV policy (default
        config.kv_policy), at K loops: (loop, layer) slots of keys and values, and under
        `recompute` the token's latest hidden state, clamp reference, depth and position."""
        c = self.config
        policy, K = kv_policy or c.kv_policy, num_loops or c.num_loops
        size = self.dtype.itemsize
        kv = 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * size
        total = KV_LOOP_SLOTS[policy](K) * c.num_hidden_layers * kv
        if KEEPS_HIDDEN[policy]:
            total += (c.hidden_size + 1) * size + 2 * torch.long.itemsize
        return total

    def decode_async(
        self,
        prompt: torch.LongTensor,
        new_tokens: int | None = None,
        forced: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_policy: str | None = None,
        num_loops: int | None = None,
        sample=None,
        eos_token_id: int | None = None,
        cache: LoopCache | None = None,
    ) -> AsyncDecoding:
        """Depth-asynchronous batched decoding (DepthAsyncDecoder) after a full-depth prefill of
        `prompt` [b, P] (left-padded where `attention_mask` says so) into a new LoopCache:
        `new_tokens` a row, each picked from its logits by `sample` (logits [r, V] → ids [r];
        default the argmax), the first from the prompt's last logits, a row ending at
        `eos_token_id` (with it; the rest of its row is that id); or teacher-forced, each token
        of `forced` [b, m] fed in turn. The exit rule and threshold are config.early_exit's and
        exit_threshold's, as in the synchronous exiting forward; `cache`, an empty LoopCache to
        decode into (default: a new one of `kv_policy`)."""
        if (new_tokens is None) == (forced is None):
            raise ValueError("decode_async: give new_tokens (greedy) or forced (teacher-forced)")
        if cache is None:
            cache = LoopCache(kv_policy or self.config.kv_policy)
        DepthAsyncDecoder.check(cache.kv_policy, attention_mask)
        pick = sample or (lambda logits: logits.argmax(-1))
        with torch.no_grad():
            out = self(
                prompt,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=True,
                num_loops=num_loops,
            )
            if forced is None:
                first, feeds = pick(out.logits[:, -1]), new_tokens - 1
                tokens = first.new_full((len(first), new_tokens), eos_token_id or 0)
                tokens[:, 0] = first
            else:
                first, feeds, tokens = forced[:, 0], forced.shape[1], forced

            def next_input(rows, j: torch.Tensor, logits: torch.Tensor):
                if forced is not None:  # past the last token: any (it is not fed)
                    return forced[rows, (j + 1).clamp(max=feeds - 1)]
                picked = pick(logits)
                tokens[rows, j + 1] = picked  # j < feeds = new_tokens - 1
                return picked

            decoder = DepthAsyncDecoder(self, cache, first, feeds, attention_mask, eos_token_id)
            decoder.run(next_input)
        return AsyncDecoding(tokens, decoder.logits, decoder.exit_loops, decoder.steps, cache)

    def exiting(
        self,
        input_ids: torch.LongTensor,
        positions: torch.LongTensor,
        cache: LoopCache,
        key_mask: torch.Tensor | None,
        K: int,
        prefill_exit: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [b, s, V] and exit loops [b, s] of the new tokens: at loop k only the tokens
        still running (and, under `recompute`, the earlier ones their attention needs at k) are
        gathered and run; a token stops at its rule's exit. A prompt (s > 1) runs at full depth
        unless `prefill_exit`, its logits still its rule's exit loop's."""
        b, s = input_ids.shape
        c = self.config
        head_dim = c.hidden_size // c.num_attention_heads
        h0 = self.embed_at(input_ids, positions)
        cache.grow(s, K, h0.new_zeros(b, c.num_key_value_heads, 0, head_dim), len(self.layers))
        new = Tokens(
            h0,
            torch.zeros_like(input_ids),
            h0.new_ones(b, s, 1),
            positions,
            cache.get_seq_length() - s,
        )
        tokens = new
        if KEEPS_HIDDEN[cache.kv_policy]:
            tokens = new if cache.tokens is None else cache.tokens.extend(new)
            cache.tokens = tokens
        rope = self.rotary(tokens.positions)
        rule = ExitRule(c.early_exit, c.exit_threshold, K)
        running = torch.ones_like(input_ids, dtype=torch.bool)
        open_ = running.clone()
        logits = h0.new_zeros(b, s, c.vocab_size)
        exit_loops, loops_run = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
        for k in range(1, K + 1):
            self.run_loop(k, tokens, rope, cache, running, key_mask)
            loops_run[running] = k
            rows, cols, stop = self.decide(rule, k, tokens.hidden[:, -s:], open_, logits)
            exit_loops[rows[stop], cols[stop]] = k
            open_[rows[stop], cols[stop]] = False
            if s == 1 or prefill_exit:
                running = open_.clone()
                if cache.kv_policy == "copy" and k < K and bool(stop.any()):
                    cache.copy_down(k, rows[stop], new.offset + cols[stop])
            if not running.any():
                break
        cache.exit_loops.append(exit_loops)
        cache.loops_run.append(loops_run)
        return logits, exit_loops

    def decide(
        self,
        rule: ExitRule,
        k: int,
        hidden: torch.Tensor,
        open_: torch.Tensor,
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rule at loop k for the new tokens without an exit yet (`open_` [b, s]): writes the
        stopping ones' logits into `logits`; returns the open tokens' rows, columns and stops."""
        rows, cols = open_.nonzero(as_tuple=True)
        h = hidden[rows, cols]
        lam = self.exit_probability(h)[..., 0] if rule.reads_gate else None
        read = self.readout(h, k) if rule.reads_logits else None
        stop = rule.stop(k, h, lam, read)
        logits[rows[stop], cols[stop]] = self.readout(h[stop], k) if read is None else read[stop]
        rule.keep(~stop)
        return rows, cols, stop

    def run_loop(
        self,
        k: int,
        tokens: Tokens,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LoopCache,
        running: torch.Tensor,
        key_mask: torch.Tensor | None,
    ) -> None:
        """Loop k on the gathered tokens that need it, scattered back into `tokens` (`rope`: their
        rotary tables): the running new ones, and under `recompute` every earlier token of their
        rows still at loop k − 1."""
        s = running.shape[1]
        if tokens.hidden.shape[1] == s and bool(running.all()):
            self.run_every_row(k, tokens, rope, cache, key_mask)
            return
        if tokens.hidden.shape[1] == 1:  # one token a row, none to catch up: the running rows
            rows = running[:, 0].nonzero().squeeze(1)
            idx = rows.new_zeros(len(rows), 1)
            valid = torch.ones_like(idx, dtype=torch.bool)
            written = (rows, idx[:, 0])
        else:
            work = torch.zeros_like(tokens.depth, dtype=torch.bool)
            work[:, -s:] = running
            if cache.kv_policy == "recompute":
                work |= (tokens.depth == k - 1) & running.any(1, keepdim=True)
            rows, idx, valid = gather_index(work)
            written = (rows[:, None].expand_as(idx)[valid], idx[valid])
        at, positions, P = (rows[:, None], idx), idx + tokens.offset, tokens.hidden.shape[1]
        new = P - s + torch.arange(s, device=idx.device)
        new_only = idx.shape[1] == s and bool(valid.all()) and torch.equal(idx, new.expand_as(idx))
        mask = None  # the new tokens only, no padding: the causal mask, as without early exit
        if key_mask is not None or not new_only:
            rows_mask = None if key_mask is None else key_mask[rows]
            mask = attendable(rows_mask, positions, cache.get_seq_length())
        slots = ActiveSlots(cache, rows, positions, valid, new_only)
        rope_at = tuple(t[:, 0][at][:, None] for t in rope)
        h = self.loop(tokens.hidden[at], k, rope_at, slots, mask)
        if self.config.clamp:
            held = Clamp()
            held.reference = tokens.reference[at] if k > 1 else None
            h = held(h)
            tokens.reference[written] = held.reference[valid]
        tokens.hidden[written] = h[valid]
        tokens.depth[written] = k
        cache.loop_applications += int(valid.sum())

    def run_every_row(
        self,
        k: int,
        tokens: Tokens,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LoopCache,
        key_mask: torch.Tensor | None,
    ) -> None:
        """Loop k when every new token runs and no earlier one needs it (a prompt at full depth,
        a decoding step before any row exits): the loop as without early exit, no gather."""
        b, s = tokens.depth.shape
        mask = None
        if key_mask is not None:
            mask = allowed_keys(key_mask, s, cache.length, key_mask.device)
        h = self.loop(tokens.hidden, k, rope, ActiveSlots(cache, None, None, None, True), mask)
        if self.config.clamp:
            held = Clamp()
            held.reference = tokens.reference if k > 1 else None
            h = held(h)
            tokens.reference = held.reference
        tokens.hidden = h
        tokens.depth.fill_(k)
        cache.loop_applications += b * s


# ---- depth-asynchronous batched decoding: rows at different loops share one stack application ---


@dataclass
class AsyncDecoding:
    """What `decode_async` gives: the new tokens [b, n] (greedy; the fed ones when forced), the
    logits [b, m, V] and exit loops [b, m] of the m tokens fed after the prompt, and the stack
    applications it took (`steps`; each serves every row still decoding once)."""

    tokens: torch.LongTensor
    logits: torch.Tensor
    exit_loops: torch.LongTensor
    steps: int
    cache: LoopCache


class DepthAsyncDecoder:
    """Decodes a batch with every row at its own loop: the stack's weights are the same at every
    loop, so one application of it serves a row at loop 1 of its next token beside a row at loop
    3 of its current one. A row whose token exits starts its next token at the next step, so no
    row waits for the batch's deepest token and the steps follow the rows' summed exit loops.
    A row that has fed its tokens leaves the step: at small batch a step costs about its
    weights, not its rows, but the last rows of a batch still run cheaper alone.

    State per decoding row (`rows`: their indices in the batch): its hidden state, the loop it
    runs next, its current token's cache position (less its left padding: its rope position),
    its gate survival and clamp reference (both reset when it starts a token) and the tokens it
    has fed. The keys and values are the prefilled LoopCache's, restacked as one
    [slots, b, 2, kv_heads, T, head_dim] with room for every fed token: a row's keys and values
    of one slot are one block (`blocks`, read whole), each head's positions contiguous as
    attention reads them; `by_position` views the same memory by (block, position), where a step
    writes. The cache's own slot lists view it too, so the cache is whole afterwards.
    `copy` and `share` only: `recompute` would resume earlier tokens of a row at a loop that
    row's attention needs, which a row-synchronous step does."""

    def __init__(
        self,
        model,
        cache: LoopCache,
        first: torch.Tensor,
        feeds: int,
        attention_mask=None,
        until: int | None = None,
    ):
        self.check(cache.kv_policy, attention_mask)
        self.model, self.cache, self.feeds = model, cache, feeds
        self.K, self.L = cache.num_loops, cache.num_layers
        room = cache.length + feeds
        self.kv = restack(cache.keys, cache.values, room)
        cache.keys, cache.values = (list(self.kv[:, :, i].unbind(0)) for i in (0, 1))
        self.blocks = self.kv.flatten(0, 1)
        self.by_position = self.blocks.permute(0, 3, 1, 2, 4)  # [blocks, room, 2, heads, d_head]
        # where a layer gathers its rows' slots, the same memory at every layer and step: a new
        # tensor each time would cost more in the allocator's page faults than in the copy
        self.gathered = self.kv.new_empty(self.kv[0].numel())
        b, device = first.shape[0], first.device
        self.batch_size = b
        self.length = torch.full((b,), cache.length, dtype=torch.long, device=device)
        self.pads = torch.zeros_like(self.length)
        if attention_mask is not None:
            self.pads = cache.length - attention_mask.long().sum(1)
        self.loop = torch.ones(b, dtype=torch.long, device=device)
        self.fed = torch.zeros(b, dtype=torch.long, device=device)
        self.hidden = model.embed_at(first, self.length - self.pads)
        self.survive = self.hidden.new_ones(b)
        self.reference = self.hidden.new_ones(b, 1)
        self.rows = torch.arange(b, device=device)
        self.logits = self.hidden.new_zeros(b, feeds, model.config.vocab_size)
        self.exit_loops = torch.zeros(b, feeds, dtype=torch.long, device=device)
        self.steps = 0
        self.applied = 0
        self.until = until
        if until is not None:  # a row whose first token ends it feeds nothing
            self.fed[first == until] = feeds
        positions = torch.arange(room, device=device)[None]
        self.rope = tuple(table[0, 0] for table in model.rotary(positions))  # [room, head_dim]
        # additive, each row's keys from its first token to the position it decodes: a step
        # opens that position (attention would turn a boolean mask into this at every layer)
        keys = torch.arange(room, device=device)[None]
        opened = (keys >= self.pads[:, None]) & (keys < cache.length)
        self.mask = self.hidden.new_zeros(opened.shape).masked_fill_(~opened, float("-inf"))
        # a row's block of (slot, layer): (slot·L + layer)·b + row in kv's first two dimensions
        self.layer_blocks = torch.arange(self.L, device=device)[:, None] * b
        # ahead[e − 1, j]: how many blocks past loop e's slot loop j + 1's lies (0 up to loop e)
        loops = torch.arange(self.K, device=device)
        self.ahead = (loops[None] - loops[:, None]).clamp(min=0) * (self.L * b)
        c = model.config
        self.rule = ExitRule(c.early_exit, c.exit_threshold, self.K)
        normalizes = [
            READOUT_NORMALIZES[c.readout](k, c.num_loops_trained) for k in range(1, self.K + 1)
        ]
        self.normalizes = torch.tensor(normalizes, device=device)
        self.normalized = None if len(set(normalizes)) > 1 else normalizes[0]

    @staticmethod
    def check(kv_policy: str, attention_mask: torch.Tensor | None) -> None:
        if kv_policy not in ("copy", "share"):
            raise ValueError(
                f"kv_policy={kv_policy!r}: depth-asynchronous decoding runs `copy` or `share`; "
                "decode `recompute` with generate() (a LoopCache, one token a forward)"
            )
        if attention_mask is not None and bool((attention_mask.diff(dim=1) < 0).any()):
            raise ValueError("attention_mask: pad prompts on the left (the pads first)")

    def run(self, next_input) -> None:
        """Steps until every row has fed its tokens. `next_input(rows, j, logits)` gives, for
        the rows `rows` [r] (indices in the batch) whose j-th token ([r]) exited at this step,
        the token each feeds next ([r]; the true next token, or one picked from `logits` [r, V],
        that token's readout)."""
        while True:
            decoding = self.fed < self.feeds
            if not bool(decoding.all()):
                self.keep(decoding.nonzero().squeeze(1))
            if not len(self.rows):
                break
            self.step(next_input)
        self.cache.length += self.feeds  # every row fills the same positions again (one ended
        # by `until` leaves the positions after it empty)
        self.cache.loop_applications += self.applied
        self.cache.exit_loops.append(self.exit_loops)
        self.cache.loops_run.append(self.exit_loops)

    def keep(self, index: torch.Tensor) -> None:
        """Only the decoding rows at `index` (of the current ones) run from now on."""
        for name in ("rows", "length", "pads", "loop", "fed", "hidden", "survive", "reference"):
            setattr(self, name, getattr(self, name)[index])

    def step(self, next_input) -> None:
        """One application of the stack to every decoding row, each at its own loop; the rows
        whose token exits start their next one."""
        model, loop = self.model, self.loop
        h = torch.where((loop > 1)[:, None], model.feed_back(self.hidden), self.hidden)
        rope = tuple(table[self.length - self.pads][:, None, None] for table in self.rope)
        slots = RowSlots(self, loop)
        x = h[:, None]
        for layer_index, layer in enumerate(model.layers):
            x = layer(x, *rope, slots, layer_index, slots.mask)
        h = self.clamp(x[:, 0], loop)
        self.steps += 1
        self.applied += len(self.rows)
        stop, read = self.decide(loop, h)
        done = stop.nonzero().squeeze(1)
        if len(done):
            if self.cache.kv_policy == "copy":
                self.copy_down(stop & (loop < self.K), loop, slots)
            fed = self.start_next(done, loop, h, read, next_input)
            h[done] = self.model.embed_at(fed, (self.length - self.pads)[done])
        self.hidden = h
        self.loop = torch.where(stop, 1, loop + 1)
        self.survive = torch.where(stop, 1.0, self.survive)

    def clamp(self, h: torch.Tensor, loop: torch.Tensor) -> torch.Tensor:
        """config.clamp: a row's H_1 sets its reference, deeper loops are held at it."""
        if not self.model.config.clamp:
            return h
        first, deeper = Clamp(), Clamp()
        first(h)
        self.reference = torch.where((loop == 1)[:, None], first.reference, self.reference)
        deeper.reference = self.reference
        return torch.where((loop > 1)[:, None], deeper(h), h)

    def decide(
        self, loop: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Which rows' tokens exit at their own loop (every row at K does), and every row's
        logits where the rule reads them (the margin; the gate reads λ only, so only the exiting
        rows are read out, by `step`); advances the rows' gate survival."""
        rule = self.rule
        lam = self.model.exit_probability(h)[..., 0] if rule.reads_gate else None
        if rule.reads_gate:
            rule.survival.survive = self.survive
        read = self.readout(h, loop) if rule.reads_logits else None
        # the rule's scores for every row (k = 0: none is at its last loop); loop K's stop by row
        stop = rule.stop(0, h, lam, read) | (loop == self.K)
        if rule.reads_gate:
            self.survive = rule.survival.survive
        return stop, read

    def readout(self, h: torch.Tensor, loop: torch.Tensor) -> torch.Tensor:
        """Each row's logits at its own loop: through the exit norm where READOUT_NORMALIZES
        says so at that loop, one W_out for every row."""
        norm = self.model.exit_norm
        if norm is None or self.normalized is False:
            return self.model.lm_head(h)
        if self.normalized:
            return self.model.lm_head(norm(h))
        return self.model.lm_head(torch.where(self.normalizes[loop - 1, None], norm(h), h))

    def copy_down(self, early: torch.Tensor, loop: torch.Tensor, slots: RowSlots) -> None:
        """`copy`: the keys and values of the rows whose token exits at its loop before K
        (`early`), written this step, into the deeper loops' slots of every layer, in one read
        and one write (which rewrites the exit slot too, with its own values)."""
        early = early.nonzero().squeeze(1)
        if not len(early):
            return
        at = slots.at[early]
        written = slots.written[:, early, None] + self.ahead[loop[early] - 1]  # [L, n, K]
        exited = torch.stack(slots.new)[:, early]  # [L, n, 2, kv_heads, head_dim]
        self.by_position.index_put_((written, at[:, None]), exited[:, :, None])

    def start_next(self, done, loop, h, read, next_input) -> torch.Tensor:
        """The rows at `done` (of the decoding ones) whose token exited: records its logits (read
        out here unless the rule read every row's) and exit loop, and returns the token each
        feeds next, which enters loop 1 at the next step, unless the row has fed its tokens or
        the token is `until` (the row then leaves)."""
        rows, fed = self.rows[done], self.fed[done]
        read = self.readout(h[done], loop[done]) if read is None else read[done]
        self.logits[rows, fed] = read
        self.exit_loops[rows, fed] = loop[done]
        tokens = next_input(rows, fed, read)
        fed = fed + 1
        more = fed < self.feeds
        if self.until is not None:
            ended = tokens == self.until
            fed[ended] = self.feeds
            more &= ~ended
        self.fed[done] = fed
        self.length[done[more]] += 1
        return tokens


class RowSlots:
    """One step's view of a DepthAsyncDecoder's slots, every row at its own loop: the `update`
    of Cache, with the layer's index for the cache index (the row's loop picks the slot):
    writes each row's new keys and values at its position and returns its slot; `mask`
    [r, 1, 1, T] hides the keys past each row's position and its left padding; `written`
    [L, r] is each row's block at each layer, `at` [r] its position. Where every row of the
    batch reads the same slot (`share`, or `copy` with the rows at one loop, as when none exits
    early) a layer's slots are one block: read as a view, not gathered."""

    def __init__(self, decoder: DepthAsyncDecoder, loop: torch.Tensor):
        self.decoder, rows, at = decoder, decoder.rows, decoder.length
        L, b = decoder.L, decoder.batch_size
        whole = len(rows) == b  # every row of the batch, in order
        decoder.mask[rows, at] = 0
        end, lowest, deepest = torch.stack((at.max(), loop.min(), loop.max())).tolist()
        end += 1
        mask = decoder.mask[:, :end] if whole else decoder.mask[rows, :end]
        self.mask = mask[:, None, None]
        self.blocks = decoder.blocks[:, :, :, :end]
        self.read, self.block = None, 0  # read: the rows' blocks; else layer l's is block + l·b
        if decoder.cache.kv_policy == "share":  # one slot a layer
            self.written = decoder.layer_blocks + rows
            if not whole:
                self.read = self.written
        else:
            self.written = decoder.layer_blocks + ((loop - 1) * (L * b) + rows)
            if whole and lowest == deepest:
                self.block = (lowest - 1) * L * b
            else:
                self.read = self.written
        self.at = at
        self.new: list[torch.Tensor] = []  # each layer's [r, 2, kv_heads, head_dim] written
        if self.read is not None:
            self.gathered = decoder.gathered[: len(rows) * self.blocks[0].numel()]
            self.gathered = self.gathered.view(len(rows), *self.blocks.shape[1:])

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int):
        """Writes each row's new key and value [r, kv_heads, 1, head_dim] at its position in its
        loop's slot and returns each row's slot [r, kv_heads, end, head_dim]: a view where the
        rows' slots are one block, else the step's one copy."""
        new = torch.stack((k[:, :, 0], v[:, :, 0]), 1)
        self.decoder.by_position.index_put_((self.written[layer], self.at), new)
        self.new.append(new)
        if self.read is None:
            b = self.decoder.batch_size
            kv = self.blocks[self.block + layer * b : self.block + (layer + 1) * b]
        else:
            kv = torch.index_select(self.blocks, 0, self.read[layer], out=self.gathered)
        return kv[:, 0], kv[:, 1]


def restack(keys: list[torch.Tensor], values: list[torch.Tensor], room: int) -> torch.Tensor:
    """A LoopCache's per-slot keys and values [b, kv_heads, ≥T, head_dim] as one
    [slots, b, 2, kv_heads, room, head_dim] tensor, the first T positions theirs."""
    b, heads, _, head_dim = keys[0].shape
    stacked = keys[0].new_zeros(len(keys), b, 2, heads, room, head_dim)
    for i, pair in enumerate(zip(keys, values)):
        for j, slot in enumerate(pair):
            stacked[i, :, j, :, : min(room, slot.shape[2])] = slot[:, :, :room]
    return stacked
