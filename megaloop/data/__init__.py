"""Training data: what `data.kind` names, built into something a step can read.

    synthetic   SyntheticConfig: built-in corpora (data/synthetic.py), a function of (seed, index)
    text        TextConfig: a UTF-8 text file (data/text.py)
    indexed     IndexedConfig: megatron-core indexed datasets via GPTDataset (data/indexed.py),
                from `megaloop prep wikitext103`; `data.epochs` sets the training length,
                `data.stride` reads the study's overlapping windows instead
    webdataset  WebDatasetConfig: packed sequences in tar shards (data/shards.py), from
                `megaloop prep fineweb`

The `data:` section stays one flat mapping in YAML; `data.kind` picks its config class, whose
fields are the only keys allowed besides those every kind has (DataConfig: kind, seq_len,
tokenizer). A key of another kind is an error naming both kinds; `null` drops it, so a command
line can switch kinds on a file that sets them (`switch_overrides`).

Every kind is sharded over data-parallel ranks (disjoint samples) and resumes from the number of
consumed samples: exactly for the indexable kinds, at the next shard boundary for webdataset.

Validation is the same for every seed, variant and layout: `batch(indices, split="valid")` reads
the validation split in file order, sample i being its i-th window of seq_len+1 tokens, one
every seq_len tokens or, for indexed data with `data.stride`, one every `stride` tokens as the
study's validation does (batches.Windows; webdataset: the i-th held-out sequence; synthetic: a
fixed stream of its own), and `valid_windows` says how many there are (None for synthetic data,
which has no end).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from megaloop.config import Config, DataError, check, fail
from megaloop.data.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from megaloop.data.batches import Dataset

__all__ = [
    "KINDS",
    "DataConfig",
    "DataError",
    "IndexedConfig",
    "SyntheticConfig",
    "TextConfig",
    "WebDatasetConfig",
    "switch_overrides",
]


@dataclass
class DataConfig(Config):
    """What every kind has. `from_dict` returns the config class of `data.kind` (KINDS)."""

    kind: Literal["synthetic", "text", "indexed", "webdataset"] = "synthetic"
    """Where windows come from: a built-in corpus, a text file, prepared token shards, or
    webdataset shards; each kind adds its own keys."""
    seq_len: int = 128
    """Tokens a training window feeds the model (the window holds one more, the last target)."""
    tokenizer: str = "bytes"
    """`bytes` (256 tokens) or a tokenizer.json path; indexed and webdataset data bring theirs."""
    epochs: ClassVar[int | None] = None
    """Passes over the training split that set train.steps: indexed data only."""

    @classmethod
    def from_dict(cls, data: dict, prefix: str = "") -> DataConfig:
        if cls is not DataConfig or not isinstance(data, dict):
            return super().from_dict(data, prefix)
        kind = data.get("kind", "synthetic")
        if kind not in tuple(KINDS):
            fail(prefix + "kind", kind, f"allowed: {', '.join(KINDS)}")
        section = KINDS[kind]
        own = section.keys()
        foreign = {k: v for k, v in data.items() if k not in own and k in ALL_KEYS}
        for key, value in foreign.items():
            if value is not None:
                owners = " or ".join(f"data.kind={k}" for k, c in KINDS.items() if key in c.keys())
                fail(
                    prefix + key,
                    value,
                    f"is a key of {owners}, not of data.kind={kind} (whose keys are "
                    f"{', '.join(sorted(own))}); remove it, or give {prefix}{key}=null to drop "
                    f"it where a file sets it",
                )
        return section.from_dict({k: v for k, v in data.items() if k not in foreign}, prefix)

    @classmethod
    def keys(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @staticmethod
    def own_keys_only(section: dict) -> dict:
        """The data section without other kinds' keys: how a checkpoint's config from an older
        megaloop, which saved every kind's keys, is read."""
        kind = section.get("kind", "synthetic")
        own = KINDS[kind].keys() if kind in tuple(KINDS) else ALL_KEYS
        return {k: v for k, v in section.items() if k in own or k not in ALL_KEYS}

    def validate(self, prefix: str = "") -> None:
        check(self.seq_len >= 2, prefix + "seq_len", self.seq_len, "must be >= 2")

    def check_files(self) -> None:
        """Inputs exist (checked when a run is built, so shipped configs validate anywhere)."""
        check(
            self.tokenizer == "bytes" or Path(self.tokenizer).is_file(),
            "data.tokenizer",
            self.tokenizer,
            "no such file; use 'bytes' or the path of a tokenizer.json file",
        )

    def tokenizer_spec(self) -> str:
        """`bytes` or the tokenizer.json the data was made with (prepared data records its own)."""
        return self.tokenizer

    def check_vocab(self, vocab_size: int, tokenizer_vocab: int) -> None:
        """Every token id the data can hold fits a model of `vocab_size` embeddings (an id past
        the embedding would fail mid-run, not here)."""
        check(
            vocab_size >= tokenizer_vocab,
            "model.vocab_size",
            vocab_size,
            f"must be >= the tokenizer's {tokenizer_vocab} tokens (of data.kind={self.kind})",
        )

    def build(self, seed: int, train_samples: int = 0) -> Dataset:
        """The data for a run that reads `train_samples` training samples (indexed data sizes
        its shuffle to them); inputs are checked first."""
        self.check_files()
        return self._build(seed, train_samples, load_tokenizer(self.tokenizer_spec()))

    def _build(self, seed: int, train_samples: int, tokenizer):
        raise NotImplementedError


MAX_DEPTH = {"addition": 18, "lookup": 12, "chase": 5}
"""chase: synthetic.CHASE_MOST_HOPS, the hop counts its query bytes can name."""


@dataclass
class SyntheticConfig(DataConfig):
    kind: Literal["synthetic"] = "synthetic"
    task: Literal["addition", "lookup", "chase"] = "addition"
    """Fixed-width multi-digit addition, multi-hop variable lookups, or pointer chasing."""
    depth: int = 4
    """Digits per operand (addition), the longest chain of lookups (lookup), or the most hops
    asked (chase: one query per hop count 1..depth)."""

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check(
            1 <= self.depth <= MAX_DEPTH[self.task],
            prefix + "depth",
            self.depth,
            "must lie in [1, 18] for addition, [1, 12] for lookup and [1, 5] for chase",
        )

    def _build(self, seed: int, train_samples: int, tokenizer):
        from megaloop.data.synthetic import SyntheticDataset

        return SyntheticDataset(self.task, seed, self.seq_len, self.depth, tokenizer)


@dataclass
class _OnDisk(DataConfig):
    """A kind read from files at `path`, which it needs."""

    path: str | None = None
    """The file or folder the data is read from."""
    needs: ClassVar[str]
    """What `path` names, for the error when it is missing."""

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check(
            self.path is not None,
            prefix + "path",
            None,
            f"data.kind={self.kind} needs {self.needs} (data.path=...)",
        )


@dataclass
class TextConfig(_OnDisk):
    kind: Literal["text"] = "text"
    needs: ClassVar[str] = "a text file"
    valid_path: str | None = None
    """A validation text file (else the last `valid_fraction` of `path`)."""
    valid_fraction: float = 0.05
    """The share of `path` held out for validation when no `valid_path` is given."""

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check(
            0 < self.valid_fraction < 1,
            prefix + "valid_fraction",
            self.valid_fraction,
            "must lie in (0, 1)",
        )

    def check_files(self) -> None:
        for key in ("path", "valid_path"):
            p = getattr(self, key)
            check(p is None or Path(p).is_file(), "data." + key, p, "no such file")
        super().check_files()

    def _build(self, seed: int, train_samples: int, tokenizer):
        from megaloop.data.text import TextDataset

        return TextDataset.from_files(
            self.path, self.valid_path, self.valid_fraction, seed, self.seq_len, tokenizer
        )


@dataclass
class IndexedConfig(_OnDisk):
    kind: Literal["indexed"] = "indexed"
    needs: ClassVar[str] = "an indexed dataset prefix such as data/wt103/train"
    valid_path: str | None = None
    """The validation prefix (DIR/valid; else the training split itself, which is no held-out
    score)."""
    epochs: int | None = None
    """Train for exactly this many passes over the training split (sets train.steps)."""
    cache_dir: str | None = None
    """Where GPTDataset caches its shuffle indices (default: beside the data)."""
    stride: int | None = None
    """The study's samples: windows of seq_len+1 tokens of the training split's documents back to
    back, starting every `stride` tokens (overlapping below seq_len+1; the study: 128 at seq_len
    256), each epoch in its own shuffled order; the validation split's windows start every
    `stride` tokens too, in order. Null: megatron-core's GPTDataset, and validation windows
    every seq_len tokens."""

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check(
            self.epochs is None or self.epochs >= 1, prefix + "epochs", self.epochs, "must be >= 1"
        )
        check(
            self.stride is None or 1 <= self.stride <= self.seq_len + 1,
            prefix + "stride",
            self.stride,
            f"must lie in [1, data.seq_len+1={self.seq_len + 1}] (a longer stride skips tokens "
            f"no window holds), or null for megatron-core's GPTDataset samples",
        )

    def check_files(self) -> None:
        for key in ("path", "valid_path"):
            p = getattr(self, key)
            check(
                p is None or Path(f"{p}.bin").is_file() and Path(f"{p}.idx").is_file(),
                "data." + key,
                p,
                "no PREFIX.bin/PREFIX.idx there; run `megaloop prep "
                "wikitext103` and give e.g. data.path=OUT/train",
            )
        super().check_files()

    def check_vocab(self, vocab_size: int, tokenizer_vocab: int) -> None:
        """And every id the prepared files hold (from the manifest `megaloop prep` writes, or
        by reading them)."""
        from megaloop.data.indexed import check_indexed

        super().check_vocab(vocab_size, tokenizer_vocab)
        for prefix in dict.fromkeys(p for p in (self.path, self.valid_path) if p):
            check_indexed(prefix, vocab_size)

    def tokenizer_spec(self) -> str:
        from megaloop.data.indexed import manifest

        return _recorded_tokenizer(manifest(self.path), Path(self.path).parent, self.tokenizer)

    def _build(self, seed: int, train_samples: int, tokenizer):
        from megaloop.data.indexed import IndexedData

        return IndexedData(
            self.path,
            self.valid_path,
            self.seq_len,
            seed,
            max(train_samples, 1),
            tokenizer,
            self.cache_dir,
            self.stride,
        )

    def steps_for_epochs(self, global_batch_size: int) -> int:
        from megaloop.data.indexed import samples_for_epochs

        samples = samples_for_epochs(self.path, self.seq_len, self.epochs, self.stride)
        check(
            samples >= global_batch_size,
            "data.epochs",
            self.epochs,
            f"gives {samples} samples, fewer than one global batch ({global_batch_size})",
        )
        return samples // global_batch_size


@dataclass
class WebDatasetConfig(_OnDisk):
    kind: Literal["webdataset"] = "webdataset"
    needs: ClassVar[str] = "the folder of `megaloop prep fineweb`"
    valid_shards: int = 1
    """Shards held out (the last ones) for validation."""
    resampled: bool = False
    """An endless stream drawing shards with replacement instead of epochs."""

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check(self.valid_shards >= 1, prefix + "valid_shards", self.valid_shards, "must be >= 1")

    def check_files(self) -> None:
        check(
            Path(self.path, "manifest.json").is_file(),
            "data.path",
            self.path,
            "no manifest.json there; run `megaloop prep fineweb` and give its --out folder",
        )
        self.shard_manifest()
        super().check_files()

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
        return _recorded_tokenizer(self.shard_manifest(), Path(self.path), self.tokenizer)

    def _build(self, seed: int, train_samples: int, tokenizer):
        from megaloop.data.shards import ShardData

        return ShardData(
            self.path, self.seq_len, seed, self.valid_shards, self.resampled, tokenizer
        )


def _recorded_tokenizer(manifest: dict, folder: Path, given: str) -> str:
    """The tokenizer.json a preparation recorded (with its sha256): at its recorded path, else
    the file of that name in the prepared folder (moved, or recorded relative to another
    directory). Found nowhere, `given` (data.tokenizer) if it names a file; never `bytes` in its
    place, which would read the data with another vocabulary."""
    from megaloop.digest import file_digest

    recorded, digest = manifest.get("tokenizer"), manifest.get("tokenizer_sha256")
    if not isinstance(recorded, str):
        return given
    for path in (Path(recorded), folder / Path(recorded).name):
        if path.is_file() and digest in (None, file_digest(path)):
            return str(path)
    if given != "bytes":
        return given
    raise DataError(
        f"the data in {folder} was prepared with the tokenizer {recorded} (sha256 {digest}), "
        f"which is neither there nor in {folder}; set data.tokenizer=PATH to that tokenizer.json"
    )


KINDS: dict[str, type[DataConfig]] = {
    c.kind: c for c in (SyntheticConfig, TextConfig, IndexedConfig, WebDatasetConfig)
}
ALL_KEYS = set().union(*(c.keys() for c in KINDS.values()))


def switch_overrides(kind: str) -> list[str]:
    """Overrides that switch a config to `kind` whatever kind its files set (other kinds'
    keys dropped), e.g. a benchmark of a real-data config on synthetic tokens."""
    return [f"data.kind={kind}", *(f"data.{k}=null" for k in sorted(ALL_KEYS - KINDS[kind].keys()))]
