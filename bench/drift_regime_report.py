"""docs/drift_regime's report: what the runs' validation curves say (growth, a power law
through the rising part) and report.md with its growth figure, all from drift_regime.json, so
that `python -m bench drift_regime --report` rewrites them after the runs are gone."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

READOUTS = ("norm", "raw")
DRIFT = 5.0
"""A cell drifts when the norm readout's final-loop RMS is >= 5x the raw readout's in every seed."""
GROWING = 1.05
"""Still growing: the last validation RMS >= 1.05x the one at three quarters of the run (our
choice)."""


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
        *consequence_lines(info["consequences"]),
    ]
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


def consequence_lines(consequences: list[dict]) -> list[str]:
    """The depth, halt and diagnose figures of the measured runs, a line each."""
    lines = [
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
    for m in consequences:
        p = m["ppl"]
        lines.append(
            f"| {m['run']} | {fmt(m['rms_K'])} | {fmt(p.get('1'))} | {fmt(p.get('2'))} "
            f"| {fmt(p.get('4'))} | {fmt(p.get('8'))} | {m['k1_over_k4']:.3f} "
            f"| {fmt(m['halt_mean_loops'])} | {m['r_fp32'][-1]:.1e} | {m['r_bf16'][-1]:.1e} "
            f"| {fmt(m['rollout_s'][0])} → {fmt(m['rollout_s'][1])} "
            f"| {fmt(m['angle_vs_s_slope'])} |"
        )
    return lines
