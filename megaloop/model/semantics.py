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
(tests/unit/model/test_readout.py checks that the two agree).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .modes import (
    DAMPING_SIZE,
    EXIT_RULES,
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


Loop = int | torch.Tensor
"""A loop index (1-based): one for every row, or one per row (rows at their own loops, a tensor
of H's shape less its last dimensions)."""


def per_row(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """A per-row value, shaped to broadcast against H (trailing dimensions of size one)."""
    return x.reshape(*x.shape, *(1,) * (h.dim() - x.dim()))


ReadoutRule = Callable[[torch.Tensor, "bool | torch.Tensor", Norm], torch.Tensor]
"""(H_k, whether modes.READOUT_NORMALIZES says exit k reads through the exit norm (a tensor
when the rows are at different loops), that norm) → W_out's input. The exit norm is the
readout's own RMSNorm or the shared loop norm."""


def _through_norm_where_told(h: torch.Tensor, normalizes, norm: Norm) -> torch.Tensor:
    if isinstance(normalizes, torch.Tensor):
        return torch.where(per_row(normalizes, h), norm(h), h)
    return norm(h) if normalizes else h


READOUTS: dict[str, ReadoutRule] = {
    # CE cannot see the scale of H_k (RMSNorm(cH) = RMSNorm(H)): the study's blind spot.
    "norm": _through_norm_where_told,
    # W_out·H_k: scale changes logits.
    "raw": _through_norm_where_told,
    # raw before the trained depth, normalised from there on.
    "final_norm": _through_norm_where_told,
    # raw before the last loop of the run, normalised at it (the study's released code).
    "last_norm": _through_norm_where_told,
}


def readout_input(
    mode: str, h: torch.Tensor, loop: Loop, trained_loops: int, last: int, norm: Norm | None
) -> torch.Tensor:
    """What W_out reads at exit `loop` (1-based; one per row, or one for all) of a model
    trained at `trained_loops`, in a run whose last loop is `last` (its K)."""
    return READOUTS[mode](h, READOUT_NORMALIZES[mode](loop, trained_loops, last), norm)


class Reused:
    """A norm whose output for the H at hand is computed already: the shared loop norm's N(H_k),
    which the next loop and the gate read too. Called, it gives that output; its weight is the
    norm's, for a readout rule that reads it."""

    def __init__(self, norm: nn.Module, out: torch.Tensor):
        self.norm, self.out = norm, out

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.out

    @property
    def weight(self) -> torch.Tensor:
        return self.norm.weight


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


def enter(h: torch.Tensor, loop: Loop, feed_back: Norm) -> torch.Tensor:
    """What loop `loop` receives: H_0 at loop 1, R(H_{k-1}) (the recurrence, or the shared loop
    norm: `feed_back`) after it; per row where the rows are at different loops."""
    if isinstance(loop, int):
        return feed_back(h) if loop > 1 else h
    return torch.where(per_row(loop > 1, h), feed_back(h), h)


def hold(
    h: torch.Tensor, loop: Loop, reference: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inference-time recurrent-scale clamp: H_1's RMS per token is its reference (set here,
    at loop 1; `reference` may be None while every row is at loop 1), and each H_k (k ≥ 2) is
    rescaled to it. Returns H_k held and the references."""
    scale = rms(h, keepdim=True)
    if isinstance(loop, int):
        if loop == 1:
            return h, scale
        return h * (reference / scale.clamp_min(torch.finfo(h.dtype).tiny)), reference
    first = per_row(loop == 1, h)
    reference = scale if reference is None else torch.where(first, scale, reference)
    held = h * (reference / scale.clamp_min(torch.finfo(h.dtype).tiny))
    return torch.where(first, h, held), reference


class Clamp:
    """`hold` for a batch that runs its loops together: call it on H_1, H_2, ... in order."""

    def __init__(self):
        self.reference: torch.Tensor | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        h, self.reference = hold(h, 1 if self.reference is None else 2, self.reference)
        return h


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

    def exited(self, lam: torch.Tensor) -> torch.Tensor:
        """Advances S by λ_k; 1 − S_k, the gate rule's score."""
        self.step(lam)
        return self.cumulative()

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the rows still running (dynamic batching drops the finished ones)."""
        self.survive = self.survive[rows]


def exit_probabilities(gates: list[torch.Tensor]) -> torch.Tensor:
    """p_1..p_K from λ_1..λ_K, stacked on dim 0 (they sum to one)."""
    survival = Survival()
    return torch.stack([survival.step(lam, k == len(gates)) for k, lam in enumerate(gates, 1)])


def exits(score: torch.Tensor, threshold: float) -> torch.Tensor:
    """The early-exit decision: a token exits at the first loop whose score (modes.EXIT_RULES)
    reaches the threshold."""
    return score >= threshold


# ---- early exit: which of the running tokens stop at loop k ---------------------------------


class ExitRule:
    """Loop by loop, which of the running tokens stop: those whose score (modes.EXIT_RULES)
    reaches the threshold, and all of them at loop K (rule `none`: only then). Call `stop` at
    each loop in order, with λ_k when the rule reads the gate and logits_k when it reads them;
    `keep` the tokens that go on when the stopped ones leave the batch, `restart` those that
    begin a new token."""

    def __init__(self, rule: str, threshold: float, num_loops: int):
        self.rule, self.threshold, self.num_loops = rule, threshold, num_loops
        self.spec = EXIT_RULES.get(rule)
        self.reads_gate = self.spec is not None and self.spec.reads == "gate"
        self.reads_logits = self.spec is not None and self.spec.reads == "logits"
        self.survival = Survival()

    def stop(
        self,
        loop: Loop,
        h: torch.Tensor,
        lam: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Booleans of H_k's shape less the hidden dimension: which running tokens exit at
        their loop."""
        score = None if self.spec is None else self.spec.score(self.survival, lam, logits)
        last = loop >= self.num_loops
        if isinstance(last, torch.Tensor):
            return last.clone() if score is None else exits(score, self.threshold) | last
        if last or score is None:
            return torch.full(h.shape[:-1], last, dtype=torch.bool, device=h.device)
        return exits(score, self.threshold)

    def keep(self, tokens: torch.Tensor) -> None:
        if self.survival.survive is not None:
            self.survival.keep(tokens)

    def restart(self, tokens: torch.Tensor) -> None:
        """The tokens at `tokens` (booleans) are new ones: nothing of their exit mass is spent."""
        if self.survival.survive is not None:
            self.survival.survive = torch.where(tokens, 1.0, self.survival.survive)


# ---- the loops: rows at their own loops, and the only iterations over loops -----------------


class Loops:
    """Rows of a batch and the loop each is at, with every rule of a loop applied per row: what
    the stack receives (`enter`), the clamp (`hold`), the exit's logits (`read`) and whether the
    row exits (`stop`). `loop` is one int while the rows run their loops together, a tensor
    [rows] when each runs its own; `num_loops` is the run's K, its last loop. `model` is the
    model's half: feed_back(H) (R or the shared loop norm), readout(H, loop, last),
    exit_probability(H) (λ, [..., 1])."""

    def __init__(
        self,
        model,
        num_loops: int,
        rule: str = "none",
        threshold: float = 0.0,
        clamp: bool = False,
        loop: Loop = 1,
    ):
        self.model, self.num_loops, self.loop, self.clamp = model, num_loops, loop, clamp
        self.exit = ExitRule(rule, threshold, num_loops)
        self.reference: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.loop)

    def enter(self, h: torch.Tensor) -> torch.Tensor:
        return enter(h, self.loop, self.model.feed_back)

    def hold(self, h: torch.Tensor) -> torch.Tensor:
        if self.clamp:
            h, self.reference = hold(h, self.loop, self.reference)
        return h

    def read(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.readout(h, self.loop, self.num_loops)

    def stop(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Which rows exit at their loop, and their logits where the rule read them (the
        margin; the gate reads λ only)."""
        lam = self.model.exit_probability(h)[..., 0] if self.exit.reads_gate else None
        logits = self.read(h) if self.exit.reads_logits else None
        return self.exit.stop(self.loop, h, lam, logits), logits

    def advance(self, stop: torch.Tensor) -> None:
        """Per row: a row whose token exits starts its next token at loop 1, the others go on."""
        self.loop = torch.where(stop, 1, self.loop + 1)
        self.exit.restart(stop)

    def keep(self, index: torch.Tensor) -> None:
        """Only the rows at `index` run from now on."""
        self.loop = self.loop[index]
        if self.reference is not None:
            self.reference = self.reference[index]
        self.exit.keep(index)


Step = Callable[[torch.Tensor, Loops], torch.Tensor]
"""The model's stack step: H_{k−1} (H_0 at loop 1) of rows at `loops.loop` → their H_k."""


def trajectory(step: Step, h: torch.Tensor, loops: Loops) -> Iterator[tuple[int, torch.Tensor]]:
    """(k, H_k) for k = 1..K of rows that run their loops together, from H_0."""
    for k in range(1, loops.num_loops + 1):
        loops.loop = k
        h = step(h, loops)
        yield k, h


def first_exits(
    path: Iterator[tuple[int, torch.Tensor]], loops: Loops
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's logits at its exit loop under `loops`' rule, and that loop, from a
    trajectory that runs every loop for every token: the no-cache reference of early exit."""
    logits, exit_loops = None, None
    for k, h in path:
        loops.loop = k
        logits_k = loops.read(h)
        lam = loops.model.exit_probability(h)[..., 0] if loops.exit.reads_gate else None
        stop = loops.exit.stop(k, h, lam, logits_k)
        if logits is None:
            logits, exit_loops = logits_k, torch.zeros_like(stop, dtype=torch.long)
        take = stop & (exit_loops == 0)
        logits = torch.where(take[..., None], logits_k, logits)
        exit_loops = torch.where(take, k, exit_loops)
    return logits, exit_loops


def each_loop(loops: Loops, run: Callable[[], bool]) -> None:
    """Loops 1..K of rows that run together, each run by `run` at `loops.loop`, until `run`
    says no row still runs (every row has exited)."""
    for k in range(1, loops.num_loops + 1):
        loops.loop = k
        if not run():
            return


def each_step(loops: Loops, step: Callable[[], None]) -> None:
    """Rows each at its own loop: one application of the stack per `step` serves every row,
    until `step` (which advances the rows and drops those that are done) leaves none."""
    while len(loops):
        step()
