"""The measurement harness shared by `megaloop depth`, `halt` and `diagnose`.

MODEL is a run directory, a checkpoint folder or a `megaloop export` folder. Every kind is opened
as the exported model (plain PyTorch, megaloop/model/modeling_megaloop.py): a run is
consolidated and converted in memory, so a measurement of a run equals the same measurement of
its export. The measurements drive that model one loop at a time through its `embed`, `loops`,
`readout` and `exit_probability`. The commands that need the export folder itself (`generate`,
`eval downstream`) take every kind through `as_export`: a run is exported into a temporary
folder for the command's duration.

--data is held-out text (tokenised with the model's tokenizer), a .npy of token ids, a prepared
indexed split (the PREFIX of PREFIX.bin/.idx from `megaloop prep wikitext103`), or webdataset
shards from `megaloop prep fineweb` (one .tar, or a prep folder: its last shard). A slice is a
run of consecutive, non-overlapping windows of seq_len+1 tokens in file order, window i starting
at token i·seq_len: every command reads the same tokens for every model.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from megaloop.evaluation.exported import EvalError, open_export
from megaloop.evaluation.settings import MODEL_KINDS

DATA_KINDS = (
    "a text file, a .npy of token ids, an indexed split PREFIX (PREFIX.bin/.idx) or "
    "webdataset shards (a .tar or a `megaloop prep fineweb` folder)"
)


@dataclass
class Opened:
    """A model ready to measure, how to tokenise text for it, and where it came from."""

    model: torch.nn.Module
    encode: Callable[[str], np.ndarray]
    info: dict = field(default_factory=dict)
    """path, kind (run | checkpoint | export), step, num_loops_trained, run_config."""

    @property
    def trained_loops(self) -> int:
        return self.info["num_loops_trained"]

    def fitted(self, settings):
        """`settings` (a measurement's) for this model: its positions, the window length it
        trained on (the run's data.seq_len, where the export or run records it)."""
        config = self.model.config
        run = self.info.get("run_config") or {}
        trained = run.get("data", {}).get("seq_len")
        learned = getattr(config, "position_embedding", "rope") == "learned"
        return settings.fitted(config.max_position_embeddings, trained, learned)


def model_kind(path: Path) -> str:
    """export, checkpoint or run: what MODEL names, told from the files in it (nothing is read
    or checked yet); EvalError naming the path and the three kinds for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise EvalError(f"MODEL {path}: no such folder (give {MODEL_KINDS})")
    if (path / "meta.json").is_file():
        return "checkpoint"
    if (path / "config.json").is_file():
        return "export"
    if (path / "checkpoints").is_dir():
        return "run"
    raise EvalError(
        f"MODEL {path}: not a run directory (no checkpoints/), a checkpoint folder (no "
        "meta.json) or a `megaloop export` folder (no config.json)"
    )


def open_model(path: Path, device: str = "cpu", dtype: str = "float32") -> Opened:
    """A run directory, a checkpoint folder or an export, as the exported model in eval mode."""
    path = Path(path)
    kind = model_kind(path)
    if kind == "export":
        export = open_export(path)
        model, tokenizer = export.model(device, dtype), export.tokenizer()
        info = {
            "path": str(path),
            "kind": kind,
            "step": None,
            "num_loops_trained": model.config.num_loops_trained,
            "run_config": getattr(model.config, "run_config", None),
        }
        return Opened(model, lambda text: np.asarray(tokenizer(text)["input_ids"], np.int64), info)
    from megaloop import experiment
    from megaloop.data.tokenizer import load_tokenizer as megaloop_tokenizer
    from megaloop.export import hf_model
    from megaloop.parallel import distributed
    from megaloop.train import checkpoint

    distributed.init(seed=0)
    try:
        state, cfg, folder = experiment.consolidated(path)
    except ValueError as e:
        raise EvalError(f"MODEL {path}: {e}") from None
    model = hf_model(state, cfg.model).to(device=device, dtype=getattr(torch, dtype))
    tokenizer = megaloop_tokenizer(cfg.data.tokenizer_spec())
    info = {
        "path": str(path),
        "kind": kind,
        "checkpoint": str(folder),
        "step": checkpoint.read_meta(folder)["step"],
        "num_loops_trained": cfg.model.num_loops,
        "run_config": cfg.to_dict(),
    }
    return Opened(model, tokenizer.encode, info)


@contextlib.contextmanager
def as_export(path: Path) -> Iterator[tuple[Path, dict]]:
    """MODEL as a `megaloop export` folder, for the commands that hand one on (`generate`,
    `eval downstream`), and where it came from ({"path": MODEL, "kind"} and, but for an
    export, the "checkpoint" folder and its "step": what their results record). An export is
    itself; a run's newest complete checkpoint, or a checkpoint folder, is exported into a
    temporary folder that is deleted when the block ends."""
    path = Path(path)
    kind = model_kind(path)
    if kind == "export":
        yield path, {"path": str(path), "kind": kind, "step": None}
        return
    from megaloop import experiment, export
    from megaloop.parallel import distributed
    from megaloop.train import checkpoint

    distributed.init(seed=0)
    try:
        state, cfg, folder = experiment.consolidated(path)
    except ValueError as e:
        raise EvalError(f"MODEL {path}: {e}") from None
    step = checkpoint.read_meta(folder)["step"]
    print(f"megaloop: exporting {folder} (step {step}) to a temporary folder", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="megaloop-export-") as tmp:
        try:
            export.write(state, cfg, folder, Path(tmp))
        except ValueError as e:
            raise EvalError(f"MODEL {path}: {e}") from None
        del state
        yield Path(tmp), {"path": str(path), "kind": kind, "checkpoint": str(folder), "step": step}


def check_data(data: Path) -> None:
    """--data names something readable (checked before a model is opened)."""
    data = Path(data)
    if not (
        Path(f"{data}.bin").is_file()
        and Path(f"{data}.idx").is_file()
        or data.is_file()
        or (data / "manifest.json").is_file()
    ):
        raise EvalError(f"--data {data}: no such file; give {DATA_KINDS}")


def read_tokens(data: Path, encode: Callable[[str], np.ndarray]) -> np.ndarray:
    """The token stream of --data, in file order."""
    data = Path(data)
    check_data(data)
    if Path(f"{data}.bin").is_file() and Path(f"{data}.idx").is_file():
        from megaloop.data.indexed import TokenStream

        stream = TokenStream(str(data))
        return stream.read(0, stream.num_tokens)
    if data.suffix == ".tar" and data.is_file() or (data / "manifest.json").is_file():
        return _shard_tokens(data)
    if data.suffix == ".npy":
        return np.load(data, allow_pickle=False).astype(np.int64).reshape(-1)
    try:
        return np.asarray(encode(data.read_text(encoding="utf-8")), dtype=np.int64)
    except UnicodeDecodeError as e:
        raise EvalError(
            f"--data {data}: not UTF-8 text ({e.reason} at byte {e.start}); give {DATA_KINDS}"
        ) from None


def _shard_tokens(path: Path) -> np.ndarray:
    import webdataset as wds

    if path.is_dir():
        shards = sorted((path / "shards").glob("*.tar"))
        if not shards:
            raise EvalError(f"--data {path}: no shards/*.tar in this prep folder")
        path = shards[-1]
    stream = wds.WebDataset(
        str(path), shardshuffle=False, nodesplitter=None, empty_check=False
    ).decode()
    samples = [s["tokens.npy"].astype(np.int64) for s in stream]
    return np.concatenate(samples) if samples else np.zeros(0, np.int64)


def windows(
    tokens: np.ndarray, seq_len: int, count: int, start: int = 0, what: str = "--data"
) -> torch.Tensor:
    """Windows start..start+count-1 of seq_len+1 tokens (window i starts at token i·seq_len)."""
    available = max(0, (len(tokens) - 1) // seq_len)
    if count < 1:
        raise EvalError(f"{what}: the slice is empty (asked for {count} sequences)")
    if start + count > available:
        raise EvalError(
            f"{what}: {len(tokens):,} tokens hold {available} windows of "
            f"{seq_len} + 1 tokens; {start + count} are needed (windows {start} to "
            f"{start + count - 1}); give more text or fewer/shorter sequences"
        )
    index = (start + np.arange(count))[:, None] * seq_len + np.arange(seq_len + 1)[None]
    return torch.from_numpy(tokens[index])


def synchronize(device: str) -> None:
    """Wait for the device's queued work, so that a wall-clock timing holds it (CUDA)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def progress(iterable, desc: str, unit: str = "batch", total: int | None = None):
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, unit=unit, total=total, dynamic_ncols=True)


def batches(slice_: torch.Tensor, batch_size: int, desc: str) -> Iterator[torch.Tensor]:
    """The slice in batches, with a progress bar."""
    yield from progress(slice_.split(batch_size), desc)


def trajectory(
    model, inputs: torch.Tensor, num_loops: int, clamp: bool = False
) -> Iterator[tuple[int, torch.Tensor]]:
    """(k, H_k) for k = 1..num_loops of whole sequences [b, s] (no cache). With `clamp`, every
    H_k (k ≥ 2) is rescaled per token to its loop-1 RMS before it is read out or fed back."""
    h, rope = model.embed(inputs)
    yield from model.loops(h, rope, num_loops, clamp)


def token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy per token, [b, s] (fp32)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(
        targets.shape
    )


def write(out: Path, command: str, result: dict, markdown: str) -> Path:
    """OUT/<command>.json (the numbers and the exact settings) and OUT/<command>.md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "schema": 1,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **result,
    }
    tmp = out / f".{command}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1, default=_plain))
    tmp.replace(out / f"{command}.json")
    (out / f"{command}.md").write_text(markdown.rstrip() + "\n")
    return out / f"{command}.json"


def _plain(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def ppl(ce: float) -> float:
    return float(np.exp(ce))


def device_and_dtype(dtype: str = "auto", device: str | None = None) -> tuple[str, str]:
    from megaloop.evaluation.exported import placement

    return placement(device, dtype)
