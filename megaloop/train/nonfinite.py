"""train.nonfinite: what a step whose update was not applied (a non-finite loss or gradient)
does to the run: `skip` counts it and goes on with unchanged weights, `stop` saves and stops
with EXIT_UNHEALTHY. The engines decide `applied` with one collective, so every rank agrees."""

from __future__ import annotations

import math

from megaloop.train.callbacks import Callback


def first_nonfinite(record: dict) -> str:
    """What went non-finite in a step's logged record: the first loop's CE, or the gradients."""
    ce = record.get("ce") or []
    bad = [k for k, c in enumerate(ce, 1) if not math.isfinite(c)]
    if bad:
        return f"loop {bad[0]}'s loss (CE per loop: {', '.join(f'{c:.4g}' for c in ce)})"
    if not math.isfinite(record.get("loss", 0.0)):
        return "the loss"
    return f"the gradients (norm {record.get('grad_norm')})"


class NonFinitePolicy(Callback):
    """Runs first after a step: a step that did not stand is neither logged as trained on nor
    saved before the policy has spoken."""

    priority = 100

    def post_step(self, trainer, record: dict) -> None:
        if not record.get("skipped"):
            return
        what = first_nonfinite(record)
        if trainer.cfg.train.nonfinite == "stop":
            trainer.stop_unhealthy("nonfinite", f"non-finite {what}; the update was not applied")
        trainer.logger.skipped(trainer.step, what)
