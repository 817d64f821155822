"""`megaloop bench fixed-k MODEL --data D`: tokens/s and CE per token at each fixed K;
`megaloop bench generate MODEL --data D --out DIR`: cached decoding with early exit against
fixed K (tokens/s, mean loops, CE) under each exit rule, threshold and KV policy."""

from __future__ import annotations

from megaloop.commands.options import deprecated, measurement, measurement_settings
from megaloop.evaluation.settings import (
    KV_POLICIES,
    asynchronous_policies,
    default_thresholds,
    kv_policies,
    scores,
)
from megaloop.extras import require

BUILDS_MODEL = True


def add_parser(sub) -> None:
    actions = sub.add_parser(
        "bench", help="benchmarks of trained or exported models"
    ).add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    p = actions.add_parser("fixed-k", help="tokens/s and CE per token at each fixed K")
    measurement(p, longest=128, batch=1, study="; study: 2048, --batch-size 2")
    p.add_argument("--loops", default="1,2,3,4", help="loop counts K to time, comma-separated")
    p.add_argument("--batches", type=int, default=8, help="timed batches (study: 128)")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches first")
    p.add_argument(
        "--out",
        help="JSON file of the results, and a PNG of the PPL-throughput frontier beside it "
        "(default: the table is printed only)",
    )
    p.set_defaults(fn=fixed_k)

    p = actions.add_parser(
        "generate",
        help="teacher-forced cached decoding with early exit: tokens/s, mean loops and CE "
        "against fixed K, per exit rule, threshold, KV policy and batch size",
    )
    measurement(p, longest=128, batch=None)
    p.add_argument(
        "--exit",
        help=f"exit rules, comma-separated, by their score: {scores()} (default: every rule the "
        "model can run; one that reads the gate needs an exit gate)",
    )
    p.add_argument(
        "--threshold",
        help=f"every rule's thresholds, comma-separated (default per rule: {default_thresholds()})",
    )
    deprecated(p, "--thresholds", "--threshold")
    p.add_argument(
        "--kv",
        default=",".join(KV_POLICIES),
        help=f"KV policies, comma-separated ({kv_policies()})",
    )
    p.add_argument(
        "--batching",
        default="sync,async",
        help="sync (every row at the same token) and/or async (every row at its own loop: "
        f"{', '.join(asynchronous_policies())}, batch > 1), comma-separated",
    )
    p.add_argument(
        "--batch-size", default="1,8", help="rows decoded together, comma-separated: one run each"
    )
    deprecated(p, "--batch-sizes", "--batch-size")
    p.add_argument(
        "--prompt-tokens", type=int, default=4, help="tokens prefilled at full depth (untimed)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed decodes per run (the fastest counts)"
    )
    p.add_argument(
        "--batches",
        type=int,
        default=1,
        help="batches of different windows each run decodes (its tokens/s, CE and accuracy "
        "are over all of them)",
    )
    p.add_argument(
        "--task",
        help="the built-in corpus (addition, lookup, chase) --data was written from: also "
        "score its answers (CE, accuracy) and draw the frontier in accuracy (default: none, "
        "any text, CE only)",
    )
    p.add_argument("--out", required=True, help="folder for generate.json, .md and .png")
    p.set_defaults(fn=generate)


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


def generate(args) -> int:
    require("eval", "megaloop bench generate", ("transformers",))
    from megaloop.evaluation import generate_bench
    from megaloop.evaluation.settings import GenerateBenchSettings, numbers

    batch_sizes = numbers("--batch-size", args.batch_size, int, "1,8")
    settings = measurement_settings(
        GenerateBenchSettings,
        args,
        rules=None if args.exit is None else tuple(args.exit.split(",")),
        thresholds=None
        if args.threshold is None
        else numbers("--threshold", args.threshold, float, "0.5,0.9"),
        policies=tuple(args.kv.split(",")),
        batching=tuple(args.batching.split(",")),
        batch_size=batch_sizes[-1],
        batch_sizes=batch_sizes,
        prompt=args.prompt_tokens,
        repeats=args.repeats,
        batches=args.batches,
        task=args.task,
    )
    result = generate_bench.run(settings)
    print(generate_bench.table(result))
    return 0
