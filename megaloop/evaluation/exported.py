"""Opening a `megaloop export` folder for evaluation: checked once, placed on a device."""

from __future__ import annotations

from pathlib import Path


class EvalError(ValueError):
    """Bad evaluation input (model folder, task names, local data)."""


def placement(device: str | None, dtype: str = "auto") -> tuple[str, str]:
    """The device (a GPU when there is one) and dtype (bf16 on a GPU, fp32 on a CPU)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not (path / "config.json").is_file():
        raise EvalError(f"{path}: no config.json; give a folder from `megaloop export`")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


def load_model(path: Path, device: str, dtype: str, **overrides):
    """The exported model in eval mode; `overrides` are its config fields (num_loops, ...)."""
    import torch
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise EvalError(f"{path}: no config.json; give a folder from `megaloop export`")
    return AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, dtype=getattr(torch, dtype), **overrides).to(device).eval()
