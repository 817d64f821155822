"""The `megaloop` command: parse → config → build → run, one subcommand per user task.

Each subcommand is a module of megaloop/commands/ (its options beside its handler); this module
parses, prepares the process (output, warnings, the CPU compatibility layer for the commands
that build a model) and reports the errors every command shares in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import sys
import warnings

from megaloop import known_warnings
from megaloop.commands import COMMANDS
from megaloop.commands.options import late_out, show_defaults
from megaloop.config import ConfigError
from megaloop.parallel.launch import LaunchError


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose unknown choice (a command, an action, an option's value) names
    the nearest valid one (`megaloop trian`: did you mean 'train'?)."""

    def error(self, message: str):
        wrong = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if wrong:
            valid = re.findall(r"'([^']*)'", wrong[2])
            near = difflib.get_close_matches(wrong[1], valid, n=1)
            if near:
                message += f"; did you mean '{near[0]}'?"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="megaloop", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"megaloop {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(sub)
    show_defaults(parser)
    return parser


def version() -> str:
    """The installed distribution's version (pyproject.toml's, from a wheel or an editable
    install)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("megaloop")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


NO_MEGATRON = frozenset(name for name, c in COMMANDS.items() if not c.BUILDS_MODEL)
"""Commands that never build a model in this process (they read configs and print, or hand the
work to other processes): they import neither torch, megatron-core nor wandb, and start in a
fraction of a second. So does `train --print-config`."""


@contextlib.contextmanager
def wandb_unloaded(args):
    """A command that builds a model runs with wandb marked absent unless it logs to it (its
    `logs_to_wandb`: a train run whose wandb.mode is not disabled). megatron-core imports wandb
    as its modules load, whatever the run logs: about 1 s of every process's start; marked
    absent, it loads as it does without wandb installed. The mark goes when the command ends,
    so that a later command in the same process (a bench worker's, a test's) can load wandb."""
    mark = "wandb" not in sys.modules and not getattr(args, "logs_to_wandb", lambda _: False)(args)
    if mark:
        sys.modules["wandb"] = None
    try:
        yield
    finally:
        if mark and "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]


class ReaderSafe:
    """Standard output or error that outlives its reader. When the reader of a pipe goes
    (`| head -1`, `| grep -q`, a launcher or `| tee` ended by the signal that stops this run),
    the next write fails with EPIPE; from then on output is dropped (the descriptor points at
    /dev/null, so the interpreter's final flush succeeds too) and the command finishes and exits
    as it would have, without a traceback. A training run piped into `head` keeps training
    rather than dying mid-step, and a run stopped by SIGTERM still saves its checkpoint."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        self.reader_gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv=None) -> int:
    if not isinstance(sys.stdout, ReaderSafe) and sys.stdout is not None:
        sys.stdout = ReaderSafe(sys.stdout)
    if not isinstance(sys.stderr, ReaderSafe) and sys.stderr is not None:
        sys.stderr = ReaderSafe(sys.stderr)
    known_warnings.install()
    if int(os.environ.get("RANK", "0")) != 0:  # every rank raises a dependency's warning alike
        warnings.filterwarnings("ignore", module="(?!megaloop)")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    extra = late_out(args, extra)
    if extra and (
        not hasattr(args, "overrides") or any(a.startswith("-") or "=" not in a for a in extra)
    ):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # key=value overrides may also follow the options
        args.overrides = [*args.overrides, *extra]
    builds_model = getattr(args, "builds_model", args.command not in NO_MEGATRON)
    try:
        if not builds_model or getattr(args, "print_config", False):
            return args.fn(args)
        with wandb_unloaded(args):
            from megaloop import _cpu_compat

            _cpu_compat.apply()
            return args.fn(args)
    except (ConfigError, LaunchError) as e:  # EvalError, PrepError, DataError among them
        print(f"megaloop: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmegaloop: aborted (Ctrl-C); what was already written is kept", file=sys.stderr)
        return 130
    finally:
        if "megaloop.parallel.distributed" in sys.modules:
            from megaloop.parallel import distributed

            distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
