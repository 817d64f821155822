"""`megaloop sweep CONFIG... --seeds 0,1,2`: every config x seed in a run directory of its own.

`--dry-run` prints what the sweep would do, run by run, under either executor, and trains,
writes and submits nothing."""

from __future__ import annotations

import shlex
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
    slurm_job(
        p,
        required=False,
        dry_run="print each run's directory, config, seed and what the sweep would do with it "
        "(with --executor slurm: that on stderr, the job array's script on stdout); "
        "train, write and submit nothing",
    )
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
    if args.executor == "slurm" and (args.nodes is None or args.gpus_per_node is None):
        print(
            "megaloop: error: --executor slurm needs --nodes and --gpus-per-node",
            file=sys.stderr,
        )
        return 2
    root = Path(args.out)
    runs = sweep.plan(configs, seeds, overrides, root)
    todo = [r for r in runs if not sweep.finished(r)]
    if args.dry_run:
        return dry_run(args, runs, todo, root)
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


def dry_run(args, runs: list, todo: list, root: Path) -> int:
    """What the sweep would do with each run; nothing trained, written or submitted. Under
    --executor slurm the job array's script alone goes to stdout, as `slurm submit --dry-run`
    prints it, and the runs to stderr."""
    from megaloop.commands.train import start_of

    slurm = args.executor == "slurm"
    say = sys.stderr if slurm else sys.stdout
    for run in runs:
        what = f"sweep: {run.run_dir}: {run.config} seed {run.seed}"
        if run not in todo:
            print(f"{what}: finished; would be skipped", file=say)
            continue
        where = start_of(run.run_dir, run.resolved["train"]["init_from"])
        print(f"{what}: would train ({where})", file=say)
        if not slurm:
            print(f"  megaloop train {shlex.join([run.config, *run.overrides])}", file=say)
    how = "as one Slurm job array" if slurm else "here, one after another"
    print(
        f"sweep: dry run: {len(todo)} of {len(runs)} run(s) would train {how}; nothing "
        f"trained, written or submitted",
        file=say,
    )
    return on_slurm(args, todo, root) if slurm and todo else 0


def on_slurm(args, todo: list, root: Path) -> int:
    """The unfinished runs as one job array (its script printed instead with --dry-run)."""
    from megaloop import sweep

    out = sweep.submit_slurm(train_job(args, todo[0].config, []), todo, root, args.dry_run)
    if args.dry_run:
        print(out, end="")
    else:
        print(
            f"submitted job {out}: {len(todo)} run(s), one per array task; Slurm logs in "
            f"{root.resolve() / 'sweep-logs'}"
        )
    return 0
