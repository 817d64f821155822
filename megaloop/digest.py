"""The digest of a file, read in blocks (never whole into memory): sha256 where a record names a
file someone may swap (the tokenizer a preparation used, the source text, an export's code),
xxh64 where a checkpoint's manifest rechecks its own shards (several times faster on GBs)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """The hex digest of the file at `path` by `algorithm`, "sha256" or "xxh64"."""
    if algorithm == "xxh64":
        import xxhash

        algorithm = xxhash.xxh64
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()
