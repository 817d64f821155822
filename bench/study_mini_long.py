"""bench/study_mini's miniature for ten times as long (run it as bench/study_mini_long).

    bench/study_mini_long              per-loop RMSNorm and raw x seeds 42, 101, per-loop RMSNorm
                                       + penalty and final-only norm x seed 42, 2,000 steps each;
                                       depth and halt of the checkpoints at MEASURE_AT, diagnose
                                       of the last; rewrites docs/study_mini_long/
    bench/study_mini_long --smoke --out OUT
                                       the same flow at a toy size, into OUT
    bench/study_mini_long --report [--out OUT]
                                       rewrites OUT's report and figures from its JSON alone

The questions (issue 55): does the normalised state keep growing under the constant learning
rate, and at what local rate; does per-loop RMSNorm become K-invariant (PPL at K = 1 over PPL at
K = 4 across training) and does calibrated halting then stop at K = 1, as the study's Table 5
and Appendix H report; does final-only norm's K = 4 failure at 200 steps persist. The shape,
data, tokens, precision and measurement sizes are bench/study_mini's (STUDY_PRECISION as there);
the steps, the rows and seeds, the batch and validation cadence (LONG) and a checkpoint every
SAVE_EVERY steps differ. The verdict
rules are bench/common/verdicts.py's, fixed before this bench first ran.

Environment: as bench/study_mini (STUDY_PRECISION, REPRO_SOURCE, PYTHON); STUDY_WORK defaults to
runs/study_mini_long.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bench.common import SMOKE, miniature, study, verdicts, workers
from bench.common.report import fmt, write_json
from bench.common.study import ROWS_DIR, Job, growth, spent, trajectory

ROWS = {
    "per_loop_norm": (42, 101),
    "per_loop_raw": (42, 101),
    "per_loop_norm_penalty": (42,),
    "final_norm": (42,),
}
"""The rows and the released seeds each trains (issue 55: two seeds for the first two)."""
STEPS = 8 if SMOKE else 2000
SAVE_EVERY = 2 if SMOKE else 250
LONG = (
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    f"train.eval_every={3 if SMOKE else 100}",
    "train.eval_batches=32",
    f"train.keep_last={STEPS // SAVE_EVERY}",
)
"""What differs from study_mini's miniature (our choice): 8 windows a step, not 16, and
validation every 100 steps, not 50, on the same 256 windows, so that the six runs fit one
3-hour session on 2 CPU cores (with native bf16: 1.0 s a step in each of two lanes, against
1.9 s at 16 windows; 2,000 steps are 4.2 passes over the training text); every checkpoint kept
(MEASURE_AT reads them)."""
MEASURE_AT = (4, 8) if SMOKE else (250, 500, 1000, 2000)
"""The checkpoints measured with depth and halt (our choice, doubling); the last one also with
diagnose --dtype bf16."""
MARKS = (1, 2, 4, 6, 8) if SMOKE else (1, 50, 100, 200, 500, 1000, 1500, 2000)
"""Steps at which the report shows the final loop's norm and the growth between them."""


def jobs(data: Path, vocab: int) -> list[Job]:
    given = study.data_overrides(data, vocab)
    return [
        Job(f"long/{row}", ROWS_DIR / f"{row}.yaml", seed, LONG, given, STEPS, True, SAVE_EVERY)
        for row, seeds in ROWS.items()
        for seed in seeds
    ]


def checkpoint(work: Path, job: Job, step: int) -> tuple[Path, Path]:
    """The checkpoint of `job` at `step` and the folder its measurements go to."""
    run_dir = job.run_dir(work)
    out = work / "measure" / run_dir.relative_to(work / "runs") / f"step_{step:07d}"
    return run_dir / "checkpoints" / f"step_{step:07d}", out


def measure(work: Path, todo: list[Job]) -> None:
    """depth and halt of every checkpoint at MEASURE_AT not measured yet, diagnose of the last."""
    valid = work / "data/valid"
    items = [(job, step) for job in todo for step in MEASURE_AT]

    def one(item: tuple[Job, int]) -> None:
        job, step = item
        ckpt, out = checkpoint(work, job, step)
        last = step == STEPS
        if (out / ("diagnose.json" if last else "halt.json")).is_file():
            return
        began = time.time()
        workers.call(
            miniature.measure,
            ckpt,
            out,
            valid,
            study.MEASURE,
            study.SEQ_LEN,
            "bf16",
            last,
        )
        spent(work, f"measure/{job.name}/seed{job.seed}/{step}", time.time() - began)
        print(f"measured {ckpt.relative_to(work)}", flush=True)

    workers.each(one, items)


def depth_use(work: Path, job: Job) -> dict:
    """Per measured step: PPL at each depth, K=1 over K=4, and the calibrated halting's mean exit
    loop and its histogram over loops 1..4."""
    out = {}
    for step in MEASURE_AT:
        found = checkpoint(work, job, step)[1]
        depth = json.loads((found / "depth.json").read_text())
        dynamic = json.loads((found / "halt.json").read_text())["benchmark"]["dynamic"]
        ppl = {str(r["loops"]): r["ppl"] for r in depth["rows"]}
        out[str(step)] = {
            "ppl": ppl,
            "k1_over_k4": ppl["1"] / ppl["4"],
            "halt_mean_loops": dynamic["mean_loops"],
            "halt_exits": dynamic.get("exit_histogram"),
        }
    return out


def summary(work: Path, todo: list[Job], vocab: int) -> dict:
    trajectories: dict = {}
    use: dict = {}
    figures = {str(step): {} for step in (MEASURE_AT[0], STEPS)}
    for job in todo:
        row, seed = job.name.split("/")[1], str(job.seed)
        t = trajectory(job.run_dir(work))
        trajectories.setdefault(row, {})[seed] = t
        use.setdefault(row, {})[seed] = depth_use(work, job)
        for step, by_row in figures.items():
            at = trajectory(job.run_dir(work), until=int(step))
            measured = checkpoint(work, job, int(step))[1]
            by_row.setdefault(row, {})[seed] = verdicts.run_figures(at, measured)
    taken = spent(work)
    return {
        "smoke": SMOKE,
        "precision": study.PRECISION,
        "cpus": os.cpu_count(),
        "vocab": vocab,
        "steps": STEPS,
        "rows": {row: list(seeds) for row, seeds in ROWS.items()},
        "miniature": study.MINIATURE,
        "long": list(LONG),
        "measure": study.MEASURE,
        "measure_at": list(MEASURE_AT),
        "minutes": {
            "training": sum(v for k, v in taken.items() if k.startswith("runs/")) / 60,
            "measuring": sum(v for k, v in taken.items() if k.startswith("measure/")) / 60,
        },
        "trajectories": trajectories,
        "growth": {
            row: {seed: growth(t, MARKS) for seed, t in by_seed.items()}
            for row, by_seed in trajectories.items()
        },
        "depth_use": use,
        "figures": figures,
    }


# -- the report -------------------------------------------------------------------------------


def growth_lines(info: dict) -> list[str]:
    """Per run: the final loop's L2 at each mark, and its growth per step between marks."""
    marks = study.marks_of(info["growth"])
    windows = [f"{a}-{b}" for a, b in zip(marks, marks[1:])]
    norms = ["| row | seed | " + " | ".join(f"L2 @ {m}" for m in marks) + " |"]
    norms.append("|---|---|" + "---|" * len(marks))
    rates = ["| row | seed | " + " | ".join(windows) + " |"]
    rates.append("|---|---|" + "---|" * len(windows))
    for row, by_seed in info["growth"].items():
        for seed, g in by_seed.items():
            at = dict(zip(map(str, g["marks"]), g["l2"][-1]))
            norms.append(f"| {row} | {seed} | " + " | ".join(fmt(at.get(m)) for m in marks) + " |")
            rates.append(
                f"| {row} | {seed} | "
                + " | ".join(f"{100 * x:+.3f}%" for x in g["per_step"][-1])
                + " |"
            )
    return [*norms, "", "Growth per step, in percent: (ln L2(b) − ln L2(a)) / (b − a).", "", *rates]


def depth_lines(info: dict) -> list[str]:
    steps = [str(s) for s in info["measure_at"]]
    lines = [
        "| row | seed | "
        + " | ".join(f"step {s}: K1/K4 · halt loops · PPL K=4" for s in steps)
        + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for row, by_seed in info["depth_use"].items():
        for seed, use in by_seed.items():
            cells = [
                f"{use[s]['k1_over_k4']:.3f} · {use[s]['halt_mean_loops']:.2f} · "
                f"{fmt(use[s]['ppl']['4'])}"
                for s in steps
            ]
            lines.append(f"| {row} | {seed} | " + " | ".join(cells) + " |")
    return lines


def write_report(info: dict, out: Path) -> None:
    minutes = info["minutes"]
    first, last = info["measure_at"][0], info["steps"]
    lines = [
        "# The miniature for longer",
        "",
        f"Written by `bench/study_mini_long` ({'SMOKE' if info['smoke'] else 'full run'}; "
        f"{info['cpus']} CPU cores; training {fmt(minutes['training'])} min, measurements "
        f"{fmt(minutes['measuring'])} min, summed over the two lanes that ran side by side).",
        "**SMOKE run: a toy size, its numbers mean nothing.**" if info["smoke"] else "",
        "",
        f"bench/study_mini's miniature ({study.PRECISIONS[info['precision']]}), "
        f"{info['steps']} steps, with these overrides of it: "
        + ", ".join(f"`{o}`" for o in info["long"])
        + "; rows and seeds: "
        + "; ".join(f"{row} {', '.join(map(str, s))}" for row, s in info["rows"].items())
        + ". Norms are the final loop's per-token L2 on each step's training batch.",
        "",
        "## The final loop's norm and its growth",
        "",
        *growth_lines(info),
        "",
        "![growth](growth.png)",
        "",
        "## Depth use over training",
        "",
        "At each measured checkpoint: `depth`'s PPL at K = 1 over K = 4 (1.00: K-invariant), "
        "the calibrated halting's mean exit loop (ρ = 1.01, 1.00: every sequence stops at "
        "K = 1) and the PPL at K = 4.",
        "",
        *depth_lines(info),
        "",
        "![depth use](depth_use.png)",
        "",
        "## Verdicts",
        "",
        "bench/verdicts.py's rules, fixed before this bench ran, on the same runs at the first "
        "measured checkpoint and at the last (– : a measurement the step does not have).",
        "",
        *verdicts.table(
            {f"d = 96, step {first}": info["figures"][str(first)]}
            | {f"d = 96, step {last}": info["figures"][str(last)]}
        ),
        "",
        "The final checkpoints' measurements in `megaloop report`'s tables: "
        "[measurements/report.md](measurements/report.md).",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


def plot(info: dict, out: Path) -> None:
    """growth.png: every run's final-loop L2 per step (log axis); depth_use.png: K1/K4 and the
    halting's mean loops at each measured step."""

    def row_panel(row: str):
        def draw(ax):
            for seed, t in info["trajectories"][row].items():
                ax.plot(t["train_steps"], t["train_l2"], lw=0.8, label=f"seed {seed}")
            ax.set_yscale("log")

        return draw

    miniature.small_multiples(
        {row: row_panel(row) for row in info["trajectories"]},
        "final-loop L2 (training batch)",
        f"The final loop's norm over {info['steps']} steps",
        out / "growth.png",
        legend=True,
    )

    def use_panel(key: str):
        def draw(ax):
            for row, by_seed in info["depth_use"].items():
                for seed, use in by_seed.items():
                    steps = [int(s) for s in use]
                    ax.plot(steps, [u[key] for u in use.values()], "o-", label=f"{row} {seed}")

        return draw

    miniature.small_multiples(
        {
            "PPL K=1 / K=4": use_panel("k1_over_k4"),
            "halting: mean exit loop": use_panel("halt_mean_loops"),
        },
        "value",
        "Depth use at each measured checkpoint",
        out / "depth_use.png",
        legend=True,
    )


def main(argv: list[str], out: Path | None) -> None:
    out, work, python, data, vocab = study.start("study_mini_long", argv, out, (write_report, plot))
    todo = jobs(data, vocab)
    study.train(work, todo, "study_mini_long")
    measure(work, todo)
    finals = [str(checkpoint(work, job, STEPS)[1].relative_to(work)) for job in todo]
    study.measurements_report(python, work, out, "runs", *finals)
    write_json(out / "study_mini_long.json", summary(work, todo, vocab))
    info = json.loads((out / "study_mini_long.json").read_text())  # as --report reads it
    write_report(info, out)
    plot(info, out)
    print(f"study_mini_long: report in {out}")
