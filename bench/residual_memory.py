"""What `model.fp32_residual` costs in memory: the bytes autograd keeps for backward over one
bf16-autocast training forward (saved-tensor hooks, parameters excluded), the residual stream
fp32 against bf16, side by side with their ratio and `megaloop plan`'s figure.

    python -m bench residual_memory [--config CONFIG] [--seq 256] [--batch 1]
        [--cuda] [key=value ...]

CONFIG defaults to the study's 44M per-loop RMSNorm row.

Counted, not timed: the figures do not depend on the machine, but dropout's do on the device
(torch's CPU dropout keeps a float mask where CUDA keeps a byte), so the table is printed with
the config's dropout and with none. The step time an fp32 residual costs needs a GPU (`--cuda`
adds the CUDA peak; time it with bench/mfu.py and the key given).
"""

import argparse

import torch

from megaloop import _cpu_compat, experiment
from megaloop.model.looped import build_model
from megaloop.parallel import distributed
from megaloop.parallel.cost import activation_bytes
from megaloop.parallel.measure import saved_activation_bytes

STUDY_44M = "configs/experiments/study/44m/per_loop_norm.yaml"


def kept(cfg, tokens, device: str) -> int:
    with torch.device(device):
        model = build_model(cfg.model, 0, recompute=cfg.train.recompute).train()
    with torch.autocast(device, torch.bfloat16):
        return saved_activation_bytes(model, tokens)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=STUDY_44M)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cuda", action="store_true", help="build and count on the GPU")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    _cpu_compat.apply()
    distributed.init(seed=0)
    device = "cuda" if args.cuda else "cpu"
    shape = [
        f"data.seq_len={args.seq}",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}",
        "train.bf16=true",
        *args.overrides,
    ]
    base = experiment.load(args.config, shape)
    m = base.model
    tokens = torch.randint(
        0, m.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    ).to(device)
    print(
        f"{args.config}: d={m.hidden_size}, L={m.num_layers}, K={m.num_loops}, seq {args.seq}, "
        f"batch {args.batch}, bf16 autocast, {device}: MiB kept for backward\n"
    )
    print("| dropout | fp32 residual | bf16 residual | fp32 / bf16 | extra MiB | plan |")
    print("|---|---|---|---|---|---|")
    for dropout in dict.fromkeys([m.dropout, 0.0]):
        mib = {}
        for fp32 in (True, False):
            cfg = experiment.load(
                args.config,
                [*shape, f"model.dropout={dropout}", f"model.fp32_residual={str(fp32).lower()}"],
            )
            mib[fp32] = kept(cfg, tokens, device) / 2**20
        planned = activation_bytes(cfg, 1, 1, 1, args.batch)["total"] / 2**20
        print(
            f"| {dropout:g} | {mib[True]:.3f} | {mib[False]:.3f} | {mib[True] / mib[False]:.3f}x "
            f"| {mib[True] - mib[False]:.3f} | {planned:.3f} |"
        )
    distributed.shutdown()
