"""Checkpoints in the run directory: `checkpoints/step_NNNNNNN/` written to a temporary folder
and renamed into place, a `latest` marker, and only the last N kept.

Weights are one safetensors file of the full model (no pickled code); `meta.json` records the
step, the data position and the resolved config.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def model_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()
            if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def save(root: Path, step: int, module: torch.nn.Module, meta: dict, keep_last: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(model_tensors(module), tmp / "model.safetensors")
    (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    marker = root / "latest.tmp"
    marker.write_text(final.name)
    os.replace(marker, root / "latest")
    for old in sorted(root.glob("step_*"))[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_weights(path: Path, module: torch.nn.Module) -> dict:
    """Load `model.safetensors` from a checkpoint folder into `module`; returns its meta."""
    state = load_file(path / "model.safetensors")
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if "_extra_state" not in k]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit this model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; was it saved from another model config?")
    return json.loads((path / "meta.json").read_text())
