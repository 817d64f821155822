"""The command line: every subcommand is listed, options change only on purpose, one spelling
per option across commands (docs/cli.md), every option has help and shows its default, old
spellings still work for a release and warn, and the measurements' defaults follow the model."""

import argparse
import re
import subprocess
import sys

import pytest
import yaml

from megaloop import experiment
from megaloop.cli import NO_MEGATRON, build_parser, main
from megaloop.commands import COMMANDS, demo, halt
from megaloop.commands.options import Deprecated, Renamed, late_out, need_out
from megaloop.config import ConfigError, shipped_configs
from megaloop.evaluation.exported import EvalError
from megaloop.evaluation.settings import (
    DepthSettings,
    DiagnoseSettings,
    DownstreamSettings,
    FixedKSettings,
    HaltSettings,
)
from support import ROOT, TINY

MEASURE = ["model", "--data", "--seq-len", "--batch-size", "--dtype", "--device"]
SLURM_JOB = [
    "--nodes",
    "--gpus-per-node",
    "--tasks-per-node",
    "--cpus-per-task",
    "--time",
    "--warning-seconds",
    "--partition",
    "--account",
    "--gpu-mem",
    "--gpu-memory-gib",
    "--sbatch-arg",
    "--job-name",
    "--program",
    "--dry-run",
]
PREP = ["--executor", "--workers", "--partition", "--time", "--cpus-per-task"]
PREP += ["--max-array-size", "--job-name"]
# Frozen on purpose: changing the CLI means changing this table (and the README, docs/cli.md).
# Each command (with its action) lists its options as typed, positionals by name, hidden old
# spellings last: `--batch` is refused, the others deprecated (docs/cli.md).
OPTIONS = {
    "train": ["config", "overrides", "--print-config", "--dry-run"],
    "params": ["config", "overrides", "--world"],
    "configs": [],
    "plan": ["config", "overrides", "--gpus", "--gpu-mem", "--tflops", "--mfu"]
    + ["--gpus-per-node", "--search"],
    "demo": ["--text", "--tokenizer", "--steps", "--out", "--seeds", "--seed"],
    "prep wikitext103": ["--out", "--tokenizer", "--eos-token", "--max-doc-bytes", "--source"]
    + ["--layout", *PREP],
    "prep fineweb": ["--out", "--tokenizer", "--eos-token", "--max-doc-bytes", "--source"]
    + ["--seq-len", "--shard-size", "--lang-model", "--lang-threshold", *PREP],
    "ckpt consolidate": ["checkpoint", "--out", "old_out", "--overwrite"],
    "export": ["source", "--out", "old_out", "--overwrite", "--format"],
    "import ouro": ["source", "--out", "old_out"],
    "eval downstream": ["model", "--loops", "--tasks", "--limit", "--data-dir", "--batch-size"]
    + ["--split", "--exit", "--threshold", "--out", "--batch"],
    "eval compare": ["a", "b", "--resamples", "--seed", "--out"],
    "bench fixed-k": [*MEASURE, "--loops", "--batches", "--warmup", "--out", "--batch"],
    "bench generate": ["model", "--data", "--seq-len", "--dtype", "--device", "--exit"]
    + ["--threshold", "--kv", "--batching", "--batch-size", "--prompt-tokens", "--repeats"]
    + ["--batches", "--task", "--out", "--batch", "--thresholds", "--batch-sizes"],
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
    + ["--show-depth", "--dtype", "--device", "--out", "--batch", "--json"],
    "depth": [*MEASURE, "--loops", "--clamp", "--sequences", "--out", "--batch"],
    "halt": [*MEASURE, "--loops", "--rho", "--calib", "--bench", "--exit", "--threshold", "--out"]
    + ["--batch", "--k-max", "--rule", "--tau", "--q"],
    "diagnose": [*MEASURE, "--tokens", "--rollout", "--out", "--batch"],
    "sweep": ["configs", "--seeds", "--executor", "--out", "--root", *SLURM_JOB],
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


@pytest.mark.parametrize(
    "argv, loaded",
    [
        (["train", TINY, "wandb.mode=offline"], True),  # megatron-core imports it as it loads
        (["train", TINY, "wandb.mode=disabled"], False),
        (["depth", "RUN", "--data", "held_out.txt", "--out", "OUT"], False),  # no measurement logs
    ],
)
def test_wandb_is_loaded_only_by_a_run_that_logs_to_it(argv, loaded):
    """cli.wandb_unloaded, in a fresh process (this one has wandb already): wandb stays unloaded
    while a command that does not log to it loads megatron-core, and loads after it."""
    code = (
        "import sys; from megaloop import cli, _cpu_compat\n"
        f"with cli.wandb_unloaded(cli.build_parser().parse_args({argv!r})):\n"
        "    _cpu_compat.apply(); import megatron.core.inference_params\n"
        "    print(sys.modules.get('wandb') is not None)\n"
        "import wandb; print(wandb.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == [str(loaded), "wandb"], out.stderr[-2000:]


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


CLI_DOC = ROOT / "docs/cli.md"


def doc_table(heading: str) -> list[dict[str, str]]:
    """The first Markdown table under `## heading` in docs/cli.md, as {column: cell} rows."""
    section = CLI_DOC.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = section[section.index("\n|") + 1 :].split("\n\n", 1)[0].splitlines()
    head, _, *rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return [dict(zip(head, row, strict=True)) for row in rows]


def code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


VOCABULARY = {row["concept"]: row for row in doc_table("Vocabulary")}
FLAGS = {concept: code(row["flag"])[0] for concept, row in VOCABULARY.items()}
OLD_SPELLINGS = [
    (path, old, FLAGS[concept])
    for concept, row in VOCABULARY.items()
    for old, paths in re.findall(
        r"`([^`]+)` \(([^)]+)\)", row["old spellings (hidden, deprecated)"]
    )
    for path in paths.split(", ")
]
"""(command, old spelling, the concept's flag) for every deprecated alias docs/cli.md names."""


def shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions --help lists (the hidden old spellings and -h left out)."""
    return [
        a
        for a in parser._actions
        if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]


def dest_of(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").lower()


def test_every_option_has_help_and_shows_its_default():
    for path, parser in commands(build_parser()):
        formatter = parser._get_formatter()
        chosen = {  # one of a required group: no default to show
            a for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions
        }
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = f"{path} {action.option_strings or action.dest}"
            if action.help == argparse.SUPPRESS:
                assert isinstance(action, (Deprecated, Renamed)), f"{name}: hidden, not an alias"
                continue
            assert action.help and action.help.strip(), f"{name} has no help"
            if action.option_strings and action.nargs != 0 and not action.required:
                if action not in chosen:
                    text = formatter._expand_help(action)
                    assert "(default" in text or "(required" in text, f"{name}: {text}"


def test_help_shows_the_defaults():
    parsers = dict(commands(build_parser()))
    text = " ".join(parsers["depth"].format_help().split())
    assert "--loops LOOPS loop counts K to read, comma-separated, e.g. 1,2,3,4,8 (default: " in text
    assert "1,2,3,4)" in text and "windows per batch (default: 8)" in text


OTHER_CONCEPTS = {"--data-dir": "eval downstream's local lm-eval task data, not held-out tokens"}
"""Options whose name extends a flag of docs/cli.md but name another concept, and why."""


def respelt(option: str, flags: set[str]) -> bool:
    """A flag of docs/cli.md under another name: longer (--thresholds, --gpu-memory) or shorter
    (--loop, --batch)."""
    return option not in flags | set(OTHER_CONCEPTS) and any(
        option.startswith(f) or f.startswith(option) for f in flags if f.startswith("--")
    )


def test_one_flag_per_concept_in_every_command():
    """A concept of docs/cli.md is spelled by its flag wherever it is shown: no command shows an
    old spelling, a respelling of a flag, or another option under a concept's name (its dest)."""
    flags = set(FLAGS.values())
    used = set()
    for path, parser in commands(build_parser()):
        for action in shown(parser):
            strings = action.option_strings or [action.dest.upper()]
            used.update(strings)
            old = [o for p, o, _ in OLD_SPELLINGS if o in strings and o not in flags]
            assert not old, f"{path} shows {old}, an old spelling (docs/cli.md)"
            assert not [s for s in strings if respelt(s, flags)], f"{path}: {strings} (docs/cli.md)"
            for flag in flags:
                if action.dest == dest_of(flag):
                    assert flag in strings, f"{path} spells {flag} as {strings} (docs/cli.md)"
    assert flags <= used, f"docs/cli.md names flags no command has: {flags - used}"


def test_every_documented_old_spelling_is_a_hidden_alias_of_its_concepts_flag():
    parsers = dict(commands(build_parser()))
    assert len(OLD_SPELLINGS) >= 10
    for path, old, flag in OLD_SPELLINGS:
        aliases = [
            a
            for a in parsers[path]._actions
            if isinstance(a, Deprecated) and old in (a.option_strings or [a.metavar])
        ]
        assert len(aliases) == 1, f"{path}: {old} is not a deprecated alias (docs/cli.md)"
        assert flag in aliases[0].new.split(), f"{path}: {old} points at {aliases[0].new}"


def test_the_per_command_table_is_each_commands_options():
    columns = ["--loops", "--exit", "--threshold", "--out"]
    rows = {row["command"]: row for row in doc_table("Per command")}
    for path, parser in commands(build_parser()):
        options_shown = {s for a in shown(parser) for s in a.option_strings}
        if not options_shown & set(columns):
            assert path not in rows, path
            continue
        assert path in rows, f"docs/cli.md's per-command table lacks {path}"
        for column in columns:
            documented = rows[path][f"`{column}`"] != "—"
            assert documented == (column in options_shown), f"{path} {column}: docs/cli.md"


BASE = {
    "halt": ["m", "--data", "d", "--out", "o"],
    "bench generate": ["m", "--data", "d", "--out", "o"],
    "demo": [],
    "sweep": ["c.yaml"],
    "generate": ["m", "--prompt", "p"],
    "slurm submit": ["c.yaml", "--nodes", "1", "--gpus-per-node", "0"],
    "export": ["src"],
    "import ouro": ["src"],
    "ckpt consolidate": ["src"],
}
"""The least each command with an old spelling takes."""
ALIASES = {
    ("halt", "--k-max"): (["--k-max", "6"], ["--loops", "6"], "k_max"),
    ("halt", "--rule"): (["--rule", "gate"], ["--exit", "gate"], "rule"),
    ("halt", "--tau"): (["--tau", "1.5"], ["--exit", "margin", "--threshold", "1.5"], None),
    ("halt", "--q"): (
        ["--exit", "gate", "--q", "0.5"],
        ["--exit", "gate", "--threshold", "0.5"],
        None,
    ),
    ("bench generate", "--thresholds"): (
        ["--thresholds", "1,2"],
        ["--threshold", "1,2"],
        "thresholds",
    ),
    ("bench generate", "--batch-sizes"): (
        ["--batch-sizes", "1,4"],
        ["--batch-size", "1,4"],
        "batch_sizes",
    ),
    ("demo", "--seed"): (["--seed", "2", "--seeds", "3"], ["--seeds", "2,3,4"], None),
    ("sweep", "--root"): (["--root", "r"], ["--out", "r"], "out"),
    ("generate", "--json"): (["--json", "g.json"], ["--out", "g.json"], "out"),
    ("sweep", "--gpu-memory-gib"): (["--gpu-memory-gib", "24"], ["--gpu-mem", "24"], "gpu_mem"),
    ("slurm submit", "--gpu-memory-gib"): (
        ["--gpu-memory-gib", "24"],
        ["--gpu-mem", "24"],
        "gpu_mem",
    ),
    ("export", "OUT"): (["dst"], ["--out", "dst"], None),
    ("import ouro", "OUT"): (["dst"], ["--out", "dst"], None),
    ("ckpt consolidate", "OUT"): (["dst"], ["--out", "dst"], None),
}
"""(command, old spelling) → (its words, the new words, the setting both give: a dest, or None
for what the command resolves itself, READ)."""
READ = {"halt": halt.threshold, "demo": demo.seeds_of}
READ.update(dict.fromkeys(["export", "import ouro", "ckpt consolidate"], need_out))


@pytest.mark.parametrize("path, old", list(ALIASES))
def test_each_old_spelling_still_works_and_warns(path, old, capsys):
    assert set(ALIASES) == {(p, o) for p, o, _ in OLD_SPELLINGS}  # docs/cli.md's, every one
    old_words, new_words, dest = ALIASES[path, old]
    read = READ[path] if dest is None else (lambda args: getattr(args, dest))
    parse = build_parser().parse_args
    new = read(parse([*path.split(), *BASE[path], *new_words]))
    assert capsys.readouterr().err == ""
    assert read(parse([*path.split(), *BASE[path], *old_words])) == new
    said = "the positional OUT" if old == "OUT" else old
    assert f"megaloop: warning: {said} is deprecated, use " in capsys.readouterr().err


def test_old_and_new_spellings_together_are_refused():
    parse = build_parser().parse_args
    for words in (["--out", "a", "src", "b"], ["src", "b", "--out", "a"]):
        with pytest.raises(ConfigError, match="give --out alone"):
            need_out(parse(["export", *words]))
    with pytest.raises(EvalError, match="give --threshold alone"):
        halt.threshold(parse(["halt", *BASE["halt"], "--tau", "1", "--threshold", "2"]))
    with pytest.raises(EvalError, match="--tau is the margin rule's threshold"):
        halt.threshold(parse(["halt", *BASE["halt"], "--exit", "gate", "--tau", "1"]))
    with pytest.raises(ConfigError, match="give the --seeds alone"):
        demo.seeds_of(parse(["demo", "--seed", "1", "--seeds", "1,2"]))


def test_out_is_required_where_it_replaced_a_positional():
    for words in (["export", "src"], ["import", "ouro", "src"], ["ckpt", "consolidate", "src"]):
        args = build_parser().parse_args(words)
        with pytest.raises(ConfigError, match="required: --out"):
            args.fn(args)
        parser = build_parser()._subparsers._group_actions[0].choices[words[0]]
        if words[0] != "export":
            parser = parser._subparsers._group_actions[0].choices[words[1]]
        usage = parser.format_usage()
        assert " --out OUT " in usage and "[--out OUT]" not in usage, usage


@pytest.mark.parametrize(
    "seeds, expected",
    [(None, [0, 1, 2, 3]), ("5,", [5]), ("3,1,7", [3, 1, 7]), ("2", [0, 1])],
)
def test_demo_takes_its_seeds_as_a_list(seeds, expected, capsys):
    args = build_parser().parse_args(["demo", *(["--seeds", seeds] if seeds else [])])
    assert demo.seeds_of(args) == expected
    assert ("as a count of seeds is deprecated" in capsys.readouterr().err) == (seeds == "2")


def test_seq_len_defaults_to_the_models_positions():
    depth = DepthSettings(model="m", data="d")
    assert depth.fitted(128).seq_len == 128 and depth.fitted(4096).seq_len == 256
    assert FixedKSettings(model="m", data="d").fitted(4096).seq_len == 128
    assert HaltSettings(model="m", data="d", seq_len=64).fitted(128).seq_len == 64
    with pytest.raises(EvalError, match="--seq-len 256: the model takes 1 to 128 positions"):
        DiagnoseSettings(model="m", data="d", seq_len=256).fitted(128)


def test_seq_len_defaults_to_the_trained_windows_and_says_when_past_them(capsys):
    """A run trained on 128-token windows with a 256-row learned position table (the study
    preset's table at study_mini's windows) is measured on 128-token windows by default; a
    longer --seq-len runs, and says which positions no step trained (RoPE's are not a table)."""
    from types import SimpleNamespace

    from megaloop.evaluation.harness import Opened

    depth = DepthSettings(model="m", data="d")
    assert depth.fitted(256, 128).seq_len == 128
    assert depth.fitted(4096, 1024).seq_len == 256 and depth.fitted(256, None).seq_len == 256
    longer = DepthSettings(model="m", data="d", seq_len=200)
    assert longer.fitted(256, 128, learned=True).seq_len == 200
    assert capsys.readouterr().err.strip() == (
        "megaloop: warning: --seq-len 200 is longer than the 128-token windows the model trained "
        "on: its learned positions 128 to 199 were never trained (give --seq-len 128 or less)"
    )
    longer.fitted(256, 128, learned=False), longer.fitted(256, 200, learned=True)
    assert capsys.readouterr().err == ""

    def opened(kind: str, run_config: dict | None) -> Opened:
        config = SimpleNamespace(max_position_embeddings=256, position_embedding=kind)
        return Opened(SimpleNamespace(config=config), None, {"run_config": run_config})

    run = {"data": {"seq_len": 128}}
    assert opened("learned", run).fitted(depth).seq_len == 128
    assert opened("learned", None).fitted(depth).seq_len == 256  # an export of no run's record
    opened("learned", run).fitted(longer)
    assert "positions 128 to 199 were never trained" in capsys.readouterr().err
    opened("rope", run).fitted(longer)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: DepthSettings(model="m", data="d", sequences=0), "--sequences 0: must be >= 1"),
        (lambda: DepthSettings(model="m", data="d", loops=(0, 2)), "--loops '0,2'"),
        (lambda: HaltSettings(model="m", data="d", rho=0.9), "--rho 0.9"),
        (lambda: HaltSettings(model="m", data="d", batch_size=0), "--batch-size 0"),
        (lambda: HaltSettings(model="m", data="d", rule="best"), "--exit best"),
        (lambda: HaltSettings(model="m", data="d", k_max=0), "--loops 0"),
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


def test_eval_downstream_takes_every_exit_rule_its_parser_offers():
    choices = dict(commands(build_parser()))["eval downstream"]._option_string_actions["--exit"]
    for rule in choices.choices:
        assert DownstreamSettings(model="m", loops=4, exit=rule, thresholds=(0.5,)).exit == rule


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
    """Each config once, by name, with its header's first sentence whole: wrapped between
    words under its column, never cut."""
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    head, experiments, fragments = out.split("\n\n")
    assert experiments.startswith("experiments (runnable")
    assert fragments.startswith("fragments")
    listed = {}
    for section, block in (("experiment", experiments), ("fragment", fragments)):
        for line in block.splitlines()[1:]:
            if not line.startswith("   "):  # a config's first line; more of its text below
                name, about = line.split(None, 1)
                listed[name] = (section, about)
            else:
                listed[name] = (section, f"{listed[name][1]} {line.strip()}")
    assert sorted(listed) == sorted(shipped_configs())  # every config once, by its name
    assert max(map(len, out.splitlines()[1:])) <= 110
    assert listed["experiments/tiny"][1] == (
        "Tiny looped model on the built-in addition corpus (4-digit sums); ~1 minute on 2 CPU "
        "cores."
    )
    assert listed["experiments/fineweb/1p4b_baseline"] == (
        "experiment",
        "The study's 1.4B baseline (Appendix B): Ouro-1.4B as published (normalised readout) on "
        "FineWeb, trained through Ouro's label path, the CE of the exit-weighted mixture of "
        "logits.",
    )
    for name in ("experiments/study/44m/per_loop_norm", "experiments/fineweb/1p4b_baseline"):
        assert listed[name][0] == "experiment", name
    for name in ("model/129m", "data/fineweb", "experiments/study/base", "experiments/study/44m"):
        assert listed[name][0] == "fragment", name
    assert all(about for _, about in listed.values())


def test_the_positional_out_after_an_option_still_names_the_output(capsys):
    """`export SRC --format ouro DST` parsed before `--out` existed; argparse leaves a trailing
    optional positional unparsed, so the entry point hands it back to OUT."""
    parser = build_parser()
    args, extra = parser.parse_known_args(["export", "src", "--format", "ouro", "dst"])
    assert extra == ["dst"]
    assert late_out(args, extra) == [] and need_out(args) == "dst"
    assert "the positional OUT is deprecated" in capsys.readouterr().err
    for words in (["--out", "a", "dst"], ["dst", "--format", "ouro", "more"]):
        args, extra = parser.parse_known_args(["export", "src", *words])
        assert late_out(args, extra) == extra != []  # still an unrecognised argument
    args, extra = parser.parse_known_args(["train", "tiny", "--dry-run", "lr=1"])
    assert late_out(args, extra) == ["lr=1"]  # overrides are not an output


def test_eval_downstream_gets_the_cpu_layer_from_the_entry_point(tmp_path, monkeypatch, capsys):
    """`eval` builds no model, but `eval downstream` exports a run (megatron-core): its parser
    says so, and the entry point applies the CPU layer for it alone."""
    from megaloop import _cpu_compat

    applied = []
    monkeypatch.setattr(_cpu_compat, "apply", lambda: applied.append(True))
    (tmp_path / "empty").mkdir()
    down = ["eval", "downstream", str(tmp_path / "empty"), "--loops", "1", "--out", "o"]
    assert main(down) == 2 and applied == [True]
    assert "MODEL" in capsys.readouterr().err
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert applied == [True]


@pytest.mark.parametrize(
    "argv, near",
    [
        (["trian", "x"], "train"),
        (["eval", "downstrem", "x"], "downstream"),
        (["generate", "m", "--exit", "margn"], "margin"),
    ],
)
def test_a_mistyped_choice_names_the_nearest_one(argv, near, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    wrong = argv[-1] if argv[0] == "generate" else argv[-2]
    assert f"invalid choice: '{wrong}'" in last
    assert last.endswith(f"; did you mean '{near}'?"), last
    with pytest.raises(SystemExit):
        main(["zzz"])
    assert "did you mean" not in capsys.readouterr().err  # nothing near: nothing suggested


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--gpus", "0", "--gpu-mem", "80"], "plan: --gpus 0: give the GPUs of the run"),
        (["--gpus", "1", "--gpu-mem", "-1"], "plan: --gpu-mem -1: give the memory of one GPU"),
        (["--gpus", "1", "--gpu-mem", "80", "--mfu", "1.5"], "plan: --mfu 1.5: give a fraction"),
    ],
)
def test_plan_names_the_flag_it_refuses(flags, says, capsys):
    assert main(["plan", "experiments/tiny", *flags]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"megaloop: error: {says}"), line
