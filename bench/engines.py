"""Step time of each training engine against plain PyTorch DDP, on the same processes.

    .venv/bin/torchrun --nproc-per-node 2 bench/engines.py [--steps 8] [key=value ...]

Builds, one after another in the same ranks, torch DistributedDataParallel + AdamW (the
reference), the megatron engine (megatron-core DDP + distributed optimizer) and the DeepSpeed
engine at ZeRO 0-3, all on the same looped model and micro-batches, and prints the median step
time of each and its ratio to plain DDP.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from megaloop import _cpu_compat, experiment, objectives
from megaloop.model.looped import build_model
from megaloop.parallel import distributed

DEFAULTS = [
    "model.hidden_size=128",
    "model.num_heads=4",
    "model.num_layers=4",
    "model.num_loops=4",
    "data.seq_len=128",
    "train.micro_batch_size=4",
    "train.global_batch_size=16",
    "train.steps=100",
    "optim.warmup_steps=10",
    "wandb.mode=disabled",
    "train.dir=runs/bench-engines",
]


class TorchDDP:
    """The reference: torch DDP, torch AdamW, clipping, the same objective and accumulation."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.module = build_model(cfg.model, cfg.train.seed)
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.module)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.ddp.parameters(),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )

    def train_step(self, microbatches):
        self.optimizer.zero_grad()
        for i, batch in enumerate(microbatches):
            sync = i == len(microbatches) - 1
            with torch.enable_grad() if sync else self.ddp.no_sync():
                out = self.ddp(batch[:, :-1], labels=batch[:, 1:])
                loss, _ = objectives.compute(self.cfg.objective, out)
                (loss / len(microbatches)).backward()
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), self.cfg.optim.clip_grad)
        self.optimizer.step()


def time_engine(engine, batches, steps: int) -> float:
    times = []
    for i in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(batches.next_step())
        dist.barrier()
        if i >= 2:  # warm-up excluded
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    _cpu_compat.apply()
    variants = {"torch DDP": ["engine=megatron"], "megatron engine": ["engine=megatron"]}
    for stage in range(4):
        variants[f"deepspeed ZeRO-{stage}"] = ["engine=deepspeed", f"deepspeed.zero_stage={stage}"]
    results = {}
    for name, overrides in variants.items():
        cfg = experiment.load(None, [*DEFAULTS, *args.overrides, *overrides])
        distributed.init(cfg.train.seed)
        trainer = experiment.build_trainer(cfg, log=False)
        engine = TorchDDP(cfg) if name == "torch DDP" else trainer.engine
        results[name] = time_engine(engine, trainer.batches, args.steps)
    if dist.get_rank() == 0:
        ref = results["torch DDP"]
        world = dist.get_world_size()
        print(
            f"{world} ranks x {torch.get_num_threads()} threads, "
            f"{os.environ.get('OMP_NUM_THREADS', '?')} OMP threads; median of {args.steps} steps"
        )
        print(f"{'engine':<20} {'step (ms)':>10} {'vs torch DDP':>13}")
        for name, t in results.items():
            print(f"{name:<20} {t * 1e3:10.1f} {t / ref:12.2f}x")
    distributed.shutdown()
