"""`megaloop halt MODEL --data D --out DIR`: calibrated halting and its timed speedup."""

from __future__ import annotations

from megaloop.commands.options import measurement, measurement_settings
from megaloop.evaluation.settings import RULES, EvalError
from megaloop.extras import require

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = measurement(
        sub.add_parser("halt", help="calibrated halting and its timed speedup (Appendix H)")
    )
    p.add_argument("--k-max", type=int, default=4)
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
        "--rule",
        choices=list(RULES),
        default="margin",
        help="margin: per sequence, mean top-1 minus top-2 logit; gate: per token, "
        "Ouro's cumulative exit probability",
    )
    p.add_argument("--tau", type=float, help="margin threshold (skip calibration)")
    p.add_argument("--q", type=float, help="gate threshold (skip calibration)")
    p.add_argument("--out", required=True, help="writes OUT/halt.json and OUT/halt.md")
    p.set_defaults(fn=run)


def run(args) -> int:
    require("eval", "megaloop halt", ("transformers",))
    from megaloop.evaluation import halting
    from megaloop.evaluation.settings import HaltSettings

    threshold, other = (args.tau, args.q) if args.rule == "margin" else (args.q, args.tau)
    if other is not None:
        raise EvalError(
            "--tau is the margin rule's threshold and --q the gate rule's; "
            f"give the one of --rule {args.rule}"
        )
    settings = measurement_settings(
        HaltSettings,
        args,
        k_max=args.k_max,
        rho=args.rho,
        calib=args.calib,
        bench=args.bench,
        rule=args.rule,
        threshold=threshold,
    )
    print(halting.markdown(halting.run(settings)))
    return 0
