"""`megaloop train CONFIG [key=value ...]`: train a looped model, print the final validation."""

from __future__ import annotations

import json
import os
import sys

from megaloop.commands.options import load_config, with_config

BUILDS_MODEL = True


def add_parser(sub) -> None:
    with_config(sub.add_parser("train", help="train a looped model")).set_defaults(fn=run)


def run(args) -> int:
    cfg = load_config(args)
    from megaloop.experiment import build_trainer
    from megaloop.train.preemption import EXIT_PREEMPTED, Preempted
    from megaloop.train.watchdog import EXIT_UNHEALTHY, STOP_MARKER, UnhealthyRun

    trainer = build_trainer(cfg)
    try:
        result = trainer.fit()
    except Preempted as e:
        print(
            f"megaloop: {e}; exiting with {EXIT_PREEMPTED} so the job can be requeued",
            file=sys.stderr,
        )
        return EXIT_PREEMPTED
    except UnhealthyRun as e:
        print(
            f"megaloop: {e}; see {trainer.run_dir / STOP_MARKER}; exiting with "
            f"{EXIT_UNHEALTHY} (not requeued)",
            file=sys.stderr,
        )
        return EXIT_UNHEALTHY
    except Exception as e:
        from megaloop.parallel import distributed

        if not distributed.is_collective_failure(e):
            raise
        return collective_failure(e)
    print(
        json.dumps(
            {
                "valid_ce": result["ce"],
                "hidden_rms": result["hidden_rms"],
                "valid_windows": result["valid_windows"],
            }
        )
    )
    return 0


def collective_failure(e: Exception) -> int:
    """A failed collective (a rank died): one line naming the missing ranks, and exit 1."""
    from megaloop.parallel import distributed

    rank = int(os.environ.get("RANK", 0))
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(
        f"megaloop: rank {rank}: a collective failed ({first}); "
        f"{distributed.missing_ranks()}. Relaunch to resume from the newest complete "
        f"checkpoint",
        file=sys.stderr,
        flush=True,
    )
    return 1
