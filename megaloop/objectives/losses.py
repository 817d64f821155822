"""The objectives' terms over the K exits (megaloop/objectives/__init__.py lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

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
    gates: list[torch.Tensor], token_ce: torch.Tensor, mask, min_gain: float, sharpness: float
) -> torch.Tensor:
    """Ouro's stage 2: at each loop k < K, the gate's probability of going on (1 − λ_k) against
    the target w_k = σ(s·(max(0, CE_k − CE_{k+1}) − γ)), in binary cross-entropy."""
    gain = (token_ce[:-1] - token_ce[1:]).detach().clamp_min(0)
    target = torch.sigmoid(sharpness * (gain - min_gain))
    lam = torch.stack(gates[:-1]).float().clamp(1e-6, 1 - 1e-6)
    bce = -(target * torch.log1p(-lam) + (1 - target) * lam.log())
    return torch.stack([masked_mean(b, mask) for b in bce]).mean()


class Exits:
    """What an objective's loss reads (objectives.OBJECTIVES): the exits' terms under the loss
    mask, each computed when first asked for."""

    def __init__(self, terms: ExitTerms, mask: torch.Tensor | None):
        self.terms, self.mask = terms, mask
        self.ce = torch.stack([masked_mean(c, mask) for c in terms.ce])
        """CE_k, the token mean of each loop's [K]."""

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The token mean under the loss mask."""
        return masked_mean(x, self.mask)

    @cached_property
    def token_ce(self) -> torch.Tensor:
        return torch.stack(self.terms.ce)

    @cached_property
    def probs(self) -> torch.Tensor:
        """p_1..p_K, the exit distribution [K, b, s]."""
        return semantics.exit_probabilities(self.terms.gates)

    @cached_property
    def entropy(self) -> torch.Tensor:
        """H(p) per token [b, s]."""
        return -(self.probs * self.probs.clamp_min(ENTROPY_FLOOR).log()).sum(0)

    @cached_property
    def expected_ce(self) -> torch.Tensor:
        """Σ_k p_k·CE_k per token [b, s]."""
        return (self.probs * self.token_ce).sum(0)

    def mixture_ce(self) -> torch.Tensor:
        return mixture_ce(self.probs, self.terms.logits, self.terms.labels)

    def gate_gain(self, min_gain: float, sharpness: float) -> torch.Tensor:
        return gate_gain(self.terms.gates, self.token_ce, self.mask, min_gain, sharpness)


def compute(
    cfg: ObjectiveConfig, exits: ExitTerms | LoopOutput, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss and its terms per loop (`ce`, `hidden_rms` and its percentiles,
    `norm_penalty`, ...), the terms as detached tensors (converted to numbers once per step, not
    per micro-batch)."""
    if isinstance(exits, LoopOutput):
        exits = ExitTerms.from_output(exits)
    num_loops = len(exits.ce)
    if cfg.gated and len(exits.gates) != num_loops:
        raise ValueError(
            f"the {cfg.kind} objective needs the model's exit gate (model.exit_gate=true)"
        )
    x = Exits(exits, loss_mask)
    loss = cfg.spec.loss(cfg, x)
    ms = torch.stack([masked_mean(m, loss_mask) for m in exits.mean_square])
    if cfg.norm_penalty > 0:
        loss = loss + cfg.norm_penalty * ms.mean()
    terms: dict = {
        # a copy: the terminal loss is a view of ce, and megatron-core's schedule divides the
        # returned loss by the number of micro-batches in place
        "ce": x.ce.detach().clone(),
        "hidden_rms": torch.stack(
            [masked_mean(m.sqrt(), loss_mask) for m in exits.mean_square]
        ).detach(),
        **rms_percentiles(exits.mean_square, loss_mask),
        "norm_penalty": (cfg.norm_penalty / num_loops * ms).detach(),
    }
    if cfg.gated:
        terms["exit_prob"] = torch.stack([x.mean(p) for p in x.probs]).detach()
        terms["weighted_ce"] = torch.stack(
            [x.mean(p * c) for p, c in zip(x.probs, x.token_ce)]
        ).detach()
        terms["exit_entropy"] = x.mean(x.entropy).detach()
    return loss, terms
