"""Opening a `megaloop export` folder for evaluation: checked once, placed on a device.

An export ships Python code (transformers remote code), and a folder can pose as an export. So
megaloop opens only a folder whose code files are the ones recorded at export and the same as
this megaloop's own (megaloop.export.code_problem), and even then runs none of the folder's
code: the model is built from megaloop's own classes (megaloop.model.modeling_megaloop), the
weights come from safetensors only, the tokenizer from its JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megaloop.evaluation.settings import EvalError


def placement(device: str | None, dtype: str = "auto") -> tuple[str, str]:
    """The device (a GPU when there is one) and dtype (bf16 on a GPU, fp32 on a CPU)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def check_export(path: Path) -> dict:
    """config.json of `path`; EvalError unless it is a finished export carrying exactly this
    megaloop's code."""
    from megaloop.export import code_problem

    if not (path / "config.json").is_file():
        raise EvalError(f"{path}: no config.json; give a folder from `megaloop export`")
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise EvalError(f"{path}/config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("model_type") != "megaloop":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise EvalError(
            f"{path}: model_type {kind!r} is not megaloop; give a folder from `megaloop export`"
        )
    problem = code_problem(path, config)
    if problem:
        raise EvalError(f"{path}: refused: {problem}; megaloop runs only its own code")
    return config


@dataclass(frozen=True)
class Export:
    """A `megaloop export` folder checked once (`open_export`): its config.json, and its model
    and tokenizer, built from megaloop's own code."""

    path: Path
    config: dict

    def model(self, device: str, dtype: str, **overrides):
        """The exported model in eval mode; `overrides` are its config fields (num_loops, ...)."""
        import torch

        from megaloop.model.modeling_megaloop import MegaloopForCausalLM

        return (
            MegaloopForCausalLM.from_pretrained(
                self.path, dtype=getattr(torch, dtype), use_safetensors=True, **overrides
            )
            .to(device)
            .eval()
        )

    def tokenizer(self):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(self.path)


def open_export(path: Path) -> Export:
    return Export(Path(path), check_export(Path(path)))
