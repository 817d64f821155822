"""The looped model: variable depth, the clamp, recurrence modes, and the K=1 baseline."""

import dataclasses
from typing import get_args

import pytest
import torch
import torch.nn.functional as F

from conftest import build
from megaloop.model.modes import RecurrenceMode
from megaloop.model.semantics import rms


def tokens(cfg, b=2, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (b, s), generator=g)


def test_model_trained_at_k4_runs_at_k1_and_k8(tiny_cfg):
    model = build(tiny_cfg)
    x = tokens(tiny_cfg)
    with torch.no_grad():
        out1, out4, out8 = (model(x, num_loops=k) for k in (1, 4, 8))
    assert [len(o.logits) for o in (out1, out4, out8)] == [1, 4, 8]
    assert out8.logits[0].shape == (16, 2, tiny_cfg.vocab_size)
    # the first loops do not depend on how many follow (the norm readout is the same at every k)
    torch.testing.assert_close(out8.logits[3], out4.logits[3])
    torch.testing.assert_close(out8.logits[0], out1.logits[0])


def test_clamp_holds_every_loop_at_the_loop1_rms(tiny_cfg):
    model = build(tiny_cfg)
    x = tokens(tiny_cfg)
    with torch.no_grad():
        free = model(x, num_loops=6)
        clamped = model(x, num_loops=6, clamp=True)
    ref = rms(clamped.hidden[0])
    for h in clamped.hidden[1:]:
        torch.testing.assert_close(rms(h), ref, rtol=1e-5, atol=0)
    # without the clamp the recurrence changes the scale
    assert (rms(free.hidden[-1]) / rms(free.hidden[0])).mean() > 1.5


@pytest.mark.parametrize(
    "mode, shape",
    [("none", "channel"), ("rmsnorm", "channel"), ("damping", "channel"), ("damping", "scalar")],
)
def test_recurrence_modes_feed_back_what_they_say(tiny_cfg, mode, shape):
    model = build(
        dataclasses.replace(tiny_cfg, recurrence=mode, damping_init=0.5, damping_shape=shape)
    )
    h = 5.0 * torch.randn(16, 2, tiny_cfg.hidden_size)
    fed = model.recurrence(h)
    if mode == "none":
        assert torch.equal(fed, h)
    elif mode == "rmsnorm":
        torch.testing.assert_close(rms(fed), torch.ones_like(rms(fed)), rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(fed, 0.5 * h)
        assert model.recurrence.damping_logit.requires_grad
        assert model.recurrence.damping_logit.numel() == (1 if shape == "scalar" else 32)


def rmsnorm_by_hand(h, weight, eps):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight


def fed_back_by_hand(model, h):
    """What loop k+1 should receive from H_k, written out from the model's parameters: R(H_k),
    or under loop_norm=shared the shared norm's N(H_k)."""
    eps = model.cfg.norm_eps
    if model.cfg.loop_norm == "shared":
        return rmsnorm_by_hand(h, model.loop_norm.weight, eps)
    return {
        "none": lambda: h,
        "rmsnorm": lambda: rmsnorm_by_hand(h, model.recurrence.norm.weight, eps),
        "damping": lambda: h * torch.sigmoid(model.recurrence.damping_logit),
    }[model.cfg.recurrence]()


@pytest.mark.parametrize(
    "change",
    [
        *({"recurrence": mode} for mode in get_args(RecurrenceMode)),
        {"recurrence": "damping", "damping_shape": "scalar"},
        {"loop_norm": "shared"},
    ],
    ids=lambda change: ",".join(f"{k}={v}" for k, v in change.items()),
)
def test_the_forward_feeds_each_loop_r_of_the_last_loops_output(tiny_cfg, change):
    """The shared stack's input at loop k+1 is R(H_k) (N(H_k) under loop_norm=shared): the
    training forward applies the recurrence, not only owns it. Its parameters start away from
    the identity (norm weights and damping logits in [0.5, 1.5]), so a skipped R shows."""
    model = build(dataclasses.replace(tiny_cfg, **change))
    feedback = [*model.recurrence.parameters()]
    if model.loop_norm is not None:
        feedback += model.loop_norm.parameters()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in feedback:
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=g))
    entered = []  # the first layer of the stack runs once a loop
    model.layers[0].register_forward_pre_hook(lambda layer, args: entered.append(args[0].clone()))
    x = tokens(tiny_cfg)
    with torch.no_grad():
        out = model(x, labels=x)
    assert len(entered) == tiny_cfg.num_loops
    for k in range(1, tiny_cfg.num_loops):
        expected = fed_back_by_hand(model, out.hidden[k - 1])
        torch.testing.assert_close(entered[k], expected, rtol=1e-6, atol=1e-7)


def test_exit_gate_gives_one_lambda_per_token_and_loop(tiny_cfg):
    model = build(dataclasses.replace(tiny_cfg, exit_gate=True))
    x = tokens(tiny_cfg)
    out = model(x, labels=x)
    assert len(out.gates) == 4 and out.gates[0].shape == x.shape
    assert ((out.gates[0] > 0) & (out.gates[0] < 1)).all()


@pytest.mark.parametrize("reads", ["normed", "raw"])
def test_exit_gate_reads_the_scale_free_direction_unless_raw(tiny_cfg, reads):
    """By default λ_k depends on H_k/‖H_k‖_rms only: the exit-weighted objective gets no path
    through the gate by which CE could see hidden scale (`raw` keeps that path, an ablation)."""
    choice = {} if reads == "normed" else {"exit_gate_input": reads}  # normed is the default
    model = build(dataclasses.replace(tiny_cfg, exit_gate=True, **choice))
    torch.nn.init.normal_(model.exit_gate.proj.weight, std=0.5)
    # RMS 30: RMSNorm's eps (1e-5) changes a normalised H by < 1e-6 relative even at c = 0.1
    h = 30.0 * torch.randn(16, 2, tiny_cfg.hidden_size, dtype=torch.float64)
    gate = model.exit_gate.double()
    with torch.no_grad():
        base = gate(h)
        for c in (0.1, 10.0, 1e3):
            if reads == "normed":
                torch.testing.assert_close(gate(c * h), base, rtol=1e-5, atol=1e-6)
            else:
                assert (gate(c * h) - base).abs().max() > 1e-2
    assert sum(p.numel() for p in gate.parameters()) == tiny_cfg.hidden_size + 1


def test_ouros_shared_loop_norm_feeds_the_next_loop_the_gate_and_the_readout(tiny_cfg):
    """loop_norm=shared: one norm N after every loop; loop k+1 runs on N(H_k), λ_k and the
    normalised exit read N(H_k); sandwich layers hold four norms each."""
    cfg = dataclasses.replace(tiny_cfg, loop_norm="shared", layer_norms="sandwich", exit_gate=True)
    model = build(cfg)
    with torch.no_grad():
        model.loop_norm.weight.uniform_(0.5, 1.5)
        torch.nn.init.normal_(model.exit_gate.proj.weight, std=0.5)
    x = tokens(cfg)
    with torch.no_grad():
        out = model(x, num_loops=2)
        normed = model.loop_norm(out.hidden[0])
        torch.testing.assert_close(
            model.stack(normed, model.rotary_pos_emb(x.shape[1])), out.hidden[1]
        )
        gate = torch.sigmoid(model.exit_gate.proj(normed)).squeeze(-1).t()
        torch.testing.assert_close(out.gates[0], gate)
        w_out = model.shared_embedding_or_output_weight()  # tied in tiny_cfg
        torch.testing.assert_close(out.logits[0], model.readout.output_layer(normed, w_out)[0])
    assert model.readout.norm is None and model.recurrence.mode == "none"
    norms = [n for n, _ in model.named_parameters() if n.startswith("layers.0.") and "norm" in n]
    assert len(norms) == 4, norms


@pytest.mark.parametrize(
    "change, key",
    [({"recurrence": "rmsnorm"}, "recurrence"), ({"exit_gate_input": "raw"}, "exit_gate_input")],
)
def test_shared_loop_norm_refuses_a_second_inter_loop_norm_or_a_raw_gate(tiny_cfg, change, key):
    from megaloop.config import ConfigError

    with pytest.raises(ConfigError, match=key):
        dataclasses.replace(tiny_cfg, loop_norm="shared", **change).validate("model.")


def test_labels_give_per_token_ce_equal_to_torch_cross_entropy(tiny_cfg):
    model = build(tiny_cfg)
    x = tokens(tiny_cfg)
    with torch.no_grad():
        logits = model(x).logits
        ce = model(x, labels=x).token_ce
    for lg, c in zip(logits, ce):
        ref = F.cross_entropy(lg.transpose(0, 1).flatten(0, 1), x.flatten(), reduction="none")
        torch.testing.assert_close(c.flatten(), ref, rtol=1e-5, atol=1e-5)


def gpt_reference(cfg, looped):
    """megatron-core's own GPTModel (local spec, DotProductAttention) with the looped model's
    weights: at K=1 with a norm readout the looped model is exactly this pre-norm GPT."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    gpt = GPTModel(
        looped.config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_seq_len,
        position_embedding_type={"rope": "rope", "learned": "learned_absolute"}[
            cfg.position_embedding
        ],
        share_embeddings_and_output_weights=cfg.tie_embeddings,
    )
    state = {}
    for k, v in looped.state_dict().items():
        if "_extra_state" in k:
            continue
        k = k.replace("layers.", "decoder.layers.", 1) if k.startswith("layers.") else k
        k = k.replace("readout.norm.", "decoder.final_layernorm.")
        k = k.replace("readout.output_layer.", "output_layer.")
        state[k] = v
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "_extra_state" not in m]
    return gpt


# megatron-core's stock GPT layer spec builds its MLP without ffn_hidden_size, and says so
@pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning")
@pytest.mark.parametrize("attention", ["sdpa", "megatron"])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_k1_norm_readout_is_an_ordinary_pre_norm_gpt(tiny_cfg, attention, tie, positions):
    cfg = dataclasses.replace(
        tiny_cfg,
        num_loops=1,
        tie_embeddings=tie,
        attention=attention,
        position_embedding=positions,
        init="pytorch" if positions == "learned" else "megatron",
    )
    looped = build(cfg)
    gpt = gpt_reference(cfg, looped)
    x = tokens(cfg)
    position_ids = torch.arange(x.shape[1]).expand_as(x) if positions == "learned" else None
    with torch.no_grad():
        ours = looped(x).logits[0]
        ref = gpt(x, position_ids=position_ids, attention_mask=None)  # [b, s, V]
    torch.testing.assert_close(ours.transpose(0, 1), ref, rtol=1e-5, atol=1e-5)


def test_learned_positions_are_a_table_added_to_h0_and_rope_is_off(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, position_embedding="learned", max_seq_len=16)
    model = build(cfg)
    assert model.rotary_pos_emb is None and model.rotary(16) is None
    table = model.embedding.position_embeddings.weight
    assert table.shape == (16, cfg.hidden_size)
    x = tokens(cfg, s=16)
    h0 = model.enter(x, 1)  # [s, b, d]
    expected = model.embedding.word_embeddings(x) + table[None]
    torch.testing.assert_close(h0, expected.transpose(0, 1))
    # the same token at two positions reads two rows of the table
    same = torch.full((1, 2), 3)
    h = model.enter(same, 1)
    torch.testing.assert_close(h[1, 0] - h[0, 0], table[1] - table[0])


def params_of(cfg) -> dict:
    return dict(build(cfg).named_parameters())


WIDE = dict(vocab_size=512, hidden_size=64, max_seq_len=256, position_embedding="learned")
"""The tiny model with tables large enough for their initial statistics to be measured."""


def test_pytorch_init_is_pytorchs_module_defaults(tiny_cfg):
    """N(0, 1) embeddings (token, position), U(±1/√fan_in) for every linear with the fan-in of
    the full matrix (the fused qkv and fc1 are d wide, fc2 ffn wide), the gate's bias too."""
    cfg = dataclasses.replace(
        tiny_cfg, **WIDE, init="pytorch", exit_gate=True, tie_embeddings=False
    )
    params = params_of(cfg)
    for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
        assert params[name].mean().abs() < 0.02 and abs(params[name].std() - 1) < 0.02, name
    fan_ins = {
        "linear_qkv.weight": 64,
        "linear_proj.weight": 64,
        "linear_fc1.weight": 64,
        "linear_fc2.weight": 256,
        "output_layer.weight": 64,
        "exit_gate.proj.weight": 64,
        "exit_gate.proj.bias": 64,
    }
    seen = set()
    for name, p in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        fan_in = next((f for suffix, f in fan_ins.items() if name.endswith(suffix)), None)
        if fan_in is None:
            continue
        seen.add(next(s for s in fan_ins if name.endswith(s)))
        bound = fan_in**-0.5
        assert p.abs().max() <= bound, name
        if p.numel() >= 4096:  # a uniform on [-b, b]: std b/√3, and it reaches near its ends
            assert abs(p.std() / (bound / 3**0.5) - 1) < 0.03, name
            assert p.abs().max() > 0.99 * bound, name
    assert seen == set(fan_ins)


def test_megatron_init_and_the_embedding_std_override(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, **WIDE)
    params = params_of(cfg)
    assert abs(params["embedding.word_embeddings.weight"].std() / 0.02 - 1) < 0.03
    assert abs(params["embedding.position_embeddings.weight"].std() / 0.02 - 1) < 0.03
    out = params["layers.0.mlp.linear_fc2.weight"].std()
    assert abs(out / (0.02 / (2 * cfg.num_layers) ** 0.5) - 1) < 0.05
    unit = params_of(dataclasses.replace(cfg, embedding_init_std=1.0))
    assert abs(unit["embedding.word_embeddings.weight"].std() - 1) < 0.03
    for name, p in unit.items():  # only the token embedding changed
        if name != "embedding.word_embeddings.weight":
            assert torch.equal(p, params[name]), name


def test_embedding_std_override_takes_effect_under_pytorch_init(tiny_cfg):
    """model.embedding_init_std sets the token embedding's std under init=pytorch too (the
    position table stays N(0, 1)). 512 x 64 = 32768 draws: a sample std's relative standard
    error is 1/sqrt(2n) = 0.0039, so a 3% band is ~7.7 of them, and N(0, 1) (the break) is 10x."""
    std = 0.1
    cfg = dataclasses.replace(tiny_cfg, **WIDE, init="pytorch", embedding_init_std=std)
    params = params_of(cfg)
    word = params["embedding.word_embeddings.weight"]
    assert word.numel() == 512 * 64
    assert abs(word.std().item() / std - 1) < 0.03
    assert word.mean().abs() < 5 * std / word.numel() ** 0.5
    position = params["embedding.position_embeddings.weight"]
    assert abs(position.std().item() - 1) < 0.03
    bound = 64**-0.5  # the linears keep pytorch's U(+-1/sqrt(fan_in))
    assert params["layers.0.self_attention.linear_qkv.weight"].abs().max() <= bound


def test_dropout_falls_where_the_study_puts_it(tiny_cfg, caplog):
    """p on H_0 and on each FFN output (dropped units: zero, kept ones scaled by 1/(1 − p)); the
    attention output is added to the residual whole; attention probabilities are dropped out
    in training only; evaluation is the model without dropout."""
    p = 0.5
    cfg = dataclasses.replace(tiny_cfg, hidden_size=64, dropout=p, num_layers=1)
    model = build(cfg)
    layer = model.layers[0]
    seen = {}

    def keep(key):
        def hook(module, args, output):
            seen.setdefault(key, []).append((args, output))

        return hook

    layer.register_forward_hook(keep("layer"))
    layer.self_attention.register_forward_hook(keep("attention"))
    layer.pre_mlp_layernorm.register_forward_hook(keep("pre_mlp"))
    layer.mlp.register_forward_hook(keep("mlp"))
    model.embedding.word_embeddings.register_forward_hook(keep("embed"))
    x = tokens(cfg, b=4, s=32)
    model.train()
    with torch.no_grad():
        model(x, num_loops=2)
    h0 = seen["layer"][0][0][0]
    embed = seen["embed"][0][1].transpose(0, 1)
    dropped = h0 == 0
    assert abs(dropped.float().mean() - p) < 0.05
    torch.testing.assert_close(h0[~dropped], embed[~dropped] / (1 - p))
    for loop in range(2):
        layer_in = seen["layer"][loop][0][0]
        attn_out, attn_bias = seen["attention"][loop][1]
        assert attn_bias is None
        mid = seen["pre_mlp"][loop][0][0]
        torch.testing.assert_close(mid, layer_in + attn_out)  # no dropout on the attention add
        mlp_out = seen["mlp"][loop][1][0]
        out = seen["layer"][loop][1][0]
        added = out - mid
        zero = added.abs() < 1e-6
        assert abs(zero.float().mean() - p) < 0.05
        torch.testing.assert_close(added[~zero], mlp_out[~zero] / (1 - p), rtol=1e-4, atol=1e-5)
    core = layer.self_attention.core_attention
    q, k, v = (torch.randn(8, 2, 4, 16) for _ in range(3))
    with torch.no_grad():
        assert not torch.equal(core(q, k, v), core(q, k, v))  # a new mask each call
        # the RNG tracker's fork on the CPU generator: no warning that it changed (it must)
        assert "RNG state changed" not in caplog.text
        model.eval()
        torch.testing.assert_close(core(q, k, v), core(q, k, v))
        without = build(dataclasses.replace(cfg, dropout=0.0)).eval()
        torch.testing.assert_close(model(x).logits[-1], without(x).logits[-1])
