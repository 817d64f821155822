"""The `megaloop` command: parse → config → build → run, one subcommand per user task."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from megaloop import known_warnings
from megaloop.config import ConfigError
from megaloop.evaluation.exported import EvalError
from megaloop.extras import require
from megaloop.parallel.launch import LaunchError


def _config(args):
    from megaloop import experiment

    return experiment.load(args.config, args.overrides)


def cmd_train(args) -> int:
    cfg = _config(args)
    from megaloop.experiment import build_trainer
    from megaloop.parallel import distributed
    from megaloop.train.preemption import EXIT_PREEMPTED, Preempted
    from megaloop.train.watchdog import EXIT_UNHEALTHY, STOP_MARKER, UnhealthyRun

    trainer = build_trainer(cfg)
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
    print(
        json.dumps(
            {
                "valid_ce": result["ce"],
                "hidden_rms": result["hidden_rms"],
                "valid_windows": result["valid_windows"],
            }
        )
    )
    return 0


def cmd_params(args) -> int:
    cfg = _config(args)
    from megaloop.parallel.layout import data_parallel_size, parameter_counts, state_bytes

    counts = parameter_counts(cfg.model)
    for name in ("embedding", "non_embedding", "total"):
        print(f"{name:>14}: {counts[name]:>15,}")
    if args.world:
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        dp = data_parallel_size(cfg, args.world)
        state = state_bytes(cfg, tp, pp, dp)
        gib = {k: state[k] / 2**30 for k in ("weights", "grads", "optimizer")}
        print(
            f"per rank at TP={tp} PP={pp} DP={dp} (largest stage, engine={cfg.engine}): "
            f"{state['params']:,} params; weights {gib['weights']:.2f} GiB + grads "
            f"{gib['grads']:.2f} GiB + optimizer {gib['optimizer']:.2f} GiB = "
            f"{sum(gib.values()):.2f} GiB (activations: `megaloop plan`)"
        )
    return 0


def cmd_configs(args) -> int:
    from megaloop.config import CONFIG_ROOT, shipped_configs

    print(
        f"shipped configs ({CONFIG_ROOT}); give one by name, e.g. `megaloop params model/129m` "
        f"or `megaloop train experiments/tiny`:"
    )
    for name in shipped_configs():
        print(f"  {name}")
    return 0


def cmd_plan(args) -> int:
    cfg = _config(args)
    from megaloop.parallel import layout

    if args.gpus < 1 or args.gpu_mem <= 0 or args.tflops <= 0 or not 0 < args.mfu <= 1:
        raise ConfigError("plan: --gpus must be >= 1, --gpu-mem and --tflops > 0, --mfu in (0, 1]")
    print(layout.describe_model(cfg))
    if args.search:
        plans, left_out = layout.search(
            cfg, args.gpus, args.gpu_mem, args.tflops, args.mfu, args.gpus_per_node
        )
        print(layout.ranking(plans, left_out, args.gpus, args.gpu_mem))
        return 0 if plans else 1
    p = layout.plan(cfg, args.gpus, args.gpu_mem, args.tflops, args.mfu)
    print(layout.describe(p, cfg, args.gpu_mem, args.tflops, args.mfu))
    return 0


def cmd_demo(args) -> int:
    from megaloop.demo import run_demo

    if args.seeds < 1:
        print("megaloop: error: --seeds must be >= 1", file=sys.stderr)
        return 2
    from megaloop import _cpu_compat

    run_demo(
        text=args.text,
        steps=args.steps,
        out=args.out,
        tokenizer=args.tokenizer,
        seed=args.seed,
        seeds=args.seeds,
        workers=2,
        initializer=_cpu_compat.apply,
    )
    return 0


def cmd_ckpt_consolidate(args) -> int:
    from pathlib import Path

    from megaloop import experiment
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    try:
        path = experiment.consolidate(Path(args.checkpoint), Path(args.out))
    except ValueError as e:
        print(f"megaloop: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def cmd_export(args) -> int:
    require("eval", "megaloop export", ("transformers",))
    from pathlib import Path

    from megaloop.export import export
    from megaloop.ouro import export_ouro
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    try:
        out = (export_ouro if args.format == "ouro" else export)(Path(args.source), Path(args.out))
    except ValueError as e:
        print(f"megaloop: error: {e}", file=sys.stderr)
        return 2
    code = " (Ouro's code from the hub)" if args.format == "ouro" else ""
    print(
        f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}, "
        f"trust_remote_code=True){code}"
    )
    return 0


def cmd_import_ouro(args) -> int:
    from pathlib import Path

    from megaloop.ouro import import_ouro
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    try:
        out = import_ouro(Path(args.source), Path(args.out))
    except ValueError as e:
        print(f"megaloop: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {out}: a megaloop checkpoint (megaloop export {out} OUT, megaloop depth "
        f"{out} ..., or train.init_from={out})"
    )
    return 0


def cmd_eval_downstream(args) -> int:
    require("eval", "megaloop eval downstream")
    from pathlib import Path

    from megaloop.evaluation import downstream

    tasks = tuple(t for t in args.tasks.split(",") if t) if args.tasks else downstream.STUDY_TASKS
    summary = downstream.run(
        Path(args.model),
        args.loops,
        tasks,
        Path(args.out),
        args.limit,
        Path(args.data_dir) if args.data_dir else None,
        args.batch_size,
        split=args.split,
    )
    print(downstream.table(summary))
    print(f"results and samples in {args.out}")
    return 0


def cmd_eval_compare(args) -> int:
    from pathlib import Path

    from megaloop.evaluation import compare

    result = compare.compare(Path(args.a), Path(args.b), args.resamples, args.seed)
    text = compare.table(result, Path(args.a).name, Path(args.b).name)
    print(text)
    if args.out:
        Path(args.out).write_text(
            json.dumps(result, indent=1) if args.out.endswith(".json") else text + "\n"
        )
    return 0


def cmd_bench_fixed_k(args) -> int:
    require("eval", "megaloop bench fixed-k", ("transformers",))
    from pathlib import Path

    from megaloop.evaluation import fixed_k, harness

    rows = fixed_k.run(
        Path(args.model),
        Path(args.data),
        harness.parse_loops(args.loops),
        args.batch_size,
        args.seq_len,
        args.batches,
        args.warmup,
        args.dtype,
        out=Path(args.out) if args.out else None,
    )
    print(fixed_k.table(rows))
    return 0


def cmd_depth(args) -> int:
    require("eval", "megaloop depth", ("transformers",))
    from pathlib import Path

    from megaloop.evaluation import depth, harness

    result = depth.run(
        Path(args.model),
        Path(args.data),
        harness.parse_loops(args.loops),
        args.sequences,
        args.seq_len,
        args.batch_size,
        args.clamp,
        args.dtype,
        out=Path(args.out),
    )
    print(depth.markdown(result))
    return 0


def cmd_halt(args) -> int:
    require("eval", "megaloop halt", ("transformers",))
    from pathlib import Path

    from megaloop.evaluation import halting

    threshold = args.tau if args.rule == "margin" else args.q
    if (args.tau is not None and args.rule == "gate") or (
        args.q is not None and args.rule == "margin"
    ):
        print(
            "megaloop: error: --tau is the margin rule's threshold and --q the gate rule's; "
            f"give the one of --rule {args.rule}",
            file=sys.stderr,
        )
        return 2
    result = halting.run(
        Path(args.model),
        Path(args.data),
        args.k_max,
        args.rho,
        args.calib,
        args.bench,
        args.batch,
        args.seq_len,
        args.rule,
        threshold,
        args.dtype,
        out=Path(args.out),
    )
    print(halting.markdown(result))
    return 0


def cmd_diagnose(args) -> int:
    require("eval", "megaloop diagnose", ("transformers",))
    from pathlib import Path

    from megaloop.evaluation import diagnostics

    result = diagnostics.run(
        Path(args.model),
        Path(args.data),
        args.tokens,
        args.seq_len,
        args.rollout,
        args.batch_size,
        out=Path(args.out),
        dtype=args.dtype,
    )
    print(diagnostics.markdown(result))
    return 0


def cmd_report(args) -> int:
    from pathlib import Path

    from megaloop.evaluation import report

    path = report.build([Path(p) for p in args.inputs], Path(args.out))
    print(f"wrote {path} and its figures")
    return 0


def cmd_prep(args) -> int:
    require("prep", "megaloop prep")
    import data_prep
    from data_prep.common import PrepError

    try:
        data_prep.run(args)
    except PrepError as e:
        print(f"megaloop prep: error: {e}", file=sys.stderr)
        return 2
    return 0


def _slurm_job(args, config: str, overrides: list):
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


def cmd_slurm_submit(args) -> int:
    from megaloop import slurm

    job = _slurm_job(args, args.config, args.overrides)
    script, run_dir, layout = slurm.prepare(job)
    summary = (
        f"layout: TP={layout.tp} PP={layout.pp} DP={layout.dp} on {job.nodes} node(s) x "
        f"{job.ranks_per_node} rank(s): {layout.why}"
    )
    if args.dry_run:
        print(script, end="")
        print(f"# {summary}", file=sys.stderr)
        return 0
    job_id = slurm.submit(script, run_dir / "logs")
    print(f"{summary}\nsubmitted job {job_id}; logs in {run_dir / 'logs'}")
    return 0


def cmd_sweep(args) -> int:
    from pathlib import Path

    from megaloop import sweep

    configs = [c for c in args.configs if "=" not in c]
    overrides = [c for c in args.configs if "=" in c] + args.overrides
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not configs or not seeds:
        print(
            "megaloop: error: give one or more config files and --seeds like 0,1,2", file=sys.stderr
        )
        return 2
    root = Path(args.root)
    runs = sweep.plan(configs, seeds, overrides, root)
    todo = [r for r in runs if not sweep.finished(r)]
    for run in runs:
        if run not in todo:
            print(f"sweep: {run.run_dir} is finished; skipped")
    if not todo:
        print(f"sweep: all {len(runs)} runs are finished")
        return 0
    if args.executor == "slurm":
        if args.nodes is None or args.gpus_per_node is None:
            print(
                "megaloop: error: --executor slurm needs --nodes and --gpus-per-node",
                file=sys.stderr,
            )
            return 2
        out = sweep.submit_slurm(_slurm_job(args, todo[0].config, []), todo, root, args.dry_run)
        if args.dry_run:
            print(out, end="")
        else:
            print(
                f"submitted job {out}: {len(todo)} run(s), one per array task; Slurm logs in "
                f"{root.resolve() / 'sweep-logs'}"
            )
        return 0
    failed = sweep.run_local(todo)
    print(
        f"sweep: {len(todo) - len(failed)} of {len(todo)} run(s) trained"
        + (f"; failed: {', '.join(str(r.run_dir) for r, _ in failed)}" if failed else "")
    )
    return 1 if failed else 0


def slurm_options(p, required: bool) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaloop", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(p):
        p.add_argument("config", help="YAML config (e.g. configs/experiments/tiny.yaml)")
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="key=value",
            help="config overrides, e.g. train.steps=100 model.readout=raw",
        )
        return p

    with_config(sub.add_parser("train", help="train a looped model")).set_defaults(fn=cmd_train)
    params = with_config(
        sub.add_parser(
            "params", help="print embedding / non-embedding parameter counts (and memory per rank)"
        )
    )
    params.add_argument(
        "--world",
        type=int,
        help="also show memory per rank for the config's parallel.tp/pp on this many ranks",
    )
    params.set_defaults(fn=cmd_params)
    sub.add_parser(
        "configs", help="list the shipped configs (any command takes one by name)"
    ).set_defaults(fn=cmd_configs)
    plan = with_config(
        sub.add_parser(
            "plan",
            help="memory per GPU, FLOPs and step time of a config's layout on N GPUs "
            "(--search: rank every layout that fits)",
        )
    )
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the run (DP = N/(TP*PP))")
    plan.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU, GiB")
    plan.add_argument(
        "--tflops",
        type=float,
        default=989.4,
        help="dense bf16 peak per GPU (default: H100/H200 SXM)",
    )
    plan.add_argument(
        "--mfu",
        type=float,
        default=0.4,
        help="model FLOPs utilization to assume (default 0.4: our choice)",
    )
    plan.add_argument("--gpus-per-node", type=int, default=8, help="TP stays within a node")
    plan.add_argument(
        "--search",
        action="store_true",
        help="rank the layouts (engine, ZeRO stage, TP, PP, recompute) that fit",
    )
    plan.set_defaults(fn=cmd_plan)
    demo = sub.add_parser("demo", help="train norm vs raw readouts on a tiny model, print a table")
    demo.add_argument("--text", help="train on this text file instead of the built-in corpus")
    demo.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json path")
    demo.add_argument(
        "--steps", type=int, default=None, help="training steps per run (default 400)"
    )
    demo.add_argument("--out", default="runs/demo", help="run directories go here")
    demo.add_argument("--seed", type=int, default=0, help="the first seed")
    demo.add_argument(
        "--seeds",
        type=int,
        default=4,
        help="seeds to train (seed, seed+1, ...); only what holds in all of them "
        "is stated as a finding",
    )
    demo.set_defaults(fn=cmd_demo)
    prep = sub.add_parser("prep", help="prepare a corpus with datatrove (wikitext103, fineweb)")
    corpora = prep.add_subparsers(dest="corpus", required=True, metavar="CORPUS")
    import data_prep

    for recipe in data_prep.add_parsers(corpora):
        recipe.set_defaults(fn=cmd_prep)
    ckpt = sub.add_parser("ckpt", help="checkpoint tools").add_subparsers(
        dest="ckpt_command", required=True, metavar="ACTION"
    )
    consolidate = ckpt.add_parser(
        "consolidate",
        help="one safetensors file of the whole model from a checkpoint of any layout",
    )
    consolidate.add_argument("checkpoint", help="a run directory or a checkpoints/step_* folder")
    consolidate.add_argument("out", help="output folder (model.safetensors, config.json)")
    consolidate.set_defaults(fn=cmd_ckpt_consolidate)

    export = sub.add_parser(
        "export",
        help="a checkpoint as a transformers model folder "
        "(trust_remote_code, safetensors, tokenizer)",
    )
    export.add_argument(
        "source", help="a run directory or a checkpoints/step_* folder (any layout or engine)"
    )
    export.add_argument("out", help="output folder")
    export.add_argument(
        "--format",
        choices=("megaloop", "ouro"),
        default="megaloop",
        help="megaloop: our remote code, any variant; ouro: Ouro's names and "
        "config, loaded by its published code (Ouro's architecture only)",
    )
    export.set_defaults(fn=cmd_export)

    imp = sub.add_parser(
        "import", help="a published checkpoint of another format as a megaloop checkpoint"
    ).add_subparsers(dest="import_command", required=True, metavar="FORMAT")
    ouro = imp.add_parser(
        "ouro", help="an Ouro folder (config.json + safetensors, e.g. ByteDance/Ouro-1.4B)"
    )
    ouro.add_argument("source", help="the Ouro folder")
    ouro.add_argument("out", help="a new checkpoint folder")
    ouro.set_defaults(fn=cmd_import_ouro)

    evaluate = sub.add_parser("eval", help="evaluate exported models").add_subparsers(
        dest="eval_command", required=True, metavar="ACTION"
    )
    down = evaluate.add_parser("downstream", help="lm-eval multiple-choice tasks at K loops")
    down.add_argument("model", help="a folder from `megaloop export`")
    down.add_argument("--loops", type=int, required=True, help="K at evaluation")
    down.add_argument("--tasks", help="comma-separated lm-eval tasks (default: the study's nine)")
    down.add_argument("--limit", type=int, help="at most this many examples per task")
    down.add_argument(
        "--data-dir",
        help="run the built-in tasks from DIR/<task>/<split>.jsonl (hub schema) instead of the hub",
    )
    down.add_argument("--batch-size", type=int, default=8)
    down.add_argument(
        "--split",
        choices=["validation", "default"],
        default="validation",
        help="validation (the study: every task's validation split) or default "
        "(the split lm-eval evaluates each task on)",
    )
    down.add_argument("--out", required=True, help="results folder (results, samples, summary)")
    down.set_defaults(fn=cmd_eval_downstream)
    cmp = evaluate.add_parser("compare", help="paired bootstrap CIs between two results folders")
    cmp.add_argument("a")
    cmp.add_argument("b")
    cmp.add_argument("--resamples", type=int, default=10_000)
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument("--out", help="write the table (.md) or the numbers (.json)")
    cmp.set_defaults(fn=cmd_eval_compare)

    bench = sub.add_parser("bench", help="benchmarks of trained or exported models").add_subparsers(
        dest="bench_command", required=True, metavar="ACTION"
    )
    fk = bench.add_parser("fixed-k", help="tokens/s and CE per token at each fixed K")
    fk.add_argument(
        "model", help="a run directory, a checkpoint folder or a `megaloop export` folder"
    )
    fk.add_argument(
        "--data",
        required=True,
        help="held-out tokens: a text file, a .npy of ids, an indexed split PREFIX "
        "or webdataset shards",
    )
    fk.add_argument("--loops", default="1,2,3,4")
    fk.add_argument("--batch-size", type=int, default=1, help="study: 2")
    fk.add_argument("--seq-len", type=int, default=128, help="study: 2048")
    fk.add_argument("--batches", type=int, default=8, help="timed batches (study: 128)")
    fk.add_argument("--warmup", type=int, default=2, help="untimed batches first")
    fk.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 on a GPU, float32 on a CPU",
    )
    fk.add_argument(
        "--out",
        help="JSON file of the results (and a PNG of the PPL-throughput frontier beside it)",
    )
    fk.set_defaults(fn=cmd_bench_fixed_k)

    def measurement(name, help_text):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "model", help="a run directory, a checkpoint folder or a `megaloop export` folder"
        )
        p.add_argument(
            "--data",
            required=True,
            help="held-out tokens: a text file, a .npy of ids, an indexed split "
            "PREFIX (PREFIX.bin/.idx) or webdataset shards",
        )
        p.add_argument("--out", required=True, help=f"writes OUT/{name}.json and OUT/{name}.md")
        return p

    dp = measurement("depth", "fixed-depth CE/PPL at each K from one pass (Table 5)")
    dp.add_argument("--loops", default="1,2,3,4", help="depths to read, e.g. 1,2,3,4,8")
    dp.add_argument(
        "--clamp",
        action="store_true",
        help="hold every loop at its loop-1 RMS (the recurrent-scale clamp)",
    )
    dp.add_argument("--sequences", type=int, default=160, help="windows in the slice")
    dp.add_argument("--seq-len", type=int, default=256)
    dp.add_argument("--batch-size", type=int, default=8)
    dp.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    dp.set_defaults(fn=cmd_depth)
    ht = measurement("halt", "calibrated halting and its timed speedup (Appendix H)")
    ht.add_argument("--k-max", type=int, default=4)
    ht.add_argument(
        "--rho",
        type=float,
        default=1.01,
        help="PPL budget: dynamic PPL <= rho x fixed-K_max PPL on the calibration slice",
    )
    ht.add_argument("--calib", type=int, default=160, help="calibration sequences")
    ht.add_argument(
        "--bench",
        type=int,
        default=160,
        help="benchmark sequences (the windows after the calibration slice)",
    )
    ht.add_argument("--batch", type=int, default=8)
    ht.add_argument("--seq-len", type=int, default=256)
    ht.add_argument(
        "--rule",
        choices=["margin", "gate"],
        default="margin",
        help="margin: per sequence, mean top-1 minus top-2 logit; gate: per token, "
        "Ouro's cumulative exit probability",
    )
    ht.add_argument("--tau", type=float, help="margin threshold (skip calibration)")
    ht.add_argument("--q", type=float, help="gate threshold (skip calibration)")
    ht.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 on a GPU, float32 on a CPU",
    )
    ht.set_defaults(fn=cmd_halt)
    dg = measurement(
        "diagnose", "scale, radial gradients, 30-loop rollout, scale sweep, clamp (Tables 3, 4, 6)"
    )
    dg.add_argument("--tokens", type=int, default=4096, help="held-out tokens in the slice")
    dg.add_argument("--seq-len", type=int, default=256)
    dg.add_argument("--rollout", type=int, default=30, help="loops of the rollout")
    dg.add_argument("--batch-size", type=int, default=8)
    dg.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "fp32", "bf16"],
        help="the precision of the model and its radial gradients: float32 shows a normalising "
        "readout's true floor (falling as the state grows), bfloat16 the study's (~1e-8)",
    )
    dg.set_defaults(fn=cmd_diagnose)
    sw = sub.add_parser(
        "sweep",
        help="every config x seed in a run directory of its own; "
        "finished runs skipped, unfinished ones resumed",
    )
    sw.add_argument(
        "configs",
        nargs="+",
        metavar="CONFIG",
        help="YAML configs, then key=value overrides for every run",
    )
    sw.add_argument("--seeds", default="0", help="e.g. 0,1,2")
    sw.add_argument(
        "--executor",
        choices=["local", "slurm"],
        default="local",
        help="local: one run after another here; slurm: one job array",
    )
    sw.add_argument(
        "--root",
        default="runs",
        help="run directories go to ROOT/<config path under configs/experiments>/seedN",
    )
    slurm_options(sw, required=False)
    sw.set_defaults(fn=cmd_sweep, overrides=[])
    rp = sub.add_parser(
        "report", help="the study's tables and figures from runs and measurement results"
    )
    rp.add_argument(
        "inputs",
        nargs="+",
        metavar="RUN_OR_RESULT",
        help="run directories (metrics.jsonl) and folders or JSON files written by "
        "depth / halt / diagnose",
    )
    rp.add_argument("--out", required=True, help="writes OUT/report.md and OUT/*.png")
    rp.set_defaults(fn=cmd_report)

    slurm = sub.add_parser("slurm", help="Slurm jobs (slurm/*.sbatch)").add_subparsers(
        dest="slurm_command", required=True, metavar="ACTION"
    )
    submit = with_config(
        slurm.add_parser(
            "submit",
            help="render slurm/train.sbatch for this config and sbatch it",
            description="One srun task per rank; the layout (parallel.tp/pp) is chosen to fit the "
            "GPUs unless given as overrides. See docs/slurm.md.",
        )
    )
    slurm_options(submit, required=True)
    submit.set_defaults(fn=cmd_slurm_submit)
    return parser


NO_MEGATRON = frozenset({"configs", "params", "plan", "slurm", "sweep", "prep", "eval", "report"})
"""Commands that never build a model in this process (they read configs and print, or hand the
work to other processes): they import neither torch, megatron-core nor wandb, and start in a
fraction of a second."""


class ReaderSafeStdout:
    """Standard output that outlives its reader. When the reader of a pipe goes (`| head -1`,
    `| grep -q`), the next write fails with EPIPE; from then on output is dropped (fd 1 points
    at /dev/null, so the interpreter's final flush succeeds too) and the command finishes and
    exits as it would have, without a traceback. A training run piped into `head` keeps
    training rather than dying mid-step."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        self.reader_gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv=None) -> int:
    if not isinstance(sys.stdout, ReaderSafeStdout) and sys.stdout is not None:
        sys.stdout = ReaderSafeStdout(sys.stdout)
    known_warnings.install()
    if int(os.environ.get("RANK", "0")) != 0:  # every rank raises a dependency's warning alike
        warnings.filterwarnings("ignore", module="(?!megaloop)")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (
        not hasattr(args, "overrides") or any(a.startswith("-") or "=" not in a for a in extra)
    ):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # key=value overrides may also follow the options
        args.overrides = [*args.overrides, *extra]
    if args.command not in NO_MEGATRON:
        from megaloop import _cpu_compat

        _cpu_compat.apply()
    try:
        return args.fn(args)
    except (ConfigError, LaunchError, EvalError) as e:
        print(f"megaloop: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmegaloop: aborted (Ctrl-C); what was already written is kept", file=sys.stderr)
        return 130
    finally:
        if "megaloop.parallel.distributed" in sys.modules:
            from megaloop.parallel import distributed

            distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
