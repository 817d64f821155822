from megaloop.model.looped import LoopedLM, LoopOutput, ModelConfig, build_model

__all__ = ["LoopedLM", "LoopOutput", "ModelConfig", "build_model"]
