"""`megaloop configs`: the shipped configs, by the names every command takes, each with the first
line of its header comment; runnable experiments first, then the fragments they compose."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

BUILDS_MODEL = False

FRAGMENT_MARK = "(a fragment"
"""What a config under experiments/ says in its first comment line when it is a part that other
experiments include rather than a run of its own (experiments/study/129m.yaml)."""


def add_parser(sub) -> None:
    sub.add_parser(
        "configs",
        help="list the shipped configs with a line on each (any command takes one by name)",
    ).set_defaults(fn=run)


def description(path: Path) -> str:
    """The first sentence of a config file's header (its first comment lines, up to a blank or
    indented comment line such as a command): the header says what the config is."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line.startswith("#"):
            if words:
                break
            continue
        body = line[1:]
        if words and (not body.strip() or body.startswith("  ")):
            break
        words.append(body.strip())
    header = " ".join(words)
    end = re.search(r"\.(\s|$)", header)
    return header[: end.start() + 1] if end else header


def is_experiment(name: str, about: str) -> bool:
    """A run of its own: under experiments/, neither a shared base.yaml nor marked a fragment.
    model/ and data/ files, and the bases, are what experiments compose through `defaults`."""
    parts = name.split("/")
    return parts[0] == "experiments" and parts[-1] != "base" and FRAGMENT_MARK not in about


def wrapped(head: str, text: str, columns: int = 110) -> str:
    """`head` then `text` broken between words at `columns` (at least 40 characters of text a
    line), its further lines under its first: a description is never cut."""
    width = max(columns, len(head) + 40)
    return (
        textwrap.fill(
            text,
            width,
            initial_indent=head,
            subsequent_indent=" " * len(head),
            break_long_words=False,
            break_on_hyphens=False,
        ).rstrip()
        or head.rstrip()
    )


def run(args) -> int:
    from megaloop.config import CONFIG_ROOT, shipped_configs

    names = shipped_configs()
    about = {name: description(CONFIG_ROOT / f"{name}.yaml") for name in names}
    width = max(map(len, names))
    experiments = [n for n in names if is_experiment(n, about[n])]
    fragments = [n for n in names if n not in experiments]
    print(
        f"shipped configs ({CONFIG_ROOT}); give one by name, e.g. `megaloop params model/129m` "
        f"or `megaloop train experiments/tiny`:"
    )
    for title, group in (
        ("experiments (runnable: megaloop train NAME)", experiments),
        ("fragments (models, data and shared bases that experiments compose)", fragments),
    ):
        print(f"\n{title}:")
        for name in group:
            print(wrapped(f"  {name:<{width}}  ", about[name]))
    return 0
