"""What the miniature benches (repro_mini, study_mini, drift_regime, drift_drivers,
final_norm_scale) share: the WikiText texts linked into their scratch folder, prepared with
`megaloop prep`, and the depth, halt and diagnose measurements of a trained run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run(cmd: list, **kwargs) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


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


def measure(run_dir: Path, out: Path, data: Path, settings: dict, seq_len: int, dtype: str):
    """`megaloop depth`, `halt` and `diagnose --dtype DTYPE` of a run into OUT, in this process
    (a worker's): `settings` holds each one's sizes (bench/repro_mini.py's MEASURE)."""
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
