"""bench/ stays a package that reads: no module past 600 lines, no function past 80 (as in
megaloop/), and no bench that edits sys.path to reach another (they share bench/common/)."""

import ast

import pytest

from support import ROOT

MODULES = sorted((ROOT / "bench").rglob("*.py"))


def long_functions(source: str, limit: int = 80) -> list[str]:
    """`name:line (n lines)` of each function or method of SOURCE longer than `limit` lines."""
    return [
        f"{node.name}:{node.lineno} ({length} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := node.end_lineno - node.lineno + 1) > limit
    ]


def test_the_rules_see_every_bench_module():
    names = {p.relative_to(ROOT / "bench").as_posix() for p in MODULES}
    assert {"__main__.py", "study_mini.py", "common/workers.py", "common/report.py"} <= names


def test_no_bench_module_runs_past_600_lines():
    lines = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in MODULES}
    assert not {path: n for path, n in lines.items() if n > 600}


def test_no_bench_function_runs_past_80_lines():
    long = {p.relative_to(ROOT).as_posix(): long_functions(p.read_text()) for p in MODULES}
    assert not {path: found for path, found in long.items() if found}


def test_no_bench_edits_sys_path():
    assert not [p.relative_to(ROOT).as_posix() for p in MODULES if "sys.path" in p.read_text()]


@pytest.mark.parametrize("lines", [80, 81])
def test_a_function_past_80_lines_is_caught(lines):
    """The check itself: a function of 81 lines is named, one of 80 is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    found = long_functions(f"def long():\n{body}")
    assert found == (["long:1 (81 lines)"] if lines > 80 else [])
