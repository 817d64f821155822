"""`megaloop bench generate`: what early exit saves in cached decoding, and what it costs in CE.

Teacher-forced decoding of held-out windows through the cache (so a KV policy's effect on
quality is measured): each row's first `prompt` tokens are prefilled at full depth (untimed),
then every following true token is fed alone (one forward of one token per row, the cache
passed on), and its logits scored against the next token. B rows are B different windows;
`batches` N decodes N batches of different windows in each run (its tokens/s, CE and accuracy
over all of them; stack and loop applications per batch), since one row scores one window.
Each run is one exit rule, threshold, KV policy and batching (a new LoopCache each time), or a
fixed K (early_exit "none": the plain cached path a user gets without early exit). The `sync`
batching feeds every row's next token together, each loop run by the rows still active, so a step
costs its deepest row's loops; `async` (DepthAsyncDecoder, copy and share at batch > 1) runs
every row at its own loop, so the stack runs about as often as a row's summed exits. tokens/s is
B x decoded tokens over the decode loop's wall time, the fastest of `repeats` timed decodes
taken in rounds across a batch size's runs (as timeit takes: what else runs on the machine only
slows a decode; every repeat's seconds are kept), after an untimed warm-up per batch size; CE is
over the same positions in every run.

The per-token fixed cost (embedding, readout, cache bookkeeping, Python) is stated by a least-
squares fit over the fixed-K runs of each batch size: seconds per token t(K) = f + c·K. An exiting
run's predicted speed-up over fixed K_max is then (f + c·K_max) / (f + c·m), m the applications of
the stack per decoded step it made (`step_max_loops`: a synchronous batch runs its deepest token's
loops, the depth-asynchronous decoder its steps per token): the work the run chose, at fixed K's
price. What the exiting path itself costs (the rule's per-loop λ or readout, the masks, recompute's
catch-up rows) is not in it, so it shows in the ratio measured / predicted. `loops_speedup`, K_max
/ mean exit loops, is the speed-up a token's own exits allow. Each run records the KV slots its
cache held per layer (`kv_slots_per_layer`, counted on the cache: K, or 1 under `share`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from megaloop.evaluation import harness
from megaloop.evaluation.settings import EvalError, GenerateBenchSettings
from megaloop.model.modes import EXIT_RULES, KV_POLICIES, asynchronous_policies

TOLERANCE = 0.15
"""The acceptance: measured speed-up within 15% of the predicted one."""


@contextmanager
def configured(model, **fields):
    """The model with config `fields` set (the rule and threshold an exiting forward reads),
    restored afterwards."""
    saved = {key: getattr(model.config, key) for key in fields}
    for key, value in fields.items():
        setattr(model.config, key, value)
    try:
        yield model
    finally:
        for key, value in saved.items():
            setattr(model.config, key, value)


def decode(model, rows: torch.Tensor, prompt: int, cache, loops: int, sync: Callable):
    """Logits [B, steps, V] of rows[:, prompt:-1] fed one token at a time after a full-depth
    prefill of rows[:, :prompt], and the wall seconds of those steps."""
    with torch.no_grad():
        model(rows[:, :prompt], past_key_values=cache, use_cache=True, num_loops=loops)
        sync()
        start = time.perf_counter()
        logits = [
            model(rows[:, i : i + 1], past_key_values=cache, use_cache=True, num_loops=loops).logits
            for i in range(prompt, rows.shape[1] - 1)
        ]
        sync()
        seconds = time.perf_counter() - start
    return torch.cat(logits, 1), seconds


def decode_async(model, rows: torch.Tensor, prompt: int, cache, sync: Callable):
    """The DepthAsyncDecoder after the same untimed prefill: logits [B, steps, V], the wall
    seconds of the decode, and the decoder (its exit loops and stack applications)."""
    from megaloop.model.decoding import DepthAsyncDecoder

    with torch.no_grad():
        model(rows[:, :prompt], past_key_values=cache, use_cache=True)
        sync()
        start = time.perf_counter()
        decoder = DepthAsyncDecoder(model, cache, rows[:, prompt], rows.shape[1] - 1 - prompt)
        last = rows.shape[1] - 1
        decoder.run(lambda at, j, _: rows[at, (prompt + j + 1).clamp(max=last)])
        sync()
        seconds = time.perf_counter() - start
    return decoder.logits, seconds, decoder


def answers(logits: torch.Tensor, targets: torch.Tensor, kinds: torch.Tensor) -> dict:
    """CE and accuracy (greedy token equals the true one) over the positions whose next token is
    an answer of the built-in corpus (kinds > 0), and the accuracy per kind (`chase`: per hop
    count)."""
    ce = harness.token_ce(logits, targets)
    right = (logits.argmax(-1) == targets).float()
    asked = kinds > 0
    return {
        "answer_ce": ce[asked].mean().item(),
        "answer_accuracy": right[asked].mean().item(),
        "accuracy_by_kind": {
            int(k): right[kinds == k].mean().item() for k in kinds.unique().tolist() if k > 0
        },
    }


def measure(
    model, rows, settings, spec: dict, sync: Callable, kinds: torch.Tensor | None = None
) -> tuple[float, dict]:
    """One timed decode of one run through each batch of `rows` ([batches x B, T], batch i its
    rows iB..iB+B-1), `spec` its exit, threshold, kv, batching and loops (K, or K_max at most):
    the wall seconds and the run's record without its tokens/s. `kinds` ([rows, positions],
    synthetic.answer_kinds) adds the answers' CE and accuracy."""
    b = rows.shape[0] // settings.batches
    seconds, logits, parts = 0.0, [], []
    for batch in range(settings.batches):
        took, batch_logits, part = decode_batch(
            model, rows[batch * b : (batch + 1) * b], settings.prompt, spec, sync
        )
        seconds += took
        logits.append(batch_logits)
        parts.append(part)
    logits = torch.cat(logits)
    targets = rows[:, settings.prompt + 1 :]
    steps = rows.shape[1] - 1 - settings.prompt
    record = {
        **spec,
        "batch_size": b,
        "batches": settings.batches,
        "kv_slots_per_layer": parts[0]["kv_slots_per_layer"],
        "ce": harness.token_ce(logits, targets).mean().item(),
    }
    if kinds is not None:
        record |= answers(logits, targets, kinds[:, settings.prompt : -1])
    if spec["exit"] == "fixed":
        loops = spec["loops"]
        return seconds, {
            **record,
            "mean_loops": float(loops),
            "step_max_loops": float(loops),
            "stack_applications": loops * steps,
            "loop_applications": loops * b * (settings.prompt + steps),
            "cache_bytes_per_token": model.cache_bytes_per_token("copy", loops),
        }
    applications = sum(p["stack_applications"] for p in parts) / settings.batches
    return seconds, {
        **record,
        "mean_loops": torch.cat([p["exit_loops"] for p in parts]).float().mean().item(),
        "step_max_loops": applications / steps,
        "stack_applications": applications,
        "loop_applications": sum(p["loop_applications"] for p in parts) / settings.batches,
        "cache_bytes_per_token": parts[-1]["cache_bytes_per_token"],
    }


def decode_batch(model, rows, prompt: int, spec: dict, sync: Callable) -> tuple:
    """One batch of one run: its wall seconds, logits, and what its cache and decoder counted
    (KV slots per layer, and for an exiting run the exit loops and stack applications)."""
    from transformers import DynamicCache

    from megaloop.model.decoding import LoopCache

    fixed = spec["exit"] == "fixed"
    fields = {"early_exit": "none"} if fixed else {"early_exit": spec["exit"]}
    if not fixed:
        fields["exit_threshold"] = spec["threshold"]
    with configured(model, **fields):
        cache = DynamicCache() if fixed else LoopCache(spec["kv"])
        if spec["batching"] == "async":
            logits, seconds, decoder = decode_async(model, rows, prompt, cache, sync)
        else:
            logits, seconds = decode(model, rows, prompt, cache, spec["loops"], sync)
    # counted on the cache, not read from spec["kv"]: what the decode really held
    part = {
        "kv_slots_per_layer": len(cache.layers if fixed else cache.keys)
        // model.config.num_hidden_layers
    }
    if not fixed:
        exit_loops = torch.cat(cache.exit_loops[1:], 1)
        part |= {
            "exit_loops": exit_loops.flatten(),
            "stack_applications": decoder.steps
            if spec["batching"] == "async"
            else exit_loops.max(0).values.sum().item(),
            "loop_applications": cache.loop_applications,
            "cache_bytes_per_token": cache.bytes_per_token(),
        }
    return seconds, logits, part


def timed(model, rows, settings, specs: list[dict], sync: Callable, kinds=None) -> list[dict]:
    """Each run's record, tokens/s from the fastest of `repeats` decodes (`seconds`: each one's,
    in order). The repeats are taken in rounds (every run once, then every run again), so a
    drift of the machine's speed over the minutes a batch size takes falls on every run alike
    instead of on whichever ran then."""
    seconds = [[] for _ in specs]
    records: list[dict | None] = [None] * len(specs)
    rounds = [(i, spec) for _ in range(settings.repeats) for i, spec in enumerate(specs)]
    desc = f"bench generate, batch {rows.shape[0] // settings.batches}"
    for i, spec in harness.progress(rounds, desc, "decode"):
        took, record = measure(model, rows, settings, spec, sync, kinds)
        seconds[i].append(took)
        records[i] = records[i] or record
    steps = rows.shape[1] - 1 - settings.prompt
    for record, took in zip(records, seconds):
        record["seconds"] = took
        record["tokens_per_s"] = rows.shape[0] * steps / min(took)
    return records


def warm_up(model, rows, settings, rules, k_max: int, sync: Callable) -> None:
    """Untimed short decodes at fixed K_max and under each rule, policy and batching (first
    calls, the allocator, kernel choices), before a batch size's timed runs."""
    fixed = {"exit": "fixed", "threshold": None, "kv": None, "batching": "sync", "loops": k_max}
    for spec in [fixed, *exiting(settings, rules, k_max, rows.shape[0], warm=True)]:
        decode_batch(model, rows, settings.prompt, spec, sync)


def exiting(settings: GenerateBenchSettings, rules, k_max: int, b: int, warm=False) -> list:
    """The exiting runs of batch size b: rule x threshold x policy x batching (the first threshold
    only when `warm`); `async` where it applies (copy and share, b > 1)."""
    return [
        {"exit": rule, "threshold": t, "kv": kv, "batching": batching, "loops": k_max}
        for rule in rules
        for t in settings.thresholds_of(rule)[: 1 if warm else None]
        for kv in settings.policies
        for batching in settings.batching
        if batching == "sync" or (b > 1 and kv in asynchronous_policies())
    ]


def plan(settings: GenerateBenchSettings, rules, k_max: int, b: int) -> list[dict]:
    """Batch size b's runs: fixed K = 1..K_max, then the exiting ones."""
    fixed = [
        {"exit": "fixed", "threshold": None, "kv": None, "batching": "sync", "loops": k}
        for k in range(1, k_max + 1)
    ]
    return fixed + exiting(settings, rules, k_max, b)


def fixed_cost(records: list[dict], k_max: int) -> dict:
    """The least-squares t(K) = f + c·K over one batch size's fixed-K runs (seconds per token)."""
    fixed = [r for r in records if r["exit"] == "fixed"]
    k = np.array([r["loops"] for r in fixed], dtype=float)
    t = np.array([1 / r["tokens_per_s"] for r in fixed])
    c, f = np.polyfit(k, t, 1)
    return {
        "batch_size": fixed[0]["batch_size"],
        "fixed_s_per_token": float(f),
        "loop_s_per_token": float(c),
        "fixed_share_at_k_max": float(f / (f + c * k_max)),
    }


def compare(records: list[dict], fit: dict, k_max: int) -> None:
    """Each run of one batch size against that batch's fixed K_max: measured and predicted
    speed-up (the stack applications it made, at fixed K's price), their ratio, and the CE
    difference."""
    base = next(r for r in records if r["exit"] == "fixed" and r["loops"] == k_max)
    f, c = fit["fixed_s_per_token"], fit["loop_s_per_token"]
    for r in records:
        predicted = (f + c * k_max) / (f + c * r["step_max_loops"])
        measured = r["tokens_per_s"] / base["tokens_per_s"]
        r.update(
            speedup=measured,
            loops_speedup=k_max / r["mean_loops"],
            predicted_speedup=predicted,
            ratio=measured / predicted,
            within_15pct=abs(measured / predicted - 1) <= TOLERANCE,
            ce_vs_fixed_kmax=r["ce"] - base["ce"],
        )


QUALITY = {"ce": -1, "answer_ce": -1, "answer_accuracy": 1}
"""The quality measures a frontier is drawn in, and their sign: higher is better times it."""


def frontier(records: list[dict], measure: str = "ce") -> None:
    """Each exiting run of one batch size against the fixed-K runs beside it, in `measure`:
    the best a fixed K reaches at least as fast (`{measure}_gain_at_speed`: how much better the
    run is, and that K), the fastest fixed K at least as good (`speedup_at_{measure}`), and
    whether some fixed K is both as fast and as good (`dominated_{measure}`)."""
    sign = QUALITY[measure]
    fixed = [r for r in records if r["exit"] == "fixed"]
    for r in records:
        if r["exit"] == "fixed":
            continue
        as_fast = [f for f in fixed if f["tokens_per_s"] >= r["tokens_per_s"]]
        best = max(as_fast, key=lambda f: sign * f[measure], default=None)
        as_good = [f for f in fixed if sign * f[measure] >= sign * r[measure]]
        fastest = max(as_good, key=lambda f: f["tokens_per_s"], default=None)
        r[f"{measure}_gain_at_speed"] = (
            None if best is None else sign * (r[measure] - best[measure])
        )
        r[f"{measure}_fixed_k_at_speed"] = None if best is None else best["loops"]
        r[f"speedup_at_{measure}"] = (
            None if fastest is None else r["tokens_per_s"] / fastest["tokens_per_s"]
        )
        r[f"{measure}_fixed_k_at_quality"] = None if fastest is None else fastest["loops"]
        r[f"dominated_{measure}"] = any(
            f["tokens_per_s"] >= r["tokens_per_s"] and sign * f[measure] >= sign * r[measure]
            for f in fixed
        )


def beat_fixed_k(runs: list[dict], measure: str = "ce") -> list[str]:
    """Per batch size, one line first: whether any exiting run lies above the fixed-K frontier
    in `measure`, and its largest margin (at a fixed K's speed, and at its quality)."""
    lines = []
    for b in sorted({r["batch_size"] for r in runs}):
        exiting = [r for r in runs if r["batch_size"] == b and r["exit"] != "fixed"]
        above = [r for r in exiting if not r[f"dominated_{measure}"]]
        if not above:
            lines.append(
                f"- batch {b}: no exiting run beat fixed K in {measure}: each of the "
                f"{len(exiting)} is matched by a fixed K at least as fast and as good"
            )
            continue
        gains = [r for r in above if (r[f"{measure}_gain_at_speed"] or 0) > 0]
        speeds = [r for r in above if (r[f"speedup_at_{measure}"] or 0) > 1]
        parts = []
        if gains:
            r = max(gains, key=lambda r: r[f"{measure}_gain_at_speed"])
            parts.append(
                f"{describe(r)} is better by {r[f'{measure}_gain_at_speed']:.4g} in {measure} "
                f"than fixed K={r[f'{measure}_fixed_k_at_speed']}, at least as fast"
            )
        if speeds:
            r = max(speeds, key=lambda r: r[f"speedup_at_{measure}"])
            parts.append(
                f"{describe(r)} runs {r[f'speedup_at_{measure}']:.2f}x the tokens/s of fixed "
                f"K={r[f'{measure}_fixed_k_at_quality']} at least as good in {measure}"
            )
        lines.append(
            f"- batch {b}: {len(above)} of {len(exiting)} exiting runs beat fixed K in "
            f"{measure}; " + "; ".join(parts)
        )
    return lines


def describe(r: dict) -> str:
    batching = f" {r['batching']}" if r["batching"] == "async" else ""
    return f"{r['exit']} {r['threshold']:g} {r['kv']}{batching}"


def run(settings: GenerateBenchSettings) -> dict:
    """Every run of `settings` on its model, compared with fixed K_max per batch size, written
    to OUT/generate.json, .md and .png; returns what generate.json holds."""
    harness.check_data(settings.data)
    device, dtype = harness.device_and_dtype(settings.dtype, settings.device)
    opened = harness.open_model(settings.model, device, dtype)
    model = opened.model
    settings = opened.fitted(settings)
    settings.check_prompt()
    k_max = model.config.num_loops
    if k_max < 2:
        raise EvalError(f"MODEL {settings.model}: it runs K = {k_max} loop; nothing can exit early")
    rules = settings.exit_rules(model.exit_gate is not None)
    windows = harness.windows(
        harness.read_tokens(settings.data, opened.encode),
        settings.seq_len,
        settings.batch_size * settings.batches,
    ).to(device)

    kinds = None
    if settings.task is not None:
        from megaloop.data.synthetic import answer_kinds

        kinds = torch.from_numpy(
            np.stack([answer_kinds(w.cpu().numpy(), settings.task) for w in windows])
        ).to(device)
        bare = [i for i, row in enumerate(kinds[:, settings.prompt : -1]) if not row.any()]
        if bare:
            raise EvalError(
                f"--task {settings.task}: decoded window {bare[0]} of --data holds no answer "
                f"of the task; give longer windows (--seq-len) or text written by the task"
            )
    measures = ["ce"] + (["answer_accuracy"] if kinds is not None else [])
    sync = functools.partial(harness.synchronize, device)
    records, fits = [], []
    for b in settings.batch_sizes:
        rows = windows[: b * settings.batches]
        warm_up(model, rows[:b, : settings.prompt + 4], settings, rules, k_max, sync)
        batch = timed(
            model,
            rows,
            settings,
            plan(settings, rules, k_max, b),
            sync,
            None if kinds is None else kinds[: b * settings.batches],
        )
        fits.append(fixed_cost(batch, k_max))
        compare(batch, fits[-1], k_max)
        for measure in measures:
            frontier(batch, measure)
        records += batch
    model_info = {k: v for k, v in opened.info.items() if k != "run_config"}
    result = {
        "model": model_info,
        "data": str(settings.data),
        "device": device,
        "dtype": dtype,
        "seq_len": settings.seq_len,
        "prompt_tokens": settings.prompt,
        "decoded_tokens_per_row": settings.seq_len - settings.prompt,
        "k_max": k_max,
        "measures": measures,
        "fixed_cost": fits,
        "settings": settings.record(device=device, dtype=dtype, rules=list(rules)),
        "runs": records,
    }
    harness.write(settings.out, "generate", result, table(result))
    plot(result, settings.out / "generate.png")
    return result


MARKERS = dict(zip(EXIT_RULES, "^sovDp*"))
COLOURS = dict(zip(KV_POLICIES, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))


def plot(result: dict, path: Path) -> None:
    """tokens/s against CE, one panel per batch size: the fixed-K runs as a line, each rule x
    policy as its own marker and colour over its thresholds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [fit["batch_size"] for fit in result["fixed_cost"]]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.8), squeeze=False)
    for ax, b in zip(axes[0], sizes):
        runs = [r for r in result["runs"] if r["batch_size"] == b]
        fixed = [r for r in runs if r["exit"] == "fixed"]
        ax.plot(
            [r["tokens_per_s"] for r in fixed], [r["ce"] for r in fixed], "k.-", label="fixed K"
        )
        for r in fixed:
            ax.annotate(f"K={r['loops']}", (r["tokens_per_s"], r["ce"]), fontsize=7)
        groups = {(r["exit"], r["kv"], r["batching"]) for r in runs if r["exit"] != "fixed"}
        for rule, kv, batching in sorted(groups):
            group = [r for r in runs if (r["exit"], r["kv"], r["batching"]) == (rule, kv, batching)]
            ax.plot(
                [r["tokens_per_s"] for r in group],
                [r["ce"] for r in group],
                marker=MARKERS.get(rule, "o"),
                color=COLOURS.get(kv),
                linestyle="--" if batching == "async" else "-",
                markerfacecolor="none" if batching == "async" else None,
                linewidth=0.6,
                label=f"{rule} {kv}" + (" async" if batching == "async" else ""),
            )
        ax.set_xlabel("tokens/s")
        ax.set_ylabel("CE / token")
        ax.set_title(f"batch {b}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{Path(result['model']['path']).name}: {result['device']} {result['dtype']}, "
        f"K_max = {result['k_max']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict) -> str:
    """The runs as Markdown, after the fixed per-token cost each batch size's prediction uses."""
    k_max = result["k_max"]
    lines = [
        f"# bench generate: {result['model']['path']}",
        "",
        "Did adaptive exit beat the best fixed K (a fixed K at least as fast and as good "
        "matches every run that did not)?",
        "",
        *[line for m in result.get("measures", ["ce"]) for line in beat_fixed_k(result["runs"], m)],
        "",
        f"{result['device']} {result['dtype']}; {result['decoded_tokens_per_row']} decoded "
        f"tokens per row after a {result['prompt_tokens']}-token prompt; K_max = {k_max}.",
        "",
    ]
    for fit in result["fixed_cost"]:
        f, c = fit["fixed_s_per_token"], fit["loop_s_per_token"]
        lines.append(
            f"- batch {fit['batch_size']}: fixed cost per token f = {f * 1e3:.4f} ms, one loop "
            f"c = {c * 1e3:.4f} ms (t(K) = f + c·K over the fixed-K runs): "
            f"{fit['fixed_share_at_k_max']:.0%} of a token at K_max"
        )
    lines += ["", *verdicts(result["runs"])]
    lines += [
        "",
        "| batch | exit | threshold | kv | batching | tokens/s | mean loops | stack applications "
        "per token | CE | ΔCE vs K_max | loop applications | speed-up | predicted | ratio "
        "| within 15% | repeats' spread | cache B/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        threshold = "" if r["threshold"] is None else f"{r['threshold']:g}"
        exit_ = f"fixed K={r['loops']}" if r["exit"] == "fixed" else r["exit"]
        lines.append(
            f"| {r['batch_size']} | {exit_} | {threshold} | {r['kv'] or ''} | {r['batching']} "
            f"| {r['tokens_per_s']:,.1f} | {r['mean_loops']:.2f} | {r['step_max_loops']:.2f} "
            f"| {r['ce']:.4f} "
            f"| {r['ce_vs_fixed_kmax']:+.4f} | {r['loop_applications']:,} "
            f"| {r['speedup']:.2f}x | {r['predicted_speedup']:.2f}x | {r['ratio']:.2f} "
            f"| {'yes' if r['within_15pct'] else 'no'} "
            f"| {max(r['seconds']) / min(r['seconds']) - 1:.0%} "
            f"| {r['cache_bytes_per_token']:,.0f} |"
        )
    return "\n".join(lines)


def verdicts(runs: list[dict]) -> list[str]:
    """How many exiting runs are within 15% of their prediction, per batch size, engine and
    policy: a line each."""
    counts: dict[tuple, list[int]] = {}
    for r in runs:
        if r["exit"] != "fixed":
            count = counts.setdefault((r["batch_size"], r["batching"], r["kv"]), [0, 0])
            count[0] += r["within_15pct"]
            count[1] += 1
    return [
        f"- within 15%, batch {b}, {batching}, `{kv}`: {within} of {total}"
        for (b, batching, kv), (within, total) in counts.items()
    ]
