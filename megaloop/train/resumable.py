"""What makes a run directory one experiment: the config keys one run may change between its
starts (RESUMABLE), and the changes outside them (`config_changes`).

A resume asks it of the newest checkpoint's config (megaloop/train/start.py); `megaloop sweep`
asks it of the config a run directory recorded (metrics.jsonl) before it skips a finished run
or starts any (megaloop/sweep.py). Imports nothing heavy: `sweep` starts without torch.
"""

from __future__ import annotations

import json

from megaloop.config import flatten

RESUMABLE = (
    "train.steps",
    "train.dir",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.save_every",
    "train.keep_last",
    "train.scale_alarm",
    "train.recompute",
    "parallel",
    "deepspeed.zero_stage",
    "wandb",
)
"""Config keys (or sections) that may change when a run resumes: its length, cadence and
monitoring, the layout (checkpoints reshard; `slurm submit` rewrites it) and activation
recompute (memory, not arithmetic: a run resharded onto fewer devices may need it). Any other
difference from the checkpoint's saved config stops the resume."""


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
