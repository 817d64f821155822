"""Tests run megatron-core for real on the CPU: the compatibility layer is applied here (tests
are an entry point) and a one-process world is set up once per session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
import torch

from megaloop import _cpu_compat

_cpu_compat.apply()
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def one_process_world():
    """A world of one, seeded the same for every test (init is a no-op when it exists; a test
    that runs the CLI in-process tears it down, so the next test gets a fresh one)."""
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    yield


@pytest.fixture
def tiny_cfg():
    from megaloop.model import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, num_loops=4,
                       max_seq_len=32)


def build(cfg, seed: int = 0):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megaloop.model import build_model

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return build_model(cfg)
