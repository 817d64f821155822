"""Untrusted files: checkpoints, exports, data shards and job scripts that may come from
elsewhere. A checkpoint file replaced by a pickle whose unpickling creates a file (its manifest
recomputed, so only the loader can stop it) is refused by resume, export and consolidate of
both engines, naming the file, with nothing run and nothing written; an export runs only
megaloop's own code; shard members named outside the shard are refused; the sbatch script
quotes what it renders; the wandb key is written nowhere."""

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megaloop import experiment
from megaloop.train import checkpoint
from multiproc import BASE, train, train_here
from support import TINY, env, megaloop

OPEN = f"{io.open.__module__}.open"
"""How a pickle names io.open: `io.open` on Python 3.11, `_io.open` on 3.12."""
STEPS = ["train.steps=2", "train.save_every=2"]
STEP = "step_0000002"
ENGINES = {"megatron": [], "deepspeed": ["engine=deepspeed", "deepspeed.zero_stage=1"]}


class Payload:
    """Unpickling this calls open(path, "w"): the file exists afterwards iff the pickle ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def megaloop_here(capsys, monkeypatch):
    """A megaloop command in this process (no second import of torch and megatron-core): the
    same return code and output as the command line."""
    from types import SimpleNamespace

    from megaloop.cli import main

    def run(*args, extra_env=None):
        with monkeypatch.context() as m:
            for key, value in (extra_env or {}).items():
                m.setenv(key, value)
            capsys.readouterr()
            code = main([str(a) for a in args])
            out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(engine) → a run directory with one checkpoint (step 2), trained once per module."""
    cache = {}

    def get(engine: str) -> Path:
        if engine not in cache:
            run_dir = tmp_path_factory.mktemp(engine) / "run"
            if engine == "megatron":
                train_here(run_dir, STEPS)
            else:
                train(1, run_dir, [*ENGINES[engine], *STEPS])
            cache[engine] = run_dir
        return cache[engine]

    return get


def rewrite_manifest(folder: Path) -> None:
    """What an attacker does after replacing a file: the manifest passes again."""
    (folder / checkpoint.MANIFEST).unlink()
    checkpoint._write_manifest(folder)
    assert checkpoint.verify(folder) is None


def tampered(run_dir: Path, tmp_path: Path, name: str, payload: Payload) -> Path:
    """A copy of `run_dir` whose checkpoint file `name` is `payload` (a torch.save zip for
    *.pt, a plain pickle for .metadata, as the engines write them)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    folder = copy / "checkpoints" / STEP
    target = folder / name
    assert target.is_file(), sorted(p.name for p in target.parent.iterdir())
    if name.endswith(".pt"):
        torch.save({"module": payload}, target)
    else:
        target.write_bytes(pickle.dumps(payload))
    rewrite_manifest(folder)
    return copy


def run_unguarded(folder: Path, name: str) -> None:
    """The engines' own loaders of `name`, without megaloop's guard: each runs the payload."""
    if name == ".metadata":
        from torch.distributed.checkpoint import FileSystemReader

        FileSystemReader(str(folder)).read_metadata()
    elif name == "common.pt":
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

        TorchCommonLoadStrategy().load_common(folder)  # under TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
    else:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
            TorchCheckpointEngine,
        )

        TorchCheckpointEngine().load(str(folder / name))


def assert_refused(proc: subprocess.CompletedProcess, path: Path, marker: Path) -> None:
    assert not marker.exists(), "the payload ran"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"megaloop: error: {path}: refused to load: it would call {OPEN}"), last


# DeepSpeed's files; torch_dist's `.metadata` (plain pickle) and `common.pt` (torch.load, here
# with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, which turns torch's default weights_only off)
PAYLOADS = {
    "deepspeed-model-states": ("deepspeed", "deepspeed/mp_rank_00_model_states.pt"),
    "deepspeed-optim-states": ("deepspeed", "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    "torch_dist-.metadata": ("megatron", ".metadata"),
    "torch_dist-common.pt": ("megatron", "common.pt"),
}
NO_WEIGHTS_ONLY = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


# torch says so when the variable is set, which this test does on purpose (and is refused anyway)
@pytest.mark.filterwarnings("ignore:Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
@pytest.mark.parametrize("case", list(PAYLOADS))
def test_a_pickle_payload_is_refused_by_resume_export_and_consolidate(
    runs, tmp_path, case, monkeypatch, megaloop_here
):
    engine, name = PAYLOADS[case]
    marker = tmp_path / "PAYLOAD_RAN"
    run_dir = tampered(runs(engine), tmp_path, name, Payload(marker))
    folder = run_dir / "checkpoints" / STEP
    path = folder / name

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    run_unguarded(folder, name)  # the hole: the engine's own loader runs it
    assert marker.exists()
    marker.unlink()
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")

    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    # DeepSpeed's engine is started in a process of its own; the rest run in this one
    resume = (megaloop if engine == "deepspeed" else megaloop_here)(
        "train",
        TINY,
        *BASE,
        *ENGINES[engine],
        "train.steps=4",
        "train.save_every=2",
        f"train.dir={run_dir}",
        extra_env=NO_WEIGHTS_ONLY,
    )
    assert_refused(resume, path, marker)
    assert (run_dir / "checkpoints/latest").read_text() == STEP
    assert not (run_dir / "checkpoints/step_0000004").exists()
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))

    out = tmp_path / "hf"
    assert_refused(
        megaloop_here("export", run_dir, "--out", out, extra_env=NO_WEIGHTS_ONLY), path, marker
    )
    assert not out.exists()
    single = tmp_path / "single"
    assert_refused(
        megaloop_here("ckpt", "consolidate", run_dir, "--out", single, extra_env=NO_WEIGHTS_ONLY),
        path,
        marker,
    )
    assert not single.exists()
    if engine == "megatron":  # train.init_from reads the weights of a megatron checkpoint
        fresh = tmp_path / "fresh"
        assert_refused(
            megaloop_here(
                "train",
                TINY,
                *BASE,
                *STEPS,
                f"train.init_from={run_dir}",
                f"train.dir={fresh}",
                extra_env=NO_WEIGHTS_ONLY,
            ),
            path,
            marker,
        )
        assert not (fresh / "checkpoints").exists() or not list(
            (fresh / "checkpoints").glob("step_*")
        )
    # the checkpoint folder itself is as it was (only the run's logs may have grown)
    after = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    assert [p for p in after if p.parts[0] == "checkpoints"] == [
        p for p in before if p.parts[0] == "checkpoints"
    ]


def test_a_payload_in_a_sharded_object_of_the_distcp_shards_is_refused_on_resume(
    tmp_path, monkeypatch
):
    """torch.distributed.checkpoint unpickles each ShardedObject (megaloop's RNG state) with
    torch.load(weights_only=False): a payload saved as one, by the saver itself so the manifest
    is genuine, is refused when the run resumes in the same layout (which loads the RNG)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megaloop.parallel.megatron import MegatronEngine

    marker = tmp_path / "PAYLOAD_RAN"
    real = MegatronEngine._rng_state

    def poisoned(self):
        obj = real(self)
        obj.data = {**obj.data, "cpu": Payload(marker)}
        return obj

    run_dir = tmp_path / "run"
    monkeypatch.setattr(MegatronEngine, "_rng_state", poisoned)
    train_here(run_dir, STEPS)
    monkeypatch.setattr(MegatronEngine, "_rng_state", real)
    folder = run_dir / "checkpoints" / STEP
    assert checkpoint.verify(folder) is None and not marker.exists()

    dist_checkpointing.load(
        {"rng": ShardedObject("rng_state", None, (1, 1, 1), (0, 0, 0), replica_id=0)}, str(folder)
    )
    assert marker.exists()  # the hole: megatron-core's own load runs it
    marker.unlink()

    resume = megaloop(
        "train", TINY, *BASE, "train.steps=4", "train.save_every=2", f"train.dir={run_dir}"
    )
    assert not marker.exists()
    assert resume.returncode == 2 and "Traceback" not in resume.stderr, resume.stderr[-3000:]
    assert (
        resume.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"megaloop: error: an object stored in the *.distcp shards of {folder}: "
            f"refused to load: "
            f"it would call {OPEN}"
        )
    )
    assert not (run_dir / "checkpoints/step_0000004").exists()


def test_every_real_checkpoint_loads_through_the_guard(runs, tmp_path):
    """The allow-lists admit what the engines really write (the multi-process layouts, ZeRO 2/3
    and resharding are covered by test_deepspeed, test_parallel and test_train, which load
    through the same guard)."""
    from safetensors.torch import load_file

    from megaloop.parallel import distributed
    from megaloop.safe_load import load_metadata

    mg = runs("megatron") / "checkpoints" / STEP
    assert load_metadata(mg / ".metadata").state_dict_metadata
    for engine in ENGINES:
        distributed.init(seed=0)
        tensors = load_file(experiment.consolidate(runs(engine), tmp_path / engine))
        assert "embedding.word_embeddings.weight" in tensors


# -- exports: only megaloop's own code -----------------------------------------------------------


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    from megaloop.export import export
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    return export(runs("megatron"), tmp_path_factory.mktemp("export") / "hf")


def test_an_export_records_its_code_and_loads_with_megaloops_own(exported):
    from megaloop.evaluation.exported import open_export
    from megaloop.export import own_code

    config = json.loads((exported / "config.json").read_text())
    assert config["megaloop_code"] == own_code()
    export = open_export(exported)
    model = export.model("cpu", "float32", num_loops=2)
    assert type(model).__module__ == "megaloop.model.modeling_megaloop"
    assert model.config.num_loops == 2
    assert export.tokenizer()("ab")["input_ids"]


def _code_swapped(folder: Path, marker: Path, name: str = "modeling_megaloop.py") -> None:
    code = folder / name
    code.write_text(f"open({str(marker)!r}, 'w')\n" + code.read_text())


def _semantics_swapped(folder: Path, marker: Path) -> None:
    """The loop's semantics, which the modeling code imports relatively, is code of the export."""
    _code_swapped(folder, marker, "semantics.py")


def _hash_recomputed(folder: Path, marker: Path) -> None:
    from megaloop.digest import file_digest as sha256

    _code_swapped(folder, marker)
    config = json.loads((folder / "config.json").read_text())
    config["megaloop_code"]["modeling_megaloop.py"] = sha256(folder / "modeling_megaloop.py")
    (folder / "config.json").write_text(json.dumps(config))


def _foreign_module(folder: Path, marker: Path) -> None:
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "evil.Model"
    (folder / "config.json").write_text(json.dumps(config))


def _unrecorded(folder: Path, marker: Path) -> None:
    _code_swapped(folder, marker)
    config = json.loads((folder / "config.json").read_text())
    del config["megaloop_code"]
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "tamper, message",
    [
        (_code_swapped, "modeling_megaloop.py differs from the code recorded at export"),
        (_semantics_swapped, "semantics.py differs from the code recorded at export"),
        (_hash_recomputed, "its recorded code is not this megaloop's"),
        (_foreign_module, "its auto_map"),
        (_unrecorded, "config.json records no megaloop_code"),
    ],
)
def test_an_export_with_foreign_code_is_refused_unrun(exported, tmp_path, tamper, message):
    from megaloop.evaluation.exported import EvalError, open_export
    from megaloop.evaluation.harness import open_model

    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    marker = tmp_path / "CODE_RAN"
    tamper(folder, marker)
    for load in (lambda: open_export(folder), lambda: open_model(folder)):
        with pytest.raises(EvalError, match=f"{folder}: refused: {message}"):
            load()
    assert not marker.exists()


# -- webdataset shards ----------------------------------------------------------------------------


def write_shard(path: Path, names: list[str], seq_len: int) -> None:
    with tarfile.open(path, "w") as tar:
        for i, name in enumerate(names):
            buf = io.BytesIO()
            np.save(buf, np.full(seq_len + 1, i, dtype=np.int32))
            info = tarfile.TarInfo(name)
            info.size = buf.tell()
            buf.seek(0)
            tar.addfile(info, buf)


@pytest.mark.parametrize(
    "bad", ["../escape.tokens.npy", "/tmp/absolute.tokens.npy", "a/../../b.tokens.npy"]
)
@pytest.mark.parametrize("where", ["valid", "train"])
def test_shard_members_named_outside_the_shard_are_refused(tmp_path, bad, where):
    from megaloop.data.shards import ShardData, UnsafeShard

    good = ["000.tokens.npy", "001.tokens.npy"]
    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards/a.tar", [good[0], bad] if where == "train" else good, 8)
    write_shard(tmp_path / "shards/b.tar", [good[0], bad] if where == "valid" else good, 8)
    (tmp_path / "manifest.json").write_text(
        json.dumps({"seq_len": 8, "shards": {"a.tar": 2, "b.tar": 2}})
    )
    shard = tmp_path / "shards" / ("b.tar" if where == "valid" else "a.tar")
    with pytest.raises(UnsafeShard, match=f"data shard {shard}: member {bad!r} is named outside"):
        data = ShardData(str(tmp_path), 8, seed=0, valid_shards=1, resampled=False, tokenizer=None)
        data.batches(2, 1).next_step()
    assert not Path("/tmp/absolute.tokens.npy").exists()
    assert not (tmp_path / "escape.tokens.npy").exists()


# -- the sbatch script ---------------------------------------------------------------------------

HOSTILE = "x$(touch PWNED)`touch PWNED2`'\"; touch PWNED3"


def dry_run(capsys, run_dir: str, *options):
    """`megaloop slurm submit` of the tiny run into `run_dir` on one CPU node, `--dry-run`:
    (exit status, captured output)."""
    from megaloop.cli import main

    rc = main(
        ["slurm", "submit", TINY, "--nodes", "1", "--gpus-per-node", "0", *options, "--dry-run"]
        + [*BASE, f"train.dir={run_dir}"]
    )
    return rc, capsys.readouterr()


def render(capsys, run_dir: str, *options) -> str:
    rc, out = dry_run(capsys, run_dir, *options)
    assert rc == 0, out.err
    return out.out


def run_script(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the rendered script with stand-ins for scontrol and srun (srun records its
    arguments); returns the process and the arguments srun got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (bin_dir / "srun").write_text(
        f'#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done > {tmp_path}/srun.args\n'
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.run(
        ["bash", str(tmp_path / "job.sh")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_NODELIST": "node1",
            "SLURM_NTASKS": "1",
        },
    )
    args = (tmp_path / "srun.args").read_text().split("\0")[:-1]
    return proc, args


@pytest.mark.parametrize("field", ["run name", "partition", "account", "job name"])
def test_values_rendered_into_the_sbatch_script_are_quoted(capsys, tmp_path, field):
    run_dir = tmp_path / "runs" / (HOSTILE if field == "run name" else "plain")
    options = {
        "partition": ["--partition", HOSTILE],
        "account": ["--account", HOSTILE],
        "job name": ["--job-name", HOSTILE],
    }.get(field, [])
    script = render(capsys, str(run_dir), *options)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    proc, args = run_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.rglob("PWNED*")), "a rendered value ran as a command"
    assert f"train.dir={run_dir.resolve()}" in args  # the exact value reached megaloop
    assert (run_dir / "logs").is_dir()


@pytest.mark.parametrize(
    "option, value, run_name",
    [
        ("--partition", "gpu\ntouch PWNED", "plain"),
        ("--job-name", "gpu\ntouch PWNED", "plain"),
        ("--account", "a\rtouch PWNED", "plain"),
        # the run directory names the job and its log; YAML's double quotes make \n a newline
        ("--partition", "gpu", "x\\ntouch PWNED"),
    ],
)
def test_a_newline_in_an_sbatch_value_is_refused(capsys, tmp_path, option, value, run_name):
    """`#SBATCH` lines are comments to bash, where quoting does not help: a newline would end
    one and run the rest, so such a value is refused before anything is rendered."""
    rc, out = dry_run(capsys, f'"{tmp_path}/runs/{run_name}"', option, value)
    assert rc == 2 and "holds a control character" in out.err and "#SBATCH" not in out.out
    assert not list(tmp_path.rglob("PWNED*"))


# -- the wandb key -------------------------------------------------------------------------------


def test_the_wandb_key_is_written_nowhere(tmp_path):
    key = "a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9"  # a well-formed, unused key
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megaloop",
            "train",
            TINY,
            *BASE,
            *STEPS,
            "wandb.mode=offline",
            f"train.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env(), "WANDB_API_KEY": key, "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "wandb").is_dir()  # wandb did run (offline) and wrote its files
    assert key not in proc.stdout + proc.stderr
    leaks = [str(p) for p in run_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert not leaks, leaks
