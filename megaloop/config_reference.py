"""docs/config.md, the reference of every config key, generated from the config dataclasses so
that it cannot drift from them: each key as a `key=value` override writes it, its type, its
default and its field's docstring. `make docs-config` rewrites the page;
tests/unit/test_config_reference.py fails when the committed page differs from `render()`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from megaloop.config import Config
from megaloop.data import KINDS, DataConfig
from megaloop.experiment import ExperimentConfig

PAGE = "docs/config.md"
REGENERATE = "make docs-config"
COMMAND = f"python -m megaloop.config_reference > {PAGE}"
NO_DOC = "—"
"""The description of a field without a docstring."""


@dataclass(frozen=True)
class Key:
    """One row of the reference: a leaf field of the config tree."""

    path: str
    """Dotted, as on the command line: `train.scale_alarm.window`."""
    type: str
    default: str
    doc: str
    """The field's docstring on one line; empty when it has none."""


@dataclass(frozen=True)
class Table:
    """The keys of one section (or of one data kind), under a heading of their own."""

    heading: str
    intro: str
    keys: list[Key]


DATA_INTRO = (
    "`data.kind` picks the section's class, and so its other keys: the keys below are every "
    "kind's; each kind adds the keys of its table after them. A key of another kind is an error "
    "naming both kinds; `data.KEY=null` drops one that a file sets, so a command line can "
    "switch kinds (`megaloop.data.switch_overrides`)."
)
"""The data section's keys depend on `data.kind` (megaloop/data/__init__.py): said once here."""


def tables() -> list[Table]:
    """Every section of ExperimentConfig, in its field order; nested sections follow their
    parent's table, and the data section is a table of common keys and one per kind."""
    out: list[Table] = []
    hints = typing.get_type_hints(ExperimentConfig)
    for f in dataclasses.fields(ExperimentConfig):
        hint = hints[f.name]
        if hint is DataConfig:
            out += _data_tables(f.name)
        elif _is_section(hint):
            out += _section_tables(hint, f.name, _intro(hint))
        else:
            intro = "A key of the config's top level (`ExperimentConfig`, megaloop.experiment)."
            out.append(Table(f.name, intro, [_key(ExperimentConfig, f, f.name)]))
    return out


def _data_tables(name: str) -> list[Table]:
    common = {f.name for f in dataclasses.fields(DataConfig)}
    out = _section_tables(DataConfig, name, _intro(DataConfig, DATA_INTRO))
    for kind, cls in KINDS.items():
        own = [f for f in dataclasses.fields(cls) if f.name not in common]
        intro = _intro(cls, f"the keys `{name}.kind={kind}` adds.")
        out.append(
            Table(f"{name}.kind={kind}", intro, [_key(cls, f, f"{name}.{f.name}") for f in own])
        )
    return out


def _section_tables(cls: type[Config], path: str, intro: str) -> list[Table]:
    """`cls`'s leaf keys under `path`, then a table for each nested section."""
    hints = typing.get_type_hints(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            about = _intro(hints[f.name], field_docs(cls).get(f.name, ""))
            nested += _section_tables(hints[f.name], f"{path}.{f.name}", about)
        else:
            keys.append(_key(cls, f, f"{path}.{f.name}"))
    return [Table(path, intro, keys), *nested]


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Config)


def _intro(cls: type, doc: str = "") -> str:
    """Where a table's class is, and what it is: `doc`, else the class's docstring."""
    doc = doc or _class_doc(cls)
    return f"`{cls.__name__}` ({cls.__module__})" + (f": {doc}" if doc else ".")


def _key(cls: type, f: dataclasses.Field, path: str) -> Key:
    hint = typing.get_type_hints(cls)[f.name]
    if f.default is not dataclasses.MISSING:
        default = f.default
    else:
        default = f.default_factory()
    return Key(path, type_text(hint), f"`{_yaml(default)}`", field_docs(cls).get(f.name, ""))


def type_text(hint: Any) -> str:
    """A field's type as a config file writes its values: `int or `all``, `str or `null``."""
    options = _alternatives(hint)
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


def _alternatives(hint: Any) -> list[str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return [option for arg in args for option in _alternatives(arg)]
    if origin is Literal:
        return [f"`{_yaml(value)}`" for value in args]
    if hint is type(None):
        return ["`null`"]
    if origin in (list, tuple):
        return [f"list of {type_text(args[0])}"]
    return [getattr(hint, "__name__", str(hint))]


def _yaml(value: Any) -> str:
    """A value as YAML (and so an override) writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring, on one line: the string literal right after the field
    in the class body. A subclass that redeclares a field without one keeps its base's."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    body = _class_def(cls)
    if body is None:
        return {}
    docs = {}
    for stmt, after in zip(body.body, body.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _class_doc(cls: type) -> str:
    """The class's own docstring (not the signature dataclass writes in its place, nor a
    base's), on one line."""
    body = _class_def(cls)
    return " ".join((ast.get_docstring(body) or "").split()) if body else ""


@functools.cache
def _class_def(cls: type) -> ast.ClassDef | None:
    if not dataclasses.is_dataclass(cls):
        return None
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source: the table says NO_DOC
        return None
    return ast.parse(textwrap.dedent(source)).body[0]


def render() -> str:
    """The Markdown text of docs/config.md."""
    all_tables = tables()
    sections = [t.heading for t in all_tables if "." not in t.heading]
    lines = [
        "# Config keys",
        "",
        f"<!-- Generated by `{REGENERATE}` ({COMMAND}): do not edit by hand. -->",
        "",
        "Every key of a run's config, as a `key=value` override writes it (`megaloop train "
        "CONFIG train.steps=200`; in a YAML file, the same keys nested), section by section: "
        "its type, its default (the value when no file sets it: the shipped configs in "
        "`configs/` set many) and what it means, from the field's docstring in the code.",
        "",
        f"Generated from the config dataclasses (`ExperimentConfig` in `megaloop/experiment.py` "
        f"and its sections) by `{REGENERATE}`, which runs `{COMMAND}`: do not edit this page by "
        f"hand. `tests/unit/test_config_reference.py` fails when the page and the code differ.",
        "",
        "Sections: " + ", ".join(f"[{name}](#{name})" for name in sections) + ".",
    ]
    for table in all_tables:
        level = "##" if table.heading in sections else "###"
        lines += ["", f"{level} {table.heading}", "", _markdown(table.intro), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for k in table.keys:
            doc = _markdown(k.doc) if k.doc else NO_DOC
            lines.append(f"| `{k.path}` | {_markdown(k.type)} | {_markdown(k.default)} | {doc} |")
    return "\n".join(lines) + "\n"


def _markdown(text: str) -> str:
    """Docstring text as Markdown shows it: in a table a `|` would end the cell, and outside
    code a `<` starts HTML (`runs/<path>` would render as `runs/`)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


if __name__ == "__main__":
    sys.stdout.write(render())
