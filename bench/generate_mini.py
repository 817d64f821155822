"""Early exit in cached decoding on a model trained here: `megaloop bench generate` on a
repro_mini exit-gate model, its figures into docs/generation/ (docs/generation/README.md reads
them).

    bench/generate_mini [--out OUT]        45-60 minutes on 2 CPU cores (training 17-25, the
                                           benchmark 25-36)
    bench/generate_mini --smoke --out OUT  the same flow at a toy size (d=32, 1 layer, 4 steps,
                                           one thread throughout), into OUT

The model: configs/experiments/repro_mini/exit_weighted.yaml (exit-weighted CE with Ouro's
gate, RMSNorm readouts) widened to d=512, 8 heads, 4 layers, 800 steps on the WikiText-103 test
text (our choice: wider than the d=256 run before it, so that Python's per-op cost is a smaller
share of a loop; at both widths a decoding loop on 8 rows costs 2-3 times one on 1 row, since
it reads the same weights: docs/generation/README.md). Training runs 2 threads, the benchmark 1,
pinned to one core where taskset exists, and takes each decode's fastest of 5 repeats (our
choices: the same decode's repeats spread by up to 19% unpinned here, 8% pinned).

Environment: REPRO_SOURCE (wiki.test.raw, wiki.valid.raw; default ../shared/data/wikitext-103
beside the repository), GEN_WORK (scratch, default runs/generate_mini_d512, or
runs/generate_mini_smoke under --smoke: finished steps are kept, so a rerun resumes), PYTHON
(default this interpreter).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from bench.common import ROOT, SMOKE, miniature, report

if SMOKE:
    WORK, VOCAB, STEPS, REPEATS, TRAIN_THREADS = "runs/generate_mini_smoke", 300, 4, 2, 1
    SHAPE = [
        *("model.vocab_size=300", "model.hidden_size=32", "model.num_heads=2"),
        *("model.num_layers=1", "model.max_seq_len=32", "data.seq_len=32"),
        *("train.log_every=2", "train.eval_batches=2"),
    ]
    BENCH_LEN = ["--seq-len", "16"]
else:
    WORK, VOCAB, STEPS, REPEATS, TRAIN_THREADS = "runs/generate_mini_d512", 1024, 800, 5, 2
    SHAPE = ["model.hidden_size=512", "model.num_layers=4", "model.num_heads=8"]
    BENCH_LEN = []
CONFIG = ROOT / "configs/experiments/repro_mini/exit_weighted.yaml"


def main(argv: list[str], out: Path | None) -> None:
    # absolute: the benchmark runs from the folder its recorded paths are relative to
    out = Path(
        os.path.abspath(report.command("generate_mini", argv, out, docs="generation", make=False))
    )
    source = Path(os.environ.get("REPRO_SOURCE", ROOT.parent / "shared/data/wikitext-103"))
    work = Path(os.path.abspath(os.environ.get("GEN_WORK", ROOT / WORK)))
    python = os.environ.get("PYTHON", sys.executable)
    if "/" in python:  # a bare name stays a command
        python = os.path.abspath(python)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    links = miniature.link_texts("generate_mini", work, source)
    megaloop = [python, "-m", "megaloop"]
    if not (work / "data/valid.idx").is_file():
        prep = [
            *megaloop,
            "prep",
            "wikitext103",
            "--source",
            links,
            "--tokenizer",
            f"train:{VOCAB}",
        ]
        miniature.run([*prep, "--out", work / "data"], env=env)
    if not (work / "run/checkpoints" / f"step_{STEPS:07d}").is_dir():
        data = [f"data.path={work / 'data/train'}", f"data.valid_path={work / 'data/valid'}"]
        steps = [f"train.steps={STEPS}", f"train.save_every={STEPS // 2}"]
        train = [*megaloop, "train", CONFIG, *data, *SHAPE, *steps, f"train.dir={work / 'run'}"]
        miniature.run(train, env={**env, "OMP_NUM_THREADS": str(TRAIN_THREADS)})
    shutil.rmtree(work / "hf", ignore_errors=True)
    miniature.run([*megaloop, "export", work / "run", "--out", work / "hf"], env=env)
    pin = (
        ["taskset", "-c", str(len(os.sched_getaffinity(0)) - 1)] if shutil.which("taskset") else []
    )
    # generate.json and generate.md record the model and data paths as given: relative to the
    # repository when the scratch folder lies inside it (runs/generate_mini_d512/hf), else to
    # the scratch folder (hf), so that the committed report names no machine's folders
    inside = work.is_relative_to(ROOT)
    base, at = (ROOT, f"{work.relative_to(ROOT)}/") if inside else (work, "")
    generate = [*pin, *megaloop, "bench", "generate", f"{at}hf"]
    generate += ["--data", f"{at}source/wiki.valid.raw", *BENCH_LEN, "--batch-size", "1,8"]
    miniature.run([*generate, "--repeats", str(REPEATS), "--out", out], cwd=base, env=env)
