"""`megaloop sweep`: every config × seed in a run directory of its own, finished runs skipped.

    megaloop sweep configs/experiments/wikitext103/44m/*.yaml --seeds 0,1,2 [key=value ...]

Run i of a sweep is `megaloop train CONFIG train.seed=S train.dir=ROOT/<config path>/seedS`
(experiment.default_run_dir), so a sweep and a hand-started run of the same config and seed
share a directory. A directory that recorded a run of another config (metrics.jsonl's config,
written at every start) stops the sweep before any run starts, finished or not: it belongs to
another experiment, and a sweep never replaces one. The keys that may differ are those a resume
may change (megaloop.train.resumable.RESUMABLE): its length (compared on its own, below), the
directory's spelling, cadence, monitoring and layout, none of which changes the trained model.
A run is finished when its metrics.jsonl holds the final validation record of its step count;
an unfinished one resumes from its newest checkpoint. `local` trains the runs one after another
in child processes; `slurm` submits one job array of slurm/train.sbatch (array task i trains run
i, with the options of `slurm submit`).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megaloop.config import ConfigError


@dataclass
class SweepRun:
    config: str
    seed: int
    run_dir: Path
    overrides: list
    """What `megaloop train CONFIG` is given: the sweep's overrides, the seed, the directory."""
    steps: int | None
    """train.steps as requested (None: from data.epochs)."""
    resolved: dict
    """The resolved config `megaloop train` would run (train.steps not yet read from
    data.epochs)."""


def plan(configs: list[str], seeds: list[int], overrides: list[str], root: Path) -> list[SweepRun]:
    """Every config × seed, each config checked (loaded and validated) before anything runs."""
    from megaloop import experiment

    given = {o.split("=", 1)[0] for o in overrides}
    for key in ("train.dir", "train.seed"):
        if key in given:
            raise ConfigError(
                f"{key} cannot be given to a sweep: every run gets its own "
                f"(--seeds, and --out for where the run directories go)"
            )
    if not seeds:
        raise ConfigError("--seeds: give at least one seed, e.g. --seeds 0,1,2")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError(
            f"--seeds gives seed {', '.join(map(str, twice))} more than once: two runs of one "
            f"(config, seed) would write one run directory; give each seed once"
        )
    runs = []
    for config in configs:
        for seed in seeds:
            run_dir = root / experiment.default_run_dir(config, seed).relative_to("runs")
            run_overrides = [*overrides, f"train.seed={seed}", f"train.dir={run_dir}"]
            cfg = experiment.load(config, run_overrides)
            runs.append(
                SweepRun(config, seed, run_dir, run_overrides, cfg.train.steps, cfg.to_dict())
            )
    dirs = [r.run_dir.resolve() for r in runs]
    if len(set(dirs)) < len(dirs):
        raise ConfigError(
            "two configs of the sweep map to one run directory (the same file given twice, "
            "or by two paths?); give each config once"
        )
    check_directories(runs)
    return runs


def check_directories(runs: list[SweepRun]) -> None:
    """No run directory holds a run of another config (ConfigError naming each and its keys)."""
    from megaloop.train import metrics
    from megaloop.train.resumable import RESUMABLE, config_changes

    taken = []
    for run in runs:
        recorded = metrics.read(run.run_dir)
        if recorded is None or not recorded.get("config"):
            continue
        changes = config_changes(recorded["config"], run.resolved)
        if changes:
            taken.append(
                f"{run.run_dir} holds a run of another config (recorded -> asked for: "
                f"{'; '.join(changes)})"
            )
    if taken:
        raise ConfigError(
            f"{'. '.join(taken)}. A sweep neither skips nor replaces a run of another config: "
            f"give the sweep that run's values, or another --out (keys that may differ: "
            f"{', '.join(RESUMABLE)})"
        )


def finished(run: SweepRun) -> bool:
    """The run wrote the final validation record of its step count (the requested one, or the
    one its saved config resolved from data.epochs)."""
    from megaloop.train import metrics

    return metrics.finished(run.run_dir, run.steps)


def run_local(runs: list[SweepRun]) -> list[tuple[SweepRun, int]]:
    """Train each run in a child process, one after another; returns the failures."""
    failed = []
    for i, run in enumerate(runs, start=1):
        print(f"sweep: [{i}/{len(runs)}] {run.config} seed {run.seed} -> {run.run_dir}", flush=True)
        code = subprocess.run(
            [sys.executable, "-m", "megaloop", "train", run.config, *run.overrides]
        ).returncode
        if code != 0:
            print(f"sweep: {run.run_dir} ended with exit code {code}", flush=True)
            failed.append((run, code))
    return failed


def submit_slurm(job, runs: list[SweepRun], root: Path, dry_run: bool = False) -> str:
    """One job array, a run per array task; returns the job id (or the script, dry)."""
    from megaloop import slurm

    job.check()
    planned = [slurm.plan(job, run.config, run.overrides) for run in runs]
    logs = root.resolve() / "sweep-logs"
    output = logs / ("slurm-%A_%a.out" if len(planned) > 1 else "slurm-%j.out")
    script = slurm.render_job(job, planned, output, "megaloop-sweep")
    if dry_run:
        return script
    return slurm.submit(script, logs, name="sweep")
