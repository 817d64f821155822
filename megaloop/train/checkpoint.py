"""Checkpoints in the run directory, the same protocol for every engine:

    checkpoints/step_0000120/   the engine's state (model, optimizer, scheduler, RNG), the data
                                position, meta.json (step, layout, engine, num_loops_trained,
                                config), manifest.json
    checkpoints/latest          the newest complete checkpoint's folder name

A checkpoint is written into `.tmp_step_*` and renamed into place after every rank has
finished and rank 0 has written `manifest.json` (size and xxh64 of every file), so a folder
named `step_*` is complete by construction. Resuming verifies the manifest of the newest one and
falls back to older ones, reporting each it skips; if none is loadable the run stops, naming
each, rather than train from step 0 beside them. `keep_last` counts loadable checkpoints only.
What goes inside is the engine's business (`save_state` / `load_state`): megatron-core dist
checkpoints for the megatron engine (they load into any TP × PP × DP layout), DeepSpeed's own
for the DeepSpeed engine.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megaloop.config import CheckpointError
from megaloop.digest import file_digest
from megaloop.parallel import comm
from megaloop.train.callbacks import Callback

MANIFEST = "manifest.json"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def _is_rank0() -> bool:
    return dist.get_rank() == 0


def _write_manifest(folder: Path) -> None:
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "xxh64": file_digest(p, "xxh64")}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    (folder / MANIFEST).write_text(json.dumps(files, indent=1))


def verify(folder: Path) -> str | None:
    """None if `folder` is a complete checkpoint, else why not."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (an interrupted save?)"
    try:
        files = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return "manifest.json is not valid JSON"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if file_digest(path, "xxh64") != expected["xxh64"]:
            return f"{name} does not match its checksum (corrupt)"
    return None


def write_meta(folder: Path, meta: dict) -> None:
    """Finish a checkpoint folder: meta.json, then the manifest of every file in it."""
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    _write_manifest(folder)


def save(root: Path, engine, position: dict, config: dict, keep_last: int) -> Path:
    """Collective: every rank calls it. `position` is {"step", "consumed_samples"}. Written
    beside the others and renamed into place, so a failed save (a full disk) leaves the previous
    checkpoint the newest: CheckpointError says so (a rank whose peers failed waits at most
    parallel.timeout_s)."""
    final = step_dir(root, position["step"])
    tmp = root / f".tmp_{final.name}"
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    comm.barrier()
    try:
        engine.save_state(tmp, position)
        comm.barrier()
        if _is_rank0():
            write_meta(
                tmp,
                {
                    **position,
                    "engine": engine.name,
                    "layout": engine.layout(),
                    "num_loops_trained": config["model"]["num_loops"],
                    "config": config,
                },
            )
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            marker = root / "latest.tmp"
            marker.write_text(final.name)
            os.replace(marker, root / "latest")
            prune(root, keep_last, fresh=final)
    except (Exception, CheckpointException) as e:  # a full disk, a quota, a size limit
        shutil.rmtree(tmp, ignore_errors=True)
        previous = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
        kept = (
            f"the previous checkpoint {previous} is intact"
            if previous
            else "no earlier checkpoint exists"
        )
        cause = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        free = shutil.disk_usage(root).free / 2**30
        if broken_pipe(e):
            raise CheckpointError(
                f"saving checkpoint {final.name} in {root} failed: a write to a pipe found its "
                f"reader gone (Broken pipe), as when the process that launched this one, or a "
                f"`| tee` of its output, ends on the same signal; not the disk ({free:.1f} GiB "
                f"free there); {kept}. Relaunch to resume from it"
            ) from None
        raise CheckpointError(
            f"saving checkpoint {final.name} in {root} failed ({cause[-1]}; "
            f"{free:.1f} GiB free there); {kept}. Free space and relaunch to "
            f"resume from it"
        ) from None
    comm.barrier()
    return final


def broken_pipe(e: BaseException) -> bool:
    """The save failed on a pipe whose reader is gone (EPIPE), not on the disk: raised here, or
    carried in a CheckpointException's per-rank failures (as text)."""
    return isinstance(e, BrokenPipeError) or f"[Errno {errno.EPIPE}]" in str(e)


def prune(root: Path, keep_last: int, fresh: Path | None = None) -> None:
    """Keep the newest `keep_last` loadable checkpoints; delete the older ones. Unloadable ones
    do not count towards `keep_last` (a corrupt checkpoint never pushes out a good one); those
    newer than the oldest kept stay, for someone to look at. `fresh` (just written, its manifest
    just computed) is not read again; the others are verified newest first, only until
    `keep_last` loadable ones are found."""
    folders = sorted(root.glob("step_*"), reverse=True)
    kept = 0
    for i, folder in enumerate(folders):
        kept += folder == fresh or verify(folder) is None
        if kept == keep_last:
            for old in folders[i + 1 :]:
                shutil.rmtree(old, ignore_errors=True)
            return


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (rank 0 checks, every rank gets the answer);
    incomplete or corrupt ones are reported and skipped. None if there are none; if there are
    some and none is loadable, CheckpointError on every rank, listing each and why."""
    choice, problems = None, []
    if _is_rank0():
        for folder in sorted(root.glob("step_*"), reverse=True):
            problem = verify(folder)
            if problem is None:
                choice = str(folder)
                break
            problems.append(f"{folder.name}: {problem}")
            print(f"megaloop: skipping checkpoint {folder}: {problem}", flush=True)
    choice, problems = comm.broadcast_object((choice, problems))
    if choice is None and problems:
        raise CheckpointError(
            f"{root} holds {len(problems)} checkpoint(s) and none is loadable ("
            f"{'; '.join(problems)}); starting over here would train from step 0 beside them. "
            f"Move them away to start a new run in this directory, or give another train.dir"
        )
    return Path(choice) if choice else None


def read_meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def load(folder: Path, engine) -> dict:
    """Restore the engine from `folder`; returns the data position {"step", "consumed_samples"}."""
    meta = read_meta(folder)
    if meta["engine"] != engine.name:
        raise ValueError(
            f"checkpoint {folder} was written by the {meta['engine']} engine; "
            f"resume it with engine={meta['engine']} (or start a new train.dir)"
        )
    engine.load_state(folder, same_layout=meta["layout"] == engine.layout())
    return {"step": meta["step"], "consumed_samples": meta["consumed_samples"]}


def resolve(path: Path) -> Path:
    """A checkpoint folder, or the newest complete one of a run directory."""
    if (path / "meta.json").is_file():
        problem = verify(path)
        if problem:
            raise ValueError(f"checkpoint {path} is not usable: {problem}")
        return path
    folder = find_latest(path / "checkpoints") if (path / "checkpoints").is_dir() else None
    if folder is None:
        raise ValueError(
            f"{path} is neither a checkpoint folder (with meta.json) nor a run "
            f"directory with a complete checkpoint under checkpoints/"
        )
    return folder


class Checkpointing(Callback):
    """A checkpoint every train.save_every steps and one after the last step; it runs after
    every other callback, so a step saved is a step that stood."""

    priority = -90

    def post_step(self, trainer, record: dict) -> None:
        every, step = trainer.cfg.train.save_every, trainer.step
        if every and step % every == 0 and step < trainer.cfg.train.steps:
            trainer.save()

    def post_train(self, trainer) -> None:
        trainer.save()
