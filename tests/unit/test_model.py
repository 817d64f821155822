"""The looped model: variable depth, the clamp, recurrence modes, and the K=1 baseline."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import build
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
        position_embedding_type="rope",
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
def test_k1_norm_readout_is_an_ordinary_pre_norm_gpt(tiny_cfg, attention, tie):
    cfg = dataclasses.replace(tiny_cfg, num_loops=1, tie_embeddings=tie, attention=attention)
    looped = build(cfg)
    gpt = gpt_reference(cfg, looped)
    x = tokens(cfg)
    with torch.no_grad():
        ours = looped(x).logits[0]
        ref = gpt(x, position_ids=None, attention_mask=None)  # [b, s, V]
    torch.testing.assert_close(ours.transpose(0, 1), ref, rtol=1e-5, atol=1e-5)
