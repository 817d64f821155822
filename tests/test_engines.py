"""Both engines implement the one written contract (megaloop/parallel/engine.py): the same
methods with the same parameters, a StepResult from train_step, and memory reports with the
same keys (the multi-process tests check the DeepSpeed engine's reports, and hold both to
`megaloop plan`)."""

import inspect

import pytest

from megaloop import experiment
from megaloop.parallel.deepspeed import DeepSpeedEngine
from megaloop.parallel.engine import RANK_REPORT_KEYS, StepResult, TrainingEngine
from megaloop.parallel.megatron import MegatronEngine
from multiproc import BASE, TINY

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
