"""The objectives' terms over the K exits (megaloop/objectives/__init__.py lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core import tensor_parallel

from megaloop.model import semantics
from megaloop.model.looped import LoopOutput
from megaloop.model.specs import tp_group
from megaloop.objectives import ObjectiveConfig

ENTROPY_FLOOR = 1e-8
"""The entropy's log reads p_k clamped at this floor, the study's released objective's clamp
(src/train_ar_looplm.py, supervision `adaptive`): where a gate saturates, a vanishing p_k's log
and gradient stop at ln 1e-8 = -18.4."""


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp_min(1)


def mean_square(h: torch.Tensor) -> torch.Tensor:
    """‖H‖²_rms per token: the mean over the hidden dimension of H², [s, b, d] → [b, s]."""
    return semantics.mean_square(h, torch.float32).t()


def rms_percentiles(
    mean_squares: list[torch.Tensor], loss_mask: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Per loop, the p50, p99 and max of the per-token ‖H_k‖_rms over the masked tokens (detached,
    [K] each; zeros when the mask keeps no token)."""
    rms = torch.stack([m.detach().float().sqrt() for m in mean_squares]).flatten(1)  # [K, b·s]
    if loss_mask is not None:
        rms = rms[:, loss_mask.flatten() > 0]
    if rms.shape[1] == 0:
        rms = rms.new_zeros(rms.shape[0], 1)
    p50, p99 = torch.quantile(rms, rms.new_tensor([0.5, 0.99]), dim=1)
    return {"hidden_rms_p50": p50, "hidden_rms_p99": p99, "hidden_rms_max": rms.amax(dim=1)}


@dataclass
class ExitTerms:
    """Per-token quantities of each exit that the objectives are functions of ([b, s] each),
    and for exit_mixture the exits' vocab-parallel logits [s, b, V/tp] and the labels [b, s]."""

    ce: list[torch.Tensor]
    mean_square: list[torch.Tensor]
    gates: list[torch.Tensor]
    logits: list[torch.Tensor] = field(default_factory=list)
    labels: torch.Tensor | None = None

    @classmethod
    def from_output(cls, out: LoopOutput) -> ExitTerms:
        return cls(
            out.token_ce, [mean_square(h) for h in out.hidden], out.gates, out.logits, out.labels
        )


def mixture_ce(
    probs: torch.Tensor, logits: list[torch.Tensor], labels: torch.Tensor
) -> torch.Tensor:
    """Per-token CE [b, s] of Σ_k p_k·logits_k (probs [K, b, s]); the mixture of vocab-parallel
    logits is vocab-parallel, so the CE is megatron-core's vocabulary-parallel one. Each
    tensor-parallel rank holds p_k whole but only its vocabulary shard of the logits, so the
    gradient of p_k is summed over the ranks (megatron-core's copy into a parallel region)."""
    probs = tensor_parallel.copy_to_tensor_model_parallel_region(probs, group=tp_group())
    mixed = sum(p.t().unsqueeze(-1) * z.float() for p, z in zip(probs, logits))
    return tensor_parallel.vocab_parallel_cross_entropy(mixed, labels.t().contiguous()).t()


def gate_gain(
    cfg: ObjectiveConfig, gates: list[torch.Tensor], token_ce: torch.Tensor, mask
) -> torch.Tensor:
    """Ouro's stage 2: at each loop k < K, the gate's probability of going on (1 − λ_k) against
    the target w_k = σ(s·(max(0, CE_k − CE_{k+1}) − γ)), in binary cross-entropy."""
    gain = (token_ce[:-1] - token_ce[1:]).detach().clamp_min(0)
    target = torch.sigmoid(cfg.gate_sharpness * (gain - cfg.gate_min_gain))
    lam = torch.stack(gates[:-1]).float().clamp(1e-6, 1 - 1e-6)
    bce = -(target * torch.log1p(-lam) + (1 - target) * lam.log())
    return torch.stack([masked_mean(b, mask) for b in bce]).mean()


def compute(
    cfg: ObjectiveConfig, exits: ExitTerms | LoopOutput, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss and its terms per loop (`ce`, `hidden_rms` and its percentiles,
    `norm_penalty`, ...), the terms as detached tensors (converted to numbers once per step, not
    per micro-batch)."""
    if isinstance(exits, LoopOutput):
        exits = ExitTerms.from_output(exits)
    num_loops = len(exits.ce)
    ce = torch.stack([masked_mean(c, loss_mask) for c in exits.ce])
    if cfg.kind == "terminal":
        loss = ce[-1]
    elif cfg.kind == "per_loop":
        loss = ce.mean()
    else:
        if len(exits.gates) != num_loops:
            raise ValueError(
                f"the {cfg.kind} objective needs the model's exit gate (model.exit_gate=true)"
            )
        probs = semantics.exit_probabilities(exits.gates)  # [K, b, s]
        token_ce = torch.stack(exits.ce)
        entropy = -(probs * probs.clamp_min(ENTROPY_FLOOR).log()).sum(0)
        if cfg.kind == "exit_mixture":
            loss = masked_mean(mixture_ce(probs, exits.logits, exits.labels), loss_mask)
        elif cfg.kind == "gate_gain":
            loss = gate_gain(cfg, exits.gates, token_ce, loss_mask)
        else:
            loss = masked_mean((probs * token_ce).sum(0), loss_mask) - (
                cfg.entropy_beta * masked_mean(entropy, loss_mask)
            )
    ms = torch.stack([masked_mean(m, loss_mask) for m in exits.mean_square])
    if cfg.norm_penalty > 0:
        loss = loss + cfg.norm_penalty * ms.mean()
    terms: dict = {
        # a copy: the terminal loss is a view of ce, and megatron-core's schedule divides the
        # returned loss by the number of micro-batches in place
        "ce": ce.detach().clone(),
        "hidden_rms": torch.stack(
            [masked_mean(m.sqrt(), loss_mask) for m in exits.mean_square]
        ).detach(),
        **rms_percentiles(exits.mean_square, loss_mask),
        "norm_penalty": (cfg.norm_penalty / num_loops * ms).detach(),
    }
    if cfg.gated:
        terms["exit_prob"] = torch.stack([masked_mean(p, loss_mask) for p in probs]).detach()
        terms["weighted_ce"] = torch.stack(
            [masked_mean(p * c, loss_mask) for p, c in zip(probs, token_ce)]
        ).detach()
        terms["exit_entropy"] = masked_mean(entropy, loss_mask).detach()
    return loss, terms
