"""A rank's place in the world from its launcher's environment: torchrun sets RANK and
WORLD_SIZE itself; srun (one task per rank, slurm/train.sbatch) gives Slurm's task variables.
Free of torch imports: `megaloop slurm submit` runs on login nodes."""

from __future__ import annotations

import os


class LaunchError(RuntimeError):
    """The job request or the launcher's environment does not describe a consistent world."""


def task_env(environ=os.environ) -> None:
    """Set RANK/LOCAL_RANK/WORLD_SIZE from Slurm's task environment for ranks started by srun
    (SLURM_STEP_ID is set) rather than torchrun (which sets RANK itself)."""
    if "RANK" in environ or "SLURM_STEP_ID" not in environ:
        return
    try:
        rank, world = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
        local = int(environ.get("SLURM_LOCALID", 0))
    except (KeyError, ValueError) as e:
        raise LaunchError(
            f"srun task without a usable {e} in its environment; start ranks with "
            f"srun inside an sbatch/salloc allocation (slurm/train.sbatch)"
        ) from None
    if not 0 <= rank < world:
        raise LaunchError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world}")
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
        if missing:
            raise LaunchError(
                f"{' and '.join(missing)} not set for a {world}-task srun step; "
                f"export them in the job script from the first node's NodeAddr "
                f"(as slurm/train.sbatch does)"
            )
    environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world))
