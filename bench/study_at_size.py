"""The study's per-loop RMSNorm and raw rows at its own widths, 44M and 129M, on 2 CPU cores (run
it as bench/study_at_size).

    bench/study_at_size              44M x seeds 42, 101 (300 steps) and 129M x seed 42 (100
                                     steps), both rows, then depth, halt and diagnose --dtype
                                     bf16 of every final checkpoint; rewrites docs/study_at_size/
    bench/study_at_size --smoke --out OUT
                                     the same flow at a toy size, into OUT
    bench/study_at_size --report [--out OUT]
                                     rewrites OUT's report and figures from its JSON alone

The question: does the drift bench/study_mini shows at d = 96 start the same way in the study's
own models, and how fast does it grow per step there? Every setting is the preset's
(configs/experiments/study/44m/ and 129m/: model, objective, optimizer, dropout, windows,
vocabulary of 20,000), but for AT_SIZE's overrides: batch, steps and evaluation cadence, and
precision where STUDY_PRECISION=fp32 asks for it. The data are
study_mini's: the WikiText-103 test text trains, the validation text evaluates, tokenised as the
study does (bench/common/miniature.py). Runs, measurements and the report go as in study_mini (two
worker lanes of one thread; finished runs are skipped and interrupted ones resume from their
last checkpoint, so a rerun continues).

Environment: STUDY_PRECISION, `bf16` (the preset's and the study's: autocast with an fp32
residual stream; the default) or `fp32` (for a CPU without native bf16 arithmetic: on AVX2 a 44M
step under autocast takes 7-12 times an fp32 one, while with AMX it takes a seventh of one);
REPRO_SOURCE (wiki.test.raw and wiki.valid.raw; default ../shared/data/wikitext-103
beside the repository), STUDY_WORK (the scratch folder; default runs/study_at_size), PYTHON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench.common import ROOT, SMOKE, miniature, study, verdicts, workers
from bench.common.report import fmt, write_json
from bench.common.study import PRECISION, Job, growth, spent, trajectory

ROWS = ("per_loop_norm", "per_loop_raw")
SCALES = {"44m": ((42, 101), 6 if SMOKE else 300), "129m": ((42,), 4 if SMOKE else 100)}
"""Per scale: the released seeds trained, and the optimizer steps of each run (at least 300 at
44M and 100 at 129M: what 6 hours of 2 cores allow beside the longer miniature)."""
EVAL_EVERY = 2 if SMOKE else 50
AT_SIZE = [
    *(["train.bf16=false"] if PRECISION == "fp32" else []),
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    f"train.eval_every={EVAL_EVERY}",
    "train.eval_batches=16",
    "train.log_every=1",
    f"train.save_every={EVAL_EVERY}",
    "wandb.mode=disabled",
]
"""What differs from the preset (each listed in the report): 2 windows of 256 tokens a step (the
study: 64), fp32 where STUDY_PRECISION asks for it, validation every EVAL_EVERY steps on the
first 16 batches of the validation split (32 windows, 8,192 tokens; the study: the whole split
once an epoch), every step logged (the per-loop norms of each step), a checkpoint at each
validation (a rerun resumes)."""
SMOKE_MODEL = [
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_layers=1",
    "model.ffn_hidden_size=64",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "data.stride=16",
]
SEQ_LEN = 32 if SMOKE else 256
MEASURE = {
    "depth": {"loops": [1, 2, 3, 4, 8], "sequences": 8 if SMOKE else 16},
    "halt": {"calib": 8 if SMOKE else 16, "bench": 8 if SMOKE else 16},
    "diagnose": {"tokens": 256 if SMOKE else 512, "rollout": 6 if SMOKE else 8},
}
"""The measurements' sizes (our choice, a fraction of study_mini's: a bf16 forward of 129M on
these CPUs is slow)."""
MARKS = (1, 2, 4, 6) if SMOKE else (1, 10, 50, 100, 150, 200, 250, 300)
"""Steps at which the report shows each run's per-loop norms and the growth between them."""


def overrides(vocab: int) -> list[str]:
    """AT_SIZE; under --smoke also the toy model, its vocabulary the tokenizer's own."""
    return AT_SIZE + ([*SMOKE_MODEL, f"model.vocab_size={vocab}"] if SMOKE else [])


def jobs(data: Path, vocab: int) -> list[Job]:
    given = [f"data.path={data / 'train'}", f"data.valid_path={data / 'valid'}"]
    return [
        Job(
            f"{scale}/{row}",
            ROOT / f"configs/experiments/study/{scale}/{row}.yaml",
            seed,
            overrides=tuple(overrides(vocab)),
            data_overrides=given,
            steps=steps,
            miniature=False,
            save_every=EVAL_EVERY,
        )
        for scale, (seeds, steps) in SCALES.items()
        for row in ROWS
        for seed in seeds
    ]


def measure(work: Path, runs: list[Job]) -> None:
    """depth, halt and diagnose --dtype bf16 of each final checkpoint not measured yet."""

    def one(job: Job) -> None:
        run_dir = job.run_dir(work)
        out = work / "measure" / run_dir.relative_to(work / "runs")
        if (out / "diagnose.json").is_file():
            return
        began = time.time()
        workers.call(miniature.measure, run_dir, out, work / "data/valid", MEASURE, SEQ_LEN, "bf16")
        spent(work, f"measure/{job.name}/seed{job.seed}", time.time() - began)
        print(f"measured {run_dir.relative_to(work)}", flush=True)

    workers.each(one, runs)


def miniature_growth() -> dict:
    """The same figures for bench/study_mini's committed d = 96 runs (200 steps, 3 seeds), per
    row, for the comparison."""
    path = ROOT / "docs/study_mini/study_mini.json"
    if not path.is_file():
        return {}
    info = json.loads(path.read_text())
    return {
        row: {seed: growth(t, MARKS) for seed, t in info["trajectories"][row].items()}
        for row in ROWS
        if row in info["trajectories"]
    }


def long_scale() -> dict:
    """bench/study_mini_long's committed d = 96 figures at its last step, measured as these
    runs are, as one more column of the verdict table ({} until that bench has run): read at
    report time, so `--report` picks up a later long run without retraining here."""
    path = ROOT / "docs/study_mini_long/study_mini_long.json"
    if not path.is_file():
        return {}
    info = json.loads(path.read_text())
    return {f"d = 96, {info['steps']} steps": info["figures"][str(info["steps"])]}


# -- the report -------------------------------------------------------------------------------


def slope_cells(by_seed: dict, k: int) -> list[str]:
    """Per window between marks, the growth per step at loop k in percent, over seeds."""
    windows = list(zip(*(g["per_step"][k] for g in by_seed.values())))
    pct = [(f"{100 * min(w):+.2f}%", f"{100 * max(w):+.2f}%") for w in windows]
    return [f"{lo} to {hi}" if len(by_seed) > 1 else lo for lo, hi in pct]


def growth_table(info: dict, row: str) -> list[str]:
    """The final loop's growth per step, window by window, at every scale."""
    scales = {"d = 96 (study_mini)": info["miniature_growth"].get(row, {})}
    scales |= {scale: info["growth"][f"{scale}/{row}"] for scale in SCALES}
    marks = max((next(iter(g.values()))["marks"] for g in scales.values() if g), key=len)
    windows = [f"{a}-{b}" for a, b in zip(marks, marks[1:])]
    lines = ["| scale | " + " | ".join(windows) + " |", "|---|" + "---|" * len(windows)]
    for name, by_seed in scales.items():
        if by_seed:
            k = len(next(iter(by_seed.values()))["l2"]) - 1
            cells = slope_cells(by_seed, k)
            lines.append(
                f"| {name} | " + " | ".join(cells + ["–"] * (len(windows) - len(cells))) + " |"
            )
    return lines


def runs_table(info: dict) -> list[str]:
    """Per run: the final loop's L2 at each mark, the last validation's L2 and PPL at K=4."""
    marks = study.marks_of(info["growth"])
    lines = [
        "| run | seed | " + " | ".join(f"L2 @ {m}" for m in marks) + " | valid L2 | PPL K=4 |",
        "|---|---|" + "---|" * (len(marks) + 2),
    ]
    for name, by_seed in info["trajectories"].items():
        for seed, t in by_seed.items():
            g = info["growth"][name][seed]
            at = dict(zip(map(str, g["marks"]), g["l2"][-1]))
            cells = [fmt(at.get(m)) for m in marks]
            lines.append(
                f"| {name} | {seed} | "
                + " | ".join(cells)
                + f" | {fmt(t['final_l2'])} | {fmt(t['final_ppl'])} |"
            )
    return lines


def write_report(info: dict, out: Path) -> None:
    minutes = info["minutes"]
    lines = [
        "# The study's per-loop rows at its own widths",
        "",
        f"Written by `bench/study_at_size` ({'SMOKE' if info['smoke'] else 'full run'}; "
        f"{info['cpus']} CPU cores; training {fmt(minutes['training'])} min, measurements "
        f"{fmt(minutes['measuring'])} min, summed over the two lanes that ran side by side).",
        "**SMOKE run: a toy size, its numbers mean nothing.**" if info["smoke"] else "",
        "",
        "The preset's models (configs/experiments/study/{44m,129m}/; parameters: "
        + ", ".join(f"{k} {v:,}" for k, v in info["params"].items())
        + "), objective, optimizer, dropout and windows; only these overrides:",
        "",
        *(f"- `{o}`" for o in info["overrides"]),
        "",
        f"Seeds: {', '.join(f'{s} {v}' for s, v in info['seeds'].items())}. The norm is the "
        "study's unit: the mean over tokens of the per-token L2 norm of the final loop's state "
        "(sqrt(d) times the RMS megaloop logs), on each step's training batch (dropout on) and "
        "on the validation windows (dropout off).",
        "",
        "## The final loop's norm over training",
        "",
        *runs_table(info),
        "",
        "## Its growth per step",
        "",
        "(ln L2(b) - ln L2(a)) / (b - a) between marks, each L2 the mean of the 5 steps ending "
        "there, in percent a step; min to max over seeds. d = 96 is docs/study_mini's committed "
        f"run (2 layers, 16 windows of 128 a step, {info['miniature_precision']}, 200 steps, "
        "seeds 42, 101, 202).",
        "",
    ]
    for row in ROWS:
        lines += [f"### {row}", "", *growth_table(info, row), ""]
    scales = {f"d = 96, {info['miniature_steps']} steps": info["miniature_figures"]}
    longer = long_scale()
    scales |= longer
    scales |= {f"{scale}, {info['steps'][scale]} steps": info["figures"][scale] for scale in SCALES}
    lines += [
        "## Verdicts across scales",
        "",
        "Each claim's figure per seed and its verdict by the rule fixed in bench/verdicts.py "
        "(RULES) before these runs were read: **follows** when every seed meets the study's "
        "claim, **against** when every seed goes the other way, **mixed** otherwise; – where "
        "the scale has no such row or measurement (docs/study_mini keeps no per-seed "
        "measurements of its d = 96 checkpoints)."
        + (
            f" The {next(iter(longer))} column is docs/study_mini_long's (8 windows a step)."
            if longer
            else ""
        ),
        "",
        *verdicts.table(scales),
        "",
        "## Measurements of the final checkpoints",
        "",
        "`megaloop report` of `depth`, `halt` and `diagnose --dtype bf16`: "
        "[measurements/report.md](measurements/report.md).",
        "",
        "![final-loop L2 over training](growth.png)",
        "",
        "![per-loop L2 of each run](loops.png)",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


def plot(info: dict, out: Path) -> None:
    """growth.png: the final loop's L2 per step, one panel a row, d = 96 beside the study's
    widths; loops.png: every loop's L2 of each run at size."""

    def row_panel(row: str):
        def draw(ax):
            mini = info.get("miniature_trajectories", {}).get(row, {})
            for i, t in enumerate(mini.values()):
                ax.plot(
                    t["train_steps"],
                    t["train_l2"],
                    color="0.6",
                    lw=0.8,
                    label="d=96" if not i else None,
                )
            for scale, color in zip(SCALES, ("tab:blue", "tab:red")):
                for i, t in enumerate(info["trajectories"][f"{scale}/{row}"].values()):
                    ax.plot(
                        t["train_steps"],
                        t["train_l2"],
                        color=color,
                        lw=0.8,
                        label=scale if not i else None,
                    )

        return draw

    miniature.small_multiples(
        {row: row_panel(row) for row in ROWS},
        "final-loop L2 (training batch)",
        "The final loop's norm: d = 96 (grey), 44M (blue), 129M (red)",
        out / "growth.png",
        legend=True,
    )

    def loop_panel(t: dict):
        def draw(ax):
            for k, values in enumerate(zip(*t["train_l2_loops"])):
                ax.plot(t["train_steps"], values, lw=0.8, label=f"loop {k + 1}")

        return draw

    miniature.small_multiples(
        {
            f"{name} seed {seed}": loop_panel(t)
            for name, by_seed in info["trajectories"].items()
            for seed, t in by_seed.items()
        },
        "per-token L2",
        "Every loop's norm over training",
        out / "loops.png",
        legend=True,
    )


def main(argv: list[str], out: Path | None) -> None:
    out, work, python, data, vocab = study.start("study_at_size", argv, out, (write_report, plot))
    if vocab > 20000:
        sys.exit(f"study_at_size: the tokenizer's {vocab} tokens exceed the preset's 20,000")
    todo = jobs(data, vocab)
    study.train(work, todo, "study_at_size")
    measure(work, todo)
    study.measurements_report(python, work, out, "runs", "measure")
    info = summary(work, todo, vocab)
    write_json(out / "study_at_size.json", info)
    info = json.loads((out / "study_at_size.json").read_text())  # as --report reads it
    write_report(info, out)
    plot(info, out)
    print(f"study_at_size: report in {out}")


def summary(work: Path, todo: list[Job], vocab: int) -> dict:
    """What the report is written from: the runs' trajectories and growth, the miniature's,
    the overrides, the parameter counts and the time spent."""
    from megaloop import experiment
    from megaloop.parallel.cost import parameter_counts

    trajectories: dict = {}
    for job in todo:
        trajectories.setdefault(job.name, {})[str(job.seed)] = trajectory(job.run_dir(work))
    taken = spent(work)
    mini = ROOT / "docs/study_mini/study_mini.json"
    mini_runs = json.loads(mini.read_text())["trajectories"] if mini.is_file() else {}
    return {
        "smoke": SMOKE,
        "precision": PRECISION,
        "cpus": os.cpu_count(),
        "vocab": vocab,
        "overrides": overrides(vocab),
        "seeds": {scale: list(seeds) for scale, (seeds, _) in SCALES.items()},
        "steps": {scale: steps for scale, (_, steps) in SCALES.items()},
        "params": {
            job.name: parameter_counts(experiment.load(job.config, list(job.overrides)).model)[
                "total"
            ]
            for job in todo
        },
        "minutes": {
            "training": sum(v for k, v in taken.items() if k.startswith("runs/")) / 60,
            "measuring": sum(v for k, v in taken.items() if k.startswith("measure/")) / 60,
        },
        "trajectories": trajectories,
        "growth": {
            name: {seed: growth(t, MARKS) for seed, t in by_seed.items()}
            for name, by_seed in trajectories.items()
        },
        "miniature_growth": miniature_growth(),
        "miniature_trajectories": {row: mini_runs[row] for row in ROWS if row in mini_runs},
        "miniature_precision": json.loads(mini.read_text())["precision"] if mini_runs else None,
        "figures": figures(work, todo, trajectories),
        "miniature_steps": json.loads(mini.read_text())["steps"] if mini_runs else None,
        "miniature_figures": {
            row: {seed: verdicts.run_figures(t, None) for seed, t in by_seed.items()}
            for row, by_seed in mini_runs.items()
        },
    }


def figures(work: Path, todo: list[Job], trajectories: dict) -> dict:
    """Per scale, row and seed, what the verdict rules read (bench/common/verdicts.py)."""
    out: dict = {}
    for job in todo:
        scale, row = job.name.split("/")
        measured = work / "measure" / scale / row / f"seed{job.seed}"
        t = trajectories[job.name][str(job.seed)]
        out.setdefault(scale, {}).setdefault(row, {})[str(job.seed)] = verdicts.run_figures(
            t, measured
        )
    return out
