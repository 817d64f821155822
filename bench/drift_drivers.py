"""What drives the drift in the study's setup (run it as bench/drift_drivers, after
bench/study_mini, whose data, shape and runs it shares).

    bench/drift_drivers              ~70 minutes on 2 CPU cores; rewrites docs/drift_drivers/
    bench/drift_drivers --smoke --out OUT
                                     the same flow at a toy size, into OUT (after
                                     bench/study_mini --smoke with the same STUDY_WORK)

Per-loop CE with a norm and a raw readout, study_mini's first two seeds, STEPS steps at its
miniature, from the study's setup (configs/experiments/study/44m/per_loop_{norm,raw}.yaml):
1. initialisation × learning rate: `pytorch` (the study's) or `megatron` (N(0, 0.02)) × 3e-4
   (the study's) or 1e-2 (where docs/drift_regime found the drift under megatron init);
2. one change at a time from the study's setup: weight decay on matrices only; a cosine schedule
   (to lr/10, no warmup); RoPE instead of learned positions; no dropout; and an initialisation
   that scales only the tied embedding (N(0, 1) embedding, megatron init elsewhere), to tell the
   embedding's scale from the rest.
The study's own cell (pytorch, 3e-4, no change) is bench/study_mini's per-loop runs read at step
STEPS: with a constant learning rate a run's first STEPS steps do not depend on its length.
3. The onset docs/drift_regime did not search, in its own regime (megaloop's init, a BPE, a
   cosine schedule, weight decay 0.1 on matrices, tied, 1,200 steps): lr 4.8e-3 (where the 129M
   conventional row maps) and 6.9e-3, between the grid's 3e-3 (no drift) and 1e-2 (drift).
A cell drifts when the norm readout's final-loop norm is >= 5x the raw readout's in every seed
(docs/drift_regime's bar). Finished runs are skipped, so a rerun resumes; a run whose loss went
non-finite is a result (its step is reported), not a failure.

Environment: as bench/study_mini (STUDY_WORK, REPRO_SOURCE, PYTHON).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import ROOT, SMOKE, miniature, report, study
from bench.common.report import fmt, write_json
from bench.common.study import FACTOR, Job

SEEDS = study.SEEDS[:2]
"""bench/study_mini's first two seeds: its runs are this bench's study cell."""
STEPS = 6 if SMOKE else 100
"""Our choice: 1,600 windows; the study's setup drifts within the first 50 steps here (and 100
keeps both benches near 3 hours)."""
READOUTS = ("norm", "raw")
CELLS = {
    "study": (),
    "lr1e-2": ("optim.lr=1e-2", "optim.min_lr=1e-2"),
    "megatron-init": ("model.init=megatron",),
    "megatron-init-lr1e-2": ("model.init=megatron", "optim.lr=1e-2", "optim.min_lr=1e-2"),
    "decay-matrices": ("optim.decay=matrices",),
    "cosine": ("optim.schedule=cosine", "optim.min_lr=3e-5"),
    "rope": ("model.position_embedding=rope",),
    "dropout0": ("model.dropout=0",),
    "embedding-unit-init": ("model.init=megatron", "model.embedding_init_std=1.0"),
}
"""Cell name → its overrides of the study's setup (min_lr set beside lr: it must not exceed it;
a constant schedule ignores it)."""
if SMOKE:
    CELLS = {k: CELLS[k] for k in ("study", "megatron-init")}
ONSET_LRS = (4.8e-3,) if SMOKE else (4.8e-3, 6.9e-3)
ONSET_STEPS = 12 if SMOKE else 1200
ONSET = ("optim.weight_decay=0.1", "model.tie_embeddings=true")
"""The conventional rows' weight decay and tying (configs/experiments/wikitext103/base.yaml)."""


def jobs(work: Path, data_given: list[str]) -> list[Job]:
    out = []
    for cell, overrides in CELLS.items():
        if cell == "study":
            continue  # bench/study_mini's runs
        for readout in READOUTS:
            for seed in SEEDS:
                out.append(
                    Job(
                        f"drivers/{cell}/{readout}",
                        study.ROWS_DIR / f"per_loop_{readout}.yaml",
                        seed,
                        overrides,
                        data_given,
                        steps=STEPS,
                    )
                )
    return out


def onset_jobs(bpe: Path) -> list[Job]:
    base = ROOT / "configs/experiments/drift_regime/base.yaml"
    given = [f"data.path={bpe / 'train'}", f"data.valid_path={bpe / 'valid'}"]
    smoke = miniature.REPRO_SMOKE_SHAPE if SMOKE else []
    return [
        Job(
            f"onset/lr{lr:g}/{readout}",
            base,
            seed,
            (
                *ONSET,
                f"optim.lr={lr}",
                f"optim.min_lr={lr / 10}",
                f"model.readout={readout}",
                *smoke,
            ),
            given,
            steps=ONSET_STEPS,
            miniature=False,
        )
        for lr in ONSET_LRS
        for readout in READOUTS
        for seed in SEEDS
    ]


def read_run(run_dir: Path, steps: int) -> dict:
    """A run's final-loop norms up to `steps` (training batches, validation), where it stopped
    if its loss went non-finite first."""
    t = study.trajectory(run_dir, until=steps)
    done = t["train_steps"][-1] if t["train_steps"] else 0
    t["diverged_at"] = None if done >= steps else done + 1
    return t


def summarize(runs: dict) -> list[dict]:
    """Per cell: per readout and seed the final-loop L2 (validation at the last step), the
    norm/raw ratio per seed, whether it drifts, and the norm readout's growth from step 1."""
    rows = []
    for cell, by_readout in runs.items():
        row = {"cell": cell, "overrides": list(CELLS.get(cell, ())), "readouts": {}}
        for readout, by_seed in by_readout.items():
            row["readouts"][readout] = {
                str(seed): {
                    "final_l2": t["final_l2"],
                    "final_rms": t["final_rms"],
                    "final_ppl": t["final_ppl"],
                    "l2_step1": study.at_step(t, 1),
                    "diverged_at": t["diverged_at"],
                }
                for seed, t in by_seed.items()
            }
        norm, raw = row["readouts"].get("norm", {}), row["readouts"].get("raw", {})
        ratios = [
            norm[s]["final_l2"] / raw[s]["final_l2"]
            for s in norm
            if s in raw and not (norm[s]["diverged_at"] or raw[s]["diverged_at"])
        ]
        row["ratios"] = ratios
        complete = len(ratios) == len(SEEDS)
        row["drifts"] = complete and all(r >= FACTOR for r in ratios)
        row["reversed"] = complete and all(r <= 1 / FACTOR for r in ratios)
        rows.append(row)
    return rows


def changes(rows: list[dict]) -> list[dict]:
    """Each cell against the study's: the final-loop L2 of each readout over the study cell's,
    per seed."""
    base = next(r for r in rows if r["cell"] == "study")
    out = []
    for row in rows:
        if row["cell"] == "study":
            continue
        entry = {"cell": row["cell"]}
        for readout in READOUTS:
            ours, theirs = row["readouts"].get(readout, {}), base["readouts"].get(readout, {})
            entry[readout] = [
                ours[s]["final_l2"] / theirs[s]["final_l2"]
                for s in sorted(ours)
                if s in theirs and not ours[s]["diverged_at"]
            ]
        out.append(entry)
    return out


def seeds_text(values: list[float]) -> str:
    return ", ".join(fmt(v) for v in values) or "–"


def cell_value(row: dict, readout: str) -> str:
    by_seed = row["readouts"].get(readout, {})
    return (
        ", ".join(
            f"non-finite at step {r['diverged_at']}" if r["diverged_at"] else fmt(r["final_l2"])
            for _, r in sorted(by_seed.items())
        )
        or "–"
    )


def verdict(row: dict) -> str:
    if row["drifts"]:
        return "**drifts**"
    if row["reversed"]:
        return "**reversed** (raw larger)"
    return "no"


def write_report(info: dict, out: Path) -> None:
    rows, onset = info["cells"], info["onset"]
    lines = [
        "# What drives the drift in the study's setup",
        "",
        f"Written by `bench/drift_drivers` ({'SMOKE' if info['smoke'] else 'full run'}). Per-loop "
        f"CE, norm and raw readouts, seeds {', '.join(map(str, info['seeds']))}, {info['steps']} "
        "steps at bench/study_mini's miniature, each cell a change of the study's setup "
        "(configs/experiments/study/44m/). Final-loop L2 (mean per-token L2 norm) on the "
        f"validation windows at step {info['steps']}, per seed; a cell **drifts** when norm / raw "
        f">= {FACTOR:g} in every seed.",
        "",
        "| cell | overrides | norm L2 | raw L2 | norm / raw | drifts |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['cell']} | {' '.join(row['overrides']) or '(the study setup)'} | "
            f"{cell_value(row, 'norm')} | {cell_value(row, 'raw')} | "
            f"{seeds_text(row['ratios'])} | {verdict(row)} |"
        )
    lines += [
        "",
        "## Each cell against the study's",
        "",
        "Final-loop L2 over the study cell's, per seed (above 1: larger).",
        "",
        "| cell | norm readout | raw readout |",
        "|---|---|---|",
    ]
    for c in info["changes"]:
        lines.append(f"| {c['cell']} | {seeds_text(c['norm'])} | {seeds_text(c['raw'])} |")
    lines += [
        "",
        "## The onset in docs/drift_regime's regime",
        "",
        "Its miniature (megaloop's N(0, 0.02) init, a 1,024-token BPE, cosine to lr/10 after 100 "
        f"warmup steps, {info['onset_steps']} steps), weight decay 0.1 on matrices, tied; "
        "final-loop RMS on its validation windows. The grid's neighbours are docs/drift_regime's "
        "(wd0.1-tied).",
        "",
        "| lr | norm RMS | raw RMS | norm / raw | drifts |",
        "|---|---|---|---|---|",
    ]
    for row in onset:
        rms = {
            r: ", ".join(
                f"non-finite at step {v['diverged_at']}"
                if v["diverged_at"]
                else fmt(v["final_rms"])
                for _, v in sorted(row["readouts"].get(r, {}).items())
            )
            for r in READOUTS
        }
        lines.append(
            f"| {row['cell']} | {rms['norm']} | {rms['raw']} | {seeds_text(row['ratios'])} | "
            f"{verdict(row)} |"
        )
    for lr, ratio in info["grid_neighbours"].items():
        lines.append(f"| {lr} (grid) | | | {seeds_text(ratio)} | |")
    lines += ["", "![ratios](ratios.png)", "", "![growth](growth.png)", ""]
    (out / "report.md").write_text("\n".join(lines))


def by_seed(item: tuple[str, dict]) -> int:
    return int(item[0])


def grid_neighbours() -> dict[str, list[float]]:
    """docs/drift_regime's norm/raw ratios at wd0.1-tied, lr 3e-3 and 1e-2."""
    path = ROOT / "docs/drift_regime/drift_regime.json"
    if not path.is_file():
        return {}
    cells = json.loads(path.read_text()).get("cells", [])
    out = {}
    for cell in cells:
        if cell.get("cell") in ("wd0.1-tied-lr0.003", "wd0.1-tied-lr0.01"):
            out[cell["cell"].rsplit("lr", 1)[1]] = cell.get("ratios", [])
    return out


def plot(info: dict, out: Path) -> None:
    """ratios.png: each cell's norm/raw ratios; growth.png: every run's final-loop L2 per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = info["cells"]
    runs = {cell: info["trajectories"][cell] for cell in CELLS if cell in info["trajectories"]}
    fig, ax = plt.subplots(figsize=(8, 3.4))
    names = [r["cell"] for r in rows]
    for i, row in enumerate(rows):
        ax.scatter([i] * len(row["ratios"]), row["ratios"], color="C0", zorder=3)
        if row["ratios"]:
            ax.bar(i, float(np.exp(np.mean(np.log(row["ratios"])))), color="C0", alpha=0.3)
    ax.axhline(FACTOR, color="k", ls="--", lw=0.8)
    ax.axhline(1 / FACTOR, color="k", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("final-loop L2, norm / raw")
    ax.set_title(f"per seed (dots) and geometric mean; dashed: {FACTOR:g}x either way")
    fig.tight_layout()
    fig.savefig(out / "ratios.png", dpi=110)
    plt.close(fig)

    def growth(cell):
        def draw(ax):
            for readout, style in zip(READOUTS, ("-", ":")):
                for seed, t in sorted(runs[cell].get(readout, {}).items(), key=by_seed):
                    ax.plot(t["train_steps"], t["train_l2"], style, lw=0.8, color=f"C{seed}")

        return draw

    panels = {cell: growth(cell) for cell in runs}
    title = "norm readout solid, raw dotted; colour: seed"
    miniature.small_multiples(panels, "final-loop L2 (training batch)", title, out / "growth.png")


def main(argv: list[str], out: Path | None) -> None:
    out = report.command("drift_drivers", argv, out, (write_report, plot))
    work = Path(os.environ.get("STUDY_WORK", ROOT / "runs/study_mini")).resolve()
    source = Path(os.environ.get("REPRO_SOURCE", ROOT.parent / "shared/data/wikitext-103"))
    python = os.environ.get("PYTHON", sys.executable)
    start = time.time()
    data, vocab = study.prepare(work, source, python)
    bpe = miniature.prepare_bpe(work / "bpe", source, python)
    todo = jobs(work, study.data_overrides(data, vocab)) + onset_jobs(bpe)
    study.train(work, todo)
    runs = {cell: {} for cell in CELLS}
    for readout in READOUTS:  # the study's own cell: bench/study_mini's runs
        runs["study"][readout] = {
            s: read_run(work / "runs" / "study" / f"per_loop_{readout}" / f"seed{s}", STEPS)
            for s in SEEDS
        }
    onset_runs = {}
    for job in todo:
        _, cell, readout = job.name.split("/")
        steps = ONSET_STEPS if job.name.startswith("onset/") else STEPS
        into = onset_runs if job.name.startswith("onset/") else runs
        into.setdefault(cell, {}).setdefault(readout, {})[job.seed] = read_run(
            job.run_dir(work), steps
        )
    rows = summarize(runs)
    info = {
        "smoke": SMOKE,
        "steps": STEPS,
        "seeds": list(SEEDS),
        "miniature": study.MINIATURE,
        "onset_steps": ONSET_STEPS,
        "cells": rows,
        "changes": changes(rows),
        "onset": summarize(onset_runs),
        "grid_neighbours": grid_neighbours(),
        "minutes": round((time.time() - start) / 60, 1),
        "trajectories": {
            cell: {r: {str(s): t for s, t in by.items()} for r, by in c.items()}
            for cell, c in {**runs, **{f"onset/{k}": v for k, v in onset_runs.items()}}.items()
        },
    }
    write_json(out / "drift_drivers.json", info)
    info = json.loads((out / "drift_drivers.json").read_text())  # as --report reads it
    write_report(info, out)
    plot(info, out)
    print(f"drift_drivers: {info['minutes']} minutes; report in {out}")
