"""megatron-core indexed datasets (from `megaloop prep wikitext103`).

Training goes through megatron-core's GPTDataset and its dataset builder: samples of seq_len+1
tokens across document boundaries, shuffled as a function of (seed, epochs) only, so "4 epochs"
means four passes over the training tokens and any sample index is reproducible (exact resume in
any layout). Validation does not shuffle: it reads the valid prefix's documents back to back in
the order they are stored, straight from megatron-core's IndexedDataset, and cuts that stream
into windows in order (batches.Windows), the same for every seed and variant.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from megaloop.data.batches import Batches, Windows
from megaloop.data.tokenizer import Tokenizer
from megaloop.parallel import comm


def manifest(prefix: str) -> dict:
    path = Path(f"{prefix}.manifest.json")
    return json.loads(path.read_text()) if path.is_file() else {}


def samples_for_epochs(prefix: str, seq_len: int, epochs: int) -> int:
    """Samples that make exactly `epochs` passes: GPTDataset needs num_samples*seq_len + 1
    tokens, so this is the most that fits in `epochs` copies of the split."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)  # keep it alive: its arrays are views of its mmap
    tokens = int(np.sum(dataset.sequence_lengths))
    return (epochs * tokens - 1) // seq_len


class TokenStream:
    """The documents of an indexed dataset back to back, in the order they are stored."""

    def __init__(self, prefix: str):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.dataset = IndexedDataset(prefix)
        self.lengths = self.dataset.sequence_lengths.astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)])
        self.num_tokens = int(self.starts[-1])

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the stream, across document boundaries."""
        parts = []
        doc = int(np.searchsorted(self.starts, start, side="right")) - 1
        while count > 0:
            offset = start - int(self.starts[doc])
            n = min(count, int(self.lengths[doc]) - offset)
            parts.append(self.dataset.get(doc, offset, n))
            start, count, doc = start + n, count - n, doc + 1
        return np.concatenate(parts).astype(np.int64)


class IndexedData:
    def __init__(self, train_prefix: str, valid_prefix: str | None, seq_len: int, seed: int,
                 num_train_samples: int, tokenizer: Tokenizer, cache_dir: str | None = None):
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        self.seq_len, self.tokenizer = seq_len, tokenizer
        eod = manifest(train_prefix).get("eos_id", tokenizer.eos_id)
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_len,
            blend_per_split=[([train_prefix], None), None, None],
            path_to_cache=cache_dir, create_attention_mask=False, reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False,
            # what GPTDataset asks of a tokenizer (pad is unused: samples carry an extra token)
            tokenizer=SimpleNamespace(eod=eod, pad=-1, vocab_size=tokenizer.vocab_size,
                                      unique_identifiers={"eod": eod,
                                                          "vocab_size": tokenizer.vocab_size}))
        rank0 = not dist.is_initialized() or dist.get_rank() == 0

        def build():
            return BlendedMegatronDatasetBuilder(
                GPTDataset, [num_train_samples, None, None], lambda: True, config).build()[0]

        # rank 0 writes the shuffle-index cache, then every rank reads it
        if rank0:
            self.train = build()
        comm.barrier()
        if not rank0:
            self.train = build()
        # without a valid prefix, the training split's own windows (a smoke check, not held out)
        stream = TokenStream(valid_prefix or train_prefix)
        self.valid = Windows(stream.read, stream.num_tokens, seq_len, valid_prefix or train_prefix)

    @property
    def valid_windows(self) -> int:
        return len(self.valid)

    def sample(self, index: int) -> np.ndarray:
        item = self.train[index]
        return torch.cat([item["tokens"], item["labels"][-1:]]).numpy()

    def batch(self, indices, split: str = "train") -> torch.Tensor:
        if split == "valid":
            return self.valid.batch(indices)
        return torch.from_numpy(np.stack([self.sample(i) for i in indices]))

    def batches(self, *args, **kwargs) -> Batches:
        return Batches(self, *args, **kwargs)
