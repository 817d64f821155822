"""The alternating-process benchmarks run end to end at tiny shapes and print finite figures and
a ratio (their timings are not checked: they depend on the machine and its load)."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess

NUMBER = r"([-+]?\d[\d,]*\.?\d*(?:e[-+]?\d+)?)"


def run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", "--smoke", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def ratio(out: str, label: str) -> float:
    match = re.search(re.escape(label) + r": " + NUMBER + "x", out)
    assert match, out
    value = float(match.group(1))
    assert math.isfinite(value) and value > 0
    return value


def table_numbers(out: str) -> list[float]:
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [c for row in rows[1:] for c in row.strip("|").split("|")]
    numbers = [float(m.replace(",", "")) for c in cells for m in re.findall(NUMBER, c)]
    assert numbers and all(math.isfinite(n) for n in numbers), out
    return numbers


def test_overhead_smoke():
    out = run("overhead.py")
    assert "| megaloop |" in out and "| plain PyTorch |" in out
    table_numbers(out)
    ratio(out, "megaloop / plain PyTorch")
    ratio(out, "in CPU time")
    ours, ref = re.search(r"parameters " + NUMBER + " = " + NUMBER, out).groups()
    assert ours == ref


def test_norm_penalty_smoke():
    out = run("norm_penalty.py")
    assert "| 0 (off) |" in out
    table_numbers(out)
    ratio(out, "on / off")
    ratio(out, "CPU time on / off")
    assert "resolvable" in out


def test_bf16_smoke():
    out = run("bf16.py")
    numbers = table_numbers(out)
    assert len(numbers) == 3 * 5  # step, fp32, bf16, Δ, Δ/fp32 for each of 3 steps
    ratio(out, "bf16 / fp32")
    assert re.search(r": (PASS|FAIL)", out)
