"""The readout blind spot: a `norm` readout cannot see hidden-state scale, a `raw` one can."""

import dataclasses
from typing import get_args

import pytest
import torch

from conftest import build
from megaloop.model import modes, semantics
from megaloop.model.config import (
    DampingShape,
    GateInput,
    LoopNorm,
    ReadoutMode,
    RecurrenceMode,
)
from megaloop.model.configuration_megaloop import MegaloopConfig


@pytest.mark.parametrize(
    "names, rules",
    [
        (ReadoutMode, semantics.READOUTS),
        (ReadoutMode, modes.READOUT_NORMALIZES),
        (RecurrenceMode, semantics.RECURRENCES),
        (RecurrenceMode, modes.RECURRENCE_PARAMS),
        (DampingShape, modes.DAMPING_SIZE),
        (GateInput, semantics.GATE_INPUTS),
        (LoopNorm, modes.SHARES_LOOP_NORM),
    ],
)
def test_the_config_types_and_the_semantics_name_the_same_modes(names, rules):
    """A mode is one name in model/modes.py's Literal type, with what it owns there and what it
    computes in megaloop.model.semantics; the exported model's config accepts exactly those
    (tests/unit/test_export.py runs them)."""
    assert sorted(get_args(names)) == sorted(rules)


def test_the_exported_config_refuses_a_mode_the_semantics_lacks_and_names_those_it_has():
    with pytest.raises(ValueError, match="readout='scale'.*" + ", ".join(get_args(ReadoutMode))):
        MegaloopConfig(readout="scale")


@pytest.mark.parametrize("mode", get_args(ReadoutMode))
def test_every_readout_reads_its_rule_at_each_exit(tiny_cfg, mode):
    """The training model's exit k of a run of K loops is W_out·READOUTS[mode](H_k, k, K_train,
    K, its norm), at depths below, at and past K_train, as the run's last loop or not: the model
    has no readout rule of its own."""
    model = build(dataclasses.replace(tiny_cfg, readout=mode))
    w_out = model.shared_embedding_or_output_weight()
    h = 3.0 * torch.randn(8, 2, tiny_cfg.hidden_size)
    deepest = tiny_cfg.num_loops + 2
    with torch.no_grad():
        for k in (1, tiny_cfg.num_loops, deepest):
            for last in sorted({k, deepest}):
                x = semantics.readout_input(
                    mode, h, k, tiny_cfg.num_loops, last, model.readout.norm
                )
                torch.testing.assert_close(exit_logits(model, h, k, last), x @ w_out.t())


def exit_logits(model, h, loop=4, last=4):
    return model.logits(h, loop, last)


@pytest.mark.parametrize("c", [0.1, 10.0, 1e3])
def test_norm_readout_is_scale_invariant_and_raw_is_not(tiny_cfg, c):
    torch.manual_seed(0)
    h = 3.0 * torch.randn(8, 2, tiny_cfg.hidden_size)  # per-token RMS ~3, so eps=1e-5 is negligible
    norm = build(dataclasses.replace(tiny_cfg, readout="norm"))
    raw = build(dataclasses.replace(tiny_cfg, readout="raw"))
    with torch.no_grad():
        base, scaled = exit_logits(norm, h), exit_logits(norm, c * h)
        # RMSNorm(cH) = cH / sqrt(c^2 ms + eps): relative error <= eps / (c^2 ms) = 1.1e-4 at c=0.1.
        torch.testing.assert_close(scaled, base, rtol=2e-4, atol=2e-4 * base.abs().max().item())
        raw_base, raw_scaled = exit_logits(raw, h), exit_logits(raw, c * h)
        torch.testing.assert_close(
            raw_scaled, c * raw_base, rtol=1e-5, atol=1e-5 * c * raw_base.abs().max().item()
        )
        assert (raw_scaled - raw_base).abs().max() > 0.05 * raw_base.abs().max()


def test_final_norm_reads_raw_before_the_last_loop(tiny_cfg):
    model = build(dataclasses.replace(tiny_cfg, readout="final_norm"))
    h = torch.randn(8, 2, tiny_cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(2 * h, 1, 4), 2 * model.logits(h, 1, 4))
        torch.testing.assert_close(
            model.logits(2 * h, 4, 4), model.logits(h, 4, 4), rtol=1e-4, atol=1e-4
        )


def test_final_norm_exits_follow_the_trained_depth_not_the_requested_one(tiny_cfg):
    """Trained at K=4: run at K=2 its exit 2 is still raw (as trained), and run at K=8 every
    exit from loop 4 on is normalised; the logits of loop k never depend on the K asked for."""
    model = build(dataclasses.replace(tiny_cfg, readout="final_norm")).eval()
    raw = build(dataclasses.replace(tiny_cfg, readout="raw")).eval()
    raw.load_state_dict(model.state_dict(), strict=False)
    tokens = torch.randint(
        0, tiny_cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        long = model(tokens, num_loops=8)
        for k in (1, 2, 3):
            short = model(tokens, num_loops=k)
            torch.testing.assert_close(short.logits[-1], long.logits[k - 1])
            torch.testing.assert_close(short.logits[-1], raw.logits(short.hidden[-1], k, k))
        for k in (4, 5, 8):
            h = long.hidden[k - 1]
            assert not torch.allclose(long.logits[k - 1], raw.logits(h, k, 8), atol=1e-3)
            # normalised: blind to scale (far above RMSNorm's eps)
            torch.testing.assert_close(model.logits(1e2 * h, k, 8), model.logits(1e3 * h, k, 8))


def test_last_norm_normalises_the_last_loop_of_whatever_depth_runs(tiny_cfg):
    """The study's released readout (decode_norm_final_only): run at any K, exits 1..K-1 are raw
    and exit K alone reads through the norm, so at K_train it trains as final_norm does and at
    another K it differs from it: at K=2 exit 2 is normalised, at K=8 exits 4..7 are raw."""
    cfg = dataclasses.replace(tiny_cfg, readout="last_norm")
    model = build(cfg).eval()
    final = build(dataclasses.replace(tiny_cfg, readout="final_norm")).eval()
    final.load_state_dict(model.state_dict())
    raw = build(dataclasses.replace(tiny_cfg, readout="raw")).eval()
    raw.load_state_dict(model.state_dict(), strict=False)
    tokens = torch.randint(
        0, tiny_cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    K = tiny_cfg.num_loops
    with torch.no_grad():
        for a, b in zip(model(tokens, tokens).token_ce, final(tokens, tokens).token_ce):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for run in (2, K, 8):
            out = model(tokens, num_loops=run)
            for k, h in enumerate(out.hidden, 1):
                if k < run:
                    torch.testing.assert_close(out.logits[k - 1], raw.logits(h, k, run))
                else:  # blind to scale, unlike raw
                    torch.testing.assert_close(
                        model.logits(1e2 * h, k, run), model.logits(1e3 * h, k, run)
                    )
                    assert not torch.allclose(out.logits[k - 1], raw.logits(h, k, run), atol=1e-3)
        two = model(tokens, num_loops=2).logits[-1]
        assert not torch.allclose(two, final(tokens, num_loops=2).logits[-1], atol=1e-3)


def dce_dlog_scale(model, h, labels):
    """d CE / d log‖H_K‖ at the current scale, i.e. <∇_H CE, H>, and ‖∇_H CE‖·‖H‖ as its scale."""
    h = h.clone().requires_grad_(True)
    logits = model.logits(h, 4, 4)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    (grad,) = torch.autograd.grad(ce, h)
    return (grad * h).sum().item(), (grad.norm() * h.norm()).item()


def test_ce_gradient_has_no_radial_component_under_norm(tiny_cfg):
    torch.manual_seed(1)
    h = 3.0 * torch.randn(8, 2, tiny_cfg.hidden_size, dtype=torch.float64)
    labels = torch.randint(0, tiny_cfg.vocab_size, (8, 2))
    norm = build(dataclasses.replace(tiny_cfg, readout="norm")).double()
    raw = build(dataclasses.replace(tiny_cfg, readout="raw")).double()
    radial, scale = dce_dlog_scale(norm, h, labels)
    assert abs(radial) < 1e-5 * scale, (radial, scale)
    radial, scale = dce_dlog_scale(raw, h, labels)
    assert abs(radial) > 1e-2 * scale, (radial, scale)
