"""Early exit in the exported model's cached forward: a token that exits at loop k runs no loop
after k, under each exit rule and KV policy, at batch 1 and 8, on megaloop's own readouts and on
an Ouro-architecture model (sandwich norms, shared loop norm, exit gate)."""

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from megaloop.evaluation.generate_bench import configured
from megaloop.model.decoding import LoopCache
from support import MODELS, exit_model, greedy, left_padded, prompts, teacher_forced

NEVER = {"gate": 1.01, "margin": float("inf"), "confidence": 1.01}
AT_ONE = {"gate": 0.0, "margin": 0.0, "confidence": 0.0}
BATCH, PROMPT, NEW = 8, 6, 8


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return exit_model(request.param)


def ce(logits, tokens) -> float:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item()


def decode(model, policy: str, decoder: str, rule: str = "gate", rows=slice(None)):
    """Greedy decoding of NEW tokens after prompts(BATCH, PROMPT), at the rule's middle threshold,
    by the synchronous decoder (generate: one token a forward, loop k run by the rows still
    open) or the depth-asynchronous one (each row at its own loop): the LoopCache and the exit
    loops [BATCH, NEW - 1] of the tokens fed after the prompt (the last new token is not fed),
    which sit at cache positions PROMPT, PROMPT + 1, ... (`rows`: of those prompts)."""
    prompt = prompts(BATCH, PROMPT)[rows]
    fields = dict(early_exit=rule, exit_threshold=model.middle[rule])
    if decoder == "sync":
        cache = LoopCache(policy)
        greedy(model, prompt, NEW, cache, **fields)
        return cache, torch.cat(cache.exit_loops[1:], 1)
    with configured(model, **fields):
        out = model.decode_async(prompt, NEW, kv_policy=policy)
    return out.cache, out.exit_loops


@contextmanager
def stack_inputs(model):
    """A one-item list: how many token positions have entered the stack's first layer (one a
    token a loop), counted by a hook, apart from the cache's own counters."""
    counted = [0]

    def count(layer, args):
        counted[0] += args[0].shape[0] * args[0].shape[1]

    handle = model.layers[0].register_forward_pre_hook(count)
    try:
        yield counted
    finally:
        handle.remove()


@pytest.mark.parametrize("policy", ["copy", "recompute"])
@pytest.mark.parametrize("rule", ["gate", "margin", "confidence"])
def test_never_exiting_is_fixed_k_max_and_exiting_at_once_is_k_1(model, rule, policy):
    """Bitwise on CPU fp32: the exiting path computes what the full-depth cached path does."""
    prompt = prompts(1)
    K = model.config.num_loops
    tokens, logits = greedy(model, prompt, early_exit="none")
    cache = LoopCache(policy)
    got = greedy(model, prompt, cache=cache, early_exit=rule, exit_threshold=NEVER[rule])
    assert torch.equal(got[0], tokens) and torch.equal(got[1], logits)
    assert all(bool((e == K).all()) for e in cache.exit_loops)

    tokens, logits = greedy(model, prompt, early_exit="none", num_loops=1)
    cache = LoopCache(policy)
    got = greedy(model, prompt, cache=cache, early_exit=rule, exit_threshold=AT_ONE[rule])
    assert torch.equal(got[0], tokens) and torch.equal(got[1], logits)
    decoded = torch.cat(cache.loops_run[1:], 1)
    assert bool((decoded == 1).all())  # the prompt ran at full depth, each new token once


@pytest.mark.parametrize("policy", ["copy", "share", "recompute"])
@pytest.mark.parametrize("rule", ["gate", "margin"])
def test_counted_loop_applications_are_the_sum_of_exits(model, rule, policy):
    """What a benchmark divides by: every application of the stack to a token is counted, and
    (copy, share) they are the prompt's full depth plus each new token's exit loop; recompute's
    catch-up of earlier tokens comes on top. The cache's measured bytes per token are the model's
    stated figure for the policy."""
    prompt, K = prompts(8), model.config.num_loops
    cache = LoopCache(policy)
    greedy(model, prompt, 8, cache, early_exit=rule, exit_threshold=model.middle[rule])
    prefill, decoded = cache.exit_loops[0], torch.cat(cache.exit_loops[1:], 1)
    assert len(decoded.unique()) >= 3, decoded  # rows and steps exit at different loops
    assert torch.equal(torch.cat(cache.loops_run[1:], 1), decoded)
    exits = prompt.numel() * K + int(decoded.sum())
    if policy == "recompute":
        assert cache.loop_applications >= exits
    else:
        assert cache.loop_applications == exits
    assert 1 <= int(prefill.min()) and int(prefill.max()) <= K
    assert cache.bytes_per_token() == model.cache_bytes_per_token(policy)


@pytest.mark.parametrize("decoder", ["sync", "async"])
@pytest.mark.parametrize("policy", ["copy", "share"])
@pytest.mark.parametrize("rule", ["gate", "margin"])
def test_a_token_runs_no_loop_after_its_exit(model, rule, policy, decoder):
    """Counted where the stack is entered, not by the cache: the prompt runs at full depth
    (PROMPT·K a row). Depth-asynchronously each fed token runs its exit loop's loops, no more:
    BATCH·PROMPT·K + Σ exit loops, where running every loop would be BATCH·(PROMPT + NEW - 1)·K.
    Synchronously a row alone does the same, and a batch runs in lockstep every row through its
    deepest token's loops at each step (masked: the exited ones' results are held). The cache
    counts each token's own loops."""
    K = model.config.num_loops
    with stack_inputs(model) as counted:
        cache, exits = decode(model, policy, decoder, rule)
    assert int((exits < K).sum()) >= exits.numel() // 4, exits  # early exits do happen
    assert cache.loop_applications == BATCH * PROMPT * K + int(exits.sum())
    if decoder == "async":
        assert counted[0] == cache.loop_applications
        return
    assert counted[0] == BATCH * PROMPT * K + BATCH * int(exits.max(0).values.sum())
    alone = []
    for row in range(3):
        with stack_inputs(model) as counted:
            cache, exits = decode(model, policy, decoder, rule, rows=slice(row, row + 1))
        assert counted[0] == PROMPT * K + int(exits.sum())
        alone.append(exits)
    assert bool((torch.cat(alone) < K).any())  # alone, a row does stop early


@pytest.mark.parametrize("decoder", ["sync", "async"])
@pytest.mark.parametrize("policy", ["copy", "share"])
def test_the_cache_holds_what_its_kv_policy_says(model, policy, decoder):
    """On the cache's tensors after a decode with early exits. `share`: one slot a layer (not
    one a loop and layer), a prompt token's holding its last loop's keys and values (the
    fixed-K forward's loop K). `copy`: a slot a loop and layer, a prompt token's own at every
    loop (the fixed-K forward's), and a fed token that exits at loop e < K has loop e's keys and
    values in every deeper loop's slot."""
    K, L = model.config.num_loops, model.config.num_hidden_layers
    cache, exits = decode(model, policy, decoder)
    assert int((exits < K).sum()) >= exits.numel() // 4, exits
    loops = 1 if policy == "share" else K
    assert len(cache.keys) == len(cache.values) == loops * L
    with torch.no_grad():
        fixed = model(prompts(BATCH, PROMPT), use_cache=True).past_key_values.layers
    for i, layer in enumerate(fixed[-loops * L :]):
        assert torch.equal(cache.keys[i][:, :, :PROMPT], layer.keys), i
        assert torch.equal(cache.values[i][:, :, :PROMPT], layer.values), i
    if policy == "copy":
        slots = [torch.stack(t).unflatten(0, (K, L)) for t in (cache.keys, cache.values)]
        for row, col in (exits < K).nonzero().tolist():
            e = int(exits[row, col])
            for kv in slots:
                token = kv[:, :, row, :, PROMPT + col]  # [K, L, kv_heads, head_dim]
                assert bool(token[e - 1].abs().sum() > 0)
                assert torch.equal(token[e:], token[e - 1 : e].expand_as(token[e:])), (row, col)


@pytest.mark.parametrize("rule", ["gate", "margin"])
def test_recompute_teacher_forced_ce_equals_the_no_cache_forward(model, rule):
    """Recompute fills the slots a token skipped when a later token needs them, so its
    teacher-forced logits are the no-cache forward's with the same exits; copy and share pay a
    CE cost, printed (`-s`), not assumed."""
    tokens = prompts(2, length=24, seed=1)
    fields = dict(early_exit=rule, exit_threshold=model.middle[rule])
    with configured(model, **fields), torch.no_grad():
        reference = model(tokens, use_cache=False)
    assert len(reference.exit_loops.unique()) >= 3
    cache = LoopCache("recompute")
    logits = teacher_forced(model, tokens, cache, **fields)
    assert torch.equal(torch.cat(cache.exit_loops, 1), reference.exit_loops)
    assert cache.loop_applications > int(reference.exit_loops.sum())  # catch-up happened
    assert ((logits - reference.logits).abs().max() / reference.logits.abs().max()).item() <= 1e-5
    assert abs(ce(logits, tokens) - ce(reference.logits, tokens)) <= 1e-5
    for policy in ("copy", "share"):
        cache = LoopCache(policy)
        cost = ce(teacher_forced(model, tokens, cache, **fields), tokens) - ce(
            reference.logits, tokens
        )
        mean = torch.cat(cache.exit_loops, 1).float().mean().item()
        print(f"{rule} {policy}: CE - recompute's CE = {cost:+.5f}, mean exit loop {mean:.2f}")


@pytest.mark.parametrize("policy", ["copy", "share", "recompute"])
@pytest.mark.parametrize("rule", ["gate", "margin"])
def test_a_batch_decodes_each_row_as_it_would_alone(model, rule, policy):
    """Rows of a batch exit at different loops, and each loop runs the rows still active only:
    every row's tokens, logits and exit loops are what it gets alone at batch 1."""
    prompt, fields = prompts(8, seed=2), dict(early_exit=rule, exit_threshold=model.middle[rule])
    cache = LoopCache(policy)
    tokens, logits = greedy(model, prompt, 6, cache, **fields)
    exit_loops = torch.cat(cache.exit_loops[1:], 1)
    assert any(len(step.unique()) > 1 for step in cache.exit_loops[1:])
    for row in range(len(prompt)):
        alone_cache = LoopCache(policy)
        alone, alone_logits = greedy(model, prompt[row : row + 1], 6, alone_cache, **fields)
        assert torch.equal(tokens[row], alone[0])
        assert torch.equal(exit_loops[row], torch.cat(alone_cache.exit_loops[1:], 1)[0])
        ref = alone_logits[:, 0]
        assert ((logits[:, row] - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_bad_cache_input_names_the_fix(model):
    with pytest.raises(ValueError, match="kv_policy='keep': use one of copy, share, recompute"):
        LoopCache("keep")
    prompt = prompts(1)
    with configured(model, early_exit="gate"), torch.no_grad():
        filled = model(prompt, use_cache=True, kv_policy="share").past_key_values
        assert filled.kv_policy == "share"
        with pytest.raises(ValueError, match="filled under 'share'"):
            model(prompt[:, :1], past_key_values=filled, kv_policy="copy")
        with pytest.raises(ValueError, match="start a new cache"):
            model(prompt[:, :1], past_key_values=filled, num_loops=2)
    with torch.no_grad():
        dynamic = model(prompt, use_cache=True).past_key_values
    with configured(model, early_exit="gate"), torch.no_grad():
        with pytest.raises(ValueError, match="pass past_key_values=LoopCache"):
            model(prompt[:, :1], past_key_values=dynamic)


@pytest.mark.parametrize("policy", ["copy", "recompute"])
def test_a_prompt_may_exit_early_too(model, policy):
    """`prefill_exit`: the prompt's tokens exit as decoded ones do, in one forward. Recompute
    still gives the no-cache forward; copy runs each token to its exit loop only."""
    tokens, fields = prompts(2, length=12, seed=4), dict(early_exit="gate")
    with configured(model, exit_threshold=model.middle["gate"], **fields), torch.no_grad():
        reference = model(tokens, use_cache=False)
        cache = LoopCache(policy)
        out = model(tokens, past_key_values=cache, prefill_exit=True)
    assert torch.equal(out.exit_loops, reference.exit_loops)
    assert len(out.exit_loops.unique()) >= 3
    if policy == "recompute":
        assert ((out.logits - reference.logits).abs().max() / reference.logits.abs().max()) <= 1e-5
    else:
        assert cache.loop_applications == int(out.exit_loops.sum())


def generate_padded(model, batch, mask, cache):
    """Six greedy tokens of the left-padded `batch` (pads: id 0), through `cache`."""
    return model.generate(
        batch,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        past_key_values=cache,
    )


def test_left_padded_rows_exit_as_each_row_alone(model):
    """Padding is masked in the gathered attention as in the full-depth path."""
    long, short, batch, mask = left_padded()
    fields = dict(early_exit="gate", exit_threshold=model.middle["gate"])
    with configured(model, **fields), torch.no_grad():
        cache = LoopCache("copy")
        out = generate_padded(model, batch, mask, cache)
    for row, prompt, pad in ((0, long, 0), (1, short, 4)):
        alone_cache = LoopCache("copy")
        alone = greedy(model, prompt, 6, alone_cache, **fields)[0]
        assert out[row, pad:].tolist() == alone[0].tolist()
        exits = torch.cat(cache.exit_loops[1:], 1)[row]
        assert torch.equal(exits, torch.cat(alone_cache.exit_loops[1:], 1)[0])


def test_the_kv_policy_is_chosen_at_load_or_per_call(model):
    with configured(model, early_exit="margin", kv_policy="share"), torch.no_grad():
        out = model.generate(
            prompts(1),
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
        assert isinstance(out.past_key_values, LoopCache)
        assert out.past_key_values.kv_policy == "share"
        assert model(prompts(1), kv_policy="recompute").past_key_values.kv_policy == "recompute"


@pytest.mark.parametrize("policy", ["copy", "recompute"])
def test_beam_search_reorders_the_rows(model, policy):
    """Beam search moves the cache's rows with their beams: never exiting, it is fixed K's."""
    fields = dict(do_sample=False, num_beams=3, max_new_tokens=5, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(prompts(2), **fields)
        with configured(model, early_exit="gate", exit_threshold=NEVER["gate"]):
            got = model.generate(prompts(2), past_key_values=LoopCache(policy), **fields)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("policy", ["copy", "share", "recompute"])
def test_a_prompts_last_token_runs_one_rule_alone_or_batched(model, policy):
    """A prompt is prefilled at full depth whatever its length: a one-token prompt alone runs
    as it does left-padded in a batch (it used to exit early alone). Prompts of 1, 2 and 7
    tokens: each row's tokens and exit loops, batched (sync; async too where the policy allows
    it), are its own alone."""
    g = torch.Generator().manual_seed(11)
    lengths = (1, 2, 7)
    rows = [torch.randint(1, 64, (1, n), generator=g) for n in lengths]
    width = max(lengths)
    batch = torch.cat([F.pad(r, (width - r.shape[1], 0)) for r in rows])
    mask = torch.cat([F.pad(torch.ones_like(r), (width - r.shape[1], 0)) for r in rows])
    fields = dict(early_exit="margin", exit_threshold=model.middle["margin"])
    with configured(model, **fields), torch.no_grad():
        cache = LoopCache(policy)
        out = generate_padded(model, batch, mask, cache)
        decoded = None
        if policy != "recompute":
            decoded = model.decode_async(batch, 6, attention_mask=mask, kv_policy=policy)
    for i, prompt in enumerate(rows):
        alone_cache = LoopCache(policy)
        alone = greedy(model, prompt, 6, alone_cache, **fields)[0]
        assert bool((alone_cache.loops_run[0] == model.config.num_loops).all()), lengths[i]
        assert out[i, width:].tolist() == alone[0, prompt.shape[1] :].tolist(), lengths[i]
        exits = torch.cat(cache.exit_loops[1:], 1)[i]
        assert torch.equal(exits, torch.cat(alone_cache.exit_loops[1:], 1)[0]), lengths[i]
        if decoded is not None:
            assert decoded.tokens[i].tolist() == alone[0, prompt.shape[1] :].tolist()
