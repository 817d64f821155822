"""Training data as a pure function of (seed, sample index), sliced over data-parallel ranks.

A step takes the next `global_batch_size` sample indices; this rank takes its slice and splits
it into micro-batches. The data position saved in checkpoints is the number of consumed samples,
so resuming (in any layout) continues with exactly the next sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch

from megaloop.config import Config, check
from megaloop.data import synthetic
from megaloop.data.tokenizer import Tokenizer, load_tokenizer


@dataclass
class DataConfig(Config):
    kind: Literal["synthetic", "text"] = "synthetic"
    """synthetic: a built-in corpus (see data/synthetic.py); text: a UTF-8 text file."""
    task: Literal["addition", "lookup"] = "addition"
    """synthetic: fixed-width multi-digit addition, or multi-hop variable lookups."""
    depth: int = 4
    """synthetic: digits per operand (addition) or the longest chain of lookups (lookup)."""
    path: Optional[str] = None
    """text: the training text file."""
    valid_path: Optional[str] = None
    """text: a validation text file; None holds out the last `valid_fraction` of `path`."""
    valid_fraction: float = 0.05
    tokenizer: str = "bytes"
    """`bytes` (256 tokens) or a Hugging Face tokenizer.json path."""
    seq_len: int = 128

    def validate(self, prefix: str = "") -> None:
        check(self.seq_len >= 2, prefix + "seq_len", self.seq_len, "must be >= 2")
        check(1 <= self.depth <= (12 if self.task == "lookup" else 18), prefix + "depth",
              self.depth, "must lie in [1, 12] for lookup and [1, 18] for addition")
        check(0 < self.valid_fraction < 1, prefix + "valid_fraction", self.valid_fraction,
              "must lie in (0, 1)")
        check(self.kind != "text" or self.path is not None, prefix + "path", self.path,
              "data.kind=text needs a text file (data.path=PATH)")

    def check_files(self) -> None:
        """Input files exist (checked when a run is built, so shipped configs validate anywhere)."""
        for key in ("path", "valid_path") if self.kind == "text" else ():
            p = getattr(self, key)
            check(p is None or Path(p).is_file(), "data." + key, p, "no such file")
        check(self.tokenizer == "bytes" or Path(self.tokenizer).is_file(), "data.tokenizer",
              self.tokenizer, "no such file; use 'bytes' or the path of a tokenizer.json file")

    def build(self, seed: int) -> "Dataset":
        self.check_files()
        tokenizer = load_tokenizer(self.tokenizer)
        if self.kind == "synthetic":
            return SyntheticDataset(self.task, seed, self.seq_len, self.depth, tokenizer)
        return TextDataset.from_files(self, seed, tokenizer)


class Dataset:
    """Samples of `seq_len + 1` tokens by index, for the train and valid splits."""

    tokenizer: Tokenizer
    seq_len: int

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        raise NotImplementedError

    def batch(self, indices, split: str = "train") -> torch.Tensor:
        return torch.from_numpy(np.stack([self.sample(i, split) for i in indices]))


class SyntheticDataset(Dataset):
    def __init__(self, task: str, seed: int, seq_len: int, depth: int, tokenizer: Tokenizer):
        self.task, self.seed, self.seq_len, self.depth = task, seed, seq_len, depth
        self.tokenizer = tokenizer

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        seed = self.seed if split == "train" else self.seed + 1_000_003
        return synthetic.sample(self.task, seed, index, self.seq_len + 1, self.depth)


class TextDataset(Dataset):
    """Random windows of a tokenized text; window i starts at a position drawn from (seed, i)."""

    def __init__(self, splits: dict[str, np.ndarray], seed: int, seq_len: int, tokenizer: Tokenizer):
        self.splits, self.seed, self.seq_len, self.tokenizer = splits, seed, seq_len, tokenizer
        for name, tokens in splits.items():
            if len(tokens) < seq_len + 1:
                raise ValueError(f"the {name} text has {len(tokens)} tokens, fewer than "
                                 f"data.seq_len+1={seq_len + 1}; use a longer text or a shorter "
                                 f"data.seq_len")

    @classmethod
    def from_files(cls, cfg: DataConfig, seed: int, tokenizer: Tokenizer) -> "TextDataset":
        train = tokenizer.encode(Path(cfg.path).read_text(encoding="utf-8", errors="replace"))
        if cfg.valid_path:
            valid = tokenizer.encode(Path(cfg.valid_path).read_text(encoding="utf-8",
                                                                   errors="replace"))
        else:
            cut = int(len(train) * (1 - cfg.valid_fraction))
            train, valid = train[:cut], train[cut:]
        return cls({"train": train, "valid": valid}, seed, cfg.seq_len, tokenizer)

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        tokens = self.splits[split]
        start = np.random.default_rng([self.seed, index, split == "valid"]).integers(
            0, len(tokens) - self.seq_len)
        return tokens[start:start + self.seq_len + 1].astype(np.int64)


class Batches:
    """Micro-batches of this data-parallel rank, resumable from `consumed_samples`."""

    def __init__(self, dataset: Dataset, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0):
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def next_step(self) -> list[torch.Tensor]:
        """The micro-batches ([micro_batch_size, seq_len + 1] tokens) of the next step."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        self.consumed_samples += self.global_batch_size
        return [self.dataset.batch(range(s, s + self.micro_batch_size))
                for s in range(start, start + per_rank, self.micro_batch_size)]
