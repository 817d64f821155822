"""The test suite's own rules: test files share helpers through support.py (and multiproc.py),
never by importing another test file, and never by defining support's names again."""

import ast

from support import ROOT

TESTS = ROOT / "tests"


def suite_files() -> list:
    return sorted(TESTS.rglob("test_*.py"))


def defined_names(path) -> set[str]:
    """The functions, classes and variables a module defines at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def imported_modules(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return names


def test_no_test_file_imports_another():
    offending = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in suite_files()
        for name in imported_modules(ast.parse(path.read_text()))
        if name.startswith("test_")
    ]
    assert len(suite_files()) > 30
    assert offending == [], "move what they share into tests/support.py"


def test_supports_names_are_defined_only_there():
    shared = defined_names(TESTS / "support.py")
    offending = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in [*suite_files(), TESTS / "multiproc.py", TESTS / "conftest.py"]
        for name in sorted(defined_names(path) & shared)
    ]
    assert {"ROOT", "TINY", "megaloop", "miniature_source"} <= shared
    assert offending == [], "import these from tests/support.py instead"
