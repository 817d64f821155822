"""Core-attention slot: torch SDPA vs megatron-core's local DotProductAttention.

Times forward+backward training steps of the same looped model with each backend, interleaved in
one process (so both see the same machine state), and prints the step-time ratio.

    python -m bench attention [--hidden 128 --layers 8 --seq 128 --batch 8 --loops 1]
"""

import argparse
import statistics
import time

import torch

from megaloop import _cpu_compat
from megaloop.model import ModelConfig, build_model
from megaloop.parallel import distributed


def step_time(model, tokens) -> float:
    start = time.perf_counter()
    out = model(tokens, labels=tokens)
    sum(c.mean() for c in out.token_ce).backward()
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--loops", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    _cpu_compat.apply()
    distributed.init(seed=0)
    models = {}
    for attention in ("megatron", "sdpa"):
        cfg = ModelConfig(
            vocab_size=256,
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_layers=args.layers,
            num_loops=args.loops,
            max_seq_len=args.seq,
            attention=attention,
        )
        models[attention] = build_model(cfg)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    times = {name: [] for name in models}
    for i in range(args.repeats + 3):
        for name, model in models.items():
            t = step_time(model, tokens)
            if i >= 3:
                times[name].append(t)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"shape: d={args.hidden} heads={args.heads} L={args.layers} K={args.loops} "
        f"T={args.seq} B={args.batch}, {args.repeats} timed steps each, "
        f"{torch.get_num_threads()} threads"
    )
    for name, t in med.items():
        print(f"  {name:>9}: median step {t * 1e3:8.2f} ms")
    print(f"  megatron DotProductAttention / SDPA step time: {med['megatron'] / med['sdpa']:.2f}x")
