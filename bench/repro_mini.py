"""The study in miniature on real WikiText text, end to end (run it as bench/repro_mini).

    bench/repro_mini                 the full run: ~30 minutes on 2 CPU cores, rewrites
                                     docs/repro_mini/report.md, its PNGs and repro_mini.json
    bench/repro_mini --smoke --out OUT
                                     two variants, a few steps: the same flow in about a minute

1. Data: the WikiText-103 test text is linked into a scratch folder as wiki.train.raw and the
   validation text as wiki.valid.raw (never copied into the repo), and `megaloop prep
   wikitext103` trains a byte-level BPE on the training text and writes indexed datasets.
2. Training: every configs/experiments/repro_mini/*.yaml variant x seeds 0 and 1 (the
   no-weight-decay pair, trained twice as long, seed 0 only) as `megaloop sweep` runs them
   (finished runs are skipped, so a rerun resumes), two at a time in the two worker processes
   of bench/common/workers.py, one thread each.
3. Measurements on the validation text: `megaloop depth`, `halt` and `diagnose` of every run
   (in the workers, two runs at a time), then `megaloop report` of everything into OUT, its
   paths written relative to the repository (to REPRO_WORK when that lies outside it).

Environment: REPRO_SOURCE, a folder holding wiki.test.raw and wiki.valid.raw (default:
../shared/data/wikitext-103 beside the repository); REPRO_WORK, the scratch folder (default
runs/repro_mini); PYTHON, the interpreter with megaloop installed (default: this one).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench.common import ROOT, SMOKE, miniature, report, workers
from bench.common.miniature import REPRO_MEASURE, REPRO_SEQ_LEN, REPRO_SMOKE_SHAPE, REPRO_VOCAB

CONFIGS = ROOT / "configs/experiments/repro_mini"
SEEDS = (0, 1)
SMOKE_VARIANTS = ("per_loop_norm", "per_loop_raw")


def variants() -> list[Path]:
    names = (
        SMOKE_VARIANTS
        if SMOKE
        else sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem != "base")
    )
    return [CONFIGS / f"{name}.yaml" for name in names]


def train(work: Path, data: Path) -> None:
    """Each variant x seed as `megaloop sweep` runs it (finished runs skipped), two at a time."""
    overrides = [
        f"data.path={data / 'train'}",
        f"data.valid_path={data / 'valid'}",
        *(REPRO_SMOKE_SHAPE if SMOKE else []),
    ]
    jobs = [
        (config, seed)
        for config in variants()  # the no-weight-decay pair: one seed
        for seed in (SEEDS[:1] if config.stem.endswith("no_wd") else SEEDS)
    ]
    jobs.sort(key=lambda job: "no_wd" not in job[0].stem)  # the longest runs first

    def one(job):
        config, seed = job
        log = work / "logs" / f"{config.stem}-seed{seed}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        code = workers.call(sweep_one, config, seed, work / "runs", overrides, log=log)
        print(f"trained {config.stem} seed {seed}: exit {code} (log {log})", flush=True)
        return code

    codes = workers.each(one, jobs)
    if any(codes):
        sys.exit("repro_mini: some runs failed; see the logs above")


def sweep_one(config: Path, seed: int, root: Path, overrides: list[str]) -> int:
    """`megaloop sweep CONFIG --seeds SEED --out ROOT OVERRIDES` in this process (a worker)."""
    from megaloop import sweep

    (run,) = sweep.plan([str(config)], [seed], overrides, root)
    if sweep.finished(run):
        return 0
    return workers.command(["train", run.config, *run.overrides])


def measure(work: Path) -> list[Path]:
    """depth, halt and diagnose of every run, in the workers, two runs at a time."""
    runs = sorted(p.parent for p in (work / "runs").rglob("metrics.json*"))
    valid = work / "source/wiki.valid.raw"

    def one(run_dir: Path) -> Path:
        out = work / "measure" / run_dir.relative_to(work / "runs")
        workers.call(miniature.measure_bpe, run_dir, out, valid)
        print(f"measured {run_dir.relative_to(work)}", flush=True)
        return out

    return workers.each(one, runs)


def main(argv: list[str], out: Path | None) -> None:
    out = report.command("repro_mini", argv, out)
    work = Path(os.environ.get("REPRO_WORK", ROOT / "runs/repro_mini")).resolve()
    source = Path(os.environ.get("REPRO_SOURCE", ROOT.parent / "shared/data/wikitext-103"))
    python = os.environ.get("PYTHON", sys.executable)
    clock = {"start": time.time()}
    data = miniature.prepare_bpe(work, source, python)
    clock["prepared"] = time.time()
    train(work, data)
    clock["trained"] = time.time()
    measure(work)
    clock["measured"] = time.time()
    miniature.run(
        [
            python,
            "-m",
            "megaloop",
            "report",
            str(work / "runs"),
            str(work / "measure"),
            "--out",
            str(out),
        ]
    )
    # the inputs' paths relative to the repository (to the scratch folder when it lies outside)
    miniature.relative_paths(out / "report.md", ROOT if work.is_relative_to(ROOT) else work)
    clock["reported"] = time.time()
    minutes = {
        f"{a}_to_{b}": round((clock[b] - clock[a]) / 60, 1) for a, b in zip(clock, list(clock)[1:])
    }
    (out / "repro_mini.json").write_text(
        json.dumps(
            {
                "smoke": SMOKE,
                "seeds": SEEDS,
                "bpe_vocab": REPRO_VOCAB,
                "measurement_seq_len": REPRO_SEQ_LEN,
                "measure": REPRO_MEASURE,
                "variants": [v.stem for v in variants()],
                "minutes": minutes,
                "total_minutes": round((clock["reported"] - clock["start"]) / 60, 1),
                "cpus": os.cpu_count(),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"repro_mini: {minutes}; report in {out}")
