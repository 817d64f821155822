"""The benches' reports: the numbers' formats (`fmt`, `spread`, `stats`, `span`), markdown
tables, the JSON they keep (`write_json`) and the command line of a bench that writes docs/
(`command`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import common


def command(
    bench: str,
    argv: list[str],
    out: Path | None,
    rewrite: tuple[Callable[[dict, Path], None], ...] = (),
    docs: str | None = None,
    make: bool = True,
) -> Path:
    """The command line of a bench that writes docs/`docs` (default docs/BENCH): OUT, made
    unless `make` is false, for a run. With `rewrite`, `--report` instead calls each of them on
    OUT/BENCH.json and OUT, rewriting the report and figures from the JSON alone, and ends the
    process there (nothing is trained or measured). A smoke run must be given OUT: it never
    writes docs/."""
    p = argparse.ArgumentParser(description=f"python -m bench {bench} [--smoke] [--out DIR]")
    if rewrite:
        p.add_argument("--report", action="store_true", help="rewrite the report from its JSON")
    report = p.parse_args(argv).__dict__.get("report", False)
    if common.SMOKE and out is None and not report:
        sys.exit(f"{bench}: --smoke needs an OUT folder (--out; it never writes docs/)")
    out = out or common.ROOT / "docs" / (docs or bench)
    if report:
        info = json.loads((out / f"{bench}.json").read_text())
        for write in rewrite:
            write(info, out)
        print(f"{bench}: report and figures rewritten from {out / f'{bench}.json'}")
        raise SystemExit(0)
    if make:
        out.mkdir(parents=True, exist_ok=True)
    return out


def table(header: list[str], rows: list[list[str]] | None = None) -> list[str]:
    """A markdown table's lines: the header, its rule, a line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows or []]


def fmt(x: float | None, digits: int = 3) -> str:
    """A figure to `digits` significant digits, in e-notation past 1e4 or under 1e-2."""
    if x is None:
        return "–"
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-2):
        return f"{x:.2e}"
    return f"{x:,.{digits}g}" if abs(x) >= 1 else f"{x:.{digits}g}"


def spread(s: dict) -> str:
    """`stats` as mean ± std [min, max]."""
    return f"{fmt(s['mean'])} ± {fmt(s['std'])} [{fmt(s['min'])}, {fmt(s['max'])}]"


def span(values: list[float]) -> str:
    """min..max, to a tenth: the per-process medians of a timing."""
    return f"{min(values):.1f}..{max(values):.1f}"


def stats(values: list[float]) -> dict:
    """Mean, std (over seeds: ddof 1), min and max."""
    v = np.asarray(values, dtype=float)
    return {
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
        "min": float(v.min()),
        "max": float(v.max()),
    }


def write_json(path: Path, info: dict) -> None:
    """`info` as JSON, floats to 6 significant digits and lists of numbers on one line: the
    per-step trajectories stay diffable without a line per number."""

    def rounded(o):
        if isinstance(o, float):
            return float(f"{o:.6g}")
        if isinstance(o, dict):
            return {k: rounded(v) for k, v in o.items()}
        if isinstance(o, list):
            return [rounded(v) for v in o]
        return o

    def dumps(o, depth: int = 0) -> str:
        pad, end = " " * (depth + 1), "\n" + " " * depth
        if isinstance(o, dict) and o:
            items = (f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in o.items())
            return "{\n" + ",\n".join(items) + end + "}"
        if isinstance(o, list) and any(isinstance(v, (dict, list)) for v in o):
            return "[\n" + ",\n".join(pad + dumps(v, depth + 1) for v in o) + end + "]"
        return json.dumps(o)

    path.write_text(dumps(rounded(info)) + "\n")
