"""`megaloop bench fixed-k MODEL --data D`: tokens/s and CE per token at each fixed K."""

from __future__ import annotations

from megaloop.commands.options import measurement, measurement_settings
from megaloop.extras import require

BUILDS_MODEL = True


def add_parser(sub) -> None:
    actions = sub.add_parser(
        "bench", help="benchmarks of trained or exported models"
    ).add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    p = actions.add_parser("fixed-k", help="tokens/s and CE per token at each fixed K")
    measurement(p, longest=128, batch=1, study="; study: 2048, --batch-size 2")
    p.add_argument("--loops", default="1,2,3,4")
    p.add_argument("--batches", type=int, default=8, help="timed batches (study: 128)")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches first")
    p.add_argument(
        "--out",
        help="JSON file of the results (and a PNG of the PPL-throughput frontier beside it)",
    )
    p.set_defaults(fn=fixed_k)


def fixed_k(args) -> int:
    require("eval", "megaloop bench fixed-k", ("transformers",))
    from megaloop.evaluation import fixed_k
    from megaloop.evaluation.settings import FixedKSettings, parse_loops

    settings = measurement_settings(
        FixedKSettings,
        args,
        loops=parse_loops(args.loops),
        batches=args.batches,
        warmup=args.warmup,
    )
    print(fixed_k.table(fixed_k.run(settings)))
    return 0
