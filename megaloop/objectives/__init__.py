"""Training objectives over the K exits, and the norm penalty that combines with any of them.

Each objective is one entry of OBJECTIVES: its loss as a function of the exits' terms
(`losses.Exits`: per-loop CE, the exit distribution p_k = λ_k·Π_{j<k}(1 − λ_j) with p_K the
remaining mass, its entropy, the mixture's CE, the gate's targets), its formula and what it
needs (the exit gate, the logits, every exit, part of the model). The norm penalty
λ·(1/K)·Σ_k E_tokens ‖H_k‖²_rms is added to any of them when λ > 0.

The two-stage recipe for learned exits (Ouro's): stage 1 trains the model with kind=exit_weighted
and an entropy bonus; stage 2 starts from its checkpoint (train.init_from) with kind=gate_gain.

CE_k and the exit-weighted terms are token means under the loss mask. Every term is also
returned per loop, detached, for logging, with the distribution of ‖H_k‖_rms over the (masked)
tokens of the micro-batch: its mean `hidden_rms`, p50, p99 and max (a mean hides the heavy tail
in which per-token drift shows first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from megaloop.config import Config, check


@dataclass(frozen=True)
class ObjectiveSpec:
    """An objective: its loss and what it needs. Configs, checks and the trainer read it."""

    loss: Callable[[Any, Any], Any]
    """(ObjectiveConfig, losses.Exits) → the scalar loss (a tensor expression: no torch here)."""
    formula: str
    gated: bool = False
    """It reads the exit gate (the model needs model.exit_gate=true)."""
    needs_logits: bool = False
    """It is a function of the exits' logits, not only of their CE."""
    every_exit: bool = True
    """It reads every loop's exit out (False: the last one only)."""
    trains: str | None = None
    """Only the parameters whose name holds this learn, the rest stay as a trained model left
    them: a second stage, which needs train.init_from and one pipeline stage."""
    keys: tuple[str, ...] = ()
    """The ObjectiveConfig keys it reads besides kind and norm_penalty."""


OBJECTIVES: dict[str, ObjectiveSpec] = {
    "terminal": ObjectiveSpec(lambda cfg, x: x.ce[-1], "CE_K", every_exit=False),
    "per_loop": ObjectiveSpec(lambda cfg, x: x.ce.mean(), "(1/K)·Σ_k CE_k"),
    "exit_weighted": ObjectiveSpec(
        lambda cfg, x: x.mean(x.expected_ce) - cfg.entropy_beta * x.mean(x.entropy),
        "Σ_k p_k·CE_k − β·H(p)",
        gated=True,
        keys=("entropy_beta",),
    ),
    # Ouro's label path (the study's 1.4B runs): no entropy term
    "exit_mixture": ObjectiveSpec(
        lambda cfg, x: x.mean(x.mixture_ce()),
        "CE(Σ_k p_k·logits_k)",
        gated=True,
        needs_logits=True,
    ),
    # Ouro's stage 2: the gate alone learns whether the next loop still lowers the token's CE
    "gate_gain": ObjectiveSpec(
        lambda cfg, x: x.gate_gain(cfg.gate_min_gain, cfg.gate_sharpness),
        "(1/(K−1))·Σ_{k<K} BCE(1 − λ_k, w_k),  w_k = σ(s·(max(0, CE_k − CE_{k+1}) − γ))",
        gated=True,
        trains="exit_gate.",
        keys=("gate_min_gain", "gate_sharpness"),
    ),
}

ObjectiveKind = Literal[tuple(OBJECTIVES)]  # type: ignore[valid-type]


@dataclass
class ObjectiveConfig(Config):
    kind: ObjectiveKind = "per_loop"
    """The loss over the K exits: each kind and its formula is an entry of objectives.OBJECTIVES."""
    entropy_beta: float = 0.0
    """β: weight of the exit-distribution entropy bonus (exit_weighted only)."""
    gate_min_gain: float = 0.005
    """γ of gate_gain: the CE (nats) the next loop must gain for a token to go on (Ouro's
    stage 2 uses 0.005)."""
    gate_sharpness: float = 50.0
    """s of gate_gain: how sharply the target turns from exit to continue around γ (Ouro's 50)."""
    norm_penalty: float = 0.0
    """λ: weight of the hidden-norm penalty (1/K)·Σ_k E‖H_k‖²_rms; 0 turns it off."""
    exit_kv: Literal["none", "copy"] = "none"
    """Exit-aware training (megaloop/model/sampled_exits.py): `copy` exits tokens at sampled
    loops in the training forward, later tokens' deeper loops attending to the keys and values
    the `copy` KV policy gives them at decode time; `none` trains every token at full depth."""
    exit_rate: float = 0.0
    """With exit_kv=copy: the fraction of tokens a training forward exits early, each at a loop
    uniform in 1..K−1 (the rest run K)."""

    def validate(self, prefix: str = "") -> None:
        check(self.entropy_beta >= 0, prefix + "entropy_beta", self.entropy_beta, "must be >= 0")
        users = [kind for kind, spec in OBJECTIVES.items() if "entropy_beta" in spec.keys]
        check(
            self.entropy_beta == 0 or self.kind in users,
            prefix + "entropy_beta",
            self.entropy_beta,
            f"is only used by kind={'|'.join(users)}; set it to 0",
        )
        check(self.norm_penalty >= 0, prefix + "norm_penalty", self.norm_penalty, "must be >= 0")
        check(self.gate_min_gain >= 0, prefix + "gate_min_gain", self.gate_min_gain, "must be >= 0")
        check(
            self.gate_sharpness > 0, prefix + "gate_sharpness", self.gate_sharpness, "must be > 0"
        )
        check(0 <= self.exit_rate <= 1, prefix + "exit_rate", self.exit_rate, "must be in [0, 1]")
        check(
            (self.exit_kv == "none") == (self.exit_rate == 0),
            prefix + "exit_rate",
            self.exit_rate,
            f"with exit_kv={self.exit_kv}: set exit_kv=copy and exit_rate in (0, 1] for "
            "exit-aware training, or exit_kv=none and exit_rate=0",
        )

    @property
    def spec(self) -> ObjectiveSpec:
        return OBJECTIVES[self.kind]

    @property
    def gated(self) -> bool:
        """The objective reads the exit gate."""
        return self.spec.gated

    def trains(self, name: str) -> bool:
        """Whether the parameter `name` (any wrapper prefix) learns."""
        return self.spec.trains is None or self.spec.trains in name

    @property
    def needs_logits(self) -> bool:
        return self.spec.needs_logits


def __getattr__(name: str):
    """The terms (`compute`, `masked_mean`, ...) need torch and megatron-core: imported only
    when asked for, so a config loads without them."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module("megaloop.objectives.losses"), name)
