"""The verdict table across scales: each claim of the study the CPU benches can test, the study's
figure, each scale's figure per seed, and whether it follows. The rules (RULES) were fixed in
this file before bench/study_at_size's runs at the study's widths were read, and before the long
miniature's ran; the 5x bar is the study miniature's FACTOR, fixed before its first run.

A scale's `figures` are {row: {seed: run figures}} with a run's figures from `run_figures`: its
training trajectory (study.trajectory) and its `depth`, `halt` and `diagnose` results.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common.report import fmt
from bench.common.study import FACTOR

BUDGET = 1.01
"""The study's halting budget, ρ: a depth whose PPL is within 1% is as good as K = 4."""


def run_figures(trajectory: dict, measured: Path | None) -> dict:
    """The figures the rules read from one run: final-loop L2 of the training batch at the first
    logged step and over the last 5, and at the last validation; PPL per inference depth, the
    calibrated halting's mean loops, the radial fractions, the clamp's ΔCE, the settled radial
    update and the final loop's token tails."""
    l2 = trajectory["train_l2"]
    out = {
        "l2_first": l2[0],
        "l2_last": float(np.mean(l2[-5:])),
        "l2_final": trajectory["final_l2"],
    }
    found = {
        c: json.loads((measured / f"{c}.json").read_text())
        for c in ("depth", "halt", "diagnose")
        if measured is not None and (measured / f"{c}.json").is_file()
    }
    if "depth" in found:
        rows = found["depth"]["rows"]
        out["ppl"] = {str(r["loops"]): r["ppl"] for r in rows}
        out["ppl4"] = next(r["ppl"] for r in rows if r["loops"] == 4)
    if "halt" in found:
        out["halt_mean_loops"] = found["halt"]["benchmark"]["dynamic"]["mean_loops"]
    if "diagnose" not in found:
        return out
    from megaloop.evaluation.report import settled as settled_loops

    diag = found["diagnose"]
    roll, tail = diag["rollout"], diag["scale"][-1]["rms"]
    first, last = settled_loops(diag)
    settled = slice(first - 2, last - 1)  # rollout[key][k - 2]: the update into loop k
    return {
        **out,
        "r": diag["radial"]["r"],
        "clamp_delta_ce": diag["clamp"]["delta_ce"],
        "b_rms": float(np.mean(roll["update_rms"][settled])),
        "a_rad_over_ds": float(
            np.mean(roll["a_rad"][settled]) / np.mean(roll["scale_step"][settled])
        ),
        "p999_over_mean": tail["p99.9"] / tail["mean"],
        "max_over_mean": tail["max"] / tail["mean"],
    }


def k1_over_k4(f: dict) -> float | None:
    return f["ppl"]["1"] / f["ppl"]["4"] if "ppl" in f else None


@dataclass(frozen=True)
class Rule:
    """`value` reads one seed's figure from its rows' figures ({row: figures}, None where a row
    or measurement is missing); the seed follows when `holds(value)`, goes against the claim
    when `against(value)`. Every seed following: "follows"; every seed against: "against";
    otherwise "mixed"."""

    claim: str
    source: str
    study: str
    figure: str
    value: Callable[[dict], float | None]
    holds: Callable[[float], bool]
    against: Callable[[float], bool]


def ratio(row: str, other: str, key: str) -> Callable[[dict], float | None]:
    def value(rows: dict) -> float | None:
        a, b = rows.get(row, {}).get(key), rows.get(other, {}).get(key)
        return a / b if a is not None and b is not None else None

    return value


def of(row: str, read: Callable[[dict], float | None]) -> Callable[[dict], float | None]:
    def value(rows: dict) -> float | None:
        return read(rows[row]) if row in rows else None

    return value


def growth(row: str) -> Callable[[dict], float | None]:
    """The training batch's final-loop L2 over its last 5 steps against its first step."""

    def value(rows: dict) -> float | None:
        f = rows.get(row)
        return f["l2_last"] / f["l2_first"] if f else None

    return value


def both(row: str, other: str, read: Callable) -> Callable[[dict], tuple | None]:
    def value(rows: dict):
        a, b = of(row, read)(rows), of(other, read)(rows)
        return (a, b) if a is not None and b is not None else None

    return value


def norm_far_above_raw(claim: str, source: str, study: str, what: str, key: str) -> Rule:
    """per_loop_norm's `key` over per_loop_raw's, by FACTOR either way."""
    return Rule(
        claim,
        source,
        study,
        f"{what}, per_loop_norm / per_loop_raw",
        ratio("per_loop_norm", "per_loop_raw", key),
        lambda x: x >= FACTOR,
        lambda x: x <= 1 / FACTOR,
    )


RULES = (
    norm_far_above_raw(
        "per-loop CE through RMSNorm drifts far above raw readouts",
        "Table 2",
        "39,207 (44M), 56,051 (129M) against tens",
        "final-loop L2",
        "l2_final",
    ),
    Rule(
        "the normalised state drifts by orders of magnitude under per-loop CE",
        "§1, Table 2",
        "39,207 at 44M from √512 ≈ 23 at N(0, 1) embeddings",
        "per_loop_norm's final-loop L2 (training batch), last 5 steps / first step",
        growth("per_loop_norm"),
        lambda x: x >= 10,
        lambda x: x <= 1,
    ),
    Rule(
        "an RMSNorm readout leaves no radial gradient; a raw one does",
        "Table 3",
        "r_k ~ 1e-8 (RMSNorm), ~ 1e-2 (raw)",
        "largest r_k of per_loop_norm / smallest of per_loop_raw",
        both("per_loop_norm", "per_loop_raw", lambda f: f.get("r")),
        lambda x: max(x[0]) <= 1e-6 and min(x[1]) >= 1e-3,
        lambda x: max(x[0]) >= 1e-3,
    ),
    Rule(
        "clamping the recurrent scale costs the RMSNorm row little CE",
        "Table 4",
        "'changes CE very little'",
        "clamp ΔCE (nats), per_loop_norm / per_loop_raw",
        ratio("per_loop_norm", "per_loop_raw", "clamp_delta_ce"),
        lambda x: abs(x) <= 1 / FACTOR,
        lambda x: abs(x) >= 1,
    ),
    Rule(
        "per-loop RMSNorm is nearly K-invariant: it halts at K = 1 under a 1% budget",
        "Table 5, App. H",
        "every sequence exits at K = 1",
        "per_loop_norm's calibrated halting, mean exit loop",
        of("per_loop_norm", lambda f: f.get("halt_mean_loops")),
        lambda x: x <= 1.0,
        lambda x: x >= 3.0,
    ),
    *(
        Rule(
            f"{row} improves with depth",
            "Table 5",
            "K = 4 below K = 1 (raw, final-only norm, penalty)",
            f"{row}'s PPL K=1 / K=4 (over the 1% budget: improves)",
            of(row, k1_over_k4),
            lambda x: x > BUDGET,
            lambda x: x <= 1.0,
        )
        for row in ("per_loop_raw", "per_loop_norm_penalty", "final_norm")
    ),
    *(
        Rule(
            f"{row} stays below per-loop RMSNorm's PPL at K = 4",
            "Table 5",
            "lower PPL than the K-invariant RMSNorm baseline",
            f"PPL at K=4, {row} / per_loop_norm",
            ratio(row, "per_loop_norm", "ppl4"),
            lambda x: x < 1.0,
            lambda x: x >= 1.0,
        )
        for row in ("per_loop_raw", "per_loop_norm_penalty", "final_norm")
    ),
    norm_far_above_raw(
        "normalised readouts learn far larger residual updates than raw ones",
        "App. F",
        "‖b‖_rms in [20.4, 258.3] against [0.07, 0.51]",
        "settled ‖b_k‖_rms",
        "b_rms",
    ),
    Rule(
        "the radial update a_rad predicts the measured scale step",
        "App. F",
        "within 3% at 44M once the transient settles",
        "per_loop_norm's a_rad / Δs past K",
        of("per_loop_norm", lambda f: f.get("a_rad_over_ds")),
        lambda x: abs(x - 1) <= 0.03,
        lambda x: abs(x - 1) > 0.5,
    ),
    Rule(
        "per-loop RMSNorm's token norms are heavy-tailed, raw readouts' narrow",
        "App. D",
        "top-percentile tokens past 10^5 at a mean of ~4e4",
        "p99.9 / mean of the final loop, per_loop_norm over per_loop_raw",
        ratio("per_loop_norm", "per_loop_raw", "p999_over_mean"),
        lambda x: x > 1.0,
        lambda x: x < 1.0,
    ),
)


def judge(rule: Rule, figures: dict) -> dict:
    """One scale's figures ({row: {seed: figures}}) under a rule: the values per seed (the seeds
    every row it reads has) and the verdict."""
    seeds = sorted({s for by_seed in figures.values() for s in by_seed}, key=int)
    values = {}
    for seed in seeds:
        rows = {row: by_seed[seed] for row, by_seed in figures.items() if seed in by_seed}
        value = rule.value(rows)
        if value is not None:
            values[seed] = value
    if not values:
        return {"values": {}, "verdict": "not run"}
    if all(rule.holds(v) for v in values.values()):
        verdict = "follows"
    elif all(rule.against(v) for v in values.values()):
        verdict = "against"
    else:
        verdict = "mixed"
    return {"values": values, "verdict": verdict}


def shown(value) -> str:
    if isinstance(value, tuple):
        return f"{max(value[0]):.1e} / {min(value[1]):.1e}"
    return fmt(value)


def table(scales: dict[str, dict]) -> list[str]:
    """The markdown table: a line per rule, a column per scale ({name: figures})."""
    lines = [
        "| claim | study | its figure | measured | " + " | ".join(scales) + " |",
        "|---|---|---|---|" + "---|" * len(scales),
    ]
    for rule in RULES:
        cells = []
        for figures in scales.values():
            j = judge(rule, figures)
            if j["verdict"] == "not run":
                cells.append("–")
                continue
            values = ", ".join(shown(v) for v in j["values"].values())
            cells.append(f"{values} (seeds {', '.join(j['values'])}): **{j['verdict']}**")
        lines.append(
            f"| {rule.claim} | {rule.source} | {rule.study} | {rule.figure} | "
            + " | ".join(cells)
            + " |"
        )
    return lines
