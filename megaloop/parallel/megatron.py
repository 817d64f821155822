"""The megatron engine: wraps the model for megatron-core's DDP and runs its schedules.

This is where parallelism is applied; the model and the train loop only see `Engine`.
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megaloop.model import ModelConfig
from megaloop.model.looped import LoopedLM
from megaloop.model.specs import transformer_config


class Engine:
    """Model chunks wrapped in megatron-core DDP, and the forward-backward schedule for them."""

    def __init__(self, model_cfg: ModelConfig, seq_len: int, micro_batch_size: int):
        self.config = transformer_config(model_cfg)
        self.module = LoopedLM(model_cfg, self.config)
        self.ddp = DistributedDataParallel(
            self.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), self.module)
        self.config.no_sync_func = self.ddp.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.chunks = [self.ddp]
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size

    def forward_backward(self, forward_step, microbatches: list, forward_only: bool = False):
        """Run the schedule over `microbatches`; returns the loss_func outputs of this rank."""
        if not forward_only:
            self.ddp.zero_grad_buffer()
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(microbatches), model=self.chunks,
            num_microbatches=len(microbatches), seq_length=self.seq_len,
            micro_batch_size=self.micro_batch_size, forward_only=forward_only)

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)
