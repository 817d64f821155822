"""`megaloop sweep CONFIG... --seeds 0,1,2`: every config x seed in a run directory of its own."""

from __future__ import annotations

import sys
from pathlib import Path

from megaloop.commands.options import deprecated, seed_list, slurm_job, train_job

BUILDS_MODEL = False


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sweep",
        help="every config x seed in a run directory of its own; "
        "finished runs skipped, unfinished ones resumed",
    )
    p.add_argument(
        "configs",
        nargs="+",
        metavar="CONFIG",
        help="YAML configs, then key=value overrides for every run",
    )
    p.add_argument(
        "--seeds", default="0", help="seeds, comma-separated: one run per config and seed"
    )
    p.add_argument(
        "--executor",
        choices=["local", "slurm"],
        default="local",
        help="local: one run after another here; slurm: one job array",
    )
    p.add_argument(
        "--out",
        default="runs",
        help="folder: the run directories go to OUT/<config path under configs/experiments>/seedN",
    )
    deprecated(p, "--root", "--out")
    slurm_job(p, required=False)
    p.set_defaults(fn=run, overrides=[])


def run(args) -> int:
    from megaloop import sweep

    configs = [c for c in args.configs if "=" not in c]
    overrides = [c for c in args.configs if "=" in c] + args.overrides
    seeds = seed_list(args.seeds)
    if not configs or not seeds:
        print(
            "megaloop: error: give one or more config files and --seeds like 0,1,2", file=sys.stderr
        )
        return 2
    root = Path(args.out)
    runs = sweep.plan(configs, seeds, overrides, root)
    todo = [r for r in runs if not sweep.finished(r)]
    for run in runs:
        if run not in todo:
            print(f"sweep: {run.run_dir} is finished; skipped")
    if not todo:
        print(f"sweep: all {len(runs)} runs are finished")
        return 0
    if args.executor == "slurm":
        return on_slurm(args, todo, root)
    failed = sweep.run_local(todo)
    print(
        f"sweep: {len(todo) - len(failed)} of {len(todo)} run(s) trained"
        + (f"; failed: {', '.join(str(r.run_dir) for r, _ in failed)}" if failed else "")
    )
    return 1 if failed else 0


def on_slurm(args, todo: list, root: Path) -> int:
    """The unfinished runs as one job array (its script printed instead with --dry-run)."""
    from megaloop import sweep

    if args.nodes is None or args.gpus_per_node is None:
        print(
            "megaloop: error: --executor slurm needs --nodes and --gpus-per-node",
            file=sys.stderr,
        )
        return 2
    out = sweep.submit_slurm(train_job(args, todo[0].config, []), todo, root, args.dry_run)
    if args.dry_run:
        print(out, end="")
    else:
        print(
            f"submitted job {out}: {len(todo)} run(s), one per array task; Slurm logs in "
            f"{root.resolve() / 'sweep-logs'}"
        )
    return 0
