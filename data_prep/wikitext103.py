"""`megaloop prep wikitext103`: WikiText-103 → one megatron-core indexed dataset per split.

    megaloop prep wikitext103 --source DIR_OR_HUB --tokenizer train:20480 --out data/wt103
    megaloop prep wikitext103 --source DIR --tokenizer words:20000 --layout stream --out data/study

Source: a folder with any of wiki.train.raw, wiki.valid.raw, wiki.test.raw, or the Hugging Face
dataset `Salesforce/wikitext` (config `wikitext-103-raw-v1`) where a hub is reachable.
Layout `articles`: a document per article, the text from one top-level ` = Title = ` heading to
the next, kept as is, each ending with EOS. Layout `stream` (the study's): the split's non-empty
lines joined by blank lines, one EOS at the very end, stored as pieces of ~1 MiB characters cut
where a token ends. Output: `{split}.bin/.idx` (uint16 when the vocabulary fits) and
`{split}.manifest.json`, plus `tokenizer.json` when it was trained here on the train split
(`train:N`, a byte-level BPE of its articles; `words:N`, the study's word-level vocabulary of its
stream). A re-run resumes: the trained tokenizer and finished splits are kept, finished
datatrove tasks are skipped.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from data_prep.common import (
    BadDocumentGuard,
    IndexedDatasetWriter,
    PrepError,
    eos_id,
    load_tokenizer,
    merge_indexed,
    read_stats,
    resolve_tokenizer,
    run_pipeline,
    sha256_file,
    stat,
    token_dtype,
    write_manifest,
)
from data_prep.config import WikiTextConfig, trained_tokenizer

SPLITS = ("train", "valid", "test")
HUB_DATASET, HUB_CONFIG = "Salesforce/wikitext", "wikitext-103-raw-v1"
HEADING = re.compile(r"^ = (?!=).*(?<!=) = $")
PIECE_CHARS = 2**20
"""Characters per document of the stream layout and per piece a words:N tokenizer counts: no
call tokenizes the 540 MB train split at once."""
CUT = re.compile(r"[!-~](?= )")
r"""Where a piece may end: after an ASCII printable non-space character that a space follows. No
token of the study's pattern spans it under any reading of \s and \w (the character is no space,
the space no word character), nor one of GPT-2's, so the pieces' tokens are the whole text's."""


def _blank(lines: list[str], i: int) -> bool:
    return i < 0 or i >= len(lines) or not lines[i].strip()


def split_articles(text: str) -> list[str]:
    """Articles of a raw WikiText file: from each top-level heading line (` = Title = ` between
    blank lines; a formula such as ` = 1 rad / s = ` inside a paragraph is not one) to the
    next; text before the first heading is kept only if it is not blank."""
    lines = text.splitlines(keepends=True)
    starts = [
        i
        for i, line in enumerate(lines)
        if HEADING.match(line.rstrip("\r\n")) and _blank(lines, i - 1) and _blank(lines, i + 1)
    ]
    if not starts:
        return [text] if text.strip() else []
    articles = ["".join(lines[a:b]) for a, b in zip(starts, starts[1:] + [len(lines)])]
    head = "".join(lines[: starts[0]])
    return ([head] if head.strip() else []) + articles


def read_raw(path: Path) -> str:
    """The file's text; bytes that are not UTF-8 become lone surrogates, so the documents that
    hold them can be found and skipped without losing the rest of the file."""
    return path.read_bytes().decode("utf-8", errors="surrogateescape")


def study_lines(path: Path) -> tuple[list[str], int]:
    """The split's non-empty lines, each with its "\n" (the hub dataset's rows are the raw file's
    lines, blank ones empty), and how many more were left out for bytes that are not UTF-8."""
    with open(path, encoding="utf-8", errors="surrogateescape", newline="\n") as f:  # as read_raw
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if _is_utf8(line)]
    return kept, len(lines) - len(kept)


def stream_pieces(lines, chars: int):
    """The study's text of a split, "\n\n".join(lines), in pieces of at least `chars`
    characters (the last may be shorter), each ending at a CUT."""
    parts, size = [], 0
    for i, line in enumerate(lines):
        parts.append("\n\n" + line if i else line)
        size += len(parts[-1])
        if size >= chars:
            text, end = "".join(parts), 0
            while cut := CUT.search(text, end + chars - 1):
                yield text[end : cut.end()]
                end = cut.end()
            parts, size = [text[end:]], len(text) - end
    if size:
        yield "".join(parts)


class WikiTextReader(PipelineStep):
    """Articles of one raw split file as datatrove Documents."""

    name = "📖 wikitext articles"
    type = "📖 - READER"
    counts = ("non_utf8_documents",)
    """What the manifest records of this step's stats."""

    def __init__(self, path: str, split: str):
        super().__init__()
        self.path, self.split = path, split

    def run(
        self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1
    ) -> DocumentsPipeline:
        for i, article in enumerate(split_articles(read_raw(Path(self.path)))):
            try:
                article.encode("utf-8")
            except UnicodeEncodeError:
                self.stat_update("non_utf8_documents")
                print(
                    f"megaloop prep: {self.path}: skipping {self.split} article {i}: not "
                    f"valid UTF-8",
                    flush=True,
                )
                continue
            self.stat_update("documents")
            title = article.strip().splitlines()[0].strip(" =") if article.strip() else ""
            yield Document(text=article, id=f"{self.split}-{i:06d}", metadata={"title": title})


class WikiTextStream(PipelineStep):
    """The study's text of one raw split file (its non-empty lines joined by blank lines) as
    Documents of `chars` characters or so, only the last followed by EOS."""

    name = "📖 wikitext stream"
    type = "📖 - READER"
    counts = ("lines", "non_utf8_lines")
    """What the manifest records of this step's stats."""

    def __init__(self, path: str, split: str, chars: int):
        super().__init__()
        self.path, self.split, self.chars = path, split, chars

    def run(
        self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1
    ) -> DocumentsPipeline:
        lines, bad = study_lines(Path(self.path))
        self.stat_update("lines", value=len(lines))
        if bad:
            self.stat_update("non_utf8_lines", value=bad)
            print(
                f"megaloop prep: {self.path}: skipping {bad} {self.split} line(s): not valid UTF-8",
                flush=True,
            )
        pieces = stream_pieces(lines, self.chars)
        piece, i = next(pieces, None), 0
        while piece is not None:
            following = next(pieces, None)
            self.stat_update("documents")
            yield Document(
                text=piece, id=f"{self.split}-{i:06d}", metadata={"eos": following is None}
            )
            piece, i = following, i + 1


def fetch_from_hub(out: Path) -> Path:
    """The hub dataset's parquet files, joined back into raw split files under out/source."""
    try:
        import pyarrow.parquet as pq
        from huggingface_hub import snapshot_download

        folder = Path(
            snapshot_download(HUB_DATASET, repo_type="dataset", allow_patterns=f"{HUB_CONFIG}/*")
        )
    except Exception as e:
        raise PrepError(
            f"could not fetch {HUB_DATASET} ({HUB_CONFIG}) from the Hugging Face hub "
            f"({type(e).__name__}: {e}); pass --source with a folder holding "
            f"wiki.train.raw / wiki.valid.raw / wiki.test.raw"
        ) from None
    source = out / "source"
    source.mkdir(parents=True, exist_ok=True)
    names = {"train": "train", "valid": "validation", "test": "test"}
    for split, hub_split in names.items():
        files = sorted((folder / HUB_CONFIG).glob(f"{hub_split}-*.parquet"))
        if files:
            with open(source / f"wiki.{split}.raw", "w", encoding="utf-8") as f:
                for file in files:
                    f.writelines(pq.read_table(file, columns=["text"]).column("text").to_pylist())
    return source


def source_files(source: str, out: Path) -> dict[str, Path]:
    folder = Path(source)
    if not folder.exists():
        if source != HUB_DATASET:
            raise PrepError(f"--source {source}: no such folder (or use {HUB_DATASET} for the hub)")
        folder = fetch_from_hub(out)
    if folder.is_file():
        raise PrepError(f"--source {source} is a file; give the folder that holds wiki.*.raw")
    files = {s: folder / f"wiki.{s}.raw" for s in SPLITS if (folder / f"wiki.{s}.raw").is_file()}
    if not files:
        raise PrepError(
            f"--source {folder} holds none of wiki.train.raw, wiki.valid.raw, wiki.test.raw"
        )
    return files


def training_text(cfg: WikiTextConfig, files: dict[str, Path]):
    """What a tokenizer trained here learns from: the train split's articles (train:N) or its
    study stream in pieces (words:N); None without a train split or a tokenizer to train."""
    trained = trained_tokenizer(cfg.tokenizer)
    if not trained or "train" not in files:
        return None
    if trained[0] == "words":
        return stream_pieces(study_lines(files["train"])[0], PIECE_CHARS)
    return (a for a in split_articles(read_raw(files["train"])) if _is_utf8(a) and a.strip())


def prepare(cfg: WikiTextConfig) -> dict:
    """Prepare (or resume) each split found; the manifests of the splits finished by this run."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    files = source_files(cfg.source, out)
    tokenizer = out / "tokenizer.json"
    if not (trained_tokenizer(cfg.tokenizer) and tokenizer.is_file()):  # else: resume with it
        tokenizer = resolve_tokenizer(cfg.tokenizer, out, training_text(cfg, files))
    vocab = load_tokenizer(tokenizer).get_vocab_size()
    eos_id(tokenizer, cfg.eos_token)
    dtype = token_dtype(vocab)
    manifests, pending = {}, []
    for split, path in files.items():
        manifest_path = out / f"{split}.manifest.json"
        if manifest_path.is_file() and (out / f"{split}.bin").is_file():
            print(f"megaloop prep: {split} is already prepared ({manifest_path})", flush=True)
            continue
        # the manifest is the mark of a finished split: gone until this run has finished it
        manifest_path.unlink(missing_ok=True)
        start = time.perf_counter()
        logs = out / "logs" / split
        if cfg.layout == "stream":  # the study's text exactly: nothing in it is dropped
            reader = [WikiTextStream(str(path), split, PIECE_CHARS)]
        else:
            reader = [WikiTextReader(str(path), split), BadDocumentGuard(cfg.max_doc_bytes)]
        pipeline = [
            *reader,
            IndexedDatasetWriter(str(out), split, str(tokenizer), dtype.__name__, cfg.eos_token),
        ]
        if not run_pipeline(pipeline, logs, 1, cfg.execution):
            pending.append(split)
            continue
        stats = read_stats(logs)
        kept = stat(stats, "indexed dataset", "documents")
        if kept == 0:
            for ext in (".bin", ".idx"):
                (out / f"{split}_00000{ext}").unlink(missing_ok=True)
            print(f"megaloop prep: {split}: no usable documents in {path}; skipped", flush=True)
            continue
        prefix = (
            merge_indexed(out, split, parts=1, dtype=dtype)
            if (out / f"{split}_00000.bin").is_file()
            else out / split
        )
        manifests[split] = manifest = {
            "split": split,
            "prefix": str(prefix),
            "documents": kept,
            "tokens": stat(stats, "indexed dataset", "tokens"),
            "dropped": {
                k: stat(stats, "guard", f"dropped_{k}") for k in ("empty", "too_long", "binary")
            },
            "layout": cfg.layout,
            **{key: stat(stats, reader[0].name, key) for key in reader[0].counts},
            "dtype": dtype.__name__,
            "vocab_size": vocab,
            "eos_token": cfg.eos_token,
            "eos_id": eos_id(tokenizer, cfg.eos_token),
            "tokenizer": str(Path(tokenizer).resolve()),
            "tokenizer_sha256": sha256_file(tokenizer),
            "source": str(path),
            "source_sha256": sha256_file(path),
            "seconds": round(time.perf_counter() - start, 2),
            "datatrove_stats": stats,
        }
        write_manifest(manifest_path, manifest)
    if (
        not manifests
        and not pending
        and not any((out / f"{s}.manifest.json").is_file() for s in files)
    ):
        raise PrepError(
            f"nothing usable in --source {cfg.source}: every split was empty or "
            f"all its documents were dropped"
        )
    return manifests


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
