"""`python -m bench NAME`: the one way a bench runs. A name is a module of bench/ (a hyphen for an
underscore), --smoke of a bench that writes docs/ needs --out, and --out is refused where a
bench writes no folder."""

import subprocess
import sys

import pytest

from support import ROOT


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_without_a_name_it_lists_the_benches():
    proc = bench()
    assert proc.returncode == 2 and "study_mini, study_mini_long" in proc.stdout
    assert "_report" not in proc.stdout and "common" not in proc.stdout.split("NAME:")[-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "no bench 'nope'"),
        (["study-mini", "--smoke"], "study_mini: --smoke needs an OUT folder"),
        (["adaptive_depth", "--smoke"], "adaptive_depth: --smoke needs an OUT folder"),
        (["metrics_log", "--out", "x"], "writes no folder: no --out"),
    ],
)
def test_it_refuses_before_any_work(args, message):
    proc = bench(*args)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
