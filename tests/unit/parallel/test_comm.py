"""Every collective megaloop runs itself goes through megaloop/parallel/comm.py, which puts its
tensors where the backend needs them (NCCL: the rank's CUDA device; gloo: the CPU)."""

import ast
from pathlib import Path

import pytest
import torch

from megaloop.parallel import comm
from support import ROOT

PACKAGE = ROOT / "megaloop"
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_to_all",
    "all_to_all_single",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
}


def collective_calls(path: Path, root: Path) -> list[str]:
    """`dist.X(...)` / `torch.distributed.X(...)` calls and `from torch.distributed import X`
    of a collective X in one source file (named relative to `root`)."""
    name, found = path.relative_to(root), []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and (node.func.attr in COLLECTIVES)
        ):
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                found.append(f"{name}:{node.lineno} {owner}.{node.func.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [
                f"{name}:{node.lineno} import {a.name}" for a in node.names if a.name in COLLECTIVES
            ]
    return found


def test_no_collective_outside_comm():
    """Flags, e.g., the preemption check's all-reduce of a CPU tensor (which NCCL refuses)."""
    stray = [
        c
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "comm.py"
        for c in collective_calls(p, PACKAGE.parent)
    ]
    assert stray == [], "call these through megaloop.parallel.comm:\n" + "\n".join(stray)


def test_the_scan_sees_a_stray_collective(tmp_path):
    (tmp_path / "stray.py").write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed import barrier\n"
        "flag = torch.zeros(1)\ndist.all_reduce(flag)\ntorch.distributed.broadcast(flag, 0)\n"
    )
    assert collective_calls(tmp_path / "stray.py", tmp_path) == [
        "stray.py:3 import barrier",
        "stray.py:5 dist.all_reduce",
        "stray.py:6 torch.distributed.broadcast",
    ]


@pytest.mark.parametrize(
    "backend, expected", [("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu"))]
)
def test_tensors_go_where_the_backend_needs_them(monkeypatch, backend, expected):
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm.dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm.device() == expected
