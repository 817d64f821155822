"""Tokenizers: raw UTF-8 bytes (256 tokens, nothing to download) or a Hugging Face tokenizer.json."""

from __future__ import annotations

import numpy as np


class Tokenizer:
    vocab_size: int
    eos_id: int | None = None

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = self._tok.token_to_id("<|endoftext|>")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)
