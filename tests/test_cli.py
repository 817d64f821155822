"""The command line: every subcommand is listed, and options change only on purpose."""

import subprocess
import sys

from megaloop.cli import build_parser

# Frozen on purpose: changing the CLI means changing this list (and the README).
SUBCOMMANDS = {
    "train": ["config", "overrides"],
    "params": ["config", "overrides", "world"],
    "configs": [],
    "plan": ["config", "overrides", "gpus", "gpu_mem", "tflops", "mfu", "gpus_per_node", "search"],
    "demo": ["text", "tokenizer", "steps", "out", "seed", "seeds"],
    "ckpt": ["ckpt_command"],
    "prep": ["corpus"],
    "export": ["source", "out", "format"],
    "import": ["import_command"],
    "eval": ["eval_command"],
    "bench": ["bench_command"],
    "slurm": ["slurm_command"],
    "depth": [
        "model",
        "data",
        "out",
        "loops",
        "clamp",
        "sequences",
        "seq_len",
        "batch_size",
        "dtype",
    ],
    "halt": [
        "model",
        "data",
        "out",
        "k_max",
        "rho",
        "calib",
        "bench",
        "batch",
        "seq_len",
        "rule",
        "tau",
        "q",
        "dtype",
    ],
    "diagnose": ["model", "data", "out", "tokens", "seq_len", "rollout", "batch_size", "dtype"],
    "report": ["inputs", "out"],
    "sweep": [
        "configs",
        "seeds",
        "executor",
        "root",
        "nodes",
        "gpus_per_node",
        "tasks_per_node",
        "cpus_per_task",
        "time",
        "warning_seconds",
        "partition",
        "account",
        "gpu_memory_gib",
        "sbatch_arg",
        "job_name",
        "dry_run",
    ],
}
CKPT_ACTIONS = {"consolidate": ["checkpoint", "out"]}
EVAL_ACTIONS = {
    "downstream": ["model", "loops", "tasks", "limit", "data_dir", "batch_size", "split", "out"],
    "compare": ["a", "b", "resamples", "seed", "out"],
}
BENCH_ACTIONS = {
    "fixed-k": [
        "model",
        "data",
        "loops",
        "batch_size",
        "seq_len",
        "batches",
        "warmup",
        "dtype",
        "out",
    ]
}
IMPORT_ACTIONS = {"ouro": ["source", "out"]}
SLURM_ACTIONS = {
    "submit": [
        "config",
        "overrides",
        "nodes",
        "gpus_per_node",
        "tasks_per_node",
        "cpus_per_task",
        "time",
        "warning_seconds",
        "partition",
        "account",
        "gpu_memory_gib",
        "sbatch_arg",
        "job_name",
        "dry_run",
    ]
}


def test_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "megaloop", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in SUBCOMMANDS:
        assert name in out


def test_subcommand_options_are_frozen():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(SUBCOMMANDS)
    for name, dests in SUBCOMMANDS.items():
        found = [a.dest for a in sub.choices[name]._actions if a.dest != "help"]
        assert found == dests, name
    for command, actions in (
        ("ckpt", CKPT_ACTIONS),
        ("slurm", SLURM_ACTIONS),
        ("eval", EVAL_ACTIONS),
        ("bench", BENCH_ACTIONS),
        ("import", IMPORT_ACTIONS),
    ):
        group = next(a for a in sub.choices[command]._actions if a.dest == f"{command}_command")
        assert set(group.choices) == set(actions)
        for name, dests in actions.items():
            assert [a.dest for a in group.choices[name]._actions if a.dest != "help"] == dests


def test_missing_config_file_is_one_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megaloop", "train", "nope.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "config file 'nope.yaml'" in proc.stderr and "Traceback" not in proc.stderr
