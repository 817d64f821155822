"""Trainer.fit is a loop over callbacks (megaloop/train/callbacks.py): each hook runs on every
callback, in order of priority, the step a callback sees is the step that ran, and a callback
registered by a program reaches the trainer build_trainer makes."""

from collections import Counter

import pytest

from megaloop import experiment
from megaloop.train import callbacks
from megaloop.train.callbacks import Callback
from megaloop.train.checkpoint import Checkpointing
from megaloop.train.metrics import ProgressLog
from megaloop.train.nonfinite import NonFinitePolicy, first_nonfinite
from megaloop.train.preemption import PreemptionCheck
from multiproc import BASE, TINY


class Recorder(Callback):
    """Every hook call, with the trainer's step at that moment."""

    def __init__(self):
        self.calls = []

    def pre_train(self, trainer):
        self.calls.append(("pre_train", trainer.step))

    def pre_step(self, trainer):
        self.calls.append(("pre_step", trainer.step))

    def post_batch(self, trainer):
        self.calls.append(("post_batch", trainer.step))

    def post_step(self, trainer, record):
        assert record["step"] == trainer.step
        self.calls.append(("post_step", trainer.step))

    def post_train(self, trainer):
        self.calls.append(("post_train", trainer.step))

    def close(self, trainer):
        self.calls.append(("close", trainer.step))


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(callbacks, "_REGISTERED", [])


def test_a_registered_callback_sees_every_hook_of_a_resumed_run(tmp_path, registry):
    overrides = [*BASE, f"train.dir={tmp_path}", "train.steps=3", "train.save_every=2"]
    experiment.build_trainer(experiment.load(TINY, overrides)).fit()
    recorder = Recorder()
    callbacks.register(recorder)
    cfg = experiment.load(TINY, [*overrides, "train.steps=5"])
    trainer = experiment.build_trainer(cfg)
    assert recorder in trainer.callbacks
    result = trainer.fit()  # resumes from step 3
    assert result["step"] == 5
    assert recorder.calls == [
        ("pre_train", 3),
        ("pre_step", 3),
        ("post_batch", 3),
        ("post_step", 4),
        ("pre_step", 4),
        ("post_batch", 4),
        ("post_step", 5),
        ("post_train", 5),
        ("close", 5),
    ]


def test_callbacks_run_by_priority_the_policy_first_the_save_last(tmp_path):
    cfg = experiment.load(TINY, [*BASE, f"train.dir={tmp_path}"])
    trainer = experiment.build_trainer(cfg)
    recorder = Recorder()
    trainer.add_callback(recorder)
    kinds = [type(c) for c in trainer.callbacks]
    assert kinds[0] is NonFinitePolicy and kinds[-2:] == [PreemptionCheck, Checkpointing]
    assert kinds.index(ProgressLog) < kinds.index(Recorder) < kinds.index(PreemptionCheck)
    assert Counter(kinds)[Recorder] == 1 and len(kinds) == 8


@pytest.mark.parametrize(
    "record, what",
    [
        ({"ce": [2.0, float("nan"), float("inf")], "loss": 1.0}, "loop 2's loss (CE per loop: 2"),
        ({"ce": [2.0, 1.5], "loss": float("nan")}, "the loss"),
        ({"ce": [2.0, 1.5], "loss": 1.0, "grad_norm": float("inf")}, "the gradients (norm inf)"),
    ],
)
def test_first_nonfinite_names_what_went_bad(record, what):
    assert first_nonfinite(record).startswith(what)
