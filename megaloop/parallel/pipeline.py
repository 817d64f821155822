"""The circular pipeline: a looped stack pipelined without copying its weights.

Rank p of P holds the layers [p·L/P, (p+1)·L/P) once. A micro-batch goes around the ring K
times; lap k is virtual stage k of megatron-core's interleaved schedule. The K virtual chunks
of a rank are thin views of one module, so a rank stores one set of parameters and its gradients
accumulate (K times per micro-batch) into one DDP buffer that is reduced once per step.

      rank 0                rank 1               rank P-1
    ┌──────────────┐     ┌──────────┐         ┌────────────────────┐
    │ lap 0: embed │ ──▶ │ layers   │ ─ ... ─▶│ layers → exit k    │──┐
    │ lap k: R(H)  │     │          │         │ (W_out, gate, CE)  │  │ H_k
    │ then layers  │     └──────────┘         └────────────────────┘  │
    └──────────────┘◀───────────────────── lap k+1 ───────────────────┘

Exit k is read on the last rank at the end of lap k. Every objective is a function f of the
per-token exit terms (CE_k, ‖H_k‖²_rms, λ_k) of all K loops, and some couple the loops (the
exit-weighted p_k depends on λ_1..λ_k). The last rank therefore keeps each micro-batch's exit
terms of laps 0..K-2, detached. At the final lap it evaluates f on those stored values (as
leaves) and the live terms of lap K-1: the loss it returns back-propagates through lap K-1 only,
and ∂f/∂(terms of lap j) for j < K-1 is computed there and stored. Each earlier lap passed its
H_j onwards through `ExitCoupling`, an identity whose backward hands those stored gradients to
lap j's own exit graph. So the coupled gradient reaches each lap exactly once, when the
schedule runs that lap backward, and no backward ever crosses into another lap's graph.
"""

from __future__ import annotations

import torch

from megaloop import objectives
from megaloop.model.looped import LoopedLM, LoopOutput


class ExitStore:
    """The last rank's memory of earlier exits, per micro-batch, for one step."""

    def __init__(self):
        self.scale = 1.0
        """d(step loss)/d(micro-batch loss): 1/num_microbatches, set by the engine."""
        self.saved: dict[int, list[tuple]] = {}
        self.grads: dict[tuple[int, int], tuple] = {}

    def reset(self, num_microbatches: int) -> None:
        self.scale = 1.0 / num_microbatches
        self.saved.clear()
        self.grads.clear()


class ExitCoupling(torch.autograd.Function):
    """Identity on H_j; its backward adds ∂f/∂(exit terms of lap j), found at the final lap."""

    @staticmethod
    def forward(ctx, h, store: ExitStore, key: tuple, *terms):
        ctx.store, ctx.key = store, key
        return h.clone()  # a new tensor: the schedule may deallocate what it sends

    @staticmethod
    def backward(ctx, grad_h):
        return (grad_h, None, None, *ctx.store.grads.pop(ctx.key))


class LapChunk(torch.nn.Module):
    """Virtual pipeline stage `lap` of this rank: a view of the rank's module for one lap."""

    def __init__(self, stage: LoopedLM, lap: int, objective, store: ExitStore, pp_rank: int,
                 pp_size: int):
        super().__init__()
        object.__setattr__(self, "stage", stage)  # not a submodule: no second copy of its params
        self.lap, self.num_loops = lap, stage.cfg.num_loops
        self.objective, self.store = objective, store
        self.first_rank, self.last_rank = pp_rank == 0, pp_rank == pp_size - 1
        self.config, self.model_type, self.vp_stage = stage.config, stage.model_type, lap
        self.pre_process = self.first_rank and lap == 0
        self.post_process = self.last_rank and lap == self.num_loops - 1
        self.input_tensor = None
        self.microbatch = 0
        self.terms: dict = {}

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        stage, mb = self.stage, self.microbatch
        self.microbatch += 1
        if self.first_rank:
            h = stage.embedding(tokens, position_ids=None) if self.lap == 0 else stage.recurrence(
                self.input_tensor)
        else:
            h = self.input_tensor
        h = stage.stack(h, stage.rotary_pos_emb(tokens.shape[1]))
        if not self.last_rank:
            return h
        out = LoopOutput()
        stage.exit(out, h, self.lap + 1, labels)
        live = (out.token_ce[0], objectives.mean_square(h), *out.gates)
        if self.lap < self.num_loops - 1:
            self.store.saved.setdefault(mb, []).append(tuple(t.detach() for t in live))
            return ExitCoupling.apply(h, self.store, (mb, self.lap), *live)
        return self.final_loss(mb, live)

    def final_loss(self, mb: int, live: tuple) -> torch.Tensor:
        earlier = [tuple(t.clone().requires_grad_(torch.is_grad_enabled()) for t in terms)
                   for terms in self.store.saved.pop(mb, [])]
        laps = earlier + [live]
        exits = objectives.ExitTerms(ce=[t[0] for t in laps], mean_square=[t[1] for t in laps],
                                     gates=[t[2] for t in laps] if len(live) > 2 else [])
        loss, self.terms = objectives.compute(self.objective, exits)
        leaves = [t for terms in earlier for t in terms]
        if leaves and torch.is_grad_enabled():
            grads = torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True)
            grads = [torch.zeros_like(t) if g is None else g * self.store.scale
                     for t, g in zip(leaves, grads)]
            n = len(live)
            for j in range(len(earlier)):
                self.store.grads[(mb, j)] = tuple(grads[j * n:(j + 1) * n])
        return loss
