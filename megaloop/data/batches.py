"""What a training step reads: this data-parallel rank's micro-batches, and the data position.

The position saved in checkpoints is the number of consumed samples (over all DP ranks), so a
resumed run, in any layout, continues where the last one stopped.
"""

from __future__ import annotations

import torch


class Batches:
    """Indexable data (synthetic, text, megatron-core indexed): a step takes the next
    `global_batch_size` sample indices and this rank its contiguous slice, so resuming is exact
    to the sample."""

    def __init__(self, dataset, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0):
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples

    def next_step(self) -> list[torch.Tensor]:
        """The micro-batches ([micro_batch_size, seq_len + 1] tokens) of the next step."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        self.consumed_samples += self.global_batch_size
        return [self.dataset.batch(range(s, s + self.micro_batch_size))
                for s in range(start, start + per_rank, self.micro_batch_size)]
