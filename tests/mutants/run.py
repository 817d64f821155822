"""Break the code on purpose and see whether the tests that claim each behaviour notice.

    .venv/bin/python tests/mutants/run.py [NAME ...]   every mutant, or those named; exit 1 if any
                                                       is missed, stale or broken

Each `tests/mutants/NAME.patch` is one small break: a header of `behaviour:`, `tests:` (pytest
node ids, space-separated, may repeat) and optionally `tier: multiprocess` lines, then a diff
against the tree (`git diff` of the break applied by hand). The repository's files (tracked and
untracked, uncommitted changes included) are copied once to a scratch folder; each mutant's patch
is applied there, its tests run in the in-process tier (`make test-fast`'s markers, unless its
tier says otherwise) with PYTHONPATH on the copy so child processes import the broken code too,
and the patch is reversed. Caught: a test failed. Missed: they all passed. Stale: the patch no
longer applies (the code moved: write the break again). Not part of CI; docs/testing.md keeps the
last result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
IN_PROCESS = "not multiprocess and not slurm"


@dataclass
class Mutant:
    name: str
    behaviour: str
    tests: list[str]
    tier: str
    patch: Path

    @classmethod
    def read(cls, patch: Path) -> Mutant:
        fields: dict[str, list[str]] = {"behaviour": [], "tests": [], "tier": []}
        for line in patch.read_text().splitlines():
            if line.startswith(("diff --git", "--- ")):
                break
            key, _, value = line.partition(":")
            if key in fields:
                fields[key].append(value.strip())
        if not fields["tests"]:
            sys.exit(f"{patch}: no `tests:` line before the diff; name the tests that claim it")
        return cls(
            patch.stem,
            " ".join(fields["behaviour"]),
            [t for line in fields["tests"] for t in line.split()],
            (fields["tier"] or ["in-process"])[0],
            patch,
        )


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored), into `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():  # deleted, not yet committed
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)


def git_apply(tree: Path, patch: Path, *flags: str) -> bool:
    done = subprocess.run(["git", "apply", *flags, str(patch)], cwd=tree, capture_output=True)
    return done.returncode == 0


def run_tests(tree: Path, mutant: Mutant) -> tuple[str, str]:
    """(verdict, the first failing test's line): pytest's exit code 1 is a caught mutant."""
    marker = [] if mutant.tier == "multiprocess" else ["-m", IN_PROCESS]
    env = {
        **os.environ,
        "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'tests'}",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *marker]
    done = subprocess.run([*cmd, *mutant.tests], cwd=tree, env=env, capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines() or [""]
    if done.returncode in (0, 1):
        failed = next((ln for ln in lines if ln.startswith("FAILED")), "")
        return ("missed", "") if done.returncode == 0 else ("caught", failed)
    return f"error (pytest exit {done.returncode})", lines[-1]


def main(names: list[str]) -> int:
    mutants = [Mutant.read(p) for p in sorted(HERE.glob("*.patch"))]
    unknown = set(names) - {m.name for m in mutants}
    if unknown:
        sys.exit(f"no such mutant: {', '.join(sorted(unknown))} (see {HERE}/*.patch)")
    mutants = [m for m in mutants if not names or m.name in names]
    results = []
    with tempfile.TemporaryDirectory(prefix="megaloop-mutants-") as scratch:
        tree = Path(scratch)
        copy_tree(tree)
        for m in mutants:
            start = time.time()
            if not git_apply(tree, m.patch, "--check"):
                verdict, detail = "stale", "the patch does not apply"
            else:
                git_apply(tree, m.patch)
                try:
                    verdict, detail = run_tests(tree, m)
                finally:
                    if not git_apply(tree, m.patch, "-R"):
                        sys.exit(f"{m.name}: the patch did not reverse; the scratch copy is broken")
            results.append((m, verdict, detail))
            print(f"{m.name:32} {verdict:8} {time.time() - start:5.0f} s  {detail}", flush=True)
    caught = sum(v == "caught" for _, v, _ in results)
    print(f"\n{caught} of {len(results)} mutants caught")
    for m, verdict, _ in results:
        if verdict != "caught":
            print(f"  {verdict}: {m.name}: {m.behaviour} (tests: {' '.join(m.tests)})")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
