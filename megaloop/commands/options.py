"""Options that several commands share, spelled one way everywhere (docs/cli.md).

Imported to build the parser of every command, so it imports nothing heavy: `megaloop configs`
and `plan` start without torch.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from megaloop.config import ConfigError
from megaloop.flags import add_flags


class Renamed(argparse.Action):
    """An option's old spelling: refused while the arguments are parsed, naming the new one."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}: give {self.new} N")


class Deprecated(argparse.Action):
    """An option's old spelling, kept for one release (docs/cli.md): hidden from the help, it
    warns on stderr and stores its value where the new spelling does, so scripts keep working
    while they are moved to the new name."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        kwargs.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        old = option_string or f"the positional {self.metavar}"
        warn(f"{old} is deprecated, use {self.new}")
        setattr(namespace, self.dest, values)


def warn(text: str) -> None:
    print(f"megaloop: warning: {text}", file=sys.stderr)


def deprecated(p: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    """`old`, a hidden Deprecated alias of `new` (same dest unless `dest` is given)."""
    if old.startswith("-"):
        kwargs.setdefault("dest", new.lstrip("-").replace("-", "_"))
    p.add_argument(old, action=Deprecated, new=new, **kwargs)


def out_folder(p: argparse.ArgumentParser, help: str, overwrite: bool = False) -> None:
    """A required `--out` folder, where the old spelling was a positional OUT (kept, deprecated,
    for one release: argparse cannot require `--out` and still take the positional, so `need_out`
    checks it); `overwrite`: with --overwrite, which lets `checked_out` accept a folder that is
    not empty (`staged` replaces it)."""
    p.add_argument("--out", help=f"{help} (required)")
    deprecated(p, "old_out", "--out", nargs="?", metavar="OUT")
    if overwrite:
        p.add_argument(
            "--overwrite",
            action="store_true",
            help="replace --out if it is a folder that is not empty: what it holds is deleted "
            "once the new output is complete (without it such a folder is refused)",
        )
    p.set_defaults(positional_out=True)


def late_out(args, extra: list[str]) -> list[str]:
    """The deprecated positional OUT given after an option (`export SRC --format ouro OUT`):
    argparse fills an optional positional only from the run of positionals it starts in, so the
    trailing one comes back unparsed; it still names the output, as it did before `--out`."""
    unfilled = getattr(args, "positional_out", False) and args.out is None
    unfilled = unfilled and getattr(args, "old_out", None) is None
    if unfilled and len(extra) == 1 and not extra[0].startswith("-"):
        warn("the positional OUT is deprecated, use --out")
        args.old_out = extra[0]
        return []
    return extra


def need_out(args) -> str:
    """`out_folder`'s folder: --out, or the deprecated positional OUT, exactly one of them."""
    old = getattr(args, "old_out", None)
    if old is not None and args.out is not None:
        raise ConfigError("the positional OUT and --out both name the output: give --out alone")
    if old is None and args.out is None:
        raise ConfigError("the following argument is required: --out")
    return args.out if old is None else old


def checked_out(args, source: str) -> Path:
    """`need_out`'s folder, checked before any work (ConfigError): not a file; new, empty, or
    with --overwrite a folder that is not empty; never one that holds `source` or the current
    directory (`staged` would delete them)."""
    out = Path(need_out(args))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: give a new or empty folder")
    if not out.is_dir():
        return out
    if any(out.iterdir()) and not getattr(args, "overwrite", False):
        raise ConfigError(
            f"--out {out} is a folder that is not empty: give a new or empty folder, or "
            f"--overwrite to replace what it holds"
        )
    for inside, what in ((Path(source), "the source"), (Path.cwd(), "the current directory")):
        if inside.resolve().is_relative_to(out.resolve()):
            raise ConfigError(
                f"--out {out} holds {what} ({inside}), which writing the output in its place "
                f"would delete: give another folder"
            )
    return out


@contextmanager
def staged(out: Path):
    """A new folder to write `out`'s contents into, moved into `out`'s place once the command
    has written all of it; only then does an existing `out` (empty, or replaced under
    --overwrite) go. A command that fails leaves `out` as it was."""
    out = out.resolve()
    tmp, old = out.with_name(f".tmp_{out.name}"), out.with_name(f".old_{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def seed_list(text: str) -> list[int] | None:
    """`--seeds 0,1,2` as seeds; None when the text is not a comma list of integers."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        return None
    return seeds or None


class ShowsDefaults:
    """A help formatter mixin: an option's help ends with its default, unless the text already
    says it (`(default...`) or there is none to show (None, a flag, a required option)."""

    def _get_help_string(self, action):
        help = action.help or ""
        default = action.default
        if "(default" in help or action.required or not action.option_strings or action.nargs == 0:
            return help
        if default is None or default is argparse.SUPPRESS or default == []:
            return help
        return f"{help} (default: %(default)s)"


def every_parser(parser: argparse.ArgumentParser):
    """`parser` and every parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from every_parser(child)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every parser under `parser` (itself included) shows its options' defaults, and a
    required `--out` (`out_folder`) as required in its usage line."""
    for p in every_parser(parser):
        if not issubclass(p.formatter_class, ShowsDefaults):
            base = p.formatter_class
            p.formatter_class = type(f"ShowsDefaults{base.__name__}", (ShowsDefaults, base), {})
        if p.get_default("positional_out"):
            usage = p.format_usage().split(": ", 1)[1].rstrip("\n")
            p.usage = usage.replace("[--out OUT]", "--out OUT")


def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("config", help="YAML config (e.g. configs/experiments/tiny.yaml)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides, e.g. train.steps=100 model.readout=raw",
    )
    return p


def load_config(args):
    from megaloop import experiment

    return experiment.load(args.config, args.overrides)


def settings_flags(p: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """A flag for every field of the settings dataclass `cls` (megaloop.flags), and the old
    `--batch` spelling refused, naming --batch-size, where it has one."""
    add_flags(p, cls)
    if "--batch-size" in p._option_string_actions:
        p.add_argument("--batch", action=Renamed, new="--batch-size")
    return p


def slurm_job(
    p: argparse.ArgumentParser,
    required: bool,
    dry_run: str = "print the script (and the layout, on stderr); submit nothing",
) -> None:
    """What a Slurm job asks for (`slurm submit`, `sweep --executor slurm`); `dry_run` is the
    help of --dry-run."""
    also = "" if required else " (required with --executor slurm)"
    p.add_argument("--nodes", type=int, required=required, help=f"nodes of each job{also}")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        required=required,
        help=f"GPUs per node, one rank each (0: CPU nodes){also}",
    )
    p.add_argument(
        "--tasks-per-node",
        type=int,
        help="ranks per node on CPU nodes (default: one per GPU, or 1 on CPU nodes)",
    )
    p.add_argument(
        "--cpus-per-task",
        type=int,
        help="CPUs (and OMP threads) per rank (default: 8 with GPUs, else 1)",
    )
    p.add_argument("--time", default="24:00:00", help="Slurm time limit of each attempt")
    p.add_argument(
        "--warning-seconds",
        type=int,
        default=300,
        help="USR1 this long before the limit: checkpoint and requeue",
    )
    p.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    p.add_argument("--account", help="Slurm account to charge (default: yours)")
    p.add_argument(
        "--gpu-mem", type=float, default=80.0, help="memory per GPU in GiB, to choose the layout"
    )
    deprecated(p, "--gpu-memory-gib", "--gpu-mem", type=float)
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra #SBATCH line, e.g. --sbatch-arg=--exclusive; repeatable (default: none)",
    )
    p.add_argument(
        "--job-name",
        help="Slurm job name (default: megaloop-RUN, RUN the run directory's name; a sweep: "
        "megaloop-sweep)",
    )
    p.add_argument(
        "--program",
        help="what each rank runs in place of `python -m megaloop` (default: that)",
    )
    p.add_argument("--dry-run", action="store_true", help=dry_run)


def train_job(args, config: str, overrides: list):
    """The slurm.TrainJob of `slurm_job`'s options."""
    from megaloop import slurm

    return slurm.TrainJob(
        config=config,
        overrides=overrides,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        warning_seconds=args.warning_seconds,
        partition=args.partition,
        account=args.account,
        gpu_memory_gib=args.gpu_mem,
        sbatch_args=tuple(args.sbatch_arg),
        job_name=args.job_name,
        program=args.program,
    )
