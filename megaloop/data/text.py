"""A UTF-8 text file as training data: windows of seq_len+1 tokens at positions drawn from
(seed, sample index). Validation reads the valid text's windows in order (batches.Windows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megaloop.data.batches import Batches, Windows
from megaloop.data.tokenizer import Tokenizer


class TextDataset:
    def __init__(self, splits: dict[str, np.ndarray], seed: int, seq_len: int, tokenizer: Tokenizer):
        self.splits, self.seed, self.seq_len, self.tokenizer = splits, seed, seq_len, tokenizer
        for name, tokens in splits.items():
            if len(tokens) < seq_len + 1:
                raise ValueError(f"the {name} text has {len(tokens)} tokens, fewer than "
                                 f"data.seq_len+1={seq_len + 1}; use a longer text or a shorter "
                                 f"data.seq_len")
        valid = splits["valid"]
        self.valid = Windows(lambda start, n: valid[start:start + n], len(valid), seq_len,
                             "the validation text")

    @property
    def valid_windows(self) -> int:
        return len(self.valid)

    @classmethod
    def from_files(cls, path: str, valid_path, valid_fraction: float, seed: int, seq_len: int,
                   tokenizer: Tokenizer) -> "TextDataset":
        train = tokenizer.encode(Path(path).read_text(encoding="utf-8", errors="replace"))
        if valid_path:
            valid = tokenizer.encode(Path(valid_path).read_text(encoding="utf-8",
                                                                errors="replace"))
        else:
            cut = int(len(train) * (1 - valid_fraction))
            train, valid = train[:cut], train[cut:]
        return cls({"train": train, "valid": valid}, seed, seq_len, tokenizer)

    def sample(self, index: int) -> np.ndarray:
        tokens = self.splits["train"]
        start = np.random.default_rng([self.seed, index]).integers(0, len(tokens) - self.seq_len)
        return tokens[start:start + self.seq_len + 1].astype(np.int64)

    def batch(self, indices, split: str = "train") -> torch.Tensor:
        if split == "valid":
            return self.valid.batch(indices)
        return torch.from_numpy(np.stack([self.sample(i) for i in indices]))

    def batches(self, *args, **kwargs) -> Batches:
        return Batches(self, *args, **kwargs)
