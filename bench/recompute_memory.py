"""Activation memory of train.recompute, measured: the bytes of the distinct tensors autograd
keeps for backward over one training forward (saved-tensor hooks), at K = 1, 2, 4, 8, for
none / selective / full / loop, with the ratio to none and `megaloop plan`'s figure beside each.
On a GPU (`--cuda`) also the peak of torch.cuda.max_memory_allocated over forward + backward,
above the weights and gradients.

    python -m bench recompute_memory [--hidden 256 --layers 4 --seq 256 --batch 4
                                                --vocab 8192 --loops 1,2,4,8] [--cuda] [--bf16]

Memory is counted, not timed, so the figures do not depend on the machine. What the count
leaves out: the live forward state (the current layer's working set) and the logits' own
buffers that the CE frees, so a GPU's peak is higher by about one layer's working set.
"""

import argparse

import torch

from megaloop import _cpu_compat, experiment
from megaloop.model.looped import LoopedLM, build_model
from megaloop.parallel import distributed
from megaloop.parallel.cost import activation_bytes
from megaloop.parallel.measure import saved_activation_bytes

OPTIONS = ("none", "selective", "full", "loop")


def build(cfg, device: str) -> LoopedLM:
    with torch.device(device):
        model = build_model(cfg.model, 0, recompute=cfg.train.recompute)
    return model.train()


def cuda_peak(model, tokens, bf16: bool) -> int:
    """Peak bytes above what was allocated before the forward (weights, gradients of a first
    backward, so the second pass's gradient buffers are not counted as activations)."""
    for _ in range(2):
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
            out = model(tokens, labels=tokens)
        torch.stack([ce.mean() for ce in out.token_ce]).sum().backward()
        del out
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--loops", default="1,2,4,8")
    p.add_argument("--cuda", action="store_true", help="also the CUDA peak (needs a GPU)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    args = p.parse_args(argv)
    _cpu_compat.apply()
    distributed.init(seed=0)
    device = "cuda" if args.cuda else "cpu"
    tokens = torch.randint(
        0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    ).to(device)
    print(
        f"d={args.hidden}, L={args.layers}, seq {args.seq}, batch {args.batch}, "
        f"V={args.vocab}{', bf16' if args.bf16 else ''}: MiB kept for backward (ratio to "
        f"none) / `megaloop plan`'s figure" + (" / CUDA peak" if args.cuda else "") + "\n"
    )
    print("| K | " + " | ".join(OPTIONS) + " |")
    print("|---|" + "---|" * len(OPTIONS))
    for k in [int(k) for k in args.loops.split(",")]:
        row, cells = {}, []
        for option in OPTIONS:
            cfg = experiment.load(
                "configs/experiments/tiny.yaml",
                [
                    f"model.vocab_size={args.vocab}",
                    f"model.hidden_size={args.hidden}",
                    f"model.num_heads={args.heads}",
                    f"model.num_layers={args.layers}",
                    f"model.num_loops={k}",
                    f"model.max_seq_len={args.seq}",
                    f"data.seq_len={args.seq}",
                    f"train.micro_batch_size={args.batch}",
                    f"train.global_batch_size={args.batch}",
                    f"train.recompute={option}",
                    f"train.bf16={str(args.bf16).lower()}",
                ],
            )
            model = build(cfg, device)
            with torch.autocast(device, torch.bfloat16, enabled=args.bf16):
                row[option] = saved_activation_bytes(model, tokens)
            planned = activation_bytes(cfg, 1, 1, 1, args.batch)["total"]
            cell = (
                f"{row[option] / 2**20:.1f} ({row[option] / row['none']:.2f}x) / "
                f"{planned / 2**20:.1f}"
            )
            if args.cuda:
                cell += f" / {cuda_peak(model, tokens, args.bf16) / 2**20:.1f}"
            cells.append(cell)
            del model
        print(f"| {k} | " + " | ".join(cells) + " |")
    distributed.shutdown()
