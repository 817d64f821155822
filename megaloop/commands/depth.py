"""`megaloop depth MODEL --data D --out DIR`: fixed-depth CE/PPL at each K from one pass."""

from __future__ import annotations

from megaloop.commands.options import settings_flags
from megaloop.evaluation.settings import DepthSettings
from megaloop.extras import require
from megaloop.flags import from_flags

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = sub.add_parser("depth", help="fixed-depth CE/PPL at each K from one pass (Table 5)")
    settings_flags(p, DepthSettings).set_defaults(fn=run)


def run(args) -> int:
    require("eval", "megaloop depth", ("transformers",))
    from megaloop.evaluation import depth

    print(depth.markdown(depth.run(from_flags(DepthSettings, args))))
    return 0
