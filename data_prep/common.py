"""Pipeline steps shared by the corpora: reading that survives bad files, the bad-document guard,
tokenizers, the megatron-core indexed-dataset writer, executors and manifests."""

from __future__ import annotations

import gzip
import io
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.utils.tokenization import PipelineStepWithTokenizer
from tqdm import tqdm

from data_prep.config import (  # noqa: F401  (EOS and PrepError re-exported for the corpora)
    EOS,
    ExecutorConfig,
    PrepError,
    trained_tokenizer,
)
from megaloop.data.tokenizer import WORD_SPECIALS, special_tokens

# -- reading ---------------------------------------------------------------------------------


class RobustReader(BaseDiskReader):
    """JSONL (optionally .gz) and parquet files with a `text` field. A record that is not valid
    UTF-8 or JSON is counted and skipped; a file that cannot be read at all is counted, logged
    and skipped, and the rest of the task goes on."""

    name = "📖 robust reader"

    def read_file(self, filepath: str) -> DocumentsPipeline:
        self._bad: dict[str, list] = {}  # reason -> [count, first line]
        records = 0
        try:
            if filepath.endswith(".parquet"):
                for records, document in enumerate(self._parquet(filepath), start=1):  # noqa: B007
                    yield document
            else:
                for records, document in enumerate(self._jsonl(filepath), start=1):  # noqa: B007
                    yield document
        except Exception as e:  # a corrupt gzip/parquet stream, a permission error, ...
            self.stat_update("unreadable_files")
            kept = (
                f"kept the {records} document(s) read before it"
                if records
                else "nothing of it was kept"
            )
            print(
                f"megaloop prep: {filepath}: unreadable ({type(e).__name__}: {e}); {kept}, "
                f"skipped the rest",
                flush=True,
            )
        for reason, (count, line) in self._bad.items():
            print(
                f"megaloop prep: {filepath}: skipped {count} {reason} record(s), the first at "
                f"line {line}",
                flush=True,
            )

    def _document(self, record: dict, filepath: str, i: int):
        """The record's Document, or None when its text is missing, empty or not a string."""
        if not isinstance(record.get(self.text_key), str):
            return None
        return self.get_document_from_dict(record, filepath, i)

    def _skip(self, reason: str, line: int) -> None:
        self.stat_update(
            {"non-UTF-8": "non_utf8_records", "invalid JSON": "invalid_json_records"}[reason]
        )
        entry = self._bad.setdefault(reason, [0, line])
        entry[0] += 1

    def _jsonl(self, filepath: str):
        with self.data_folder.open(filepath, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if filepath.endswith(".gz") else raw
            for i, line in enumerate(io.BufferedReader(stream)):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    self._skip("non-UTF-8", i + 1)
                    continue
                except json.JSONDecodeError:
                    self._skip("invalid JSON", i + 1)
                    continue
                if not isinstance(record, dict):
                    self._skip("invalid JSON", i + 1)  # a JSON line, but not an object
                    continue
                document = self._document(record, filepath, i)
                if document:
                    yield document
                else:
                    self.stat_update("records_without_text")

    def _parquet(self, filepath: str):
        import pyarrow.parquet as pq

        with self.data_folder.open(filepath, "rb") as f:
            table = pq.read_table(f)
        for i, record in enumerate(table.to_pylist()):
            document = self._document(record, filepath, i)
            if document:
                yield document
            else:
                self.stat_update("records_without_text")


# control characters (but tab and newlines), surrogates and private-use code points
CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ue000-\uf8ff]")


class BadDocumentGuard(BaseFilter):
    """Drops what no tokenizer should see: empty documents, binary junk (control characters),
    and single documents larger than `max_bytes`. datatrove counts each reason."""

    name = "🛡 bad-document guard"

    def __init__(self, max_bytes: int = 10 * 2**20, max_control_fraction: float = 0.05):
        super().__init__()
        self.max_bytes, self.max_control_fraction = max_bytes, max_control_fraction

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = doc.text
        if not text or not text.strip():
            return False, "empty"
        if len(text) * 4 > self.max_bytes and len(text.encode("utf-8")) > self.max_bytes:
            return False, "too_long"
        sample = text[:100_000]
        control = len(CONTROL.findall(sample))
        if control > self.max_control_fraction * len(sample) or "\ufffd" * 8 in sample:
            return False, "binary"
        return True


# -- tokenizers ------------------------------------------------------------------------------


def resolve_tokenizer(spec: str, out: Path, training_text=None) -> Path:
    """A tokenizer.json path for `spec`: a local file, a Hugging Face hub name (downloaded), or
    one trained on `training_text` and saved as out/tokenizer.json: `train:N` (a byte-level BPE
    of N tokens) or `words:N` (the study's word-level vocabulary; `training_text` is then the
    rows its tokens are counted in, each on its own: train_words)."""
    out.mkdir(parents=True, exist_ok=True)
    trained = trained_tokenizer(spec)
    if trained:
        if training_text is None:
            raise PrepError(
                f"--tokenizer {spec}: training a tokenizer needs the training split; "
                f"give a source with wiki.train.raw or pass a tokenizer.json"
            )
        kind, size = trained
        train = train_bpe if kind == "train" else train_words
        return train(training_text, size, out / "tokenizer.json")
    if Path(spec).is_file():
        return Path(spec)
    if Path(spec).is_dir():
        if (Path(spec) / "tokenizer.json").is_file():
            return Path(spec) / "tokenizer.json"
        raise PrepError(f"--tokenizer {spec}: a folder without tokenizer.json; pass the file")
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(spec, "tokenizer.json"))
    except Exception as e:
        raise PrepError(
            f"--tokenizer {spec!r} is not a file and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}); pass a tokenizer.json path, "
            f"train:N or words:N"
        ) from None


def train_bpe(texts, vocab_size: int, path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(path))
    return path


WORD_CLASSES = (r"\s+", r"[A-Za-z0-9_]+", r"[^\w\s]")
WORD_PATTERN = "|".join(WORD_CLASSES)
"""The study's tokens, in Python's `re`: whitespace runs, ASCII word runs, and single characters
that are neither word nor space. A character none of them matches (é, ½: word characters outside
[A-Za-z0-9_]) is dropped."""


def _as_python_reads_it(alternative: str) -> str:
    r"""One of WORD_CLASSES (a character class, maybe repeated) with its class spelled out as the
    code points Python's `re` puts in it, in the regex syntax of `tokenizers` (\x{..} ranges).
    That engine's Unicode tables disagree with Python's (½ and ² are \w to Python, Myanmar vowel
    signs to it), so the pattern must not leave \w and \s to it."""
    char_class = alternative.removesuffix("+")
    ranges = []
    for run in re.finditer(char_class + "+", "".join(map(chr, range(0x110000)))):
        # surrogates never reach a tokenizer: its text is UTF-8
        for lo, hi in (
            (run.start(), min(run.end(), 0xD800)),
            (max(run.start(), 0xE000), run.end()),
        ):
            if lo < hi:
                ranges.append(f"\\x{{{lo:x}}}-\\x{{{hi - 1:x}}}")
    return "[" + "".join(ranges) + "]" + alternative[len(char_class) :]


def word_pre_tokenizer():
    """The study's tokens as a `tokenizers` pre-tokenizer: the matches of WORD_PATTERN kept, the
    rest removed, so that its tokens are `re.findall(WORD_PATTERN, text)` on any text."""
    from tokenizers import Regex, pre_tokenizers

    pattern = "|".join(_as_python_reads_it(a) for a in WORD_CLASSES)
    return pre_tokenizers.Split(Regex(pattern), behavior="removed", invert=True)


def count_words(rows) -> Counter:
    r"""The study's token counts: each row tokenized on its own with Python's `re` (the rule of
    readout-blind-spot src/data/dataset.py, RegexTokenizer.from_texts over the rows its
    src/train_ar_looplm.py build_dataset loads), so a token that exists only where rows are
    joined (the whitespace run around a "\n\n" join) is never counted."""
    pattern, counts = re.compile(WORD_PATTERN), Counter()
    for row in rows:
        counts.update(pattern.findall(row))
    return counts


def train_words(rows, size: int, path: Path) -> Path:
    """The study's word-level tokenizer of `rows` (count_words): ids 0-3 for WORD_SPECIALS, then
    the other tokens counted at least twice, by descending count and then the token, at most
    `size` ids in all; any other token encodes as <unk>. Its pre-tokenizer splits as `re` does
    (word_pre_tokenizer), so a joined text encodes token for token as the study's does. Decoding
    concatenates the tokens (nothing added between them). Written atomically: a tokenizer.json
    that exists is a whole one."""
    from tokenizers import Tokenizer, decoders, models

    counts = count_words(rows)
    ranked = sorted(
        (t for t, n in counts.items() if n >= 2 and t not in WORD_SPECIALS),
        key=lambda t: (-counts[t], t),
    )
    vocab = {token: i for i, token in enumerate([*WORD_SPECIALS, *ranked][:size])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=WORD_SPECIALS[3]))
    tokenizer.pre_tokenizer = word_pre_tokenizer()
    tokenizer.decoder = decoders.Fuse()
    tmp = path.with_name(path.name + ".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(path)
    return path


def load_tokenizer(path: Path):
    """The `tokenizers.Tokenizer` of a tokenizer.json, or one PrepError naming the file."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for unparsable JSON
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PrepError(
            f"--tokenizer {path} is not a Hugging Face tokenizer.json ({reason})"
        ) from None


def eos_id(tokenizer_path: Path, eos: str = EOS) -> int:
    tok = load_tokenizer(tokenizer_path)
    token = tok.token_to_id(eos)
    if token is None:
        own = special_tokens(tok).get("eos_token")
        raise PrepError(
            f"tokenizer {tokenizer_path} has no {eos!r} token to end documents with; "
            f"pass --eos-token with one it has" + (f" (its own: --eos-token {own})" if own else "")
        )
    return token


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.int32


# -- tokenize and write ----------------------------------------------------------------------


class TokenizingStep(PipelineStepWithTokenizer):
    """Tokenizes documents in batches, each followed by `eos_token` (None: by nothing, and
    without the special tokens the tokenizer's own post-processor would add: the ids of the
    text alone), and counts documents and tokens on a progress bar; subclasses decide where the
    tokens go."""

    def __init__(self, tokenizer_path: str, eos_token: str | None = EOS, batch_size: int = 256):
        super().__init__(tokenizer_path, eos_token)
        self.batch_size = batch_size

    def token_batches(self, data: DocumentsPipeline, rank: int, desc: str):
        from datatrove.utils.batching import batched

        start, docs, tokens = time.perf_counter(), 0, 0
        with tqdm(
            desc=f"{desc} [task {rank}]", unit="doc", position=rank, leave=True, mininterval=1.0
        ) as bar:
            for batch in batched(data, self.batch_size):
                with self.track_time(unit="batch"):  # the post-processor appends the EOS
                    encoded = self.tokenizer.encode_batch(
                        [d.text for d in batch], add_special_tokens=self.eos_token is not None
                    )
                ids = [np.asarray(e.ids, np.int64) for e in encoded]
                docs += len(batch)
                tokens += sum(len(i) for i in ids)
                self.stat_update("documents", value=len(batch))
                self.stat_update("tokens", value=sum(len(i) for i in ids))
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.update(len(batch))
                bar.set_postfix_str(f"{docs / elapsed:,.0f} docs/s, {tokens / elapsed:,.0f} tok/s")
                yield batch, ids


class IndexedDatasetWriter(TokenizingStep):
    """Writes this task's documents as a megatron-core indexed dataset (.bin/.idx, written with
    megatron-core's own IndexedDatasetBuilder) named `{prefix}_{rank:05d}`."""

    name = "💾 megatron indexed dataset"
    type = "✍ WRITER"

    def __init__(
        self,
        output_dir: str,
        prefix: str,
        tokenizer_path: str,
        dtype: str,
        eos_token: str | None = EOS,
    ):
        super().__init__(tokenizer_path, eos_token)
        self.output_dir, self.prefix, self.dtype = output_dir, prefix, dtype

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        part = Path(self.output_dir) / f"{self.prefix}_{rank:05d}"
        builder = IndexedDatasetBuilder(f"{part}.bin", dtype=np.dtype(self.dtype).type)
        for _, ids in self.token_batches(data, rank, self.prefix):
            for doc_ids in ids:
                builder.add_document(doc_ids, [len(doc_ids)])
        builder.finalize(f"{part}.idx")
        yield from ()


def merge_indexed(output_dir: Path, prefix: str, parts: int, dtype) -> Path:
    """One `{prefix}.bin/.idx` from the tasks' parts (megatron-core's builder, in task order)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    final = output_dir / prefix
    if parts == 1:
        for ext in (".bin", ".idx"):
            (output_dir / f"{prefix}_00000{ext}").replace(f"{final}{ext}")
        return final
    builder = IndexedDatasetBuilder(f"{final}.bin", dtype=np.dtype(dtype).type)
    for rank in range(parts):
        builder.add_index(str(output_dir / f"{prefix}_{rank:05d}"))
    builder.finalize(f"{final}.idx")
    for rank in range(parts):
        for ext in (".bin", ".idx"):
            (output_dir / f"{prefix}_{rank:05d}{ext}").unlink()
    return final


# -- executors and stats ---------------------------------------------------------------------


def make_executor(
    pipeline: list[PipelineStep], logging_dir: Path, tasks: int, execution: ExecutorConfig
):
    """datatrove's local or Slurm executor; completion markers in `logging_dir` make a re-run
    resume where the last one stopped (finished tasks are skipped)."""
    if execution.executor == "slurm":
        from datatrove.executor.slurm import SlurmPipelineExecutor

        return SlurmPipelineExecutor(
            pipeline,
            tasks=tasks,
            time=execution.time,
            partition=execution.partition,
            cpus_per_task=execution.cpus_per_task,
            job_name=execution.job_name,
            logging_dir=str(logging_dir),
            max_array_size=execution.max_array_size,
            workers=execution.workers,
            venv_path=_venv_activate(),
        )
    from datatrove.executor.local import LocalPipelineExecutor

    return LocalPipelineExecutor(
        pipeline, tasks=tasks, workers=min(execution.workers, tasks), logging_dir=str(logging_dir)
    )


def run_pipeline(
    pipeline: list[PipelineStep], logging_dir: Path, tasks: int, execution: ExecutorConfig
) -> bool:
    """Run (locally) or submit (Slurm) the pipeline; true when all its tasks have completed,
    false while submitted Slurm tasks are still to finish (run the command again then)."""
    executor = make_executor(pipeline, logging_dir, tasks, execution)
    executor.run()
    pending = execution.executor == "slurm" and not all(
        executor.is_rank_completed(r) for r in range(tasks)
    )
    if pending:
        print(
            f"megaloop prep: {tasks} task(s) are queued or running on Slurm (logs in "
            f"{logging_dir}); run the same command again when they are done to finish",
            flush=True,
        )
        return False
    return True


def _venv_activate() -> str | None:
    """This venv's activate script, so array tasks find datatrove's `launch_pickled_pipeline`."""
    script = Path(sys.prefix, "bin", "activate")
    return str(script) if sys.prefix != sys.base_prefix and script.is_file() else None


def read_stats(logging_dir: Path) -> list:
    """The merged stats of all tasks. On Slurm datatrove merges them in a job that runs after
    the array; a re-run that comes first merges the per-task files itself."""
    path = logging_dir / "stats.json"
    if not path.is_file():
        from datatrove.utils.stats import PipelineStats

        parts = [
            PipelineStats.from_json(json.loads(p.read_text()))
            for p in sorted((logging_dir / "stats").glob("*.json"))
        ]
        if not parts:
            return []
        with open(path, "w") as f:
            sum(parts, start=PipelineStats()).save_to_disk(f)
    return json.loads(path.read_text())


def stat(stats: list, step_name_part: str, key: str) -> int:
    """The total of `key` in the stats of the step whose name contains `step_name_part`."""
    for step in stats:
        if step_name_part in step["name"]:
            value = step["stats"].get(key, 0)
            return int(value["total"] if isinstance(value, dict) else value)
    return 0


def write_manifest(path: Path, manifest: dict) -> None:
    """Atomically: the manifest marks a finished preparation, so it is never seen half-written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(path)
