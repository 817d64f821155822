"""`megaloop depth MODEL --data D --out DIR`: fixed-depth CE/PPL at each K from one pass."""

from __future__ import annotations

from megaloop.commands.options import measurement, measurement_settings
from megaloop.extras import require

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = measurement(
        sub.add_parser("depth", help="fixed-depth CE/PPL at each K from one pass (Table 5)")
    )
    p.add_argument(
        "--loops", default="1,2,3,4", help="loop counts K to read, comma-separated, e.g. 1,2,3,4,8"
    )
    p.add_argument(
        "--clamp",
        action="store_true",
        help="hold every loop at its loop-1 RMS (the recurrent-scale clamp)",
    )
    p.add_argument("--sequences", type=int, default=160, help="windows in the slice")
    p.add_argument("--out", required=True, help="folder: writes OUT/depth.json and OUT/depth.md")
    p.set_defaults(fn=run)


def run(args) -> int:
    require("eval", "megaloop depth", ("transformers",))
    from megaloop.evaluation import depth
    from megaloop.evaluation.settings import DepthSettings, parse_loops

    settings = measurement_settings(
        DepthSettings,
        args,
        loops=parse_loops(args.loops),
        sequences=args.sequences,
        clamp=args.clamp,
    )
    print(depth.markdown(depth.run(settings)))
    return 0
