"""The test suite's own rules: test files share helpers through support.py (and multiproc.py),
never by importing another test file, and never by defining support's names again; and
tests/unit mirrors the packages, each module's tests in one place (MODULE_EXEMPTIONS and
NOT_MIRRORS below list, with reasons, where it does not)."""

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


# -- where a module's tests are ------------------------------------------------------------------
# tests/unit mirrors the packages: megaloop/<sub>/<module>.py is tested in
# tests/unit/<sub>/test_<module>.py, megaloop/<module>.py in tests/unit/test_<module>.py and
# data_prep/<module>.py in tests/unit/data_prep/test_<module>.py (a package's __init__.py:
# test_<package>.py in its folder; a leading underscore dropped). Where that basename is taken
# (every test module's basename is unique), the folder's name comes first:
# tests/unit/model/test_model_config.py. tests/multiprocess/ and tests/cluster/ are tiers (how a
# test runs, marked in tests/conftest.py), not mirrors, and are not checked here; nor are the
# bench tests (bench/ is no package of megaloop's: tests/unit/bench/ and BENCH_TESTS).

UNIT = TESTS / "unit"
PACKAGES = ("megaloop", "data_prep")

# The bench tests (bench/'s scripts), by basename: in tests/unit/ or, moved, in tests/unit/bench/.
BENCH_TESTS = {
    "test_adaptive_depth_bench.py",
    "test_at_size_growth.py",
    "test_bench_scripts.py",
    "test_bench_workers.py",
    "test_mini_long_checkpoints.py",
    "test_verdicts.py",
}

# Test files that mirror no module: each is about a concern that crosses modules.
NOT_MIRRORS = {
    "tests/unit/test_docs_examples.py": "output docs/ shows is what the command prints today",
    "tests/unit/test_docs_index.py": "docs/: the index, links and anchors, no build machine paths",
    "tests/unit/test_fuzz.py": "fuzzed configs, overrides and data files, against every reader",
    "tests/unit/test_mutants.py": "tests/mutants/'s patches apply and name tests that exist",
    "tests/unit/test_pipes.py": "every read-only command in a shell pipeline; config-only "
    "commands import no training stack",
    "tests/unit/test_release.py": "the release files agree with the package",
    "tests/unit/test_slurm_submit.py": "`megaloop slurm submit` end to end (megaloop/slurm.py "
    "and commands/slurm.py; test_slurm.py is tests/cluster's)",
    "tests/unit/test_study_reference.py": "parity with the study's released model "
    "(tests/study_reference.py): model, objectives and the study configs together",
    "tests/unit/test_suite_rules.py": "the test suite's own rules",
    "tests/unit/test_untrusted.py": "untrusted checkpoints, exports, data shards and job "
    "scripts, across every loader",
}

# Modules without a test module of their own: where they are tested, or why they need none.
MODULE_EXEMPTIONS = {
    "data_prep/common.py": "shared by the recipes: tests/unit/data_prep/test_wikitext103.py "
    "and test_data_prep.py",
    "data_prep/config.py": "the recipes' configs: tests/unit/data_prep/test_data_prep.py "
    "(flags build the dataclass) and test_fuzz.py",
    "data_prep/fineweb.py": "tests/unit/data_prep/test_data_prep.py (the web recipe)",
    "megaloop/__init__.py": "empty",
    "megaloop/__main__.py": "calls cli.main: tests/unit/test_cli.py",
    "megaloop/commands/__init__.py": "the command table: tests/unit/test_cli.py",
    "megaloop/commands/bench.py": "tests/unit/evaluation/test_generate_bench.py (bench "
    "generate) and tests/unit/test_cli.py",
    "megaloop/commands/ckpt.py": "tests/unit/test_cli.py and test_untrusted.py",
    "megaloop/commands/configs.py": "tests/unit/test_cli.py",
    "megaloop/commands/demo.py": "tests/unit/test_demo.py and test_cli.py",
    "megaloop/commands/depth.py": "tests/unit/evaluation/test_depth.py and tests/unit/test_cli.py",
    "megaloop/commands/diagnose.py": "tests/unit/evaluation/test_depth.py and "
    "tests/unit/test_cli.py",
    "megaloop/commands/eval_.py": "tests/unit/evaluation/test_downstream.py, test_compare.py "
    "and tests/unit/test_cli.py",
    "megaloop/commands/export.py": "tests/unit/test_export.py",
    "megaloop/commands/halt.py": "tests/unit/evaluation/test_depth.py and tests/unit/test_cli.py",
    "megaloop/commands/import_.py": "tests/unit/test_ouro.py (imports a generated Ouro folder)",
    "megaloop/commands/options.py": "the commands' shared options: tests/unit/test_cli.py",
    "megaloop/commands/plan.py": "tests/unit/parallel/test_planner.py",
    "megaloop/commands/prep.py": "tests/unit/data_prep/test_data_prep.py",
    "megaloop/commands/report.py": "tests/unit/evaluation/test_depth.py and tests/unit/test_cli.py",
    "megaloop/commands/slurm.py": "tests/unit/test_slurm_submit.py",
    "megaloop/commands/sweep.py": "tests/unit/test_sweep.py",
    "megaloop/commands/train.py": "tests/unit/train/test_trainer.py and tests/unit/test_cli.py",
    "megaloop/data/batches.py": "tests/unit/data/test_indexed.py and test_data.py",
    "megaloop/data/shards.py": "tests/unit/data_prep/test_data_prep.py (on prepared shards) "
    "and tests/unit/data/test_data.py",
    "megaloop/data/synthetic.py": "tests/unit/data/test_data.py and tests/unit/test_demo.py",
    "megaloop/data/text.py": "tests/unit/data/test_data.py",
    "megaloop/data/tokenizer.py": "tests/unit/data_prep/test_wikitext103.py, test_data_prep.py "
    "and tests/unit/test_fuzz.py",
    "megaloop/evaluation/__init__.py": "ppl_text: tests/unit/evaluation/test_report.py",
    "megaloop/evaluation/adaptive_downstream.py": "tests/unit/evaluation/test_downstream.py "
    "(it shares that file's task data)",
    "megaloop/evaluation/diagnostics.py": "tests/unit/evaluation/test_depth.py (on its trained "
    "models) and tests/unit/test_ouro.py",
    "megaloop/evaluation/exported.py": "tests/unit/commands/test_generate.py, "
    "tests/unit/evaluation/test_downstream.py and tests/unit/test_untrusted.py",
    "megaloop/evaluation/settings.py": "each command's settings: tests/unit/test_cli.py and "
    "the evaluation tests",
    "megaloop/experiment.py": "tests/unit/test_config.py and every test that loads a config",
    "megaloop/known_warnings.py": "installed by tests/conftest.py for every test; "
    "tests/multiprocess/test_long_runs.py",
    "megaloop/model/__init__.py": "re-exports (build_model, ModelConfig)",
    "megaloop/model/config.py": "tests/unit/test_config.py, tests/unit/model/test_readout.py "
    "and tests/unit/test_export.py (every field)",
    "megaloop/model/configuration_megaloop.py": "tests/unit/test_export.py and "
    "tests/unit/model/test_readout.py",
    "megaloop/model/init.py": "tests/unit/model/test_looped.py",
    "megaloop/model/modeling_megaloop.py": "tests/unit/test_export.py (the exported model)",
    "megaloop/model/specs.py": "tests/unit/model/test_looped.py and test_structure.py",
    "megaloop/objectives/__init__.py": "ObjectiveConfig: tests/unit/objectives/test_losses.py",
    "megaloop/parallel/__init__.py": "empty",
    "megaloop/parallel/cost.py": "tests/unit/parallel/test_planner.py and "
    "tests/unit/commands/test_params.py",
    "megaloop/parallel/deepspeed.py": "tests/unit/parallel/test_engines.py and "
    "tests/multiprocess/test_deepspeed.py",
    "megaloop/parallel/distributed.py": "the one-process world of tests/conftest.py; "
    "tests/multiprocess/",
    "megaloop/parallel/engine.py": "tests/unit/parallel/test_engines.py",
    "megaloop/parallel/launch.py": "tests/multiprocess/ and tests/cluster/ (it launches ranks)",
    "megaloop/parallel/layout.py": "tests/unit/data/test_data.py (eval batches) and "
    "tests/multiprocess/test_parallel.py",
    "megaloop/parallel/megatron.py": "tests/unit/parallel/test_engines.py and "
    "tests/multiprocess/test_parallel.py",
    "megaloop/parallel/pipeline.py": "tests/multiprocess/test_parallel.py (PP needs ranks)",
    "megaloop/parallel/versions.py": "tests/unit/test_cpu_compat.py",
    "megaloop/safe_load.py": "tests/unit/test_untrusted.py",
    "megaloop/slurm.py": "tests/unit/test_slurm_submit.py and tests/cluster/test_slurm.py",
    "megaloop/train/__init__.py": "empty",
    "megaloop/train/config.py": "tests/unit/test_config.py and tests/unit/data/test_data.py",
    "megaloop/train/preemption.py": "tests/unit/train/test_checkpoint.py and test_callbacks.py",
    "megaloop/train/start.py": "tests/unit/train/test_trainer.py and tests/unit/test_ouro.py "
    "(train.init_from)",
}


def modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def mirrors(module: str) -> list[str]:
    """The test modules that would mirror `module`, its own basename first."""
    package, *folders, name = module.removesuffix(".py").split("/")
    folder = ["data_prep"] if package == "data_prep" else folders
    if name == "__init__":
        name = (folders or [package])[-1]
    name = name.lstrip("_")
    base = "/".join(["tests/unit", *folder])
    return [f"{base}/test_{name}.py", f"{base}/test_{(folders or [package])[-1]}_{name}.py"]


def unit_test_files() -> list[str]:
    files = (p for p in UNIT.rglob("test_*.py") if p.name not in BENCH_TESTS)
    return sorted(str(p.relative_to(ROOT)) for p in files if not p.is_relative_to(UNIT / "bench"))


def test_every_module_has_a_test_module_or_an_exemption():
    mirrored = {m for m in modules() if any((ROOT / t).is_file() for t in mirrors(m))}
    assert len(modules()) > 80 and len(mirrored) > 40
    missing = [
        f"{m}: add {mirrors(m)[0]} or an entry in MODULE_EXEMPTIONS"
        for m in modules()
        if m not in mirrored and m not in MODULE_EXEMPTIONS
    ]
    assert missing == [], "tests/unit mirrors the package (this file's MODULE_EXEMPTIONS)"
    both = [m for m in MODULE_EXEMPTIONS if m in mirrored]
    assert both == [], "these have a test module now: drop their exemption"


def test_every_exemption_names_a_file_that_exists():
    gone = [name for name in [*MODULE_EXEMPTIONS, *NOT_MIRRORS] if not (ROOT / name).is_file()]
    gone += [name for name in BENCH_TESTS if not any(UNIT.rglob(name))]
    assert gone == [], "exempted but gone (renamed or removed): update this file"


def test_every_unit_test_file_mirrors_a_module_or_says_why():
    mirror_files = {t for m in modules() for t in mirrors(m)}
    stray = [f for f in unit_test_files() if f not in mirror_files and f not in NOT_MIRRORS]
    assert stray == [], "name it test_<module>.py beside its module's mirror, or add to NOT_MIRRORS"
    both = [f for f in NOT_MIRRORS if f in mirror_files]
    assert both == [], "these mirror a module: drop them from NOT_MIRRORS"


def test_test_module_basenames_are_unique():
    """pytest imports a test file by its basename (rootdir import mode, no __init__.py in
    tests/): two test_config.py in two folders would collide."""
    names = sorted(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n in set(names) if names.count(n) > 1] == []
