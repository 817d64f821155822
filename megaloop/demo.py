"""`megaloop demo`: the readout blind spot in a few minutes on a CPU.

Trains the same tiny looped model twice with a per-loop CE objective and no inter-loop norm, once
reading every exit through RMSNorm (`norm`) and once raw (`raw`), for several seeds, then prints
per-loop CE and the hidden-state RMS per loop (mean and range over seeds): under `norm` CE cannot
see the scale of H_k, and the recurrence lets it drift; under `raw` it can. A tiny model's CE
ordering is a coin flip between seeds, so the demo states as findings only the comparisons that
come out the same way, and clearly (MIN_EFFECT), in every one of its seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from megaloop.data import SyntheticConfig, TextConfig, synthetic
from megaloop.experiment import ExperimentConfig, build_trainer
from megaloop.model import ModelConfig, semantics
from megaloop.objectives import ObjectiveConfig, masked_mean
from megaloop.train.config import TrainConfig
from megaloop.train.metrics import WandbConfig, write_json_atomic
from megaloop.train.metrics import read as read_metrics
from megaloop.train.optim import OptimConfig

READOUTS = ("norm", "raw")
DEFAULT_STEPS = 400


def demo_config(
    readout: str, out: Path, text: str | None, tokenizer: str, steps: int, seed: int = 0
) -> ExperimentConfig:
    seq_len = 128 if text else 64
    data = (
        TextConfig(path=text, tokenizer=tokenizer, seq_len=seq_len)
        if text
        else SyntheticConfig(task="addition", depth=4, seq_len=seq_len)
    )
    vocab = 256 if tokenizer == "bytes" else data.build(0).tokenizer.vocab_size
    return ExperimentConfig(
        model=ModelConfig(
            vocab_size=vocab,
            hidden_size=64,
            num_heads=4,
            num_layers=1,
            num_loops=4,
            max_seq_len=seq_len,
            readout=readout,
            recurrence="none",
        ),
        objective=ObjectiveConfig(kind="per_loop"),
        data=data,
        optim=OptimConfig(lr=5e-3, min_lr=5e-4, warmup_steps=50, weight_decay=0.0),
        train=TrainConfig(
            dir=str(out / readout),
            steps=steps,
            seed=seed,
            micro_batch_size=8,
            global_batch_size=8,
            log_every=25,
            eval_batches="all" if text else 32,
        ),
        wandb=WandbConfig(mode="disabled"),
    )


@torch.no_grad()
def evaluate(trainer, task: str | None) -> dict:
    """Per-loop CE (all tokens and, on the built-in corpus, answer tokens) and hidden RMS."""
    model = trainer.engine.module
    model.eval()
    mbs, n = trainer.cfg.train.micro_batch_size, trainer.eval_microbatches
    batch = trainer.dataset.batch(range(mbs * n), split="valid")
    out = model(batch[:, :-1], labels=batch[:, 1:])
    result = {
        "ce": [c.mean().item() for c in out.token_ce],
        "hidden_rms": [semantics.rms(h).mean().item() for h in out.hidden],
    }
    if task:
        mask = torch.from_numpy(
            np.stack([synthetic.answer_mask(b.numpy(), task) for b in batch])[:, :-1]
        ).float()
        result["answer_ce"] = [masked_mean(c, mask).item() for c in out.token_ce]
    return result


def relative(a: float, b: float) -> float:
    """(a - b) over their mean: a difference that means the same for CE and for hidden RMS."""
    return (a - b) / ((abs(a) + abs(b)) / 2 or 1.0)


MIN_EFFECT = 0.05
"""A comparison is a finding only if it comes out the same way in every seed and by at least this
relative difference in each: a tiny model's CE differs between readouts by ~1%, less than
between seeds, and a handful of seeds can agree on a coin flip."""

COMPARISONS = [
    # (what is compared, how to say it when the value is > 0, when < 0, value(norm, raw))
    (
        "final-loop hidden RMS",
        "is larger with the norm readout than with raw",
        "is larger with the raw readout than with norm",
        lambda n, r: relative(n["hidden_rms"][-1], r["hidden_rms"][-1]),
    ),
    (
        "hidden RMS under the norm readout",
        "grows at every loop",
        "does not grow at every loop",
        lambda n, r: (
            1.0 if all(b > a for a, b in zip(n["hidden_rms"], n["hidden_rms"][1:])) else -1.0
        ),
    ),
    (
        "growth of the hidden RMS from loop 1 to loop K",
        "is larger under norm than under raw",
        "is larger under raw than under norm",
        lambda n, r: relative(
            n["hidden_rms"][-1] / n["hidden_rms"][0], r["hidden_rms"][-1] / r["hidden_rms"][0]
        ),
    ),
    (
        "CE (all tokens) at loop K",
        "is lower with raw than with norm",
        "is lower with norm than with raw",
        lambda n, r: relative(n["ce"][-1], r["ce"][-1]),
    ),
    (
        "CE (answer digits) at loop K",
        "is lower with raw than with norm",
        "is lower with norm than with raw",
        lambda n, r: relative(n["answer_ce"][-1], r["answer_ce"][-1]) if "answer_ce" in r else None,
    ),
    (
        "CE gained from loop 1 to loop K",
        "is larger with raw than with norm",
        "is larger with norm than with raw",
        lambda n, r: (
            ((r["ce"][0] - r["ce"][-1]) - (n["ce"][0] - n["ce"][-1]))
            / ((n["ce"][0] + r["ce"][0]) / 2)
        ),
    ),
]
"""What the demo compares between its readouts (values are relative differences)."""


def conclusions(results: dict) -> tuple[list[str], list[str]]:
    """(comparisons that are findings: the same way and >= MIN_EFFECT in every seed; the
    others, with how they came out)."""
    holds, mixed = [], []
    for what, positive, negative, value in COMPARISONS:
        values = [value(r["norm"], r["raw"]) for r in results.values()]
        if None in values:
            continue
        up = sum(v > 0 for v in values)
        clear = all(abs(v) >= MIN_EFFECT for v in values)
        sizes = f"differences {min(map(abs, values)):.1%} to {max(map(abs, values)):.1%}"
        if up in (0, len(values)) and clear:
            holds.append(f"{what} {positive if up else negative}")
        elif up in (0, len(values)):
            mixed.append(
                f"{what} {positive if up else negative} in every seed, but by less "
                f"than {MIN_EFFECT:.0%} in some ({sizes})"
            )
        else:
            mixed.append(
                f"{what} {positive} in {up} of {len(values)} seeds, {negative} in "
                f"the others ({sizes})"
            )
    return holds, mixed


def table(results: dict) -> str:
    """Mean over seeds, [min, max] beneath, per readout, metric and loop; then the conclusions."""
    first = next(iter(results.values()))
    k = len(first["norm"]["ce"])
    loops = " ".join(f"{f'k={i}':>15}" for i in range(1, k + 1))
    lines = [
        f"{len(results)} seeds ({', '.join(map(str, results))}): mean [min, max] over seeds",
        f"{'readout':<8} {'metric':<20} {loops}",
    ]
    metrics = [
        ("CE (all tokens)", "ce"),
        ("CE (answer digits)", "answer_ce"),
        ("hidden RMS ||H_k||", "hidden_rms"),
    ]
    for readout in READOUTS:
        for name, key in metrics:
            if key not in first[readout]:
                continue
            values = np.array([r[readout][key] for r in results.values()])
            cells = [
                f"{m:.3g} [{lo:.3g},{hi:.3g}]"
                for m, lo, hi in zip(values.mean(0), values.min(0), values.max(0))
            ]
            lines.append(f"{readout:<8} {name:<20} " + " ".join(f"{c:>15}" for c in cells))
    holds, mixed = conclusions(results)
    lines += [
        "",
        f"Findings: the same way, by {MIN_EFFECT:.0%} or more, in every one of the "
        f"{len(results)} seeds:",
    ]
    lines += [f"  - {c}" for c in holds] or ["  (nothing)"]
    lines += ["Not findings of this demo (seeds disagree, or the readouts differ too little):"]
    lines += [f"  - {c}" for c in mixed] or ["  (nothing)"]
    return "\n".join(lines)


def plot(results: dict, out_dir: Path, path: Path) -> None:
    """Left: hidden RMS of the last loop over training, every seed; right: CE per loop after
    training, mean over seeds with the [min, max] band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rms, ax_ce) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, readout in enumerate(READOUTS):
        color = f"C{i}"
        for j, seed in enumerate(results):
            steps = read_metrics(out_dir / f"seed{seed}" / readout)["steps"]
            ax_rms.plot(
                [s["step"] for s in steps],
                [s["hidden_rms"][-1] for s in steps],
                color=color,
                alpha=0.8,
                lw=1,
                label=f"{readout} readout" if j == 0 else None,
            )
        for key, marker, ls, what in (
            ("ce", "o", "-", "all tokens"),
            ("answer_ce", "s", "--", "answer digits"),
        ):
            if key not in next(iter(results.values()))[readout]:
                continue
            values = np.array([r[readout][key] for r in results.values()])
            loops = range(1, values.shape[1] + 1)
            ax_ce.plot(
                loops, values.mean(0), marker=marker, ls=ls, color=color, label=f"{readout}: {what}"
            )
            ax_ce.fill_between(loops, values.min(0), values.max(0), color=color, alpha=0.15)
    ax_rms.set(
        xlabel="step",
        ylabel="hidden RMS ||H_K||, last loop",
        yscale="log",
        title=f"hidden-state scale during training ({len(results)} seeds)",
    )
    ax_ce.set(
        xlabel="loop k",
        ylabel="validation CE (nats)",
        xticks=list(loops),
        title="CE per exit after training (mean, min-max band)",
    )
    for ax in (ax_rms, ax_ce):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train_one(job: tuple) -> dict:
    """Train one (readout, seed) and evaluate it. With `log` set (a worker process of its own),
    the run's output goes to RUN_DIR/train.log and it uses one thread."""
    readout, seed, out_dir, text, tokenizer, steps, log = job
    cfg = demo_config(readout, out_dir / f"seed{seed}", text, tokenizer, steps, seed)
    if log:
        import os
        import sys

        Path(cfg.train.dir).mkdir(parents=True, exist_ok=True)
        stream = open(Path(cfg.train.dir) / "train.log", "w")
        os.dup2(stream.fileno(), 1)
        os.dup2(stream.fileno(), 2)
        sys.stdout = sys.stderr = stream
        torch.set_num_threads(1)
    from megaloop.parallel import distributed

    trainer = build_trainer(cfg)
    try:
        trainer.fit()
        return evaluate(trainer, None if text else cfg.data.task)
    finally:
        distributed.shutdown()  # the worker's next run sets up its own world


def run_demo(
    text: str | None = None,
    steps: int | None = None,
    out: str = "runs/demo",
    tokenizer: str = "bytes",
    seeds: Sequence[int] = (0, 1, 2, 3),
    workers: int = 1,
    initializer=None,
) -> dict:
    """Both readouts for each of `seeds`; results[seed][readout]. `workers` > 1
    trains that many runs at a time in processes of their own (one thread each; started with
    `initializer`, e.g. the CPU compatibility layer an entry point applies)."""
    out_dir = Path(out)
    steps = steps or DEFAULT_STEPS
    print(
        f"== demo: norm and raw readouts, per-loop CE, no inter-loop norm, seeds "
        f"{', '.join(map(str, seeds))}, {steps} steps each on "
        f"{'the text ' + text if text else 'the built-in addition corpus'}",
        flush=True,
    )
    jobs = [
        (readout, s, out_dir, text, tokenizer, steps, workers > 1)
        for s in seeds
        for readout in READOUTS
    ]
    results: dict = {s: {} for s in seeds}
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=initializer
        ) as pool:
            for job, result in zip(jobs, pool.map(train_one, jobs)):
                results[job[1]][job[0]] = result
                print(
                    f"   seed {job[1]}, {job[0]} readout: done "
                    f"(log {out_dir / f'seed{job[1]}' / job[0] / 'train.log'})",
                    flush=True,
                )
    else:
        for job in jobs:
            results[job[1]][job[0]] = train_one(job)
    print()
    print(table(results))
    write_json_atomic(out_dir / "summary.json", {str(k): v for k, v in results.items()})
    plot(results, out_dir, out_dir / "demo.png")
    print(f"\nplot: {out_dir / 'demo.png'}")
    return results
