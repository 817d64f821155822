"""The `megaloop` command: parse → config → build → run, one subcommand per user task."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from megaloop.config import ConfigError


def _config(args):
    from megaloop import experiment

    return experiment.load(args.config, args.overrides)


def cmd_train(args) -> int:
    cfg = _config(args)
    from megaloop.experiment import build_trainer
    from megaloop.train.preemption import EXIT_PREEMPTED, Preempted

    trainer = build_trainer(cfg)
    try:
        result = trainer.fit()
    except Preempted as e:
        print(f"megaloop: {e}; exiting with {EXIT_PREEMPTED} so the job can be requeued",
              file=sys.stderr)
        return EXIT_PREEMPTED
    print(json.dumps({"valid_ce": result["ce"], "hidden_rms": result["hidden_rms"]}))
    return 0


def cmd_params(args) -> int:
    cfg = _config(args)
    from megaloop.model.params import count_parameters

    counts = count_parameters(cfg.model)
    for name in ("embedding", "non_embedding", "total"):
        print(f"{name:>14}: {counts[name]:>15,}")
    if args.world:
        from megaloop.parallel.layout import data_parallel_size, memory_per_rank

        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        dp = data_parallel_size(cfg, args.world)
        mem = memory_per_rank(cfg.model, tp, pp, dp)
        gib = {k: v / 2**30 for k, v in mem.items() if k.endswith("bytes")}
        print(f"per rank at TP={tp} PP={pp} DP={dp} (largest stage): {mem['params']:,} params; "
              f"fp32 params {gib['param_bytes']:.2f} GiB + grads {gib['grad_bytes']:.2f} GiB + "
              f"Adam {gib['optimizer_bytes']:.2f} GiB = {gib['total_bytes']:.2f} GiB "
              f"(activations not included)")
    return 0


def cmd_demo(args) -> int:
    from megaloop.demo import run_demo

    run_demo(text=args.text, steps=args.steps, out=args.out, tokenizer=args.tokenizer)
    return 0


def cmd_ckpt_consolidate(args) -> int:
    from pathlib import Path

    from megaloop.parallel import distributed
    from megaloop.train import checkpoint

    distributed.init(seed=0)
    try:
        path = checkpoint.consolidate(Path(args.checkpoint), Path(args.out))
    except ValueError as e:
        print(f"megaloop: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def cmd_prep(args) -> int:
    import data_prep
    from data_prep.common import PrepError

    try:
        data_prep.run(args)
    except PrepError as e:
        print(f"megaloop prep: error: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaloop", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(p):
        p.add_argument("config", help="YAML config (e.g. configs/experiments/tiny.yaml)")
        p.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. train.steps=100 model.readout=raw")
        return p

    with_config(sub.add_parser("train", help="train a looped model")).set_defaults(fn=cmd_train)
    params = with_config(sub.add_parser(
        "params", help="print embedding / non-embedding parameter counts (and memory per rank)"))
    params.add_argument("--world", type=int, help="also show memory per rank for the config's "
                        "parallel.tp/pp on this many ranks")
    params.set_defaults(fn=cmd_params)
    demo = sub.add_parser("demo", help="train norm vs raw readouts on a tiny model, print a table")
    demo.add_argument("--text", help="train on this text file instead of the built-in corpus")
    demo.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json path")
    demo.add_argument("--steps", type=int, default=None, help="training steps per variant")
    demo.add_argument("--out", default="runs/demo", help="run directories go here")
    demo.set_defaults(fn=cmd_demo)
    prep = sub.add_parser("prep", help="prepare a corpus with datatrove (wikitext103, fineweb)")
    corpora = prep.add_subparsers(dest="corpus", required=True, metavar="CORPUS")
    import data_prep

    for recipe in data_prep.add_parsers(corpora):
        recipe.set_defaults(fn=cmd_prep)
    ckpt = sub.add_parser("ckpt", help="checkpoint tools").add_subparsers(
        dest="ckpt_command", required=True, metavar="ACTION")
    consolidate = ckpt.add_parser("consolidate", help="one safetensors file of the whole model "
                                                      "from a checkpoint of any layout")
    consolidate.add_argument("checkpoint", help="a run directory or a checkpoints/step_* folder")
    consolidate.add_argument("out", help="output folder (model.safetensors, config.json)")
    consolidate.set_defaults(fn=cmd_ckpt_consolidate)
    return parser


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    args = build_parser().parse_args(argv)
    from megaloop import _cpu_compat

    _cpu_compat.apply()
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"megaloop: error: {e}", file=sys.stderr)
        return 2
    finally:
        from megaloop.parallel import distributed

        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
