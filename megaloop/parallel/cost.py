"""The cost model of a layout: parameters, FLOPs, activation and state bytes per rank, and a
step's time. Parameters come from the model's own definition (megaloop/model/structure.py), state
bytes from the engine's memory model (megaloop/parallel/engines.py);
tests/unit/parallel/test_planner.py holds the activation figures to autograd's saved tensors, the
multi-process tests the state bytes to what the engines measure."""

from __future__ import annotations

from megaloop.model import structure


def params_per_rank(model, tp: int, pp: int, pp_rank: int) -> int:
    """Parameters held by one rank of pipeline stage `pp_rank` (any tensor-parallel rank):
    the stage's L/PP layers once (not once per loop), plus the embedding and recurrence on the
    first stage and the exits on the last (a tied W_out is a copy there when PP > 1)."""
    return structure.count(
        structure.parameters(
            model, tp, first=pp_rank == 0, last=pp_rank == pp - 1, layers=model.num_layers // pp
        )
    )


def parameter_counts(model) -> dict[str, int]:
    """Embedding and non-embedding parameters of the whole model (a tied W_out counts once):
    the same figures as LoopedLM.num_parameters(), without building anything."""
    params = structure.parameters(model)
    total = structure.count(params)
    embedding = structure.count([p for p in params if p.part == "embedding"])
    return {"embedding": embedding, "non_embedding": total - embedding, "total": total}


def flops_per_token(model, seq_len: int, loss_exits: int) -> float:
    """Training matmul FLOPs per token at K = model.num_loops: the forward pass (the shared
    stack's weights K times, attention scores and values 4·s·d per layer application, and the
    logits of every one of the K exits) and a backward pass of twice the forward of what the
    loss reaches (`loss_exits` exits: 1 for the terminal objective, K otherwise)."""
    d, K, L = model.hidden_size, model.num_loops, model.num_layers
    matmul = structure.count([p for p in structure.layer_params(model, 0) if len(p.shape) == 2])
    layer = 2 * matmul + 4 * seq_len * d
    readout = 2 * d * model.vocab_size
    return 3.0 * layer * L * K + readout * (K + 2 * loss_exits)


def loss_exits(cfg) -> int:
    return cfg.model.num_loops if cfg.objective.spec.every_exit else 1


PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}
"""Dense bf16 peak of one GPU (SXM), by a name torch.cuda.get_device_name() contains: the
denominator of MFU, as torchtitan and Megatron-LM count it (whatever precision the run uses)."""


def peak_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPUs, unlisted GPUs: no MFU)."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


# -- activations: what autograd keeps for backward -----------------------------------------------
# Values per token, counted from the tensors megatron-core's layers save with SDPA in the
# core-attention slot (tests/unit/parallel/test_planner.py holds the formula to the saved-tensor
# measurement).
# `shared`: split over TP ranks (attention and MLP internals); `replicated`: the residual stream
# and the norms, which every TP rank keeps whole (no sequence parallelism).


DROPOUT_MASK_BYTES = 1
"""Bytes a dropout keeps per element for backward on CUDA, a bool mask (torch's CPU dropout keeps
its float noise: 4). Attention-probability dropout inside SDPA's flash and memory-efficient
kernels keeps nothing more (they regenerate the mask); CPU SDPA falls back to the math kernel,
which keeps the s×s probabilities: a CPU run's attention dropout is not what this plans."""


def _dropout_bytes(model, seq_len: int, tp: int, recompute: str) -> float:
    """Bytes per token one layer application keeps for model.dropout: the FFN output's mask
    and, with megatron-core's own attention, the s×s probabilities' mask and their dropped
    copy."""
    if model.dropout == 0 or recompute in ("full", "loop"):
        return 0.0
    out = DROPOUT_MASK_BYTES * model.hidden_size
    if model.attention == "megatron" and recompute != "selective":
        out += (DROPOUT_MASK_BYTES + 4) * model.num_heads * seq_len / tp
    return out


def _layer_values(model, seq_len: int, tp: int, recompute: str) -> tuple[float, float]:
    """(replicated, shared) values per token of one layer application."""
    d, f, h = model.hidden_size, model.ffn_size, model.num_heads
    kv = (model.num_query_groups or h) * (d // h)
    if recompute in ("full", "loop"):
        return (d if recompute == "full" else 0), 0.0
    norms = sum(len(p.shape) == 1 for p in structure.layer_params(model, 0))
    replicated = d + norms * (2 * d + 1)  # the layer's input; each norm's input x·rstd and output
    shared = 3 * d + 3 * kv + h + 5 * f  # qkv, q and k copies, SDPA out and log-sum-exp, SwiGLU
    if model.attention == "megatron" and recompute != "selective":
        shared += 2 * h * seq_len  # the s×s scores and their softmax
    return replicated, shared / tp


def _exit_values(model, tp: int, loop: int, keep_logits: bool) -> float:
    """Values per token one exit keeps: its fp32 logits (the CE's softmax), its norm, the gate."""
    d = model.hidden_size
    normed = model.loop_norm == "shared" or structure.readout_normalizes(model, loop)
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
    layer = (
        4 * replicated
        + (2 if train.bf16 else 4) * shared
        + bf16_copies
        + _dropout_bytes(model, s, tp, train.recompute)
    )  # 0 under `loop`
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
        h0_mask = DROPOUT_MASK_BYTES * model.hidden_size if model.dropout else 0
        first = tokens * (4 * (model.hidden_size + 2) + h0_mask) if rank == 0 else 0
        if pp == 1:
            total = sum(laps) + first
        else:
            total = in_flight(pp, rank, K, microbatches) * max(laps) + first
        if total > worst["total"]:
            worst = {"per_loop": int(max(laps)), "total": int(total)}
    return worst


# -- weights, gradients and optimizer state -----------------------------------------------------


def state_bytes(cfg, tp: int, pp: int, dp: int) -> dict:
    """Bytes of weights, gradients and optimizer state on the largest stage's rank, by the
    memory model of the config's engine (megaloop/parallel/engines.py)."""
    n = max(params_per_rank(cfg.model, tp, pp, r) for r in range(pp))
    return cfg.engine_spec.state_bytes(cfg, n, dp)


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
