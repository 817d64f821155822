r"""`megaloop prep wikitext103`: WikiText-103 → one megatron-core indexed dataset per split.

    megaloop prep wikitext103 --source DIR_OR_HUB --tokenizer train:20480 --out data/wt103
    megaloop prep wikitext103 --source DIR --tokenizer words:20000 --layout stream --out data/study

Source: a folder with any of wiki.train.raw, wiki.valid.raw, wiki.test.raw, or the Hugging Face
dataset `Salesforce/wikitext` (config `wikitext-103-raw-v1`) where a hub is reachable.
A split's rows are the hub dataset's: the raw file's lines, each with its "\n", those that are
blank or only whitespace left out; a line that is not UTF-8 is skipped (and counted), for the
vocabulary too.
Layout `articles`: a document per article, the text from one top-level ` = Title = ` heading to
the next, kept as is, each ending with EOS. Layout `stream` (the study's): the split's rows
joined by "\n\n" and tokenized as one text, nothing appended (no EOS: the ids of
readout-blind-spot src/train_ar_looplm.py build_dataset), stored as pieces of ~1 MiB
characters cut where a token ends; its manifest's eos_token and eos_id are null.
Output: `{split}.bin/.idx` (uint16 when the vocabulary fits) and `{split}.manifest.json`, plus
`tokenizer.json` when it was trained here: `train:N`, a byte-level BPE of the train split's
articles; `words:N`, the study's word-level vocabulary (src/data/dataset.py
RegexTokenizer.from_texts): each row of the train and valid splits tokenized on its own with
\s+|[A-Za-z0-9_]+|[^\w\s], the tokens seen at least twice ranked by (-count, token) after
<pad> <bos> <eos> <unk> (ids 0-3), N ids in all; a token met only where rows are joined (the
" \n\n\n " between two rows) encodes as <unk>. It needs wiki.valid.raw, and writes
tokenizer.words.json beside tokenizer.json to say which rule made it.
A re-run resumes: the trained tokenizer and finished splits are kept, finished datatrove tasks
are skipped; a folder that an older rule, another layout or another tokenizer made is refused
before any work (prepare into a new folder).
"""

from __future__ import annotations

import json
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
    stat,
    token_dtype,
    write_manifest,
)
from data_prep.config import Prepared, WikiTextConfig, trained_tokenizer
from megaloop.digest import file_digest

SPLITS = ("train", "valid", "test")
HUB_DATASET, HUB_CONFIG = "Salesforce/wikitext", "wikitext-103-raw-v1"
HEADING = re.compile(r"^ = (?!=).*(?<!=) = $")
PIECE_CHARS = 2**20
"""Characters per document of the stream layout: no call tokenizes the 540 MB train split at
once."""
WORDS_RULE = "rows of train+valid, each alone"
"""How a words:N vocabulary is counted (count_words over vocabulary_rows), as recorded in
WORDS_MARKER: an older megaloop counted the train split's joined stream and wrote no marker."""
WORDS_MARKER = "tokenizer.words.json"
"""Written beside a words:N tokenizer.json before it: the spec, WORDS_RULE and the sources."""
FRESH = "prepare into a new --out folder (nothing here was changed or deleted)"
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


class Rows:
    r"""The study's rows of a raw split file, read lazily (each with its "\n"; the hub dataset's
    rows are the raw file's lines, blank ones empty, and the study drops the empty ones);
    `skipped` counts the lines left out for bytes that are not UTF-8, once read through."""

    def __init__(self, path: Path):
        self.path, self.skipped = Path(path), 0

    def __iter__(self):
        self.skipped = 0
        # bytes that are not UTF-8 become lone surrogates (as read_raw), so a line that holds
        # them is found and skipped without losing the rest of the file
        with open(self.path, encoding="utf-8", errors="surrogateescape", newline="\n") as f:
            for line in f:
                if not line.strip():
                    continue
                if not _is_utf8(line):
                    self.skipped += 1
                    continue
                yield line


def study_lines(path: Path) -> tuple[list[str], int]:
    """The split's rows (Rows) and how many lines were left out for bytes that are not UTF-8."""
    rows = Rows(path)
    return list(rows), rows.skipped


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
    r"""The study's text of one raw split file (its rows joined by "\n\n") as Documents of
    `chars` characters or so, cut where a token ends: back to back they are the split's ids."""

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
        for i, piece in enumerate(stream_pieces(lines, self.chars)):
            self.stat_update("documents")
            yield Document(text=piece, id=f"{self.split}-{i:06d}")


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


def vocabulary_rows(files: dict[str, Path]):
    """What a words:N vocabulary is counted on: the train split's rows, then the valid split's
    (src/train_ar_looplm.py build_dataset: RegexTokenizer.from_texts(train_texts +
    val_texts)); lines that are not UTF-8 are left out, as from the splits' ids."""
    for split in ("train", "valid"):
        rows = Rows(files[split])
        yield from rows
        if rows.skipped:
            print(
                f"megaloop prep: {files[split]}: {rows.skipped} line(s) are not valid UTF-8; "
                f"left out of the vocabulary (and of the {split} split)",
                flush=True,
            )


def training_text(cfg: WikiTextConfig, files: dict[str, Path]):
    """What a tokenizer trained here learns from: the train split's articles (train:N) or the
    train and valid splits' rows (words:N); None without a train split or a tokenizer to
    train."""
    trained = trained_tokenizer(cfg.tokenizer)
    if not trained or "train" not in files:
        return None
    if trained[0] == "words":
        return vocabulary_rows(files)
    return (a for a in split_articles(read_raw(files["train"])) if _is_utf8(a) and a.strip())


def check_words_sources(cfg: WikiTextConfig, files: dict[str, Path], source: Path) -> None:
    """A words:N vocabulary to train needs both splits it is counted on: one PrepError naming
    the missing file and the fixes, before any work."""
    for split in ("train", "valid"):
        if split not in files:
            raise PrepError(
                f"--tokenizer {cfg.tokenizer} counts its vocabulary over the train and valid "
                f"splits (the study's rule), but --source {source} has no wiki.{split}.raw; "
                f"add it, or pass the tokenizer.json of an earlier preparation as --tokenizer"
            )


def _read_marker(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_resume(cfg: WikiTextConfig, out: Path) -> None:
    """Refuse a folder that this preparation would otherwise reuse but another one made: a
    words:N tokenizer.json without WORDS_MARKER (an older megaloop's, counted on the train
    split's joined stream) or of another spec, a finished split of another layout, a finished
    stream that ends with EOS (an older megaloop's), or split work (finished, or tasks that
    datatrove would skip) whose tokenizer.json is gone when one is to be trained. One PrepError
    naming the problem and the fix, before any compute; nothing is deleted."""
    trained = trained_tokenizer(cfg.tokenizer)
    tokenizer = out / "tokenizer.json"
    if trained and trained[0] == "words" and tokenizer.is_file():
        marker = _read_marker(out / WORDS_MARKER)
        if marker is None or marker.get("rule") != WORDS_RULE:
            raise PrepError(
                f"{tokenizer} has no {WORDS_MARKER} beside it, so it is not the study's "
                f"vocabulary: an older megaloop counted words:N on the train split's joined "
                f"text, the study counts row by row over the train and valid rows; {FRESH}"
            )
        if marker.get("tokenizer") != cfg.tokenizer:
            raise PrepError(
                f"{tokenizer} holds the --tokenizer {marker.get('tokenizer')} vocabulary, not "
                f"{cfg.tokenizer}; {FRESH}, or pass --tokenizer {marker.get('tokenizer')} to "
                f"resume this one"
            )
    if trained and not tokenizer.is_file():  # split work is only ever done after it is saved
        done = [
            p
            for split in SPLITS
            for p in (out / f"{split}.bin", out / f"{split}_00000.bin", out / "logs" / split)
            if p.exists() and not (p.is_dir() and not any((p / "completions").glob("*")))
        ]
        if done:
            raise PrepError(
                f"{out} holds work of an earlier preparation ({done[0].relative_to(out)}), but "
                f"not the tokenizer.json it was made with, and --tokenizer {cfg.tokenizer} "
                f"would train a new one; {FRESH}"
            )
    for split in SPLITS:
        path = out / f"{split}.manifest.json"
        if not (path.is_file() and (out / f"{split}.bin").is_file()):
            continue
        m = _read_marker(path) or {}
        layout = m.get("layout", "articles")
        if layout != cfg.layout:
            raise PrepError(
                f"{out} holds the {split} split in the {layout} layout, and --layout is "
                f"{cfg.layout}; {FRESH}"
            )
        if layout == "stream" and m.get("eos_id") is not None:
            raise PrepError(
                f"{path}: the {split} stream ends with {m.get('eos_token')!r}, as an older "
                f"megaloop wrote it (the study's ids have no end token); {FRESH}"
            )


def check_finished_tokenizer(out: Path, tokenizer: Path) -> None:
    """Every finished split was made with `tokenizer` (its sha256): else one PrepError."""
    digest = None
    for split in SPLITS:
        path = out / f"{split}.manifest.json"
        if not (path.is_file() and (out / f"{split}.bin").is_file()):
            continue
        recorded = (_read_marker(path) or {}).get("tokenizer_sha256")
        digest = digest or file_digest(tokenizer)
        if recorded != digest:
            raise PrepError(
                f"{path}: the {split} split was made with another tokenizer (sha256 "
                f"{recorded}) than {tokenizer} (sha256 {digest}); {FRESH}"
            )


def prepare(cfg: WikiTextConfig) -> dict:
    """Prepare (or resume) each split found; the manifests of the splits finished by this run."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    check_resume(cfg, out)  # before anything is written there (the hub's files included)
    files = source_files(cfg.source, out)
    tokenizer = out / "tokenizer.json"
    trained = trained_tokenizer(cfg.tokenizer)
    if not (trained and tokenizer.is_file()):  # else: resume with it
        if trained and trained[0] == "words":
            check_words_sources(cfg, files, Path(cfg.source))
            marker = {
                "tokenizer": cfg.tokenizer,
                "rule": WORDS_RULE,
                "sources": {s: str(files[s]) for s in ("train", "valid")},
            }
            write_manifest(out / WORDS_MARKER, marker)  # before tokenizer.json: never after it
        tokenizer = resolve_tokenizer(cfg.tokenizer, out, training_text(cfg, files))
    check_finished_tokenizer(out, tokenizer)
    vocab = load_tokenizer(tokenizer).get_vocab_size()
    stream = cfg.layout == "stream"
    eos = None if stream else cfg.eos_token  # the study's stream has no end token
    eos_token_id = None if stream else eos_id(tokenizer, cfg.eos_token)
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
        if stream:  # the study's text exactly: nothing in it is dropped
            reader = [WikiTextStream(str(path), split, PIECE_CHARS)]
        else:
            reader = [WikiTextReader(str(path), split), BadDocumentGuard(cfg.max_doc_bytes)]
        pipeline = [
            *reader,
            IndexedDatasetWriter(str(out), split, str(tokenizer), dtype.__name__, eos),
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
            # the token that ends each document; null: nothing ends the stream
            "eos_token": eos,
            "eos_id": eos_token_id,
            "tokenizer": str(Path(tokenizer).resolve()),
            "tokenizer_sha256": file_digest(tokenizer),
            "source": str(path),
            "source_sha256": file_digest(path),
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


def prepared(cfg: WikiTextConfig) -> Prepared | None:
    """The splits in cfg.out with their tokens, and the experiment that trains on them: the
    study's preset for its stream layout, megaloop's own WikiText-103 rows for articles. None
    while no train split is there or a split's datatrove task has not completed (Slurm)."""
    out = Path(cfg.out)
    manifests = {
        s: json.loads((out / f"{s}.manifest.json").read_text())
        for s in SPLITS
        if (out / f"{s}.manifest.json").is_file()
    }
    started = [s for s in SPLITS if (out / "logs" / s).is_dir()]
    if "train" not in manifests or any(
        s not in manifests and not (out / "logs" / s / "completions" / "00000").is_file()
        for s in started
    ):
        return None
    parts = []
    for split, m in manifests.items():
        documents = f", {m['documents']:,} articles" if m.get("layout") != "stream" else ""
        parts.append(f"{split} ({m['tokens']:,} tokens{documents})")
    train = manifests["train"]
    stream = train.get("layout") == "stream"
    return Prepared(
        out=str(out),
        holds=", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1],
        vocab_size=train["vocab_size"],
        config=f"experiments/{'study' if stream else 'wikitext103'}/44m/per_loop_norm",
        data={
            "path": str(out / "train"),
            "valid_path": str(out / "valid") if "valid" in manifests else None,
        },
    )


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
