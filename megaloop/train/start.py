"""Where a run starts, and the checks that it may, before any compute: from the newest complete
checkpoint of its own run directory (a resume), else from train.init_from's weights, else fresh.

A resume continues the same experiment: every config key outside RESUMABLE (resumable.py) must
match the checkpoint's, and the engine must be able to read the checkpoint's layout. init_from
starts a new run from another run's weights: the model keys outside INIT_FREE must match. Both
stop with one error naming the keys and the fix (ConfigError), on every rank.
"""

from __future__ import annotations

from pathlib import Path

from megaloop.config import ConfigError, check
from megaloop.parallel.engines import ENGINES, names
from megaloop.parallel.layout import data_parallel_size
from megaloop.train import checkpoint
from megaloop.train.resumable import RESUMABLE, config_changes

INIT_FREE = (
    "max_seq_len",
    "attention",
    "init",
    "init_std",
    "embedding_init_std",
    "damping_init",
    "dropout",
)
"""Model keys a run started from train.init_from may set differently from the checkpoint's
(max_seq_len only with RoPE: learned positions are a table of that many rows)."""


def check_start(cfg, world_size: int) -> Path | None:
    """Before any compute: the run may start where it will (collective through the files every
    rank reads alike). Returns the checkpoint it resumes from (None: it starts fresh or from
    train.init_from), looked up once: `start` loads it."""
    folder = check_resume(cfg, world_size)
    check_init_from(cfg)
    return folder


def check_resume(cfg, world_size: int) -> Path | None:
    """The newest complete checkpoint of train.dir, if any (returned), was written by this same
    experiment in a layout this one can read."""
    folder = checkpoint.find_latest(Path(cfg.train.dir) / "checkpoints")
    if folder is None:
        return None
    meta = checkpoint.read_meta(folder)
    changes = config_changes(meta["config"], cfg.to_dict())
    if changes:
        raise ConfigError(
            f"train.dir={cfg.train.dir} holds a run with another config (checkpoint "
            f"{folder.name}); it would resume with {len(changes)} changed key(s): "
            f"{'; '.join(changes)}. Resume it with its own values, or give another train.dir "
            f"(keys that may change on resume: {', '.join(RESUMABLE)})"
        )
    dp = data_parallel_size(cfg, world_size)
    ENGINES[meta["engine"]].check_reshard(cfg, meta["layout"], dp, folder)
    return folder


def check_init_from(cfg) -> None:
    """train.init_from, if given, is a complete checkpoint of this same model."""
    if cfg.train.init_from is None:
        return
    try:
        folder = checkpoint.resolve(Path(cfg.train.init_from))
    except ValueError as e:
        raise ConfigError(f"config key 'train.init_from': {e}") from None
    meta = checkpoint.read_meta(folder)
    check(
        ENGINES[meta["engine"]].init_from,
        "train.init_from",
        str(folder),
        f"is a checkpoint of engine={meta['engine']}; train.init_from reads megatron-core dist "
        f"checkpoints ({names(lambda e: e.init_from)} runs, `megaloop import ouro` folders)",
    )
    saved = meta["config"]["model"]
    free = [k for k in INIT_FREE if k != "max_seq_len" or cfg.model.position_embedding == "rope"]
    changes = [
        c
        for c in config_changes({"model": saved}, {"model": cfg.model.to_dict()})
        if c.split(":")[0].removeprefix("model.") not in free
    ]
    if changes:
        raise ConfigError(
            f"config key 'train.init_from': {folder} holds another model: {'; '.join(changes)}. "
            f"Give the model keys of that checkpoint (only {', '.join(free)} may differ)"
        )


def start(folder: Path | None, init_from: str | None, engine) -> tuple[Path | None, dict | None]:
    """Load where the run starts into `engine`: the checkpoint `check_start` found (returned
    with its position: step, consumed samples), else init_from's weights (position None), else
    nothing."""
    if folder is not None:
        return folder, checkpoint.load(folder, engine)
    if init_from:
        engine.load_weights(checkpoint.resolve(Path(init_from)))
    return None, None
