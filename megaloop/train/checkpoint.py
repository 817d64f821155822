"""Checkpoints: megatron-core dist_checkpointing (torch_dist) in the run directory.

    checkpoints/step_0000120/   model, optimizer (DistributedOptimizer, fully reshardable),
                                scheduler, step, data position, per-rank RNG, manifest.json
    checkpoints/latest          the newest complete checkpoint's folder name

A checkpoint is written into `.tmp_step_*` and renamed into place after every rank has
finished and rank 0 has written `manifest.json` (size and xxh64 of every file), so a folder
named `step_*` is complete by construction. Resuming verifies the manifest of the newest one
and falls back to older ones, reporting each it skips. Tensors are stored under the one-device
model's names, so a checkpoint loads into any TP × PP × DP layout.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import xxhash
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

log = logging.getLogger("megaloop.checkpoint")

MANIFEST = "manifest.json"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def _is_rank0() -> bool:
    return dist.get_rank() == 0


def _layout() -> dict:
    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _rng_state(layout: dict) -> ShardedObject:
    """This rank's RNG states; restored only into the same layout (the data order does not
    depend on them: it is a function of the sample index)."""
    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    return ShardedObject(
        "rng_state", state, (layout["pp"], layout["tp"], layout["dp"]),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
         ps.get_data_parallel_rank()), replica_id=0)


def _sharded_state(module, optimizer, loading: bool) -> dict:
    model = module.sharded_state_dict()
    return {"model": model,
            "optimizer": optimizer.sharded_state_dict(model, is_loading=loading,
                                                      metadata=OPTIMIZER_METADATA)}


def _file_digest(path: Path) -> str:
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "xxh64": _file_digest(p)}
             for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / MANIFEST).write_text(json.dumps(files, indent=1))


def verify(folder: Path) -> Optional[str]:
    """None if `folder` is a complete checkpoint, else why not."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (an interrupted save?)"
    try:
        files = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return "manifest.json is not valid JSON"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _file_digest(path) != expected["xxh64"]:
            return f"{name} does not match its checksum (corrupt)"
    return None


def save(root: Path, step: int, module, optimizer, scheduler, meta: dict,
         keep_last: int) -> Path:
    """Collective: every rank calls it."""
    final, tmp = step_dir(root, step), root / f".tmp_{step_dir(root, step).name}"
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    layout = _layout()
    state = _sharded_state(module, optimizer, loading=False)
    state.update(rng=_rng_state(layout), scheduler=scheduler.state_dict(), step=step,
                 consumed_samples=meta["consumed_samples"], layout=layout)
    dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    if _is_rank0():
        (tmp / "meta.json").write_text(json.dumps({"step": step, "layout": layout, **meta},
                                                  indent=1))
        _write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        marker = root / "latest.tmp"
        marker.write_text(final.name)
        os.replace(marker, root / "latest")
        for old in sorted(root.glob("step_*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def find_latest(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under `root` (rank 0 checks, every rank gets the answer);
    incomplete or corrupt ones are reported and skipped."""
    choice = [None]
    if _is_rank0():
        for folder in sorted(root.glob("step_*"), reverse=True):
            problem = verify(folder)
            if problem is None:
                choice[0] = str(folder)
                break
            log.warning("skipping checkpoint %s: %s", folder, problem)
            print(f"megaloop: skipping checkpoint {folder}: {problem}", flush=True)
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def load(folder: Path, module, optimizer, scheduler) -> dict:
    """Load a checkpoint (saved in any layout) into this rank's model and optimizer; returns
    {"step", "consumed_samples"}. RNG states come back only when the layout is unchanged."""
    layout = _layout()
    saved_layout = json.loads((folder / "meta.json").read_text())["layout"]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not opt.optimizer.state:
            # torch's AdamW has no state (no "step") before its first step; the dummy step is
            # overwritten by what is loaded (megatron-core does the same for FSDP checkpoints)
            opt._init_optimizer_states_with_dummy_values()
    state = _sharded_state(module, optimizer, loading=True)
    state.update(scheduler=None, step=None, consumed_samples=None)
    if saved_layout == layout:
        state["rng"] = _rng_state(layout)
    loaded = dist_checkpointing.load(state, str(folder))
    module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in opt.optimizer.state.values():
            if "step" in param_state:
                # megatron-core hands every parameter the same "step" tensor, which torch's
                # AdamW then increments once per parameter on every step: give each its own
                param_state["step"] = param_state["step"].clone()
    scheduler.load_state_dict(loaded["scheduler"])
    if "rng" in loaded:
        rng = loaded["rng"]
        torch.set_rng_state(rng["cpu"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return {"step": loaded["step"], "consumed_samples": loaded["consumed_samples"]}


def resolve(path: Path) -> Path:
    """A checkpoint folder, or the newest complete one of a run directory."""
    if (path / "meta.json").is_file():
        problem = verify(path)
        if problem:
            raise ValueError(f"checkpoint {path} is not usable: {problem}")
        return path
    folder = find_latest(path / "checkpoints") if (path / "checkpoints").is_dir() else None
    if folder is None:
        raise ValueError(f"{path} is neither a checkpoint folder (with meta.json) nor a run "
                         f"directory with a complete checkpoint under checkpoints/")
    return folder


def read_meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def load_model(folder: Path, module) -> None:
    """Only the model weights (for consolidation and evaluation), into any layout."""
    loaded = dist_checkpointing.load({"model": module.sharded_state_dict()}, str(folder))
    module.load_state_dict(loaded["model"])


def consolidate(path: Path, out: Path) -> Path:
    """One safetensors file of the whole model (plus its config) from a checkpoint saved in
    any layout; runs in one process."""
    from safetensors.torch import save_file

    from megaloop.experiment import ExperimentConfig
    from megaloop.model.looped import LoopedLM
    from megaloop.model.specs import transformer_config

    folder = resolve(path)
    cfg = ExperimentConfig.from_dict(read_meta(folder)["config"])
    model = LoopedLM(cfg.model, transformer_config(cfg.model))
    load_model(folder, model)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()
               if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    save_file(tensors, out / "model.safetensors",
              metadata={"source": str(folder), "step": str(read_meta(folder)["step"])})
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    return out / "model.safetensors"
