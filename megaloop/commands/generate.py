"""`megaloop generate MODEL (--prompt TEXT | --prompts FILE)`: text with per-token early exit."""

from __future__ import annotations

from megaloop.commands.options import deprecated
from megaloop.evaluation.settings import (
    BATCHING,
    DTYPES,
    EXITS,
    KV_POLICIES,
    MODEL_KINDS,
    asynchronous_policies,
    kv_policies,
    scores,
)
from megaloop.extras import require

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="text from a model, each new token stopping at its exit loop"
    )
    p.add_argument("model", help=MODEL_KINDS)
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the text to continue (printed as it is generated)")
    given.add_argument(
        "--prompts", help="a text file, one prompt per line (blank lines skipped), in batches"
    )
    p.add_argument(
        "--exit",
        choices=list(EXITS),
        default="fixed",
        help=f"a token exits at the first loop whose score >= T ({scores()}); fixed (or none): "
        "every token runs K loops",
    )
    p.add_argument(
        "--threshold",
        type=float,
        help="the --exit rule's T, e.g. the one `megaloop halt` calibrated (required with an "
        "exit rule)",
    )
    p.add_argument(
        "--loops", type=int, help="K, the most loops a token runs (default: the model's)"
    )
    p.add_argument(
        "--kv",
        choices=list(KV_POLICIES),
        default="copy",
        help=f"what a token's skipped (loop, layer) cache slots hold: {kv_policies()}",
    )
    p.add_argument(
        "--batching",
        choices=["auto", *BATCHING],
        default="auto",
        help="sync: a batch's rows decode a token together (one prompt streams); async: every "
        f"row at its own loop, no row waiting for the deepest ({', '.join(asynchronous_policies())}"
        "; printed when done); auto: async for a batch of prompts under an exit rule with a "
        "policy it runs, else sync",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling")
    p.add_argument(
        "--top-k", type=int, help="sample from the k most likely tokens (default: all of them)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        help="sample from the smallest set of mass >= p (default: all tokens)",
    )
    p.add_argument(
        "--seed",
        type=int,
        help="torch.manual_seed before sampling, for reproducible draws (default: unseeded)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="prompts of --prompts at a time")
    p.add_argument(
        "--show-depth",
        action="store_true",
        help="follow each new token's text with ⟨its exit loop⟩",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help="auto: bfloat16 on a GPU, float32 on a CPU",
    )
    p.add_argument("--device", help="e.g. cpu, cuda:0 (default: a GPU when there is one)")
    p.add_argument(
        "--out",
        help="JSON file: the settings, prompts, completions, each token's exit loop and the "
        "summary (default: none written)",
    )
    deprecated(p, "--json", "--out")
    p.set_defaults(fn=run)


def run(args) -> int:
    from megaloop.evaluation.settings import GenerateSettings

    settings = GenerateSettings(
        model=args.model,
        prompt=args.prompt,
        prompts=args.prompts,
        exit=args.exit,
        threshold=args.threshold,
        loops=args.loops,
        kv=args.kv,
        batching=args.batching,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        batch_size=args.batch_size,
        show_depth=args.show_depth,
        dtype=args.dtype,
        device=args.device,
        out=args.out,
    )
    require("eval", "megaloop generate", ("transformers",))
    from megaloop.evaluation import generation

    generation.run(settings)
    return 0
