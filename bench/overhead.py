"""Framework overhead: a megaloop training step against the same model and step written in
plain PyTorch inside this script, each side in processes of its own, alternated.

    .venv/bin/python bench/overhead.py [--pairs 3] [--steps 4] [--warmup 2] [--threads 1]
        [--hidden 256 --heads 4 --layers 4 --loops 4 --seq 256 --batch 4 --vocab 8192] [--profile]

megaloop: the real trainer (megatron engine: megatron-core DDP + distributed optimizer, the
no-pipelining schedule, the default per-loop objective with its diagnostics, synthetic data).
Reference: `LoopedReference` below, the default megaloop model's math (pre-norm RMSNorm layers,
SDPA with RoPE, SwiGLU of width 4d, no biases, K loops of the shared stack, an exit after every
loop through one RMSNorm and the tied embedding, CE averaged over exits), torch AdamW with the
same hyperparameters and no decay on 1-D parameters, gradient clipping. Before timing, the
parent builds both models from the same weights and checks that their losses agree and their
parameter counts match.

Each process sets `--threads` torch threads (one by default: 2 shared cores), runs warm-up
steps, then timed steps, and reports its median step in wall and in CPU time, and the median
time of each part of the step (data, forward + loss, backward, ...). The parent prints each
side's figures and the median of the per-pair ratios with their min..max. `--profile` instead
compares the two op by op in one process (torch.profiler, steps alternated) and shows megaloop's
step under cProfile.

norm_penalty.py and bf16.py reuse `alternate`, `megaloop_trainer` and `summary` from here.
"""

import argparse
import collections
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
SHAPE = dict(hidden=256, heads=4, layers=4, loops=4, seq=256, batch=4, vocab=8192)
SMOKE_SHAPE = dict(hidden=32, heads=4, layers=2, loops=2, seq=16, batch=2, vocab=256)


# -- the reference: plain PyTorch --------------------------------------------------------------


def rotate(x, cos, sin):
    """RoPE on [b, heads, t, head_dim], halves rotated (megatron-core's non-interleaved form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.linear_qkv = nn.Linear(d, 3 * d, bias=False)  # per head [q; k; v], as megatron-core
        self.linear_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        qkv = self.linear_qkv(x).view(b, t, self.heads, 3 * d // self.heads).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(
            rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True
        )
        return self.linear_proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.linear_fc1 = nn.Linear(d, 2 * ffn, bias=False)  # [gate; up]
        self.linear_fc2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, d, heads, ffn, eps):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.self_attention = Attention(d, heads)
        self.pre_mlp_layernorm = nn.RMSNorm(d, eps=eps)
        self.mlp = SwiGLU(d, ffn)

    def forward(self, x, cos, sin):
        x = x + self.self_attention(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class LoopedReference(nn.Module):
    """Embedding, then L layers applied K times; after every loop an exit reads
    RMSNorm(H_k) through the tied embedding, and the loss is the mean of the K exits' CE."""

    def __init__(
        self, vocab, d, heads, layers, loops, seq_len, ffn=None, eps=1e-5, rope_base=10000.0
    ):
        super().__init__()
        self.loops = loops
        self.embedding = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, ffn or 4 * d, eps) for _ in range(layers))
        self.readout_norm = nn.RMSNorm(d, eps=eps)
        head_dim = d // heads
        inv_freq = 1.0 / rope_base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq_len).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels):
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        h = self.embedding(tokens)
        ce = []
        for _ in range(self.loops):
            for layer in self.layers:
                h = layer(h, cos, sin)
            logits = F.linear(self.readout_norm(h), self.embedding.weight)
            ce.append(F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()))
        return torch.stack(ce).mean()


MEGALOOP_NAMES = {"embedding.word_embeddings.": "embedding.", "readout.norm.": "readout_norm."}


def reference_name(megaloop_name):
    """A megaloop parameter's name in LoopedReference (the layers' names are megatron-core's)."""
    for old, new in MEGALOOP_NAMES.items():
        megaloop_name = megaloop_name.replace(old, new)
    return megaloop_name


def reference_model(shape):
    return LoopedReference(
        shape["vocab"],
        shape["hidden"],
        shape["heads"],
        shape["layers"],
        shape["loops"],
        shape["seq"],
    )


class Phases:
    """Seconds a step spends in named parts (each side decides which calls are timed); a part
    timed inside another counts only for itself, so the parts add up to at most the step."""

    def __init__(self):
        self.step = collections.Counter()
        self.inner = []

    @contextlib.contextmanager
    def time(self, phase):
        start = time.perf_counter()
        self.inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.step[phase] += elapsed - self.inner.pop()
            if self.inner:
                self.inner[-1] += elapsed

    def wrap(self, owner, name, phase):
        """Time every call of `owner.name` as `phase`."""
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            with self.time(phase):
                return fn(*args, **kwargs)

        setattr(owner, name, timed)

    def take(self):
        step, self.step = self.step, collections.Counter()
        return step


PHASES = {
    "data": "data",
    "forward": "forward + loss",
    "backward": "backward",
    "grads": "gradient finalize (DP all-reduce)",
    "optimizer": "zero grads, clip, optimizer, schedule",
    "terms": "logged terms to numbers",
    "other": "rest of the step",
}


def torch_side(shape, phases, seed=0):
    """(step function, parameter count) of the reference."""
    torch.manual_seed(seed)
    model = reference_model(shape)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )
    generator = torch.Generator().manual_seed(seed)

    def step():
        with phases.time("data"):
            tokens = torch.randint(
                0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=generator
            )
        with phases.time("forward"):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        with phases.time("backward"):
            loss.backward()
        with phases.time("optimizer"):
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with phases.time("terms"):
            return loss.item()

    return step, sum(p.numel() for p in model.parameters())


# -- megaloop ----------------------------------------------------------------------------------


def megaloop_overrides(shape):
    return [
        f"model.hidden_size={shape['hidden']}",
        f"model.num_heads={shape['heads']}",
        f"model.num_layers={shape['layers']}",
        f"model.num_loops={shape['loops']}",
        f"model.vocab_size={shape['vocab']}",
        f"model.max_seq_len={shape['seq']}",
        f"data.seq_len={shape['seq']}",
        f"train.micro_batch_size={shape['batch']}",
        f"train.global_batch_size={shape['batch']}",
        f"optim.lr={LR}",
        f"optim.beta1={BETAS[0]}",
        f"optim.beta2={BETAS[1]}",
        f"optim.eps={EPS}",
        f"optim.weight_decay={WEIGHT_DECAY}",
        f"optim.clip_grad={CLIP}",
        "optim.warmup_steps=0",
    ]


def megaloop_trainer(overrides, steps, run_dir, config=None):
    """The real trainer of `config` + `overrides` on synthetic data, for `steps` steps."""
    from megaloop import _cpu_compat, experiment

    _cpu_compat.apply()
    cfg = experiment.load(
        config,
        [
            *overrides,
            "data.kind=synthetic",
            f"train.steps={steps}",
            f"train.dir={run_dir}",
            "wandb.mode=disabled",
            "train.eval_batches=1",
        ],
    )
    return experiment.build_trainer(cfg, log=False)


def megaloop_side(shape, steps, run_dir, phases):
    """(step function, parameter count) of the trainer, its parts timed where they are called
    (megatron-core's schedule calls forward_step and backward_step by their module names); the
    engine's step outside them is the optimizer's part."""
    from megatron.core.pipeline_parallel import schedules

    trainer = megaloop_trainer(megaloop_overrides(shape), steps, run_dir)
    engine = trainer.engine
    phases.wrap(trainer.batches, "next_step", "data")
    phases.wrap(schedules, "forward_step", "forward")
    phases.wrap(schedules, "backward_step", "backward")
    phases.wrap(engine.config, "finalize_model_grads_func", "grads")
    phases.wrap(engine, "train_step", "optimizer")
    phases.wrap(engine, "reduce", "terms")
    params = sum(p.numel() for p in engine.module.parameters())
    return (lambda: trainer.train_step()["loss"]), params


def check_same_math(shape):
    """Both models from megaloop's initial weights on one batch: (megaloop loss, reference loss,
    megaloop parameters, reference parameters)."""
    from megaloop import _cpu_compat, experiment, objectives
    from megaloop.model.looped import build_model
    from megaloop.parallel import distributed

    _cpu_compat.apply()
    distributed.init(seed=0)
    cfg = experiment.load(None, megaloop_overrides(shape))
    ours = build_model(cfg.model, seed=0)
    ref = reference_model(shape)
    ref.load_state_dict({reference_name(n): p.detach() for n, p in ours.named_parameters()})
    tokens = torch.randint(
        0,
        shape["vocab"],
        (shape["batch"], shape["seq"] + 1),
        generator=torch.Generator().manual_seed(1),
    )
    with torch.no_grad():
        loss, _ = objectives.compute(cfg.objective, ours(tokens[:, :-1], labels=tokens[:, 1:]))
        ref_loss = ref(tokens[:, :-1], tokens[:, 1:])
    distributed.shutdown()
    return (
        loss.item(),
        ref_loss.item(),
        sum(p.numel() for p in ours.parameters()),
        sum(p.numel() for p in ref.parameters()),
    )


# -- measuring ---------------------------------------------------------------------------------


def set_threads(threads=1):
    torch.set_num_threads(threads)


def time_steps(step, warmup, steps, phases=None):
    """Over `steps` calls after `warmup` calls: the median wall and CPU milliseconds of a step,
    the last loss, and the median wall milliseconds of each part of `phases` (what no part timed
    as `other`). With one thread, CPU time leaves out the time other processes take the core,
    so it spreads less than wall time on a shared machine (contention for caches and memory
    still shows)."""
    wall, cpu, parts = [], [], collections.defaultdict(list)
    for i in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = step()
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        timed = phases.take() if phases else {}
        if i >= warmup:
            wall.append(elapsed)
            cpu.append(elapsed_cpu)
            for phase in PHASES:
                parts[phase].append(timed.get(phase, 0.0))
            parts["other"][-1] = elapsed - sum(timed.values())
    return {
        "step_ms": 1e3 * statistics.median(wall),
        "cpu_ms": 1e3 * statistics.median(cpu),
        "loss": loss,
        "phases_ms": {k: 1e3 * statistics.median(v) for k, v in parts.items()},
    }


def report(**result):
    """The child's one line for the parent."""
    print("RESULT " + json.dumps(result), flush=True)


def run_child(script, args, threads=1):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "WANDB_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(
            f"{os.path.basename(script)} {' '.join(args)} failed "
            f"(exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def alternate(script, sides, pairs, args, threads=1):
    """Run `script --side S ARGS` for each side in turn, `pairs` times (A B A B ...), one
    process each with `threads` threads; the children's results per side, in order."""
    results = {side: [] for side in sides}
    for i in range(pairs):
        for side in sides:
            results[side].append(run_child(script, ["--side", side, *args], threads))
            last = results[side][-1]
            cpu = f" ({last['cpu_ms']:.1f} ms CPU)" if "cpu_ms" in last else ""
            print(
                f"pair {i + 1}/{pairs} {side}: {last['step_ms']:.1f} ms{cpu}",
                file=sys.stderr,
                flush=True,
            )
    return results


def summary(ratios, resamples=2000, seed=0):
    """(median, min, max, 95% bootstrap interval of the median) of per-pair ratios."""
    import random

    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return (
        statistics.median(ratios),
        min(ratios),
        max(ratios),
        (medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]),
    )


def sign_test(ratios):
    """Two-sided sign-test p-value of "ratio 1": how often pairs split this unevenly by chance."""
    n, above = len(ratios), sum(r > 1 for r in ratios)
    tail = sum(math.comb(n, i) for i in range(min(above, n - above) + 1)) / 2**n
    return min(1.0, 2 * tail)


def spread(values):
    return f"{min(values):.1f}..{max(values):.1f}"


def profile_both(shape, warmup, steps, rows=30):
    """Both sides in this process, their steps alternated under torch.profiler: each op's self
    CPU milliseconds a step on either side, largest differences first; then cProfile's view of
    the megaloop step (its Python: schedule, optimizer, objective, logging)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    set_threads()
    totals = {"megaloop": collections.Counter(), "torch": collections.Counter()}
    with tempfile.TemporaryDirectory() as run_dir:
        sides = {
            "megaloop": megaloop_side(shape, warmup + 2 * steps, run_dir, Phases())[0],
            "torch": torch_side(shape, Phases())[0],
        }
        for _ in range(warmup):
            for step in sides.values():
                step()
        for _ in range(steps):
            for side, step in sides.items():
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step()
                for event in prof.key_averages():
                    totals[side][event.key] += event.self_cpu_time_total / 1e3 / steps
        ours, ref = totals["megaloop"], totals["torch"]
        print(
            f"self CPU ms a step, mean of {steps} alternated steps; total megaloop "
            f"{sum(ours.values()):.1f}, plain PyTorch {sum(ref.values()):.1f}\n"
        )
        print("| op | megaloop | plain PyTorch | difference |")
        print("|---|---|---|---|")
        for op in sorted(set(ours) | set(ref), key=lambda k: -abs(ours[k] - ref[k]))[:rows]:
            print(f"| {op[:70]} | {ours[op]:.1f} | {ref[op]:.1f} | {ours[op] - ref[op]:+.1f} |")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            sides["megaloop"]()
        profiler.disable()
    print(f"\nmegaloop, cProfile over {steps} steps:")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=2)
    for key, value in SHAPE.items():
        p.add_argument(f"--{key}", type=int, default=value)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one pair, one step")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--side", choices=["megaloop", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = SMOKE_SHAPE if args.smoke else {k: getattr(args, k) for k in SHAPE}
    if args.smoke:
        args.pairs, args.steps, args.warmup = 1, 1, 1
    if args.side:
        set_threads(args.threads)
        phases = Phases()
        with tempfile.TemporaryDirectory() as run_dir:
            step, params = (
                megaloop_side(shape, args.warmup + args.steps, run_dir, phases)
                if args.side == "megaloop"
                else torch_side(shape, phases)
            )
            result = time_steps(step, args.warmup, args.steps, phases)
        report(**result, params=params, threads=torch.get_num_threads())
        return
    if args.profile:
        profile_both(shape, args.warmup, args.steps)
        return
    set_threads()
    ours, ref, n_ours, n_ref = check_same_math(shape)
    assert n_ours == n_ref, f"parameter counts differ: megaloop {n_ours:,}, reference {n_ref:,}"
    assert math.isclose(ours, ref, rel_tol=1e-4), f"losses differ: {ours} vs {ref}"
    child = [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        *[a for k in SHAPE for a in (f"--{k}", str(shape[k]))],
    ]
    results = alternate(__file__, ("megaloop", "torch"), args.pairs, child, args.threads)
    ml, pt = ([r["step_ms"] for r in results[side]] for side in ("megaloop", "torch"))
    ml_cpu, pt_cpu = ([r["cpu_ms"] for r in results[side]] for side in ("megaloop", "torch"))
    ratio, low, high, (ci_low, ci_high) = summary([a / b for a, b in zip(ml, pt)])
    cpu_ratio, cpu_low, cpu_high, _ = summary([a / b for a, b in zip(ml_cpu, pt_cpu)])
    print(
        f"d={shape['hidden']}, {shape['heads']} heads, L={shape['layers']}, "
        f"K={shape['loops']}, T={shape['seq']}, B={shape['batch']}, V={shape['vocab']}, fp32, "
        f"{args.threads} thread(s) a process; {args.pairs} pairs of processes (megaloop, torch, "
        f"...), each the median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        f"same math: loss at init {ours:.6f} (megaloop) vs {ref:.6f} (reference); "
        f"parameters {n_ours:,} = {n_ref:,}\n"
    )
    print(
        "| side | parameters | step (ms) | per-process medians (ms) | CPU time (ms) | "
        "per-process CPU (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for label, n, w, c in (("megaloop", n_ours, ml, ml_cpu), ("plain PyTorch", n_ref, pt, pt_cpu)):
        print(
            f"| {label} | {n:,} | {statistics.median(w):.1f} | {spread(w)} | "
            f"{statistics.median(c):.1f} | {spread(c)} |"
        )
    print(
        f"\nmegaloop / plain PyTorch: {ratio:.3f}x (median of {args.pairs} per-pair ratios, "
        f"min..max {low:.3f}..{high:.3f}, bootstrap 95% {ci_low:.3f}..{ci_high:.3f}); "
        f"in CPU time: {cpu_ratio:.3f}x (min..max {cpu_low:.3f}..{cpu_high:.3f}); goal <= 1.05: "
        f"{'met' if ratio <= 1.05 else 'missed'} (wall), "
        f"{'met' if cpu_ratio <= 1.05 else 'missed'} (CPU)\n"
    )
    print("Where the step goes (ms; per part, the median over processes of each one's median):\n")
    print("| part | megaloop | plain PyTorch | megaloop - PyTorch |")
    print("|---|---|---|---|")
    for phase, label in PHASES.items():
        a = statistics.median(r["phases_ms"][phase] for r in results["megaloop"])
        b = statistics.median(r["phases_ms"][phase] for r in results["torch"])
        print(f"| {label} | {a:.1f} | {b:.1f} | {a - b:+.1f} |")


if __name__ == "__main__":
    main()
