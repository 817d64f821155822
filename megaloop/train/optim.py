"""AdamW with warmup, then a cosine decay or a constant learning rate, and gradient clipping,
through megatron-core's optimizer (so the same code path serves DDP and the distributed
optimizer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megaloop.config import Config, check

EMBEDDING_WEIGHTS = ("embedding.word_embeddings.weight", "readout.output_layer.weight")
"""The token embedding and W_out, as the model names them."""


@dataclass
class OptimConfig(Config):
    lr: float = 3e-4
    """The peak learning rate, reached after the warmup."""
    min_lr: float = 3e-5
    """The floor of the cosine decay."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After the warmup: `cosine` from lr to min_lr over the run, or `constant` at lr (the
    study's released code: no warmup, no decay)."""
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled (AdamW), on the parameters `decay` names."""
    decay: Literal["matrices", "all"] = "matrices"
    """Which parameters weight decay reaches: `matrices` (2-D weights; norms, biases and the
    damping factors never) or `all` (every parameter, as AdamW over model.parameters() does in
    the study's released code)."""
    decay_embeddings: bool = True
    """With decay=matrices, whether weight decay also reaches the token embedding and W_out
    (tied or not). Decay shrinks W_out, which a raw readout must then make up with a larger
    hidden state: one of the settings docs/drift_regime/ maps."""
    beta1: float = 0.9
    """Adam's β1."""
    beta2: float = 0.95
    """Adam's β2."""
    eps: float = 1e-8
    """Adam's ε."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""

    def validate(self, prefix: str = "") -> None:
        check(self.lr > 0, prefix + "lr", self.lr, "must be > 0")
        check(
            0 <= self.min_lr <= self.lr,
            prefix + "min_lr",
            self.min_lr,
            f"must lie in [0, lr={self.lr}]",
        )
        check(self.warmup_steps >= 0, prefix + "warmup_steps", self.warmup_steps, "must be >= 0")
        check(self.weight_decay >= 0, prefix + "weight_decay", self.weight_decay, "must be >= 0")
        check(
            self.decay == "matrices" or self.decay_embeddings,
            prefix + "decay_embeddings",
            self.decay_embeddings,
            "exempts the embedding from optim.decay=matrices; with optim.decay=all every "
            "parameter is decayed: set one or the other",
        )
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            check(0 <= value < 1, prefix + name, value, "must lie in [0, 1)")
        check(self.eps > 0, prefix + "eps", self.eps, "must be > 0")
        check(self.clip_grad >= 0, prefix + "clip_grad", self.clip_grad, "must be >= 0")

    def decays(self, name: str, param) -> bool:
        """Whether weight decay reaches the parameter `name` (any wrapper prefix)."""
        if self.decay == "all":
            return True
        if param.ndim <= 1:
            return False
        return self.decay_embeddings or not name.endswith(EMBEDDING_WEIGHTS)

    def build(self, model_chunks: list, steps: int):
        """(optimizer, scheduler) for `steps` optimizer steps. Always megatron-core's
        DistributedOptimizer (state sharded over data-parallel ranks; with one rank it is the
        plain optimizer), so every layout writes the same reshardable checkpoint format."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate
        from megatron.core.optimizer_param_scheduler import (
            OptimizerParamScheduler,
            ParamGroupOverride,
        )

        not_decayed = ParamWithNamePredicate(
            name="megaloop_no_decay", fn=lambda param, name: not self.decays(name, param)
        )

        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=self.lr,
                min_lr=self.min_lr,
                weight_decay=self.weight_decay,
                adam_beta1=self.beta1,
                adam_beta2=self.beta2,
                adam_eps=self.eps,
                clip_grad=self.clip_grad,
                use_distributed_optimizer=True,
            ),
            model_chunks,
            config_overrides={
                ParamKey(with_name_predicate=not_decayed): ParamGroupOverride(wd_mult=0.0)
            },
        )
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=self.lr,
            min_lr=self.min_lr,
            lr_warmup_steps=self.warmup_steps,
            lr_decay_steps=max(steps, self.warmup_steps + 1),
            lr_decay_style=self.schedule,
            start_wd=self.weight_decay,
            end_wd=self.weight_decay,
            wd_incr_steps=max(steps, 1),
            wd_incr_style="constant",
        )
        return optimizer, scheduler
