"""What a step reads: this data-parallel rank's training micro-batches and the data position,
the validation split's windows, and the study's overlapping training windows (and validation
windows, with the same stride).

The position saved in checkpoints is the number of consumed samples (over all DP ranks), so a
resumed run, in any layout, continues where the last one stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from megaloop.config import DataError


class Windows:
    """The validation windows of a token stream, in order: window i is tokens[i·t : i·t + s + 1]
    (s = seq_len, t = stride). Without a stride t = s, so consecutive windows share one token
    and every token after the first is a target exactly once; with data.stride they overlap as
    the study's validation windows do (readout-blind-spot src/train_ar_looplm.py: the
    TextChunkDataset of the validation ids with the training stride, read unshuffled). The same
    for every seed, variant and layout."""

    def __init__(
        self,
        read: Callable[[int, int], np.ndarray],
        num_tokens: int,
        seq_len: int,
        name: str,
        stride: int | None = None,
    ):
        self.read, self.num_tokens, self.seq_len, self.name = read, num_tokens, seq_len, name
        self.stride = seq_len if stride is None else stride

    def __len__(self) -> int:
        return strided_windows(self.num_tokens, self.seq_len, self.stride)

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(
                f"validation window {index} of {self.name}: it has {len(self)} windows of "
                f"data.seq_len+1={self.seq_len + 1} tokens, one every {self.stride} tokens"
            )
        return np.asarray(self.read(index * self.stride, self.seq_len + 1), dtype=np.int64)

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self[i] for i in indices]))


def strided_windows(num_tokens: int, seq_len: int, stride: int) -> int:
    """How many windows of seq_len+1 tokens start every `stride` tokens of a stream."""
    return (num_tokens - seq_len - 1) // stride + 1 if num_tokens > seq_len else 0


class StridedWindows:
    """The study's training samples: window j is tokens[j·stride : j·stride + seq_len + 1]
    (overlapping when stride <= seq_len), and sample i is window order(e)[i mod n] of epoch
    e = i // n, each epoch a permutation drawn from (seed, e) alone, so any sample index is
    reproducible (exact resume in any layout) and every epoch visits each window once."""

    def __init__(
        self,
        read: Callable[[int, int], np.ndarray],
        num_tokens: int,
        seq_len: int,
        stride: int,
        seed: int,
        name: str,
    ):
        self.read, self.seq_len, self.stride, self.seed = read, seq_len, stride, seed
        self.windows = strided_windows(num_tokens, seq_len, stride)
        if self.windows == 0:
            raise DataError(
                f"{name} holds {num_tokens} tokens, fewer than one training window of "
                f"data.seq_len+1={seq_len + 1}; lower data.seq_len or prepare more text"
            )
        self._order: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The windows of `epoch` in the order it visits them (the last epoch's is kept)."""
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = epoch, rng.permutation(self.windows)
        return self._order[1]

    def __getitem__(self, index: int) -> np.ndarray:
        epoch, j = divmod(index, self.windows)
        start = int(self.order(epoch)[j]) * self.stride
        return np.asarray(self.read(start, self.seq_len + 1), dtype=np.int64)


class Dataset(Protocol):
    """What training and evaluation read from data of every kind (DataConfig.build): a step's
    micro-batches from `batches`, validation windows by index from `batch(indices, "valid")`,
    and how many there are (None: a stream without end)."""

    tokenizer: object
    valid_windows: int | None

    def batch(self, indices, split: str = "train") -> torch.Tensor: ...

    def batches(self, *args, **kwargs):
        """This rank's micro-batches, step by step (Batches' arguments)."""


class IndexableData:
    """Data whose every sample is a function of its index (synthetic, text, megatron-core
    indexed): a kind gives `sample` and its validation `Windows` (None: `sample(i, "valid")`
    draws them), and batching is written here once."""

    valid: Windows | None = None

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        raise NotImplementedError

    @property
    def valid_windows(self) -> int | None:
        return None if self.valid is None else len(self.valid)

    def batch(self, indices, split: str = "train") -> torch.Tensor:
        if split == "valid" and self.valid is not None:
            return self.valid.batch(indices)
        return torch.from_numpy(np.stack([self.sample(i, split) for i in indices]))

    def batches(self, *args, **kwargs) -> Batches:
        return Batches(self, *args, **kwargs)


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
