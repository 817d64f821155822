"""Recurrence control: what H_k becomes before it re-enters the shared stack, and the clamp.

`none` feeds H_k back as is (the pre-norm residual stream carries and grows its scale: the
study's ablation); `rmsnorm` is Ouro's inter-loop RMSNorm; `damping` multiplies H_k by a learned
factor in (0, 1), per channel or one scalar, a contraction of the recurrent map's spectrum.
"""

from __future__ import annotations

import math

import torch

from megaloop.model.config import DampingShape, RecurrenceMode


class Recurrence(torch.nn.Module):
    def __init__(
        self,
        mode: RecurrenceMode,
        hidden_size: int,
        eps: float,
        damping_init: float,
        damping_shape: DampingShape = "channel",
    ):
        super().__init__()
        self.mode = mode
        if mode == "rmsnorm":
            self.norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif mode == "damping":
            logit = math.log(damping_init / (1.0 - damping_init))
            size = hidden_size if damping_shape == "channel" else 1
            self.damping_logit = torch.nn.Parameter(torch.full((size,), logit))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.mode == "rmsnorm":
            return self.norm(h)
        if self.mode == "damping":
            return h * torch.sigmoid(self.damping_logit)
        return h


def rms(h: torch.Tensor) -> torch.Tensor:
    """Per-token root-mean-square over the hidden dimension, keeping that dimension."""
    return h.pow(2).mean(dim=-1, keepdim=True).sqrt()


def clamp_to(h: torch.Tensor, reference_rms: torch.Tensor) -> torch.Tensor:
    """The inference-time recurrent-scale clamp: rescale each token of H_k to its loop-1 RMS."""
    return h * (reference_rms / rms(h).clamp_min(torch.finfo(h.dtype).tiny))
