"""`megaloop slurm submit CONFIG --nodes N --gpus-per-node G`: render and sbatch a training job."""

from __future__ import annotations

import sys

from megaloop.commands.options import slurm_job, train_job, with_config
from megaloop.config import ConfigError

BUILDS_MODEL = False


def add_parser(sub) -> None:
    actions = sub.add_parser("slurm", help="Slurm jobs (slurm/*.sbatch)").add_subparsers(
        dest="slurm_command", required=True, metavar="ACTION"
    )
    p = with_config(
        actions.add_parser(
            "submit",
            help="render slurm/train.sbatch for this config and sbatch it",
            description="One srun task per rank; the layout (parallel.tp/pp) is chosen to fit the "
            "GPUs unless given as overrides. See docs/slurm.md.",
        )
    )
    slurm_job(p, required=True)
    p.set_defaults(fn=submit)


def submit(args) -> int:
    from megaloop import slurm

    job = train_job(args, args.config, args.overrides)
    script, run = slurm.prepare(job)
    run_dir, layout = run.run_dir, run.layout
    summary = (
        f"layout: TP={layout.plan.tp} PP={layout.plan.pp} DP={layout.plan.dp} on {job.nodes} "
        f"node(s) x {job.ranks_per_node} rank(s): {layout.why}"
    )
    if args.dry_run:
        print(script, end="")
        print(f"# {summary}", file=sys.stderr)
        if run.missing:
            print(
                f"megaloop: warning: {run.missing} (checked on this machine: `slurm submit` "
                f"without --dry-run refuses it)",
                file=sys.stderr,
            )
        return 0
    if run.missing:
        raise ConfigError(f"{run.missing} (checked on this machine; nothing submitted)")
    job_id = slurm.submit(script, run_dir / "logs")
    print(f"{summary}\nsubmitted job {job_id}; logs in {run_dir / 'logs'}")
    return 0
