"""The config language: typed dataclasses are the truth, YAML files are data mapped onto them.

A YAML file may start with `defaults: [other.yaml, ...]`; those files are merged first (in
order, later wins), then the file's own keys, then `key=value` overrides from the command line.
Every key must name a dataclass field: a typo fails loudly with the key, the value and what is
allowed, before any compute starts.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

CONFIG_ROOT = Path(str(importlib.resources.files("megaloop") / "_files" / "configs")).resolve()
"""The shipped configs: the repository's configs/ (megaloop/_files/configs links to it), package
data in a wheel. A config given by name is looked up here: `megaloop params 129m`."""


class ConfigError(ValueError):
    """A bad config value: the message names the key, the value and what is allowed."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be used (unreadable, from another layout, refused as unsafe), and
    starting over would hide that: reported like a bad config, before any compute, naming each
    checkpoint and the way out."""


class DataError(ConfigError):
    """A bad input file (data, tokenizer, manifest): the message names the file, the record or
    byte where that means something, and what to do. A ConfigError, so every command reports it
    in one line."""


def fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"config key '{key}': got {value!r}; {allowed}")


@dataclasses.dataclass
class Config:
    """Base for every config section: strict construction from dicts, and `validate()`."""

    @classmethod
    def from_dict(cls, data: dict, prefix: str = "") -> Config:
        if not isinstance(data, dict):
            fail(prefix.rstrip(".") or "<root>", data, "expected a mapping of keys to values")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        unknown = sorted((k for k in data if k not in fields), key=str)  # YAML keys may be 1, null
        if unknown:
            fail(
                prefix + str(unknown[0]),
                data[unknown[0]],
                f"unknown key; allowed keys here: {', '.join(sorted(fields))}",
            )
        kwargs = {name: _coerce(hints[name], value, prefix + name) for name, value in data.items()}
        cfg = cls(**kwargs)
        cfg.validate(prefix)
        return cfg

    def validate(self, prefix: str = "") -> None:
        """Cross-field checks of this section (nested sections validate themselves first);
        sections override this and call `check`/`fail` with the full key."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _coerce(options[0], value, key)
        for option in options:  # the first that takes the value, e.g. Union[int, Literal["all"]]
            try:
                return _coerce(option, value, key)
            except ConfigError:
                pass
        fail(key, value, "expected " + " or ".join(_describe(o) for o in options))
    if origin is Literal:
        if value not in args:
            fail(key, value, f"allowed: {', '.join(map(str, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            fail(key, value, f"expected a list of {args[0].__name__}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(hint, type) and issubclass(hint, Config):
        return hint.from_dict(value if value is not None else {}, key + ".")
    if hint is bool:
        if not isinstance(value, bool):
            fail(key, value, "expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, value, "expected an integer")
        if not -(2**63) <= value < 2**63:
            fail(key, value, "out of range: expected an integer that fits 64 bits")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(key, value, "expected a number")
        if isinstance(value, int) and abs(value) > 2**1023 or not math.isfinite(value):
            fail(key, value, "expected a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            fail(key, value, "expected a string")
        return str(value)
    raise TypeError(f"config field {key} has an unsupported type {hint}")


def _describe(hint: Any) -> str:
    """What a value of `hint` looks like, for error messages."""
    if typing.get_origin(hint) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        fail(key, value, allowed)


def flatten(config: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} → {"a.b": 1}: a resolved config as its dotted keys."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def _resolve(ref: str, relative_to: Path) -> Path:
    """A config file: a path (beside the including file, or from the working directory), or a
    shipped config by name: 129m, experiments/tiny, wikitext103/44m/per_loop_norm."""
    names = [ref] if ref.endswith((".yaml", ".yml")) else [ref, ref + ".yaml"]
    roots = (
        relative_to,
        CONFIG_ROOT,
        Path(),
        CONFIG_ROOT / "model",
        CONFIG_ROOT / "experiments",
        CONFIG_ROOT.parent,
    )  # the last: configs/... as the docs write it, from anywhere
    for root in roots:
        for name in names:
            if (root / name).is_file():
                return root / name
    raise ConfigError(
        f"config file '{ref}' (from {relative_to}) not found; looked beside it, in the working "
        f"directory and among the shipped configs in {CONFIG_ROOT} (`megaloop configs` lists "
        f"them)"
    )


def find_config(ref: str | Path) -> Path:
    """A config given on the command line: a path, or a shipped config's name."""
    return _resolve(str(ref), Path.cwd()).resolve()


def shipped_configs() -> list[str]:
    """Every shipped config, by a name that finds it (`megaloop configs`); the model/ and
    experiments/ prefixes may be left out where that is unambiguous (129m)."""
    return [
        str(p.relative_to(CONFIG_ROOT).with_suffix("")) for p in sorted(CONFIG_ROOT.rglob("*.yaml"))
    ]


def read_yaml(path: Path, _seen: tuple = ()) -> dict:
    """Read a YAML file with its `defaults` merged in (recursively)."""
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"config file {path} includes itself through 'defaults'")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.start}, line {line}); save it as UTF-8"
        ) from None
    try:
        data = yaml.safe_load(text) or {}
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer of > 4300 digits
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of keys, not {type(data).__name__}"
        )
    merged: dict = {}
    defaults = data.pop("defaults", []) or []
    if not isinstance(defaults, list) or not all(isinstance(r, str) and r for r in defaults):
        raise ConfigError(
            f"config file {path}: 'defaults' must be a list of YAML file names, got {defaults!r}"
        )
    for ref in defaults:
        merged = _deep_merge(merged, read_yaml(_resolve(str(ref), path.parent), _seen + (path,)))
    return _deep_merge(merged, data)


def parse_override(text: str) -> dict:
    """`a.b.c=value` → {"a": {"b": {"c": value}}}; the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. train.steps=100)")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer of > 4300 digits
        problem = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise ConfigError(
            f"config key '{key}': the value {raw!r} of override {text!r} is not "
            f"valid YAML ({problem}); give a number, true/false, a string or a "
            f"[list]"
        ) from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load(cls: type[Config], path: str | Path | None, overrides: list[str] = ()) -> Config:
    data = read_yaml(find_config(path)) if path is not None else {}
    for text in overrides:
        data = _deep_merge(data, parse_override(text))
    return cls.from_dict(data)
