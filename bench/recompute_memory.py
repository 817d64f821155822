"""Activation memory of train.recompute, measured: the bytes of the distinct tensors autograd
keeps for backward over one training forward (saved-tensor hooks), at K = 1, 2, 4, 8, for
none / selective / full / loop, with the ratio to none.

    .venv/bin/python bench/recompute_memory.py [--hidden 256 --layers 4 --seq 256 --batch 4
                                                --vocab 8192 --loops 1,2,4,8]

Memory is counted, not timed, so the figures do not depend on the machine. What it leaves out:
the live forward state (the current layer's working set) and the logits' own buffers that the
CE frees, so a GPU's peak is higher by about one layer's working set.
"""

import argparse

import torch

from megaloop import _cpu_compat
from megaloop.model import ModelConfig
from megaloop.model.init import init_weights
from megaloop.model.looped import LoopedLM
from megaloop.model.specs import recompute_config, transformer_config
from megaloop.parallel import distributed
from megaloop.parallel.layout import saved_activation_bytes

OPTIONS = ("none", "selective", "full", "loop")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--loops", default="1,2,4,8")
    args = p.parse_args()
    _cpu_compat.apply()
    distributed.init(seed=0)
    loops = [int(k) for k in args.loops.split(",")]
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq),
                           generator=torch.Generator().manual_seed(0))
    print(f"d={args.hidden}, L={args.layers}, seq {args.seq}, batch {args.batch}, "
          f"V={args.vocab}: MiB saved for backward (ratio to none)\n")
    print("| K | " + " | ".join(OPTIONS) + " |")
    print("|---|" + "---|" * len(OPTIONS))
    for k in loops:
        cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_heads=args.heads,
                          num_layers=args.layers, num_loops=k, max_seq_len=args.seq)
        row = {}
        for option in OPTIONS:
            model = LoopedLM(cfg, transformer_config(cfg, **recompute_config(option)),
                             recompute=option)
            init_weights(model, 0)
            model.train()
            row[option] = saved_activation_bytes(model, tokens)
        cells = [f"{row[o] / 2**20:.1f} ({row[o] / row['none']:.2f}x)" for o in OPTIONS]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
