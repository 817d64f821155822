"""The looped model. Its config imports without torch; the model itself on first use."""

from megaloop.model.config import ModelConfig

__all__ = ["LoopOutput", "LoopedLM", "ModelConfig", "build_model"]


def __getattr__(name: str):
    """`LoopedLM`, `LoopOutput` and `build_model` import megatron-core: only when asked for."""
    if name in ("LoopOutput", "LoopedLM", "build_model"):
        import importlib

        return getattr(importlib.import_module("megaloop.model.looped"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
