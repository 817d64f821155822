"""What a looped model means, written once: every model and measurement of megaloop calls this.

    H_0 = Embed(x)
    H_k = Stack(R(H_{k-1}))          k = 1..K, R = recurrence (identity for k = 1)
    logits_k = W_out·read(H_k, k)    one shared W_out
    λ_k = sigmoid(w·g(H_k) + b)      the exit gate, g its input rule
    p_k = λ_k·Π_{j<k}(1 − λ_j)       the exit distribution (the last loop takes the rest)

Under Ouro's wiring (loop_norm=shared) one RMSNorm N follows every loop: N(H_k) is what loop
k+1 receives, what the gate reads and, with a normalising readout, what W_out reads.

Torch only (no megatron-core, no transformers): `megaloop export` copies this file and
modes.py (the torch-free half: which modes exist and which parameters each owns) beside the
exported model's code, which imports them relatively. What each mode computes is one entry of a
rule table (READOUTS, RECURRENCES, GATE_INPUTS) keyed by the modes modes.py's types name
(tests/unit/test_readout.py checks that the two agree).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .modes import (
    DAMPING_SIZE,
    READOUT_NORMALIZES,
    SHARES_LOOP_NORM,
    readout_owns_norm,
)

Norm = Callable[[torch.Tensor], torch.Tensor]


def mean_square(
    h: torch.Tensor, dtype: torch.dtype | None = None, keepdim: bool = False
) -> torch.Tensor:
    """‖H‖²_rms per token: the mean of H² over the hidden (last) dimension, in `dtype` if given."""
    return (h if dtype is None else h.to(dtype)).pow(2).mean(dim=-1, keepdim=keepdim)


def rms(h: torch.Tensor, dtype: torch.dtype | None = None, keepdim: bool = False) -> torch.Tensor:
    """‖H‖_rms per token, the scale the readout blind spot is about."""
    return mean_square(h, dtype, keepdim).sqrt()


# ---- the readout: what W_out multiplies at exit k -------------------------------------------


ReadoutRule = Callable[[torch.Tensor, bool, Norm], torch.Tensor]
"""(H_k, whether modes.READOUT_NORMALIZES says exit k reads through the exit norm, that norm)
→ W_out's input. The exit norm is the readout's own RMSNorm or the shared loop norm."""


def _through_norm_where_told(h: torch.Tensor, normalizes: bool, norm: Norm) -> torch.Tensor:
    return norm(h) if normalizes else h


READOUTS: dict[str, ReadoutRule] = {
    # CE cannot see the scale of H_k (RMSNorm(cH) = RMSNorm(H)): the study's blind spot.
    "norm": _through_norm_where_told,
    # W_out·H_k: scale changes logits.
    "raw": _through_norm_where_told,
    # raw before the trained depth, normalised from there on.
    "final_norm": _through_norm_where_told,
}


def readout_input(
    mode: str, h: torch.Tensor, loop: int, trained_loops: int, norm: Norm | None
) -> torch.Tensor:
    """What W_out reads at exit `loop` (1-based) of a model trained at `trained_loops`."""
    return READOUTS[mode](h, READOUT_NORMALIZES[mode](loop, trained_loops), norm)


def readout_norm(
    mode: str, hidden_size: int, eps: float, loop_norm: str, trained_loops: int
) -> nn.RMSNorm | None:
    """The readout's own RMSNorm, if its mode reads through one and the model has no shared
    loop norm."""
    own = readout_owns_norm(mode, trained_loops, loop_norm)
    return nn.RMSNorm(hidden_size, eps=eps) if own else None


# ---- the recurrence: what H_k becomes before it re-enters the stack -------------------------


@dataclass(frozen=True)
class RecurrenceRule:
    apply: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    params: Callable[[nn.Module, int, float, float, str], None] = lambda *_: None
    """Adds the mode's parameters to the module: (module, d, eps, damping_init, damping_shape)."""


def _rmsnorm_params(m: nn.Module, d: int, eps: float, init: float, shape: str) -> None:
    m.norm = nn.RMSNorm(d, eps=eps)


def _damping_params(m: nn.Module, d: int, eps: float, init: float, shape: str) -> None:
    m.damping_logit = nn.Parameter(
        torch.full((DAMPING_SIZE[shape](d),), math.log(init / (1 - init)))
    )


RECURRENCES: dict[str, RecurrenceRule] = {
    # H_k as is: the pre-norm residual stream carries and grows its scale (the study's ablation).
    "none": RecurrenceRule(lambda m, h: h),
    # Ouro's inter-loop RMSNorm.
    "rmsnorm": RecurrenceRule(lambda m, h: m.norm(h), _rmsnorm_params),
    # A learned factor in (0, 1): a contraction of the recurrent map's spectrum.
    "damping": RecurrenceRule(lambda m, h: h * torch.sigmoid(m.damping_logit), _damping_params),
}


class Recurrence(nn.Module):
    """R, per RECURRENCES[mode]. `damping_init` 0.5 (logit 0) suits weights loaded next."""

    def __init__(
        self,
        mode: str,
        hidden_size: int,
        eps: float,
        damping_init: float = 0.5,
        damping_shape: str = "channel",
    ):
        super().__init__()
        self.mode = mode
        RECURRENCES[mode].params(self, hidden_size, eps, damping_init, damping_shape)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return RECURRENCES[self.mode].apply(self, h)


def loop_norm(mode: str, hidden_size: int, eps: float) -> nn.RMSNorm | None:
    return nn.RMSNorm(hidden_size, eps=eps) if SHARES_LOOP_NORM[mode] else None


class Clamp:
    """The inference-time recurrent-scale clamp: each token of H_k (k ≥ 2) rescaled to its
    loop-1 RMS. Call it on H_1, H_2, ... in order, once per loop."""

    def __init__(self):
        self.reference: torch.Tensor | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.reference is None:
            self.reference = rms(h, keepdim=True)
            return h
        return h * (self.reference / rms(h, keepdim=True).clamp_min(torch.finfo(h.dtype).tiny))


# ---- the exit gate and the exit distribution ------------------------------------------------

GATE_INPUTS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    # The scale-free direction H_k/‖H_k‖_rms, no weights: CE stays blind to scale via the gate.
    "normed": lambda h, eps: F.rms_norm(h, (h.shape[-1],), eps=eps),
    # H_k itself (an ablation): a path by which the exit-weighted objective sees hidden scale.
    "raw": lambda h, eps: h,
}


def gate_input(
    mode: str, h: torch.Tensor, eps: float, normed: torch.Tensor | None = None
) -> torch.Tensor:
    """What the exit gate reads: the shared loop norm's output `normed` when the model has one,
    else GATE_INPUTS[mode] of H_k."""
    return normed if normed is not None else GATE_INPUTS[mode](h, eps)


class ExitGate(nn.Module):
    """Ouro's exit gate λ_k = sigmoid(Linear(d, 1)(g(H_k))), zero-initialised (λ = 1/2)."""

    def __init__(self, hidden_size: int, input_mode: str = "normed", eps: float = 1e-5):
        super().__init__()
        self.input_mode, self.eps = input_mode, eps
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """[..., d] → λ in (0, 1), [...]; `normed` is the shared loop norm's output of h."""
        return exit_lambda(self.proj, gate_input(self.input_mode, h, self.eps, normed))


def exit_lambda(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """λ = sigmoid(proj(x)), [..., d] → [...]."""
    return torch.sigmoid(proj(x).squeeze(-1))


class Survival:
    """S_k = Π_{j≤k}(1 − λ_j), loop by loop: the exit distribution p_k = λ_k·S_{k−1} (the last
    loop takes S_{K−1}) and the cumulative exit probability 1 − S_k, which early exit compares
    with a threshold."""

    def __init__(self):
        self.survive: torch.Tensor | None = None

    def step(self, lam: torch.Tensor, last: bool = False) -> torch.Tensor:
        """p_k of this loop, given λ_k; advances S."""
        before = torch.ones_like(lam) if self.survive is None else self.survive
        self.survive = before * (1 - lam)
        return before if last else lam * before

    def cumulative(self) -> torch.Tensor:
        """Σ_{j≤k} p_j = 1 − S_k, the probability of having exited by loop k."""
        return 1 - self.survive

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the rows still running (dynamic batching drops the finished ones)."""
        self.survive = self.survive[rows]


def exit_probabilities(gates: list[torch.Tensor]) -> torch.Tensor:
    """p_1..p_K from λ_1..λ_K, stacked on dim 0 (they sum to one)."""
    survival = Survival()
    return torch.stack([survival.step(lam, k == len(gates)) for k, lam in enumerate(gates, 1)])


def exits(score: torch.Tensor, threshold: float) -> torch.Tensor:
    """The early-exit decision: a token exits at the first loop whose score (the cumulative exit
    probability, or the top-1 margin) reaches the threshold."""
    return score >= threshold


def top1_margin(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per token, [..., V] → [...] (fp32): the study's halting score.
    On one token it is what `megaloop halt` calibrates (its per-sequence mean over one token)."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


# ---- early exit: which of the running tokens stop at loop k ---------------------------------

ExitScore = Callable[[Survival, torch.Tensor | None, torch.Tensor | None], torch.Tensor | None]

EXIT_SCORES: dict[str, ExitScore] = {
    # fixed K: no score, every token runs to the last loop
    "none": lambda survival, lam, logits: None,
    # Ouro's gate: the cumulative exit probability 1 − S_k
    "gate": lambda survival, lam, logits: (survival.step(lam), survival.cumulative())[1],
    # the study's margin: top-1 minus top-2 logit of this loop's readout
    "margin": lambda survival, lam, logits: top1_margin(logits),
}
"""Per modes.EarlyExit: (the survival so far, λ_k, logits_k of the running tokens) → their
score at loop k, which exits compares with the threshold."""

READS_GATE = {"none": False, "gate": True, "margin": False}
READS_LOGITS = {"none": False, "gate": False, "margin": True}


class ExitRule:
    """Loop by loop, which of the running tokens stop: those whose score (EXIT_SCORES) reaches
    the threshold, and all of them at loop K. Call `stop` at k = 1..K in order, with λ_k when
    the rule reads the gate and logits_k when it reads them; `keep` the tokens that go on when
    the stopped ones leave the batch."""

    def __init__(self, rule: str, threshold: float, num_loops: int):
        self.rule, self.threshold, self.num_loops = rule, threshold, num_loops
        self.reads_gate, self.reads_logits = READS_GATE[rule], READS_LOGITS[rule]
        self.survival = Survival()

    def stop(
        self,
        k: int,
        h: torch.Tensor,
        lam: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Booleans of H_k's shape less the hidden dimension: which running tokens exit at k."""
        score = EXIT_SCORES[self.rule](self.survival, lam, logits)
        if k >= self.num_loops or score is None:
            return torch.full(h.shape[:-1], k >= self.num_loops, dtype=torch.bool, device=h.device)
        return exits(score, self.threshold)

    def keep(self, tokens: torch.Tensor) -> None:
        if self.survival.survive is not None:
            self.survival.keep(tokens)
