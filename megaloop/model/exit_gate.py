"""Ouro's exit gate: λ_k = sigmoid(Linear(d, 1)(H_k)), the per-token halting probability of loop k.

The exit distribution p_k = λ_k·Π_{j<k}(1 − λ_j) (the last loop takes the remaining mass) is used
by the exit-weighted objective in training and by dynamic halting at inference.
"""

from __future__ import annotations

import torch


class ExitGate(torch.nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[s, b, d] → λ in (0, 1), [s, b]."""
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
