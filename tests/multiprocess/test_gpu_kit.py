"""bench/gpu.sh, the one call on a lent GPU, run here on the CPU: the --smoke flow end to end (its
figures, not only its exit status), a step past its time limit (recorded, the next step still
runs) and a missing import (named before any benchmark starts). gpu.sh launches torchrun."""

import json
import math
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from support import ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.one_at_a_time]  # torchrun of one rank

STEPS = ["preempt_resume", "recompute_memory", "mfu_129m", "mfu_1p4b", "fixed_k"]


def gpu_sh(out: Path, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """bash bench/gpu.sh --smoke OUT with this interpreter and, unless given, no wheels."""
    env = {
        **os.environ,
        "PY": sys.executable,
        "WHEELS": str(tmp_path / "no-wheels"),
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
        **env,
    }
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh"), "--smoke", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def statuses(out: Path) -> dict:
    lines = (out / "steps.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["step", "status", "rc", "seconds", "limit_s"]
    return {row[0]: row[1:] for row in (line.split("\t") for line in lines[1:])}


def table(text: str) -> list[list[str]]:
    """The data rows of the Markdown table in `text` (header and rule dropped)."""
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row] for row in rows[2:]]


def number(cell: str) -> float:
    value = float(cell.replace(",", "").rstrip("x%"))
    assert math.isfinite(value), cell
    return value


def test_smoke_run_writes_sane_figures(tmp_path):
    out = tmp_path / "out"
    run = gpu_sh(out, tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.rstrip().endswith(f"all steps passed; figures in {out}")
    status = statuses(out)
    assert list(status) == ["install", "kit", *STEPS]
    assert status["install"][0] == "skipped"
    assert "install skipped" in (out / "kit.md").read_text()
    for step in ["kit", *STEPS]:
        state, rc, seconds, limit = status[step]
        assert (state, rc) == ("ok", "0"), (step, (out / f"{step}.md").read_text()[-2000:])
        assert 0 <= int(seconds) <= int(limit)
    assert not list(tmp_path.glob("megaloop-gpu.*")), "the scratch folder was not removed"
    # what a device call returns: at most 8 files
    files = ["steps.tsv", "kit.md", *(f"{s}.md" for s in STEPS), "fixed_k.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(files)

    kit = (out / "kit.md").read_text()
    assert re.search(r"^torch 2\.\d+\.\d+.*cuda available: False$", kit, re.M), kit
    assert "megatron-core 0.16.1" in kit
    assert "all_reduce over 1 rank(s), gloo: ok" in kit

    preempt = (out / "preempt_resume.md").read_text()
    assert "SIGUSR1 at step 3, resumed" in preempt and preempt.rstrip().endswith("PASS")
    rows = table(preempt)
    assert [int(r[0]) for r in rows] == list(range(1, 7))
    for _, uninterrupted, resumed, rel in rows:
        assert 0 < number(uninterrupted) < 20 and number(rel) <= 1e-5
        assert abs(number(uninterrupted) - number(resumed)) <= 1e-5 * number(uninterrupted)

    rows = table((out / "recompute_memory.md").read_text())
    assert [r[0] for r in rows] == ["1", "2"]
    for row in rows:  # "kept MiB (ratio to none) / planned MiB" for none, selective, full, loop
        kept = [re.fullmatch(r"([\d.]+) \(([\d.]+)x\) / ([\d.]+)", c).groups() for c in row[1:]]
        assert number(kept[0][1]) == 1.0
        assert all(0 < number(k[0]) < 100 and 0 < number(k[2]) < 100 for k in kept)
        assert number(kept[2][0]) < number(kept[0][0])  # full keeps less than none

    for step in ("mfu_129m", "mfu_1p4b"):
        text = (out / f"{step}.md").read_text()
        assert "on CPU, 64 tokens a step, median of 2 steps after 1 warm-up" in text
        rows = table(text)
        assert [r[0] for r in rows] == ["4", "1"]
        for _k, step_s, tokens_s, tflops, mfu, mem, vs_k1 in rows:
            assert 0 < number(step_s) < 600 and number(tokens_s) > 0 and number(tflops) > 0
            assert mfu == "n/a" and number(mem) == 0  # no GPU: no peak, no memory figure
            assert number(vs_k1) > 0
        assert rows[1][6] == "1.00x"

    fixed_k = json.loads((out / "fixed_k.json").read_text())
    assert (fixed_k["device"], fixed_k["batch_size"], fixed_k["seq_len"]) == ("cpu", 1, 32)
    assert [r["loops"] for r in fixed_k["rows"]] == [1, 2, 3, 4]
    for row in fixed_k["rows"]:
        assert 0 < row["tokens_per_s"] < 1e9 and 0 < row["median_batch_s"] < 600
        # an untrained model on random tokens of a 49,152-token vocabulary: CE near ln(49152)
        assert abs(row["ce"] - math.log(49152)) < 1.0
    assert [r[0] for r in table((out / "fixed_k.md").read_text())] == ["1", "2", "3", "4"]


def test_a_step_past_its_limit_is_recorded_and_the_next_runs(tmp_path):
    out = tmp_path / "out"
    run = gpu_sh(
        out,
        tmp_path,
        STEPS="preempt_resume recompute_memory",
        GPU_TEST_STALL="preempt_resume",  # sleeps an hour before it starts
        LIMIT_preempt_resume="1",
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    status = statuses(out)
    assert list(status) == ["install", "kit", "preempt_resume", "recompute_memory"]
    assert status["preempt_resume"][:2] == ["timeout", "124"]
    assert status["preempt_resume"][3] == "1"
    assert status["recompute_memory"][:2] == ["ok", "0"]
    assert "preempt_resume timeout (rc 124)" in (out / "preempt_resume.md").read_text()
    assert len(table((out / "recompute_memory.md").read_text())) == 2
    assert "FAILED: preempt_resume (the rest passed" in run.stdout


def wheel(folder: Path, name: str, files: dict) -> Path:
    """A pure-Python wheel by hand (no build backend, no index)."""
    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_a_missing_import_is_named_before_any_benchmark(tmp_path):
    """A wheel whose empty `megatron` package shadows megatron-core: the install step puts it
    first on the path, and the kit check names megatron.core as missing."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "shadow_megatron", {"megatron/__init__.py": ""})
    (wheels / "MANIFEST.txt").write_text("# a test manifest\n")
    out = tmp_path / "out"
    run = gpu_sh(out, tmp_path, WHEELS=str(wheels))
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    status = statuses(out)
    assert status["install"][:2] == ["ok", "0"]
    kit = (out / "kit.md").read_text()
    assert "installed 1 wheels" in kit and "# a test manifest" in kit
    assert status["kit"][0] == "failed"
    assert "missing: megatron.core (ModuleNotFoundError" in kit
    assert all(status[s][0] == "skipped" for s in STEPS)
    assert "FAILED before any benchmark: kit" in run.stdout
