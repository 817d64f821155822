"""Ouro's exit gate: λ_k = sigmoid(Linear(d, 1)(x_k)), the per-token halting probability of loop k.

x_k is the scale-free direction H_k/‖H_k‖_rms (`normed`, a normalisation without weights, as
Ouro's gate reads a normalised state), or H_k itself (`raw`, an ablation). Under Ouro's wiring
(model.loop_norm=shared) the gate reads the shared loop norm's output, which the model hands
it. Reading raw H_k would give the exit-weighted objective a path through which CE sees hidden
scale, which the study's exit-weighted row assumes is absent: that objective changes CE
weights, not what CE can see.

The exit distribution p_k = λ_k·Π_{j<k}(1 − λ_j) (the last loop takes the remaining mass) is used
by the exit-weighted objective in training and by dynamic halting at inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ExitGate(torch.nn.Module):
    def __init__(self, hidden_size: int, normalize: bool = True, eps: float = 1e-5):
        super().__init__()
        self.normalize, self.eps = normalize, eps
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[s, b, d] → λ in (0, 1), [s, b]."""
        if self.normalize:
            h = F.rms_norm(h, (h.shape[-1],), eps=self.eps)
        return torch.sigmoid(self.proj(h).squeeze(-1))


def exit_probabilities(gates: list[torch.Tensor]) -> torch.Tensor:
    """p_k = λ_k·Π_{j<k}(1 − λ_j) for k < K and p_K = Π_{j<K}(1 − λ_j); stacked on dim 0."""
    survive = torch.ones_like(gates[0])
    probs = []
    for lam in gates[:-1]:
        probs.append(lam * survive)
        survive = survive * (1.0 - lam)
    probs.append(survive)
    return torch.stack(probs)
