"""`megaloop halt MODEL --data D --out DIR`: calibrated halting and its timed speedup."""

from __future__ import annotations

from megaloop.commands.options import deprecated, measurement, measurement_settings
from megaloop.evaluation.settings import EXIT_RULES, EvalError, scores
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
        choices=list(EXIT_RULES),
        default="margin",
        help=f"exit rule: the first loop whose score >= T ({scores()}), per token; margin per "
        "sequence, its tokens' mean (the study's)",
    )
    deprecated(p, "--rule", "--exit", choices=list(EXIT_RULES))
    p.add_argument(
        "--threshold",
        type=float,
        help="the --exit rule's T, given instead of calibrated (default: calibrated to the PPL "
        "budget)",
    )
    deprecated(p, "--tau", "--exit margin --threshold", type=float, dest="tau", default=None)
    deprecated(p, "--q", "--exit gate --threshold", type=float, dest="q", default=None)
    p.add_argument("--out", required=True, help="folder: writes OUT/halt.json and OUT/halt.md")
    p.set_defaults(fn=run)


def threshold(args) -> float | None:
    """--threshold, or the deprecated --tau (margin) or --q (gate), each only with its rule."""
    old = {
        rule: value for rule, value in (("margin", args.tau), ("gate", args.q)) if value is not None
    }
    if any(rule != args.exit for rule in old):
        raise EvalError(
            "--tau is the margin rule's threshold and --q the gate rule's; "
            f"give --threshold T with --exit {args.exit}"
        )
    if old and args.threshold is not None:
        raise EvalError("give --threshold alone (--tau and --q are its old spellings)")
    return old.get(args.exit, args.threshold)


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
