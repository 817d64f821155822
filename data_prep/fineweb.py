"""`megaloop prep fineweb`: web text → quality filters → packed token sequences in webdataset
shards, locally or as a Slurm job array.

    megaloop prep fineweb --source HuggingFaceFW/fineweb/sample/10BT --tokenizer TOK \\
        --out data/fineweb --seq-len 4096 --executor slurm --partition cpu --workers 64

Source: a hub dataset path (`HuggingFaceFW/fineweb/sample/10BT`, read as parquet through
hf://) or a local folder of parquet or JSONL(.gz) files with a `text` field. Pipeline: reader
→ bad-document guard → Gopher repetition, Gopher quality, C4 and FineWeb quality filters (and
fastText language ID with a local model, `--lang-model`) → tokenize (EOS after each document) →
pack into sequences of seq_len+1 tokens → `shards/{task:05d}-{n:06d}.tar`, each sample a
`tokens.npy`. Work is split by input file (one datatrove task per file), so a single file keeps
one worker busy: split big files to use more. A re-run resumes: finished tasks are skipped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from datatrove.data import DocumentsPipeline

from data_prep.common import (
    EOS,
    BadDocumentGuard,
    PrepError,
    RobustReader,
    TokenizingStep,
    eos_id,
    load_tokenizer,
    read_stats,
    resolve_tokenizer,
    run_pipeline,
    stat,
    token_dtype,
    write_manifest,
)
from data_prep.config import FineWebConfig, Prepared
from megaloop.digest import file_digest


class PackedShardWriter(TokenizingStep):
    """Packs this task's token stream (documents joined by EOS) into sequences of seq_len+1
    tokens and writes them as webdataset tar shards of `shard_size` samples. The tail that does
    not fill a sequence is dropped and counted."""

    name = "📦 packed webdataset shards"
    type = "✍ WRITER"

    def __init__(
        self,
        output_dir: str,
        tokenizer_path: str,
        seq_len: int,
        shard_size: int,
        dtype: str,
        eos_token: str = EOS,
    ):
        super().__init__(tokenizer_path, eos_token)
        self.output_dir, self.seq_len, self.shard_size, self.dtype = (
            output_dir,
            seq_len,
            shard_size,
            dtype,
        )

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        import webdataset as wds

        folder = Path(self.output_dir) / "shards"
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f"{rank:05d}-*.tar"):  # a rerun of an unfinished task
            stale.unlink()
        size, buffer, n = self.seq_len + 1, np.empty(0, dtype=np.int64), 0
        counts: dict[str, int] = {}
        with wds.ShardWriter(
            str(folder / f"{rank:05d}-%06d.tar"), maxcount=self.shard_size, verbose=0
        ) as sink:
            for _, ids in self.token_batches(data, rank, "fineweb"):
                buffer = np.concatenate([buffer, *ids])
                whole = len(buffer) // size
                for seq in buffer[: whole * size].reshape(whole, size):
                    sink.write(
                        {"__key__": f"{rank:05d}-{n:09d}", "tokens.npy": seq.astype(self.dtype)}
                    )
                    shard = Path(sink.fname).name
                    counts[shard] = counts.get(shard, 0) + 1
                    n += 1
                buffer = buffer[whole * size :]
        self.stat_update("sequences", value=n)
        self.stat_update("tail_tokens_dropped", value=len(buffer))
        (folder / f"{rank:05d}.json").write_text(json.dumps(counts))
        yield from ()


def quality_filters(lang_model: str | None, threshold: float) -> list:
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    steps = []
    if lang_model:
        from datatrove.pipeline.filters import FastTextClassifierFilter

        if not Path(lang_model).is_file():
            raise PrepError(
                f"--lang-model {lang_model}: no such file (a fastText language-ID "
                f"model, e.g. lid.176.bin)"
            )
        steps.append(FastTextClassifierFilter(lang_model, keep_labels=[("en", threshold)]))
    return steps + [
        GopherRepetitionFilter(),
        GopherQualityFilter(),
        C4QualityFilter(filter_no_terminal_punct=False),
        FineWebQualityFilter(),
    ]


def resolve_source(source: str) -> tuple[str, list[str]]:
    """(datatrove data folder, its input files) for a local folder or a hub dataset path."""
    from datatrove.io import get_datafolder

    local = Path(source)
    if local.exists():
        if local.is_file():
            raise PrepError(f"--source {source} is a file; give the folder that holds it")
        folder = str(local)
    elif source.startswith("hf://") or source.count("/") >= 1:
        folder = source if source.startswith("hf://") else f"hf://datasets/{source}"
    else:
        raise PrepError(
            f"--source {source}: no such folder (or give a hub dataset path such as "
            f"HuggingFaceFW/fineweb/sample/10BT)"
        )
    try:
        files = [
            f
            for f in get_datafolder(folder).list_files(recursive=True)
            if f.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet"))
        ]
    except Exception as e:
        raise PrepError(f"--source {source}: cannot list it ({type(e).__name__}: {e})") from None
    if not files:
        raise PrepError(f"--source {source} holds no .parquet, .jsonl or .jsonl.gz files")
    return folder, sorted(files)


def prepare(cfg: FineWebConfig) -> dict:
    """Run (or resume) the pipeline and write manifest.json; {} while Slurm tasks are pending."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    # the manifest is the mark of a finished folder: gone until this run has finished
    (out / "manifest.json").unlink(missing_ok=True)
    folder, files = resolve_source(cfg.source)
    tokenizer = resolve_tokenizer(cfg.tokenizer, out)
    vocab = load_tokenizer(tokenizer).get_vocab_size()
    eos = eos_id(tokenizer, cfg.eos_token)
    dtype = token_dtype(vocab)
    workers = cfg.execution.workers
    if len(files) == 1 and workers > 1:
        print(
            f"megaloop prep: {files[0]} is the only input file: datatrove splits work by file, "
            f"so one of the {workers} workers will be busy; split it into several files "
            f"to use them all",
            flush=True,
        )
    start = time.perf_counter()
    logs = out / "logs"
    pipeline = [
        RobustReader(folder, paths_file=None, glob_pattern=None, text_key="text"),
        BadDocumentGuard(cfg.max_doc_bytes),
        *quality_filters(cfg.lang_model, cfg.lang_threshold),
        PackedShardWriter(
            str(out), str(tokenizer), cfg.seq_len, cfg.shard_size, dtype.__name__, cfg.eos_token
        ),
    ]
    if not run_pipeline(pipeline, logs, len(files), cfg.execution):
        return {}
    stats = read_stats(logs)
    shards = {}
    for counts in sorted((out / "shards").glob("*.json")):
        shards.update(json.loads(counts.read_text()))
    kept = stat(stats, "packed webdataset", "documents")
    if not shards or kept == 0:
        raise PrepError(
            f"nothing usable in --source {cfg.source}: "
            f"{stat(stats, 'reader', 'documents')} documents read, none kept (or too "
            f"few tokens for one sequence of {cfg.seq_len + 1})"
        )
    manifest = {
        "source": cfg.source,
        "files": files,
        "seq_len": cfg.seq_len,
        "documents_read": stat(stats, "reader", "documents"),
        "unreadable_files": stat(stats, "reader", "unreadable_files"),
        "non_utf8_records": stat(stats, "reader", "non_utf8_records"),
        "invalid_json_records": stat(stats, "reader", "invalid_json_records"),
        "records_without_text": stat(stats, "reader", "records_without_text"),
        "dropped": _dropped(stats),
        "documents_kept": kept,
        "tokens": stat(stats, "packed webdataset", "tokens"),
        "sequences": sum(shards.values()),
        "tail_tokens_dropped": stat(stats, "packed webdataset", "tail_tokens_dropped"),
        "shards": dict(sorted(shards.items())),
        "dtype": dtype.__name__,
        "vocab_size": vocab,
        "eos_token": cfg.eos_token,
        "eos_id": eos,
        "tokenizer": str(Path(tokenizer).resolve()),
        "tokenizer_sha256": file_digest(tokenizer),
        "seconds": round(time.perf_counter() - start, 2),
        "datatrove_stats": stats,
    }
    write_manifest(out / "manifest.json", manifest)
    return manifest


def prepared(cfg: FineWebConfig) -> Prepared | None:
    """The shards in cfg.out and the 1.4B baseline at their sequence length; None until the
    manifest is there (it is written when every task has finished)."""
    path = Path(cfg.out) / "manifest.json"
    if not path.is_file():
        return None
    m = json.loads(path.read_text())
    return Prepared(
        out=cfg.out,
        holds=(
            f"{m['sequences']:,} sequences of {m['seq_len']:,}+1 tokens in {len(m['shards']):,} "
            f"shards ({m['tokens']:,} tokens of {m['documents_kept']:,} documents kept, of "
            f"{m['documents_read']:,} read)"
        ),
        vocab_size=m["vocab_size"],
        config="experiments/fineweb/1p4b_baseline",
        data={"path": cfg.out, "seq_len": m["seq_len"]},
    )


def _dropped(stats: list) -> dict:
    """Documents each filter removed, by filter (and by reason where the filter gives one)."""
    dropped = {}
    for step in stats:
        if "FILTER" not in step["name"]:
            continue
        name = step["name"].split(":", 1)[1].strip()
        values = {k: (v["total"] if isinstance(v, dict) else v) for k, v in step["stats"].items()}
        dropped[name] = {
            "total": int(values.get("dropped", 0)),
            **{k[len("dropped_") :]: int(v) for k, v in values.items() if k.startswith("dropped_")},
        }
    return dropped
