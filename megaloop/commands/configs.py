"""`megaloop configs`: the shipped configs, by the names every command takes."""

from __future__ import annotations

BUILDS_MODEL = False


def add_parser(sub) -> None:
    sub.add_parser(
        "configs", help="list the shipped configs (any command takes one by name)"
    ).set_defaults(fn=run)


def run(args) -> int:
    from megaloop.config import CONFIG_ROOT, shipped_configs

    print(
        f"shipped configs ({CONFIG_ROOT}); give one by name, e.g. `megaloop params model/129m` "
        f"or `megaloop train experiments/tiny`:"
    )
    for name in shipped_configs():
        print(f"  {name}")
    return 0
