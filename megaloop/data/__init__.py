"""Training data: what `data.kind` names, built into something a step can read.

    synthetic   built-in corpora (data/synthetic.py), a function of (seed, index)
    text        a UTF-8 text file (data/text.py)
    indexed     megatron-core indexed datasets via GPTDataset (data/indexed.py), from
                `megaloop prep wikitext103`; `data.epochs` sets the training length
    webdataset  packed sequences in tar shards (data/shards.py), from `megaloop prep fineweb`

Every kind is sharded over data-parallel ranks (disjoint samples) and resumes from the number of
consumed samples: exactly for the indexable kinds, at the next shard boundary for webdataset.

Validation is the same for every seed, variant and layout: `batch(indices, split="valid")` reads
the validation split in file order, sample i being its i-th window of seq_len+1 tokens
(batches.Windows; webdataset: the i-th held-out sequence; synthetic: a fixed stream of its own),
and `valid_windows` says how many there are (None for synthetic data, which has no end).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megaloop.config import Config, DataError, check, fail
from megaloop.data.tokenizer import load_tokenizer

__all__ = ["DataConfig", "DataError"]


@dataclass
class DataConfig(Config):
    kind: Literal["synthetic", "text", "indexed", "webdataset"] = "synthetic"
    task: Literal["addition", "lookup"] = "addition"
    """synthetic: fixed-width multi-digit addition, or multi-hop variable lookups."""
    depth: int = 4
    """synthetic: digits per operand (addition) or the longest chain of lookups (lookup)."""
    path: str | None = None
    """text: a text file; indexed: a dataset prefix (DIR/train); webdataset: the prep folder."""
    valid_path: str | None = None
    """text: a validation text file (else the last `valid_fraction` of `path`); indexed: the
    validation prefix (DIR/valid; else the training split itself, which is no held-out score)."""
    valid_fraction: float = 0.05
    tokenizer: str = "bytes"
    """`bytes` (256 tokens) or a tokenizer.json path; indexed and webdataset data bring theirs."""
    seq_len: int = 128
    epochs: int | None = None
    """indexed: train for exactly this many passes over the training split (sets train.steps)."""
    cache_dir: str | None = None
    """indexed: where GPTDataset caches its shuffle indices (default: beside the data)."""
    valid_shards: int = 1
    """webdataset: shards held out (the last ones) for validation."""
    resampled: bool = False
    """webdataset: an endless stream drawing shards with replacement instead of epochs."""

    def validate(self, prefix: str = "") -> None:
        check(self.seq_len >= 2, prefix + "seq_len", self.seq_len, "must be >= 2")
        check(
            1 <= self.depth <= (12 if self.task == "lookup" else 18),
            prefix + "depth",
            self.depth,
            "must lie in [1, 12] for lookup and [1, 18] for addition",
        )
        check(
            0 < self.valid_fraction < 1,
            prefix + "valid_fraction",
            self.valid_fraction,
            "must lie in (0, 1)",
        )
        needs_path = {
            "text": "a text file",
            "indexed": "an indexed dataset prefix such as data/wt103/train",
            "webdataset": "the folder of `megaloop prep fineweb`",
        }
        check(
            self.kind not in needs_path or self.path is not None,
            prefix + "path",
            self.path,
            f"data.kind={self.kind} needs {needs_path.get(self.kind)} (data.path=...)",
        )
        check(
            self.epochs is None or (self.kind == "indexed" and self.epochs >= 1),
            prefix + "epochs",
            self.epochs,
            "is for data.kind=indexed, and must be >= 1",
        )
        check(self.valid_shards >= 1, prefix + "valid_shards", self.valid_shards, "must be >= 1")

    def check_files(self) -> None:
        """Inputs exist (checked when a run is built, so shipped configs validate anywhere)."""
        if self.kind == "text":
            for key in ("path", "valid_path"):
                p = getattr(self, key)
                check(p is None or Path(p).is_file(), "data." + key, p, "no such file")
        if self.kind == "indexed":
            for key in ("path", "valid_path"):
                p = getattr(self, key)
                check(
                    p is None or Path(f"{p}.bin").is_file() and Path(f"{p}.idx").is_file(),
                    "data." + key,
                    p,
                    "no PREFIX.bin/PREFIX.idx there; run `megaloop prep "
                    "wikitext103` and give e.g. data.path=OUT/train",
                )
        if self.kind == "webdataset":
            check(
                Path(self.path, "manifest.json").is_file(),
                "data.path",
                self.path,
                "no manifest.json there; run `megaloop prep fineweb` and give its --out folder",
            )
            self.shard_manifest()
        check(
            self.tokenizer == "bytes" or Path(self.tokenizer).is_file(),
            "data.tokenizer",
            self.tokenizer,
            "no such file; use 'bytes' or the path of a tokenizer.json file",
        )

    def shard_manifest(self) -> dict:
        """The webdataset folder's manifest.json, checked against this config: sequences of
        data.seq_len+1 tokens, and more shards than data.valid_shards."""
        from megaloop.data.indexed import read_json

        path = Path(self.path, "manifest.json")
        info = read_json(path)
        shards = info.get("shards")
        if (
            not isinstance(info.get("seq_len"), int)
            or not isinstance(shards, dict)
            or not all(isinstance(n, int) and n >= 0 for n in shards.values())
        ):
            raise DataError(
                f"{path} lacks `seq_len` (an integer) or `shards` (shard name -> "
                f"sequences); it is not from `megaloop prep fineweb`: prepare again"
            )
        missing = [name for name in sorted(shards) if not Path(self.path, "shards", name).is_file()]
        if missing:
            raise DataError(
                f"{path} lists shard {missing[0]}, but {Path(self.path, 'shards')} "
                f"has no such file ({len(missing)} missing); prepare again"
            )
        check(
            info["seq_len"] == self.seq_len,
            "data.seq_len",
            self.seq_len,
            f"data.path={self.path} holds sequences of {info['seq_len']} (+1) tokens; set "
            f"data.seq_len={info['seq_len']} or prepare again with --seq-len {self.seq_len}",
        )
        check(
            len(shards) > self.valid_shards,
            "data.valid_shards",
            self.valid_shards,
            f"data.path={self.path} has {len(shards)} shard(s): too few to hold out "
            f"{self.valid_shards} for validation and train on the rest",
        )
        return info

    def tokenizer_spec(self) -> str:
        """`bytes` or the tokenizer.json the data was made with (prepared data records its own)."""
        if self.kind in ("indexed", "webdataset"):
            from megaloop.data.indexed import manifest

            info = manifest(self.path) if self.kind == "indexed" else self.shard_manifest()
            if isinstance(info.get("tokenizer"), str) and Path(info["tokenizer"]).is_file():
                return info["tokenizer"]
        return self.tokenizer

    def _tokenizer(self):
        return load_tokenizer(self.tokenizer_spec())

    def build(self, seed: int, train_samples: int = 0):
        """The data for a run that reads `train_samples` training samples (indexed data sizes
        its shuffle to them)."""
        self.check_files()
        tokenizer = self._tokenizer()
        if self.kind == "synthetic":
            from megaloop.data.synthetic import SyntheticDataset

            return SyntheticDataset(self.task, seed, self.seq_len, self.depth, tokenizer)
        if self.kind == "text":
            from megaloop.data.text import TextDataset

            return TextDataset.from_files(
                self.path, self.valid_path, self.valid_fraction, seed, self.seq_len, tokenizer
            )
        if self.kind == "indexed":
            from megaloop.data.indexed import IndexedData

            return IndexedData(
                self.path,
                self.valid_path,
                self.seq_len,
                seed,
                max(train_samples, 1),
                tokenizer,
                self.cache_dir,
            )
        if self.kind == "webdataset":
            from megaloop.data.shards import ShardData

            return ShardData(
                self.path, self.seq_len, seed, self.valid_shards, self.resampled, tokenizer
            )
        fail("data.kind", self.kind, "allowed: synthetic, text, indexed, webdataset")

    def steps_for_epochs(self, global_batch_size: int) -> int:
        from megaloop.data.indexed import samples_for_epochs

        samples = samples_for_epochs(self.path, self.seq_len, self.epochs)
        check(
            samples >= global_batch_size,
            "data.epochs",
            self.epochs,
            f"gives {samples} samples, fewer than one global batch ({global_batch_size})",
        )
        return samples // global_batch_size
