"""Each objective equals a hand computation on small tensors."""

import math

import pytest
import torch

from megaloop.model.looped import LoopOutput
from megaloop.model.semantics import exit_probabilities
from megaloop.objectives import ObjectiveConfig, compute

CE = [[[2.0, 4.0]], [[1.0, 3.0]], [[0.5, 1.5]]]  # K=3 loops, b=1, s=2
GATES = [[[0.5, 0.2]], [[0.4, 0.9]], [[0.7, 0.1]]]


def output(hidden_scale=(1.0, 2.0, 3.0), gates=False):
    hidden = [torch.full((2, 1, 4), s) for s in hidden_scale]  # [s, b, d], every entry = s
    return LoopOutput(
        hidden=hidden,
        token_ce=[torch.tensor(c) for c in CE],
        gates=[torch.tensor(g) for g in GATES] if gates else [],
    )


def test_terminal():
    loss, terms = compute(ObjectiveConfig(kind="terminal"), output())
    assert loss.item() == pytest.approx(1.0)
    assert terms["ce"].tolist() == pytest.approx([3.0, 2.0, 1.0])


def test_per_loop():
    loss, _ = compute(ObjectiveConfig(kind="per_loop"), output())
    assert loss.item() == pytest.approx((3.0 + 2.0 + 1.0) / 3)


def test_norm_penalty_adds_mean_square_over_loops():
    loss, terms = compute(ObjectiveConfig(kind="per_loop", norm_penalty=0.1), output())
    # ‖H_k‖²_rms = s² for H filled with s: (1 + 4 + 9) / 3
    assert loss.item() == pytest.approx(2.0 + 0.1 * 14.0 / 3)
    assert terms["norm_penalty"].tolist() == pytest.approx([0.1 / 3, 0.4 / 3, 0.9 / 3])
    assert terms["hidden_rms"].tolist() == pytest.approx([1.0, 2.0, 3.0])


def test_exit_weighted_matches_hand_computation():
    beta = 0.3
    loss, terms = compute(
        ObjectiveConfig(kind="exit_weighted", entropy_beta=beta), output(gates=True)
    )
    expected, entropies = 0.0, 0.0
    for t in range(2):
        lam = [GATES[k][0][t] for k in range(3)]
        p = [lam[0], (1 - lam[0]) * lam[1], (1 - lam[0]) * (1 - lam[1])]
        expected += sum(p[k] * CE[k][0][t] for k in range(3)) / 2
        entropies += -sum(q * math.log(q) for q in p) / 2
    assert loss.item() == pytest.approx(expected - beta * entropies)
    assert terms["exit_entropy"].item() == pytest.approx(entropies)
    assert terms["exit_prob"].sum().item() == pytest.approx(1.0)


def test_exit_probabilities_sum_to_one():
    torch.manual_seed(0)
    gates = [torch.rand(3, 5) for _ in range(6)]
    probs = exit_probabilities(gates)
    assert probs.shape == (6, 3, 5)
    torch.testing.assert_close(probs.sum(0), torch.ones(3, 5))
    assert (probs >= 0).all()


def test_loss_mask_restricts_the_token_mean():
    mask = torch.tensor([[1.0, 0.0]])
    loss, terms = compute(ObjectiveConfig(kind="per_loop"), output(), loss_mask=mask)
    assert loss.item() == pytest.approx((2.0 + 1.0 + 0.5) / 3)
    assert terms["ce"].tolist() == pytest.approx([2.0, 1.0, 0.5])


@pytest.mark.parametrize("kind", ["exit_weighted", "exit_mixture"])
def test_gated_objectives_without_gate_are_refused(kind):
    with pytest.raises(ValueError, match="exit_gate"):
        compute(ObjectiveConfig(kind=kind), output(gates=False))


def test_exit_mixture_is_the_ce_of_the_exit_weighted_mixture_of_logits():
    """Ouro's label path: CE(Σ_k p_k·logits_k), by hand over a 3-token vocabulary."""
    logits = [
        [[[1.0, 0.0, -1.0]], [[0.0, 2.0, 0.5]]],  # loop 1: [s=2, b=1, V=3]
        [[[0.5, 0.5, 0.0]], [[3.0, -1.0, 0.0]]],
        [[[-2.0, 1.0, 1.0]], [[0.0, 0.0, 4.0]]],
    ]
    labels = [[0, 2]]
    out = output(gates=True)
    out.logits, out.labels = [torch.tensor(z) for z in logits], torch.tensor(labels)
    loss, terms = compute(ObjectiveConfig(kind="exit_mixture"), out)
    expected = 0.0
    for t in range(2):
        lam = [GATES[k][0][t] for k in range(3)]
        p = [lam[0], (1 - lam[0]) * lam[1], (1 - lam[0]) * (1 - lam[1])]
        mixed = [sum(p[k] * logits[k][t][0][v] for k in range(3)) for v in range(3)]
        log_z = math.log(sum(math.exp(m) for m in mixed))
        expected += (log_z - mixed[labels[0][t]]) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert terms["ce"].tolist() == pytest.approx([3.0, 2.0, 1.0])  # per-loop CE still logged
    assert terms["exit_prob"].sum().item() == pytest.approx(1.0)


def test_gate_gain_is_ouros_stage_two_by_hand():
    """BCE of the gate's go-on probability 1 − λ_k against σ(s·(max(0, CE_k − CE_{k+1}) − γ)),
    token mean per loop k < K, mean over those loops; the CE is a target, not trained."""
    cfg = ObjectiveConfig(kind="gate_gain", gate_min_gain=0.6, gate_sharpness=5.0)
    out = output(gates=True)
    for t in out.token_ce + out.gates:
        t.requires_grad_(True)
    loss, terms = compute(cfg, out)
    per_loop = []
    for k in range(2):
        bce = 0.0
        for t in range(2):
            gain = max(0.0, CE[k][0][t] - CE[k + 1][0][t])
            target = 1 / (1 + math.exp(-5.0 * (gain - 0.6)))
            lam = GATES[k][0][t]
            bce += -(target * math.log(1 - lam) + (1 - target) * math.log(lam)) / 2
        per_loop.append(bce)
    assert loss.item() == pytest.approx(sum(per_loop) / 2, rel=1e-6)
    assert "exit_prob" in terms
    loss.backward()
    assert all(c.grad is None for c in out.token_ce)
    assert all(g.grad.abs().sum() > 0 for g in out.gates[:-1]) and out.gates[-1].grad is None


def test_gate_gain_trains_the_gate_alone_and_starts_from_a_model():
    cfg = ObjectiveConfig(kind="gate_gain")
    assert cfg.trains("module.exit_gate.proj.weight") and cfg.trains("exit_gate.norm.weight")
    assert not cfg.trains("module.layers.0.mlp.linear_fc1.weight")
    assert ObjectiveConfig(kind="exit_weighted").trains("module.layers.0.mlp.linear_fc1.weight")
    with pytest.raises(ValueError, match="gate_sharpness"):
        ObjectiveConfig(kind="gate_gain", gate_sharpness=0.0).validate()


def test_gate_gain_clamps_the_gain_at_zero_where_the_next_loop_is_worse():
    """K=2, γ=0, s=1: token 0's CE rises from 1 to 3 (a gain of -2, clamped to 0: target
    σ(0) = 1/2, not σ(-2)); token 1's falls from 2 to 1.5 (target σ(0.5)). Gates λ = 0.3, 0.8."""
    cfg = ObjectiveConfig(kind="gate_gain", gate_min_gain=0.0, gate_sharpness=1.0)
    out = LoopOutput(
        hidden=[torch.ones(2, 1, 4)] * 2,
        token_ce=[torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 1.5]])],
        gates=[torch.tensor([[0.3, 0.8]]), torch.tensor([[0.5, 0.5]])],
    )
    loss, _ = compute(cfg, out)
    rises = -(0.5 * math.log(0.7) + 0.5 * math.log(0.3))
    w = 1 / (1 + math.exp(-0.5))
    falls = -(w * math.log(0.2) + (1 - w) * math.log(0.8))
    assert loss.item() == pytest.approx((rises + falls) / 2, rel=1e-6)
