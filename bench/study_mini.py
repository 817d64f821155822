"""The study's Table 2 at CPU scale, in the study's released setup (run it as bench/study_mini).

    bench/study_mini               every Table 2 row x seeds 42, 101, 202, then depth, halt and
                                   diagnose --dtype bf16 of every final checkpoint; rewrites
                                   docs/study_mini/ (report.md, study_mini.json, PNGs)
    SMOKE=1 bench/study_mini OUT   two rows, two seeds, a few steps: the same flow in minutes
    bench/study_mini --report [OUT]  rewrites OUT's report.md and growth.png from its
                                   study_mini.json alone (trains and measures nothing)

1. Data: the WikiText-103 test text is linked as the training split and the validation text as
   itself (never copied into the repo); `megaloop prep wikitext103 --tokenizer words:20000
   --layout stream` makes the study's tokens: its word-level tokenizer trained on the training
   text, each split one stream of its non-empty lines.
2. Training: each row of configs/experiments/study/44m/ (the study's setup: PyTorch's default
   initialisation, learned positions, dropout 0.1, AdamW at a constant 3e-4 with weight decay
   0.01 on every parameter, bf16 autocast with an fp32 residual stream, windows with a stride;
   STUDY_PRECISION=fp32 trains in fp32 instead) at the miniature shape of
   MINIATURE, through `megaloop train` in two worker processes (bench/workers.py). Finished runs
   are skipped, so a rerun resumes.
3. Measurements of every final checkpoint on the validation split's token stream: `depth`,
   `halt` and `diagnose --dtype bf16` (the study's precision).
4. The report: the final-loop hidden norm in the study's unit (the mean over tokens of the
   per-token L2 norm, sqrt(d) times the mean per-token RMS that megaloop logs) and in RMS, per
   row over seeds (mean ± std, min, max), its growth over training, the final-loop perplexity;
   the norm and raw readouts side by side under per-loop CE with their ratio per seed; a verdict
   per row of Table 2 by the rules in VERDICTS, fixed before the run; then `megaloop report`'s
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
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import miniature
import numpy as np
import workers

ROOT = Path(__file__).resolve().parent.parent
ROWS_DIR = ROOT / "configs/experiments/study/44m"
SMOKE = bool(os.environ.get("SMOKE"))
SEEDS = (42, 101) if SMOKE else (42, 101, 202)
"""The released code's seeds (scripts/reproduce_table1.sh)."""
STEPS = 6 if SMOKE else 200
"""Optimizer steps of every run (our choice: 3,200 windows, 0.4 epochs of the training text;
sized so that this bench and bench/drift_drivers fit 3 hours on 2 CPU cores; at this shape the
norm readout's state grows ten-fold within the first 50)."""
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
PRECISION = os.environ.get("STUDY_PRECISION", "bf16")
if PRECISION not in ("bf16", "fp32"):
    sys.exit(f"study_mini: STUDY_PRECISION={PRECISION!r}; use bf16 (the study's) or fp32")
WIDTH = 32 if SMOKE else 96
MINIATURE = [
    f"train.bf16={str(PRECISION == 'bf16').lower()}",
    f"model.hidden_size={WIDTH}",
    "model.num_heads=4",
    f"model.num_layers={1 if SMOKE else 2}",
    f"model.max_seq_len={32 if SMOKE else 128}",
    f"data.seq_len={32 if SMOKE else 128}",
    f"data.stride={16 if SMOKE else 64}",
    "data.epochs=null",
    "train.micro_batch_size=16",
    "train.global_batch_size=16",
    "train.log_every=1",
    f"train.eval_every={3 if SMOKE else 50}",
    f"train.eval_batches={2 if SMOKE else 16}",
    "wandb.mode=disabled",
]
"""The miniature (our choice): the study's 44M rows at d=96, 2 layers of 4 heads (the study's
K=4), windows of 128 tokens every 64 (its 256 every 128, halved), 16 windows a step (a quarter
of its 64), STEPS steps; validation on the first 256 windows (32,768 tokens) of the validation
text every 50 steps. The vocabulary is the tokenizer's own size (the study's rule on the
training text)."""
MEASURE = {
    "depth": {"loops": [1, 2, 3, 4, 8], "sequences": 8 if SMOKE else 64},
    "halt": {"calib": 8 if SMOKE else 64, "bench": 8 if SMOKE else 64},
    "diagnose": {"tokens": 256 if SMOKE else 2048, "rollout": 6 if SMOKE else 30},
}
SEQ_LEN = 32 if SMOKE else 128
FACTOR = 5.0
"""A comparison counts in a verdict when it holds by this factor in every seed (our choice, the
same bar as docs/drift_regime's)."""
EXIT_UNHEALTHY = 65
"""`megaloop train`'s exit when a loss went non-finite: a diverged run is a result."""


@dataclass
class Job:
    """One training run of `steps` steps: `config` at the miniature (unless `miniature` is
    false) with `data_overrides` and `overrides`, into WORK/runs/`name`/seed`seed`."""

    name: str
    config: Path
    seed: int
    overrides: tuple[str, ...] = ()
    data_overrides: list[str] = field(default_factory=list)
    steps: int = STEPS
    miniature: bool = True
    save_every: int | None = None
    """None: one checkpoint, at the end."""

    def run_dir(self, work: Path) -> Path:
        return work / "runs" / self.name / f"seed{self.seed}"


def prepare(work: Path, source: Path, python: str) -> tuple[Path, int]:
    """The study's tokens of the linked texts; returns the data folder and the vocabulary."""
    options = ("--tokenizer", "words:20000", "--layout", "stream")
    data = miniature.prepare("study_mini", work, source, python, *options)
    vocab = json.loads((data / "train.manifest.json").read_text())["vocab_size"]
    return data, vocab


def data_overrides(data: Path, vocab: int) -> list[str]:
    return [
        f"data.path={data / 'train'}",
        f"data.valid_path={data / 'valid'}",
        f"model.vocab_size={vocab}",
    ]


def train(work: Path, jobs: list[Job], bench: str = "study_mini") -> None:
    """Every job not finished yet, in the two workers; `bench` names the caller in what it
    prints."""
    from megaloop.train.metrics import finished

    todo = [j for j in jobs if not finished(j.run_dir(work), j.steps)]
    lock = threading.Lock()
    print(f"{bench}: {len(jobs) - len(todo)} of {len(jobs)} runs finished; training {len(todo)}")

    def one(job: Job) -> int:
        log = work / "logs" / f"{job.name}-seed{job.seed}.log".replace("/", "-")
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.time()
        argv = [
            "train",
            job.config,
            *(MINIATURE if job.miniature else []),
            *job.data_overrides,
            *job.overrides,
            f"train.steps={job.steps}",
            f"train.save_every={job.save_every or job.steps}",
            f"train.seed={job.seed}",
            f"train.dir={job.run_dir(work)}",
        ]
        code = workers.megaloop(argv, log)
        seconds = time.time() - start
        with lock:  # the two lanes' records in one file
            spent(work, str(job.run_dir(work).relative_to(work)), seconds)
        print(f"trained {job.name} seed {job.seed} in {seconds:.0f} s: exit {code} (log {log})")
        return code

    codes = workers.each(one, todo)
    if any(code not in (0, EXIT_UNHEALTHY) for code in codes):
        sys.exit(f"{bench}: some runs failed; see the logs above")


def spent(work: Path, what: str | None = None, seconds: float = 0.0) -> dict[str, float]:
    """WORK/seconds.json: the seconds each run (and the measurements) took, kept across
    invocations (a resumed bench's own clock knows only its part); `what` adds one."""
    record = work / "seconds.json"
    taken = json.loads(record.read_text()) if record.is_file() else {}
    if what is not None:
        taken[what] = round(seconds, 1)
        record.write_text(json.dumps(taken, indent=1))
    return taken


def measure(work: Path, run_dirs: list[Path]) -> None:
    """depth, halt and diagnose of each run not measured yet on the prepared validation split
    (the study's token stream), in the two workers."""
    valid = work / "data/valid"

    def one(run_dir: Path) -> None:
        out = work / "measure" / run_dir.relative_to(work / "runs")
        if (out / "diagnose.json").is_file():
            return
        workers.call(measure_one, run_dir, out, valid)
        print(f"measured {run_dir.relative_to(work)}", flush=True)

    workers.each(one, run_dirs)


def measure_one(run_dir: Path, out: Path, data: Path) -> None:
    miniature.measure(run_dir, out, data, MEASURE, SEQ_LEN, "bfloat16")


# -- what a run's records say -----------------------------------------------------------------


def trajectory(run_dir: Path, until: int | None = None) -> dict:
    """A run's final-loop norms over training: the training batches' (every logged step,
    dropout on) and the validation windows' (every eval, dropout off), as mean per-token L2 =
    sqrt(d)·RMS, and its last validation record (up to step `until`, when given)."""
    from megaloop.train.metrics import read

    m = read(run_dir)
    if until is not None:
        m["steps"] = [r for r in m["steps"] if r["step"] <= until]
        m["evals"] = [r for r in m["evals"] if r["step"] <= until]
    root_d = math.sqrt(m["config"]["model"]["hidden_size"])
    out = {
        "train_steps": [r["step"] for r in m["steps"]],
        "train_l2": [root_d * r["hidden_rms"][-1] for r in m["steps"]],
        "train_l2_loops": [[root_d * x for x in r["hidden_rms"]] for r in m["steps"]],
        "eval_steps": [r["step"] for r in m["evals"]],
        "eval_l2": [root_d * r["hidden_rms"][-1] for r in m["evals"]],
    }
    if not m["evals"]:  # stopped (non-finite) before its first validation
        return {**out, "final_rms": None, "final_l2": None, "final_ppl": None}
    final = m["evals"][-1]
    return {
        **out,
        "final_l2_loops": [root_d * x for x in final["hidden_rms"]],
        "final_rms": final["hidden_rms"][-1],
        "final_l2": root_d * final["hidden_rms"][-1],
        "final_ppl": math.exp(min(final["ce"][-1], 700.0)),
        "final_ppl_loops": [math.exp(min(c, 700.0)) for c in final["ce"]],
        "valid_tokens": final["valid_tokens"],
    }


def stats(values: list[float]) -> dict:
    v = np.asarray(values, dtype=float)
    return {
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
        "min": float(v.min()),
        "max": float(v.max()),
    }


def at_step(t: dict, step: int) -> float | None:
    """The training batch's final-loop L2 at `step`, or None when it was not logged."""
    steps = t["train_steps"]
    return t["train_l2"][steps.index(step)] if step in steps else None


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


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "–"
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-2):
        return f"{x:.2e}"
    return f"{x:,.{digits}g}" if abs(x) >= 1 else f"{x:.{digits}g}"


def spread(s: dict) -> str:
    return f"{fmt(s['mean'])} ± {fmt(s['std'])} [{fmt(s['min'])}, {fmt(s['max'])}]"


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


def write_json(path: Path, info: dict) -> None:
    """`info` as JSON, floats to 6 significant digits and lists of numbers on one line: the
    per-step trajectories stay diffable without a line per number."""

    def rounded(o):
        if isinstance(o, float):
            return float(f"{o:.6g}")
        if isinstance(o, dict):
            return {k: rounded(v) for k, v in o.items()}
        if isinstance(o, list):
            return [rounded(v) for v in o]
        return o

    def dumps(o, depth: int = 0) -> str:
        pad, end = " " * (depth + 1), "\n" + " " * depth
        if isinstance(o, dict) and o:
            items = (f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in o.items())
            return "{\n" + ",\n".join(items) + end + "}"
        if isinstance(o, list) and any(isinstance(v, (dict, list)) for v in o):
            return "[\n" + ",\n".join(pad + dumps(v, depth + 1) for v in o) + end + "]"
        return json.dumps(o)

    path.write_text(dumps(rounded(info)) + "\n")


PRECISIONS = {
    "bf16": "trained under bf16 autocast with the residual stream in fp32 (the study's)",
    "fp32": "trained in fp32 (STUDY_PRECISION=fp32: the study trains under bf16 autocast)",
}


def write_report(info: dict, out: Path) -> None:
    rows, claims = info["summary"]["rows"], info["summary"]["claims"]
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
        "| row | seeds | final-loop L2 | final-loop RMS | PPL at K=4 |",
        "|---|---|---|---|---|",
    ]
    for row, r in rows.items():
        lines.append(
            f"| {row} | {len(r['seeds'])} | {spread(r['final_l2'])} | {spread(r['final_rms'])} "
            f"| {spread(r['final_ppl'])} |"
        )
    marks = sorted({int(s) for r in rows.values() for s in r["train_l2_at"]})
    lines += [
        "",
        "## Growth over training",
        "",
        "Final-loop L2 of the training batch (dropout on) at steps "
        + ", ".join(map(str, marks))
        + " (mean over seeds [min, max]); growth.png draws every step.",
        "",
        "| row | " + " | ".join(f"step {s}" for s in marks) + " |",
        "|---|" + "---|" * len(marks),
    ]
    for row, r in rows.items():
        cells = []
        for s in marks:
            v = r["train_l2_at"].get(str(s))
            cells.append(
                "–" if v is None else f"{fmt(v['mean'])} [{fmt(v['min'])}, {fmt(v['max'])}]"
            )
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Per loop (validation)",
        "",
        "| row | " + " | ".join(f"L2 k={k}" for k in range(1, 5)) + " |",
        "|---|" + "---|" * 4,
    ]
    for row, r in rows.items():
        lines.append(f"| {row} | " + " | ".join(fmt(s["mean"]) for s in r["final_l2_loops"]) + " |")
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
        "| row | the study says | ratio to | per seed | verdict |",
        "|---|---|---|---|---|",
    ]
    for c in claims:
        lines.append(
            f"| {c['row']} | {c['says']} | {c['other']} | "
            + (", ".join(fmt(x) for x in c["ratios"]) or "–")
            + f" | **{c['verdict']}** |"
        )
    for damp in info["summary"]["damping_below"]:
        lines.append(
            f"| {damp['row']} | lowers norms relative to RMSNorm with the same objective | "
            f"{damp['other']} (< 1) | "
            + (", ".join(fmt(x) for x in damp["ratios"]) or "–")
            + f" | **{damp['verdict']}** |"
        )
    lines += [
        "",
        "![growth](growth.png)",
        "",
        "The measurements (depth, halt, diagnose --dtype bf16 of every final checkpoint) follow, "
        "in `megaloop report`'s tables: [measurements/report.md](measurements/report.md).",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


def plot(trajectories: dict, out: Path) -> None:
    def growth(row):
        def draw(ax):
            for seed, t in sorted(trajectories[row].items()):
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


def command_line(bench: str, rewrite) -> tuple[Path, Path, Path, str] | None:
    """What the study benches share: `BENCH --report [OUT]` calls rewrite(info, OUT) on
    OUT/BENCH.json (default OUT docs/BENCH) and returns None; otherwise `BENCH [OUT]` gives
    (OUT, the scratch folder STUDY_WORK, the text folder REPRO_SOURCE, the PYTHON to run), OUT
    made. Under SMOKE, OUT must be given: a smoke run never writes docs/."""
    if sys.argv[1:2] == ["--report"]:
        out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs" / bench
        rewrite(json.loads((out / f"{bench}.json").read_text()), out)
        print(f"{bench}: report.md and figures rewritten from {out / f'{bench}.json'}")
        return None
    if SMOKE and len(sys.argv) < 2:
        sys.exit(f"{bench}: SMOKE=1 needs an OUT folder (it never writes docs/)")
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / bench
    work = Path(os.environ.get("STUDY_WORK", ROOT / "runs" / bench)).resolve()
    source = Path(os.environ.get("REPRO_SOURCE", ROOT.parent / "shared/data/wikitext-103"))
    out.mkdir(parents=True, exist_ok=True)
    return out, work, source, os.environ.get("PYTHON", sys.executable)


def rewrite(info: dict, out: Path) -> None:
    write_report(info, out)
    plot(info["trajectories"], out)


def main() -> None:
    given = command_line("study_mini", rewrite)
    if given is None:
        return
    out, work, source, python = given
    clock = {"start": time.time()}
    data, vocab = prepare(work, source, python)
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
    # paths relative to the scratch folder: the committed report names no machine's paths (the
    # inputs are given so; the models behind the measurements are recorded absolute, cut after)
    report = [python, "-m", "megaloop", "report", "runs/study", "measure/study"]
    miniature.run([*report, "--out", str(out.resolve() / "measurements")], cwd=work)
    miniature.relative_paths(out / "measurements" / "report.md", work)
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
    write_report(info, out)
    plot(trajectories, out)
    print(f"study_mini: {info['minutes']}; report in {out}")


if __name__ == "__main__":
    main()
