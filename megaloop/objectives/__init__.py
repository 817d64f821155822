"""Training objectives over the K exits, and the norm penalty that combines with any of them.

    terminal       CE_K
    per_loop       (1/K)·Σ_k CE_k
    exit_weighted  Σ_k p_k·CE_k − β·H(p),  p_k = λ_k·Π_{j<k}(1 − λ_j), p_K the remaining mass
    exit_mixture   CE(Σ_k p_k·logits_k)     Ouro's label path: CE of the exit-weighted mixture
                                            of logits, no entropy term (the study's 1.4B runs)
    gate_gain      (1/(K−1))·Σ_{k<K} BCE(1 − λ_k, w_k),   w_k = σ(s·(max(0, CE_k − CE_{k+1}) − γ))
                                            Ouro's stage 2: the gate alone learns whether the
                                            next loop still lowers the token's CE (by γ); every
                                            other parameter is frozen (`trains`)
    norm_penalty   λ·(1/K)·Σ_k E_tokens ‖H_k‖²_rms          (added when λ > 0)

The two-stage recipe for learned exits (Ouro's): stage 1 trains the model with kind=exit_weighted
and an entropy bonus; stage 2 starts from its checkpoint (train.init_from) with kind=gate_gain.

CE_k and the exit-weighted terms are token means under the loss mask. Every term is also
returned per loop, detached, for logging, with the distribution of ‖H_k‖_rms over the (masked)
tokens of the micro-batch: its mean `hidden_rms`, p50, p99 and max (a mean hides the heavy tail
in which per-token drift shows first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megaloop.config import Config, check


@dataclass
class ObjectiveConfig(Config):
    kind: Literal["terminal", "per_loop", "exit_weighted", "exit_mixture", "gate_gain"] = "per_loop"
    """The loss over the K exits (the table above)."""
    entropy_beta: float = 0.0
    """β: weight of the exit-distribution entropy bonus (exit_weighted only)."""
    gate_min_gain: float = 0.005
    """γ of gate_gain: the CE (nats) the next loop must gain for a token to go on (Ouro's
    stage 2 uses 0.005)."""
    gate_sharpness: float = 50.0
    """s of gate_gain: how sharply the target turns from exit to continue around γ (Ouro's 50)."""
    norm_penalty: float = 0.0
    """λ: weight of the hidden-norm penalty (1/K)·Σ_k E‖H_k‖²_rms; 0 turns it off."""

    def validate(self, prefix: str = "") -> None:
        check(self.entropy_beta >= 0, prefix + "entropy_beta", self.entropy_beta, "must be >= 0")
        check(
            self.entropy_beta == 0 or self.kind == "exit_weighted",
            prefix + "entropy_beta",
            self.entropy_beta,
            "is only used by kind=exit_weighted; set it to 0",
        )
        check(self.norm_penalty >= 0, prefix + "norm_penalty", self.norm_penalty, "must be >= 0")
        check(self.gate_min_gain >= 0, prefix + "gate_min_gain", self.gate_min_gain, "must be >= 0")
        check(
            self.gate_sharpness > 0, prefix + "gate_sharpness", self.gate_sharpness, "must be > 0"
        )

    @property
    def gated(self) -> bool:
        """The objective reads the exit gate."""
        return self.kind in ("exit_weighted", "exit_mixture", "gate_gain")

    def trains(self, name: str) -> bool:
        """Whether the parameter `name` (any wrapper prefix) learns: under gate_gain only the
        exit gate's, the rest of the model stays as stage 1 left it."""
        return self.kind != "gate_gain" or "exit_gate." in name

    @property
    def needs_logits(self) -> bool:
        """The loss is a function of the exits' logits, not only of their CE."""
        return self.kind == "exit_mixture"


def __getattr__(name: str):
    """The terms (`compute`, `masked_mean`, ...) need torch and megatron-core: imported only
    when asked for, so a config loads without them."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module("megaloop.objectives.losses"), name)
