"""`megaloop halt MODEL --data D --out DIR`: calibrated halting and its timed speedup."""

from __future__ import annotations

from megaloop.commands.options import deprecated, measurement, measurement_settings
from megaloop.evaluation.settings import RULES, EvalError
from megaloop.extras import require

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = measurement(
        sub.add_parser("halt", help="calibrated halting and its timed speedup (Appendix H)")
    )
    p.add_argument(
        "--loops",
        type=int,
        default=4,
        help="K_max: the most loops a token runs, and the fixed depth the PPL budget and the "
        "speedup are measured against",
    )
    deprecated(p, "--k-max", "--loops", type=int)
    p.add_argument(
        "--rho",
        type=float,
        default=1.01,
        help="PPL budget: dynamic PPL <= rho x fixed-K_max PPL on the calibration slice",
    )
    p.add_argument("--calib", type=int, default=160, help="calibration sequences")
    p.add_argument(
        "--bench",
        type=int,
        default=160,
        help="benchmark sequences (the windows after the calibration slice)",
    )
    p.add_argument(
        "--exit",
        choices=list(RULES),
        default="margin",
        help="exit rule: margin, per sequence, mean top-1 minus top-2 logit >= T; gate, per "
        "token, Ouro's cumulative exit probability >= T",
    )
    deprecated(p, "--rule", "--exit", choices=list(RULES))
    p.add_argument(
        "--threshold",
        type=float,
        help="the --exit rule's T (margin: tau; gate: q), given instead of calibrated "
        "(default: calibrated to the PPL budget)",
    )
    deprecated(p, "--tau", "--exit margin --threshold", type=float, dest="tau", default=None)
    deprecated(p, "--q", "--exit gate --threshold", type=float, dest="q", default=None)
    p.add_argument("--out", required=True, help="folder: writes OUT/halt.json and OUT/halt.md")
    p.set_defaults(fn=run)


def threshold(args) -> float | None:
    """--threshold, or the deprecated --tau (margin) or --q (gate), each only with its rule."""
    old, other = (args.tau, args.q) if args.exit == "margin" else (args.q, args.tau)
    if other is not None:
        raise EvalError(
            "--tau is the margin rule's threshold and --q the gate rule's; "
            f"give --threshold T with --exit {args.exit}"
        )
    if old is not None and args.threshold is not None:
        raise EvalError("give --threshold alone (--tau and --q are its old spellings)")
    return args.threshold if old is None else old


def run(args) -> int:
    require("eval", "megaloop halt", ("transformers",))
    from megaloop.evaluation import halting
    from megaloop.evaluation.settings import HaltSettings

    settings = measurement_settings(
        HaltSettings,
        args,
        k_max=args.loops,
        rho=args.rho,
        calib=args.calib,
        bench=args.bench,
        rule=args.exit,
        threshold=threshold(args),
    )
    print(halting.markdown(halting.run(settings)))
    return 0
