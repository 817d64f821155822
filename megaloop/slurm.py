"""Slurm: rendering and submitting the job scripts in slurm/ (the layout a job gets is
megaloop.parallel.planner's, a rank's place in it megaloop.parallel.launch's).

One launch path. `megaloop slurm submit` renders slurm/train.sbatch for N nodes x T tasks and
submits it with sbatch; the script exports MASTER_ADDR (the first node's NodeAddr) and
MASTER_PORT (from the job id), and its srun starts one `megaloop train` per rank. Each rank
reads its place from Slurm's task environment (megaloop.parallel.launch), so no launcher sits
in between.
Kept free of torch imports: `megaloop slurm submit` runs on login nodes.
"""

from __future__ import annotations

import importlib.resources
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megaloop.config import ConfigError, find_config
from megaloop.parallel.launch import LaunchError
from megaloop.parallel.planner import Proposal, layout_given, propose

TEMPLATES = Path(str(importlib.resources.files("megaloop") / "_files" / "slurm")).resolve()
"""slurm/ (megaloop/_files/slurm links to it; package data in a wheel)."""


# -- the job script -----------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def render(template: Path, values: dict) -> str:
    text = template.read_text()
    missing = sorted(set(_PLACEHOLDER.findall(text)) - set(values))
    if missing:
        raise LaunchError(f"{template}: no value for {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)


def time_limit_seconds(time: str) -> int:
    """Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", time)
    if not m:
        raise LaunchError(f"--time {time!r}: use Slurm's MINUTES, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:
        return ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    if c is not None:
        return (a * 60 + b) * 60 + c
    return a * 60 + (b or 0)


@dataclass
class TrainJob:
    """What `megaloop slurm submit` asks Slurm for."""

    config: str
    overrides: list
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int | None = None
    """Ranks per node; default: one per GPU (1 without GPUs)."""
    cpus_per_task: int | None = None
    """CPUs (and torch threads) per rank; default 8 on GPU nodes (data loading), 1 without."""
    time: str = "24:00:00"
    warning_seconds: int = 300
    partition: str | None = None
    account: str | None = None
    gpu_memory_gib: float = 80.0
    sbatch_args: tuple = ()
    job_name: str | None = None
    program: str | None = None
    """What each rank runs, its `train ...` arguments following, in place of `python -m
    megaloop` (words split as a shell would, nothing expanded): a container, `apptainer exec
    IMAGE python -m megaloop`, or a script that registers callbacks of its own
    (megaloop.train.callbacks.register) and calls megaloop.cli.main."""

    def check(self) -> None:
        if (
            self.nodes < 1
            or self.gpus_per_node < 0
            or (self.cpus_per_task is not None and self.cpus_per_task < 1)
        ):
            raise LaunchError("--nodes and --cpus-per-task must be >= 1, --gpus-per-node >= 0")
        if self.tasks_per_node is not None and self.tasks_per_node < 1:
            raise LaunchError("--tasks-per-node must be >= 1")
        if self.gpus_per_node and self.tasks_per_node not in (None, self.gpus_per_node):
            raise LaunchError(
                f"--tasks-per-node {self.tasks_per_node} with --gpus-per-node "
                f"{self.gpus_per_node}: megaloop runs one rank per GPU; drop "
                f"--tasks-per-node"
            )
        limit = time_limit_seconds(self.time)
        if not 1 <= self.warning_seconds < limit:
            raise LaunchError(
                f"--warning-seconds {self.warning_seconds} must lie in [1, {limit}) "
                f"for --time {self.time}: the warning comes that long before the "
                f"limit, and the run needs time to reach it"
            )
        self.config = str(find_config(self.config))  # a path, or a shipped config's name
        if self.program is not None:
            self.program_words()

    def program_words(self) -> list[str]:
        if self.program is None:
            return [sys.executable, "-m", "megaloop"]
        try:
            words = shlex.split(self.program)
        except ValueError as e:
            raise LaunchError(f"--program {self.program!r}: {e}") from None
        if not words:
            raise LaunchError("--program is empty: give a command, e.g. 'python -m megaloop'")
        return words

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def cpus(self) -> int:
        return self.cpus_per_task or (8 if self.gpus_per_node else 1)


@dataclass
class Run:
    """One training run of a job: what its srun step starts, where, in which layout."""

    config: str
    overrides: list
    run_dir: Path
    layout: Proposal
    missing: str | None = None
    """Why the run's data cannot be read from this machine (a file named in data.* is not
    there), None when it can: `slurm submit` refuses such a run, its dry run says it."""

    def command(self) -> str:
        """Bash: RUN_DIR and the RUN array of `megaloop train` arguments, every value quoted."""
        args = [str(find_config(self.config)), *self.overrides]
        return (
            f"RUN_DIR={shlex.quote(str(self.run_dir))}; "
            f"RUN=({' '.join(shlex.quote(a) for a in args)})"
        )


def plan(job: TrainJob, config: str, overrides: list) -> Run:
    """Check one run's config against the job, choose its layout, fix its run directory."""
    from megaloop import experiment

    cfg = experiment.load(config, overrides)
    world = job.nodes * job.ranks_per_node
    layout = propose(
        cfg,
        world,
        job.gpu_memory_gib if job.gpus_per_node else None,
        job.gpus_per_node,
        layout_given(overrides),
    )
    run_dir = Path(cfg.train.dir).resolve()
    applied = {"parallel.tp": layout.plan.tp, "parallel.pp": layout.plan.pp, **layout.changes}
    kept = [o for o in overrides if o.split("=", 1)[0].strip() not in (*applied, "train.dir")]
    kept += [f"{k}={v}" for k, v in applied.items()] + [f"train.dir={run_dir}"]
    try:
        cfg.data.check_files()
        missing = None
    except ConfigError as e:
        missing = str(e)
    return Run(config, kept, run_dir, layout, missing)


def directive(what: str, value) -> str:
    """A value for an `#SBATCH` line, which is a comment to bash: a newline (or any control
    character) in it would end the comment and run the rest as a command."""
    text = str(value)
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise LaunchError(
            f"{what} {text!r} holds a control character (a newline?); it would end "
            f"its #SBATCH line and run the rest as a shell command"
        )
    return text


def render_job(job: TrainJob, runs: list[Run], output: Path, name: str) -> str:
    """slurm/train.sbatch for one run, or a job array of runs (array task i trains runs[i])."""
    for what, value in (
        ("--partition", job.partition),
        ("--account", job.account),
        ("--job-name", job.job_name or name),
        ("the log path", output),
        *(("--sbatch-arg", a) for a in job.sbatch_args),
    ):
        if value is not None:
            directive(what, value)
    lines = [
        f"#SBATCH --{k}={v}"
        for k, v in (
            ("partition", job.partition),
            ("account", job.account),
            ("gpus-per-node", job.gpus_per_node),
        )
        if v
    ]
    if len(runs) > 1:
        lines.append(f"#SBATCH --array=0-{len(runs) - 1}")
        select = "\n".join(
            ['case "$SLURM_ARRAY_TASK_ID" in']
            + [f"  {i}) {run.command()} ;;" for i, run in enumerate(runs)]
            + ["esac"]
        )
    else:
        select = runs[0].command()
    lines += [f"#SBATCH {a}" for a in job.sbatch_args]
    return render(
        TEMPLATES / "train.sbatch",
        {
            "job_name": job.job_name or name,
            "nodes": job.nodes,
            "tasks_per_node": job.ranks_per_node,
            "cpus_per_task": job.cpus,
            "time": job.time,
            "warning_seconds": job.warning_seconds,
            "output": shlex.quote(str(output)),
            "sbatch_lines": "\n".join(lines),
            "runs": select,
            "program": shlex.join(job.program_words()),
        },
    )


def prepare(job: TrainJob) -> tuple[str, Run]:
    """Check the request and the config together, choose the layout, render the script.
    Nothing is written and nothing is submitted."""
    job.check()
    run = plan(job, job.config, job.overrides)
    script = render_job(job, [run], run.run_dir / "logs" / "slurm-%j.out", job_name(run.run_dir))
    return script, run


def job_name(run_dir: Path) -> str:
    """`megaloop-` and the run directory's path under its last `runs` folder (runs/study/44m/
    per_loop_norm/seed0: megaloop-study-44m-per_loop_norm-seed0), else its name, with its
    parent's before a `seedN` (every run of a sweep has one)."""
    parts = run_dir.parts
    if "runs" in parts[:-1]:
        below = parts[len(parts) - parts[::-1].index("runs") :]
    elif run_dir.name.startswith("seed") and len(parts) > 1:
        below = parts[-2:]
    else:
        below = parts[-1:]
    return "-".join(["megaloop", *below])


def submit(script: str, logs: Path, name: str = "train") -> str:
    """Write the script into `logs` (Slurm does not create its --output folder) and sbatch it;
    return the job id."""
    logs.mkdir(parents=True, exist_ok=True)
    n = len(list(logs.glob(f"{name}-*.sbatch")))
    path = logs / f"{name}-{n}.sbatch"
    path.write_text(script)
    try:
        out = subprocess.run(
            ["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=True
        )
    except FileNotFoundError:
        raise LaunchError(
            "sbatch not found: run this on a Slurm login node (or source the "
            "env.sh of slurm/local/up.sh)"
        ) from None
    except subprocess.CalledProcessError as e:
        raise LaunchError(f"sbatch refused {path}: {e.stderr.strip()}") from None
    return out.stdout.strip().split(";")[0]
