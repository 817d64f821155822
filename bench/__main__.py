"""`python -m bench NAME [--smoke] [--out DIR] [OPTIONS]`: one bench, NAME its module here
(a hyphen for an underscore is fine), OPTIONS its own (`python -m bench NAME --help`).

--smoke runs a bench at its toy size (the tests' runs); a smoke run of a bench that writes
docs/ needs --out, so that it never writes there. --out is the folder a bench writes; benches
that print their figures take none."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

from bench import common

NAMES = sorted(
    p.stem
    for p in Path(__file__).parent.glob("*.py")
    if not p.stem.startswith("_") and not p.stem.endswith("_report")
)
"""Every bench: a module here (NAME_report.py is a bench's report, not a bench)."""

RUNNER = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
RUNNER.add_argument("--smoke", action="store_true")
RUNNER.add_argument("--out", type=Path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\nNAME: " + ", ".join(NAMES))
        return 0 if argv else 2
    name = argv[0].replace("-", "_")
    if name not in NAMES:
        sys.exit(f"python -m bench: no bench {argv[0]!r} (benches: {', '.join(NAMES)})")
    given, rest = RUNNER.parse_known_args(argv[1:])
    common.SMOKE = given.smoke  # before the import: a bench's sizes are read at import
    run = importlib.import_module(f"bench.{name}").main
    sys.argv[0] = f"python -m bench {name}"  # the bench's usage line names the command
    if "out" in inspect.signature(run).parameters:
        return run(rest, out=given.out) or 0
    if given.out is not None:
        sys.exit(f"python -m bench {name}: it prints its figures and writes no folder: no --out")
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
