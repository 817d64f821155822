"""megaloop in shell pipelines: a reader that stops early (`| head -1`, `| grep -q`) never fails
the command, and commands that only read configs start without the training stack.

The reader is made to stop before the command writes anything (the pipe's read end is closed
before the command starts), so the first write meets a closed pipe every time: the test does not
depend on timing, unlike `cmd | head -1`, whose outcome depends on which side runs first."""

import os
import re
import subprocess
import sys

import pytest

from megaloop.train.metrics import read as read_metrics
from support import ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

# The kinds of check .ci/wheel makes, each against a reader that is gone.
READ_ONLY = [
    ["--help"],
    ["configs"],
    ["params", "129m"],
    ["plan", "experiments/fineweb/1p4b_baseline", "--gpus", "8", "--gpu-mem", "80"],
    ["plan", "experiments/fineweb/1p4b_baseline", "--gpus", "8", "--gpu-mem", "80", "--search"],
]


def run_into_closed_pipe(args: list[str], cwd=None, timeout: float = 300):
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "megaloop", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            cwd=cwd,
            timeout=timeout,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", READ_ONLY, ids=lambda a: " ".join(a[:2]))
def test_a_reader_that_stops_early_is_not_an_error(args):
    proc = run_into_closed_pipe(args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_slurm_dry_run_into_a_closed_pipe(tmp_path):
    proc = run_into_closed_pipe(
        ["slurm", "submit", "experiments/tiny", "--nodes", "1", "--gpus-per-node", "0"]
        + ["--dry-run", f"train.dir={tmp_path / 'run'}"]
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "layout: TP=1 PP=1" in proc.stderr  # the summary still reaches stderr


def test_training_goes_on_when_its_reader_stops(tmp_path):
    """A run piped into `head` trains to the end and saves: output nobody reads is dropped."""
    run = tmp_path / "run"
    proc = run_into_closed_pipe(
        ["train", "experiments/tiny", "train.steps=3", "train.eval_batches=1", f"train.dir={run}"]
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    metrics = read_metrics(run)
    assert metrics["steps"][-1]["step"] == 3
    assert (run / "checkpoints" / "step_0000003").is_dir()


@pytest.mark.parametrize(
    "args",
    [
        ["configs"],
        ["params", "129m"],
        ["plan", "experiments/fineweb/1p4b_baseline", "--gpus", "8", "--gpu-mem", "80"],
        ["train", "experiments/tiny", "train.steps=3", "--print-config"],
        ["slurm", "submit", "experiments/tiny", "--nodes", "1", "--gpus-per-node", "0"]
        + ["--dry-run"],
    ],
    ids=lambda a: a[0],
)
def test_config_only_commands_import_no_training_stack(args, tmp_path):
    code = (
        "import sys\n"
        "from megaloop.cli import main\n"
        f"rc = main({args + [f'train.dir={tmp_path}'] if args[0] == 'slurm' else args!r})\n"
        "heavy = sorted(m for m in ('torch', 'megatron.core', 'wandb', 'deepspeed', "
        "'transformers') if m in sys.modules)\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stderr, proc.stderr


EARLY_READER = re.compile(r"\|\s*(grep\s+(-\w*q|--quiet)|head\b)")


def test_no_script_under_pipefail_pipes_into_an_early_reader():
    """`cmd | grep -q` and `cmd | head` under pipefail fail when the reader exits first."""
    scripts = [
        p
        for p in [*ROOT.glob(".ci/*"), *ROOT.glob("bench/**/*"), *ROOT.glob("slurm/**/*")]
        if p.is_file() and p.suffix not in (".py", ".md", ".json", ".png")
    ]
    scripts += [ROOT / "Makefile"]
    offending = []
    for script in scripts:
        text = script.read_text(errors="replace")
        if "pipefail" not in text:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if not line.lstrip().startswith("#") and EARLY_READER.search(line):
                offending.append(f"{script.relative_to(ROOT)}:{n}: {line.strip()}")
    assert len(scripts) > 5 and not offending, "\n".join(offending)
