"""Callbacks: each concern of the training loop (logging, validation, checkpoints, the watchdog,
the non-finite policy, memory reports, preemption) is one object with named hooks, in the manner
of OLMo-core, so `Trainer.fit` stays a short loop and a concern changes in one place.

The trainer calls every callback's hook in order of `priority` (highest first, then in the
order given): what decides whether a step stands (the non-finite policy, the watchdog) runs
before what records it, and saving runs last. A program that runs `megaloop.cli.main` itself
may `register` callbacks of its own (extra logging, a test's faults); every trainer built in
that process runs them too.
"""

from __future__ import annotations

from typing import ClassVar


class Callback:
    """Hooks default to doing nothing; a callback overrides the ones its concern needs. Each
    hook gets the megaloop.train.trainer.Trainer (its step, engine, config, logger)."""

    priority: ClassVar[int] = 0

    def pre_train(self, trainer) -> None:
        """After the resume (`trainer.step` is the step resumed from), before the first step;
        `trainer.logger` opens after it."""

    def pre_step(self, trainer) -> None:
        """Before a step's forward-backward (`trainer.step` is the previous step)."""

    def post_batch(self, trainer) -> None:
        """Right after a step's forward-backward and optimizer step, even if they raised."""

    def post_step(self, trainer, record: dict) -> None:
        """After step `record["step"]`, with its reduced record."""

    def post_train(self, trainer) -> None:
        """After the last step."""

    def close(self, trainer) -> None:
        """Always, when fit ends, whichever way."""


_REGISTERED: list[Callback] = []


def register(callback: Callback) -> None:
    """Run `callback` in every trainer this process builds after this call."""
    _REGISTERED.append(callback)


def registered() -> list[Callback]:
    return list(_REGISTERED)


def ordered(callbacks: list[Callback]) -> list[Callback]:
    return sorted(callbacks, key=lambda c: -c.priority)
