"""megatron-core indexed datasets (from `megaloop prep wikitext103`) through megatron-core's
GPTDataset and its dataset builder: samples of seq_len+1 tokens across document boundaries,
shuffled as a function of (seed, epochs) only, so "4 epochs" means four passes over the
training tokens and any sample index is reproducible (exact resume in any layout)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from megaloop.data.batches import Batches
from megaloop.data.tokenizer import Tokenizer


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


class IndexedData:
    def __init__(self, train_prefix: str, valid_prefix: str | None, seq_len: int, seed: int,
                 num_train_samples: int, num_valid_samples: int, tokenizer: Tokenizer,
                 cache_dir: str | None = None):
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        self.seq_len, self.tokenizer = seq_len, tokenizer
        eod = manifest(train_prefix).get("eos_id", tokenizer.eos_id)
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_len,
            blend_per_split=[([train_prefix], None), ([valid_prefix or train_prefix], None), None],
            path_to_cache=cache_dir, create_attention_mask=False, reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False,
            # what GPTDataset asks of a tokenizer (pad is unused: samples carry an extra token)
            tokenizer=SimpleNamespace(eod=eod, pad=-1, vocab_size=tokenizer.vocab_size,
                                      unique_identifiers={"eod": eod,
                                                          "vocab_size": tokenizer.vocab_size}))
        rank0 = not dist.is_initialized() or dist.get_rank() == 0

        def build(on_this_rank: bool):
            return BlendedMegatronDatasetBuilder(
                GPTDataset, [num_train_samples, num_valid_samples, None],
                lambda: on_this_rank, config).build()

        # rank 0 writes the shuffle-index cache, then every rank reads it
        if rank0:
            self.train, self.valid, _ = build(True)
        if dist.is_initialized():
            dist.barrier()
        if not rank0:
            self.train, self.valid, _ = build(True)

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        item = (self.train if split == "train" else self.valid)[index]
        return torch.cat([item["tokens"], item["labels"][-1:]]).numpy()

    def batch(self, indices, split: str = "train") -> torch.Tensor:
        dataset = self.train if split == "train" else self.valid
        rows = []
        for i in indices:
            item = dataset[i]
            rows.append(torch.cat([item["tokens"], item["labels"][-1:]]))
        return torch.stack(rows)

    def batches(self, *args, **kwargs) -> Batches:
        return Batches(self, *args, **kwargs)
