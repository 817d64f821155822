"""A command's settings dataclass is its flags: one declaration gives the parser and the settings.

Each field of a settings dataclass (evaluation/settings.py's measurements, data_prep/config.py's
recipes) is a flag of its command: `--batch-size` for `batch_size`, its docstring the help, its
default the flag's, its choices the flag's. `add_flags` puts them on an argparse parser and
`from_flags` builds the settings from what was parsed, so a default or a list of choices is
written once, in the dataclass; the settings check their values on construction and name the
flag. `setting(...)` declares what a field's type does not say (a flag of another name, how its
text parses, where its choices come from). Standard library only: `megaloop --help` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

KEY = "megaloop.flag"


@dataclass(frozen=True)
class Flag:
    """How a settings field is spelled on the command line, where its type does not say."""

    name: str | None = None
    """The flag, where it is not the field's name (`--loops` for k_max)."""
    positional: bool = False
    """A positional argument (MODEL), not a flag."""
    parse: Callable[[str], Any] | None = None
    """Text → value, for a value argparse's types do not parse (a comma list): applied when the
    settings are built, so its error is the settings' own, naming the flag."""
    choices: Iterable[str] | Callable[[], Iterable[str]] | None = None
    help: str | Callable[[type], str] | None = None
    """In place of the field's docstring: a help that names a table's entries, or (a function of
    the settings class) its class's values."""
    required: bool = False
    group: str | None = None
    """Fields of one group are a required choice of one of them (`--prompt` or `--prompts`)."""
    internal: bool = False
    """Not a flag: the command or the settings set it."""


def setting(
    default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **flag
) -> Any:
    """A settings field with a `default` (or `default_factory`) and the Flag of `flag`."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={KEY: Flag(**flag)}
    )


def internal(default: Any = dataclasses.MISSING) -> Any:
    """A settings field that is no flag (the command or the settings set it)."""
    return setting(default, internal=True)


def option(name: str) -> str:
    """A field's flag: batch_size → --batch-size."""
    return "--" + name.replace("_", "-")


def flag_of(field: dataclasses.Field) -> Flag:
    return field.metadata.get(KEY, Flag())


def flag_name(field: dataclasses.Field) -> str:
    """How the field is given: its flag, or its name where it is positional."""
    flag = flag_of(field)
    return field.name if flag.positional else flag.name or option(field.name)


@functools.cache
def docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring (the string after its annotation), over the class and its bases."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    found[node.target.id] = " ".join(str(after.value.value).split())
    return found


def value_type(hint: Any) -> Any:
    """The type a flag's text is read as: the hint without None (int | None → int)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def flags(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.init and not flag_of(f).internal]


def add_flags(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """A flag for every field of `cls` (a settings dataclass) on `parser`."""
    hints, docs, groups = typing.get_type_hints(cls), docstrings(cls), {}
    for field in flags(cls):
        flag, kind = flag_of(field), value_type(hints[field.name])
        help = flag.help(cls) if callable(flag.help) else flag.help or docs.get(field.name, "")
        kwargs: dict[str, Any] = {"help": help, "dest": field.name}
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["default"] = shown(field)
            if flag.parse is None and kind in (int, float):
                kwargs["type"] = kind
        if flag.choices is not None:
            kwargs["choices"] = list(flag.choices() if callable(flag.choices) else flag.choices)
        target = parser
        if flag.group is not None:
            if flag.group not in groups:
                groups[flag.group] = parser.add_mutually_exclusive_group(required=True)
            target = groups[flag.group]
        if flag.positional:
            del kwargs["dest"]
            target.add_argument(field.name, **kwargs)
            continue
        if flag.name is not None:
            kwargs["metavar"] = flag.name.lstrip("-").replace("-", "_").upper()
        kwargs["required"] = flag.required or field.default is dataclasses.MISSING
        target.add_argument(flag_name(field), **kwargs)
    return parser


def shown(field: dataclasses.Field) -> Any:
    """A field's default as its flag's: a tuple as the comma list one would type (None if empty),
    None where there is none."""
    default = None if field.default is dataclasses.MISSING else field.default
    if isinstance(default, tuple):
        return ",".join(map(str, default)) or None
    return default


def from_flags(cls: type, args: argparse.Namespace, **given):
    """`cls` from the parsed flags (the text of each parsed by its Flag.parse), `given` over
    them; a flag left at its default leaves the field at the dataclass's."""
    values = {}
    for field in flags(cls):
        if field.name in given or field.name not in args:
            continue
        value, parse = getattr(args, field.name), flag_of(field).parse
        if value is None or (field.default is not dataclasses.MISSING and value == shown(field)):
            continue
        values[field.name] = parse(value) if parse is not None and isinstance(value, str) else value
    return cls(**values, **given)
