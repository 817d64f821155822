"""The study's miniature, which study_mini, study_mini_long, study_at_size and drift_drivers
train and read: its shape (MINIATURE) and measurements, the runs (`Job`, `train` in the two
workers), what a run's records say (`trajectory`, `growth`) and the benches' command line."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import ROOT, SMOKE, miniature, report, workers

ROWS_DIR = ROOT / "configs/experiments/study/44m"
SEEDS = (42, 101) if SMOKE else (42, 101, 202)
"""The released code's seeds (scripts/reproduce_table1.sh)."""
STEPS = 6 if SMOKE else 200
"""Optimizer steps of every run (our choice: 3,200 windows, 0.4 epochs of the training text;
sized so that bench/study_mini and bench/drift_drivers fit 3 hours on 2 CPU cores; at this shape the
norm readout's state grows ten-fold within the first 50)."""
PRECISION = os.environ.get("STUDY_PRECISION", "bf16")
if PRECISION not in ("bf16", "fp32"):
    sys.exit(f"bench: STUDY_PRECISION={PRECISION!r}; use bf16 (the study's) or fp32")
PRECISIONS = {
    "bf16": "trained under bf16 autocast with the residual stream in fp32 (the study's)",
    "fp32": "trained in fp32 (STUDY_PRECISION=fp32: the study trains under bf16 autocast)",
}
"""How each precision reads in a report."""
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


def at_step(t: dict, step: int) -> float | None:
    """The training batch's final-loop L2 at `step`, or None when it was not logged."""
    steps = t["train_steps"]
    return t["train_l2"][steps.index(step)] if step in steps else None


def growth(t: dict, marks: tuple[int, ...]) -> dict:
    """Per loop, the per-token L2 at each of `marks` (the training batch's,
    dropout on) and the local growth per step between consecutive marks: (ln L2(b) - ln L2(a))
    / (b - a), each L2 the mean over the 5 logged steps ending at its mark (a batch's own noise,
    not a fit)."""
    steps, loops = t["train_steps"], t["train_l2_loops"]

    def around(step: int, k: int) -> float | None:
        near = [loops[i][k] for i, s in enumerate(steps) if step - 5 < s <= step]
        return sum(near) / len(near) if near else None

    marks = [m for m in marks if m <= steps[-1]]
    out = {"marks": marks, "l2": [], "per_step": []}
    for k in range(len(loops[0])):
        l2 = [around(m, k) for m in marks]
        out["l2"].append(l2)
        out["per_step"].append(
            [
                (math.log(b) - math.log(a)) / (mb - ma)
                for (a, ma), (b, mb) in zip(zip(l2, marks), zip(l2[1:], marks[1:]))
            ]
        )
    return out


def marks_of(growth_by_run: dict) -> list[str]:
    """The steps `growth` marked in any run of {run: {seed: growth}}, in order: a report's
    columns, read from its JSON (not from the sizes the bench runs at)."""
    marks = {m for by_seed in growth_by_run.values() for g in by_seed.values() for m in g["marks"]}
    return [str(m) for m in sorted(marks)]


def measurements_report(python: str, work: Path, out: Path, *inputs: str) -> None:
    """`megaloop report INPUTS` (folders of WORK) into OUT/measurements, run from WORK and its
    paths written relative to it: the committed report names no machine's folders (the inputs
    are given so; the models behind the measurements are recorded absolute, cut after)."""
    report = [python, "-m", "megaloop", "report", *inputs]
    miniature.run([*report, "--out", str(out.resolve() / "measurements")], cwd=work)
    miniature.relative_paths(out / "measurements" / "report.md", work)


def start(bench: str, argv: list[str], out: Path | None, rewrite):
    """`BENCH --report` rewrites OUT's report from its JSON (`report.command`) and ends there;
    otherwise the study's data prepared (`prepare`) in the scratch folder STUDY_WORK from the
    texts in REPRO_SOURCE, and (OUT, STUDY_WORK, the PYTHON to run, the data, its vocabulary)."""
    out = report.command(bench, argv, out, rewrite)
    work = Path(os.environ.get("STUDY_WORK", ROOT / "runs" / bench)).resolve()
    source = Path(os.environ.get("REPRO_SOURCE", ROOT.parent / "shared/data/wikitext-103"))
    python = os.environ.get("PYTHON", sys.executable)
    return out, work, python, *prepare(work, source, python)
