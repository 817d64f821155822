"""The parallel layout (TP × PP × DP) and its checks, made before any compute."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from megaloop.config import Config, ConfigError, check, fail


@dataclass
class ParallelConfig(Config):
    tp: int = 1
    """Tensor parallel size (megatron-core column/row parallel layers)."""
    pp: int = 1
    """Pipeline parallel size: the circular pipeline, one lap of the ring per loop."""
    timeout_s: float = 600.0
    """How long a collective waits for the other ranks before the run gives up (the process
    groups' timeout): the bound on a run whose rank died. Our choice: 10 minutes (torch's
    default is 10 for NCCL, 30 for gloo); a checkpoint save must fit in it."""

    def validate(self, prefix: str = "") -> None:
        check(self.tp >= 1, prefix + "tp", self.tp, "must be >= 1")
        check(self.pp >= 1, prefix + "pp", self.pp, "must be >= 1")
        check(self.timeout_s > 0, prefix + "timeout_s", self.timeout_s, "must be > 0 seconds")


@dataclass
class DeepSpeedConfig(Config):
    zero_stage: int = 1
    """0 = plain data parallel, 1 = optimizer state, 2 = + gradients, 3 = + parameters sharded."""
    param_persistence_threshold: int = 100_000
    """ZeRO-3 keeps parameters with fewer elements than this whole on every rank."""

    def validate(self, prefix: str = "") -> None:
        check(
            self.zero_stage in (0, 1, 2, 3),
            prefix + "zero_stage",
            self.zero_stage,
            "allowed: 0, 1, 2, 3",
        )
        check(
            self.param_persistence_threshold >= 0,
            prefix + "param_persistence_threshold",
            self.param_persistence_threshold,
            "must be >= 0",
        )


def data_parallel_size(cfg, world_size: int) -> int:
    """Check the layout against the model, the batch and the world; return DP."""
    par, model, train = cfg.parallel, cfg.model, cfg.train
    if world_size % (par.tp * par.pp):
        fail(
            "parallel",
            f"tp={par.tp} pp={par.pp}",
            f"world size {world_size} must be a multiple of tp*pp={par.tp * par.pp} "
            f"(world size = TP*PP*DP); launch with a matching --nproc-per-node/--ntasks or "
            f"change parallel.tp / parallel.pp",
        )
    dp = world_size // (par.tp * par.pp)
    groups = model.num_query_groups or model.num_heads
    check(
        model.num_heads % par.tp == 0 and groups % par.tp == 0,
        "parallel.tp",
        par.tp,
        f"must divide model.num_heads={model.num_heads} and the key/value heads ({groups})",
    )
    check(
        model.ffn_size % par.tp == 0,
        "parallel.tp",
        par.tp,
        f"must divide the SwiGLU hidden size {model.ffn_size}",
    )
    check(
        model.vocab_size % par.tp == 0,
        "parallel.tp",
        par.tp,
        f"must divide model.vocab_size={model.vocab_size}",
    )
    check(
        model.num_layers % par.pp == 0,
        "parallel.pp",
        par.pp,
        f"must divide model.num_layers={model.num_layers} (each rank holds L/PP layers)",
    )
    per_rank = train.global_batch_size // dp
    check(
        train.global_batch_size % (train.micro_batch_size * dp) == 0,
        "train.global_batch_size",
        train.global_batch_size,
        f"must be a multiple of micro_batch_size*DP = {train.micro_batch_size}*{dp}",
    )
    microbatches = per_rank // train.micro_batch_size
    check(
        par.pp == 1 or microbatches % par.pp == 0,
        "train.global_batch_size",
        train.global_batch_size,
        f"gives {microbatches} micro-batches per step on each pipeline; the circular pipeline "
        f"(megatron-core's interleaved schedule) needs a multiple of parallel.pp={par.pp}",
    )
    check(
        train.eval_batches == "all"
        or (train.eval_batches % dp == 0 and (train.eval_batches // dp) % par.pp == 0),
        "train.eval_batches",
        train.eval_batches,
        f"must split evenly over DP={dp} ranks into a multiple of parallel.pp={par.pp} "
        f"micro-batches each (or be `all`)",
    )
    return dp


def eval_microbatches(train, valid_windows: int | None, dp: int, pp: int) -> int:
    """Validation micro-batches of a run: micro-batch j holds windows [j·b, (j+1)·b) of the
    validation split (b = micro_batch_size), so a number evaluates the same windows in every
    layout. `all` is as many as fit the split evenly over DP ranks and the pipeline's multiple
    of PP micro-batches: the split's longest such prefix. Checked before any compute."""
    b, per_round = train.micro_batch_size, dp * pp
    if train.eval_batches == "all":
        check(
            valid_windows is not None,
            "train.eval_batches",
            "all",
            "this data has no finite validation split (data.kind=synthetic); give a number of "
            "micro-batches, e.g. train.eval_batches=16",
        )
        count = valid_windows // (b * per_round) * per_round
        check(
            count > 0,
            "train.eval_batches",
            "all",
            f"the validation split has {valid_windows} windows of data.seq_len+1 tokens, fewer "
            f"than one micro-batch (train.micro_batch_size={b}) on each of the DP={dp} x "
            f"PP={pp} pipelines; use more validation data or a smaller micro-batch",
        )
        return count
    check(
        valid_windows is None or train.eval_batches * b <= valid_windows,
        "train.eval_batches",
        train.eval_batches,
        f"asks for {train.eval_batches * b} windows (x micro_batch_size={b}), but the "
        f"validation split has {valid_windows}; use train.eval_batches=all or at most "
        f"{(valid_windows or 0) // b}",
    )
    return train.eval_batches


def params_per_rank(model, tp: int, pp: int, pp_rank: int) -> int:
    """Parameters held by one rank of pipeline stage `pp_rank` (any tensor-parallel rank):
    the stage's L/PP layers once (not once per loop), plus the embedding on the first stage and
    the readout (with the shared loop norm, if any) on the last (a tied W_out is a copy there
    when PP > 1)."""
    d, ffn, V = model.hidden_size, model.ffn_size, model.vocab_size
    head = d // model.num_heads
    kv = (model.num_query_groups or model.num_heads) * head
    norms = 4 if model.layer_norms == "sandwich" else 2
    layer = (d * (d + 2 * kv) + d * d + 3 * ffn * d) // tp + norms * d
    count = layer * model.num_layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        recurrence = {
            "none": 0,
            "rmsnorm": d,
            "damping": d if model.damping_shape == "channel" else 1,
        }
        count += V * d // tp + recurrence[model.recurrence]
    if last:
        shared = model.loop_norm == "shared"
        count += d if shared or model.readout != "raw" else 0  # the loop's or readout's norm
        count += (d + 1) if model.exit_gate else 0
        if not model.tie_embeddings or not first:
            count += V * d // tp
    return count


def parameter_counts(model) -> dict[str, int]:
    """Embedding and non-embedding parameters of the whole model (a tied W_out counts once):
    the same figures as LoopedLM.num_parameters(), without building anything."""
    total = params_per_rank(model, 1, 1, 0)
    embedding = model.vocab_size * model.hidden_size * (1 if model.tie_embeddings else 2)
    return {"embedding": embedding, "non_embedding": total - embedding, "total": total}


def flops_per_token(model, seq_len: int, loss_exits: int) -> float:
    """Training matmul FLOPs per token at K = model.num_loops: the forward pass (the shared
    stack's weights K times, attention scores and values 4·s·d per layer application, and the
    logits of every one of the K exits) and a backward pass of twice the forward of what the
    loss reaches (`loss_exits` exits: 1 for the terminal objective, K otherwise)."""
    d, K, L = model.hidden_size, model.num_loops, model.num_layers
    kv = (model.num_query_groups or model.num_heads) * (d // model.num_heads)
    layer = 2 * (d * (d + 2 * kv) + d * d + 3 * model.ffn_size * d) + 4 * seq_len * d
    readout = 2 * d * model.vocab_size
    return 3.0 * layer * L * K + readout * (K + 2 * loss_exits)


def loss_exits(cfg) -> int:
    return 1 if cfg.objective.kind == "terminal" else cfg.model.num_loops


PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}
"""Dense bf16 peak of one GPU (SXM), by a name torch.cuda.get_device_name() contains: the
denominator of MFU, as torchtitan and Megatron-LM count it (whatever precision the run uses)."""


def peak_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPUs, unlisted GPUs: no MFU)."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


# -- activations: what autograd keeps for backward -----------------------------------------------
# Values per token, counted from the tensors megatron-core's layers save with SDPA in the
# core-attention slot (tests/test_layout.py holds the formula to the saved-tensor measurement).
# `shared`: split over TP ranks (attention and MLP internals); `replicated`: the residual stream
# and the norms, which every TP rank keeps whole (no sequence parallelism).


def _layer_values(model, seq_len: int, tp: int, recompute: str) -> tuple[float, float]:
    """(replicated, shared) values per token of one layer application."""
    d, f, h = model.hidden_size, model.ffn_size, model.num_heads
    kv = (model.num_query_groups or h) * (d // h)
    if recompute in ("full", "loop"):
        return (d if recompute == "full" else 0), 0.0
    norms = 4 if model.layer_norms == "sandwich" else 2
    replicated = d + norms * (2 * d + 1)  # the layer's input; each norm's input x·rstd and output
    shared = 3 * d + 3 * kv + h + 5 * f  # qkv, q and k copies, SDPA out and log-sum-exp, SwiGLU
    if model.attention == "megatron" and recompute != "selective":
        shared += 2 * h * seq_len  # the s×s scores and their softmax
    return replicated, shared / tp


def _exit_values(model, tp: int, loop: int, keep_logits: bool) -> float:
    """Values per token one exit keeps: its fp32 logits (the CE's softmax), its norm, the gate."""
    d = model.hidden_size
    normed = (
        model.loop_norm == "shared"
        or model.readout == "norm"
        or (model.readout == "final_norm" and loop == model.num_loops)
    )
    return (
        model.vocab_size / tp * (2 if keep_logits else 1)
        + (2 * d + 1 if normed else 0)
        + (d + 2 if model.exit_gate else 0)
    )


def in_flight(pp: int, rank: int, chunks: int, microbatches: int) -> int:
    """Micro-batch chunks whose activations a pipeline rank holds at its peak under
    megatron-core's interleaved 1F1B schedule (a chunk = one lap of the ring on this stage):
    its warm-up forwards plus the one of the steady state."""
    if pp == 1:
        return 1
    warmup = (pp - rank - 1) * 2 + (chunks - 1) * pp
    return min(warmup + 1, chunks * microbatches)


def activation_bytes(cfg, tp: int, pp: int, dp: int, micro_batch: int) -> dict:
    """Activation bytes of the most loaded rank for one step: `per_loop` is one loop of one
    micro-batch on a stage (its L/PP layer applications, and the exit on the last stage),
    `total` the peak over the pipeline schedule. fp32 counts are measured; under bf16 autocast
    the shared part (matmul outputs) is counted at 2 bytes, plus the bf16 copies of the norms'
    outputs the linears save (an estimate: check with bench/gpu.sh on a GPU)."""
    model, train = cfg.model, cfg.train
    s, K, layers = cfg.data.seq_len, model.num_loops, model.num_layers // pp
    tokens = s * micro_batch
    replicated, shared = _layer_values(model, s, tp, train.recompute)
    bf16_copies = (
        4 * model.hidden_size if train.bf16 and train.recompute in ("none", "selective") else 0
    )
    layer = 4 * replicated + (2 if train.bf16 else 4) * shared + bf16_copies  # 0 under `loop`
    per_lap = 4.0 * model.hidden_size if train.recompute == "loop" else 0.0  # a lap's input
    keep = cfg.objective.needs_logits
    microbatches = max(1, train.global_batch_size // (micro_batch * dp))
    worst = {"per_loop": 0, "total": 0}
    for rank in range(pp):
        last = rank == pp - 1
        laps = [
            tokens
            * (layers * layer + per_lap + (4 * _exit_values(model, tp, k, keep) if last else 0))
            for k in range(1, K + 1)
        ]
        first = 4 * tokens * (model.hidden_size + 2) if rank == 0 else 0
        if pp == 1:
            total = sum(laps) + first
        else:
            total = in_flight(pp, rank, K, microbatches) * max(laps) + first
        if total > worst["total"]:
            worst = {"per_loop": int(max(laps)), "total": int(total)}
    return worst


# -- weights, gradients and optimizer state -----------------------------------------------------


def state_bytes(cfg, tp: int, pp: int, dp: int) -> dict:
    """Bytes of weights, gradients and optimizer state on the largest stage's rank, for the
    config's engine. megatron: fp32 weights and gradient buffer (bf16 is autocast), Adam's two
    fp32 moments sharded over DP by the distributed optimizer (up to megatron-core's alignment
    padding of each parameter to 64 values). DeepSpeed, fp32: ZeRO-0 keeps everything whole;
    ZeRO-1/2 add an fp32 master partition beside the moments (12 bytes/DP a parameter), ZeRO-2
    partitions gradients, ZeRO-3 also the weights. DeepSpeed with bf16 holds bf16 weights and
    gradients."""
    n = max(params_per_rank(cfg.model, tp, pp, r) for r in range(pp))
    if cfg.engine == "megatron":
        return {"params": n, "weights": 4 * n, "grads": 4 * n, "optimizer": 8 * n / dp}
    stage, width = cfg.deepspeed.zero_stage, 2 if cfg.train.bf16 else 4
    sharded = lambda on: n / dp if on else n  # noqa: E731
    return {
        "params": n,
        "weights": width * sharded(stage == 3),
        "grads": width * sharded(stage >= 2),
        "optimizer": 8 * n if stage == 0 and not cfg.train.bf16 else 12 * n / dp,
    }


# -- the plan: one layout's memory and time, and the search over layouts ---------------------------

USABLE = 0.9
"""Our choice: plan against 90% of a GPU's memory (the CUDA context, the allocator's
fragmentation and communication buffers take the rest)."""


@dataclass
class Plan:
    engine: str
    zero_stage: int | None
    recompute: str
    tp: int
    pp: int
    dp: int
    micro_batch: int
    params: int
    """Parameters on the largest stage's rank."""
    weights: float
    grads: float
    optimizer: float
    activations: int
    activations_per_loop: int
    max_micro_batch: int
    """The largest micro-batch whose memory fits (0: not even one sequence)."""
    step_seconds: float | None
    tokens_per_day: float | None

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    def fits(self, gpu_mem_gib: float) -> bool:
        return self.total <= USABLE * gpu_mem_gib * 2**30

    @property
    def name(self) -> str:
        engine = self.engine if self.zero_stage is None else f"deepspeed ZeRO-{self.zero_stage}"
        return (
            f"{engine}, TP={self.tp} PP={self.pp} DP={self.dp}, micro-batch "
            f"{self.micro_batch}, recompute={self.recompute}"
        )


def step_seconds(cfg, gpus: int, tflops: float, mfu: float, dp: int) -> float:
    """One optimizer step's time at `mfu` of `tflops` per GPU: the training FLOPs, the forward
    that recompute repeats (the stack for full/loop, attention's core for selective) and the
    interleaved pipeline's bubble ((PP-1)/(M·K) of the step, M micro-batches a pipeline);
    communication is taken to hide inside the MFU."""
    model, train, s = cfg.model, cfg.train, cfg.data.seq_len
    flops = flops_per_token(model, s, loss_exits(cfg))
    applications = model.num_layers * model.num_loops
    if train.recompute in ("full", "loop"):
        flops += (
            flops_per_token(model, s, 0)
            - 2 * model.hidden_size * model.vocab_size * model.num_loops
        ) / 3
    elif train.recompute == "selective":
        flops += 4 * s * model.hidden_size * applications
    seconds = flops * train.global_batch_size * s / (gpus * tflops * 1e12 * mfu)
    pp = cfg.parallel.pp
    if pp > 1:
        microbatches = train.global_batch_size // (train.micro_batch_size * dp)
        seconds *= 1 + (pp - 1) / (microbatches * model.num_loops)
    return seconds


def plan(cfg, gpus: int, gpu_mem_gib: float, tflops: float, mfu: float) -> Plan:
    """Memory per GPU and time per step of the config's own layout on `gpus` GPUs (DP is what
    TP×PP leaves). Bad layouts fail here, naming the key, as they would in `megaloop train`."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    dp = data_parallel_size(cfg, gpus)
    state = state_bytes(cfg, tp, pp, dp)
    b = cfg.train.micro_batch_size
    acts = activation_bytes(cfg, tp, pp, dp, b)
    free = USABLE * gpu_mem_gib * 2**30 - state["weights"] - state["grads"] - state["optimizer"]
    per_sample = activation_bytes(cfg, tp, pp, dp, 1)["total"]
    seconds = step_seconds(cfg, gpus, tflops, mfu, dp)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return Plan(
        cfg.engine,
        cfg.deepspeed.zero_stage if cfg.engine == "deepspeed" else None,
        cfg.train.recompute,
        tp,
        pp,
        dp,
        b,
        state["params"],
        state["weights"],
        state["grads"],
        state["optimizer"],
        acts["total"],
        acts["per_loop"],
        max(0, int(free // per_sample)),
        seconds,
        86400 * tokens / seconds,
    )


def candidates(cfg, gpus_per_node: int):
    """Every (engine, ZeRO stage, TP, PP, recompute) worth trying: TP within a node and a power
    of two, PP dividing L, DeepSpeed without pipelines."""
    tps = [t for t in (1, 2, 4, 8) if t <= max(gpus_per_node, 1)]
    pps = [p for p in range(1, cfg.model.num_layers + 1) if cfg.model.num_layers % p == 0]
    for recompute in ("none", "selective", "full", "loop"):
        for tp in tps:
            for pp in pps:
                yield "megatron", None, tp, pp, recompute
            for stage in (0, 1, 2, 3):
                yield "deepspeed", stage, tp, 1, recompute


def with_layout(cfg, engine: str, stage: int | None, tp: int, pp: int, recompute: str):
    out = copy.deepcopy(cfg)
    out.engine, out.parallel.tp, out.parallel.pp, out.train.recompute = engine, tp, pp, recompute
    if stage is not None:
        out.deepspeed.zero_stage = stage
    return out


def search(
    cfg, gpus: int, gpu_mem_gib: float, tflops: float, mfu: float, gpus_per_node: int = 8
) -> tuple[list[Plan], list[str]]:
    """The layouts that fit `gpus` GPUs of `gpu_mem_gib`, fastest first; among equal times the
    smallest model-parallel degree (Megatron's advice), then anything but ZeRO-3 (which
    all-gathers the shared stack again at every loop), then the megatron engine, then the least
    memory. Also: why each other layout was left out."""
    plans, left_out = [], []
    for engine, stage, tp, pp, recompute in candidates(cfg, min(gpus, gpus_per_node)):
        trial = with_layout(cfg, engine, stage, tp, pp, recompute)
        try:
            p = plan(trial, gpus, gpu_mem_gib, tflops, mfu)
        except ConfigError as e:
            left_out.append(f"{engine} TP={tp} PP={pp}: {e}")
            continue
        if p.fits(gpu_mem_gib):
            plans.append(p)
        else:
            left_out.append(f"{p.name}: {p.total / 2**30:.1f} GiB")
    plans.sort(
        key=lambda p: (
            round(p.step_seconds, 6),
            p.tp * p.pp,
            p.zero_stage == 3,
            p.engine != "megatron",
            p.total,
        )
    )
    return plans, left_out


def describe_model(cfg) -> str:
    model, s = cfg.model, cfg.data.seq_len
    counts = parameter_counts(model)
    train = flops_per_token(model, s, loss_exits(cfg))
    return (
        f"parameters: {counts['total']:,} ({counts['embedding']:,} embedding, "
        f"{counts['non_embedding']:,} non-embedding)\n"
        f"FLOPs per token, training at K={model.num_loops}, seq {s} (matmuls; every exit's "
        f"logits, backward through the {loss_exits(cfg)} the loss reads): {train:.4g}"
    )


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def describe(p: Plan, cfg, gpu_mem_gib: float, tflops: float, mfu: float) -> str:
    usable = USABLE * gpu_mem_gib * 2**30
    verdict = "fits" if p.fits(gpu_mem_gib) else "does NOT fit"
    return "\n".join(
        [
            f"layout: {p.name}",
            f"per GPU (the largest stage's rank: {p.params:,} parameters):",
            f"  weights      {_gib(p.weights)}",
            f"  gradients    {_gib(p.grads)}",
            f"  optimizer    {_gib(p.optimizer)}",
            f"  activations  {_gib(p.activations)} (one loop of one micro-batch: "
            f"{_gib(p.activations_per_loop)}; K={cfg.model.num_loops}, peak over the schedule)",
            f"  total        {_gib(p.total)}: {verdict} in {USABLE:.0%} of {gpu_mem_gib:g} GiB "
            f"({_gib(usable)})",
            f"largest micro-batch that fits: {p.max_micro_batch}",
            f"step ({cfg.train.global_batch_size} x {cfg.data.seq_len} tokens): "
            f"{p.step_seconds:.3g} s at {mfu:.0%} MFU of {tflops:g} TFLOP/s per GPU; "
            f"{p.tokens_per_day / 1e9:.3g}B tokens/day",
        ]
    )


def ranking(
    plans: list[Plan], left_out: list[str], gpus: int, gpu_mem_gib: float, top: int = 20
) -> str:
    lines = [
        f"{len(plans)} layouts fit {gpus} GPUs of {gpu_mem_gib:g} GiB, fastest first "
        f"(compute, recompute and pipeline bubble; communication not modelled: among equal "
        f"times prefer the top row, the smallest TP x PP):",
        "",
        "| # | engine | TP | PP | DP | recompute | GiB per GPU | max micro-batch | step (s) "
        "| tokens/day |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(plans[:top], 1):
        engine = p.engine if p.zero_stage is None else f"ZeRO-{p.zero_stage}"
        lines.append(
            f"| {i} | {engine} | {p.tp} | {p.pp} | {p.dp} | {p.recompute} | "
            f"{p.total / 2**30:.1f} | {p.max_micro_batch} | {p.step_seconds:.3g} | "
            f"{p.tokens_per_day / 1e9:.3g}B |"
        )
    if len(plans) > top:
        lines.append(f"... and {len(plans) - top} slower or larger")
    if not plans:
        lines.append("nothing fits; closest: " + "; ".join(left_out[:3]))
    return "\n".join(lines)


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    why: str


def choose_layout(cfg, world: int, gpus_per_node: int, gpu_memory_gib: float) -> Layout:
    """For `megaloop slurm submit`: the largest data-parallel degree whose memory fits the GPU
    for the config's engine and recompute (Megatron's advice: model parallelism only as far as
    memory needs it), tensor parallel within a node before pipeline stages. Without GPUs there
    is no memory to fit: pure DP. Raises ConfigError when nothing fits."""
    tps = [t for t in (1, 2, 4, 8) if t <= max(gpus_per_node, 1)]
    pps = [
        p
        for p in range(1, cfg.model.num_layers + 1)
        if cfg.model.num_layers % p == 0 and (cfg.engine == "megatron" or p == 1)
    ]
    best, errors = None, []
    for tp, pp in sorted(((t, p) for t in tps for p in pps), key=lambda c: (c[0] * c[1], c[1])):
        trial = with_layout(cfg, cfg.engine, None, tp, pp, cfg.train.recompute)
        try:
            p = plan(trial, world, gpu_memory_gib, 1.0, 1.0)
        except ConfigError as e:
            errors.append(f"TP={tp} PP={pp}: {e}")
            continue
        if best is None or p.total < best.total:
            best = p
        if gpus_per_node == 0 or p.fits(gpu_memory_gib):
            fits = (
                "no GPUs: pure data parallel"
                if gpus_per_node == 0
                else f"~{p.total / 2**30:.1f} GiB per rank (weights, gradients, optimizer state, "
                f"activations: `megaloop plan`) fits {USABLE:.0%} of {gpu_memory_gib:g} GiB"
            )
            smaller = "; the smallest model-parallel degree that does" if tp * pp > 1 else ""
            return Layout(tp, pp, p.dp, fits + smaller)
    if best is None:
        raise ConfigError(
            f"no TP x PP layout fits {world} ranks and this config's batch: "
            + "; ".join(errors[:3])
        )
    raise ConfigError(
        f"no layout fits {gpu_memory_gib:g} GiB per GPU: the smallest estimate is "
        f"{best.total / 2**30:.1f} GiB (TP={best.tp} PP={best.pp}); lower "
        f"train.micro_batch_size or data.seq_len, set train.recompute=full, or use "
        f"more GPUs per node (`megaloop plan CONFIG --search` ranks the layouts)"
    )


def optimizer_state_bytes(optimizer, module) -> int:
    """Measured: the bytes a torch optimizer holds beyond the model's own weights, i.e. its
    per-element state (Adam's moments) and master copies that do not share the weights'
    storage (DeepSpeed's fp32 partitions). Scalars such as Adam's step are left out."""
    import torch

    own = set()
    for p in module.parameters():
        own.add(p.untyped_storage().data_ptr())
        if hasattr(p, "ds_tensor"):
            own.add(p.ds_tensor.untyped_storage().data_ptr())
    held = {}
    # ZeRO-3 empties param_groups between steps: the state's keys are the parameters too
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params + list(optimizer.state):
        if p.untyped_storage().data_ptr() not in own:
            held[p.untyped_storage().data_ptr()] = p.numel() * p.element_size()
        for t in optimizer.state.get(p, {}).values():
            if torch.is_tensor(t) and t.dim() > 0:
                held[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
    return sum(held.values())


def saved_activation_bytes(model, tokens) -> int:
    """Measured activation memory: the bytes of the distinct tensors autograd keeps for backward
    over one training forward of `model` on `tokens` (saved-tensor hooks), parameters (which
    layers also save) not counted."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, labels=tokens)
    del out
    return sum(seen.values())
