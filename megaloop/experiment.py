"""The root config of a run: one section per component, checked together before any compute.

model:     ModelConfig       (megaloop/model/config.py)
objective: ObjectiveConfig   (megaloop/objectives/__init__.py)
data:      DataConfig        (megaloop/data/__init__.py)
optim:     OptimConfig       (megaloop/train/optim.py)
train:     TrainConfig       (megaloop/train/config.py)
parallel:  ParallelConfig    (megaloop/parallel/layout.py)
engine:    EngineName        (megaloop/parallel/engines.py: what each engine supports)
deepspeed: DeepSpeedConfig   (megaloop/parallel/engines.py)
wandb:     WandbConfig       (megaloop/train/metrics.py)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megaloop import config as config_lib
from megaloop.config import CONFIG_ROOT, Config, check
from megaloop.data import DataConfig, SyntheticConfig
from megaloop.model import ModelConfig
from megaloop.objectives import ObjectiveConfig
from megaloop.parallel.engines import ENGINES, DeepSpeedConfig, EngineName, EngineSpec, names
from megaloop.parallel.layout import ParallelConfig, data_parallel_size
from megaloop.train.config import TrainConfig
from megaloop.train.metrics import WandbConfig
from megaloop.train.optim import OptimConfig


@dataclass
class ExperimentConfig(Config):
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=SyntheticConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: EngineName = "megatron"
    """megatron: megatron-core DDP/distributed optimizer, any TP x PP x DP; deepspeed: ZeRO
    stage 0-3 over DP with megatron-core TP, no PP."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    @property
    def engine_spec(self) -> EngineSpec:
        """What the config's engine supports (megaloop/parallel/engines.py)."""
        return ENGINES[self.engine]

    def validate(self, prefix: str = "") -> None:
        spec = self.engine_spec
        check(
            spec.supports_pipeline or self.parallel.pp == 1,
            "parallel.pp",
            self.parallel.pp,
            f"{spec.no_pipeline_why}. Supported: {names(lambda e: e.supports_pipeline)} "
            f"with any parallel.tp x parallel.pp x DP, or engine={spec.name} with parallel.pp=1",
        )
        check(
            not self.objective.gated or self.model.exit_gate,
            "model.exit_gate",
            self.model.exit_gate,
            f"objective.kind={self.objective.kind} needs the exit gate: set model.exit_gate=true",
        )
        part, kind = self.objective.spec.trains, self.objective.kind
        check(
            part is None or self.parallel.pp == 1,
            "parallel.pp",
            self.parallel.pp,
            f"objective.kind={kind} trains {part}* alone, which one pipeline stage holds: set "
            "parallel.pp=1 (a second stage is a small run)",
        )
        check(
            part is None or self.train.init_from is not None,
            "train.init_from",
            self.train.init_from,
            f"objective.kind={kind} trains {part}* of a trained model (a second stage): set "
            "train.init_from to the first stage's checkpoint",
        )
        self.check_sampled_exits()
        check(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            self.data.seq_len,
            f"must be <= model.max_seq_len={self.model.max_seq_len}",
        )
        check(
            self.model.dropout == 0 or self.train.recompute in ("none", "selective"),
            "train.recompute",
            self.train.recompute,
            f"with model.dropout={self.model.dropout}: torch's recompute of a layer or a loop "
            f"restores the default RNG but not megatron-core's tracker, so attention dropout "
            f"would draw other masks in backward; use train.recompute=selective or none",
        )
        policy = self.train.nonfinite
        check(
            policy in spec.nonfinite,
            "train.nonfinite",
            policy,
            f"{policy} needs {names(lambda e: policy in e.nonfinite)} ({spec.nonfinite_why}); "
            f"use train.nonfinite={spec.nonfinite[0]}",
        )
        check(
            not (self.model.fp32_residual and self.train.bf16) or spec.bf16_autocast,
            "model.fp32_residual",
            self.model.fp32_residual,
            f"engine={spec.name} trains bf16 with bf16 weights, so its residual stream is bf16; "
            f"keep it fp32 with {names(lambda e: e.bf16_autocast)} (bf16 autocast over fp32 "
            f"weights), or set model.fp32_residual=false",
        )
        check(
            self.train.init_from is None or spec.init_from,
            "train.init_from",
            self.train.init_from,
            f"is read by {names(lambda e: e.init_from)} only (megatron-core dist checkpoints, "
            f"any layout); start from it with {names(lambda e: e.init_from)}",
        )
        check(
            self.train.eval_batches != "all" or self.data.kind != "synthetic",
            "train.eval_batches",
            "all",
            "data.kind=synthetic has no finite validation split; "
            "give a number of micro-batches, e.g. train.eval_batches=16",
        )
        # The layout against the model and the batch: every world is TP x PP x DP, and what
        # DP=1 rules out no DP allows, so a contradiction fails here, naming the key, not when
        # the ranks have started (the world's own checks stay in build_trainer).
        data_parallel_size(self, self.parallel.tp * self.parallel.pp)

    def check_sampled_exits(self) -> None:
        """Exit-aware training (objective.exit_kv) where its keys can be held from loop to loop."""
        exits = self.objective.exit_kv != "none"
        check(
            not exits or (self.parallel.pp == 1 and self.train.recompute == "none"),
            "objective.exit_kv",
            self.objective.exit_kv,
            "exits sampled in the training forward hold each layer's keys and values from loop "
            "to loop, in one process's layers and once per forward: set parallel.pp=1 and "
            "train.recompute=none (a recomputed layer would read them again)",
        )
        check(
            not exits or self.model.num_loops > 1,
            "objective.exit_kv",
            self.objective.exit_kv,
            "a model of one loop has no early exit: set model.num_loops >= 2 or exit_kv=none",
        )


def load(path, overrides=()) -> ExperimentConfig:
    """The resolved config of `path` with `overrides`; a run directory (default_run_dir) and a
    wandb name (the config's path and the seed) are filled in if none is given."""
    cfg = config_lib.load(ExperimentConfig, path, list(overrides))
    default = default_run_dir(path, cfg.train.seed)
    if cfg.train.dir is None:
        cfg.train.dir = str(default)
    if cfg.wandb.name is None:
        cfg.wandb.name = f"{default.parent.relative_to('runs')} seed{cfg.train.seed}"
    return cfg


def default_run_dir(path, seed: int) -> Path:
    """runs/<the config's path under configs/experiments (or configs), without .yaml>/seed<N>:
    configs/experiments/wikitext103/44m/per_loop_norm.yaml, seed 1 ->
    runs/wikitext103/44m/per_loop_norm/seed1."""
    if path is None:
        return Path("runs", "default", f"seed{seed}")
    resolved = config_lib.find_config(path)
    for root in (CONFIG_ROOT / "experiments", CONFIG_ROOT):
        if resolved.is_relative_to(root):
            return Path("runs", resolved.relative_to(root).with_suffix(""), f"seed{seed}")
    return Path("runs", resolved.stem, f"seed{seed}")


def resolve_steps(cfg: ExperimentConfig) -> str | None:
    """Fill in train.steps from data.epochs when it is not given; an explicit train.steps wins.
    Returns a note for the log when both were given."""
    if cfg.data.epochs is None:
        check(
            cfg.train.steps is not None,
            "train.steps",
            None,
            "set the number of optimizer steps (or data.epochs, for indexed data)",
        )
        return None
    epoch_steps = cfg.data.steps_for_epochs(cfg.train.global_batch_size)
    if cfg.train.steps is None:
        cfg.train.steps = epoch_steps
        return None
    return (
        f"train.steps={cfg.train.steps} is given, so it is used: data.epochs="
        f"{cfg.data.epochs} ({epoch_steps} steps) is ignored"
    )


def build_trainer(cfg: ExperimentConfig, log: bool = True, dry_run: bool = False):
    """The chain: process groups → data → engine (model + parallelism) → trainer. Building
    writes nothing to train.dir but its lock (`fit` writes the rest); `dry_run` leaves even the
    lock alone, only checking that no live run holds it."""
    from megaloop.parallel import distributed, layout
    from megaloop.train import callbacks, run_lock, start
    from megaloop.train.trainer import Trainer, default_callbacks

    cfg.engine_spec.check_installed()
    cfg.data.check_files()
    note = resolve_steps(cfg)
    dp = layout.data_parallel_size(cfg, distributed.world_size())
    distributed.init(
        cfg.train.seed,
        tp=cfg.parallel.tp,
        pp=cfg.parallel.pp,
        virtual_pp=cfg.model.num_loops if cfg.parallel.pp > 1 else None,
        timeout_s=cfg.parallel.timeout_s,
    )
    if note and log and distributed.is_main():
        print(f"megaloop: {note}", flush=True)
    run_lock.hold(Path(cfg.train.dir), probe_only=dry_run)
    resume_from = start.check_start(cfg, distributed.world_size())
    t = cfg.train
    dataset = cfg.data.build(t.seed, train_samples=t.steps * t.global_batch_size)
    cfg.data.check_vocab(cfg.model.vocab_size, dataset.tokenizer.vocab_size)
    layout.eval_microbatches(t, dataset.valid_windows, dp, cfg.parallel.pp)  # before the model
    engine = cfg.engine_spec.build(cfg, cfg.data.seq_len, cfg.train.micro_batch_size)
    hooks = [*default_callbacks(cfg), *callbacks.registered()]
    return Trainer(
        cfg, engine, dataset, hooks, log=log and distributed.is_main(), resume_from=resume_from
    )


# -- checkpoints read back as experiments ---------------------------------------------------


def config_of(folder: Path) -> ExperimentConfig:
    """The config a checkpoint folder was written with."""
    from megaloop.train import checkpoint

    saved = checkpoint.read_meta(folder)["config"]
    return ExperimentConfig.from_dict({**saved, "data": DataConfig.own_keys_only(saved["data"])})


def consolidated(path: Path) -> tuple[dict, ExperimentConfig, Path]:
    """The whole model's tensors (one-process names), the run's config and the checkpoint
    folder, from a checkpoint of any engine and layout; runs in one process."""
    from megaloop.train import checkpoint

    folder = checkpoint.resolve(path)
    meta = checkpoint.read_meta(folder)
    cfg = config_of(folder)
    state = ENGINES[meta["engine"]].consolidated_state(folder, cfg, meta["layout"])
    return state, cfg, folder


def consolidate(path: Path, out: Path) -> Path:
    """One safetensors file of the whole model, plus its config."""
    from safetensors.torch import save_file

    from megaloop.train import checkpoint

    tensors, cfg, folder = consolidated(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        tensors,
        out / "model.safetensors",
        metadata={"source": str(folder), "step": str(checkpoint.read_meta(folder)["step"])},
    )
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    return out / "model.safetensors"
