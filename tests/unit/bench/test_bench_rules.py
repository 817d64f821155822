"""bench/ stays a package that reads: no module past 600 lines, no function past 80 (as in
megaloop/), no sys.path edits, and no bench that imports another: what two share is in
bench/common/, which imports no bench (a bench's report module, NAME_report.py, is its own)."""

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


def bench_imports(path) -> set[str]:
    """X of each `bench.X` that PATH imports (`import bench.X`, `from bench import X`,
    `from bench.X import ...`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "bench":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
    return found


def test_a_bench_imports_only_bench_common_and_its_own_report():
    benches = {p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("__")}
    wrong = {}
    for path in MODULES:
        name = path.stem.removesuffix("_report")
        own = set() if path.parent.name == "common" else {name, f"{name}_report"}
        others = (bench_imports(path) & benches) - own
        if others and path.name != "__main__.py":
            wrong[path.relative_to(ROOT).as_posix()] = sorted(others)
    assert not wrong


def test_no_bench_edits_sys_path():
    assert not [p.relative_to(ROOT).as_posix() for p in MODULES if "sys.path" in p.read_text()]


@pytest.mark.parametrize("lines", [80, 81])
def test_a_function_past_80_lines_is_caught(lines):
    """The check itself: a function of 81 lines is named, one of 80 is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    found = long_functions(f"def long():\n{body}")
    assert found == (["long:1 (81 lines)"] if lines > 80 else [])
