"""bench/gpu_wheels.sh without the network: the script, copied into a throwaway git repository
with the real requirements.txt and .gitignore, runs against a fake `pip` (its PIP variable) that
records what it is asked for and writes fake wheels. Checked: the pinned binary wheel it asks
for and where, the stale wheels it clears, the manifest (each wheel's size and sha256, the total
with the working tree that travels beside it), and each refusal with its exit code."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from support import ROOT

PIN = next(
    line
    for line in (ROOT / "requirements.txt").read_text().splitlines()
    if line.startswith("megatron-core==")
)
WHEEL = f"megatron_core-{PIN.split('==')[1]}-py3-none-any.whl"
MIB = 1048576

FAKE_PIP = """#!{python}
# `pip download` as gpu_wheels.sh calls it: records its arguments and working directory, then
# writes FAKE_PIP_WHEELS versions of each NAME==VERSION asked for (FAKE_PIP_BYTES each) into -d.
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps({{"args": args, "cwd": os.getcwd()}}) + "\\n")
dest = args[args.index("-d") + 1]
for spec in (a for a in args if "==" in a):
    name, version = spec.split("==")
    for n in range(int(os.environ.get("FAKE_PIP_WHEELS", "1"))):
        suffix = f".post{{n}}" if n else ""
        wheel = f"{{dest}}/{{name.replace('-', '_')}}-{{version}}{{suffix}}-py3-none-any.whl"
        with open(wheel, "wb") as f:
            size = int(os.environ.get("FAKE_PIP_BYTES", "1000"))
            f.write((bytes(range(256)) * (size // 256 + 1))[:size])
sys.exit(int(os.environ.get("FAKE_PIP_EXIT", "0")))
"""


@pytest.fixture
def repo(tmp_path):
    """A git repository holding the script, requirements.txt and .gitignore (tracked or not:
    both travel), a tracked file deleted since (skipped) and an ignored one (does not travel)."""
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench/gpu_wheels.sh", repo / "bench")
    shutil.copy(ROOT / "requirements.txt", repo)
    shutil.copy(ROOT / ".gitignore", repo)
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "gone.txt").write_text("deleted from the working tree\n")
    subprocess.run([*git, "add", "gone.txt", "requirements.txt"], check=True)
    (repo / "gone.txt").unlink()
    (repo / "runs").mkdir()
    (repo / "runs/ignored.bin").write_bytes(b"\0" * 50_000)
    pip = tmp_path / "pip"
    pip.write_text(FAKE_PIP.format(python=sys.executable))
    pip.chmod(0o755)
    return repo


def tree_bytes(repo) -> int:
    """What travels besides the wheels: the repository's files, neither ignored nor deleted."""
    return sum(
        (repo / f).stat().st_size for f in ("bench/gpu_wheels.sh", "requirements.txt", ".gitignore")
    )


def gpu_wheels(repo, *args, **env):
    """bash bench/gpu_wheels.sh ARGS run from elsewhere with the fake pip: the process and the
    pip calls it made."""
    log = repo.parent / "pip.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "LIMIT_MIB"} | {
        "PIP": str(repo.parent / "pip"),
        "FAKE_PIP_LOG": str(log),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(repo / "bench/gpu_wheels.sh"), *args],
        cwd=repo.parent,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def test_gpu_wheels_downloads_the_pinned_wheel_and_writes_its_manifest(repo):
    dest = repo / ".whl"
    dest.mkdir()
    (dest / "megatron_core-0.1.0-py3-none-any.whl").write_bytes(b"stale")
    (dest / "MANIFEST.txt").write_text("stale\n")
    (dest / "notes.txt").write_text("not a wheel: kept\n")
    proc, calls = gpu_wheels(repo, "--python-version", "3.11", FAKE_PIP_BYTES="4096")
    assert proc.returncode == 0, proc.stderr

    # one download, from the repository root, of the pinned megatron-core alone, binary only
    [call] = calls
    args = call["args"]
    assert call["cwd"] == str(repo) and args[0] == "download"
    assert [a for a in args if "==" in a] == [PIN]
    assert {"--no-deps", "--only-binary=:all:"} <= set(args)
    assert args[args.index("--python-version") + 1] == "3.11"
    assert args[args.index("--implementation") + 1] == "cp"
    assert args[args.index("-d") + 1] == ".whl"  # the default --dest, in the repository
    platforms = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert "manylinux_2_17_x86_64" in platforms and "manylinux2014_x86_64" in platforms
    assert all(re.fullmatch(r"manylinux(_2_\d+_|2014_|1_)x86_64", p) for p in platforms), platforms

    # the stale wheel is gone (two versions would stop gpu.sh's install), other files stay
    assert sorted(p.name for p in dest.iterdir()) == sorted([WHEEL, "MANIFEST.txt", "notes.txt"])
    wheel = (dest / WHEEL).read_bytes()
    manifest = (dest / "MANIFEST.txt").read_text().splitlines()
    assert manifest[0].startswith("# bench/gpu_wheels.sh --python-version 3.11, ")
    assert manifest[0].endswith(f": {PIN}")
    assert manifest[2] == f"{WHEEL}  {len(wheel)}  {hashlib.sha256(wheel).hexdigest()}"
    total = len(wheel) + tree_bytes(repo)
    assert manifest[3] == (
        f"# total: {len(wheel)} bytes of wheels; with the working tree ({tree_bytes(repo)} "
        f"bytes): {total} of {64 * MIB}"
    )
    assert proc.stdout.splitlines()[-1] == (
        "gpu_wheels: 1 wheel(s) for Python 3.11 in .whl; name .whl in the call's carry"
    )


def test_gpu_wheels_limit_counts_the_wheels_and_the_working_tree(repo, tmp_path):
    """LIMIT_MIB is on what travels in all: a total of exactly the limit passes, a byte more is
    refused (exit 1), the manifest written either way."""
    dest = tmp_path / "wheels"
    room = MIB - tree_bytes(repo)
    for size, code in ((room, 0), (room + 1, 1)):
        proc, _ = gpu_wheels(repo, "--dest", str(dest), LIMIT_MIB="1", FAKE_PIP_BYTES=str(size))
        wheel = (dest / WHEEL).stat().st_size
        assert proc.returncode == code, (wheel, tree_bytes(repo), proc.stderr)
        assert f"): {wheel + tree_bytes(repo)} of {MIB}" in (dest / "MANIFEST.txt").read_text()
        assert ("OVER the device call's limit" in proc.stderr) == (code == 1)


@pytest.mark.parametrize(
    "args, env, pinned, code, message",
    [
        (["--bogus"], {}, True, 2, "usage: bash bench/gpu_wheels.sh"),
        ([], {}, False, 1, "megatron-core is not pinned in requirements.txt"),
        ([], {"FAKE_PIP_EXIT": "3"}, True, 3, ""),  # pip's own failure: its exit code
        ([], {"FAKE_PIP_WHEELS": "0"}, True, 1, "expected 1 wheels, got 0 in"),
        ([], {"FAKE_PIP_WHEELS": "2"}, True, 1, "expected 1 wheels, got 2 in"),
    ],
    ids=["unknown-option", "not-pinned", "pip-fails", "no-wheel", "two-versions"],
)
def test_gpu_wheels_refuses(repo, tmp_path, args, env, pinned, code, message):
    """Each refusal's exit code and message, pip asked only once the options and the pin are
    good, and no manifest."""
    if not pinned:
        lines = (repo / "requirements.txt").read_text().splitlines(keepends=True)
        (repo / "requirements.txt").write_text("".join(x for x in lines if x.strip() != PIN))
    dest = tmp_path / "wheels"
    proc, calls = gpu_wheels(repo, "--dest", str(dest), *args, **env)
    assert proc.returncode == code and message in proc.stderr, (proc.returncode, proc.stderr)
    assert not (dest / "MANIFEST.txt").exists()
    assert len(calls) == (pinned and code != 2)
