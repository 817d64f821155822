"""Options that several commands share, spelled one way everywhere.

Imported to build the parser of every command, so it imports nothing heavy: `megaloop configs`
and `plan` start without torch.
"""

from __future__ import annotations

import argparse

from megaloop.evaluation.settings import DTYPES

MODEL_HELP = "a run directory, a checkpoint folder or a `megaloop export` folder"


class Renamed(argparse.Action):
    """An option's old spelling: refused while the arguments are parsed, naming the new one."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}: give {self.new} N")


def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("config", help="YAML config (e.g. configs/experiments/tiny.yaml)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides, e.g. train.steps=100 model.readout=raw",
    )
    return p


def load_config(args):
    from megaloop import experiment

    return experiment.load(args.config, args.overrides)


def batch_size(p: argparse.ArgumentParser, default: int, help: str | None = None) -> None:
    p.add_argument("--batch-size", type=int, default=default, help=help)
    p.add_argument("--batch", action=Renamed, new="--batch-size")


def measurement(
    p: argparse.ArgumentParser, longest: int = 256, batch: int | None = 8, study: str = ""
) -> argparse.ArgumentParser:
    """MODEL, --data, --seq-len, --batch-size and --dtype: what every measurement of a model
    over held-out tokens takes (megaloop.evaluation.settings.Measurement). `batch` None: no
    --batch-size (the command takes its batch sizes another way)."""
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--data",
        required=True,
        help="held-out tokens: a text file, a .npy of ids, an indexed split "
        "PREFIX (PREFIX.bin/.idx) or webdataset shards",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per window (default: the model's positions, at most {longest}{study})",
    )
    if batch is not None:
        batch_size(p, batch)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help="auto: bfloat16 on a GPU (the study's precision), float32 on a CPU",
    )
    return p


def measurement_settings(cls, args, **settings):
    """`cls` (a Measurement) from the shared options and this command's own `settings`."""
    shared = dict(model=args.model, data=args.data, seq_len=args.seq_len, dtype=args.dtype)
    if "batch_size" in args:
        shared["batch_size"] = args.batch_size
    return cls(**shared, out=args.out, **settings)


def slurm_job(p: argparse.ArgumentParser, required: bool) -> None:
    """What a Slurm job asks for (`slurm submit`, `sweep --executor slurm`)."""
    p.add_argument("--nodes", type=int, required=required)
    p.add_argument(
        "--gpus-per-node",
        type=int,
        required=required,
        help="GPUs per node, one rank each (0: CPU nodes)",
    )
    p.add_argument("--tasks-per-node", type=int, help="ranks per node on CPU nodes")
    p.add_argument(
        "--cpus-per-task",
        type=int,
        help="CPUs (and OMP threads) per rank (default: 8 with GPUs, else 1)",
    )
    p.add_argument("--time", default="24:00:00", help="Slurm time limit of each attempt")
    p.add_argument(
        "--warning-seconds",
        type=int,
        default=300,
        help="USR1 this long before the limit: checkpoint and requeue",
    )
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument(
        "--gpu-memory-gib", type=float, default=80.0, help="memory per GPU, for choosing the layout"
    )
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra #SBATCH line, e.g. --sbatch-arg=--exclusive (repeatable)",
    )
    p.add_argument("--job-name")
    p.add_argument("--program", help="what each rank runs in place of `python -m megaloop`")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the script (and the layout, on stderr); submit nothing",
    )


def train_job(args, config: str, overrides: list):
    """The slurm.TrainJob of `slurm_job`'s options."""
    from megaloop import slurm

    return slurm.TrainJob(
        config=config,
        overrides=overrides,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        warning_seconds=args.warning_seconds,
        partition=args.partition,
        account=args.account,
        gpu_memory_gib=args.gpu_memory_gib,
        sbatch_args=tuple(args.sbatch_arg),
        job_name=args.job_name,
        program=args.program,
    )
