"""`megaloop plan CONFIG --gpus N --gpu-mem GiB [--search]`: the layout `slurm submit` would
choose (or the one given as parallel.tp/pp overrides), its memory, FLOPs and time."""

from __future__ import annotations

import contextlib

from megaloop.commands.options import load_config, with_config
from megaloop.config import ConfigError
from megaloop.parallel import planner

BUILDS_MODEL = False


def add_parser(sub) -> None:
    p = with_config(
        sub.add_parser(
            "plan",
            help="memory per GPU, FLOPs and step time of a config's layout on N GPUs "
            "(--search: rank every layout that fits)",
        )
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the run (DP = N/(TP*PP))")
    p.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in GiB")
    p.add_argument(
        "--tflops",
        type=float,
        default=planner.PEAK_TFLOPS,
        help="dense bf16 peak TFLOP/s per GPU (default: %(default)s, H100/H200 SXM)",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=planner.MFU,
        help="model FLOPs utilization to assume (default: %(default)s, our choice)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=planner.GPUS_PER_NODE,
        help="GPUs per node: TP stays within a node",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="rank the layouts (engine, ZeRO stage, TP, PP, recompute) that fit",
    )
    p.set_defaults(fn=run)


def run(args) -> int:
    cfg = load_config(args)

    for flag, value, valid, what in (
        ("--gpus", args.gpus, args.gpus >= 1, "the GPUs of the run, at least 1"),
        ("--gpu-mem", args.gpu_mem, args.gpu_mem > 0, "the memory of one GPU in GiB, above 0"),
        ("--tflops", args.tflops, args.tflops > 0, "a GPU's peak TFLOP/s, above 0"),
        ("--mfu", args.mfu, 0 < args.mfu <= 1, "a fraction of the peak in (0, 1]"),
    ):
        if not valid:
            raise ConfigError(f"plan: {flag} {value:g}: give {what}")
    print(planner.describe_model(cfg))
    if args.search:
        plans, left_out = planner.search(
            cfg, args.gpus, args.gpu_mem, args.tflops, args.mfu, args.gpus_per_node
        )
        print(planner.ranking(plans, left_out, args.gpus, args.gpu_mem))
        return 0 if plans else 1
    fixed = planner.layout_given(args.overrides)
    try:
        proposal = planner.propose(
            cfg, args.gpus, args.gpu_mem, args.gpus_per_node, fixed, args.tflops, args.mfu
        )
    except ConfigError:
        if fixed:  # the breakdown of what was asked for, then why it cannot run
            with contextlib.suppress(ConfigError):
                _, closest = planner.fitted(cfg, args.gpus, args.gpu_mem, args.tflops, args.mfu)
                print(planner.describe(closest, cfg, args.gpu_mem, args.tflops, args.mfu))
        raise
    print(planner.describe(proposal.plan, cfg, args.gpu_mem, args.tflops, args.mfu))
    print(f"why: {proposal.why}")
    if proposal.changes:
        print(
            f"applies with: {' '.join(proposal.overrides)} (add them to `megaloop train`; "
            f"`megaloop slurm submit` on {args.gpus} GPUs adds them itself)"
        )
    return 0
