"""The command line: every subcommand is listed, options change only on purpose, one spelling
per option across commands, and the measurements' defaults follow the model."""

import argparse
import subprocess
import sys

import pytest
import yaml

from megaloop import experiment
from megaloop.cli import NO_MEGATRON, build_parser, main
from megaloop.commands import COMMANDS
from megaloop.config import CONFIG_ROOT, shipped_configs
from megaloop.evaluation.exported import EvalError
from megaloop.evaluation.settings import (
    DepthSettings,
    DiagnoseSettings,
    DownstreamSettings,
    FixedKSettings,
    HaltSettings,
)
from support import TINY

MEASURE = ["model", "--data", "--seq-len", "--batch-size", "--batch", "--dtype"]
SLURM_JOB = [
    "--nodes",
    "--gpus-per-node",
    "--tasks-per-node",
    "--cpus-per-task",
    "--time",
    "--warning-seconds",
    "--partition",
    "--account",
    "--gpu-memory-gib",
    "--sbatch-arg",
    "--job-name",
    "--program",
    "--dry-run",
]
PREP = ["--executor", "--workers", "--partition", "--time", "--cpus-per-task"]
PREP += ["--max-array-size", "--job-name"]
# Frozen on purpose: changing the CLI means changing this table (and the README). Each command
# (with its action) lists its options as typed, positionals by name; `--batch` is the refused
# old spelling of `--batch-size`.
OPTIONS = {
    "train": ["config", "overrides", "--print-config", "--dry-run"],
    "params": ["config", "overrides", "--world"],
    "configs": [],
    "plan": ["config", "overrides", "--gpus", "--gpu-mem", "--tflops", "--mfu"]
    + ["--gpus-per-node", "--search"],
    "demo": ["--text", "--tokenizer", "--steps", "--out", "--seed", "--seeds"],
    "prep wikitext103": ["--source", "--tokenizer", "--out", "--layout", "--eos-token"]
    + ["--max-doc-bytes"]
    + PREP,
    "prep fineweb": ["--source", "--tokenizer", "--out", "--seq-len", "--shard-size"]
    + ["--eos-token", "--max-doc-bytes", "--lang-model", "--lang-threshold", *PREP],
    "ckpt consolidate": ["checkpoint", "out"],
    "export": ["source", "out", "--format"],
    "import ouro": ["source", "out"],
    "eval downstream": ["model", "--loops", "--tasks", "--limit", "--data-dir", "--batch-size"]
    + ["--batch", "--split", "--exit", "--threshold", "--out"],
    "eval compare": ["a", "b", "--resamples", "--seed", "--out"],
    "bench fixed-k": [*MEASURE, "--loops", "--batches", "--warmup", "--out"],
    "bench generate": ["model", "--data", "--seq-len", "--dtype", "--exit", "--thresholds"]
    + [
        "--kv",
        "--batching",
        "--batch-sizes",
        "--prompt-tokens",
        "--repeats",
        "--batches",
        "--task",
        "--out",
    ],
    "generate": ["model", "--prompt", "--prompts", "--exit", "--threshold", "--loops", "--kv"]
    + [
        "--batching",
        "--max-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--batch-size",
    ]
    + ["--show-depth", "--dtype", "--device", "--json"],
    "depth": [*MEASURE, "--loops", "--clamp", "--sequences", "--out"],
    "halt": [*MEASURE, "--k-max", "--rho", "--calib", "--bench", "--rule", "--tau", "--q", "--out"],
    "diagnose": [*MEASURE, "--tokens", "--rollout", "--out"],
    "sweep": ["configs", "--seeds", "--executor", "--root", *SLURM_JOB],
    "report": ["inputs", "--out"],
    "slurm submit": ["config", "overrides", *SLURM_JOB],
}
MEASUREMENTS = {
    "depth": ["--out", "o"],
    "halt": ["--out", "o"],
    "diagnose": ["--out", "o"],
    "bench fixed-k": [],
}


def commands(parser: argparse.ArgumentParser, path: tuple = ()):
    """(command path, its parser) for every command and action the user can run."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield " ".join(path), parser
    for group in groups:
        for name, child in group.choices.items():
            yield from commands(child, (*path, name))


def options(parser: argparse.ArgumentParser) -> list[str]:
    return [
        a.option_strings[0] if a.option_strings else a.dest
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction)
    ]


def test_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "megaloop", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in COMMANDS:
        assert f"\n    {name} " in out, name


def test_version_is_the_packages(capsys):
    import tomllib

    from support import ROOT

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"megaloop {declared}\n"


def test_command_options_are_frozen():
    found = {path: options(p) for path, p in commands(build_parser())}
    assert found == OPTIONS


def test_config_only_commands_are_the_ones_that_build_no_model():
    assert NO_MEGATRON == {"configs", "params", "plan", "slurm", "sweep", "prep", "eval", "report"}


def test_the_measurements_share_their_options_and_defaults():
    parsers = dict(commands(build_parser()))
    for path, out in MEASUREMENTS.items():
        args = parsers[path].parse_args(["m", "--data", "d", *out])
        assert (args.seq_len, args.dtype) == (None, "auto"), path
    assert parsers["eval downstream"].get_default("batch_size") == 8


@pytest.mark.parametrize("path", [*MEASUREMENTS, "eval downstream"])
def test_the_old_batch_spelling_is_refused_naming_the_new_one(path, capsys):
    words = path.split()
    rest = ["--loops", "2", "--out", "o"] if path == "eval downstream" else ["--data", "d"]
    rest += MEASUREMENTS.get(path, [])
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args([*words, "m", *rest, "--batch", "8"])
    assert exit.value.code == 2
    assert "--batch is now --batch-size" in capsys.readouterr().err.splitlines()[-1]


def test_seq_len_defaults_to_the_models_positions():
    depth = DepthSettings(model="m", data="d")
    assert depth.fitted(128).seq_len == 128 and depth.fitted(4096).seq_len == 256
    assert FixedKSettings(model="m", data="d").fitted(4096).seq_len == 128
    assert HaltSettings(model="m", data="d", seq_len=64).fitted(128).seq_len == 64
    with pytest.raises(EvalError, match="--seq-len 256: the model takes 1 to 128 positions"):
        DiagnoseSettings(model="m", data="d", seq_len=256).fitted(128)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: DepthSettings(model="m", data="d", sequences=0), "--sequences 0: must be >= 1"),
        (lambda: DepthSettings(model="m", data="d", loops=(0, 2)), "--loops '0,2'"),
        (lambda: HaltSettings(model="m", data="d", rho=0.9), "--rho 0.9"),
        (lambda: HaltSettings(model="m", data="d", batch_size=0), "--batch-size 0"),
        (lambda: HaltSettings(model="m", data="d", rule="best"), "--rule best"),
        (lambda: DiagnoseSettings(model="m", data="d", rollout=1), "--rollout 1"),
        (lambda: DiagnoseSettings(model="m", data="d", dtype="fp16"), "--dtype fp16"),
        (lambda: FixedKSettings(model="m", data="d", warmup=-1), "--warmup -1"),
        (lambda: DownstreamSettings(model="m", loops=0), "--loops 0"),
        (lambda: DownstreamSettings(model="m", loops=1, split="test"), "--split test"),
    ],
)
def test_settings_refuse_bad_values_naming_the_option(build, message):
    with pytest.raises(EvalError, match=message):
        build()


def test_settings_record_what_ran():
    s = DiagnoseSettings(model="m", data="d", seq_len=32, dtype="bf16", out="o")
    assert s.dtype == "bfloat16"
    assert s.record(device="cpu") == {
        "data": "d",
        "seq_len": 32,
        "batch_size": 8,
        "dtype": "bfloat16",
        "device": "cpu",
        "tokens": 4096,
        "rollout": 30,
    }


def test_missing_config_file_is_one_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megaloop", "train", "nope.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "config file 'nope.yaml'" in proc.stderr and "Traceback" not in proc.stderr


def test_print_config_is_the_resolved_config_as_yaml(tmp_path, capsys):
    overrides = ["train.steps=7", "model.readout=raw", f"train.dir={tmp_path / 'run'}"]
    assert main(["train", TINY, *overrides, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    resolved = experiment.load(TINY, overrides).to_dict()
    assert printed == resolved
    assert printed["train"]["steps"] == 7 and printed["model"]["readout"] == "raw"
    assert printed["model"]["num_loops"] == 4  # from the model file the config composes
    again = tmp_path / "printed.yaml"  # it runs as a config file of its own
    again.write_text(yaml.safe_dump(printed))
    assert experiment.load(again).to_dict() == resolved
    assert not (tmp_path / "run").exists()


def test_print_config_of_a_bad_config_is_the_one_line_error(capsys):
    assert main(["train", TINY, "train.steps=x", "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        "megaloop: error: config key 'train.steps': got 'x'; expected an integer"
    ]


def test_print_config_and_dry_run_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", TINY, "--print-config", "--dry-run"])
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_configs_lists_experiments_apart_from_fragments_with_descriptions(capsys):
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    head, experiments, fragments = out.split("\n\n")
    assert experiments.startswith("experiments (runnable")
    assert fragments.startswith("fragments")
    listed = {
        line.split()[0]: (section, line.split(None, 1)[1])
        for section, block in (("experiment", experiments), ("fragment", fragments))
        for line in block.splitlines()[1:]
    }
    assert sorted(listed) == sorted(shipped_configs())  # every config once, by its name
    assert len(out.splitlines()) == len(listed) + 5
    first_comment = (CONFIG_ROOT / "experiments/tiny.yaml").read_text().splitlines()[0]
    assert listed["experiments/tiny"] == ("experiment", first_comment.removeprefix("# "))
    for name in ("experiments/study/44m/per_loop_norm", "experiments/fineweb/1p4b_baseline"):
        assert listed[name][0] == "experiment", name
    for name in ("model/129m", "data/fineweb", "experiments/study/base", "experiments/study/44m"):
        assert listed[name][0] == "fragment", name
    assert all(about for _, about in listed.values())
