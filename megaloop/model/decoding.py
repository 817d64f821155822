"""Early exit with a KV cache, and the decoders that run rows at their own loops: shipped with an
export beside modeling_megaloop.py (sha256 recorded), as semantics.py is.

A token that exits at loop k runs no loop after it; its KV policy (modes.KV_POLICIES) says what
the (loop, layer) slots it skipped hold for later tokens (docs/generation.md). Two decoders:
`exiting`, the forward of a LoopCache, runs a batch's new tokens loop by loop together
(semantics.each_loop), gathering the ones still running; `DepthAsyncDecoder` runs every row at
its own loop (semantics.each_step), so one application of the stack serves rows at different
loops. Both step through the model's `step` with semantics.Loops, which applies the loop's
rules per row; neither iterates over loops itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .modes import KV_POLICIES, asynchronous_policies
from .semantics import Loops, each_loop, each_step


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


class LoopCache(Cache):
    """Early exit's KV cache: (loop, layer) slots of keys and values [b, kv_heads, T, head_dim],
    as many per layer as the KV policy keeps (modes.KV_POLICIES), and what the exiting forward
    counts: each new token's exit loop and loops run (`exit_loops`, `loops_run`: one [b, s] per
    forward) and every application of the stack to a token (`loop_applications`, recompute's
    catch-up included). `recompute` also keeps every token's latest hidden state (`tokens`).

    The slots are views of one preallocated tensor `kv` [slots, b, 2, kv_heads, capacity,
    head_dim] (`keys[i]`, `values[i]`: kv[i, :, 0], kv[i, :, 1]), so that what spans slots (a
    copy into every deeper loop, a decoder's gather of each row's slot) is one operation."""

    is_compileable = False

    def __init__(self, kv_policy: str = "copy"):
        if kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy={kv_policy!r}: use one of {', '.join(KV_POLICIES)}")
        super().__init__(layers=[])
        self.kv_policy, self.policy = kv_policy, KV_POLICIES[kv_policy]
        self.num_loops: int | None = None
        self.num_layers = 0
        self.length = 0
        self.kv: torch.Tensor | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.tokens: Tokens | None = None
        self.exit_loops: list[torch.Tensor] = []
        self.loops_run: list[torch.Tensor] = []
        self.loop_applications = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def slot(self, index: int) -> int:
        """The slot of cache entry (k - 1)·L + l: its own, or layer l's where a layer keeps one."""
        return index % len(self.keys)

    def grow(self, s: int, num_loops: int, like: torch.Tensor, layers: int) -> None:
        """Room for s new positions in every slot (capacity doubled when full, so a decoded token
        copies no slot); the first call fixes K and the slots' shape from `like`
        [b, kv_heads, 0, head_dim]."""
        if self.num_loops is None:
            self.num_loops, self.num_layers = num_loops, layers
            slots = self.policy.loop_slots(num_loops) * layers
            b, heads, _, head_dim = like.shape
            self.set_kv(like.new_zeros(slots, b, 2, heads, 0, head_dim))
        elif num_loops != self.num_loops:
            raise ValueError(
                f"num_loops={num_loops}: this cache holds K={self.num_loops}; start a new cache "
                "to change K"
            )
        self.length += s
        if self.length > self.capacity:
            self.reserve(max(2 * self.capacity, self.length))

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def reserve(self, room: int) -> None:
        """Capacity for `room` positions in every slot, allocated now (a decoder that knows how
        many tokens it will feed copies the slots once, not as they fill)."""
        if room > self.capacity:
            kv = self.kv.new_zeros(*self.kv.shape[:4], room, self.kv.shape[5])
            kv[:, :, :, :, : self.capacity] = self.kv
            self.set_kv(kv)

    def set_kv(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.keys, self.values = (list(kv[:, :, i].unbind(0)) for i in (0, 1))

    def copy_deeper(self, k: int, s: int) -> None:
        """`copy`, after a forward whose every new token (the last s positions) exited by loop
        k < K: loop k's slots of those positions, each token's exit loop's keys and values by
        then, into every deeper loop's slots, in one copy."""
        by_loop = self.kv.unflatten(0, (self.num_loops, self.num_layers))
        new = slice(self.length - s, self.length)
        by_loop[k:, :, :, :, :, new] = by_loop[k - 1 : k, :, :, :, :, new]

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
        self.set_kv(select(self.kv.transpose(0, 1)).transpose(0, 1).contiguous())
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
    loop on the active rows only. (Running every row instead, a row without work on a masked
    position, spares the copy of the gathered rows' slots but runs every row at the most
    positions any row catches up: at batch 8 it decoded 12% slower here.)"""
    rows = work.any(1).nonzero().squeeze(1)
    of_rows = work[rows]
    n = int(of_rows.sum(1).max()) if len(rows) else 0
    idx = torch.argsort((~of_rows).to(torch.int8), dim=1, stable=True)[:, :n]
    return rows, idx, of_rows.gather(1, idx)


def loop_cache(cache: Cache | None, kv_policy: str | None, default: str) -> LoopCache:
    """The LoopCache of an exiting forward: the one given, or a new one (of `kv_policy`, else
    `default`) in place of none or of the empty cache generate() makes."""
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
    return LoopCache(kv_policy or default)


def bytes_per_token(config, itemsize: int, kv_policy: str, num_loops: int) -> int:
    """A LoopCache's memory per cached token under a KV policy at K loops: (loop, layer) slots
    of keys and values, and under `recompute` the token's latest hidden state, clamp
    reference, depth and position."""
    c = config
    kv = 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * itemsize
    policy = KV_POLICIES[kv_policy]
    total = policy.loop_slots(num_loops) * c.num_hidden_layers * kv
    if policy.resumes:
        total += (c.hidden_size + 1) * itemsize + 2 * torch.long.itemsize
    return total


def exiting(
    model,
    input_ids: torch.LongTensor,
    positions: torch.LongTensor,
    cache: LoopCache,
    key_mask: torch.Tensor | None,
    K: int,
    prefill_exit: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [b, s, V] and exit loops [b, s] of the new tokens; a token stops at its rule's
    exit. A prompt runs at full depth unless `prefill_exit`, its logits still its rule's exit
    loop's: a forward of more than one token, or the first forward of a cache whatever its
    length, so that a one-token prompt alone runs as it does left-padded in a batch. Only a
    decoded token (one, after cached ones) exits. `recompute` gathers the tokens a loop runs
    (`resumed`); the other policies run the batch in lockstep (`lockstep`)."""
    s = input_ids.shape[1]
    c = model.config
    tokens = fresh_tokens(model, input_ids, positions, cache, K)
    exits_early = prefill_exit or (s == 1 and cache.get_seq_length() > s)
    rope = model.rotary(tokens.positions)
    loops = Loops(model, K, c.early_exit, c.exit_threshold, c.clamp)
    if cache.policy.resumes:
        logits, exit_loops, loops_run = resumed(
            loops, tokens, rope, cache, key_mask, exits_early, s
        )
    else:
        logits, exit_loops = lockstep(loops, tokens, rope, cache, key_mask, exits_early)
        loops_run = exit_loops if exits_early else torch.full_like(exit_loops, K)
        cache.loop_applications += int(loops_run.sum())
    cache.exit_loops.append(exit_loops)
    cache.loops_run.append(loops_run)
    return logits, exit_loops


def lockstep(
    loops: Loops,
    tokens: Tokens,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: LoopCache,
    key_mask: torch.Tensor | None,
    exits_early: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and exit loops of a forward whose tokens resume nothing (`copy`, `share`): every
    row runs each loop until all its new tokens have exited, an exited token's hidden state and
    keys and values held by masks (HeldSlots) instead of gathering the running ones, so a loop
    costs the fixed-K forward's plus a `where` a tensor, one host sync decides whether any token
    runs on, and the exit's readout is computed once, at the end, unless the rule read it."""
    model, K = loops.model, loops.num_loops
    b, s = tokens.depth.shape
    mask = None if key_mask is None else allowed_keys(key_mask, s, cache.length, key_mask.device)
    open_ = torch.ones_like(tokens.depth, dtype=torch.bool)
    exit_loops = torch.zeros_like(tokens.depth)
    kept = {}  # the exits' logits where the rule reads them, else their hidden states
    slots = HeldSlots(cache, s)

    def run() -> bool:
        k = loops.loop
        h = model.step(tokens.hidden, loops, rope, slots, mask)
        if slots.running is not None:
            h = torch.where(slots.running[..., None], h, tokens.hidden)
        tokens.hidden = h
        stop, read = loops.stop(tokens.hidden)
        newly = open_ & stop
        exit_loops.masked_fill_(newly, k)
        name, value = ("logits", read) if read is not None else ("hidden", tokens.hidden)
        kept[name] = value if k == 1 else torch.where(newly[..., None], value, kept[name])
        open_.logical_and_(~stop)
        if not exits_early:
            return True
        if open_.numel() == 1:
            return bool(open_)
        more, every = torch.stack((open_.any(), open_.all())).tolist()
        slots.running = None if every else open_
        return more

    if loops.clamp:
        loops.reference = tokens.reference
    each_loop(loops, run)
    if exits_early and cache.policy.copies_down and loops.loop < K:
        cache.copy_deeper(loops.loop, s)
    if "logits" in kept:
        return kept["logits"], exit_loops
    return model.readout(kept["hidden"], exit_loops, K), exit_loops


class HeldSlots:
    """A lockstep forward's view of a LoopCache: `update` writes the new positions' keys and
    values in the loop's slot and returns the slot whole, as Cache.update does; a token no
    longer `running` [b, s] (None: all are; set each loop) writes what its KV policy leaves
    there instead, the previous loop's under `copy` (by induction its exit loop's), its own last
    under `share`. A slot's views are taken once a forward, when a loop first reaches it."""

    def __init__(self, cache: LoopCache, s: int):
        self.cache, self.s, self.running = cache, s, None
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def view(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot i's keys (i < slots) or values (slot i − slots) whole, and at the new positions."""
        if i not in self.views:
            cache, slots = self.cache, len(self.cache.keys)
            t = cache.keys[i] if i < slots else cache.values[i - slots]
            self.views[i] = (t[:, :, : cache.length], t[:, :, cache.length - self.s : cache.length])
        return self.views[i]

    def update(self, k: torch.Tensor, v: torch.Tensor, index: int):
        cache, slot = self.cache, self.cache.slot(index)
        slots = len(cache.keys)
        for i, new in ((slot, k), (slots + slot, v)):
            fresh = self.view(i)[1]
            if self.running is not None:
                held = self.view(i - cache.num_layers)[1] if cache.policy.copies_down else fresh
                new = torch.where(self.running[:, None, :, None], new, held)
            fresh.copy_(new)
        return self.view(slot)[0], self.view(slots + slot)[0]


def resumed(
    loops: Loops,
    tokens: Tokens,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: LoopCache,
    key_mask: torch.Tensor | None,
    exits_early: bool,
    s: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, exit loops and loops run of a `recompute` forward's s new tokens: at loop k only
    the new tokens still running, and the earlier ones their attention needs at k (at loop
    k − 1), are gathered and run."""
    b, model = tokens.depth.shape[0], loops.model
    running = torch.ones(b, s, dtype=torch.bool, device=tokens.depth.device)
    open_ = running.clone()
    logits = tokens.hidden.new_zeros(b, s, model.config.vocab_size)
    exit_loops = torch.zeros_like(running, dtype=torch.long)
    loops_run = torch.zeros_like(exit_loops)

    def run() -> bool:
        nonlocal running
        k = loops.loop
        run_loop(model, loops, tokens, rope, cache, running, key_mask)
        loops_run[running] = k
        rows, cols, stop = decide(loops, tokens.hidden[:, -s:], open_, logits)
        exit_loops[rows[stop], cols[stop]] = k
        open_[rows[stop], cols[stop]] = False
        if exits_early:
            running = open_.clone()
        return bool(running.any())

    each_loop(loops, run)
    return logits, exit_loops, loops_run


def fresh_tokens(model, input_ids, positions, cache: LoopCache, K: int) -> Tokens:
    """The forward's new tokens at H_0, the cache grown for them; under `recompute`, after the
    cache's earlier ones (which the cache keeps)."""
    (b, s), c = input_ids.shape, model.config
    h0 = model.embed_at(input_ids, positions)
    head_dim = c.hidden_size // c.num_attention_heads
    cache.grow(s, K, h0.new_zeros(b, c.num_key_value_heads, 0, head_dim), len(model.layers))
    depth, offset = torch.zeros_like(input_ids), cache.get_seq_length() - s
    new = Tokens(h0, depth, h0.new_ones(b, s, 1), positions, offset)
    if not cache.policy.resumes:
        return new
    cache.tokens = new if cache.tokens is None else cache.tokens.extend(new)
    return cache.tokens


def decide(
    loops: Loops, hidden: torch.Tensor, open_: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule at `loops.loop` for the new tokens without an exit yet (`open_` [b, s]): writes
    the stopping ones' logits into `logits`; returns the open tokens' rows, columns and stops."""
    rows, cols = open_.nonzero(as_tuple=True)
    h = hidden[rows, cols]
    stop, read = loops.stop(h)
    logits[rows[stop], cols[stop]] = loops.read(h[stop]) if read is None else read[stop]
    loops.exit.keep(~stop)
    return rows, cols, stop


def run_loop(
    model,
    loops: Loops,
    tokens: Tokens,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: LoopCache,
    running: torch.Tensor,
    key_mask: torch.Tensor | None,
) -> None:
    """Loop `loops.loop` (k) on the gathered tokens that need it, scattered back into `tokens`
    (`rope`: their rotary tables): the running new ones, and under `recompute` every earlier
    token of their rows still at loop k − 1."""
    s, k = running.shape[1], loops.loop
    if tokens.hidden.shape[1] == s and bool(running.all()):
        run_every_row(model, loops, tokens, rope, cache, key_mask)
        return
    if tokens.hidden.shape[1] == 1:  # one token a row, none to catch up: the running rows
        rows = running[:, 0].nonzero().squeeze(1)
        idx = rows.new_zeros(len(rows), 1)
        valid = torch.ones_like(idx, dtype=torch.bool)
        written = (rows, idx[:, 0])
    else:
        work = torch.zeros_like(tokens.depth, dtype=torch.bool)
        work[:, -s:] = running
        if cache.policy.resumes:
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
    if loops.clamp:
        loops.reference = tokens.reference[at]
    h = model.step(tokens.hidden[at], loops, rope_at, slots, mask)
    if loops.clamp:
        tokens.reference[written] = loops.reference[valid]
    tokens.hidden[written] = h[valid]
    tokens.depth[written] = k
    cache.loop_applications += int(valid.sum())


def run_every_row(
    model,
    loops: Loops,
    tokens: Tokens,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: LoopCache,
    key_mask: torch.Tensor | None,
) -> None:
    """The loop when every new token runs and no earlier one needs it (a prompt at full depth,
    a decoding step before any row exits): the loop as without early exit, no gather."""
    b, s = tokens.depth.shape
    mask = None
    if key_mask is not None:
        mask = allowed_keys(key_mask, s, cache.length, key_mask.device)
    if loops.clamp:
        loops.reference = tokens.reference
    slots = ActiveSlots(cache, None, None, None, True)
    tokens.hidden = model.step(tokens.hidden, loops, rope, slots, mask)
    if loops.clamp:
        tokens.reference = loops.reference
    tokens.depth.fill_(loops.loop)
    cache.loop_applications += b * s


# ---- depth-asynchronous batched decoding: rows at different loops share one stack application


def decode_async(
    model,
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
        cache = LoopCache(kv_policy or model.config.kv_policy)
    DepthAsyncDecoder.check(cache.kv_policy, attention_mask)
    pick = sample or (lambda logits: logits.argmax(-1))
    with torch.no_grad():
        out = model(
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

        decoder = DepthAsyncDecoder(model, cache, first, feeds, attention_mask, eos_token_id)
        decoder.run(next_input)
    return AsyncDecoding(tokens, decoder.logits, decoder.exit_loops, decoder.steps, cache)


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

    State per decoding row (`rows`: their indices in the batch): its hidden state, its current
    token's cache position (less its left padding: its rope position) and the tokens it has fed;
    `loops` (semantics.Loops) holds the loop each runs next, its gate survival and clamp reference
    (reset when it starts a token) and applies the loop's rules to each. The keys and values are the
    prefilled LoopCache's one tensor (LoopCache.kv), given room for every fed token: a row's keys
    and values of one slot are one block (`blocks`, read whole), each head's positions contiguous
    as attention reads them; `by_position` views the same memory by (block, position), where a
    step writes. `copy` and `share` only: `recompute` would resume earlier tokens of a row at a loop
    that row's attention needs, which a row-synchronous step does."""

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
        cache.reserve(cache.length + feeds)
        self.kv, room = cache.kv, cache.capacity
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
        self.fed = torch.zeros(b, dtype=torch.long, device=device)
        self.hidden = model.embed_at(first, self.length - self.pads)
        c = model.config
        loop = torch.ones(b, dtype=torch.long, device=device)
        self.loops = Loops(model, self.K, c.early_exit, c.exit_threshold, c.clamp, loop)
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

    @staticmethod
    def check(kv_policy: str, attention_mask: torch.Tensor | None) -> None:
        if KV_POLICIES[kv_policy].resumes:
            runs = ", ".join(asynchronous_policies())
            raise ValueError(
                f"kv_policy={kv_policy!r}: depth-asynchronous decoding runs {runs}; decode "
                f"{kv_policy} with generate() (a LoopCache, one token a forward)"
            )
        if attention_mask is not None and bool((attention_mask.diff(dim=1) < 0).any()):
            raise ValueError("attention_mask: pad prompts on the left (the pads first)")

    def run(self, next_input) -> None:
        """Steps until every row has fed its tokens. `next_input(rows, j, logits)` gives, for
        the rows `rows` [r] (indices in the batch) whose j-th token ([r]) exited at this step,
        the token each feeds next ([r]; the true next token, or one picked from `logits` [r, V],
        that token's readout)."""
        self.keep_decoding()
        each_step(self.loops, lambda: self.step(next_input))
        self.cache.length += self.feeds  # every row fills the same positions again (one ended
        # by `until` leaves the positions after it empty)
        self.cache.loop_applications += self.applied
        self.cache.exit_loops.append(self.exit_loops)
        self.cache.loops_run.append(self.exit_loops)

    def keep_decoding(self) -> None:
        """Only the rows that still have tokens to feed run from now on."""
        decoding = self.fed < self.feeds
        if not bool(decoding.all()):
            index = decoding.nonzero().squeeze(1)
            for name in ("rows", "length", "pads", "fed", "hidden"):
                setattr(self, name, getattr(self, name)[index])
            self.loops.keep(index)

    def step(self, next_input) -> None:
        """One application of the stack to every decoding row, each at its own loop; the rows
        whose token exits start their next one."""
        loops = self.loops
        loop = loops.loop
        rope = tuple(table[self.length - self.pads][:, None, None] for table in self.rope)
        slots = RowSlots(self, loop)
        h = self.model.step(self.hidden[:, None], loops, rope, slots, slots.mask)[:, 0]
        self.steps += 1
        self.applied += len(self.rows)
        stop, read = loops.stop(h)
        done = stop.nonzero().squeeze(1)
        if len(done):
            if self.cache.policy.copies_down:
                self.copy_down(stop & (loop < self.K), loop, slots)
            fed = self.start_next(done, loop, h, read, next_input)
            h[done] = self.model.embed_at(fed, (self.length - self.pads)[done])
        self.hidden = h
        loops.advance(stop)
        self.keep_decoding()

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
        read = self.model.readout(h[done], loop[done], self.K) if read is None else read[done]
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
        if not decoder.cache.policy.per_loop:  # one slot a layer
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
