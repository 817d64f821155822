"""The root config of a run: one section per component, checked together before any compute.

    model:     ModelConfig       (megaloop/model/looped.py)
    objective: ObjectiveConfig   (megaloop/objectives.py)
    data:      DataConfig        (megaloop/data/__init__.py)
    optim:     OptimConfig       (megaloop/train/optim.py)
    train:     TrainConfig       (megaloop/train/trainer.py)
    parallel:  ParallelConfig    (megaloop/parallel/layout.py)
    engine:    megatron | deepspeed, with deepspeed: DeepSpeedConfig (megaloop/parallel/deepspeed.py)
    wandb:     WandbConfig       (megaloop/train/metrics.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megaloop import config as config_lib
from megaloop.config import Config, check
from megaloop.data import DataConfig
from megaloop.model import ModelConfig
from megaloop.objectives import ObjectiveConfig
from megaloop.parallel.deepspeed import DeepSpeedConfig
from megaloop.parallel.layout import ParallelConfig
from megaloop.train.metrics import WandbConfig
from megaloop.train.optim import OptimConfig
from megaloop.train.trainer import TrainConfig


@dataclass
class ExperimentConfig(Config):
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: Literal["megatron", "deepspeed"] = "megatron"
    """megatron: megatron-core DDP/distributed optimizer, any TP x PP x DP; deepspeed: ZeRO
    stage 0-3 over DP with megatron-core TP, no PP."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    def validate(self, prefix: str = "") -> None:
        check(self.engine == "megatron" or self.parallel.pp == 1, "parallel.pp", self.parallel.pp,
              "engine=deepspeed runs ZeRO stage 0-3 over DP with megatron-core TP and no "
              "pipeline (DeepSpeed refuses ZeRO-2/3 with pipelines). Supported: engine=megatron "
              "with any parallel.tp x parallel.pp x DP, or engine=deepspeed with parallel.pp=1")
        check(self.objective.kind != "exit_weighted" or self.model.exit_gate,
              "model.exit_gate", self.model.exit_gate,
              "objective.kind=exit_weighted needs the exit gate: set model.exit_gate=true")
        check(self.data.seq_len <= self.model.max_seq_len, "data.seq_len", self.data.seq_len,
              f"must be <= model.max_seq_len={self.model.max_seq_len}")
        check(self.train.eval_batches != "all" or self.data.kind != "synthetic",
              "train.eval_batches", "all", "data.kind=synthetic has no finite validation split; "
              "give a number of micro-batches, e.g. train.eval_batches=16")


def load(path, overrides=()) -> ExperimentConfig:
    return config_lib.load(ExperimentConfig, path, list(overrides))


def build_trainer(cfg: ExperimentConfig, log: bool = True):
    """The chain: process groups → data → engine (model + parallelism) → trainer."""
    from megaloop.parallel import distributed, layout
    from megaloop.parallel.megatron import Engine
    from megaloop.train.trainer import Trainer

    cfg.data.check_files()
    if cfg.data.epochs:
        cfg.train.steps = cfg.data.steps_for_epochs(cfg.train.global_batch_size)
    dp = layout.data_parallel_size(cfg, distributed.world_size())
    distributed.init(cfg.train.seed, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                     virtual_pp=cfg.model.num_loops if cfg.parallel.pp > 1 else None)
    t = cfg.train
    dataset = cfg.data.build(t.seed, train_samples=t.steps * t.global_batch_size)
    vocab = dataset.tokenizer.vocab_size
    check(cfg.model.vocab_size >= vocab, "model.vocab_size", cfg.model.vocab_size,
          f"must be >= the tokenizer's {vocab} tokens (of data.kind={cfg.data.kind})")
    layout.eval_microbatches(t, dataset.valid_windows, dp, cfg.parallel.pp)  # before the model
    engine_class = Engine
    if cfg.engine == "deepspeed":
        from megaloop.parallel.deepspeed import DeepSpeedEngine as engine_class
    engine = engine_class(cfg, cfg.data.seq_len, cfg.train.micro_batch_size)
    return Trainer(cfg, engine, dataset, log=log and distributed.is_main())
