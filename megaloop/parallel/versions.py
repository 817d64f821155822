"""The megatron-core and DeepSpeed versions megaloop's patches were written against.

A patch of a library's internals (the CPU compatibility layer, the megatron engine's optimizer
fix) names that version's lines; on another version it could silently do the wrong thing, so it
is refused, loudly, before it applies. Versions are read from the installed metadata, so a check
imports nothing.
"""

from __future__ import annotations

import importlib.metadata

TESTED = {"megatron-core": "0.16.1", "deepspeed": "0.19.8"}
"""As pinned in pyproject.toml and requirements.txt."""


class UntestedVersion(RuntimeError):
    """An installed library differs from the version a patch of its internals was tested with."""


def installed(distribution: str) -> str | None:
    """The installed version of `distribution`, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def require_tested(distribution: str, version: str | None, patcher: str) -> None:
    """Refuse `version` of `distribution` unless it is the tested one (None: not installed, so
    nothing of it will be patched)."""
    tested = TESTED[distribution]
    if version is not None and version != tested:
        raise UntestedVersion(
            f"{patcher} was tested with {distribution} {tested}, but {version} is installed; its "
            f"patches name that version's lines. Install {distribution}=={tested} (see "
            f"requirements.txt)."
        )
