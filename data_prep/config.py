"""What a `megaloop prep` recipe is asked to do: one typed config per recipe, checked when built.

Each field is its flag (megaloop.flags: `--max-doc-bytes` is `max_doc_bytes`, its docstring the
help, its default the flag's), so an error names the flag; the command line builds them
(`from_args`), the bench and the tests directly. Kept free of datatrove so that `megaloop --help`
stays fast.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar, Literal

from megaloop.config import ConfigError
from megaloop.flags import from_flags, setting

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

    executor: Literal["local", "slurm"] = setting("local", choices=("local", "slurm"))
    """local: processes here; slurm: a Slurm job array"""
    workers: int = 1
    """local: processes; slurm: concurrent array tasks (-1: no limit)"""
    partition: str | None = None
    """slurm partition (required with --executor slurm)"""
    time: str = "04:00:00"
    """slurm time limit per task"""
    cpus_per_task: int = 1
    """slurm: CPUs of each task"""
    max_array_size: int = 1001
    """slurm: the most tasks one job array holds (the cluster's MaxArraySize)"""
    job_name: str = "megaloop-prep"
    """slurm: job name"""

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
    """output folder: what the recipe writes and its manifest"""
    tokenizer: str
    """tokenizer.json path or hub name"""
    eos_token: str | None = setting(
        None,
        help=lambda cls: (
            f"the token that ends each document (default: {WORDS_EOS} for words:N, "
            f"else {EOS}); WikiText's stream layout appends none"
        ),
    )
    max_doc_bytes: int = MAX_DOC_BYTES
    """larger single documents are dropped (and counted)"""
    execution: ExecutorConfig = setting(internal=True, default_factory=ExecutorConfig)

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
        """The config of parsed `megaloop prep NAME` options (its flags and ExecutorConfig's)."""
        return from_flags(cls, args, execution=from_flags(ExecutorConfig, args))


@dataclass(kw_only=True)
class WikiTextConfig(RecipeConfig):
    """`megaloop prep wikitext103`: raw WikiText-103 splits → megatron-core indexed datasets."""

    recipe: ClassVar[str] = "wikitext103"
    tokenizer: str = f"train:{DEFAULT_VOCAB}"
    """tokenizer.json path, hub name, train:N (a byte-level BPE trained on the train split) or
    words:N (the study's word-level vocabulary, at most N tokens, counted row by row over the
    train and valid rows, e.g. words:20000)"""
    source: str = "Salesforce/wikitext"
    """folder with wiki.{train,valid,test}.raw, or Salesforce/wikitext (hub)"""
    layout: Literal["articles", "stream"] = setting("articles", choices=("articles", "stream"))
    """articles: one document per article, each ending with EOS; stream: the study's, non-empty
    lines joined by blank lines, no end token (--eos-token refused, --max-doc-bytes unused)"""

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
    """hub dataset path (HuggingFaceFW/fineweb/sample/10BT) or a local folder"""
    seq_len: int
    """tokens per packed sequence (a training window)"""
    shard_size: int = 1024
    """sequences per tar shard"""
    lang_model: str | None = None
    """local fastText language-ID model; needs the fasttext package (default: none, no language
    filter)"""
    lang_threshold: float = 0.65
    """least English score a document keeps (with --lang-model)"""

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
