"""Data preparation recipes (datatrove pipelines), one module per corpus, run by `megaloop prep`.

The command-line options live here so that `megaloop --help` (and every training rank) does
not import datatrove; a corpus module is imported only when it runs. Each recipe's options are
a typed config (data_prep/config.py); the flags' defaults are read from it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

from data_prep.config import (
    DEFAULT_VOCAB,
    EOS,
    WORDS_EOS,
    ExecutorConfig,
    FineWebConfig,
    Prepared,
    PrepError,
    RecipeConfig,
    WikiTextConfig,
)

__all__ = [
    "DEFAULT_VOCAB",
    "EOS",
    "ExecutorConfig",
    "FineWebConfig",
    "PrepError",
    "Prepared",
    "RecipeConfig",
    "WikiTextConfig",
    "config_from_args",
    "prepared",
    "run",
]


def _executor_options(parser) -> None:
    d = ExecutorConfig()
    group = parser.add_argument_group("execution (datatrove)")
    group.add_argument(
        "--executor",
        choices=["local", "slurm"],
        default=d.executor,
        help="local: processes here; slurm: a Slurm job array",
    )
    group.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help="local: processes; slurm: concurrent array tasks (-1: no limit)",
    )
    group.add_argument(
        "--partition",
        default=d.partition,
        help="slurm partition (required with --executor slurm)",
    )
    group.add_argument("--time", default=d.time, help="slurm time limit per task")
    group.add_argument(
        "--cpus-per-task", type=int, default=d.cpus_per_task, help="slurm: CPUs of each task"
    )
    group.add_argument(
        "--max-array-size",
        type=int,
        default=d.max_array_size,
        help="slurm: the most tasks one job array holds (the cluster's MaxArraySize)",
    )
    group.add_argument("--job-name", default=d.job_name, help="slurm: job name")


def _corpus(sub, config: type[RecipeConfig], help: str):
    module = importlib.util.find_spec(f"data_prep.{config.recipe}")
    doc = _module_doc(module.origin)
    p = sub.add_parser(
        config.recipe,
        help=help,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(prep_config=config)
    return p


def _module_doc(path: str) -> str:
    import ast

    with open(path) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def add_parsers(sub) -> list[argparse.ArgumentParser]:
    wt = _corpus(sub, WikiTextConfig, "WikiText-103 → megatron-core indexed datasets")
    wt.add_argument(
        "--source",
        default=WikiTextConfig.source,
        help="folder with wiki.{train,valid,test}.raw, or Salesforce/wikitext (hub)",
    )
    wt.add_argument(
        "--tokenizer",
        default=WikiTextConfig.tokenizer,
        help="tokenizer.json path, hub name, train:N (byte-level BPE) or words:N (the study's "
        "word-level vocabulary of the train and valid rows, e.g. words:20000)",
    )
    wt.add_argument(
        "--out",
        required=True,
        help="output folder: each split's indexed dataset (.bin, .idx) and manifest",
    )
    wt.add_argument(
        "--layout",
        choices=["articles", "stream"],
        default=WikiTextConfig.layout,
        help="articles: one document per article, each ending with EOS; stream: the study's, "
        "non-empty lines joined by blank lines, no end token",
    )
    wt.add_argument(
        "--eos-token",
        default=WikiTextConfig.eos_token,
        help=f"the token that ends each article (default: {WORDS_EOS} for words:N, else {EOS}); "
        "not with --layout stream, which appends none",
    )
    wt.add_argument(
        "--max-doc-bytes",
        type=int,
        default=WikiTextConfig.max_doc_bytes,
        help="larger single articles are dropped (and counted)",
    )
    _executor_options(wt)

    fw = _corpus(sub, FineWebConfig, "web text → filtered, packed webdataset shards")
    fw.add_argument(
        "--source",
        required=True,
        help="hub dataset path (HuggingFaceFW/fineweb/sample/10BT) or a local folder",
    )
    fw.add_argument("--tokenizer", required=True, help="tokenizer.json path or hub name")
    fw.add_argument(
        "--out", required=True, help="output folder: the webdataset shards and their manifest"
    )
    fw.add_argument(
        "--seq-len", type=int, required=True, help="tokens per packed sequence (a training window)"
    )
    fw.add_argument(
        "--shard-size",
        type=int,
        default=FineWebConfig.shard_size,
        help="sequences per tar shard",
    )
    fw.add_argument("--eos-token", default=EOS, help="the token that ends each document")
    fw.add_argument(
        "--max-doc-bytes",
        type=int,
        default=FineWebConfig.max_doc_bytes,
        help="larger single documents are dropped (and counted)",
    )
    fw.add_argument(
        "--lang-model",
        default=FineWebConfig.lang_model,
        help="local fastText language-ID model; needs the fasttext package (default: none, no "
        "language filter)",
    )
    fw.add_argument(
        "--lang-threshold",
        type=float,
        default=FineWebConfig.lang_threshold,
        help="least English score a document keeps (with --lang-model)",
    )
    _executor_options(fw)
    return [wt, fw]


def config_from_args(args: argparse.Namespace) -> RecipeConfig:
    """The typed config of `megaloop prep NAME ...`: the one place flags become a config."""
    return args.prep_config.from_args(args)


def run(config: RecipeConfig) -> dict:
    """Run one recipe; returns what it wrote in its manifest(s)."""
    return importlib.import_module(f"data_prep.{config.recipe}").prepare(config)


def prepared(config: RecipeConfig) -> Prepared | None:
    """What config.out holds once the recipe has finished there; None while it has not (Slurm
    tasks still queued or running)."""
    return importlib.import_module(f"data_prep.{config.recipe}").prepared(config)
