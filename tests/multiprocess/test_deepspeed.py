"""The DeepSpeed engine: ZeRO 1/2/3 (and TP × DP) follow the one-process megatron-engine run,
ZeRO-3 really partitions, kill -9 resumes exactly, and a ZeRO-3 checkpoint consolidates to the
same weights. Every run is a real gloo launch of `megaloop train engine=deepspeed` (its ranks
started by multiproc.launch, or by torchrun in the kill -9 and wrong-layout tests)."""

import json

import pytest
from safetensors.torch import load_file

from megaloop import experiment
from megaloop.parallel import distributed
from megaloop.parallel.cost import state_bytes
from megaloop.parallel.engine import RANK_REPORT_KEYS
from megaloop.train.metrics import read as read_metrics
from multiproc import BASE, OBJECTIVES, assert_same_curve, kill_9_then_resume, metrics, train
from support import TINY

pytestmark = pytest.mark.multiprocess

OBJECTIVE = OBJECTIVES["per_loop+penalty"]  # clipping is on (optim.clip_grad=1, norms ~2)
ZERO = {  # name: (processes, overrides)
    "zero1-dp2": (2, ["deepspeed.zero_stage=1"]),
    "zero2-dp2": (2, ["deepspeed.zero_stage=2"]),
    "zero3-dp2": (2, ["deepspeed.zero_stage=3", "deepspeed.param_persistence_threshold=0"]),
    "zero2-tp2xdp2": (4, ["deepspeed.zero_stage=2", "parallel.tp=2"]),
}


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            nproc, overrides = ZERO[name]
            run_dir = tmp_path_factory.mktemp(name)
            train(nproc, run_dir, [*OBJECTIVE, "engine=deepspeed", *overrides])
            cache[name] = (run_dir, metrics(run_dir))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(ZERO))
def test_zero_equals_one_process_megatron_engine(reference_run, ds_run, name, memory_report):
    _, reference = reference_run("per_loop+penalty")
    run_dir, run = ds_run(name)
    assert_same_curve(run, reference, 1e-5)
    memory_report(name, run["layout"])
    # the planner's weights and optimizer state are what each rank measures holding
    nproc, overrides = ZERO[name]
    cfg = experiment.load(TINY, [*BASE, *OBJECTIVE, "engine=deepspeed", *overrides])
    report = run["layout"]
    planned = state_bytes(cfg, report["tp"], 1, report["dp"])
    for r in report["ranks"]:
        assert RANK_REPORT_KEYS <= set(r)  # the engine contract's report
        assert r["param_bytes"] == planned["weights"]
        # between steps ZeRO-3 keeps its gradient partition; ZeRO-1/2 have freed theirs
        assert r["grad_bytes"] == (planned["grads"] if "zero3" in name else 0)
        assert r["optimizer_bytes"] == planned["optimizer"]
    written = json.loads((run_dir / "deepspeed.json").read_text())
    assert written["gradient_clipping"] == 1.0 and written["optimizer"]["params"]["torch_adam"]
    assert f"deepspeed.zero_stage={written['zero_optimization']['stage']}" in ZERO[name][1]


def test_zero3_holds_one_dp_share_of_each_large_parameter(ds_run):
    _, run = ds_run("zero3-dp2")
    ranks = run["layout"]["ranks"]
    assert len(ranks) == 2 and ranks[0]["held_of_full"]
    for r in ranks:
        for name, (held, full) in r["held_of_full"].items():
            # ZeRO-3 pads each partition to a multiple of the DP size
            assert full / 2 <= held <= full / 2 + 2, (name, held, full)


def test_zero3_checkpoint_consolidates_to_the_one_process_weights(reference_run, ds_run, tmp_path):
    reference_dir, _ = reference_run("per_loop+penalty")
    run_dir, _ = ds_run("zero3-dp2")
    distributed.init(seed=0)
    zero3 = load_file(experiment.consolidate(run_dir, tmp_path / "zero3"))
    one = load_file(experiment.consolidate(reference_dir, tmp_path / "one"))
    assert set(zero3) == set(one)
    for key, tensor in one.items():
        diff = (zero3[key] - tensor).norm() / tensor.norm()
        assert diff < 1e-5, (key, diff.item())


def test_zero3_trains_the_study_preset_as_the_megatron_engine(reference_run, tmp_path):
    """Learned positions (a table ZeRO-3 partitions too), PyTorch's initialisation, decay of
    every parameter and a constant learning rate: the one-process megatron-engine curve."""
    _, reference = reference_run("study")
    nproc, overrides = ZERO["zero3-dp2"]
    train(nproc, tmp_path, [*OBJECTIVES["study"], "engine=deepspeed", *overrides])
    assert_same_curve(metrics(tmp_path), reference, 1e-5)


def test_kill_9_then_resume_continues_exactly(ds_run, tmp_path):
    _, reference = ds_run("zero3-dp2")
    kill_9_then_resume(
        tmp_path / "run", [*OBJECTIVE, "engine=deepspeed", *ZERO["zero3-dp2"][1]], reference
    )


@pytest.mark.parametrize(
    "nproc, change, launch",
    [
        (1, "deepspeed.zero_stage=2", "this launch is TP=1 DP=1 ZeRO-2"),
        (2, "deepspeed.zero_stage=3", "this launch is TP=1 DP=2 ZeRO-3"),
    ],
)
def test_a_deepspeed_checkpoint_in_another_layout_is_refused_before_any_compute(
    ds_run, tmp_path, nproc, change, launch
):
    """DeepSpeed's checkpoints do not reshard (it raised mid-load for another DP size, and
    asserted for ZeRO-2 -> 3): the resume stops first, saying why and what would work."""
    import shutil
    import subprocess

    from multiproc import command
    from support import env

    source, _ = ds_run("zero2-dp2")
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    proc = subprocess.run(
        command(nproc, run_dir, [*OBJECTIVE, "engine=deepspeed", change, "train.steps=12"]),
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert proc.returncode != 0
    assert "is a DeepSpeed checkpoint of TP=1 DP=2 ZeRO-2" in proc.stderr and launch in (
        proc.stderr
    )
    if nproc == 1:  # (torchrun adds its own report of the failed ranks)
        assert "Traceback" not in proc.stderr
    assert read_metrics(run_dir)["steps"][-1]["step"] == 10
