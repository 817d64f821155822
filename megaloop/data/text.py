"""A UTF-8 text file as training data: windows of seq_len+1 tokens at positions drawn from
(seed, sample index). Validation reads the valid text's windows in order (batches.Windows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megaloop.config import DataError
from megaloop.data.batches import IndexableData, Windows
from megaloop.data.tokenizer import Tokenizer


def read_text(path: str, key: str) -> str:
    """The file as UTF-8 text, or one DataError naming `key`, the file and the first bad byte
    (a file that is not text is refused rather than trained on as replacement characters)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{key}={path}: cannot be read ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"{key}={path} is not UTF-8 text: byte {e.start} (line {line}) is "
            f"{raw[e.start : e.start + 1]!r}; convert it to UTF-8 (e.g. iconv -t "
            f"utf-8) or give a text file"
        ) from None


class TextDataset(IndexableData):
    def __init__(
        self,
        splits: dict[str, np.ndarray],
        seed: int,
        seq_len: int,
        tokenizer: Tokenizer,
        names: dict[str, str] | None = None,
    ):
        self.splits, self.seed, self.seq_len, self.tokenizer = splits, seed, seq_len, tokenizer
        for name, tokens in splits.items():
            if len(tokens) < seq_len + 1:
                source = (names or {}).get(name, f"the {name} text")
                raise DataError(
                    f"{source} has {len(tokens)} tokens, fewer than "
                    f"data.seq_len+1={seq_len + 1}; use a longer text or a shorter "
                    f"data.seq_len"
                )
        valid = splits["valid"]
        self.valid = Windows(
            lambda start, n: valid[start : start + n], len(valid), seq_len, "the validation text"
        )

    @classmethod
    def from_files(
        cls,
        path: str,
        valid_path,
        valid_fraction: float,
        seed: int,
        seq_len: int,
        tokenizer: Tokenizer,
    ) -> TextDataset:
        train = tokenizer.encode(read_text(path, "data.path"))
        if valid_path:
            valid = tokenizer.encode(read_text(valid_path, "data.valid_path"))
            names = {"train": f"data.path={path}", "valid": f"data.valid_path={valid_path}"}
        else:
            cut = int(len(train) * (1 - valid_fraction))
            train, valid = train[:cut], train[cut:]
            names = {
                "train": f"data.path={path} (its first {1 - valid_fraction:.0%})",
                "valid": f"data.path={path} (its last data.valid_fraction="
                f"{valid_fraction:g}, the validation text)",
            }
        return cls({"train": train, "valid": valid}, seed, seq_len, tokenizer, names)

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        tokens = self.splits["train"]
        start = np.random.default_rng([self.seed, index]).integers(0, len(tokens) - self.seq_len)
        return tokens[start : start + self.seq_len + 1].astype(np.int64)
