"""Data preparation recipes (datatrove pipelines), one module per corpus, run by `megaloop prep`.

The command-line options live here so that `megaloop --help` (and every training rank) does
not import datatrove; a corpus module is imported only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

DEFAULT_VOCAB = 20480
EOS = "<|endoftext|>"


def _executor_options(parser) -> None:
    group = parser.add_argument_group("execution (datatrove)")
    group.add_argument("--executor", choices=["local", "slurm"], default="local")
    group.add_argument(
        "--workers",
        type=int,
        default=1,
        help="local: processes; slurm: concurrent array tasks (-1: no limit)",
    )
    group.add_argument("--partition", default=None, help="slurm partition")
    group.add_argument("--time", default="04:00:00", help="slurm time limit per task")
    group.add_argument("--cpus-per-task", type=int, default=1)
    group.add_argument("--max-array-size", type=int, default=1001)
    group.add_argument("--job-name", default="megaloop-prep")


def _corpus(sub, name: str, help: str):
    module = importlib.util.find_spec(f"data_prep.{name}")
    doc = _module_doc(module.origin)
    p = sub.add_parser(
        name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.set_defaults(corpus_module=f"data_prep.{name}")
    return p


def _module_doc(path: str) -> str:
    import ast

    with open(path) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def add_parsers(sub) -> list[argparse.ArgumentParser]:
    wt = _corpus(sub, "wikitext103", "WikiText-103 → megatron-core indexed datasets")
    wt.add_argument(
        "--source",
        default="Salesforce/wikitext",
        help="folder with wiki.{train,valid,test}.raw, or Salesforce/wikitext (hub)",
    )
    wt.add_argument(
        "--tokenizer",
        default=f"train:{DEFAULT_VOCAB}",
        help="tokenizer.json path, hub name, or train:N (byte-level BPE, default "
        f"train:{DEFAULT_VOCAB})",
    )
    wt.add_argument("--out", required=True)
    wt.add_argument("--eos-token", default=EOS)
    wt.add_argument(
        "--max-doc-bytes",
        type=int,
        default=10 * 2**20,
        help="larger single documents are dropped (and counted)",
    )
    _executor_options(wt)

    fw = _corpus(sub, "fineweb", "web text → filtered, packed webdataset shards")
    fw.add_argument(
        "--source",
        required=True,
        help="hub dataset path (HuggingFaceFW/fineweb/sample/10BT) or a local folder",
    )
    fw.add_argument("--tokenizer", required=True, help="tokenizer.json path or hub name")
    fw.add_argument("--out", required=True)
    fw.add_argument("--seq-len", type=int, required=True)
    fw.add_argument("--shard-size", type=int, default=1024, help="sequences per tar shard")
    fw.add_argument("--eos-token", default=EOS)
    fw.add_argument("--max-doc-bytes", type=int, default=10 * 2**20)
    fw.add_argument(
        "--lang-model",
        default=None,
        help="local fastText language-ID model (optional; needs the fasttext package)",
    )
    fw.add_argument("--lang-threshold", type=float, default=0.65)
    _executor_options(fw)
    return [wt, fw]


def run(args) -> dict:
    return importlib.import_module(args.corpus_module).prepare(args)
