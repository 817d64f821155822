"""The looped model's modes, and the parameters each one owns: the torch-free half of its meaning.

The Literal types are the modes a config may name (model/config.py and the exported config read
them from here); the tables say what each mode is made of, which the planner needs without torch
(model/structure.py) and semantics.py builds. semantics.py holds what each mode computes, keyed
by the same names (tests/unit/model/test_readout.py holds the two to the same modes). The kinds
a command offers (exit rules, KV policies) are one spec each here, which everything else reads.
Standard library only at import (the exit scores are tensor expressions, evaluated where torch
runs them): `megaloop export` copies this file beside semantics.py and the exported model's code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

ReadoutMode = Literal["norm", "raw", "final_norm", "last_norm"]
RecurrenceMode = Literal["none", "rmsnorm", "damping"]
DampingShape = Literal["channel", "scalar"]
GateInput = Literal["normed", "raw"]
LayerNorms = Literal["pre", "sandwich"]
LoopNorm = Literal["separate", "shared"]
PositionEmbedding = Literal["rope", "learned"]

READOUT_NORMALIZES: dict[ReadoutMode, Callable[[int, int, int], bool]] = {
    "norm": lambda loop, trained, last: True,
    "raw": lambda loop, trained, last: False,
    # the normalised interface belongs to the trained final loop, at any K the model runs at
    "final_norm": lambda loop, trained, last: loop >= trained,
    # the study's released code (decode_norm_final_only): the last loop of the K run is normalised
    "last_norm": lambda loop, trained, last: loop >= last,
}
"""(exit k, K_train, the last loop of this run) → whether exit k reads H_k through the exit
norm. `final_norm` and `last_norm` agree at K = K_train and differ at any other K: exit k of a
K-loop run reads its norm from k = K_train on under the first, only at k = K under the second.
A mode that does at its trained depth owns an RMSNorm, unless the shared loop norm is the norm
it reads."""

DAMPING_SIZE: dict[DampingShape, Callable[[int], int]] = {
    "channel": lambda hidden_size: hidden_size,
    "scalar": lambda hidden_size: 1,
}
"""`damping`: how many learned factors, one per channel or one for the whole state."""

RECURRENCE_PARAMS: dict[RecurrenceMode, Callable[[int, DampingShape], dict[str, int]]] = {
    "none": lambda d, shape: {},
    "rmsnorm": lambda d, shape: {"norm.weight": d},
    "damping": lambda d, shape: {"damping_logit": DAMPING_SIZE[shape](d)},
}
"""(hidden size, damping shape) → the recurrence's parameters, name → length."""

SHARES_LOOP_NORM: dict[LoopNorm, bool] = {"separate": False, "shared": True}
"""Whether one RMSNorm after every loop serves the next loop, the gate and the readout (Ouro)."""


def readout_owns_norm(readout: ReadoutMode, trained_loops: int, loop_norm: LoopNorm) -> bool:
    return (
        READOUT_NORMALIZES[readout](trained_loops, trained_loops, trained_loops)
        and not SHARES_LOOP_NORM[loop_norm]
    )


# ---- early exit: the exit rules and the KV policies, one spec each ---------------------------


def top1_margin(logits: Any) -> Any:
    """Top-1 minus top-2 logit per token, [..., V] → [...] (fp32): the study's halting score."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@dataclass(frozen=True)
class ExitRuleSpec:
    """An exit rule: a score per token at each loop; a token exits at the first loop whose
    score reaches the threshold (all tokens at the last loop). Every command, check and help
    text that names exit rules reads EXIT_RULES."""

    score: Callable[[Any, Any, Any], Any]
    """(semantics.Survival so far, λ_k, logits_k of the running tokens) → their score [...]."""
    reads: Literal["gate", "logits"]
    """What the score reads: λ_k (only a model trained with the exit gate has it) or logits_k."""
    summary: str
    """The score in a few words, for help texts and reports."""
    bounds: tuple[float, float]
    """The score's range: a threshold above it never exits early, one at or below its bottom
    exits every token at loop 1."""
    thresholds: tuple[float, ...]
    """`bench generate`'s thresholds when none is given, from early exits to late ones."""
    halts: Literal["sequence", "token"] = "token"
    """`megaloop halt`'s unit: a sequence exits by its tokens' mean score, or each token alone."""

    @property
    def needs_gate(self) -> bool:
        return self.reads == "gate"


EXIT_RULES: dict[str, ExitRuleSpec] = {
    # Ouro's gate: thresholds in Ouro's range
    "gate": ExitRuleSpec(
        score=lambda survival, lam, logits: survival.exited(lam),
        reads="gate",
        summary="Ouro's cumulative exit probability 1 − Π(1 − λ)",
        bounds=(0.0, 1.0),
        thresholds=(0.3, 0.5, 0.7, 0.9),
    ),
    # the study's halting score (Appendix H: per sequence), around its calibrated τ
    "margin": ExitRuleSpec(
        score=lambda survival, lam, logits: top1_margin(logits),
        reads="logits",
        summary="top-1 minus top-2 logit",
        bounds=(0.0, float("inf")),
        thresholds=(0.5, 1.0, 2.0, 4.0),
        halts="sequence",
    ),
    # post-hoc confidence, which needs no training: what a learned gate is measured against
    "confidence": ExitRuleSpec(
        score=lambda survival, lam, logits: logits.float().softmax(-1).amax(-1),
        reads="logits",
        summary="top-1 probability",
        bounds=(0.0, 1.0),
        thresholds=(0.5, 0.7, 0.9, 0.97),
    ),
}
"""The exit rules early exit may run, by name (`none`, fixed depth, is not one of them)."""

EARLY_EXITS: tuple[str, ...] = ("none", *EXIT_RULES)
EarlyExit = Literal[EARLY_EXITS]  # type: ignore[valid-type]
"""An exported config's early_exit: none (every token runs K loops) or an exit rule."""


def gate_missing(rule: str, has_gate: bool, model: str, option: str = "--exit") -> str | None:
    """Why exit rule `rule` (as `option` names it) cannot run on `model`, which has or lacks
    an exit gate (None: it can): the one check every command and the exported config make."""
    if rule not in EXIT_RULES or not EXIT_RULES[rule].needs_gate or has_gate:
        return None
    others = "|".join(name for name, spec in EXIT_RULES.items() if not spec.needs_gate)
    return (
        f"{option} {rule}: {model} has no exit gate (trained without model.exit_gate); use "
        f"{option} {others}, or a model trained with model.exit_gate=true"
    )


@dataclass(frozen=True)
class KVPolicySpec:
    """What early exit's cache holds for the loops a token skipped, which later tokens attend
    to at those loops. decoding.py reads it; every command offers KV_POLICIES."""

    per_loop: bool
    """A (loop, layer) slot per loop; False: one slot per layer, the last loop computed."""
    copies_down: bool
    """An exiting token's keys and values are copied into its skipped loops' slots."""
    resumes: bool
    """A skipped slot is computed when a later token needs it (the cache keeps each token's
    latest hidden state to resume its loops): exact, and row-synchronous only."""
    summary: str

    def loop_slots(self, num_loops: int) -> int:
        """The (loop, layer) cache slots per layer at K = `num_loops`."""
        return num_loops if self.per_loop else 1


KV_POLICIES: dict[str, KVPolicySpec] = {
    "copy": KVPolicySpec(
        per_loop=True,
        copies_down=True,
        resumes=False,
        summary="a skipped loop reads the exit loop's keys and values",
    ),
    "share": KVPolicySpec(
        per_loop=False,
        copies_down=False,
        resumes=False,
        summary="one slot per layer, the last loop computed",
    ),
    "recompute": KVPolicySpec(
        per_loop=True,
        copies_down=False,
        resumes=True,
        summary="a skipped loop is computed when a later token needs it (exact)",
    ),
}

KVPolicy = Literal[tuple(KV_POLICIES)]  # type: ignore[valid-type]


def asynchronous_policies() -> tuple[str, ...]:
    """The KV policies the depth-asynchronous decoder runs: not one that resumes earlier tokens
    at the loop a row needs (a row-synchronous step)."""
    return tuple(name for name, policy in KV_POLICIES.items() if not policy.resumes)
