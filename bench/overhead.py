"""Framework overhead: megaloop against the same looped model and training step written in plain
PyTorch inside this script, both in one process, timed in alternation, at 1 and 2 threads.

    python -m bench overhead [--threads 1,2] [--rounds 8] [--warmup 2] [--steps 100]
        [--hidden 256 --heads 4 --layers 4 --loops 4 --seq 256 --batch 4 --vocab 8192] [--profile]

Three things are timed, each against its plain-PyTorch counterpart:
- the model: forward, loss and backward of megaloop's model (megatron-core layers, the default
  per-loop objective with its diagnostics) without engine or optimizer, against
  `LoopedReference` below (pre-norm RMSNorm layers, SDPA with RoPE, SwiGLU of width 4d, no
  biases, K loops of the shared stack, an exit after every loop through one RMSNorm and the tied
  embedding, CE averaged over the exits);
- the training step: the real trainer's `train_step` (megatron engine: megatron-core DDP and
  distributed optimizer, the no-pipelining schedule, synthetic data, logged terms) against the
  step a user writes (nanoGPT's: forward, backward, clip the gradient norm, torch AdamW with no
  decay on 1-D parameters, zero the gradients);
- what a step costs seen from outside, over a run of `--steps` steps: once-per-run costs
  (imports, building, the first step's excess over a warm one; megaloop's final evaluation and
  checkpoint) spread over the run, plus the warm step.
And what the loop rebuilds in every layer, which issue 23 asks it to compute once: megaloop's
model with RoPE's cos/sin taken once per position table (`rope_tables_once`) against itself,
RoPE alone both ways (`shared_tables`), and the causal mask `model.attention=megatron` builds.

Before timing, megaloop's initial weights are loaded into the reference and both losses are
checked equal. Each round times every callable once (the order reversed every other round, so
drift in the machine's load falls on both sides alike); a ratio is the median of the per-round
ratios, with their min..max. Wall time and CPU time (the process's, every thread) are both
reported: on shared cores a process can lose wall time to others without using more CPU.
`--profile` instead compares the two training steps op by op (torch.profiler, steps
alternated) and shows megaloop's step under cProfile.

The trainer it times, `megaloop_trainer`, and its shape are bench/common/alternation.py's, which
norm_penalty and bf16 time too.
"""

import argparse
import collections
import contextlib
import math
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench import common
from bench.common.alternation import (
    BETAS,
    CLIP,
    EPS,
    LR,
    SHAPE,
    SMOKE_SHAPE,
    WEIGHT_DECAY,
    megaloop_overrides,
    megaloop_trainer,
    set_threads,
)

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


def batches(shape, seed=0):
    """Uniform random [batch, seq + 1] token windows, the same sequence on every side."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(
            0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=generator
        )


def plain_step(model):
    """The training step a user writes around `model`, nanoGPT's: AdamW (no decay on 1-D
    parameters), the gradient norm clipped."""
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

    def step(tokens):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def forward_backward(model, loss_of):
    """Forward, loss and backward alone, the gradients dropped after."""

    def step(tokens):
        loss = loss_of(model, tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    return step


def reference_loss(model, tokens):
    return model(tokens[:, :-1], tokens[:, 1:])


def megaloop_loss(objective):
    from megaloop import objectives

    def loss_of(model, tokens):
        return objectives.compute(objective, model(tokens[:, :-1], labels=tokens[:, 1:]))[0]

    return loss_of


@contextlib.contextmanager
def rope_tables_once():
    """megatron-core's RoPE with cos/sin taken once per position table, as `LoopedReference`
    does, instead of in every layer of every loop, and without its copy through an empty
    pass-through concatenation (rotary_percent=1): what computing the shared tables once would
    save, measured before the model changes."""
    from megatron.core.transformer import attention

    stock, tables = attention.apply_rotary_pos_emb, {}

    def apply(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        key = (freqs.data_ptr(), freqs.shape, t.dtype, mscale)
        if key not in tables:
            tables[key] = ((freqs.cos() * mscale).to(t.dtype), (freqs.sin() * mscale).to(t.dtype))
        cos, sin = tables[key]
        return rotate(t, cos, sin)

    attention.apply_rotary_pos_emb = apply
    try:
        yield
    finally:
        attention.apply_rotary_pos_emb = stock


def shared_tables(model, shape, threads, rounds):
    """Milliseconds a training step spends rebuilding what every layer of every loop shares
    (median of `rounds` alternated rounds, `threads` threads): RoPE on q and k, forward and
    backward, as megatron-core applies it (cos/sin in every call) and with the tables taken
    once; and the causal mask that `model.attention=megatron` builds in every layer (SDPA, the
    default, builds none)."""
    from megatron.core.transformer import attention
    from megatron.core.transformer.utils import get_default_causal_mask

    set_threads(threads)
    t, head_dim, calls = shape["seq"], shape["hidden"] // shape["heads"], shape["layers"]
    calls *= shape["loops"]
    freqs = model.rotary_pos_emb(t)
    x = torch.randn(t, shape["batch"], shape["heads"], head_dim, requires_grad=True)
    grad = torch.randn_like(x)

    def rope():
        for _ in range(2 * calls):  # q and k
            attention.apply_rotary_pos_emb(x, freqs, config=model.config).backward(grad)

    def rope_once():
        with rope_tables_once():
            rope()

    def masks():
        for _ in range(calls):
            get_default_causal_mask(t)

    parts = {"RoPE, megatron-core": rope, "RoPE, tables once": rope_once, "causal masks": masks}
    times = collections.defaultdict(list)
    for i in range(rounds + 1):
        for name in parts if i % 2 == 0 else reversed(parts):
            start = time.perf_counter()
            parts[name]()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(v) for name, v in times.items()}


# -- megaloop ----------------------------------------------------------------------------------


def import_megaloop():
    """Seconds to import what `megaloop train` imports before it builds anything."""
    start = time.perf_counter()
    from megaloop import _cpu_compat, experiment  # noqa: F401
    from megaloop.parallel import megatron  # noqa: F401
    from megaloop.train import trainer  # noqa: F401

    _cpu_compat.apply()
    return time.perf_counter() - start


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def build_sides(shape, steps, run_dir):
    """The trainer, megaloop's bare model, the timed callables (name -> step of a [batch,
    seq + 1] token window), their build seconds, and the two models' losses and parameter
    counts on one batch from the same weights (megaloop's initial ones)."""
    from megaloop.model.looped import build_model
    from megaloop.train.config import TrainConfig

    trainer, megaloop_build = timed(
        lambda: megaloop_trainer(
            megaloop_overrides(shape), steps, run_dir, eval_batches=TrainConfig.eval_batches
        )
    )
    cfg = trainer.cfg
    model = build_model(cfg.model, seed=0)
    ref = reference_model(shape)
    ref.load_state_dict({reference_name(n): p.detach() for n, p in model.named_parameters()})
    tokens = next(batches(shape, seed=1))
    loss_of = megaloop_loss(cfg.objective)
    with torch.no_grad():
        same = {
            "megaloop": loss_of(model, tokens).item(),
            "reference": reference_loss(ref, tokens).item(),
        }
        with rope_tables_once():
            same["megaloop, RoPE tables once"] = loss_of(model, tokens).item()
    params = {
        "megaloop": sum(p.numel() for p in model.parameters()),
        "reference": sum(p.numel() for p in ref.parameters()),
    }
    torch.manual_seed(0)
    plain, plain_build = timed(lambda: plain_step(reference_model(shape)))
    steps = {
        "megaloop step": lambda tokens: trainer.train_step()["loss"],
        "plain step": plain,
        "megaloop model": forward_backward(model, loss_of),
        "plain model": forward_backward(ref, reference_loss),
    }
    model_once = forward_backward(model, loss_of)

    def once(tokens):
        with rope_tables_once():
            return model_once(tokens)

    steps["megaloop model, RoPE once"] = once
    return trainer, model, steps, {"megaloop": megaloop_build, "plain": plain_build}, same, params


# -- measuring ---------------------------------------------------------------------------------


def interleave(steps, shape, threads, warmup, rounds):
    """Every callable of `steps` once a round, the order reversed every other round, with
    `threads` torch threads: per callable the wall and CPU seconds of each round and the wall
    seconds of its first call."""
    set_threads(threads)
    data = batches(shape, seed=threads)
    wall, cpu, first = (collections.defaultdict(list) for _ in range(3))
    for i in range(warmup + rounds):
        for name in steps if i % 2 == 0 else reversed(steps):
            tokens = next(data)
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[name](tokens)
            (wall if i >= warmup else first)[name].append(time.perf_counter() - start)
            if i >= warmup:
                cpu[name].append(time.process_time() - start_cpu)
        done = "warm-up" if i < warmup else "timed"
        print(f"{threads} thread(s), round {i + 1}/{warmup + rounds} ({done})", file=sys.stderr)
    return wall, cpu, {name: times[0] for name, times in first.items()}


def ratio_cell(ours, ref):
    """The median of the per-round ratios and their min..max."""
    ratios = [a / b for a, b in zip(ours, ref)]
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}..{max(ratios):.3f})"


COMPARED = [
    ("model: forward, loss, backward", "megaloop model", "plain model"),
    ("training step (optimizer included)", "megaloop step", "plain step"),
    (
        "model, RoPE cos/sin once (megaloop) vs stock (megaloop)",
        "megaloop model, RoPE once",
        "megaloop model",
    ),
]


def print_threads(threads, wall, cpu):
    for label, ours, ref in COMPARED:
        ms = [1e3 * statistics.median(wall[n]) for n in (ours, ref)]
        wall_ratio, cpu_ratio = ratio_cell(wall[ours], wall[ref]), ratio_cell(cpu[ours], cpu[ref])
        print(f"| {threads} | {label} | {ms[0]:.1f} | {ms[1]:.1f} | {wall_ratio} | {cpu_ratio} |")


def once_per_run(trainer):
    """Seconds of what `megaloop train` does once a run besides its steps."""
    return {
        "memory report (after the first step)": timed(trainer.engine.memory_report)[1],
        "final evaluation": timed(trainer.evaluate)[1],
        "final checkpoint": timed(trainer.save)[1],
    }


def outside(run_steps, fixed, warm):
    """A run of `run_steps` steps as its whole time shows it: once-per-run seconds plus the
    warm steps; (megaloop / plain) for each thread count's warm step seconds (ours, ref)."""
    return {
        threads: (fixed["megaloop"] + run_steps * ours) / (fixed["plain"] + run_steps * ref)
        for threads, (ours, ref) in warm.items()
    }


def profile_steps(steps, shape, threads, warmup, rounds, rows=30):
    """The two training steps alternated under torch.profiler: each op's self CPU milliseconds a
    step on either side, largest differences first; then cProfile's view of megaloop's step
    (its Python: schedule, optimizer, objective, logging)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    set_threads(threads)
    names, data = ("megaloop step", "plain step"), batches(shape)
    totals = {name: collections.Counter() for name in names}
    for i in range(warmup + rounds):
        for name in names:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                steps[name](next(data))
            if i >= warmup:
                for event in prof.key_averages():
                    totals[name][event.key] += event.self_cpu_time_total / 1e3 / rounds
    ours, ref = totals.values()
    print(
        f"self CPU ms a step, {threads} thread(s), mean of {rounds} alternated steps; total "
        f"megaloop {sum(ours.values()):.1f}, plain PyTorch {sum(ref.values()):.1f}\n"
    )
    print("| op | megaloop | plain PyTorch | difference |")
    print("|---|---|---|---|")
    for op in sorted(set(ours) | set(ref), key=lambda k: -abs(ours[k] - ref[k]))[:rows]:
        print(f"| {op[:70]} | {ours[op]:.1f} | {ref[op]:.1f} | {ours[op] - ref[op]:+.1f} |")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(rounds):
        steps["megaloop step"](next(data))
    profiler.disable()
    print(f"\nmegaloop, cProfile over {rounds} steps:")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(rows)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds per thread count")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds before them")
    p.add_argument("--steps", type=int, default=100, help="the run length of the outside view")
    for key, value in SHAPE.items():
        p.add_argument(f"--{key}", type=int, default=value)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        p.error(f"--threads {args.threads!r}: give thread counts like 1,2")
    if min(args.threads) < 1:
        p.error(f"--threads {args.threads}: every thread count must be >= 1")
    if common.SMOKE:  # tiny shapes, one round
        args.rounds, args.warmup = 1, 1
    args.shape = SMOKE_SHAPE if common.SMOKE else {k: getattr(args, k) for k in SHAPE}
    return args


def print_shared_tables(shape, tables, runs):
    print(
        f"\nRebuilt in every layer of every loop (ms a step, {2 * shape['layers'] * shape['loops']}"
        " RoPE calls: q and k, forward and backward):\n"
    )
    print(
        "| threads | RoPE, megatron-core | RoPE, tables once | saved | saved / megaloop step | "
        "causal masks (model.attention=megatron only) |"
    )
    print("|---|---|---|---|---|---|")
    for threads, ms in tables.items():
        saved = ms["RoPE, megatron-core"] - ms["RoPE, tables once"]
        step_ms = 1e3 * statistics.median(runs[threads][0]["megaloop step"])
        print(
            f"| {threads} | {ms['RoPE, megatron-core']:.2f} | {ms['RoPE, tables once']:.2f} | "
            f"{saved:.2f} | {100 * saved / step_ms:.2f}% | {ms['causal masks']:.2f} |"
        )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    shape = args.shape
    imports_s = import_megaloop()
    with tempfile.TemporaryDirectory() as run_dir:
        steps_run = len(args.threads) * (args.warmup + args.rounds) + 1
        trainer, model, steps, build_s, same, params = build_sides(shape, steps_run, run_dir)
        assert params["megaloop"] == params["reference"], f"parameter counts differ: {params}"
        for loss in same.values():
            assert math.isclose(loss, same["megaloop"], rel_tol=1e-5), f"losses differ: {same}"
        if args.profile:
            profile_steps(steps, shape, args.threads[-1], args.warmup, args.rounds)
            return
        runs = {t: interleave(steps, shape, t, args.warmup, args.rounds) for t in args.threads}
        set_threads(args.threads[0])
        finish = once_per_run(trainer)
        tables = {t: shared_tables(model, shape, t, 5 * args.rounds) for t in args.threads}
    wall, _, first = runs[args.threads[0]]
    excess = {n: first[n] - statistics.median(wall[n]) for n in ("megaloop step", "plain step")}
    fixed = {
        "megaloop": imports_s
        + build_s["megaloop"]
        + excess["megaloop step"]
        + sum(finish.values()),
        "plain": build_s["plain"] + excess["plain step"],
    }
    print(
        f"d={shape['hidden']}, {shape['heads']} heads, L={shape['layers']}, "
        f"K={shape['loops']}, T={shape['seq']}, B={shape['batch']}, V={shape['vocab']}, fp32, "
        f"one process; per thread count {args.warmup} untimed and {args.rounds} timed rounds "
        f"(every callable once a round, alternated)"
    )
    print(
        f"same math: loss at init {same['megaloop']:.6f} (megaloop) vs {same['reference']:.6f} "
        f"(reference), {same['megaloop, RoPE tables once']:.6f} (megaloop, RoPE tables once); "
        f"parameters {params['megaloop']:,} = {params['reference']:,}\n"
    )
    print(
        "| threads | what | megaloop (ms) | plain PyTorch (ms) | megaloop / plain, wall | "
        "in CPU time |"
    )
    print("|---|---|---|---|---|---|")
    for threads, (wall_t, cpu_t, _) in runs.items():
        print_threads(threads, wall_t, cpu_t)
    print_shared_tables(shape, tables, runs)
    print("\nOnce a run (s): megaloop | plain PyTorch\n")
    print("| part | megaloop | plain PyTorch |")
    print("|---|---|---|")
    for label, ours, ref in (
        ("imports (megaloop, megatron-core; torch is shared)", imports_s, 0.0),
        (
            "build (process groups, data, model, engine, optimizer)",
            build_s["megaloop"],
            build_s["plain"],
        ),
        (
            f"first step beyond a warm one ({args.threads[0]} thread(s))",
            excess["megaloop step"],
            excess["plain step"],
        ),
        *((f"{label} ({args.threads[0]} thread(s))", s, 0.0) for label, s in finish.items()),
        ("total", fixed["megaloop"], fixed["plain"]),
    ):
        print(f"| {label} | {ours:.2f} | {ref:.2f} |")
    warm = {
        t: tuple(statistics.median(runs[t][0][n]) for n in ("megaloop step", "plain step"))
        for t in args.threads
    }
    seen = ", ".join(f"{t} thread(s) {r:.3f}x" for t, r in outside(args.steps, fixed, warm).items())
    print(f"\nmeasured from outside over {args.steps} steps (megaloop / plain PyTorch): {seen}")
