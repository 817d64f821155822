"""What a step reads: this data-parallel rank's training micro-batches and the data position,
and the validation split's windows.

The position saved in checkpoints is the number of consumed samples (over all DP ranks), so a
resumed run, in any layout, continues where the last one stopped.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class Windows:
    """The validation windows of a token stream, in order: window i is tokens[i·s : i·s + s + 1]
    (s = seq_len), so consecutive windows share one token and every token after the first is a
    target exactly once. The same for every seed, variant and layout."""

    def __init__(
        self, read: Callable[[int, int], np.ndarray], num_tokens: int, seq_len: int, name: str
    ):
        self.read, self.num_tokens, self.seq_len, self.name = read, num_tokens, seq_len, name

    def __len__(self) -> int:
        return max(self.num_tokens - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(
                f"validation window {index} of {self.name}: it has {len(self)} "
                f"windows of data.seq_len+1={self.seq_len + 1} tokens"
            )
        return np.asarray(self.read(index * self.seq_len, self.seq_len + 1), dtype=np.int64)

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self[i] for i in indices]))


class Batches:
    """Indexable data (synthetic, text, megatron-core indexed): a step takes the next
    `global_batch_size` sample indices and this rank its contiguous slice, so resuming is exact
    to the sample."""

    def __init__(
        self,
        dataset,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
    ):
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples

    def next_step(self) -> list[torch.Tensor]:
        """The micro-batches ([micro_batch_size, seq_len + 1] tokens) of the next step."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        self.consumed_samples += self.global_batch_size
        return [
            self.dataset.batch(range(s, s + self.micro_batch_size))
            for s in range(start, start + per_rank, self.micro_batch_size)
        ]
