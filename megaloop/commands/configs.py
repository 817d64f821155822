"""`megaloop configs`: the shipped configs, by the names every command takes, each with the first
line of its header comment; runnable experiments first, then the fragments they compose."""

from __future__ import annotations

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
    """The first comment line of a config file: its header says what it is."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("#"):
            return line.lstrip().lstrip("#").strip()
    return ""


def is_experiment(name: str, about: str) -> bool:
    """A run of its own: under experiments/, neither a shared base.yaml nor marked a fragment.
    model/ and data/ files, and the bases, are what experiments compose through `defaults`."""
    parts = name.split("/")
    return parts[0] == "experiments" and parts[-1] != "base" and FRAGMENT_MARK not in about


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
            print(f"  {name:<{width}}  {about[name]}".rstrip())
    return 0
