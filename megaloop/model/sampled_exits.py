"""Exit-aware training: tokens exit at sampled loops, and later tokens' deeper loops attend to
what the decode-time KV policy hands them (objective.exit_kv, objective.exit_rate).

Under `copy` a token that exits at loop e leaves its loop-e keys and values in every deeper
loop's slots (decoding.HeldSlots), so a later token at loop j > e attends to them, not
to the keys and values of a loop the exited token never ran. A plain training forward runs every
token K loops, so a model trained on it has never attended to an exited token: the training
forward here draws each token's exit loop e_t and, at loop j, layer l, gives every query the
keys and values K_l(min(j, e_t)) of token t, which is what `copy` decodes. Every token still runs
(and is scored at) every loop: a token's own loops past its exit are never decoded, but each of
them is a loop some token runs while the others around it have exited.

`share` (one slot a layer, each token's last loop) has no such forward: a token's keys at loop
j < e_t would be those of loop e_t, not computed yet when loop j runs. `recompute` decodes as
the full-depth forward, so it needs no training of its own.
"""

from __future__ import annotations

import torch


def draw(tokens: torch.Tensor, num_loops: int, rate: float) -> torch.Tensor:
    """Each token's exit loop [b, s] for tokens [b, s]: with probability `rate` a loop uniform in
    1..K−1, else K (our choice, in the spirit of LayerSkip's early-exit training: every
    exit pattern a decode may meet, rather than the gate's own)."""
    early = torch.randint(1, num_loops, tokens.shape, device=tokens.device)
    exits = torch.rand(tokens.shape, device=tokens.device) < rate
    return torch.where(exits, early, num_loops)


class SampledExits:
    """One forward's exit loops (given [b, s], kept sequence-first) and, per layer, each token's
    keys and values of its last loop so far (min(loop, exit)): what `copy` leaves in the current
    loop's slots."""

    def __init__(self, exit_loops: torch.Tensor):
        self.exit_loops = exit_loops.t()
        self.loop = 0
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keys_values(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values [s, b, groups, head_dim] at `self.loop` as `copy`
        decodes them: a token's own while it runs, its exit loop's after."""
        if layer in self.held:
            running = (self.exit_loops >= self.loop)[:, :, None, None]
            key = torch.where(running, key, self.held[layer][0])
            value = torch.where(running, value, self.held[layer][1])
        self.held[layer] = (key, value)
        return key, value
