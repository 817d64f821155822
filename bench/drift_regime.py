"""Where the drift lives: norm vs raw readouts under per-loop CE over a grid of training settings,
on real WikiText text (run it as bench/drift_regime).

    bench/drift_regime               the full run: <= 2 hours on 2 CPU cores, rewrites
                                     docs/drift_regime/report.md, its PNGs and drift_regime.json
    SMOKE=1 bench/drift_regime OUT   the same flow at a toy size (a minute or two)

The model is the miniature of bench/repro_mini (configs/experiments/drift_regime/base.yaml:
d=96, 2 layers, K=4, a 1,024-token BPE, 4 x 128 tokens a step, 1,200 steps), trained with per-loop
CE, once with an RMSNorm (`norm`) and once with a `raw` readout, seeds 0 and 1, in every cell of

    optim.weight_decay {0, 0.1} x model.tie_embeddings {true, false} x optim.lr {1e-3, 3e-3, 1e-2}

(min_lr = lr/10). Every run logs ||H_k||_rms per loop every 20 steps and on the same validation
windows every 100, so growth over training is a curve. Then, in this order and only while the
budget's projection allows (DRIFT_BUDGET_MIN, default 120 minutes in all): a run 3x the
miniature's length (3,600 steps) at the cell that drifts most; depth, halt and diagnose (float32
and bfloat16) on the final checkpoints of the most- and least-drifting cells and the long runs;
the most-drifting cell with 8 layers (the study's) instead of 2; and with weight decay kept off
the embedding and W_out (optim.decay_embeddings=false). Finished runs are skipped, so a rerun
resumes. The report (report.md, PNGs, drift_regime.json) is written unedited into OUT; the
verdict is the hand-written README beside it.

Environment: REPRO_SOURCE (a folder with wiki.test.raw, trained on, and wiki.valid.raw; default
../shared/data/wikitext-103), DRIFT_WORK (scratch, default runs/drift_regime), DRIFT_BUDGET_MIN,
PYTHON (the interpreter with megaloop installed).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megaloop.train import metrics
from megaloop.train.metrics import read as read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
import repro_mini  # noqa: E402  (the miniature's data preparation)

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
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_layers=1",
    "model.vocab_size=300",
    "data.seq_len=32",
    "model.max_seq_len=32",
    "train.log_every=2",
    "train.eval_every=4",
    "train.eval_batches=1",
]
DRIFT = 5.0
"""A cell drifts when the norm readout's final-loop RMS is >= 5x the raw readout's in every seed."""
GROWING = 1.05
"""Still growing: the last validation RMS >= 1.05x the one at three quarters of the run (our
choice)."""
STUDY = {"44M": (39_207, 512), "129M": (56_051, 768)}
"""The study's per-loop RMSNorm final-loop norms (Table 2) and widths; read as per-token L2 norms
(the study does not say; sqrt(d)*RMS), so RMS = L2/sqrt(d)."""
STEPS_44M = 7_300
"""The 44M config's step count, estimated: 4 epochs of WikiText-103 train (103M words, ~120M
tokens of a 20,480-token BPE: our estimate) at 64 x 1,024 tokens a step."""
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


def grid() -> list[Cell]:
    return [
        Cell(
            f"wd{wd:g}-{'tied' if tie else 'untied'}-lr{lr:g}",
            (
                f"optim.weight_decay={wd}",
                f"model.tie_embeddings={str(tie).lower()}",
                f"optim.lr={lr}",
                f"optim.min_lr={lr / 10}",
            ),
        )
        for wd in WEIGHT_DECAYS
        for tie in TIES
        for lr in LRS
    ]


def variant(cell: Cell, suffix: str, extra: tuple[str, ...], **kwargs) -> Cell:
    return Cell(f"{cell.name}-{suffix}", cell.overrides + extra, grid=False, **kwargs)


class Bench:
    def __init__(self, work: Path, data: Path, python: str, budget_min: float):
        self.work, self.data, self.python = work, data, python
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
        """Each run not yet finished, two at a time, one thread each; failures are recorded (a
        diverged run is a result), not raised."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

        def one(run: Run) -> None:
            if self.finished(run):
                return
            log = self.work / "logs" / f"{run.name.replace('/', '-')}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            began = time.time()
            cmd = [
                self.python,
                "-m",
                "megaloop",
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
            with open(log, "w") as f:
                code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
            self.seconds[run.name] = time.time() - began
            self.seconds_file.write_text(json.dumps(self.seconds, indent=1))
            self.worked()
            print(
                f"[{self.minutes():5.1f} min] {run.name}: exit {code}, "
                f"{self.seconds[run.name]:.0f} s (log {log})",
                flush=True,
            )

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one, sorted(runs, key=lambda r: -r.cell.steps)))

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
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        valid = str(self.work / "source/wiki.valid.raw")

        def one(run: Run) -> None:
            out = self.work / "measure" / run.name
            if self.measured(run):
                return
            cmd = [self.python, __file__, "--measure", str(self.run_dir(run)), str(out), valid]
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            self.worked()
            print(f"[{self.minutes():5.1f} min] measured {run.name}", flush=True)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one, runs))


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


def power_law(c: dict) -> dict | None:
    """The growth phase's law: log RMS = log a + b log step from the end of the warmup to the
    step of the largest RMS (under the cosine schedule the RMS may peak and fall as the learning
    rate decays), with the peak and the last value beside it."""
    steps, rms = np.array(c["steps"], float), np.array(c["rms"], float)
    peak = int(np.argmax(rms))
    keep = (steps >= c["warmup"]) & (steps <= steps[peak])
    if keep.sum() < 3:
        return None
    x, y = np.log(steps[keep]), np.log(rms[keep])
    b, log_a = np.polyfit(x, y, 1)
    residual = y - (log_a + b * x)
    r2 = 1 - residual.var() / y.var() if y.var() > 0 else 1.0
    return {
        "a": math.exp(log_a),
        "b": float(b),
        "r2": float(r2),
        "fit_steps": [int(steps[keep][0]), int(steps[keep][-1])],
        "peak_rms": float(rms[peak]),
        "peak_step": int(steps[peak]),
        "last_rms": float(rms[-1]),
        "rms_at_44m_steps": math.exp(log_a) * STEPS_44M**b,
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
        grows = row["norm"]["growth"]
        row["norm_still_growing"] = complete and all(g is not None and g >= GROWING for g in grows)
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


def cell_table(rows: list[dict]) -> list[str]:
    lines = [
        "| cell | seeds | norm ‖H_K‖_rms | norm L2 | raw ‖H_K‖_rms | raw L2 | norm/raw per seed "
        "| ≥ 5× every seed | norm growth, last quarter | norm CE at K | raw CE at K |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["norm"]["d"] or r["raw"]["d"] or 0
        l2 = {k: [x * d**0.5 if x else None for x in r[k]["final_rms"]] for k in READOUTS}
        lines.append(
            f"| {r['cell']} | {len(r['norm']['final_rms'])} | {spread(r['norm']['final_rms'])} "
            f"| {spread(l2['norm'])} | {spread(r['raw']['final_rms'])} | {spread(l2['raw'])} "
            f"| {', '.join(fmt(x) for x in r['ratios']) or '—'} "
            f"| {'**yes**' if r['drifts'] else 'no'} "
            f"| {', '.join(fmt(g) for g in r['norm']['growth'])}"
            f"{' (growing)' if r['norm_still_growing'] else ''} "
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


def plot_long(bench: Bench, cell: Cell, fits: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for readout, color in (("norm", "C0"), ("raw", "C1")):
        c = curve(bench.run_dir(Run(cell, readout, cell.seeds[0])))
        if not c:
            continue
        ax.plot(c["steps"], c["rms"], color=color, label=f"{readout} (training batches)")
        ax.plot(c["eval_steps"], c["eval_rms"], "o", color=color, ms=3, label=f"{readout} (valid)")
        fit = fits.get(readout)
        if fit:
            x = np.linspace(*fit["fit_steps"], 50)
            ax.plot(x, fit["a"] * x ** fit["b"], ":", color="k")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("final-loop ‖H_K‖_rms")
    ax.set_title(f"{cell.name}: power-law fits of the growth phase (dotted)", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
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


def write_report(bench: Bench, out: Path, rows, extras, long_cell, fits, measured) -> None:
    lines = [
        "# Where the drift lives: norm vs raw readouts over a grid of training settings",
        "",
        f"Written by `bench/drift_regime` ({'SMOKE' if SMOKE else 'full run'} on "
        f"{os.cpu_count()} CPU cores: {bench.wall_minutes():.0f} minutes of training and "
        f"measuring over {bench.invocations()} invocation(s), {len(bench.seconds)} runs two at "
        "a time, "
        f"{sum(bench.seconds.values()) / 60:.0f} run-minutes; this report's invocation "
        f"{bench.minutes():.0f} minutes). Per-loop CE, K=4, the "
        f"miniature of bench/repro_mini, {STEPS} steps a run, seeds {', '.join(map(str, SEEDS))}. "
        "‖H_K‖_rms is the mean token RMS of the final loop's hidden state on the same 64 "
        "validation windows, at the last step; L2 = √d·RMS. The study's Table 2 norms read as "
        "per-token L2 norms: 39,207 at d=512 (44M) is RMS 1,733; 56,051 at d=768 (129M) is RMS "
        "2,023.",
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
    lines += ["## Growth law of the final-loop RMS", ""]
    if fits:
        lines += [
            "Power law ‖H_K‖_rms = a·step^b fitted to the logged training steps of the growth "
            "phase: from the end of the warmup to the step of the largest RMS (under the cosine "
            "schedule the RMS can peak and then fall as the learning rate decays; the peak and "
            "the last value stand beside the fit). Continued to the 44M config's "
            f"~{STEPS_44M:,} steps it is an **extrapolation** (d=96, not 512; another batch, "
            "learning rate and schedule; and it assumes the growth phase lasts), set beside the "
            f"study's RMS {STUDY['44M'][0] / STUDY['44M'][1] ** 0.5:,.0f} (L2 39,207).",
            "",
            "| run | steps | fitted steps | a | b (exponent) | R² | peak RMS (step) | last RMS "
            f"| RMS at {STEPS_44M:,} steps | L2 at {STEPS_44M:,} steps |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, (steps, fit, d) in fits.items():
            at = fit["rms_at_44m_steps"]
            lines.append(
                f"| {name} | {steps} | {fit['fit_steps'][0]}–{fit['fit_steps'][1]} "
                f"| {fmt(fit['a'])} | {fit['b']:.3f} | {fit['r2']:.3f} "
                f"| {fmt(fit['peak_rms'])} ({fit['peak_step']}) | {fmt(fit['last_rms'])} "
                f"| {fmt(at)} | {fmt(at * d**0.5)} |"
            )
        if long_cell:
            lines += ["", "![long](long.png)"]
    else:
        lines += ["No run finished to fit."]
    lines += [
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
    for m in measured:
        p = m["ppl"]
        lines.append(
            f"| {m['run']} | {fmt(m['rms_K'])} | {fmt(p.get(1))} | {fmt(p.get(2))} "
            f"| {fmt(p.get(4))} | {fmt(p.get(8))} | {m['k1_over_k4']:.3f} "
            f"| {fmt(m['halt_mean_loops'])} | {m['r_fp32'][-1]:.1e} | {m['r_bf16'][-1]:.1e} "
            f"| {fmt(m['rollout_s'][0])} → {fmt(m['rollout_s'][1])} "
            f"| {fmt(m['angle_vs_s_slope'])} |"
        )
    drifting = [r["cell"] for r in rows + extras if r["drifts"]]
    lines += [
        "",
        "## Summary (computed)",
        "",
        f"Cells where the norm readout's final-loop RMS is ≥ {DRIFT:g}× the raw readout's in "
        f"every seed: {', '.join(drifting) if drifting else 'none'}.",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


def growth_fits(bench: Bench, cells: list[Cell]) -> dict:
    """The power law of each cell's seed-0 runs that finished: {run name: (steps, fit, d)}."""
    fits = {}
    for cell in cells:
        for readout in READOUTS:
            c = curve(bench.run_dir(Run(cell, readout, 0)))
            fit = power_law(c) if c and c["finished"] else None
            if fit:
                fits[f"{cell.name}/{readout}/seed0"] = (cell.steps, fit, c["d"])
    return fits


def extra_work(bench: Bench, best: Cell, least: Cell) -> tuple[Cell, list[dict], list[Run]]:
    """What the budget still allows after the grid, in order: the long run at the most drifting
    cell, the measurements, that cell with 8 layers, and with the embeddings undecayed. Each is
    skipped (saying so) when its projected minutes do not fit what is left, minus 3 for the
    report."""
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
    if sys.argv[1:2] == ["--measure"]:
        measure_one(*map(Path, sys.argv[2:5]))
        return
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/drift_regime"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("DRIFT_WORK", ROOT / "runs/drift_regime")).resolve()
    source = Path(os.environ.get("REPRO_SOURCE", ROOT.parent / "shared/data/wikitext-103"))
    python = os.environ.get("PYTHON", sys.executable)
    budget = float(os.environ.get("DRIFT_BUDGET_MIN", 30 if SMOKE else 120))
    data = repro_mini.prepare(work, source, python)
    bench = Bench(work, data, python, budget)

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

    fits = growth_fits(
        bench,
        [c for c in cells if any(r["cell"] == c.name and r["drifts"] for r in rows)]
        + ([long_cell] if long_cell else []),
    )
    long_fits = {
        readout: fits[f"{long_cell.name}/{readout}/seed0"][1]
        for readout in READOUTS
        if long_cell and f"{long_cell.name}/{readout}/seed0" in fits
    }
    plot_curves(bench, cells, out / "curves.png")
    plot_ratio(rows, out / "ratio.png")
    extra_cells = [c for c in [long_cell] if c] + [
        Cell(r["cell"], tuple(r["overrides"]), grid=False) for r in extras
    ]
    if extras or long_cell:
        plot_curves(bench, extra_cells, out / "curves_extra.png")
    if long_cell:
        plot_long(bench, long_cell, long_fits, out / "long.png")
    measured = consequences(bench, measured_runs)
    all_runs = [Run(c, r, s) for c in cells + extra_cells for r in READOUTS for s in c.seeds]
    write_report(bench, out, rows, extras, long_cell, fits, measured)
    (out / "drift_regime.json").write_text(
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
                "fits": {k: {"steps": s, **f, "d": d} for k, (s, f, d) in fits.items()},
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
    print(f"drift_regime: {bench.minutes():.1f} minutes; report in {out}")


if __name__ == "__main__":
    main()
