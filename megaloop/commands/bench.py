"""`megaloop bench fixed-k MODEL --data D`: tokens/s and CE per token at each fixed K;
`megaloop bench generate MODEL --data D --out DIR`: cached decoding with early exit against
fixed K (tokens/s, mean loops, CE) under each exit rule, threshold and KV policy."""

from __future__ import annotations

from megaloop.commands.options import deprecated, settings_flags
from megaloop.evaluation.settings import FixedKSettings, GenerateBenchSettings
from megaloop.extras import require
from megaloop.flags import from_flags

BUILDS_MODEL = True


def add_parser(sub) -> None:
    actions = sub.add_parser(
        "bench", help="benchmarks of trained or exported models"
    ).add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    p = actions.add_parser("fixed-k", help="tokens/s and CE per token at each fixed K")
    settings_flags(p, FixedKSettings).set_defaults(fn=fixed_k)
    p = actions.add_parser(
        "generate",
        help="teacher-forced cached decoding with early exit: tokens/s, mean loops and CE "
        "against fixed K, per exit rule, threshold, KV policy and batch size",
    )
    settings_flags(p, GenerateBenchSettings)
    deprecated(p, "--thresholds", "--threshold", dest="thresholds")
    deprecated(p, "--batch-sizes", "--batch-size", dest="batch_sizes")
    p.set_defaults(fn=generate)


def fixed_k(args) -> int:
    require("eval", "megaloop bench fixed-k", ("transformers",))
    from megaloop.evaluation import fixed_k

    print(fixed_k.table(fixed_k.run(from_flags(FixedKSettings, args))))
    return 0


def generate(args) -> int:
    require("eval", "megaloop bench generate", ("transformers",))
    from megaloop.evaluation import generate_bench

    result = generate_bench.run(from_flags(GenerateBenchSettings, args))
    print(generate_bench.table(result))
    return 0
