"""`megaloop halt MODEL --data D --out DIR`: calibrated halting and its timed speedup."""

from __future__ import annotations

from megaloop.commands.options import deprecated, settings_flags
from megaloop.evaluation.settings import EXIT_RULES, EvalError, HaltSettings
from megaloop.extras import require
from megaloop.flags import from_flags

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = sub.add_parser("halt", help="calibrated halting and its timed speedup (Appendix H)")
    settings_flags(p, HaltSettings)
    deprecated(p, "--k-max", "--loops", type=int, dest="k_max")
    deprecated(p, "--rule", "--exit", choices=list(EXIT_RULES), dest="rule")
    deprecated(p, "--tau", "--exit margin --threshold", type=float, dest="tau", default=None)
    deprecated(p, "--q", "--exit gate --threshold", type=float, dest="q", default=None)
    p.set_defaults(fn=run)


def threshold(args) -> float | None:
    """--threshold, or the deprecated --tau (margin) or --q (gate), each only with its rule."""
    spelled = {"margin": args.tau, "gate": args.q}
    old = {rule: value for rule, value in spelled.items() if value is not None}
    if any(rule != args.rule for rule in old):
        raise EvalError(
            "--tau is the margin rule's threshold and --q the gate rule's; "
            f"give --threshold T with --exit {args.rule}"
        )
    if old and args.threshold is not None:
        raise EvalError("give --threshold alone (--tau and --q are its old spellings)")
    return old.get(args.rule, args.threshold)


def run(args) -> int:
    require("eval", "megaloop halt", ("transformers",))
    from megaloop.evaluation import halting

    settings = from_flags(HaltSettings, args, threshold=threshold(args))
    print(halting.markdown(halting.run(settings)))
    return 0
