"""Optional dependencies, by the extra that installs them (pyproject.toml): a command that needs
one says which extra to install, before it reads or writes anything."""

from __future__ import annotations

import importlib.util

from megaloop.config import ConfigError

EXTRAS = {
    "prep": ("datatrove", "pyarrow", "spacy"),
    "eval": ("transformers", "lm_eval"),
    "deepspeed": ("deepspeed",),
}


class MissingExtra(ConfigError):
    """A command's optional dependency is not installed."""


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a stub in sys.modules
        return False


def require(extra: str, command: str, modules: tuple[str, ...] | None = None) -> None:
    """MissingExtra naming the extra unless `modules` (default: all of the extra's) import."""
    missing = [m for m in modules or EXTRAS[extra] if not available(m)]
    if missing:
        raise MissingExtra(
            f"{command} needs {', '.join(missing)}, which megaloop installs with its [{extra}] "
            f"extra: pip install 'megaloop[{extra}]' (or 'megaloop[all]')"
        )
