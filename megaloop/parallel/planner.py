"""`megaloop plan` and `megaloop slurm submit`'s layout choice: one layout's memory and time
from the cost model (megaloop/parallel/cost.py), the search over engines and layouts, and how
they are printed."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from megaloop.config import ConfigError
from megaloop.parallel.cost import (
    activation_bytes,
    flops_per_token,
    loss_exits,
    parameter_counts,
    state_bytes,
    step_seconds,
)
from megaloop.parallel.engines import ENGINES
from megaloop.parallel.layout import data_parallel_size

USABLE = 0.9
"""Our choice: plan against 90% of a GPU's memory (the CUDA context, the allocator's
fragmentation and communication buffers take the rest)."""


@dataclass
class Plan:
    engine: str
    zero_stage: int | None
    """The engine's own setting (its `variant`: DeepSpeed's ZeRO stage), None where it has none."""
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
        engine = ENGINES[self.engine].label(self.zero_stage)
        return (
            f"{engine}, TP={self.tp} PP={self.pp} DP={self.dp}, micro-batch "
            f"{self.micro_batch}, recompute={self.recompute}"
        )


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
        cfg.engine_spec.variant(cfg),
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


def tensor_parallel_sizes(gpus_per_node: int) -> list[int]:
    """TP within a node and a power of two."""
    return [t for t in (1, 2, 4, 8) if t <= max(gpus_per_node, 1)]


def pipeline_sizes(cfg, engine: str) -> list[int]:
    """PP dividing L, where the engine runs pipelines."""
    L = cfg.model.num_layers
    return [
        p for p in range(1, L + 1) if L % p == 0 and (p == 1 or ENGINES[engine].supports_pipeline)
    ]


def candidates(cfg, gpus_per_node: int):
    """Every (engine, its variant, TP, PP, recompute) worth trying: each engine's own variants
    (DeepSpeed's ZeRO stages) at every TP and the PPs it runs."""
    for recompute in ("none", "selective", "full", "loop"):
        for tp in tensor_parallel_sizes(gpus_per_node):
            for engine, spec in ENGINES.items():
                for pp in pipeline_sizes(cfg, engine):
                    for variant in spec.variants():
                        yield engine, variant, tp, pp, recompute


def with_layout(cfg, engine: str, variant: int | None, tp: int, pp: int, recompute: str):
    out = copy.deepcopy(cfg)
    out.engine, out.parallel.tp, out.parallel.pp, out.train.recompute = engine, tp, pp, recompute
    ENGINES[engine].with_variant(out, variant)
    return out


def search(
    cfg, gpus: int, gpu_mem_gib: float, tflops: float, mfu: float, gpus_per_node: int = 8
) -> tuple[list[Plan], list[str]]:
    """The layouts that fit `gpus` GPUs of `gpu_mem_gib`, fastest first; among equal times the
    smallest model-parallel degree (Megatron's advice), then anything that does not all-gather
    the shared stack again at every loop (ZeRO-3), then the engines in ENGINES' order, then the
    least memory. Also: why each other layout was left out."""
    order = list(ENGINES)
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
            ENGINES[p.engine].regathers_weights(p.zero_stage),
            order.index(p.engine),
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
        engine = ENGINES[p.engine].label(p.zero_stage, short=True)
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
    tps, pps = tensor_parallel_sizes(gpus_per_node), pipeline_sizes(cfg, cfg.engine)
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
