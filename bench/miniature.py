"""What the miniature benches (repro_mini, study_mini, drift_regime, drift_drivers,
final_norm_scale) share: the WikiText texts linked into their scratch folder, prepared with
`megaloop prep`, the model their smoke runs train, the depth, halt and diagnose measurements of
a trained run, the figure of final-loop norms over training, one panel a run group, and their
reports' paths written relative to the repository or the scratch folder."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

SMOKE_MODEL = [
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_layers=1",
    "model.vocab_size=300",
    "data.seq_len=32",
    "model.max_seq_len=32",
]
"""The model of the benches' SMOKE=1 runs (the tests'): a few seconds a run."""


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


def prepare(bench: str, work: Path, source: Path, python: str, *prep_options: str) -> Path:
    """WORK/data: the WikiText-103 test text as the training split, the validation text as
    itself (linked from SOURCE, never copied), through `megaloop prep wikitext103 OPTIONS`."""
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
    data = work / "data"
    prep = [python, "-m", "megaloop", "prep", "wikitext103", "--source", links, *prep_options]
    run([*prep, "--out", data])
    return data


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
    (bench/repro_mini.py's MEASURE)."""
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
