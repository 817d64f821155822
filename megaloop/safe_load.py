"""Reading checkpoint files without running code from them.

A checkpoint may come from elsewhere, and its manifest (sizes, xxh64) catches accidents, not
attacks: anyone can recompute it. Pickle runs whatever callables a file names, and the engines'
own loaders unpickle freely: DeepSpeed 0.19.8 calls `torch.load(weights_only=False)` (its
TorchCheckpointEngine, zero_to_fp32), torch.distributed.checkpoint unpickles `.metadata` with
plain `pickle.load` and each ShardedObject's bytes with `torch.load(weights_only=False)`
(DefaultLoadPlanner.load_bytes), and megatron-core's `common.pt` load leaves weights_only to
torch's default (which an environment variable can turn off).

Inside `untrusted(folder)` every one of them goes through megaloop's loaders instead:
`torch.load` always runs with `weights_only=True` (plus, for DeepSpeed's files, an explicit
allow-list of the few data classes they hold: `deepspeed_globals`), and `.metadata` is read by
an unpickler that admits only the torch.distributed.checkpoint metadata classes. Anything else
is refused before it is called, as a CheckpointError naming the file and the callable.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from megaloop.config import CheckpointError

# What a torch_dist `.metadata` holds (torch 2.13): dataclasses, enums, torch.Size, dtypes,
# and torch's own layout decoder.
METADATA_GLOBALS = frozenset(
    {
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        *(
            ("torch.distributed.checkpoint.planner", name)
            for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
        ),
    }
)


def deepspeed_globals() -> list:
    """The non-tensor classes DeepSpeed 0.19.8's model and optimizer state files hold (ZeRO 0-3,
    fp32 and bf16): found by loading real checkpoints with weights_only=True."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def refused(name: str, what: str) -> CheckpointError:
    """The error for a refused file; also kept for `untrusted` to raise when an engine's code
    wraps it into an exception of its own."""
    _Guard.refusal = CheckpointError(
        f"{name}: refused to load: it would call {what}, which is not among the tensors and "
        f"data classes a checkpoint holds (a pickle that runs code?). megaloop reads checkpoints "
        f"with torch.load(weights_only=True) and an allow-list; nothing was run or written"
    )
    return _Guard.refusal


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only METADATA_GLOBALS and torch dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")


def _global_of(error: Exception) -> str:
    found = re.search(r"GLOBAL (\S+?)[ :]", str(error) + " ")
    return found.group(1) if found else f"something not allowed ({str(error).splitlines()[0]})"


def load_metadata(path) -> torch.distributed.checkpoint.Metadata:
    """A torch_dist checkpoint's `.metadata`, through MetadataUnpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise refused(str(path), _global_of(e)) from None
        except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
            raise CheckpointError(f"{path} is not readable torch_dist metadata ({e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not torch_dist metadata")
    return metadata


class _Guard:
    """The patches `untrusted` installs, once however deeply it is nested (the outermost
    `allowed` applies)."""

    lock = threading.RLock()
    depth = 0
    saved: dict = {}
    refusal: CheckpointError | None = None


def _safe_torch_load(original, folder: Path, allowed: list):
    """torch.load as the engines call it, but always with weights_only=True."""

    def load(f, map_location=None, pickle_module=None, *, weights_only=None, **kwargs):
        name = (
            str(f)
            if isinstance(f, (str, os.PathLike))
            else f"an object stored in the *.distcp shards of {folder}"
            if isinstance(f, io.BytesIO)
            else f"a file of {folder}"
        )
        with torch.serialization.safe_globals(allowed):
            try:
                return original(f, map_location=map_location, weights_only=True, **kwargs)
            except pickle.UnpicklingError as e:
                raise refused(name, _global_of(e)) from None

    return load


def _safe_read_metadata(self, *args, **kwargs):
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = load_metadata(self._get_metadata_path(kwargs.get("rank")))
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _check_torch_dist(folder: Path) -> None:
    """Read a torch_dist checkpoint's `.metadata` and `common.pt` (both small) before megatron-core
    does: a refusal then comes as itself, before torch.distributed.checkpoint logs and wraps it."""
    if (folder / ".metadata").is_file():
        load_metadata(folder / ".metadata")
    if (folder / "common.pt").is_file():
        torch.load(folder / "common.pt", map_location="cpu")


@contextlib.contextmanager
def untrusted(folder, allowed: Sequence[type] = ()) -> Iterator[None]:
    """Load checkpoint files under `folder` (by any engine's code) only through safe loaders;
    `allowed`: classes torch.load may build besides tensors and plain containers."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    with _Guard.lock:
        if _Guard.depth == 0:
            _Guard.saved = {"load": torch.load, "read_metadata": FileSystemReader.read_metadata}
            _Guard.refusal = None
            torch.load = _safe_torch_load(torch.load, Path(folder), list(allowed))
            FileSystemReader.read_metadata = _safe_read_metadata
        _Guard.depth += 1
    try:
        _check_torch_dist(Path(folder))
        yield
    except (Exception, CheckpointException):
        if _Guard.refusal is not None:  # torch.distributed.checkpoint wraps what it raises
            raise _Guard.refusal from None
        raise
    finally:
        with _Guard.lock:
            _Guard.depth -= 1
            if _Guard.depth == 0:
                torch.load = _Guard.saved["load"]
                FileSystemReader.read_metadata = _Guard.saved["read_metadata"]
