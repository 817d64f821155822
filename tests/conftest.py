"""Tests run megatron-core for real on the CPU: the compatibility layer is applied here (tests
are an entry point) and a one-process world is set up once per session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
import torch

from megaloop import _cpu_compat, known_warnings

known_warnings.install()  # before megatron-core is imported: some warn at import

_cpu_compat.apply()
# processes x threads <= cores: `make test` runs these tests on pytest-xdist workers, one per core
workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // workers))


def pytest_configure(config):
    for entry in known_warnings.pytest_filters():
        config.addinivalue_line("filterwarnings", entry)


@pytest.fixture(autouse=True)
def one_process_world():
    """A world of one, seeded the same for every test (init is a no-op when it exists; a test
    that runs the CLI in-process tears it down, so the next test gets a fresh one)."""
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    yield


@pytest.fixture
def tiny_cfg():
    """support.TINY_MODEL as a ModelConfig, for tests that vary it with dataclasses.replace."""
    from support import tiny_config

    return tiny_config()


def build(cfg, seed: int = 0):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megaloop.model import build_model

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return build_model(cfg)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """reference_run(objective) → (run_dir, metrics) of the one-process megatron-engine run of
    the multi-process tests' tiny config, trained once per session."""
    from multiproc import OBJECTIVES, metrics, train_here

    cache = {}

    def get(objective: str):
        if objective not in cache:
            run_dir = tmp_path_factory.mktemp(f"{objective}-one")
            train_here(run_dir, OBJECTIVES[objective])
            cache[objective] = (run_dir, metrics(run_dir))
        return cache[objective]

    return get


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory):
    """A briefly trained tiny model (bytes tokenizer), exported once a session. 256 positions:
    lm-eval needs the longest continuation of a real task row to fit."""
    from megaloop.export import export
    from megaloop.parallel import distributed
    from multiproc import train_here

    root = tmp_path_factory.mktemp("eval")
    train_here(root / "run", ["train.steps=6", "train.save_every=6", "model.max_seq_len=256"])
    distributed.init(seed=0)
    return export(root / "run", root / "hf")


_MEMORY_REPORTS: list[tuple[str, dict]] = []


@pytest.fixture
def memory_report():
    """Record a run's per-rank memory (printed at the end of the test session)."""
    return lambda name, report: _MEMORY_REPORTS.append((name, report))


def pytest_terminal_summary(terminalreporter):
    if not _MEMORY_REPORTS:
        return
    tr = terminalreporter
    tr.section("memory per rank (parameters, gradient buffer, optimizer state)")
    for name, report in _MEMORY_REPORTS:
        for r in report["ranks"]:
            tr.write_line(
                f"{name:28s} rank {r['rank']} (tp {r['tp_rank']} pp {r['pp_rank']} "
                f"dp {r['dp_rank']}): {r['params']:>7,} params ({r['layer_params']:>7,} in "
                f"layers), {r['param_bytes'] / 1024:7.1f} KiB params, "
                f"{r['grad_bytes'] / 1024:7.1f} KiB grads, "
                f"{r['optimizer_bytes'] / 1024:7.1f} KiB optimizer"
            )
