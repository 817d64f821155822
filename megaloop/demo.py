"""`megaloop demo`: the readout blind spot in a few minutes on a CPU.

Trains the same tiny looped model twice with a per-loop CE objective and no inter-loop norm, once
reading every exit through RMSNorm (`norm`) and once raw (`raw`), then prints per-loop CE and the
hidden-state RMS per loop: under `norm` CE cannot see the scale of H_k, and the recurrence lets it
drift; under `raw` it can.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megaloop.data import DataConfig, synthetic
from megaloop.experiment import ExperimentConfig, build_trainer
from megaloop.model import ModelConfig
from megaloop.objectives import ObjectiveConfig, masked_mean
from megaloop.train.metrics import WandbConfig, write_json_atomic
from megaloop.train.optim import OptimConfig
from megaloop.train.trainer import TrainConfig

READOUTS = ("norm", "raw")


def demo_config(readout: str, out: Path, text: Optional[str], tokenizer: str, steps: int
                ) -> ExperimentConfig:
    seq_len = 128 if text else 64
    data = (DataConfig(kind="text", path=text, tokenizer=tokenizer, seq_len=seq_len) if text
            else DataConfig(kind="synthetic", task="addition", depth=4, seq_len=seq_len))
    vocab = 256 if tokenizer == "bytes" else data.build(0).tokenizer.vocab_size
    return ExperimentConfig(
        model=ModelConfig(vocab_size=vocab, hidden_size=64, num_heads=4, num_layers=1,
                          num_loops=4, max_seq_len=seq_len, readout=readout, recurrence="none"),
        objective=ObjectiveConfig(kind="per_loop"),
        data=data,
        optim=OptimConfig(lr=5e-3, min_lr=5e-4, warmup_steps=50, weight_decay=0.0),
        train=TrainConfig(dir=str(out / readout), steps=steps, micro_batch_size=32,
                          global_batch_size=32, log_every=25,
                          eval_batches="all" if text else 8),
        wandb=WandbConfig(mode="disabled"))


@torch.no_grad()
def evaluate(trainer, task: Optional[str]) -> dict:
    """Per-loop CE (all tokens and, on the built-in corpus, answer tokens) and hidden RMS."""
    model = trainer.engine.module
    model.eval()
    mbs, n = trainer.cfg.train.micro_batch_size, trainer.eval_microbatches
    batch = trainer.dataset.batch(range(mbs * n), split="valid")
    out = model(batch[:, :-1], labels=batch[:, 1:])
    result = {
        "ce": [c.mean().item() for c in out.token_ce],
        "hidden_rms": [h.pow(2).mean(-1).sqrt().mean().item() for h in out.hidden],
    }
    if task:
        mask = torch.from_numpy(np.stack([synthetic.answer_mask(b.numpy(), task)
                                          for b in batch])[:, :-1]).float()
        result["answer_ce"] = [masked_mean(c, mask).item() for c in out.token_ce]
    return result


def table(results: dict) -> str:
    k = len(next(iter(results.values()))["ce"])
    loops = " ".join(f"{f'k={i}':>7}" for i in range(1, k + 1))
    lines = [f"{'readout':<8} {'metric':<22} {loops}"]
    for readout, r in results.items():
        rows = [("CE (all tokens)", r["ce"])]
        if "answer_ce" in r:
            rows.append(("CE (answer digits)", r["answer_ce"]))
        rows.append(("hidden RMS ||H_k||", r["hidden_rms"]))
        for name, values in rows:
            lines.append(f"{readout:<8} {name:<22} " + " ".join(f"{v:7.3f}" for v in values))
    lines.append("")
    for readout, r in results.items():
        lines.append(f"{readout}: final-loop hidden RMS {r['hidden_rms'][-1]:.3g}, "
                     f"CE k=1 -> k={k}: {r['ce'][0]:.3f} -> {r['ce'][-1]:.3f}")
    return "\n".join(lines)


def plot(results: dict, out_dir: Path, path: Path) -> None:
    """Left: hidden RMS of the last loop over training; right: CE per loop after training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rms, ax_ce) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (readout, r) in enumerate(results.items()):
        color = f"C{i}"
        steps = json.loads((out_dir / readout / "metrics.json").read_text())["steps"]
        ax_rms.plot([s["step"] for s in steps], [s["hidden_rms"][-1] for s in steps],
                    color=color, label=f"{readout} readout")
        loops = range(1, len(r["ce"]) + 1)
        ax_ce.plot(loops, r["ce"], marker="o", color=color,
                   label=f"{readout}: all tokens")
        if "answer_ce" in r:
            ax_ce.plot(loops, r["answer_ce"], marker="s", ls="--", color=color,
                       label=f"{readout}: answer digits")
    ax_rms.set(xlabel="step", ylabel="hidden RMS ||H_K||, last loop", yscale="log",
               title="hidden-state scale during training")
    ax_ce.set(xlabel="loop k", ylabel="validation CE (nats)", xticks=list(loops),
              title="CE per exit after training")
    for ax in (ax_rms, ax_ce):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(text: Optional[str] = None, steps: Optional[int] = None, out: str = "runs/demo",
             tokenizer: str = "bytes") -> dict:
    out_dir = Path(out)
    steps = steps or 1000
    results = {}
    for readout in READOUTS:
        cfg = demo_config(readout, out_dir, text, tokenizer, steps)
        print(f"== demo: {readout} readout, per-loop CE, no inter-loop norm, {steps} steps "
              f"on {'the text ' + text if text else 'the built-in addition corpus'}")
        trainer = build_trainer(cfg)
        trainer.fit()
        results[readout] = evaluate(trainer, None if text else cfg.data.task)
    print()
    print(table(results))
    write_json_atomic(out_dir / "summary.json", results)
    plot(results, out_dir, out_dir / "demo.png")
    print(f"\nplot: {out_dir / 'demo.png'}")
    return results
