"""Packed sequences from webdataset shards (from `megaloop prep fineweb`), streamed.

Each data-parallel rank reads its own shards of each epoch (an order drawn from (seed, epoch),
then `order[dp_rank::dp_size]` through webdataset's node-splitting hook, since webdataset's own
`split_by_node` splits over *global* ranks, which would hand tensor-parallel peers different
data), so ranks see disjoint samples whose union is the epoch. `resampled=true` instead draws
each next shard with replacement from (seed, rank, shard number): an endless stream. The shard
order is megaloop's, not webdataset's shardshuffle (set to False), because it must be
reproducible: a resumed run restarts at the first shard boundary at or after the saved position.
Shards may come from elsewhere: a member named with an absolute path or `..` is refused
(UnsafeShard), never read.
The last `valid_shards` shards are held out for validation: validation sample i is their i-th
sequence, in shard name order and the order within each shard.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from megaloop.config import DataError

REPREPARE = "prepare the data again (megaloop prep fineweb)"


class UnsafeShard(DataError):
    """A shard member named outside the shard (an absolute path or `..`)."""


def _checked(files: Iterable[dict]) -> Iterator[dict]:
    for f in files:
        name = f.get("fname")
        if name is not None and (
            PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts
        ):
            raise UnsafeShard(
                f"data shard {f.get('__url__')}: member {name!r} is named outside "
                f"the shard (an absolute path or '..'); refusing the shard: "
                f"{REPREPARE}"
            )
        yield f


@contextmanager
def damaged_shard(where: Path):
    """A shard that tar or numpy cannot read becomes one DataError naming it."""
    try:
        yield
    except DataError:
        raise
    except (tarfile.TarError, OSError, ValueError, KeyError) as e:
        url = getattr(e, "url", None) or where
        raise DataError(
            f"data shard {url} cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); {REPREPARE}"
        ) from None


def tar_samples(src: Iterable[dict]) -> Iterator[dict]:
    """webdataset's tarfile_to_samples with each member's name checked (_checked)."""
    from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

    return group_by_keys(_checked(tar_file_expander(url_opener(src))))


class ShardData:
    def __init__(
        self, folder: str, seq_len: int, seed: int, valid_shards: int, resampled: bool, tokenizer
    ):
        self.folder, self.seed, self.resampled, self.tokenizer = (
            Path(folder),
            seed,
            resampled,
            tokenizer,
        )
        manifest = json.loads((self.folder / "manifest.json").read_text())
        if manifest["seq_len"] != seq_len:
            raise ValueError(
                f"data.path {folder} holds sequences of {manifest['seq_len']} (+1) "
                f"tokens; set data.seq_len={manifest['seq_len']} or prepare again "
                f"with --seq-len {seq_len}"
            )
        counts = manifest["shards"]
        names = sorted(counts)
        if len(names) <= valid_shards:
            raise ValueError(
                f"data.path {folder} has {len(names)} shards: too few to hold out "
                f"data.valid_shards={valid_shards} for validation"
            )
        self.seq_len = seq_len
        self.train_shards = names[: len(names) - valid_shards]
        self.counts = {n: counts[n] for n in names}
        self._valid = np.concatenate([self._read(n) for n in names[len(names) - valid_shards :]])

    def _read(self, name: str) -> np.ndarray:
        import webdataset as wds

        path = self.folder / "shards" / name
        with damaged_shard(path):
            rows = [
                s["tokens.npy"]
                for s in wds.DataPipeline(wds.SimpleShardList(str(path)), tar_samples, wds.decode())
            ]
        if len(rows) != self.counts[name] or any(r.shape != (self.seq_len + 1,) for r in rows):
            raise DataError(
                f"data shard {path} holds {len(rows)} readable sequences of "
                f"{self.seq_len + 1} tokens; manifest.json says {self.counts[name]}: "
                f"truncated or damaged; {REPREPARE}"
            )
        return np.stack(rows).astype(np.int64)

    @property
    def valid_windows(self) -> int:
        return len(self._valid)

    def batch(self, indices, split: str = "valid") -> torch.Tensor:
        assert split == "valid", "training samples are streamed (see batches())"
        indices = list(indices)
        if indices and not 0 <= min(indices) <= max(indices) < len(self._valid):
            raise IndexError(
                f"validation sequences {indices[0]}..{indices[-1]}: the held-out "
                f"shards of {self.folder} hold {len(self._valid)}"
            )
        return torch.from_numpy(self._valid[indices])

    def shard_order(self, dp_rank: int, dp_size: int) -> Iterator[str]:
        """This rank's endless sequence of shards."""
        if self.resampled:
            n = 0
            while True:
                rng = np.random.default_rng([self.seed, dp_rank, n])
                yield self.train_shards[int(rng.integers(len(self.train_shards)))]
                n += 1
        epoch = 0
        while True:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.train_shards))
            mine = [self.train_shards[i] for i in order][dp_rank::dp_size]
            if not mine:
                raise ValueError(
                    f"{len(self.train_shards)} training shards cannot feed "
                    f"{dp_size} data-parallel ranks; prepare smaller shards"
                )
            yield from mine
            epoch += 1

    def batches(self, *args, **kwargs) -> StreamBatches:
        return StreamBatches(self, *args, **kwargs)


class StreamBatches:
    """Micro-batches from this rank's shard stream; `consumed_samples` (over all DP ranks) is
    the data position, restored to the next shard boundary."""

    def __init__(
        self,
        data: ShardData,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
    ):
        self.data, self.dp_rank, self.dp_size = data, dp_rank, dp_size
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.consumed_samples = consumed_samples
        self._samples = None

    def _stream(self) -> Iterator[np.ndarray]:
        import webdataset as wds

        mine = self.consumed_samples // self.dp_size
        seen, shards = 0, self.data.shard_order(self.dp_rank, self.dp_size)
        for name in shards:  # skip whole shards up to the first boundary at or after `mine`
            if seen >= mine:
                break
            seen += self.data.counts[name]
        folder = self.data.folder / "shards"

        def urls():
            first = name
            while True:
                yield {"url": str(folder / first)}
                first = next(shards)

        stream = iter(wds.DataPipeline(urls, wds.split_by_worker, tar_samples, wds.decode()))
        while True:
            with damaged_shard(folder):
                sample = next(stream, None)
            if sample is None:
                return
            yield sample["tokens.npy"].astype(np.int64)

    def next_step(self) -> list[torch.Tensor]:
        if self._samples is None:
            self._samples = self._stream()
        per_rank = self.global_batch_size // self.dp_size
        rows = [next(self._samples) for _ in range(per_rank)]
        self.consumed_samples += self.global_batch_size
        return [
            torch.from_numpy(np.stack(rows[i : i + self.micro_batch_size]))
            for i in range(0, per_rank, self.micro_batch_size)
        ]
