"""`megaloop plan` and `megaloop slurm submit`'s layout choice: one layout's memory and time
from the cost model (megaloop/parallel/cost.py), the search over engines and layouts, and how
they are printed."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from megaloop.config import ConfigError
from megaloop.parallel.cost import (
    PEAK_BF16_TFLOPS,
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
    """The layouts that fit `gpus` GPUs of `gpu_mem_gib`, each at the largest micro-batch it
    can run that fits (`fitted`), fastest first; among equal times the smallest model-parallel
    degree (Megatron's advice), then anything that does not all-gather the shared stack again
    at every loop (ZeRO-3), then the engines in ENGINES' order, then the least memory. A layout
    whose row would repeat a faster one's numbers (the ZeRO stages at DP=1 shard nothing) is
    named among the left out. Also: why each other layout was left out."""
    order = list(ENGINES)
    plans, left_out = [], []
    for engine, stage, tp, pp, recompute in candidates(cfg, min(gpus, gpus_per_node)):
        trial = with_layout(cfg, engine, stage, tp, pp, recompute)
        try:
            _, p = fitted(trial, gpus, gpu_mem_gib, tflops, mfu)
        except ConfigError as e:
            left_out.append(f"{ENGINES[engine].label(stage)} TP={tp} PP={pp}: {e}")
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
    kept, seen = [], {}
    for p in plans:
        row = (p.tp, p.pp, p.dp, p.recompute, p.micro_batch, round(p.total / 2**30, 1))
        row += (round(p.step_seconds, 6),)
        if row in seen:
            left_out.append(f"{p.name}: the same figures as {seen[row].name}")
        else:
            seen[row] = p
            kept.append(p)
    return kept, left_out


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
            f"largest micro-batch the memory holds: {p.max_micro_batch}",
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
        "| # | engine | TP | PP | DP | recompute | micro-batch | GiB per GPU | step (s) "
        "| tokens/day |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(plans[:top], 1):
        engine = ENGINES[p.engine].label(p.zero_stage, short=True)
        lines.append(
            f"| {i} | {engine} | {p.tp} | {p.pp} | {p.dp} | {p.recompute} | "
            f"{p.micro_batch} | {p.total / 2**30:.1f} | {p.step_seconds:.3g} | "
            f"{p.tokens_per_day / 1e9:.3g}B |"
        )
    if len(plans) > top:
        lines.append(f"... and {len(plans) - top} slower or larger")
    if plans:
        lines.append(
            "micro-batch: each layout's largest that divides a data-parallel rank's share of "
            "the global batch and fits, no larger than the config's (train.micro_batch_size=N "
            "applies it)"
        )
    if not plans:
        lines.append(
            "nothing fits; left out, first: "
            + "; ".join(left_out[:3])
            + ". Use GPUs with more memory, more GPUs or a shorter data.seq_len"
        )
    return "\n".join(lines)


RECOMPUTE_ORDER = ("none", "selective", "full", "loop")
"""train.recompute from the least compute to the least memory: the planner turns recompute on
only as far as memory needs it."""

LAYOUT_KEYS = ("parallel.tp", "parallel.pp")


def layout_given(overrides: list) -> bool:
    """The command line fixes TP x PP (`parallel.tp=` or `parallel.pp=`): plan that layout."""
    return any(str(o).split("=", 1)[0].strip() in LAYOUT_KEYS for o in overrides)


def with_micro_batch(cfg, b: int):
    """`cfg` at micro-batch `b`; a counted train.eval_batches is rescaled to the same validation
    windows (micro-batch j holds windows [j*b, (j+1)*b)) where that is a whole number."""
    out = copy.deepcopy(cfg)
    old, evals = cfg.train.micro_batch_size, cfg.train.eval_batches
    out.train.micro_batch_size = b
    if evals != "all" and (evals * old) % b == 0:
        out.train.eval_batches = evals * old // b
    return out


def micro_batch_sizes(cfg, gpus: int) -> list[int]:
    """The micro-batches a layout can run, largest first: divisors of a data-parallel rank's
    share of the global batch, no larger than the config's own (our choice: the config's
    micro-batch is a ceiling, a smaller GPU gets the same gradient in smaller pieces)."""
    tp_pp, gbs = cfg.parallel.tp * cfg.parallel.pp, cfg.train.global_batch_size
    if gpus % tp_pp:
        return [cfg.train.micro_batch_size]  # plan() names the layout error
    dp = gpus // tp_pp
    if gbs % dp:
        raise ConfigError(
            f"config key 'train.global_batch_size': {gbs} windows a step do not split over "
            f"DP={dp} ranks (TP={cfg.parallel.tp} PP={cfg.parallel.pp} on {gpus} GPUs); "
            f"give a TP x PP whose DP divides {gbs}, fewer GPUs, or a global batch that is a "
            f"multiple of {dp}"
        )
    share = gbs // dp
    return [b for b in range(min(cfg.train.micro_batch_size, share), 0, -1) if share % b == 0]


def fitted(cfg, gpus: int, gpu_mem_gib: float | None, tflops: float, mfu: float):
    """(config, Plan) of the config's layout at the largest micro-batch it can run that fits
    (`gpu_mem_gib` None: no GPU memory to fit, the largest it can run); where none fits, the
    smallest micro-batch's, which does not. ConfigError when the layout cannot run at all."""
    error, last = None, None
    for b in micro_batch_sizes(cfg, gpus):
        trial = with_micro_batch(cfg, b)
        try:
            p = plan(trial, gpus, gpu_mem_gib or 1.0, tflops, mfu)
        except ConfigError as e:
            error = error or e
            continue
        last = trial, p
        if gpu_mem_gib is None or p.fits(gpu_mem_gib):
            return last
    if last is None:
        raise error
    return last


@dataclass
class Proposal:
    """A layout the config can run on the GPUs and the overrides that apply it."""

    plan: Plan
    changes: dict
    """Config key -> the value the proposal gives it, where it differs from the config's."""
    why: str

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.changes.items()]


def _changes(cfg, chosen) -> dict:
    keys = {
        "parallel.tp": lambda c: c.parallel.tp,
        "parallel.pp": lambda c: c.parallel.pp,
        "train.micro_batch_size": lambda c: c.train.micro_batch_size,
        "train.eval_batches": lambda c: c.train.eval_batches,
        "train.recompute": lambda c: c.train.recompute,
    }
    return {k: get(chosen) for k, get in keys.items() if get(chosen) != get(cfg)}


def _why(cfg, p: Plan, gpu_mem_gib: float | None, fixed: bool) -> str:
    if gpu_mem_gib is None:
        parts = ["no GPUs: pure data parallel" if not fixed else "no GPUs: nothing to fit"]
    else:
        parts = [
            f"~{p.total / 2**30:.1f} GiB per rank (weights, gradients, optimizer state, "
            f"activations: `megaloop plan`) fits {USABLE:.0%} of {gpu_mem_gib:g} GiB"
        ]
    if fixed:
        parts.append("the layout given on the command line")
    elif p.tp * p.pp > 1:
        parts.append("the smallest model-parallel degree that runs and fits")
    if p.micro_batch != cfg.train.micro_batch_size:
        parts.append(
            f"micro-batch {p.micro_batch}, the largest that divides a data-parallel rank's "
            f"{cfg.train.global_batch_size // p.dp} windows"
            + (" and fits" if gpu_mem_gib is not None else "")
        )
    if p.recompute != cfg.train.recompute:
        tried = RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(cfg.train.recompute) :]
        less = tried[: tried.index(p.recompute)]
        parts.append(f"recompute={p.recompute}: nothing fits with {' or '.join(less)}")
    return "; ".join(parts)


GPUS_PER_NODE = 8
PEAK_TFLOPS = PEAK_BF16_TFLOPS["H200"]
"""`megaloop plan`'s default peak: an H100/H200 SXM's dense bf16."""
MFU = 0.4
"""The model FLOPs utilization `megaloop plan` assumes by default (our choice)."""


def propose(
    cfg,
    gpus: int,
    gpu_mem_gib: float | None,
    gpus_per_node: int = GPUS_PER_NODE,
    fixed: bool = False,
    tflops: float = PEAK_TFLOPS,
    mfu: float = MFU,
) -> Proposal:
    """What `megaloop plan` prints and `megaloop slurm submit` launches (one choice for both):
    the smallest model-parallel degree whose memory fits (Megatron's advice: model parallelism
    only as far as memory needs it; TP within a node before PP stages; only the config's own
    TP x PP when `fixed`), at the config's engine and recompute, else at each heavier recompute
    in turn, with the largest micro-batch that splits the global batch and fits (`fitted`).
    `gpu_mem_gib` None (no GPUs): pure data parallel, nothing to fit. Raises ConfigError naming
    the closest layout and what to change when nothing fits."""
    if fixed:
        layouts = [(cfg.parallel.tp, cfg.parallel.pp)]
    else:
        tps = tensor_parallel_sizes(gpus_per_node if gpu_mem_gib is not None else 0)
        pps = pipeline_sizes(cfg, cfg.engine) if gpu_mem_gib is not None else [1]
        layouts = sorted(((t, p) for t in tps for p in pps), key=lambda c: (c[0] * c[1], c[1]))
    recomputes = RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(cfg.train.recompute) :]
    closest, errors = None, []
    for recompute in recomputes:
        for tp, pp in layouts:
            trial = with_layout(cfg, cfg.engine, None, tp, pp, recompute)
            try:
                chosen, p = fitted(trial, gpus, gpu_mem_gib, tflops, mfu)
            except ConfigError as e:
                errors.append(f"TP={tp} PP={pp}: {e}")
                continue
            if gpu_mem_gib is None or p.fits(gpu_mem_gib):
                return Proposal(p, _changes(cfg, chosen), _why(cfg, p, gpu_mem_gib, fixed))
            if closest is None or p.total < closest.total:
                closest = p
    if closest is None:
        if len(errors) == 1:
            raise ConfigError(errors[0].split(": ", 1)[1])
        raise ConfigError(
            f"no TP x PP layout runs this config on {gpus} GPUs: " + "; ".join(errors[:3])
        )
    raise ConfigError(
        f"nothing fits {gpu_mem_gib:g} GiB per GPU: the closest is {closest.name} at "
        f"{closest.total / 2**30:.1f} GiB per GPU ({USABLE:.0%} of {gpu_mem_gib:g} GiB usable); "
        f"use GPUs with more memory, more GPUs"
        + ("" if not fixed else " or another TP x PP (drop the parallel.tp/pp overrides)")
        + ", or a shorter data.seq_len (`megaloop plan CONFIG --search` ranks every engine "
        "and layout)"
    )
