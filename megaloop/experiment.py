"""The root config of a run: one section per component, checked together before any compute.

model:     ModelConfig       (megaloop/model/config.py)
objective: ObjectiveConfig   (megaloop/objectives/__init__.py)
data:      DataConfig        (megaloop/data/__init__.py)
optim:     OptimConfig       (megaloop/train/optim.py)
train:     TrainConfig       (megaloop/train/config.py)
parallel:  ParallelConfig    (megaloop/parallel/layout.py)
engine:    megatron | deepspeed, with deepspeed: DeepSpeedConfig (megaloop/parallel/layout.py)
wandb:     WandbConfig       (megaloop/train/metrics.py)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megaloop import config as config_lib
from megaloop.config import CONFIG_ROOT, Config, ConfigError, check, flatten
from megaloop.data import DataConfig
from megaloop.extras import require
from megaloop.model import ModelConfig
from megaloop.objectives import ObjectiveConfig
from megaloop.parallel.layout import DeepSpeedConfig, ParallelConfig, data_parallel_size
from megaloop.train.config import TrainConfig
from megaloop.train.metrics import WandbConfig
from megaloop.train.optim import OptimConfig


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
        check(
            self.engine == "megatron" or self.parallel.pp == 1,
            "parallel.pp",
            self.parallel.pp,
            "engine=deepspeed runs ZeRO stage 0-3 over DP with megatron-core TP and no "
            "pipeline (DeepSpeed refuses ZeRO-2/3 with pipelines). Supported: engine=megatron "
            "with any parallel.tp x parallel.pp x DP, or engine=deepspeed with parallel.pp=1",
        )
        check(
            not self.objective.gated or self.model.exit_gate,
            "model.exit_gate",
            self.model.exit_gate,
            f"objective.kind={self.objective.kind} needs the exit gate: set model.exit_gate=true",
        )
        check(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            self.data.seq_len,
            f"must be <= model.max_seq_len={self.model.max_seq_len}",
        )
        check(
            self.train.nonfinite == "stop" or self.engine == "megatron",
            "train.nonfinite",
            self.train.nonfinite,
            "skip needs engine=megatron (skipping a DeepSpeed update "
            "would desynchronise its gradient accumulation); use train.nonfinite=stop",
        )
        check(
            self.train.init_from is None or self.engine == "megatron",
            "train.init_from",
            self.train.init_from,
            "is read by engine=megatron only (megatron-core dist "
            "checkpoints, any layout); start from it with engine=megatron",
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


RESUMABLE = (
    "train.steps",
    "train.dir",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.save_every",
    "train.keep_last",
    "train.scale_alarm",
    "parallel",
    "deepspeed.zero_stage",
    "wandb",
)
"""Config keys (or sections) that may change when a run resumes: its length, cadence and
monitoring, and the layout (checkpoints reshard; `slurm submit` rewrites it). Any other
difference from the checkpoint's saved config stops the resume."""


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


def config_changes(saved: dict, requested: dict) -> list[str]:
    """`key: saved -> requested` for every key outside RESUMABLE whose value differs (keys a
    checkpoint of an older megaloop does not hold are not compared)."""
    old, new = flatten(saved), flatten(requested)
    changes = []
    for key in sorted(set(old) & set(new)):
        if any(key == r or key.startswith(r + ".") for r in RESUMABLE):
            continue
        if old[key] != new[key]:
            changes.append(f"{key}: {json.dumps(old[key])} -> {json.dumps(new[key])}")
    return changes


def check_resume(cfg: ExperimentConfig) -> None:
    """Before any compute: the newest complete checkpoint of train.dir, if any, was written by
    this same experiment (collective)."""
    from megaloop.train import checkpoint

    folder = checkpoint.find_latest(Path(cfg.train.dir) / "checkpoints")
    if folder is None:
        return
    meta = checkpoint.read_meta(folder)
    changes = config_changes(meta["config"], cfg.to_dict())
    if changes:
        raise ConfigError(
            f"train.dir={cfg.train.dir} holds a run with another config (checkpoint "
            f"{folder.name}); it would resume with {len(changes)} changed key(s): "
            f"{'; '.join(changes)}. Resume it with its own values, or give another train.dir "
            f"(keys that may change on resume: {', '.join(RESUMABLE)})"
        )
    if meta["engine"] == "deepspeed":
        check_deepspeed_layout(cfg, meta["layout"], folder)


def check_deepspeed_layout(cfg: ExperimentConfig, saved: dict, folder: Path) -> None:
    """DeepSpeed's checkpoints do not reshard: its optimizer state is partitioned over the DP
    ranks (it refuses another DP size mid-load) and ZeRO-3's files differ from ZeRO-1/2's. The
    megatron engine's checkpoints load in any layout."""
    from megaloop.parallel import distributed, layout

    dp = layout.data_parallel_size(cfg, distributed.world_size())
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
            f"ZeRO-{now['zero_stage']}. DeepSpeed resumes only in its own TP and DP (ZeRO-1 and "
            f"2 are interchangeable, 3 is not): relaunch with {was['dp'] * was['tp']} ranks, "
            f"parallel.tp={was['tp']} and a ZeRO stage of its kind; engine=megatron "
            f"checkpoints are the ones that reshard"
        )


INIT_FREE = ("max_seq_len", "attention", "init_std", "damping_init")
"""Model keys a run started from train.init_from may set differently from the checkpoint's."""


def check_init_from(cfg: ExperimentConfig) -> None:
    """Before any compute: train.init_from is a complete checkpoint of this same model."""
    from megaloop.train import checkpoint

    if cfg.train.init_from is None:
        return
    try:
        folder = checkpoint.resolve(Path(cfg.train.init_from))
    except ValueError as e:
        raise ConfigError(f"config key 'train.init_from': {e}") from None
    meta = checkpoint.read_meta(folder)
    check(
        meta["engine"] == "megatron",
        "train.init_from",
        str(folder),
        "is a DeepSpeed checkpoint; train.init_from reads megatron-core dist checkpoints "
        "(engine=megatron runs, `megaloop import ouro` folders)",
    )
    saved = meta["config"]["model"]
    changes = [
        c
        for c in config_changes({"model": saved}, {"model": cfg.model.to_dict()})
        if c.split(":")[0].removeprefix("model.") not in INIT_FREE
    ]
    if changes:
        raise ConfigError(
            f"config key 'train.init_from': {folder} holds another model: {'; '.join(changes)}. "
            f"Give the model keys of that checkpoint (only {', '.join(INIT_FREE)} may differ)"
        )


def hold_run_dir(cfg: ExperimentConfig) -> None:
    """Rank 0 takes the run directory's lock (megaloop/train/run_lock.py); every rank stops if
    it could not (collective), before anything is read or written there."""
    from megaloop.parallel import comm, distributed
    from megaloop.train import run_lock

    busy = None
    if distributed.is_main():
        try:
            run_lock.acquire(Path(cfg.train.dir))
        except run_lock.RunDirBusy as e:
            busy = e
    if comm.any_rank(busy is not None):
        raise busy or run_lock.RunDirBusy(
            f"train.dir={cfg.train.dir} is in use by another run (rank 0 names it)"
        )


def build_trainer(cfg: ExperimentConfig, log: bool = True):
    """The chain: process groups → data → engine (model + parallelism) → trainer."""
    from megaloop.parallel import distributed, layout
    from megaloop.parallel.megatron import MegatronEngine
    from megaloop.train import callbacks
    from megaloop.train.trainer import Trainer, default_callbacks

    if cfg.engine == "deepspeed":
        require("deepspeed", "engine=deepspeed")
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
    hold_run_dir(cfg)
    check_resume(cfg)
    check_init_from(cfg)
    t = cfg.train
    dataset = cfg.data.build(t.seed, train_samples=t.steps * t.global_batch_size)
    vocab = dataset.tokenizer.vocab_size
    check(
        cfg.model.vocab_size >= vocab,
        "model.vocab_size",
        cfg.model.vocab_size,
        f"must be >= the tokenizer's {vocab} tokens (of data.kind={cfg.data.kind})",
    )
    if cfg.data.kind == "indexed":  # an id past the embedding would fail mid-run, not here
        from megaloop.data.indexed import check_indexed

        for prefix in dict.fromkeys(p for p in (cfg.data.path, cfg.data.valid_path) if p):
            check_indexed(prefix, cfg.model.vocab_size)
    layout.eval_microbatches(t, dataset.valid_windows, dp, cfg.parallel.pp)  # before the model
    engine_class = MegatronEngine
    if cfg.engine == "deepspeed":
        from megaloop.parallel.deepspeed import DeepSpeedEngine as engine_class
    engine = engine_class(cfg, cfg.data.seq_len, cfg.train.micro_batch_size)
    hooks = [*default_callbacks(cfg), *callbacks.registered()]
    return Trainer(cfg, engine, dataset, hooks, log=log and distributed.is_main())


# -- checkpoints read back as experiments ---------------------------------------------------


def config_of(folder: Path) -> ExperimentConfig:
    """The config a checkpoint folder was written with."""
    from megaloop.train import checkpoint

    return ExperimentConfig.from_dict(checkpoint.read_meta(folder)["config"])


def consolidated(path: Path) -> tuple[dict, ExperimentConfig, Path]:
    """The whole model's tensors (one-process names), the run's config and the checkpoint
    folder, from a checkpoint of any engine and layout; runs in one process."""
    from megaloop.train import checkpoint

    folder = checkpoint.resolve(path)
    meta = checkpoint.read_meta(folder)
    cfg = config_of(folder)
    if meta["engine"] == "deepspeed":
        from megaloop.parallel.deepspeed import consolidated_state
    else:
        from megaloop.parallel.megatron import consolidated_state
    return consolidated_state(folder, cfg, meta["layout"]), cfg, folder


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
