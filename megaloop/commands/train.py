"""`megaloop train CONFIG [key=value ...]`: train a looped model. It prints its run directory
first and, at the end, the run directory again and the final validation (a `result:` JSON line).

`--print-config` prints the resolved config and builds nothing; `--dry-run` builds everything
the first step needs (data, model, layout) as a run would, then stops before it, having written
nothing to train.dir."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from megaloop.commands.options import load_config, with_config

BUILDS_MODEL = True


def add_parser(sub) -> None:
    p = with_config(sub.add_parser("train", help="train a looped model"))
    check = p.add_mutually_exclusive_group()
    check.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (files, defaults and overrides) as YAML and exit; "
        "builds nothing",
    )
    check.add_argument(
        "--dry-run",
        action="store_true",
        help="open the data, build the model and layout as a run would, print a summary and "
        "exit before the first step; writes nothing to train.dir",
    )
    p.set_defaults(fn=run, logs_to_wandb=logs_to_wandb)


def logs_to_wandb(args) -> bool:
    """Whether this run's wandb.mode is not disabled (cli.wandb_unloaded: wandb stays unloaded
    when it is)."""
    return load_config(args).wandb.mode != "disabled"


def run(args) -> int:
    cfg = load_config(args)
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    import torch

    from megaloop.experiment import build_trainer
    from megaloop.parallel import distributed
    from megaloop.train import cpu_bf16
    from megaloop.train.preemption import EXIT_PREEMPTED, Preempted
    from megaloop.train.watchdog import EXIT_UNHEALTHY, STOP_MARKER, UnhealthyRun

    trainer = build_trainer(cfg, dry_run=args.dry_run)
    main_rank = distributed.is_main()
    if main_rank:
        cpu_bf16.warn_if_slow(cfg.train.bf16, torch.cuda.is_available(), cpu_bf16.read_cpuinfo())
    if args.dry_run:
        summary = dry_run_summary(trainer, args.config)  # collective: every rank measures
        if main_rank:
            print(summary)
        return 0
    if main_rank:
        print(f"run directory: {trainer.run_dir}", flush=True)
    try:
        result = trainer.fit()
    except Preempted as e:
        print(
            f"megaloop: {e}; exiting with {EXIT_PREEMPTED} so the job can be requeued",
            file=sys.stderr,
        )
        return EXIT_PREEMPTED
    except UnhealthyRun as e:
        print(
            f"megaloop: {e}; see {trainer.run_dir / STOP_MARKER}; exiting with "
            f"{EXIT_UNHEALTHY} (not requeued)",
            file=sys.stderr,
        )
        return EXIT_UNHEALTHY
    except Exception as e:
        if not distributed.is_collective_failure(e):
            raise
        return collective_failure(e)
    if main_rank:
        print(final_summary(trainer, result))
    return 0


def final_summary(trainer, result: dict) -> str:
    """What a finished run prints last: where it is, what takes it, and its final validation
    as one JSON line labelled `result:` (for scripts: `grep '^result: '`)."""
    record = {
        "valid_ce": result["ce"],
        "hidden_rms": result["hidden_rms"],
        "valid_windows": result["valid_windows"],
    }
    return "\n".join(
        [
            f"megaloop train: finished at step {trainer.step}",
            f"run directory: {trainer.run_dir} (metrics.jsonl, checkpoints/); depth, halt, "
            f"diagnose, generate, eval downstream and export take it as MODEL",
            f"result: {json.dumps(record)}",
        ]
    )


def config_yaml(cfg) -> str:
    """The resolved config as YAML that loads back to the same values (and runs as a config
    file)."""
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True)


def dry_run_summary(trainer, config: str) -> str:
    """What the run would be: parameters (counted, and as built on its ranks), layout, data
    windows, steps, and where it would start."""
    from megaloop.parallel import distributed
    from megaloop.parallel.cost import parameter_counts

    cfg, engine, dataset = trainer.cfg, trainer.engine, trainer.dataset
    t = cfg.train
    counts = parameter_counts(cfg.model)
    built = max(r["params"] for r in engine.memory_report()["ranks"])
    layout = engine.layout()
    zero = f" ZeRO-{layout['zero_stage']}" if "zero_stage" in layout else ""
    windows = t.steps * t.global_batch_size
    valid = trainer.eval_microbatches * t.micro_batch_size
    split = dataset.valid_windows
    return "\n".join(
        [
            f"megaloop: dry run of {config}: nothing trained, nothing written to train.dir",
            f"  parameters: {counts['total']:,} (embedding {counts['embedding']:,}, "
            f"non-embedding {counts['non_embedding']:,}); the largest rank holds {built:,}",
            f"  layout: engine={cfg.engine}{zero}, {distributed.world_size()} rank(s): "
            f"TP={layout['tp']} PP={layout['pp']} DP={layout['dp']}",
            f"  data: {cfg.data.kind}, {dataset.seq_len} tokens a window; micro-batch "
            f"{t.micro_batch_size}, global batch {t.global_batch_size}",
            f"  steps: {t.steps:,} = {windows:,} training windows "
            f"({windows * dataset.seq_len:,} tokens)",
            f"  validation: {valid:,} windows"
            + (f" of the split's {split:,}" if split is not None else " (synthetic stream)"),
            f"  train.dir: {t.dir} ({described(Path(t.dir), trainer.resume_from, t.init_from)})",
        ]
    )


def start_of(run_dir: Path, init_from: str | None) -> str:
    """Where a run in `run_dir` would start, from what is there (read, never written): the
    checkpoint the run itself would resume from (checkpoint.find_latest, the newest complete
    one; not the `latest` marker, which a run stopped between a checkpoint's rename and the
    marker's write, or a corrupt newest checkpoint, leaves naming another), and its step.
    Collective, as find_latest is."""
    from megaloop.train import checkpoint

    if not run_dir.exists():
        return described(run_dir, None, init_from)
    return described(run_dir, checkpoint.find_latest(run_dir / "checkpoints"), init_from)


def described(run_dir: Path, folder: Path | None, init_from: str | None) -> str:
    """Where a run in `run_dir` starts: from checkpoint `folder` (its newest complete one),
    else from init_from's weights or fresh."""
    from megaloop.train import checkpoint

    weights = f"from the weights of {init_from}" if init_from else "fresh"
    if not run_dir.exists():
        return f"does not exist yet; the run creates it and starts {weights}"
    if folder is not None:
        step = checkpoint.read_meta(folder)["step"]
        return f"exists; resumes from step {step}, its newest complete checkpoint {folder}"
    return f"exists, no checkpoint; starts {weights}"


def collective_failure(e: Exception) -> int:
    """A failed collective (a rank died): one line naming the missing ranks, and exit 1."""
    from megaloop.parallel import distributed

    rank = int(os.environ.get("RANK", 0))
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(
        f"megaloop: rank {rank}: a collective failed ({first}); "
        f"{distributed.missing_ranks()}. Relaunch to resume from the newest complete "
        f"checkpoint",
        file=sys.stderr,
        flush=True,
    )
    return 1
