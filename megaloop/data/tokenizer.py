"""Tokenizers: raw UTF-8 bytes (256 tokens, nothing to download) or a Hugging Face
tokenizer.json (a BPE, or the study's word-level vocabulary from `megaloop prep ... words:N`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megaloop.config import DataError

EOS = "<|endoftext|>"
WORD_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
"""The study's special tokens, ids 0-3 of a words:N vocabulary (data_prep.common.train_words)."""
ROLES = {
    "eos_token": (EOS, WORD_SPECIALS[2]),
    "bos_token": (WORD_SPECIALS[1],),
    "pad_token": (WORD_SPECIALS[0],),
    "unk_token": (WORD_SPECIALS[3],),
}
"""The names megaloop's preparations give each special token, by its role in transformers."""


def special_tokens(tok) -> dict[str, str]:
    """The special tokens a `tokenizers.Tokenizer` has, by role (eos_token, bos_token, pad_token,
    unk_token), as transformers' PreTrainedTokenizerFast takes them."""
    found = {}
    for role, names in ROLES.items():
        name = next((n for n in names if tok.token_to_id(n) is not None), None)
        if name is not None:
            found[role] = name
    return found


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

        if not Path(path).is_file():
            raise DataError(
                f"tokenizer {path}: no such file; use 'bytes' or the path of a tokenizer.json file"
            )
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for unparsable JSON
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(
                f"tokenizer {path} is not a Hugging Face tokenizer.json ({reason}); "
                f"give the tokenizer.json the data was prepared with"
            ) from None
        self.vocab_size = self._tok.get_vocab_size()
        eos = special_tokens(self._tok).get("eos_token")
        self.eos_id = None if eos is None else self._tok.token_to_id(eos)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies are spelled
    in)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_level_tokenizer():
    """ByteTokenizer as a `tokenizers.Tokenizer` (token id = byte value), for exports. Its end of
    text is the NUL byte."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tok = _Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


BYTE_EOS = _bytes_to_unicode()[0]
