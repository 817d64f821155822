"""`megaloop diagnose MODEL --data D --out DIR`: why hidden norms drift (Tables 3, 4, 6)."""

from __future__ import annotations

from megaloop.commands.options import measurement, measurement_settings
from megaloop.extras import require

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = measurement(
        sub.add_parser(
            "diagnose",
            help="scale, radial gradients, 30-loop rollout, scale sweep, clamp (Tables 3, 4, 6)",
        )
    )
    p.add_argument("--tokens", type=int, default=4096, help="held-out tokens in the slice")
    p.add_argument("--rollout", type=int, default=30, help="loops of the rollout")
    p.add_argument(
        "--out", required=True, help="folder: writes OUT/diagnose.json and OUT/diagnose.md"
    )
    p.set_defaults(fn=run)


def run(args) -> int:
    require("eval", "megaloop diagnose", ("transformers",))
    from megaloop.evaluation import diagnostics
    from megaloop.evaluation.settings import DiagnoseSettings

    settings = measurement_settings(
        DiagnoseSettings, args, tokens=args.tokens, rollout=args.rollout
    )
    print(diagnostics.markdown(diagnostics.run(settings)))
    return 0
