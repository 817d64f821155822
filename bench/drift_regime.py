"""Where the drift lives: norm vs raw readouts under per-loop CE over a grid of training settings,
on real WikiText text (run it as bench/drift_regime).

    bench/drift_regime               the full run: <= 2 hours on 2 CPU cores, rewrites
                                     docs/drift_regime/report.md, its PNGs and drift_regime.json
    bench/drift_regime --smoke --out OUT
                                     the same flow at a toy size (a minute or two)
    bench/drift_regime --report [--out OUT]
                                     rewrites OUT's report.md and growth.png from its
                                     drift_regime.json alone (trains and measures nothing)

The model is the miniature of bench/repro_mini (configs/experiments/drift_regime/base.yaml:
d=96, 2 layers, K=4, a 1,024-token BPE, 4 x 128 tokens a step, 1,200 steps), trained with per-loop
CE, once with an RMSNorm (`norm`) and once with a `raw` readout, seeds 0 and 1, in every cell of

    optim.weight_decay {0, 0.1} x model.tie_embeddings {true, false} x optim.lr {1e-3, 3e-3, 1e-2}

(min_lr = lr/10). Every run logs ||H_k||_rms per loop every 20 steps and on the same validation
windows every 100, so growth over training is a curve. Then, in this order and only while the
budget's projection allows (DRIFT_BUDGET_MIN, default 120 minutes in all): a run 3x the
miniature's length (3,600 steps) at the cell that drifts most; depth, halt and diagnose (float32
and bfloat16) on the final checkpoints of the most- and least-drifting cells and the long runs;
the most-drifting cell with 8 layers (the study's) instead of 2; and with weight decay 0.1 on the
matrices but kept off the embedding and W_out (optim.decay_embeddings=false). Every cell is named
for what it runs (wd{decay}-{tied|untied}-lr{lr}, then what it adds). Finished runs are skipped,
so a rerun resumes. The report (report.md, PNGs, drift_regime.json) is written unedited into OUT;
the verdict is the hand-written README beside it. The report's growth section reads only the
validation curves kept in drift_regime.json, so `--report` rewrites it after the runs are gone.

Environment: REPRO_SOURCE (a folder with wiki.test.raw, trained on, and wiki.valid.raw; default
../shared/data/wikitext-103), DRIFT_WORK (scratch, default runs/drift_regime), DRIFT_BUDGET_MIN,
PYTHON (the interpreter with megaloop installed).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import ROOT, SMOKE, miniature, report, workers
from bench.drift_regime_report import (
    DRIFT,
    READOUTS,
    growth,
    plot_growth,
    still_growing,
    write_report,
)
from megaloop.train import metrics
from megaloop.train.metrics import read as read_metrics

BASE = ROOT / "configs/experiments/drift_regime/base.yaml"
SEEDS = (0, 1)
STEPS = 12 if SMOKE else 1200
LONG_STEPS = 3 * STEPS
WEIGHT_DECAYS, TIES, LRS = (0.0, 0.1), (True, False), (1e-3, 3e-3, 1e-2)
if SMOKE:  # two cells, and every extra step of the flow
    WEIGHT_DECAYS, TIES, LRS = (0.0,), (True, False), (1e-2,)
EXTRA_SEEDS = (0,) if SMOKE else SEEDS
SMOKE_SHAPE = [
    *miniature.SMOKE_MODEL,
    "train.log_every=2",
    "train.eval_every=4",
    "train.eval_batches=1",
]
LAYERS_FACTOR = 4.0
"""Projected cost of a step with 8 layers against 2 (for the budget; measured after)."""
MEASURE_MINUTES = 0.6
"""Projected minutes of depth + halt + diagnose of one run (repro_mini measured ~0.25)."""


@dataclass(frozen=True)
class Cell:
    name: str
    overrides: tuple[str, ...]
    steps: int = STEPS
    seeds: tuple[int, ...] = SEEDS
    grid: bool = True


@dataclass(frozen=True)
class Run:
    cell: Cell
    readout: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.cell.name}/{self.readout}/seed{self.seed}"


def cell_name(overrides: tuple[str, ...]) -> str:
    """wd{weight decay}-{tied|untied}-lr{lr}: the grid's keys as the run resolves them."""
    key = dict(o.split("=", 1) for o in overrides)
    tie = "tied" if key["model.tie_embeddings"] == "true" else "untied"
    return f"wd{float(key['optim.weight_decay']):g}-{tie}-lr{float(key['optim.lr']):g}"


def grid() -> list[Cell]:
    cells = []
    for wd in WEIGHT_DECAYS:
        for tie in TIES:
            for lr in LRS:
                overrides = (
                    f"optim.weight_decay={wd}",
                    f"model.tie_embeddings={str(tie).lower()}",
                    f"optim.lr={lr}",
                    f"optim.min_lr={lr / 10}",
                )
                cells.append(Cell(cell_name(overrides), overrides))
    return cells


def variant(cell: Cell, suffix: str, extra: tuple[str, ...], **kwargs) -> Cell:
    """`cell` with `extra` overrides (replacing its own for the same keys), named for what it
    runs: a variant that changes a grid key carries the new value in its name."""
    changed = {o.split("=", 1)[0] for o in extra}
    overrides = tuple(o for o in cell.overrides if o.split("=", 1)[0] not in changed) + extra
    return Cell(f"{cell_name(overrides)}-{suffix}", overrides, grid=False, **kwargs)


class Bench:
    def __init__(self, work: Path, data: Path, budget_min: float):
        self.work, self.data = work, data
        self.start, self.budget_s = time.time(), budget_min * 60
        self.seconds_file = work / "run_seconds.json"
        self.seconds: dict[str, float] = (
            json.loads(self.seconds_file.read_text()) if self.seconds_file.is_file() else {}
        )
        """Wall seconds of each run's training, kept across reruns (a resumed bench reports the
        runs it skipped with the time they took when they ran)."""
        self.clock_file = work / "clock.json"
        spans = json.loads(self.clock_file.read_text()) if self.clock_file.is_file() else []
        self.spans = [*spans, [self.start, self.start]]
        """[start, end of its last training or measurement] of every invocation: the bench's
        own wall time, however many invocations (and pauses between them) it took."""

    def run_dir(self, run: Run) -> Path:
        return self.work / "runs" / run.name

    def finished(self, run: Run) -> bool:
        return metrics.finished(self.run_dir(run), run.cell.steps)

    def train(self, runs: list[Run]) -> None:
        """Each run not yet finished, in the two workers; failures are recorded (a diverged run
        is a result), not raised."""

        def one(run: Run) -> None:
            if self.finished(run):
                return
            log = self.work / "logs" / f"{run.name.replace('/', '-')}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            began = time.time()
            argv = [
                "train",
                str(BASE),
                f"train.dir={self.run_dir(run)}",
                f"train.seed={run.seed}",
                f"train.steps={run.cell.steps}",
                f"model.readout={run.readout}",
                f"data.path={self.data / 'train'}",
                f"data.valid_path={self.data / 'valid'}",
                *run.cell.overrides,
                *(SMOKE_SHAPE if SMOKE else []),
            ]
            code = workers.megaloop(argv, log)
            self.seconds[run.name] = time.time() - began
            self.seconds_file.write_text(json.dumps(self.seconds, indent=1))
            self.worked()
            print(
                f"[{self.minutes():5.1f} min] {run.name}: exit {code}, "
                f"{self.seconds[run.name]:.0f} s (log {log})",
                flush=True,
            )

        workers.each(one, sorted(runs, key=lambda r: -r.cell.steps))

    def worked(self) -> None:
        self.spans[-1][1] = time.time()
        self.clock_file.write_text(json.dumps(self.spans))

    def wall_minutes(self) -> float:
        """The invocations' time from their start to their last work, summed."""
        return sum(end - start for start, end in self.spans) / 60

    def invocations(self) -> int:
        """Those that trained or measured anything."""
        return sum(end > start for start, end in self.spans)

    def minutes(self) -> float:
        return (time.time() - self.start) / 60

    def left_s(self) -> float:
        return self.budget_s - (time.time() - self.start)

    def step_seconds(self) -> float:
        """Measured wall seconds of one grid step (two runs at a time)."""
        grid_runs = [s for name, s in self.seconds.items() if "-L8" not in name]
        return float(np.median(grid_runs)) / STEPS if grid_runs else 0.15

    def measured(self, run: Run) -> bool:
        return (self.work / "measure" / run.name / "diagnose-bf16" / "diagnose.json").is_file()

    def measure(self, runs: list[Run]) -> None:
        valid = self.work / "source/wiki.valid.raw"

        def one(run: Run) -> None:
            out = self.work / "measure" / run.name
            if self.measured(run):
                return
            workers.call(measure_one, self.run_dir(run), out, valid)
            self.worked()
            print(f"[{self.minutes():5.1f} min] measured {run.name}", flush=True)

        workers.each(one, runs)


def measure_one(run_dir: Path, out: Path, data: Path) -> None:
    """repro_mini's depth, halt and diagnose, and diagnose's radial fractions in bfloat16."""
    miniature.measure_bpe(run_dir, out, data)
    from megaloop.evaluation import diagnostics
    from megaloop.evaluation.settings import DiagnoseSettings

    diagnostics.run(
        DiagnoseSettings(
            model=run_dir,
            data=data,
            tokens=miniature.REPRO_MEASURE["diagnose"]["tokens"],
            seq_len=miniature.REPRO_SEQ_LEN,
            rollout=2,
            dtype="bfloat16",
            out=out / "diagnose-bf16",
        )
    )


# --- reading the runs -----------------------------------------------------------------------


def curve(run_dir: Path) -> dict | None:
    """Final-loop RMS over training (every logged step and every validation) of one run."""
    m = read_metrics(run_dir)
    if m is None:
        return None
    steps = [r for r in m["steps"] if all(map(math.isfinite, r["hidden_rms"]))]
    evals = [r for r in m["evals"] if all(map(math.isfinite, r["hidden_rms"]))]
    return {
        "steps": [r["step"] for r in steps],
        "rms": [r["hidden_rms"][-1] for r in steps],
        "eval_steps": [r["step"] for r in evals],
        "eval_rms": [r["hidden_rms"][-1] for r in evals],
        "eval_ce": [r["ce"][-1] for r in evals],
        "d": m["config"]["model"]["hidden_size"],
        "planned": m["config"]["train"]["steps"],
        "warmup": m["config"]["optim"]["warmup_steps"],
        "finished": bool(evals) and evals[-1]["step"] == m["config"]["train"]["steps"],
    }


def summarize(bench: Bench, cells: list[Cell]) -> list[dict]:
    rows = []
    for cell in cells:
        row = {"cell": cell.name, "overrides": list(cell.overrides), "steps": cell.steps}
        for readout in READOUTS:
            curves = [curve(bench.run_dir(Run(cell, readout, s))) for s in cell.seeds]
            finals = [c["eval_rms"][-1] if c and c["finished"] else None for c in curves]
            row[readout] = {
                "final_rms": finals,
                "final_ce": [c["eval_ce"][-1] if c and c["finished"] else None for c in curves],
                "growth": [growth(c) if c and c["finished"] else None for c in curves],
                "d": next((c["d"] for c in curves if c), None),
            }
        pairs = [
            (n, r) for n, r in zip(row["norm"]["final_rms"], row["raw"]["final_rms"]) if n and r
        ]
        ratios = [n / r for n, r in pairs]
        complete = len(pairs) == len(cell.seeds)
        row["ratios"] = ratios
        row["min_ratio"] = min(ratios) if complete else None
        row["drifts"] = complete and min(ratios) >= DRIFT
        row["norm_still_growing"] = complete and still_growing(row["norm"]["growth"])
        rows.append(row)
    return rows


def plot_curves(bench: Bench, cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = math.ceil(len(cells) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, cell in zip(axes.flat, cells):
        for readout, style in (("norm", "-"), ("raw", "--")):
            for seed in cell.seeds:
                c = curve(bench.run_dir(Run(cell, readout, seed)))
                if c and c["steps"]:
                    ax.plot(
                        c["steps"],
                        c["rms"],
                        style,
                        color="C0" if readout == "norm" else "C1",
                        alpha=0.8,
                        label=f"{readout} s{seed}",
                    )
        ax.set_yscale("log")
        ax.set_title(cell.name, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(cells) :]:
        ax.axis("off")
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=6)
    fig.supxlabel("training step")
    fig.supylabel("final-loop ‖H_K‖_rms (training batches)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ratio(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {r["cell"]: r for r in rows}
    labels = [(wd, tie) for wd in WEIGHT_DECAYS for tie in TIES]
    grid_ratio = np.full((len(labels), len(LRS)), np.nan)
    for i, (wd, tie) in enumerate(labels):
        for j, lr in enumerate(LRS):
            r = by_name.get(f"wd{wd:g}-{'tied' if tie else 'untied'}-lr{lr:g}")
            if r and r["ratios"]:
                grid_ratio[i, j] = float(np.mean(r["ratios"]))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    image = ax.imshow(np.log10(grid_ratio), cmap="coolwarm", vmin=-2, vmax=2)
    for (i, j), value in np.ndenumerate(grid_ratio):
        if np.isfinite(value):
            ax.text(j, i, f"{value:.2g}×", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(LRS)), [f"lr {lr:g}" for lr in LRS])
    ax.set_yticks(
        range(len(labels)), [f"wd {wd:g}, {'tied' if t else 'untied'}" for wd, t in labels]
    )
    fig.colorbar(image, label="log10 (norm / raw final-loop RMS)")
    ax.set_title("norm / raw final-loop ‖H_K‖_rms (mean of seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def consequences(bench: Bench, runs: list[Run]) -> list[dict]:
    out = []
    for run in runs:
        folder = bench.work / "measure" / run.name
        try:
            depth = json.loads((folder / "depth.json").read_text())
            halt = json.loads((folder / "halt.json").read_text())
            diag = json.loads((folder / "diagnose.json").read_text())
            bf16 = json.loads((folder / "diagnose-bf16" / "diagnose.json").read_text())
        except FileNotFoundError:
            continue
        ppl = {r["loops"]: r["ppl"] for r in depth["rows"]}
        roll = diag["rollout"]
        s, angle = np.array(roll["s"][1:]), np.array(roll["angle_deg"])
        keep = (s > 0) & (angle > 0)
        slope = (
            float(np.polyfit(np.log(s[keep]), np.log(angle[keep]), 1)[0])
            if keep.sum() > 2
            else None
        )
        out.append(
            {
                "run": run.name,
                "rms_K": diag["scale"][-1]["rms"]["mean"],
                "ppl": ppl,
                "k1_over_k4": ppl.get(1, math.nan) / ppl.get(4, math.nan),
                "halt_mean_loops": halt["benchmark"]["dynamic"]["mean_loops"],
                "r_fp32": diag["radial"]["r"],
                "r_bf16": bf16["radial"]["r"],
                "rollout_s": [roll["s"][0], roll["s"][-1]],
                "angle_vs_s_slope": slope,
            }
        )
    return out


def extra_work(bench: Bench, best: Cell, least: Cell) -> tuple[Cell, list[dict], list[Run]]:
    """What the budget still allows after the grid, in order: the long run at the most drifting
    cell, the measurements, that cell with 8 layers, and with weight decay 0.1 on its matrices but
    not on the embedding / W_out. Each is skipped (saying so) when its projected minutes do not
    fit what is left, minus 3 for the report."""
    per_step = bench.step_seconds()
    long_cell = variant(best, "long", (), steps=LONG_STEPS, seeds=(0,))
    layers = variant(best, "L8", ("model.num_layers=8",), seeds=EXTRA_SEEDS)
    undecayed = variant(
        best,
        "emb-undecayed",
        ("optim.weight_decay=0.1", "optim.decay_embeddings=false"),
        seeds=EXTRA_SEEDS,
    )
    plan = [
        ("long run", [long_cell], per_step * LONG_STEPS),
        ("measurements", [], 6 * MEASURE_MINUTES * 60 / 2),
        ("8 layers", [layers], 2 * per_step * STEPS * LAYERS_FACTOR),
        ("no decay on the embeddings", [undecayed], 2 * per_step * STEPS),
    ]
    extras, measured = [], []
    for what, new_cells, estimate in plan:
        runs = [Run(c, r, s) for c in new_cells for r in READOUTS for s in c.seeds]
        if not new_cells:  # the measurements of the runs that exist, done or not before
            cells = dict.fromkeys((best, least, long_cell))  # best may be least: a tie
            candidates = [Run(c, r, 0) for c in cells for r in READOUTS]
            measured = [run for run in candidates if bench.finished(run)]
            done = all(bench.measured(run) for run in measured)
        else:
            done = all(bench.finished(run) for run in runs)
        if not done and estimate > bench.left_s() - 180:
            print(
                f"[{bench.minutes():5.1f} min] skipped the {what}: needs ~{estimate / 60:.0f} "
                f"min, {bench.left_s() / 60:.0f} left",
                flush=True,
            )
            continue
        if new_cells:
            bench.train(runs)
            if long_cell not in new_cells:
                extras += summarize(bench, new_cells)
        else:
            bench.measure(measured)
    return long_cell, extras, measured


def rewrite(info: dict, out: Path) -> None:
    write_report(info, out, rewritten=True)
    plot_growth(info, out / "growth.png")


def main(argv: list[str], out: Path | None) -> None:
    out = report.command("drift_regime", argv, out, (rewrite,))
    work = Path(os.environ.get("DRIFT_WORK", ROOT / "runs/drift_regime")).resolve()
    source = Path(os.environ.get("REPRO_SOURCE", ROOT.parent / "shared/data/wikitext-103"))
    python = os.environ.get("PYTHON", sys.executable)
    budget = float(os.environ.get("DRIFT_BUDGET_MIN", 30 if SMOKE else 120))
    data = miniature.prepare_bpe(work, source, python)
    bench = Bench(work, data, budget)

    cells = grid()
    bench.train([Run(c, r, s) for c in cells for r in READOUTS for s in c.seeds])
    rows = summarize(bench, cells)
    complete = [r for r in rows if r["min_ratio"] is not None]
    if complete:
        top = max(complete, key=lambda r: r["min_ratio"])
        bottom = min(complete, key=lambda r: r["min_ratio"])
        print(f"[{bench.minutes():5.1f} min] grid done; most drifting: {top['cell']}", flush=True)
        best, least = (next(c for c in cells if c.name == r["cell"]) for r in (top, bottom))
        long_cell, extras, measured_runs = extra_work(bench, best, least)
    else:
        long_cell, extras, measured_runs = None, [], []

    plot_curves(bench, cells, out / "curves.png")
    plot_ratio(rows, out / "ratio.png")
    extra_cells = [c for c in [long_cell] if c] + [
        Cell(r["cell"], tuple(r["overrides"]), grid=False) for r in extras
    ]
    if extras or long_cell:
        plot_curves(bench, extra_cells, out / "curves_extra.png")
    measured = consequences(bench, measured_runs)
    all_runs = [Run(c, r, s) for c in cells + extra_cells for r in READOUTS for s in c.seeds]
    text = (
        json.dumps(
            {
                "smoke": SMOKE,
                "steps": STEPS,
                "long_steps": LONG_STEPS,
                "seeds": SEEDS,
                "budget_minutes": budget,
                "minutes": round(bench.minutes(), 1),
                "wall_minutes": round(bench.wall_minutes(), 1),
                "invocations": bench.invocations(),
                "cpus": os.cpu_count(),
                "run_seconds": bench.seconds,
                "cells": rows,
                "extra_cells": extras,
                "consequences": measured,
                "curves": {
                    run.name: {k: c[k] for k in ("eval_steps", "eval_rms", "eval_ce")}
                    for run in all_runs
                    if (c := curve(bench.run_dir(run)))
                },
            },
            indent=1,
        )
        + "\n"
    )
    (out / "drift_regime.json").write_text(text)
    info = json.loads(text)  # the report reads what the JSON holds, as --report does
    write_report(info, out)
    plot_growth(info, out / "growth.png")
    print(f"drift_regime: {bench.minutes():.1f} minutes; report in {out}")
