"""What the miniature benches (repro_mini, study_mini, drift_regime, drift_drivers,
final_norm_scale) share: the WikiText texts linked into their scratch folder, prepared with
`megaloop prep`, the model their smoke runs train, the depth, halt and diagnose measurements of
a trained run, the figure of final-loop norms over training, one panel a run group, and their
reports' paths written relative to the repository or the scratch folder. The REPRO_ settings
are repro_mini's BPE miniature, which drift_regime, drift_drivers and final_norm_scale reuse."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bench.common import SMOKE

SMOKE_MODEL = [
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_layers=1",
    "model.vocab_size=300",
    "data.seq_len=32",
    "model.max_seq_len=32",
]
"""The model of the benches' --smoke runs (the tests'): a few seconds a run."""
REPRO_VOCAB = 300 if SMOKE else 1024
"""BPE vocabulary trained on the training text (our choice); model.vocab_size in
configs/experiments/repro_mini/base.yaml."""
REPRO_SMOKE_SHAPE = [*SMOKE_MODEL, "train.steps=4", "train.log_every=2"]
REPRO_MEASURE = {
    "depth": {"loops": [1, 2, 3, 4, 8], "sequences": 8 if SMOKE else 160},
    "halt": {"calib": 8 if SMOKE else 160, "bench": 8 if SMOKE else 160},
    "diagnose": {"tokens": 256 if SMOKE else 4096, "rollout": 6 if SMOKE else 30},
}
REPRO_SEQ_LEN = 32 if SMOKE else 128
"""Measurement windows: the models' training context (the study's slice harness used 256)."""


def small_multiples(
    panels: dict[str, Callable], ylabel: str, title: str, path: Path, legend: bool = False
) -> None:
    """One log-scale panel per name, `draw(ax)` plotting it, five a row, one y axis: PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(5, len(panels))
    n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(n, cols, figsize=(3.2 * cols, 2.6 * n), sharey=True, squeeze=False)
    for ax, (name, draw) in zip(axes.flat, panels.items()):
        draw(ax)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    axes.flat[0].set_ylabel(ylabel)
    if legend:
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cmd: list, **kwargs) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def relative_paths(path: Path, base: Path) -> None:
    """Rewrite PATH (a report) with every absolute path under BASE written relative to BASE: a
    report committed under docs/ names no machine's folders (`megaloop report` lists its inputs
    and the models behind the measurements as they were given, absolute here)."""
    prefix = re.escape(f"{Path(base).resolve()}/")
    path.write_text(re.sub(rf"(?<![\w./-]){prefix}", "", path.read_text()))


def link_texts(bench: str, work: Path, source: Path) -> Path:
    """WORK/source: the WikiText-103 test text linked as wiki.train.raw, the validation text as
    itself (from SOURCE, never copied)."""
    for name in ("wiki.test.raw", "wiki.valid.raw"):
        if not (source / name).is_file():
            sys.exit(
                f"{bench}: {source / name} is missing; set REPRO_SOURCE to a folder with "
                f"wiki.test.raw (trained on) and wiki.valid.raw (evaluated on)"
            )
    links = work / "source"
    links.mkdir(parents=True, exist_ok=True)
    for link, target in (("wiki.train.raw", "wiki.test.raw"), ("wiki.valid.raw", "wiki.valid.raw")):
        path = links / link
        if path.is_symlink() or path.exists():
            path.unlink()
        path.symlink_to((source / target).resolve())
    return links


def prepare(bench: str, work: Path, source: Path, python: str, *prep_options: str) -> Path:
    """WORK/data: the linked texts (`link_texts`) through `megaloop prep wikitext103 OPTIONS`."""
    links = link_texts(bench, work, source)
    data = work / "data"
    prep = [python, "-m", "megaloop", "prep", "wikitext103", "--source", links, *prep_options]
    run([*prep, "--out", data])
    return data


def prepare_bpe(work: Path, source: Path, python: str) -> Path:
    """The linked texts in indexed datasets, with a BPE trained on the training text."""
    return prepare("repro_mini", work, source, python, "--tokenizer", f"train:{REPRO_VOCAB}")


def measure_bpe(run_dir: Path, out: Path, data: Path) -> None:
    """depth, halt and diagnose of a BPE miniature run at REPRO_MEASURE's sizes."""
    measure(run_dir, out, data, REPRO_MEASURE, REPRO_SEQ_LEN, "float32")


def measure(
    run_dir: Path,
    out: Path,
    data: Path,
    settings: dict,
    seq_len: int,
    dtype: str,
    diagnose: bool = True,
):
    """`megaloop depth`, `halt` and (unless `diagnose` is false) `diagnose --dtype DTYPE` of a
    run or checkpoint into OUT, in this process (a worker's): `settings` holds each one's sizes
    (REPRO_MEASURE)."""
    from megaloop import _cpu_compat

    _cpu_compat.apply()
    from megaloop.evaluation import depth, diagnostics, halting
    from megaloop.evaluation.settings import DepthSettings, DiagnoseSettings, HaltSettings

    depth.run(
        DepthSettings(
            model=run_dir,
            data=data,
            loops=settings["depth"]["loops"],
            sequences=settings["depth"]["sequences"],
            seq_len=seq_len,
            dtype="float32",
            out=out,
        )
    )
    halting.run(
        HaltSettings(
            model=run_dir,
            data=data,
            k_max=4,
            rho=1.01,
            calib=settings["halt"]["calib"],
            bench=settings["halt"]["bench"],
            batch_size=8,
            seq_len=seq_len,
            out=out,
        )
    )
    if not diagnose:
        return
    diagnostics.run(
        DiagnoseSettings(
            model=run_dir,
            data=data,
            tokens=settings["diagnose"]["tokens"],
            seq_len=seq_len,
            rollout=settings["diagnose"]["rollout"],
            dtype=dtype,
            out=out,
        )
    )
