"""What a `megaloop prep` recipe is asked to do: one typed config per recipe, checked when built.

The command line builds them (`from_args`); the bench and the tests build them directly. Field
names are the flags' names (`--max-doc-bytes` is `max_doc_bytes`), so an error names the flag.
Kept free of datatrove so that `megaloop --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megaloop.config import ConfigError

DEFAULT_VOCAB = 20480
EOS = "<|endoftext|>"
WORDS_EOS = "<eos>"
"""What ends a document under a words:N tokenizer (megaloop.data.tokenizer.WORD_SPECIALS)."""
MAX_DOC_BYTES = 10 * 2**20
TRAINED = {"train": (1, DEFAULT_VOCAB), "words": (5, 20000)}
"""The tokenizers trained here (`KIND:N`): the least N of each (a words:N vocabulary holds its 4
special tokens and at least one word) and the usual one (the study's 20,000 words)."""


class PrepError(ConfigError):
    """Bad input that leaves nothing to prepare, or a bad option, named by its flag: one
    message, no traceback (a ConfigError, as every bad input of megaloop is)."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def trained_tokenizer(spec: str) -> tuple[str, int] | None:
    """(kind, N) of a `--tokenizer` trained here (train:N, words:N); None for a file or hub
    name. A bad N is one PrepError naming the spec and the fix."""
    kind, colon, size = spec.partition(":")
    if kind not in TRAINED or not colon:
        return None
    least, usual = TRAINED[kind]
    if not (size.isascii() and size.isdigit() and int(size) >= least):
        raise PrepError(
            f"--tokenizer {spec!r}: use {kind}:N with N an integer >= {least}, e.g. {kind}:{usual}"
        )
    return kind, int(size)


@dataclass
class ExecutorConfig:
    """Where datatrove runs the pipeline's tasks: here (processes) or as a Slurm job array."""

    executor: Literal["local", "slurm"] = "local"
    workers: int = 1
    """local: processes; slurm: concurrent array tasks (-1: no limit)."""
    partition: str | None = None
    time: str = "04:00:00"
    """slurm: the time limit of each task."""
    cpus_per_task: int = 1
    max_array_size: int = 1001
    job_name: str = "megaloop-prep"

    def __post_init__(self) -> None:
        if self.executor not in ("local", "slurm"):
            raise PrepError(f"--executor {self.executor}: use local or slurm")
        if self.executor == "slurm" and not self.partition:
            raise PrepError("--executor slurm needs --partition")
        if self.workers == 0 or self.workers < -1:
            raise PrepError(f"--workers {self.workers}: use a positive number (or -1 on slurm)")
        for name in ("cpus_per_task", "max_array_size"):
            if getattr(self, name) < 1:
                raise PrepError(f"{_flag(name)} {getattr(self, name)}: use a positive number")


@dataclass(kw_only=True)
class RecipeConfig:
    """Options every recipe shares; `recipe` names the data_prep module that runs it."""

    recipe: ClassVar[str]
    out: str
    tokenizer: str
    eos_token: str | None = None
    """The token that ends each document; None: the tokenizer's own (<eos> for words:N,
    <|endoftext|> otherwise). WikiText's stream layout ends with none: None stays."""
    max_doc_bytes: int = MAX_DOC_BYTES
    """Larger single documents are dropped (and counted)."""
    execution: ExecutorConfig = field(default_factory=ExecutorConfig)

    def __post_init__(self) -> None:
        trained = trained_tokenizer(self.tokenizer)
        if self.eos_token is None:
            self.eos_token = WORDS_EOS if trained and trained[0] == "words" else EOS
        if self.max_doc_bytes < 1:
            raise PrepError(f"--max-doc-bytes {self.max_doc_bytes}: use a positive number")
        if not self.eos_token:
            raise PrepError("--eos-token is empty: give the token that ends each document")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RecipeConfig:
        """The config of parsed `megaloop prep NAME` options (flags and fields share names)."""
        given = vars(args)
        executor = {f.name: given[f.name] for f in dataclasses.fields(ExecutorConfig)}
        own = {
            f.name: given[f.name]
            for f in dataclasses.fields(cls)
            if f.init and f.name != "execution" and f.name in given
        }
        return cls(**own, execution=ExecutorConfig(**executor))


@dataclass(kw_only=True)
class WikiTextConfig(RecipeConfig):
    """`megaloop prep wikitext103`: raw WikiText-103 splits → megatron-core indexed datasets."""

    recipe: ClassVar[str] = "wikitext103"
    tokenizer: str = f"train:{DEFAULT_VOCAB}"
    """A tokenizer.json path, a hub name, train:N (a byte-level BPE trained on the train split),
    or words:N (the study's word-level vocabulary, at most N tokens, counted row by row over the
    train and valid splits' rows)."""
    source: str = "Salesforce/wikitext"
    """A folder with wiki.{train,valid,test}.raw, or Salesforce/wikitext (the hub)."""
    layout: Literal["articles", "stream"] = "articles"
    r"""articles: one document per article, each ending with EOS. stream: the study's, the split's
    non-empty lines joined by "\n\n" and nothing appended (no EOS, so eos_token is None and
    --eos-token is refused; --max-doc-bytes unused)."""

    def __post_init__(self) -> None:
        if self.layout not in ("articles", "stream"):
            raise PrepError(f"--layout {self.layout}: use articles or stream")
        stream = self.layout == "stream"
        if stream and self.eos_token is not None:
            raise PrepError(
                f"--eos-token {self.eos_token}: --layout stream appends no end token (the "
                f"study's ids); drop --eos-token, or use --layout articles"
            )
        super().__post_init__()
        if stream:
            self.eos_token = None


@dataclass(kw_only=True)
class FineWebConfig(RecipeConfig):
    """`megaloop prep fineweb`: web text → filtered, packed webdataset shards."""

    recipe: ClassVar[str] = "fineweb"
    source: str
    """A hub dataset path (HuggingFaceFW/fineweb/sample/10BT) or a local folder."""
    seq_len: int
    shard_size: int = 1024
    """Sequences per tar shard."""
    lang_model: str | None = None
    """A local fastText language-ID model (optional; needs the fasttext package)."""
    lang_threshold: float = 0.65

    def __post_init__(self) -> None:
        super().__post_init__()
        trained = trained_tokenizer(self.tokenizer)
        if trained:
            raise PrepError(
                f"--tokenizer {trained[0]}:N is for WikiText; pass a tokenizer.json or hub name"
            )
        if self.seq_len < 1 or self.shard_size < 1:
            raise PrepError("--seq-len and --shard-size must be >= 1")
        if not 0 <= self.lang_threshold <= 1:
            raise PrepError(f"--lang-threshold {self.lang_threshold}: use a number in [0, 1]")


RECIPES: dict[str, type[RecipeConfig]] = {c.recipe: c for c in (WikiTextConfig, FineWebConfig)}


@dataclass
class Prepared:
    """What a finished `megaloop prep` folder holds, and how a run trains on it: the command's
    closing summary, read from the manifests (a re-run that prepares nothing says it too)."""

    out: str
    holds: str
    """What is there, in words: each split or the shards, with its tokens."""
    vocab_size: int
    config: str
    """The shipped experiment that trains on such data (megaloop train NAME)."""
    data: dict[str, object]
    """The data.* values that point a run of `config` at this folder."""
