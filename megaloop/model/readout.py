"""The readout ("exit"): how loop k's hidden state H_k becomes logits.

With `norm`, logits = W_out·RMSNorm(H_k): cross-entropy cannot see the scale of H_k
(RMSNorm(cH) = RMSNorm(H)), which is the study's blind spot. `raw` reads W_out·H_k, so scale
changes logits; `final_norm` reads raw for k < K_train and normalised for k >= K_train, where
K_train is the depth the model was trained at: the normalised interface belongs to the trained
final loop, so running the model at another K reads each exit the way it was trained. One W_out
serves all exits; when it is tied to the embedding its weight is passed in at call time. Under
Ouro's wiring (model.loop_norm=shared) the readout has no norm of its own: the model hands it
the shared loop norm's output, and a normalising exit reads that.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megaloop.model.config import ReadoutMode
from megaloop.model.specs import tp_group


class Readout(MegatronModule):
    def __init__(
        self,
        mode: ReadoutMode,
        config: TransformerConfig,
        vocab_size: int,
        tied: bool,
        trained_loops: int,
        own_norm: bool = True,
    ):
        super().__init__(config=config)
        self.mode, self.trained_loops = mode, trained_loops
        self.norm = (
            torch.nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
            if mode != "raw" and own_norm
            else None
        )
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=tied,
            tp_group=tp_group(),
        )

    def normalizes(self, loop: int) -> bool:
        return self.mode == "norm" or (self.mode == "final_norm" and loop >= self.trained_loops)

    def forward(
        self,
        h: torch.Tensor,
        loop: int,
        weight: torch.Tensor | None = None,
        normed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[s, b, d] → vocab-parallel logits [s, b, V/tp] for exit `loop` (1-based); `normed`
        is the shared loop norm's output of h, when the model has one."""
        if self.normalizes(loop):
            h = self.norm(h) if normed is None else normed
        logits, _ = self.output_layer(h, weight=weight)
        return logits
