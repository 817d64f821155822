"""Both engines implement the one written contract (megaloop/parallel/engine.py): the same
methods with the same parameters, a StepResult from train_step, and memory reports with the
same keys (the multi-process tests check the DeepSpeed engine's reports, and hold both to
`megaloop plan`)."""

import inspect
import re
from typing import get_args, get_type_hints

import pytest

from megaloop import experiment
from megaloop.config import ConfigError
from megaloop.parallel.deepspeed import DeepSpeedEngine
from megaloop.parallel.engine import RANK_REPORT_KEYS, StepResult, TrainingEngine
from megaloop.parallel.engines import ENGINES, EngineName
from megaloop.parallel.megatron import MegatronEngine
from megaloop.train.config import TrainConfig
from multiproc import BASE
from support import ROOT, TINY

METHODS = sorted(
    name
    for name, value in vars(TrainingEngine).items()
    if callable(value) and not name.startswith("_")
)


def parameters(function) -> list:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("engine", [MegatronEngine, DeepSpeedEngine])
def test_every_engine_has_the_contracts_methods_and_parameters(engine):
    assert METHODS == sorted(
        [
            "layout",
            "train",
            "train_step",
            "step",
            "reduce",
            "memory_report",
            "run_files",
            "save_state",
            "load_state",
            "load_weights",
        ]
    )
    for name in METHODS:
        assert parameters(getattr(engine, name)) == parameters(getattr(TrainingEngine, name)), name
    assert isinstance(engine.name, str)


def test_a_megatron_engine_is_a_training_engine(tmp_path):
    cfg = experiment.load(TINY, [*BASE, f"train.dir={tmp_path}"])
    trainer = experiment.build_trainer(cfg, log=False)
    assert isinstance(trainer.engine, TrainingEngine)
    result = trainer.engine.train_step(trainer.batches.next_step())
    assert isinstance(result, StepResult) and result.applied
    report = trainer.engine.memory_report()
    assert {"tp", "pp", "dp", "ranks"} <= set(report)
    assert all(RANK_REPORT_KEYS <= set(r) for r in report["ranks"])
    assert report["ranks"][0]["optimizer_bytes"] > 0


# -- capabilities: each engine's rules live in its description (megaloop/parallel/engines.py) --

ENGINE_FILES = {"engines.py", "megatron.py", "deepspeed.py"}
NAME_RULE = re.compile(
    r"""\bengine\b["'\]]*(\s*(==|!=)|\s+in\s+[(\[{])"""  # cfg.engine == ..., meta["engine"] in (
    r"""|\bengine\b.*(==|!=)\s*["'](megatron|deepspeed)["']"""
)


def test_every_engine_is_described_and_its_class_carries_the_description():
    assert tuple(ENGINES) == get_args(EngineName)
    for engine in (MegatronEngine, DeepSpeedEngine):
        assert engine.spec is ENGINES[engine.name]
        assert engine.spec.implementation.endswith(f":{engine.__name__}")


def test_no_rule_on_an_engine_name_outside_the_engines():
    """Config checks, the planner and checkpoints ask the engine's description, not its name
    (the one comparison left, checkpoint.py's, checks that a checkpoint's writer is this engine)."""
    offending = []
    for path in (ROOT / "megaloop").rglob("*.py"):
        if path.parent.name == "parallel" and path.name in ENGINE_FILES:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_RULE.search(line) and "engine.name" not in line:
                offending.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offending, "\n".join(offending)


@pytest.mark.parametrize("name", list(ENGINES))
def test_config_checks_follow_the_engines_capabilities(name):
    spec, base = ENGINES[name], [*BASE, f"engine={name}"]

    def loads(*overrides) -> bool:
        try:
            experiment.load(TINY, [*base, *overrides])
        except ConfigError:
            return False
        return True

    assert loads()
    assert loads("parallel.pp=2", "model.num_layers=2", "train.global_batch_size=4") == (
        spec.supports_pipeline
    )
    for policy in get_args(get_type_hints(TrainConfig)["nonfinite"]):
        assert loads(f"train.nonfinite={policy}") == (policy in spec.nonfinite)
    assert loads("train.init_from=runs/elsewhere") == spec.init_from


def test_the_memory_models_in_numbers():
    cfg = experiment.load(TINY, [*BASE, "engine=deepspeed", "deepspeed.zero_stage=3"])
    n, dp = 1000, 4
    assert ENGINES["megatron"].state_bytes(cfg, n, dp) == {
        "params": n,
        "weights": 4000,
        "grads": 4000,
        "optimizer": 2000,
    }
    by_stage = {}
    for stage in (0, 1, 2, 3):
        cfg.deepspeed.zero_stage = stage
        state = ENGINES["deepspeed"].state_bytes(cfg, n, dp)
        by_stage[stage] = (state["weights"], state["grads"], state["optimizer"])
    assert by_stage == {
        0: (4000, 4000, 8000),
        1: (4000, 4000, 3000),
        2: (4000, 1000, 3000),
        3: (1000, 1000, 3000),
    }


def test_a_deepspeed_checkpoint_resumes_only_in_its_own_layout(tmp_path):
    cfg = experiment.load(TINY, [*BASE, "engine=deepspeed", "deepspeed.zero_stage=2"])
    saved = {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 1}
    ENGINES["deepspeed"].check_reshard(cfg, saved, 2, tmp_path)  # ZeRO-1 -> 2: same kind
    with pytest.raises(ConfigError, match="DP=2 ZeRO-1; this launch is TP=1 DP=4 ZeRO-2"):
        ENGINES["deepspeed"].check_reshard(cfg, saved, 4, tmp_path)
    ENGINES["megatron"].check_reshard(cfg, saved, 4, tmp_path)  # megatron reshards any layout


@pytest.mark.parametrize(
    "engine", [[], ["engine=deepspeed", "deepspeed.zero_stage=1"]], ids=["megatron", "deepspeed"]
)
def test_validation_runs_with_dropout_off_on_every_engine(tmp_path, engine):
    """After a training step (the engine in training mode), two validation passes of a model
    with dropout 0.5 give the same CE bit for bit, and that CE is the one of the model put in
    eval mode directly (not through the engine) over the same windows."""
    import torch

    cfg = experiment.load(
        TINY, [*BASE, *engine, f"train.dir={tmp_path}", "model.dropout=0.5", "train.steps=2"]
    )
    trainer = experiment.build_trainer(cfg, log=False)
    trainer.train_step()
    assert trainer.engine.module.training  # a training step leaves the model training
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first["ce"] == second["ce"]
    windows = trainer.eval_microbatches * cfg.train.micro_batch_size
    assert first["valid_windows"] == windows == 4
    batch = trainer.dataset.batch(range(windows), split="valid")
    model = trainer.engine.module
    model.eval()
    with torch.no_grad():
        out = model(batch[:, :-1], labels=batch[:, 1:])
    direct = [c.float().mean().item() for c in out.token_ce]
    assert len(direct) == cfg.model.num_loops
    assert first["ce"] == pytest.approx(direct, rel=1e-5)
    # the same model training: dropout moves the CE of a near-uniform model by ~5e-4 of itself,
    # 50x the tolerance above (so the comparison can tell the two apart)
    model.train()
    with torch.no_grad():
        dropped = model(batch[:, :-1], labels=batch[:, 1:])
    assert [c.float().mean().item() for c in dropped.token_ce] != pytest.approx(direct, rel=1e-4)
