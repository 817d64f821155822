"""The engines a run can train with, described without importing them: what each supports (its
rules for configs, checkpoints and `megaloop plan`) and its memory model.

Torch-free, so that `megaloop params`, `plan` and `slurm submit` check a config's engine and
plan its layouts without megatron-core or DeepSpeed; the engine itself (megatron.py,
deepspeed.py, behind parallel/engine.py's Protocol) is imported only by `build` and
`consolidated_state`. Adding an engine: a description here, its class, and its name in
EngineName.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from megaloop.config import Config, ConfigError, check
from megaloop.extras import require

EngineName = Literal["megatron", "deepspeed"]


@dataclass
class DeepSpeedConfig(Config):
    zero_stage: int = 1
    """0 = plain data parallel, 1 = optimizer state, 2 = + gradients, 3 = + parameters sharded."""
    param_persistence_threshold: int = 100_000
    """ZeRO-3 keeps parameters with fewer elements than this whole on every rank."""

    def validate(self, prefix: str = "") -> None:
        check(
            self.zero_stage in (0, 1, 2, 3),
            prefix + "zero_stage",
            self.zero_stage,
            "allowed: 0, 1, 2, 3",
        )
        check(
            self.param_persistence_threshold >= 0,
            prefix + "param_persistence_threshold",
            self.param_persistence_threshold,
            "must be >= 0",
        )


class EngineSpec:
    """One engine's capabilities. Subclasses set the class attributes and the memory model."""

    name: ClassVar[str]
    implementation: ClassVar[str]
    """module:Class of the engine (imported on `build`)."""
    extra: ClassVar[str | None] = None
    """The pyproject extra that installs what the engine imports, if any."""
    supports_pipeline: ClassVar[bool]
    """Runs parallel.pp > 1 (the circular pipeline)."""
    no_pipeline_why: ClassVar[str] = ""
    reshards: ClassVar[bool]
    """Loads a checkpoint saved under another layout (TP, PP, DP)."""
    nonfinite: ClassVar[tuple[str, ...]]
    """The train.nonfinite policies it implements."""
    nonfinite_why: ClassVar[str] = ""
    init_from: ClassVar[bool]
    """Starts from train.init_from, and its checkpoints can be one."""
    bf16_autocast: ClassVar[bool]
    """train.bf16 is autocast over fp32 weights (so the residual stream can stay fp32:
    model.fp32_residual), not bf16 weights."""

    def variants(self) -> tuple[int | None, ...]:
        """The engine's own settings `megaloop plan --search` tries (None: it has none)."""
        return (None,)

    def variant(self, cfg) -> int | None:
        return None

    def with_variant(self, cfg, variant: int | None) -> None:
        """Set `variant` in `cfg` (a copy the planner owns)."""

    def label(self, variant: int | None, short: bool = False) -> str:
        """How a plan names the engine and its variant (`short`: in a table's engine column)."""
        return self.name

    def regathers_weights(self, variant: int | None) -> bool:
        """Whether the weights are all-gathered again at every loop (a cost the planner's
        compute-only time does not see: it prefers other layouts among equal times)."""
        return False

    def state_bytes(self, cfg, params: int, dp: int) -> dict:
        """Bytes of weights, gradients and optimizer state on a rank holding `params`."""
        raise NotImplementedError

    def check_reshard(self, cfg, saved: dict, dp: int, folder: Path) -> None:
        """Before any compute: refuse to resume a checkpoint of layout `saved` (written by this
        engine) in this launch's layout when the engine does not reshard it."""

    def build(self, cfg, seq_len: int, micro_batch_size: int):
        """The engine of this rank (collective: process groups must exist)."""
        return self._module_attr(self.implementation)(cfg, seq_len, micro_batch_size)

    def check_installed(self) -> None:
        if self.extra:
            require(self.extra, f"engine={self.name}")

    def consolidated_state(self, folder: Path, cfg, layout: dict) -> dict:
        """The whole model's tensors (one-process names) of a checkpoint this engine wrote."""
        module = self.implementation.split(":")[0]
        return self._module_attr(f"{module}:consolidated_state")(folder, cfg, layout)

    @staticmethod
    def _module_attr(path: str):
        module, attr = path.split(":")
        return getattr(importlib.import_module(module), attr)


class MegatronSpec(EngineSpec):
    """megatron-core DDP with the distributed optimizer, any TP x PP x DP; dist checkpoints
    that load in any layout."""

    name = "megatron"
    implementation = "megaloop.parallel.megatron:MegatronEngine"
    supports_pipeline = True
    reshards = True
    nonfinite = ("stop", "skip")
    init_from = True
    bf16_autocast = True

    def state_bytes(self, cfg, params: int, dp: int) -> dict:
        """fp32 weights and gradient buffer (bf16 is autocast), Adam's two fp32 moments sharded
        over DP by the distributed optimizer (up to megatron-core's alignment padding of each
        parameter to 64 values)."""
        return {
            "params": params,
            "weights": 4 * params,
            "grads": 4 * params,
            "optimizer": 8 * params / dp,
        }


class DeepSpeedSpec(EngineSpec):
    """DeepSpeed ZeRO stage 0-3 over DP with megatron-core TP, no pipeline."""

    name = "deepspeed"
    implementation = "megaloop.parallel.deepspeed:DeepSpeedEngine"
    extra = "deepspeed"
    supports_pipeline = False
    no_pipeline_why = (
        "engine=deepspeed runs ZeRO stage 0-3 over DP with megatron-core TP and no "
        "pipeline (DeepSpeed refuses ZeRO-2/3 with pipelines)"
    )
    reshards = False
    nonfinite = ("stop",)
    nonfinite_why = "skipping a DeepSpeed update would desynchronise its gradient accumulation"
    init_from = False
    bf16_autocast = False

    def variants(self) -> tuple[int, ...]:
        return (0, 1, 2, 3)

    def variant(self, cfg) -> int:
        return cfg.deepspeed.zero_stage

    def with_variant(self, cfg, variant: int | None) -> None:
        if variant is not None:
            cfg.deepspeed.zero_stage = variant

    def label(self, variant: int | None, short: bool = False) -> str:
        return f"ZeRO-{variant}" if short else f"deepspeed ZeRO-{variant}"

    def regathers_weights(self, variant: int | None) -> bool:
        return variant == 3

    def state_bytes(self, cfg, params: int, dp: int) -> dict:
        """fp32: ZeRO-0 keeps everything whole; ZeRO-1/2 add an fp32 master partition beside
        the moments (12 bytes/DP a parameter), ZeRO-2 partitions gradients, ZeRO-3 also the
        weights. With bf16 the weights and gradients are bf16."""
        stage, width, n = cfg.deepspeed.zero_stage, 2 if cfg.train.bf16 else 4, params
        return {
            "params": n,
            "weights": width * (n / dp if stage == 3 else n),
            "grads": width * (n / dp if stage >= 2 else n),
            "optimizer": 8 * n if stage == 0 and not cfg.train.bf16 else 12 * n / dp,
        }

    def check_reshard(self, cfg, saved: dict, dp: int, folder: Path) -> None:
        """DeepSpeed's checkpoints do not reshard: its optimizer state is partitioned over the DP
        ranks (it refuses another DP size mid-load) and ZeRO-3's files differ from ZeRO-1/2's."""
        now = {"tp": cfg.parallel.tp, "dp": dp, "zero_stage": cfg.deepspeed.zero_stage}
        was = {key: saved.get(key) for key in now}
        if (
            now["tp"] != was["tp"]
            or now["dp"] != was["dp"]
            or ((now["zero_stage"] == 3) != (was["zero_stage"] == 3))
        ):
            raise ConfigError(
                f"{folder} is a DeepSpeed checkpoint of TP={was['tp']} DP={was['dp']} "
                f"ZeRO-{was['zero_stage']}; this launch is TP={now['tp']} DP={now['dp']} "
                f"ZeRO-{now['zero_stage']}. DeepSpeed resumes only in its own TP and DP (ZeRO-1 "
                f"and 2 are interchangeable, 3 is not): relaunch with {was['dp'] * was['tp']} "
                f"ranks, parallel.tp={was['tp']} and a ZeRO stage of its kind; "
                f"{names(lambda e: e.reshards)} checkpoints are the ones that reshard"
            )


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (MegatronSpec(), DeepSpeedSpec())}
"""Every engine by its config name (`engine:`), in the planner's order of preference."""


def names(where: Callable[[EngineSpec], bool]) -> str:
    """`engine=A or engine=B`: the engines `where` holds for, as a message names them."""
    return " or ".join(f"engine={spec.name}" for spec in ENGINES.values() if where(spec))
