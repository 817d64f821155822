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
per-token exit terms (CE_k, ‖H_k‖²_rms, λ_k, and for exit_mixture the logits) of all K loops,
and some couple the loops (the exit-weighted p_k depends on λ_1..λ_k; Ouro's exit mixture is
the CE of Σ_k p_k·logits_k, so it needs every lap's logits). The last rank therefore keeps each
micro-batch's exit terms of laps 0..K-2, detached (for exit_mixture, K-1 logit tensors of
[s, b, V/tp] per micro-batch in flight). At the final lap it evaluates f twice: with those
stored values as leaves and lap K-1's terms detached, which gives ∂f/∂(terms of lap j) for
j < K-1, stored; and with the live terms of lap K-1, the loss it returns, which
back-propagates through lap K-1 only. Each earlier lap passed its H_j onwards through
`ExitCoupling`, an identity whose backward hands those stored gradients to lap j's own exit
graph. So the coupled gradient reaches each lap exactly once, when the schedule runs that lap
backward, and no backward ever crosses into another lap's graph.
Under Ouro's shared loop norm the last rank sends N(H_k) onwards instead of H_k.
What a rank sends is cast to megatron-core's pipeline_dtype (fp32), the dtype every rank
receives into: under bf16 autocast a residual stream that is bf16 (model.fp32_residual off)
goes out as fp32, exactly.
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

    def __init__(
        self, stage: LoopedLM, lap: int, objective, store: ExitStore, pp_rank: int, pp_size: int
    ):
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
        h = self.input_tensor
        if self.first_rank:
            h = stage.enter(tokens if self.lap == 0 else h, self.lap + 1)
        h = stage.stack(h, stage.rotary(tokens.shape[1]))
        if not self.last_rank:
            return h.to(self.config.pipeline_dtype)
        out = LoopOutput()
        onward = stage.exit(
            out, h, self.lap + 1, self.num_loops, labels, self.objective.needs_logits
        )
        live = (out.token_ce[0], objectives.mean_square(h), *out.gates, *out.logits)
        if self.lap < self.num_loops - 1:
            self.store.saved.setdefault(mb, []).append(tuple(t.detach() for t in live))
            onward = onward.to(self.config.pipeline_dtype)
            return ExitCoupling.apply(onward, self.store, (mb, self.lap), *live)
        return self.final_loss(mb, live, labels)

    def final_loss(self, mb: int, live: tuple, labels: torch.Tensor) -> torch.Tensor:
        earlier = self.store.saved.pop(mb, [])
        if earlier and torch.is_grad_enabled():
            # f with the earlier laps' terms as leaves and this lap's detached: its gradients
            # for the earlier laps, handed back through ExitCoupling. A graph of its own, so no
            # backward runs twice through one graph (megatron-core's CE backward is in place).
            leaves = [tuple(t.detach().requires_grad_() for t in terms) for terms in earlier]
            f, _ = objectives.compute(
                self.objective, self.exit_terms(leaves + [tuple(t.detach() for t in live)], labels)
            )
            flat = [t for terms in leaves for t in terms]
            grads = torch.autograd.grad(f, flat, allow_unused=True)
            grads = [None if g is None else g * self.store.scale for g in grads]
            n = len(live)
            for j in range(len(earlier)):
                self.store.grads[(mb, j)] = tuple(grads[j * n : (j + 1) * n])
        loss, self.terms = objectives.compute(
            self.objective, self.exit_terms(earlier + [live], labels)
        )
        return loss

    def exit_terms(self, laps: list[tuple], labels: torch.Tensor) -> objectives.ExitTerms:
        """Each lap's (CE, ‖H‖²_rms, [λ], [logits]) as the objective's ExitTerms."""
        gated, mixture = self.objective.gated, self.objective.needs_logits
        return objectives.ExitTerms(
            ce=[t[0] for t in laps],
            mean_square=[t[1] for t in laps],
            gates=[t[2] for t in laps] if gated else [],
            logits=[t[-1] for t in laps] if mixture else [],
            labels=labels,
        )
