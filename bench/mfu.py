"""Training-step throughput and model FLOPs utilization of a config, next to the same model at
K=1 (one pass of the stack: what a looped step costs over an ordinary one).

    python -m bench mfu configs/experiments/fineweb/1p4b_42b_tokens.yaml [--steps 10]
        [--warmup 3] [--peak-tflops 989] [key=value ...]

One process, the real trainer (megatron engine, bf16 autocast where the config asks for it) on
synthetic tokens of the config's sequence length, one micro-batch per step. Model FLOPs per
token: megaloop.parallel.cost.flops_per_token (matmuls only, as `megaloop plan` counts them).
"""

import argparse
import statistics
import tempfile
import time

import torch

from megaloop import _cpu_compat, experiment
from megaloop.data import switch_overrides
from megaloop.parallel import distributed
from megaloop.parallel.cost import flops_per_token, loss_exits, peak_tflops


def measure(config: str, overrides: list, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = experiment.load(config, overrides)
        mbs = cfg.train.micro_batch_size
        cfg = experiment.load(
            config,
            [
                *overrides,
                *switch_overrides("synthetic"),
                f"train.steps={warmup + steps}",
                f"train.global_batch_size={mbs}",
                f"train.dir={run_dir}",
                "wandb.mode=disabled",
                "train.eval_batches=1",
            ],
        )
        trainer = experiment.build_trainer(cfg, log=False)
        times = []
        for i in range(warmup + steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            trainer.train_step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    step = statistics.median(times)
    tokens = mbs * cfg.data.seq_len
    flops = flops_per_token(cfg.model, cfg.data.seq_len, loss_exits(cfg)) * tokens / step
    return {
        "K": cfg.model.num_loops,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "tflops": flops / 1e12,
        "peak_mem_gib": peak_mem,
        "tokens_per_step": tokens,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense bf16 peak (default: known GPUs by name)",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    _cpu_compat.apply()
    peak = args.peak_tflops
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    if peak is None:
        peak = peak_tflops(device)
    looped = measure(args.config, args.overrides, args.steps, args.warmup)
    single = measure(args.config, [*args.overrides, "model.num_loops=1"], args.steps, args.warmup)
    print(
        f"{args.config} on {device}, {looped['tokens_per_step']:,} tokens a step, median of "
        f"{args.steps} steps after {args.warmup} warm-up"
    )
    print("| K | step (s) | tokens/s | model TFLOP/s | MFU | peak memory (GiB) | step vs K=1 |")
    print("|---|---|---|---|---|---|---|")
    for r in (looped, single):
        mfu = f"{100 * r['tflops'] / peak:.1f}%" if peak else "n/a"
        print(
            f"| {r['K']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.3g} | "
            f"{mfu} | {r['peak_mem_gib']:.1f} | {r['step_s'] / single['step_s']:.2f}x |"
        )
    distributed.shutdown()
