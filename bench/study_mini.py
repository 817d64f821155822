"""The study's Table 2 at CPU scale, in the study's released setup (run it as bench/study_mini).

    bench/study_mini               every Table 2 row x seeds 42, 101, 202, then depth, halt and
                                   diagnose --dtype bf16 of every final checkpoint; rewrites
                                   docs/study_mini/ (report.md, study_mini.json, PNGs)
    bench/study_mini --smoke --out OUT
                                   two rows, two seeds, a few steps: the same flow in minutes
    bench/study_mini --report [--out OUT]
                                   rewrites OUT's report.md and growth.png from its
                                   study_mini.json alone (trains and measures nothing)

1. Data: the WikiText-103 test text is linked as the training split and the validation text as
   itself (never copied into the repo); `megaloop prep wikitext103 --tokenizer words:20000
   --layout stream` makes the study's tokens: its word-level tokenizer trained on the training
   text, each split one stream of its non-empty lines.
2. Training: each row of configs/experiments/study/44m/ (the study's setup: PyTorch's default
   initialisation, learned positions, dropout 0.1, AdamW at a constant 3e-4 with weight decay
   0.01 on every parameter, bf16 autocast with an fp32 residual stream, windows with a stride;
   STUDY_PRECISION=fp32 trains in fp32 instead) at the miniature shape of MINIATURE
   (bench/common/study.py), through `megaloop train` in two worker processes
   (bench/common/workers.py). Finished runs are skipped, so a rerun resumes.
3. Measurements of every final checkpoint on the validation split's token stream: `depth`,
   `halt` and `diagnose --dtype bf16` (the study's precision).
4. The report: the final-loop hidden norm in the study's unit (the mean over tokens of the
   per-token L2 norm, sqrt(d) times the mean per-token RMS that megaloop logs) and in RMS, per
   row over seeds (mean ± std, min, max), its growth over training, the final-loop perplexity;
   the norm and raw readouts side by side under per-loop CE with their ratio per seed; a verdict
   per row of Table 2 by the rules in CLAIMS, fixed before the run; then `megaloop report`'s
   tables of the measurements.

Environment: STUDY_PRECISION, `bf16` (the study's: autocast, default) or `fp32` (on a CPU without
native bf16 arithmetic, AVX2 only, a bf16 step takes 12 times an fp32 one); REPRO_SOURCE, a
folder holding wiki.test.raw and wiki.valid.raw (default
../shared/data/wikitext-103 beside the repository); STUDY_WORK, the scratch folder (default
runs/study_mini); PYTHON, the interpreter with megaloop installed (default: this one).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import SMOKE, miniature, study
from bench.common.report import fmt, spread, stats, table, write_json
from bench.common.study import (
    FACTOR,
    MEASURE,
    MINIATURE,
    PRECISION,
    PRECISIONS,
    ROWS_DIR,
    SEEDS,
    SEQ_LEN,
    STEPS,
    WIDTH,
    Job,
    at_step,
    data_overrides,
    measure,
    spent,
    train,
    trajectory,
)

ROWS = (
    ("per_loop_norm", "per_loop_raw")
    if SMOKE
    else (
        "terminal_norm",
        "terminal_raw",
        "per_loop_norm",
        "per_loop_raw",
        "final_norm",
        "terminal_norm_penalty",
        "per_loop_norm_penalty",
        "exit_weighted",
        "spectral_damping_terminal",
        "spectral_damping",
        "interloop_rmsnorm",
    )
)
"""The study's Table 2 conditions, every row of configs/experiments/study/44m/. Damping twice:
which objective the study's damping row trained is not known (terminal-CE, which the study
compares with terminal + RMSNorm, and per-loop CE)."""
# -- the verdicts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """A row's claim in the study, as a ratio of final-loop norms per seed: `row`'s over
    `other`'s should be >= FACTOR (`above`) or <= 1/FACTOR; every seed past the bar the same
    way is "reproduced", past it the other way "reversed", anything else "not reproduced"."""

    row: str
    other: str
    above: bool
    says: str


CLAIMS = (
    Claim(
        "per_loop_norm",
        "per_loop_raw",
        True,
        "per-loop CE through RMSNorm still drifts far above raw (39,207 at 44M; raw in the tens)",
    ),
    Claim(
        "terminal_norm",
        "terminal_raw",
        True,
        "terminal CE through RMSNorm drifts far above raw",
    ),
    Claim(
        "per_loop_raw",
        "per_loop_norm",
        False,
        "raw readouts keep norms in the tens, under per-loop CE",
    ),
    Claim(
        "terminal_raw",
        "terminal_norm",
        False,
        "raw readouts keep norms in the tens, under terminal CE",
    ),
    Claim(
        "per_loop_norm_penalty",
        "per_loop_norm",
        False,
        "the norm penalty collapses norms to 17-27 with the same RMSNorm readout (per-loop)",
    ),
    Claim(
        "terminal_norm_penalty",
        "terminal_norm",
        False,
        "the norm penalty collapses norms to 17-27 with the same RMSNorm readout (terminal)",
    ),
    Claim(
        "final_norm",
        "per_loop_norm",
        False,
        "final-only norm controls scale: raw intermediate exits, a normalised final one",
    ),
    Claim(
        "exit_weighted",
        "per_loop_raw",
        True,
        "exit-weighted CE keeps the drift: norms in the thousands (6,470 ± 2,233 at 44M)",
    ),
    Claim(
        "spectral_damping_terminal",
        "terminal_raw",
        True,
        "spectral damping remains far above raw readouts (2,432 ± 238 at 44M)",
    ),
    Claim(
        "spectral_damping",
        "per_loop_raw",
        True,
        "spectral damping remains far above raw readouts (the per-loop CE row)",
    ),
    Claim(
        "interloop_rmsnorm",
        "per_loop_norm",
        False,
        "inter-loop RMSNorm caps the scale entering each loop",
    ),
)
"""The study's Table 2 claims about final-loop norms (its text and appendix), fixed before the
run. The damping rows' second claim, below RMSNorm with the same objective, is checked in
`damping_below`."""
DAMPING_BELOW = (
    ("spectral_damping_terminal", "terminal_norm"),
    ("spectral_damping", "per_loop_norm"),
)
"""(damping row, the RMSNorm row of its objective): "lowers norms relative to terminal +
RMSNorm", by any margin in every seed (the per-loop pair added with the per-loop damping row,
before the run of 2026-12-06)."""


def verdict(ratios: list[float], above: bool) -> str:
    if not ratios:
        return "not run"
    hit = all(r >= FACTOR for r in ratios) if above else all(r <= 1 / FACTOR for r in ratios)
    flip = all(r <= 1 / FACTOR for r in ratios) if above else all(r >= FACTOR for r in ratios)
    return "reproduced" if hit else "reversed" if flip else "not reproduced"


def ratios(trajectories: dict, row: str, other: str) -> list[float]:
    """row's final-loop L2 over other's, seed by seed (the seeds both have)."""
    a, b = trajectories.get(row, {}), trajectories.get(other, {})
    return [a[s]["final_l2"] / b[s]["final_l2"] for s in sorted(a) if s in b]


def damping_below(trajectories: dict, row: str, other: str) -> dict:
    """A damping row's other claim: below RMSNorm with its objective (by any margin, every
    seed)."""
    r = ratios(trajectories, row, other)
    if not r:
        return {"row": row, "other": other, "ratios": r, "verdict": "not run"}
    below, above = all(x < 1 for x in r), all(x > 1 for x in r)
    return {
        "row": row,
        "other": other,
        "ratios": r,
        "verdict": "reproduced" if below else "reversed" if above else "not reproduced",
    }


# -- the report -------------------------------------------------------------------------------


def summarize(trajectories: dict) -> dict:
    """Per row: final-loop L2 and RMS, PPL at K, and L2 at steps 1, 50, 100 and the last, over
    seeds; the claims' ratios and verdicts."""
    rows = {}
    marks = sorted({1, 50, 100, STEPS} if not SMOKE else {1, STEPS})
    for row, by_seed in trajectories.items():
        runs = list(by_seed.values())
        rows[row] = {
            "seeds": sorted(by_seed),
            "final_l2": stats([t["final_l2"] for t in runs]),
            "final_rms": stats([t["final_rms"] for t in runs]),
            "final_ppl": stats([t["final_ppl"] for t in runs]),
            "final_l2_loops": [stats(list(v)) for v in zip(*(t["final_l2_loops"] for t in runs))],
            "train_l2_at": {
                str(s): stats([v for t in runs if (v := at_step(t, s)) is not None])
                for s in marks
                if any(at_step(t, s) is not None for t in runs)
            },
        }
    claims = []
    for c in CLAIMS:
        r = ratios(trajectories, c.row, c.other)
        claims.append({**vars(c), "ratios": r, "verdict": verdict(r, c.above)})
    below = [damping_below(trajectories, row, other) for row, other in DAMPING_BELOW]
    return {"rows": rows, "claims": claims, "damping_below": below}


def write_report(info: dict, out: Path) -> None:
    lines = [*header_lines(info), *growth_lines(info["summary"]["rows"]), *verdict_lines(info)]
    (out / "report.md").write_text("\n".join(lines))


def header_lines(info: dict) -> list[str]:
    """What ran, and Table 2's final-loop norm and perplexity per row."""
    d = info["width"]
    lines = [
        "# The study's Table 2 at CPU scale, in its released setup",
        "",
        f"Written by `bench/study_mini` ({'SMOKE' if info['smoke'] else 'full run'} on "
        f"{info['cpus']} CPUs: {info['run_minutes']} minutes of training runs, two at a time, "
        f"and {info['measure_minutes']} of measurements). Every row of "
        "configs/experiments/study/44m/ at the miniature shape: "
        f"d={d}, {info['layers']} layers, K=4, {info['vocab']:,}-token word vocabulary (the "
        "released rule, counted row by row over the WikiText-103 test text, which trains, and "
        "the validation text), windows of "
        f"{info['seq_len']} tokens every {info['stride']}, 16 a step, {info['steps']} steps, "
        f"seeds {', '.join(map(str, info['seeds']))}; the study's initialisation, positions, "
        f"dropout and optimizer, {PRECISIONS[info.get('precision', 'bf16')]}. Norms are the "
        "final loop's, in the study's unit: "
        f"the mean over tokens of the per-token L2 norm (= √d · mean per-token RMS, √d = "
        f"{math.sqrt(d):.2f}). Values: mean ± std [min, max] over seeds.",
        "",
        "## Final-loop hidden norm and perplexity (Table 2)",
        "",
        "Final validation record (the first "
        f"{info['valid_tokens']:,} tokens of the validation text, dropout off).",
        "",
    ]
    return lines + table(
        ["row", "seeds", "final-loop L2", "final-loop RMS", "PPL at K=4"],
        [
            [
                row,
                str(len(r["seeds"])),
                spread(r["final_l2"]),
                spread(r["final_rms"]),
                spread(r["final_ppl"]),
            ]
            for row, r in info["summary"]["rows"].items()
        ],
    )


def growth_lines(rows: dict) -> list[str]:
    """The training batch's final-loop L2 at the marked steps, and the per-loop L2 at the end."""
    marks = sorted({int(s) for r in rows.values() for s in r["train_l2_at"]})

    def cell(v: dict | None) -> str:
        return "–" if v is None else f"{fmt(v['mean'])} [{fmt(v['min'])}, {fmt(v['max'])}]"

    lines = [
        "",
        "## Growth over training",
        "",
        "Final-loop L2 of the training batch (dropout on) at steps "
        + ", ".join(map(str, marks))
        + " (mean over seeds [min, max]); growth.png draws every step.",
        "",
        *table(
            ["row", *(f"step {s}" for s in marks)],
            [
                [row, *(cell(r["train_l2_at"].get(str(s))) for s in marks)]
                for row, r in rows.items()
            ],
        ),
        "",
        "## Per loop (validation)",
        "",
    ]
    return lines + table(
        ["row", *(f"L2 k={k}" for k in range(1, 5))],
        [[row, *(fmt(s["mean"]) for s in r["final_l2_loops"])] for row, r in rows.items()],
    )


def verdict_lines(info: dict) -> list[str]:
    """The norm and raw readouts side by side, then each claim's verdict."""
    rows, claims = info["summary"]["rows"], info["summary"]["claims"]
    lines = []
    pair = next((c for c in claims if c["row"] == "per_loop_norm"), None)
    if pair and pair["ratios"]:
        n, raw = rows["per_loop_norm"], rows["per_loop_raw"]
        rs = pair["ratios"]
        lines += [
            "",
            "## Norm and raw readouts under per-loop CE",
            "",
            "| | per_loop_norm | per_loop_raw | ratio norm / raw |",
            "|---|---|---|---|",
            f"| final-loop L2 | {spread(n['final_l2'])} | {spread(raw['final_l2'])} | "
            f"{fmt(float(np.mean(rs)))} [{fmt(min(rs))}, {fmt(max(rs))}] (per seed: "
            + ", ".join(fmt(x) for x in rs)
            + ") |",
            f"| PPL at K=4 | {spread(n['final_ppl'])} | {spread(raw['final_ppl'])} | |",
        ]
    lines += [
        "",
        "## Verdicts",
        "",
        f"A claim is a ratio of final-loop norms, seed by seed: **reproduced** when every seed "
        f"passes the bar ({FACTOR:g}× the way the study says), **reversed** when every seed "
        f"passes it the other way, **not reproduced** otherwise. The rules were fixed before the "
        "run (bench/study_mini.py, CLAIMS).",
        "",
    ]
    per_claim = [
        [
            c["row"],
            c["says"],
            c["other"],
            ", ".join(fmt(x) for x in c["ratios"]) or "–",
            f"**{c['verdict']}**",
        ]
        for c in claims
    ]
    per_damping = [
        [
            d["row"],
            "lowers norms relative to RMSNorm with the same objective",
            f"{d['other']} (< 1)",
            ", ".join(fmt(x) for x in d["ratios"]) or "–",
            f"**{d['verdict']}**",
        ]
        for d in info["summary"]["damping_below"]
    ]
    lines += table(
        ["row", "the study says", "ratio to", "per seed", "verdict"], per_claim + per_damping
    )
    return lines + [
        "",
        "![growth](growth.png)",
        "",
        "The measurements (depth, halt, diagnose --dtype bf16 of every final checkpoint) follow, "
        "in `megaloop report`'s tables: [measurements/report.md](measurements/report.md).",
        "",
    ]


def plot(info: dict, out: Path) -> None:
    trajectories = info["trajectories"]

    def growth(row):
        def draw(ax):
            for seed, t in sorted(trajectories[row].items(), key=lambda item: int(item[0])):
                ax.plot(t["train_steps"], t["train_l2"], lw=0.8, label=f"seed {seed}")
                ax.plot(t["eval_steps"], t["eval_l2"], "k.", ms=3)

        return draw

    miniature.small_multiples(
        {row: growth(row) for row in trajectories},
        "final-loop L2 (mean per token)",
        "final-loop hidden norm over training: lines training batches, dots validation",
        out / "growth.png",
        legend=True,
    )


def main(argv: list[str], out: Path | None) -> None:
    clock = {"start": time.time()}
    out, work, python, data, vocab = study.start("study_mini", argv, out, (write_report, plot))
    clock["prepared"] = time.time()
    given = data_overrides(data, vocab)
    jobs = [
        Job(f"study/{row}", ROWS_DIR / f"{row}.yaml", seed, data_overrides=given)
        for row in ROWS
        for seed in SEEDS
    ]
    train(work, jobs)
    clock["trained"] = time.time()
    measure(work, [j.run_dir(work) for j in jobs])
    clock["measured"] = time.time()
    if clock["measured"] - clock["trained"] > 60:  # it measured, not only skipped
        spent(work, "measure", clock["measured"] - clock["trained"])
    study.measurements_report(python, work, out, "runs/study", "measure/study")
    trajectories = {
        row: {seed: trajectory(work / "runs" / "study" / row / f"seed{seed}") for seed in SEEDS}
        for row in ROWS
    }
    clock["reported"] = time.time()
    info = {
        "smoke": SMOKE,
        "precision": PRECISION,
        "seeds": list(SEEDS),
        "rows": list(ROWS),
        "steps": STEPS,
        "width": WIDTH,
        "layers": 1 if SMOKE else 2,
        "seq_len": SEQ_LEN,
        "stride": 16 if SMOKE else 64,
        "vocab": vocab,
        "valid_tokens": next(iter(next(iter(trajectories.values())).values()))["valid_tokens"],
        "miniature": MINIATURE,
        "measure": MEASURE,
        "cpus": os.cpu_count(),
        "minutes": {
            f"{a}_to_{b}": round((clock[b] - clock[a]) / 60, 1)
            for a, b in zip(clock, list(clock)[1:])
        },
        "total_minutes": round((clock["reported"] - clock["start"]) / 60, 1),
        "run_minutes": round(
            sum(v for k, v in spent(work).items() if k.startswith("runs/study/")) / 60, 1
        ),
        "measure_minutes": round(spent(work).get("measure", 0.0) / 60, 1),
        "summary": summarize(trajectories),
        "trajectories": {
            row: {str(seed): t for seed, t in by_seed.items()}
            for row, by_seed in trajectories.items()
        },
    }
    write_json(out / "study_mini.json", info)
    info = json.loads((out / "study_mini.json").read_text())  # as --report reads it
    write_report(info, out)
    plot(info, out)
    print(f"study_mini: {info['minutes']}; report in {out}")
