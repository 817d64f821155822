"""The readout ("exit") of the training model: W_out, tensor-parallel, applied to what the
readout rule (megaloop.model.semantics.READOUTS) says exit k reads.

One W_out serves all exits; when it is tied to the embedding its weight is passed in at call
time. Under Ouro's wiring (model.loop_norm=shared) the readout has no norm of its own: the model
hands it the shared loop norm's output, and a normalising exit reads that.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megaloop.model import semantics
from megaloop.model.config import LoopNorm, ReadoutMode
from megaloop.model.specs import tp_group


class Readout(MegatronModule):
    def __init__(
        self,
        mode: ReadoutMode,
        config: TransformerConfig,
        vocab_size: int,
        tied: bool,
        trained_loops: int,
        loop_norm: LoopNorm = "separate",
    ):
        super().__init__(config=config)
        self.mode, self.trained_loops = mode, trained_loops
        self.norm = semantics.readout_norm(
            mode, config.hidden_size, config.layernorm_epsilon, loop_norm, trained_loops
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

    def forward(
        self,
        h: torch.Tensor,
        loop: int,
        last: int,
        weight: torch.Tensor | None = None,
        norm: semantics.Norm | None = None,
    ) -> torch.Tensor:
        """[s, b, d] → vocab-parallel logits [s, b, V/tp] for exit `loop` (1-based) of a run
        whose last loop is `last`; `norm` is the shared loop norm (semantics.Reused, its output
        of h computed), when the model has one."""
        norm = self.norm if norm is None else norm
        x = semantics.readout_input(self.mode, h, loop, self.trained_loops, last, norm)
        logits, _ = self.output_layer(x, weight=weight)
        return logits
