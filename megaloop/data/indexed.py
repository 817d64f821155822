"""megatron-core indexed datasets (from `megaloop prep wikitext103`).

Training goes through megatron-core's GPTDataset and its dataset builder: samples of seq_len+1
tokens across document boundaries, shuffled as a function of (seed, epochs) only, so "4 epochs"
means four passes over the training tokens and any sample index is reproducible (exact resume in
any layout). With `data.stride` it reads the study's samples instead: overlapping windows of the
documents back to back, shuffled per epoch (batches.StridedWindows). Validation does not
shuffle: it reads the valid prefix's documents back to back in the order they are stored,
straight from megatron-core's IndexedDataset, and cuts that stream into windows in order
(batches.Windows), the same for every seed and variant: one every seq_len tokens, or with
`data.stride` one every `stride` tokens, overlapping as the study's validation windows do.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from megaloop.config import DataError
from megaloop.data.batches import IndexableData, StridedWindows, Windows, strided_windows
from megaloop.data.tokenizer import Tokenizer
from megaloop.parallel import comm

INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron-core's .idx magic, then version 1
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
"""megatron-core's DType codes of integer tokens (6 and 7 are floats: not token ids)."""
REPREPARE = "prepare it again with `megaloop prep wikitext103`"


def read_json(path: Path) -> dict:
    """A JSON object from `path` (a manifest), or one DataError naming the file."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(
            f"{path} is not a JSON manifest ({e}); it is written last by `megaloop "
            f"prep`, so the preparation did not finish: run it again"
        ) from None
    if not isinstance(data, dict):
        raise DataError(
            f"{path} holds a JSON {type(data).__name__}, not the object `megaloop "
            f"prep` writes; run the preparation again"
        )
    return data


def manifest(prefix: str) -> dict:
    path = Path(f"{prefix}.manifest.json")
    return read_json(path) if path.is_file() else {}


def check_indexed(prefix: str, vocab_size: int | None = None) -> int:
    """Check PREFIX.idx/.bin as megatron-core's IndexedDatasetBuilder writes them (header,
    sizes, contiguous documents, a .bin of exactly the indexed tokens; with `vocab_size`, every
    token id below it: from the manifest `megaloop prep` writes, or by reading every id when there
    is none) before megatron-core maps them, which asserts or reads past the end of a damaged
    pair. Returns the number of tokens; one DataError naming the file otherwise."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx, bin_):
        if not path.is_file():
            raise DataError(
                f"{path}: no such file; give the PREFIX of PREFIX.bin/PREFIX.idx "
                f"from `megaloop prep wikitext103` (e.g. OUT/train)"
            )
    raw = idx.read_bytes()
    if len(raw) < 34 or raw[:9] != INDEX_HEADER or int.from_bytes(raw[9:17], "little") != 1:
        raise DataError(
            f"{idx} is not a megatron-core index (no MMIDIDX version-1 header); {REPREPARE}"
        )
    dtype = TOKEN_DTYPES.get(raw[17])
    if dtype is None:
        raise DataError(f"{idx}: token dtype code {raw[17]} is not an integer type; {REPREPARE}")
    sequences, documents = (int.from_bytes(raw[a : a + 8], "little") for a in (18, 26))
    expected = 34 + 12 * sequences + 8 * documents
    if len(raw) != expected:
        raise DataError(
            f"{idx} is {len(raw)} bytes, but its header promises {sequences} "
            f"sequences and {documents} document indices ({expected} bytes): it is "
            f"truncated or damaged; {REPREPARE}"
        )
    lengths = np.frombuffer(raw, np.int32, sequences, 34).astype(np.int64)
    pointers = np.frombuffer(raw, np.int64, sequences, 34 + 4 * sequences)
    docs = np.frombuffer(raw, np.int64, documents, 34 + 12 * sequences)
    size = np.dtype(dtype).itemsize
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * size
    if sequences == 0:
        raise DataError(f"{idx} holds no documents; {REPREPARE} from a source with text")
    if (
        (lengths < 0).any()
        or not np.array_equal(pointers, starts)
        or len(docs) == 0
        or docs[0] != 0
        or docs[-1] != sequences
        or (np.diff(docs) < 0).any()
    ):
        bad = int(np.argmax((lengths < 0) | (pointers != starts)))
        raise DataError(
            f"{idx}: the document table is inconsistent (first bad entry: sequence "
            f"{bad}); {REPREPARE}"
        )
    tokens = int(lengths.sum())
    if bin_.stat().st_size != tokens * size:
        raise DataError(
            f"{bin_} is {bin_.stat().st_size} bytes, but {idx} indexes {tokens} "
            f"tokens of {size} byte(s) ({tokens * size} bytes): the pair is "
            f"truncated or from different runs; {REPREPARE}"
        )
    recorded = manifest(prefix).get("vocab_size") if vocab_size is not None else None
    if recorded is not None and recorded > vocab_size:
        raise DataError(
            f"{prefix}.manifest.json: the data was tokenized with {recorded} token "
            f"ids, more than model.vocab_size={vocab_size}; raise model.vocab_size "
            f"or {REPREPARE} with the model's tokenizer"
        )
    if vocab_size is not None and recorded is None and tokens:  # no manifest: read every id
        ids = np.memmap(bin_, dtype=dtype, mode="r")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            raise DataError(
                f"{bin_} holds token id {high if high >= vocab_size else low}, "
                f"outside model.vocab_size={vocab_size}: the data was made with "
                f"another tokenizer or is damaged; {REPREPARE}"
            )
    return tokens


def samples_for_epochs(prefix: str, seq_len: int, epochs: int, stride: int | None = None) -> int:
    """Samples that make exactly `epochs` passes: with a stride, `epochs` times its windows;
    else the most GPTDataset fits in `epochs` copies of the split (it needs
    num_samples*seq_len + 1 tokens)."""
    tokens = check_indexed(prefix)
    if stride is not None:
        return epochs * strided_windows(tokens, seq_len, stride)
    return (epochs * tokens - 1) // seq_len


class TokenStream:
    """The documents of an indexed dataset back to back, in the order they are stored."""

    def __init__(self, prefix: str):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        check_indexed(prefix)
        self.dataset = IndexedDataset(prefix)
        self.lengths = self.dataset.sequence_lengths.astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)])
        self.num_tokens = int(self.starts[-1])

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the stream, across document boundaries."""
        parts = []
        doc = int(np.searchsorted(self.starts, start, side="right")) - 1
        while count > 0:
            offset = start - int(self.starts[doc])
            n = min(count, int(self.lengths[doc]) - offset)
            parts.append(self.dataset.get(doc, offset, n))
            start, count, doc = start + n, count - n, doc + 1
        return np.concatenate(parts).astype(np.int64)


class IndexedData(IndexableData):
    def __init__(
        self,
        train_prefix: str,
        valid_prefix: str | None,
        seq_len: int,
        seed: int,
        num_train_samples: int,
        tokenizer: Tokenizer,
        cache_dir: str | None = None,
        stride: int | None = None,
    ):
        self.seq_len, self.tokenizer, self.stride = seq_len, tokenizer, stride
        for prefix in dict.fromkeys([train_prefix, valid_prefix or train_prefix]):
            check_indexed(prefix)  # token ids against the model: experiment.build_trainer
        if stride is None:
            self.train = gpt_dataset(
                train_prefix, seq_len, seed, num_train_samples, tokenizer, cache_dir
            )
        else:
            train = TokenStream(train_prefix)
            self.train = StridedWindows(
                train.read, train.num_tokens, seq_len, stride, seed, train_prefix
            )
        # without a valid prefix, the training split's own windows (a smoke check, not held out)
        stream = TokenStream(valid_prefix or train_prefix)
        self.valid = Windows(
            stream.read, stream.num_tokens, seq_len, valid_prefix or train_prefix, stride
        )

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        if self.stride is not None:
            return self.train[index]
        item = self.train[index]
        return torch.cat([item["tokens"], item["labels"][-1:]]).numpy()


def gpt_dataset(
    prefix: str,
    seq_len: int,
    seed: int,
    num_samples: int,
    tokenizer: Tokenizer,
    cache_dir: str | None,
):
    """megatron-core's GPTDataset of `num_samples` samples of the indexed dataset at `prefix`."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    # the token that ends the documents; null in a stream that nothing ends (the study's)
    eod = manifest(prefix).get("eos_id")
    eod = tokenizer.eos_id if eod is None else eod
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend_per_split=[([prefix], None), None, None],
        path_to_cache=cache_dir,
        create_attention_mask=False,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # what GPTDataset asks of a tokenizer (pad is unused: samples carry an extra token)
        tokenizer=SimpleNamespace(
            eod=eod,
            pad=-1,
            vocab_size=tokenizer.vocab_size,
            unique_identifiers={"eod": eod, "vocab_size": tokenizer.vocab_size},
        ),
    )

    def build():
        return BlendedMegatronDatasetBuilder(
            GPTDataset, [num_samples, None, None], lambda: True, config
        ).build()[0]

    # rank 0 writes the shuffle-index cache, then every rank reads it
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        dataset = build()
    comm.barrier()
    return dataset if rank0 else build()
