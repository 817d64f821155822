"""`megaloop diagnose MODEL --data D --out DIR`: why hidden norms drift (Tables 3, 4, 6)."""

from __future__ import annotations

from megaloop.commands.options import settings_flags
from megaloop.evaluation.settings import DiagnoseSettings
from megaloop.extras import require
from megaloop.flags import from_flags

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = sub.add_parser(
        "diagnose",
        help="scale, radial gradients, 30-loop rollout, scale sweep, clamp (Tables 3, 4, 6)",
    )
    settings_flags(p, DiagnoseSettings).set_defaults(fn=run)


def run(args) -> int:
    require("eval", "megaloop diagnose", ("transformers",))
    from megaloop.evaluation import diagnostics

    print(diagnostics.markdown(diagnostics.run(from_flags(DiagnoseSettings, args))))
    return 0
