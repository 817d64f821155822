"""Where the drift lives: norm vs raw readouts under per-loop CE over a grid of training settings,
on real WikiText text (run it as bench/drift_regime).

    bench/drift_regime               the full run: <= 2 hours on 2 CPU cores, rewrites
                                     docs/drift_regime/report.md, its PNGs and drift_regime.json
    SMOKE=1 bench/drift_regime OUT   the same flow at a toy size (a minute or two)
    bench/drift_regime --report [OUT]  rewrites OUT's report.md and growth.png from its
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

from megaloop.train import metrics
from megaloop.train.metrics import read as read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
import miniature  # noqa: E402
import repro_mini  # noqa: E402  (the miniature's data preparation)
import workers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "configs/experiments/drift_regime/base.yaml"
SMOKE = bool(os.environ.get("SMOKE"))
SEEDS = (0, 1)
READOUTS = ("norm", "raw")
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
DRIFT = 5.0
"""A cell drifts when the norm readout's final-loop RMS is >= 5x the raw readout's in every seed."""
GROWING = 1.05
"""Still growing: the last validation RMS >= 1.05x the one at three quarters of the run (our
choice)."""
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
    repro_mini.measure_one(run_dir, out, data)
    from megaloop.evaluation import diagnostics
    from megaloop.evaluation.settings import DiagnoseSettings

    diagnostics.run(
        DiagnoseSettings(
            model=run_dir,
            data=data,
            tokens=repro_mini.MEASURE["diagnose"]["tokens"],
            seq_len=repro_mini.SEQ_LEN,
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


def growth(c: dict) -> float | None:
    """Last validation RMS over the one nearest three quarters of the run."""
    if not c or len(c["eval_steps"]) < 2:
        return None
    i = int(np.argmin(np.abs(np.array(c["eval_steps"]) - 0.75 * c["planned"])))
    return c["eval_rms"][-1] / c["eval_rms"][i] if i < len(c["eval_steps"]) - 1 else None


def still_growing(values: list) -> bool:
    """Every seed's last-quarter growth >= GROWING."""
    return bool(values) and all(g is not None and g >= GROWING for g in values)


def local_slopes(c: dict) -> list[float]:
    """d log RMS / d log step between successive validation points (one number for a power law,
    whatever the interval)."""
    return list(np.diff(np.log(c["eval_rms"])) / np.diff(np.log(c["eval_steps"])))


def rising_fit(curves: dict[int, dict]) -> dict | None:
    """One power law, log RMS = log a + b log step, through every seed's rising part pooled (its
    validation points from the first to its largest: the window kindest to a law), with R² and
    each point's residual ln(RMS / law) by seed."""
    parts = {}
    for seed, c in curves.items():
        end = int(np.argmax(c["eval_rms"])) + 1
        parts[seed] = list(zip(c["eval_steps"][:end], c["eval_rms"][:end]))
    points = np.log([p for part in parts.values() for p in part])
    if len(points) < 3 or np.ptp(points[:, 0]) == 0:
        return None
    x, y = points.T
    b, log_a = np.polyfit(x, y, 1)
    residual = y - (log_a + b * x)
    return {
        "a": math.exp(log_a),
        "b": float(b),
        "r2": float(1 - residual.var() / y.var()) if y.var() > 0 else 1.0,
        "residuals": {
            seed: [(int(s), math.log(r) - log_a - b * math.log(s)) for s, r in part]
            for seed, part in parts.items()
        },
    }


def growth_curves(info: dict) -> dict[str, dict[int, dict]]:
    """{cell: {seed: validation curve}} of the norm readout in every drifting cell and in the long
    run: the runs whose growth the report describes, read from drift_regime.json's fields."""
    drifting = {r["cell"] for r in info["cells"] + info["extra_cells"] if r["drifts"]}
    out: dict[str, dict[int, dict]] = {}
    for name, c in info["curves"].items():
        cell, readout, seed = name.split("/")
        long = c["eval_steps"][-1:] == [info["long_steps"]]
        if readout == "norm" and (cell in drifting or long) and len(c["eval_steps"]) > 1:
            out.setdefault(cell, {})[int(seed.removeprefix("seed"))] = c
    return out


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


# --- the report -------------------------------------------------------------------------------


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"


def spread(values: list) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "—"
    if len(v) == 1:
        return fmt(v[0])
    return f"{fmt(float(np.mean(v)))} [{fmt(min(v))}, {fmt(max(v))}]"


def growths(values: list) -> str:
    return ", ".join(fmt(g) for g in values) + (" (growing)" if still_growing(values) else "")


def cell_table(rows: list[dict]) -> list[str]:
    lines = [
        "| cell | seeds | norm ‖H_K‖_rms | norm L2 | raw ‖H_K‖_rms | raw L2 | norm/raw per seed "
        "| ≥ 5× every seed | norm growth, last quarter | raw growth, last quarter | norm CE at K "
        "| raw CE at K |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["norm"]["d"] or r["raw"]["d"] or 0
        l2 = {k: [x * d**0.5 if x else None for x in r[k]["final_rms"]] for k in READOUTS}
        lines.append(
            f"| {r['cell']} | {len(r['norm']['final_rms'])} | {spread(r['norm']['final_rms'])} "
            f"| {spread(l2['norm'])} | {spread(r['raw']['final_rms'])} | {spread(l2['raw'])} "
            f"| {', '.join(fmt(x) for x in r['ratios']) or '—'} "
            f"| {'**yes**' if r['drifts'] else 'no'} "
            f"| {growths(r['norm']['growth'])} | {growths(r['raw']['growth'])} "
            f"| {spread(r['norm']['final_ce'])} | {spread(r['raw']['final_ce'])} |"
        )
    return lines


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


def plot_growth(info: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8))
    for i, (cell, seeds) in enumerate(growth_curves(info).items()):
        for seed, c in seeds.items():
            style = dict(color=f"C{i}", ls="-" if seed == 0 else "--", lw=1)
            label = f"{cell} s{seed}"
            left.plot(c["eval_steps"], c["eval_rms"], marker="o", ms=2, label=label, **style)
            mid = np.sqrt(np.array(c["eval_steps"][1:]) * np.array(c["eval_steps"][:-1]))
            right.plot(mid, local_slopes(c), marker="o", ms=2, **style)
    for ax in (left, right):
        ax.set_xscale("log")
        lo, hi = ax.get_xlim()
        ticks = [t for t in (20, 50, 100, 200, 500, 1000, 2000, 5000) if lo <= t <= hi]
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("training step")
        ax.tick_params(labelsize=7)
    left.set_yscale("log")
    left.set_ylabel("final-loop ‖H_K‖_rms (validation)")
    right.axhline(0, color="k", lw=0.5)
    right.set_ylabel("local slope d log RMS / d log step")
    fig.suptitle("norm readouts of the drifting cells: a power law would be a flat line (right)")
    if left.get_legend_handles_labels()[0]:
        fig.legend(fontsize=6, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
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


def growth_section(info: dict) -> list[str]:
    """Local log-log slopes of every drifting norm run, and one power law per cell with its
    residuals, from the validation curves alone."""
    groups = growth_curves(info)
    if not groups:
        return ["No drifting run to describe."]
    longest = max((c["eval_steps"] for g in groups.values() for c in g.values()), key=len)
    edges = [s for s in longest if s <= info["steps"]]
    intervals = list(zip(edges[:-1], edges[1:]))
    lines = [
        "From the validation records in drift_regime.json (the same 64 windows every "
        f"{edges[1] - edges[0]} steps) of the norm readout in every drifting cell, every seed, and "
        "in the long run. A power law RMS = a·step^b has one log–log slope b at every step; the "
        "local slope d log RMS / d log step between successive validation points is below, then "
        "one power law per cell fitted to all its seeds' rising parts (each seed's points from "
        "the first to its largest RMS, the window kindest to a law) with its residuals "
        "ln(RMS / law). Nothing is extrapolated.",
        "",
        "| run | " + " | ".join(f"{a}→{b}" for a, b in intervals) + " | largest RMS (step) "
        "| last / largest |",
        "|---|" + "---|" * (len(intervals) + 2),
    ]
    first, before_peak = [], []
    for cell, seeds in groups.items():
        for seed, c in sorted(seeds.items()):
            slopes = dict(zip(zip(c["eval_steps"][:-1], c["eval_steps"][1:]), local_slopes(c)))
            peak = int(np.argmax(c["eval_rms"]))
            first.append(local_slopes(c)[0])
            if peak > 0:
                before_peak.append(local_slopes(c)[peak - 1])
            columns = " | ".join(f"{slopes[i]:.2f}" if i in slopes else "—" for i in intervals)
            lines.append(
                f"| {cell}/norm/seed{seed} | {columns} | {fmt(c['eval_rms'][peak])} "
                f"({c['eval_steps'][peak]}) | {c['eval_rms'][-1] / c['eval_rms'][peak]:.2f} |"
            )
    lines += [
        "",
        f"The local slope over the first interval is {min(first):.2f} to {max(first):.2f}; over "
        "the last interval before each run's largest RMS it is "
        + (f"{min(before_peak):.2f} to {max(before_peak):.2f}." if before_peak else "—."),
    ]
    for cell, seeds in groups.items():
        past = [x for c in seeds.values() for x in local_slopes(c)[len(intervals) :]]
        if past:
            lines[-1] += (
                f" {cell} past step {edges[-1]:,}: {min(past):.2f} to {max(past):.2f} (growth.png)."
            )
    lines += [
        "",
        "| cell | seeds | points | b | R² | residual ln(RMS / law) at each point, by seed |",
        "|---|---|---|---|---|---|",
    ]
    for cell, seeds in groups.items():
        fit = rising_fit(seeds)
        if not fit:
            continue
        per_seed = "; ".join(
            f"s{seed}: "
            + " ".join(f"{e:+.2f}" for _, e in points)
            + f" (steps {points[0][0]}–{points[-1][0]})"
            for seed, points in sorted(fit["residuals"].items())
        )
        n = sum(len(part) for part in fit["residuals"].values())
        lines.append(
            f"| {cell} | {len(seeds)} | {n} | {fit['b']:.2f} | {fit['r2']:.3f} | {per_seed} |"
        )
    return lines + ["", "![growth](growth.png)"]


def write_report(info: dict, out: Path, rewritten: bool = False) -> None:
    """report.md from drift_regime.json's fields (`rewritten`: from the JSON alone, the runs
    gone)."""
    rows, extras, seconds = info["cells"], info["extra_cells"], info["run_seconds"]
    lines = [
        "# Where the drift lives: norm vs raw readouts over a grid of training settings",
        "",
        f"Written by `bench/drift_regime` ({'SMOKE' if info['smoke'] else 'full run'} on "
        f"{info['cpus']} CPU cores: {info['wall_minutes']:.0f} minutes of training and "
        f"measuring over {info['invocations']} invocation(s), {len(seconds)} runs two at a "
        f"time, {sum(seconds.values()) / 60:.0f} run-minutes; this report's invocation "
        f"{info['minutes']:.0f} minutes). "
        + (
            "Rewritten from drift_regime.json alone by `bench/drift_regime --report`: "
            "curves.png, curves_extra.png and ratio.png are the training invocation's (its "
            "training-batch curves are not in the JSON). "
            if rewritten
            else ""
        )
        + "Per-loop CE, K=4, the miniature of bench/repro_mini, "
        f"{info['steps']} steps a run, seeds {', '.join(map(str, info['seeds']))}. "
        "‖H_K‖_rms is the mean token RMS of the final loop's hidden state on the same 64 "
        "validation windows, at the last step; L2 = √d·RMS. Growth, last quarter: the last "
        f"validation RMS over the one at three quarters of the run (≥ {GROWING:g}: still "
        "growing). The study's Table 2 norms read as per-token L2 norms: 39,207 at d=512 (44M) "
        "is RMS 1,733; 56,051 at d=768 (129M) is RMS 2,023.",
        "",
        "## Every grid cell",
        "",
        *cell_table(rows),
        "",
        "![curves](curves.png)",
        "",
        "![ratio](ratio.png)",
        "",
    ]
    if extras:
        lines += ["## Extra cells (where the budget allowed)", "", *cell_table(extras), ""]
        lines += ["![extra curves](curves_extra.png)", ""]
    lines += [
        "## Growth of the final-loop RMS over training",
        "",
        *growth_section(info),
        "",
        "## The consequences beside the drift (depth, halt, diagnose on the final checkpoints)",
        "",
        "PPL at inference depth K (held-out text), PPL(K=1)/PPL(K=4) (≈1: K-invariant), mean "
        "loops of margin halting at ρ=1.01, the radial fraction r_k at the trained depth in "
        "float32 and bfloat16, and over diagnose's 30-loop rollout the slope of log(angle "
        "between H_k and H_k+1) against log ‖H_k‖_rms (Lemma 2's large-scale regime: −1).",
        "",
        "| run | ‖H_K‖_rms | PPL K=1 | K=2 | K=4 | K=8 | K1/K4 | halt loops | r_K fp32 "
        "| r_K bf16 | rollout RMS k=1→30 | angle ~ s^slope |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in info["consequences"]:
        p = m["ppl"]
        lines.append(
            f"| {m['run']} | {fmt(m['rms_K'])} | {fmt(p.get('1'))} | {fmt(p.get('2'))} "
            f"| {fmt(p.get('4'))} | {fmt(p.get('8'))} | {m['k1_over_k4']:.3f} "
            f"| {fmt(m['halt_mean_loops'])} | {m['r_fp32'][-1]:.1e} | {m['r_bf16'][-1]:.1e} "
            f"| {fmt(m['rollout_s'][0])} → {fmt(m['rollout_s'][1])} "
            f"| {fmt(m['angle_vs_s_slope'])} |"
        )
    drifting = [r["cell"] for r in rows + extras if r["drifts"]]
    growing = {
        readout: [r["cell"] for r in rows + extras if still_growing(r[readout]["growth"])]
        for readout in READOUTS
    }
    lines += [
        "",
        "## Summary (computed)",
        "",
        f"Cells where the norm readout's final-loop RMS is ≥ {DRIFT:g}× the raw readout's in "
        f"every seed: {', '.join(drifting) if drifting else 'none'}.",
        "",
        *(
            f"Cells where the {readout} readout's RMS still grew ≥ {GROWING:g}× over the last "
            f"quarter in every seed: {', '.join(growing[readout]) or 'none'}.\n"
            for readout in READOUTS
        ),
    ]
    (out / "report.md").write_text("\n".join(lines))


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


def main() -> None:
    if sys.argv[1:2] == ["--report"]:
        out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs/drift_regime"
        info = json.loads((out / "drift_regime.json").read_text())
        write_report(info, out, rewritten=True)
        plot_growth(info, out / "growth.png")
        print(f"drift_regime: report.md and growth.png rewritten from {out / 'drift_regime.json'}")
        return
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/drift_regime"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("DRIFT_WORK", ROOT / "runs/drift_regime")).resolve()
    source = Path(os.environ.get("REPRO_SOURCE", ROOT.parent / "shared/data/wikitext-103"))
    python = os.environ.get("PYTHON", sys.executable)
    budget = float(os.environ.get("DRIFT_BUDGET_MIN", 30 if SMOKE else 120))
    data = repro_mini.prepare(work, source, python)
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


if __name__ == "__main__":
    main()
