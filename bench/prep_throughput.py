"""Data preparation throughput against the tokenizer's own batch-encode rate, on real text.

    python -m bench prep_throughput [--data ../shared/data] [--out runs/bench-prep]

Runs `megaloop prep wikitext103` on WikiText-103's valid and test text and `megaloop prep
fineweb` on the Common Crawl sample (one worker, the GPT-2 tokenizer), then times
`Tokenizer.encode_batch` alone over the same documents in this process, and prints documents,
tokens, drop rates, wall time and the ratio of the two rates (pipeline / tokenizer).
"""

import argparse
import shutil
import time
from pathlib import Path

from tokenizers import Tokenizer

import data_prep
from data_prep import ExecutorConfig, FineWebConfig, WikiTextConfig
from data_prep.wikitext103 import read_raw, split_articles

BENCH = ExecutorConfig(workers=1, time="01:00:00", job_name="bench")


def step_seconds(stats: list) -> float:
    """Time spent in the pipeline's steps (datatrove's runtime stats): the steady-state cost,
    without process start-up and imports (megatron-core alone takes ~4 s to import here)."""
    return sum(
        step["time_stats"]["total"] for step in stats if isinstance(step.get("time_stats"), dict)
    )


def encode_rate(tokenizer: Tokenizer, texts: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = sum(len(e.ids) + 1 for e in tokenizer.encode_batch(texts))
    return tokens, time.perf_counter() - start


def main(argv: list[str], out: Path | None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data"))
    args = p.parse_args(argv)
    data, out = Path(args.data), out or Path("runs/bench-prep")
    shutil.rmtree(out, ignore_errors=True)
    tok_path = data / "tokenizers/gpt2/tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_path))

    source = out / "wikitext-source"
    source.mkdir(parents=True)
    for split in ("valid", "test"):
        shutil.copy(data / f"wikitext-103/wiki.{split}.raw", source / f"wiki.{split}.raw")
    start = time.perf_counter()
    manifests = data_prep.run(
        WikiTextConfig(
            source=str(source), tokenizer=str(tok_path), out=str(out / "wikitext"), execution=BENCH
        )
    )
    wall = time.perf_counter() - start
    docs = sum(m["documents"] for m in manifests.values())
    tokens = sum(m["tokens"] for m in manifests.values())
    steps = sum(step_seconds(m["datatrove_stats"]) for m in manifests.values())
    articles = [
        a for s in ("valid", "test") for a in split_articles(read_raw(source / f"wiki.{s}.raw"))
    ]
    enc_tokens, enc_time = encode_rate(tokenizer, articles)
    print(
        f"wikitext103 (valid+test): {docs} documents, {tokens:,} tokens, {wall:.2f} s wall "
        f"({tokens / wall:,.0f} tokens/s), {steps:.2f} s in pipeline steps "
        f"({tokens / steps:,.0f} tokens/s); tokenizer.encode_batch alone "
        f"{enc_tokens / enc_time:,.0f} tokens/s; pipeline steps / tokenizer = "
        f"{tokens / steps / (enc_tokens / enc_time):.2f}"
    )

    start = time.perf_counter()
    m = data_prep.run(
        FineWebConfig(
            source=str(data / "web/dolma-cc-sample"),
            tokenizer=str(tok_path),
            out=str(out / "web"),
            seq_len=1024,
            shard_size=64,
            execution=BENCH,
        )
    )
    wall = time.perf_counter() - start
    read, steps = m["documents_read"], step_seconds(m["datatrove_stats"])
    kept_texts = [d for d in _kept_documents(data / "web/dolma-cc-sample", m)]
    enc_tokens, enc_time = encode_rate(tokenizer, kept_texts) if kept_texts else (0, 1)
    print(
        f"fineweb (Common Crawl sample): {read} documents read, {m['documents_kept']} kept "
        f"({100 * m['documents_kept'] / read:.1f}%), {m['tokens']:,} tokens, "
        f"{m['sequences']} sequences of 1,025 in {len(m['shards'])} shards; {wall:.2f} s wall, "
        f"{steps:.2f} s in pipeline steps ({read / steps:,.0f} documents/s, "
        f"{m['tokens'] / steps:,.0f} kept tokens/s); tokenizer.encode_batch alone on the kept "
        f"documents {enc_tokens / enc_time:,.0f} tokens/s"
    )
    for name, d in m["dropped"].items():
        reasons = ", ".join(f"{k} {v}" for k, v in d.items() if k != "total")
        print(
            f"  {name:<24} dropped {d['total']:>4} ({100 * d['total'] / read:5.1f}% of read)"
            + (f": {reasons}" if reasons else "")
        )


def _kept_documents(folder: Path, manifest: dict) -> list[str]:
    """Texts of the documents the filters kept, recovered by filtering again in-process."""
    from datatrove.data import Document

    from data_prep.common import BadDocumentGuard, RobustReader
    from data_prep.fineweb import quality_filters

    steps = [BadDocumentGuard(), *quality_filters(None, 0.65)]
    reader = RobustReader(str(folder), text_key="text")
    kept = []
    for doc in reader.run(rank=0, world_size=1):
        doc = Document(text=doc.text, id=doc.id)
        ok = True
        for step in steps:  # in order, on one document: C4's filter also drops lines from it
            result = step.filter(doc)
            if not (result[0] if isinstance(result, tuple) else result):
                ok = False
                break
        if ok:
            kept.append(doc.text)
    assert len(kept) == manifest["documents_kept"]
    return kept
