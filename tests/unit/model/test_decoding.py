"""Depth-asynchronous batched decoding (`decode_async`, DepthAsyncDecoder): one application of
the stack serves rows at different loops, and no row's tokens, exit loops or logits change for
it: each is what the synchronous exiting path gives that row, on megaloop's own wiring and on
Ouro's."""

from typing import get_args

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaloop.evaluation.generate_bench import configured
from megaloop.model.decoding import LoopCache
from megaloop.model.modes import ReadoutMode
from support import (
    MODELS,
    exit_model,
    greedy,
    middle_thresholds,
    prompts,
    teacher_forced,
    tiny_export,
)

NEVER = {"gate": 1.01, "margin": float("inf")}
PROMPT = 6


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return exit_model(request.param)


def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def synchronous(model, tokens, policy, **fields):
    """Teacher-forced logits [b, m, V] and exit loops [b, m] of tokens[:, PROMPT:] through the
    synchronous exiting path (one forward a token, every row at the same step)."""
    cache = LoopCache(policy)
    with configured(model, **fields), torch.no_grad():
        model(tokens[:, :PROMPT], past_key_values=cache)
    logits = teacher_forced(model, tokens[:, PROMPT:], cache, **fields)
    return logits, torch.cat(cache.exit_loops[1:], 1)


@pytest.mark.parametrize("policy", ["copy", "share"])
@pytest.mark.parametrize("rule", ["gate", "margin"])
def test_never_exiting_is_the_synchronous_path_and_fixed_k(model, rule, policy):
    """Every token runs K loops: greedy tokens and logits are the synchronous exiting path's,
    and under `copy` fixed-K cached generation's (`share` differs from fixed K by design)."""
    prompt, K, fields = prompts(4), model.config.num_loops, dict(early_exit=rule)
    fields["exit_threshold"] = NEVER[rule]
    tokens, logits = greedy(model, prompt, 6, LoopCache(policy), **fields)
    with configured(model, **fields):
        got = model.decode_async(prompt, 6, kv_policy=policy)
    assert torch.equal(got.tokens, tokens[:, PROMPT:])
    assert close(got.logits, logits[1:].transpose(0, 1))
    assert bool((got.exit_loops == K).all()) and got.steps == 5 * K
    if policy == "copy":
        fixed, fixed_logits = greedy(model, prompt, 6, early_exit="none")
        assert torch.equal(got.tokens, fixed[:, PROMPT:])
        assert close(got.logits, fixed_logits[1:].transpose(0, 1))


@pytest.mark.parametrize("policy", ["copy", "share"])
@pytest.mark.parametrize("rule", ["gate", "margin"])
def test_each_row_decodes_as_it_would_alone(model, rule, policy):
    """The key property: rows at different loops in one step do not change any row's result.
    Greedy: each row's tokens, exit loops and logits are its own at batch 1 through the
    synchronous exiting path; teacher-forced: the batch's through that path."""
    prompt, fields = prompts(8, seed=2), dict(early_exit=rule, exit_threshold=model.middle[rule])
    with configured(model, **fields):
        got = model.decode_async(prompt, 8, kv_policy=policy)
    assert len(got.exit_loops.unique()) >= 3, got.exit_loops
    for row in range(len(prompt)):
        cache = LoopCache(policy)
        alone, alone_logits = greedy(model, prompt[row : row + 1], 8, cache, **fields)
        assert torch.equal(got.tokens[row], alone[0, PROMPT:])
        assert torch.equal(got.exit_loops[row], torch.cat(cache.exit_loops[1:], 1)[0])
        assert close(got.logits[row], alone_logits[1:, 0])

    tokens = prompts(8, PROMPT + 12, seed=7)
    logits, exit_loops = synchronous(model, tokens, policy, **fields)
    with configured(model, **fields):
        forced = model.decode_async(tokens[:, :PROMPT], forced=tokens[:, PROMPT:], kv_policy=policy)
    assert torch.equal(forced.exit_loops, exit_loops)
    assert close(forced.logits, logits)


@pytest.mark.parametrize("policy", ["copy", "share"])
@pytest.mark.parametrize("rule", ["gate", "margin"])
def test_steps_follow_each_rows_summed_exits(model, rule, policy):
    """Counted, not timed: the stack is applied to K per prompt token plus each decoded token's
    exit loop; a row never waits, so the steps are the largest row's summed exit loops. The
    synchronous path's steps each run until their deepest row exits: more, unless one row is
    the deepest at every token (then that row bounds both)."""
    tokens, fields = prompts(8, PROMPT + 16, seed=11), dict(early_exit=rule)
    fields["exit_threshold"] = model.middle[rule]
    b, K = tokens.shape[0], model.config.num_loops
    with configured(model, **fields):
        got = model.decode_async(tokens[:, :PROMPT], forced=tokens[:, PROMPT:], kv_policy=policy)
    exits = got.exit_loops
    assert got.cache.loop_applications == b * PROMPT * K + int(exits.sum())
    assert got.steps == int(exits.sum(1).max())
    assert got.steps >= -(-int(exits.sum()) // b)
    step_max = synchronous(model, tokens, policy, **fields)[1].max(0).values
    assert got.steps <= int(step_max.sum())
    one_row_always_deepest = bool((exits == step_max).all(1).any())
    assert (got.steps == int(step_max.sum())) == one_row_always_deepest
    assert torch.equal(got.cache.exit_loops[-1], exits)
    assert got.cache.length == tokens.shape[1]


@pytest.mark.parametrize("policy", ["copy", "share"])
def test_a_row_that_has_fed_its_tokens_leaves_the_step(model, policy):
    """Counted: step n runs the rows whose summed exit loops reach n, and no other (a loop on
    fewer rows costs less even where it costs mostly its weights)."""
    tokens, fields = prompts(8, PROMPT + 16, seed=11), dict(early_exit="gate")
    fields["exit_threshold"] = model.middle["gate"]
    sizes = []
    hook = model.layers[0].register_forward_pre_hook(lambda _, args: sizes.append(len(args[0])))
    try:
        with configured(model, **fields):
            got = model.decode_async(
                tokens[:, :PROMPT], forced=tokens[:, PROMPT:], kv_policy=policy
            )
    finally:
        hook.remove()
    summed = got.exit_loops.sum(1)
    assert len(set(summed.tolist())) > 1, summed
    decoding = sizes[-got.steps :]
    assert decoding == [int((summed >= n).sum()) for n in range(1, got.steps + 1)]


class Gathers(TorchDispatchMode):
    """Counts the slot gathers (index_select) run under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket is torch.ops.aten.index_select
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["copy", "share"])
def test_rows_at_one_loop_read_their_slots_in_place(model, policy):
    """Counted: while every row of the batch reads one slot (none exits early, or `share`) a
    layer's slots are read as a view; rows at different loops under `copy`, or fewer rows than
    the batch (some have left), are gathered, once a layer."""
    prompt, L, sizes = prompts(4), len(model.layers), []
    hook = model.layers[0].register_forward_pre_hook(lambda _, a: sizes.append(len(a[0])))
    try:
        for threshold in (NEVER["gate"], model.middle["gate"]):
            sizes.clear()
            with configured(model, early_exit="gate", exit_threshold=threshold), Gathers() as seen:
                got = model.decode_async(prompt, 6, kv_policy=policy)
            in_step = sizes[-got.steps :]
            if threshold == NEVER["gate"] or policy == "share":
                assert seen.count == L * sum(size < len(prompt) for size in in_step), in_step
            else:
                assert len(got.exit_loops.unique()) > 1 and seen.count > 0
    finally:
        hook.remove()


def test_recompute_and_bad_arguments_are_refused(model):
    with configured(model, early_exit="gate", exit_threshold=model.middle["gate"]):
        with pytest.raises(ValueError, match="runs copy, share; decode recompute with generate"):
            model.decode_async(prompts(2), 4, kv_policy="recompute")
        with pytest.raises(ValueError, match="give new_tokens"):
            model.decode_async(prompts(2))


def test_a_row_that_emits_the_end_token_stops_there(model):
    """eos_token_id: the row that picks it runs no more steps and is filled with it; the
    other rows are unchanged."""
    prompt = prompts(3, seed=4)
    with configured(model, early_exit="gate", exit_threshold=model.middle["gate"]):
        free = model.decode_async(prompt, 8, kv_policy="copy")
        eos = int(free.tokens[0, 3])
        ended = model.decode_async(prompt, 8, kv_policy="copy", eos_token_id=eos)
    for row in range(3):
        tokens = free.tokens[row].tolist()
        stop = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert ended.tokens[row].tolist() == tokens[:stop] + [eos] * (len(tokens) - stop)
        assert torch.equal(ended.exit_loops[row, : stop - 1], free.exit_loops[row, : stop - 1])
        assert bool((ended.exit_loops[row, stop - 1 :] == 0).all())  # fed nothing after
    K, (b, P) = model.config.num_loops, prompt.shape
    assert ended.cache.loop_applications == K * P * b + ended.exit_loops.sum().item()
    assert ended.cache.loop_applications < free.cache.loop_applications


def test_left_padded_rows_decode_as_each_row_alone(model):
    """Left padding: a row's rope positions count its tokens only and its pads are masked."""
    long, short = prompts(1, 9, seed=5), prompts(1, 5, seed=6)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    fields = dict(early_exit="gate", exit_threshold=model.middle["gate"])
    with configured(model, **fields):
        got = model.decode_async(batch, 8, attention_mask=mask, kv_policy="copy")
    for row, prompt in enumerate((long, short)):
        cache = LoopCache("copy")
        alone, alone_logits = greedy(model, prompt, 8, cache, **fields)
        assert torch.equal(got.tokens[row], alone[0, prompt.shape[1] :])
        assert torch.equal(got.exit_loops[row], torch.cat(cache.exit_loops[1:], 1)[0])
        assert close(got.logits[row], alone_logits[1:, 0])
    with pytest.raises(ValueError, match="pad prompts on the left"):
        model.decode_async(batch, 4, attention_mask=mask.flip(1))


@pytest.fixture(scope="module", params=list(get_args(ReadoutMode)))
def each_readout(request):
    """A tiny export of every readout modes.py names (a new one is covered unedited)."""
    hf = tiny_export(seed=5, readout=request.param, exit_gate=True, tie_embeddings=False)
    hf.middle = middle_thresholds(hf)
    return hf


@pytest.mark.parametrize("policy", ["copy", "share", "recompute"])
def test_every_readout_decodes_alike_in_every_decoder(each_readout, policy):
    """Under the margin rule (which reads every row's logits at its own loop), the asynchronous
    decoder's logits and exits are the synchronous path's for every readout; under `recompute`
    (synchronous only) the synchronous path is the no-cache forward with the same exits."""
    model, fields = each_readout, dict(early_exit="margin")
    fields["exit_threshold"] = model.middle["margin"]
    tokens = prompts(4, PROMPT + 10, seed=4)
    logits, exit_loops = synchronous(model, tokens, policy, **fields)
    assert len(exit_loops.unique()) >= 2, exit_loops
    if policy == "recompute":
        with configured(model, **fields), torch.no_grad():
            reference = model(tokens, use_cache=False)
        assert torch.equal(exit_loops, reference.exit_loops[:, PROMPT:])
        assert close(logits, reference.logits[:, PROMPT:])
        return
    with configured(model, **fields):
        forced = model.decode_async(tokens[:, :PROMPT], forced=tokens[:, PROMPT:], kv_policy=policy)
    assert torch.equal(forced.exit_loops, exit_loops)
    assert close(forced.logits, logits)
