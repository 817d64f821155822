"""Throughput and cross-entropy at fixed depth K: what each extra loop costs and buys.

Forward passes of a model (a run, checkpoint or export, opened as the exported model:
megaloop/evaluation/harness.py) over a slice of held-out tokens at each K, no cache: tokens/s is the
median over timed batches (warm-up excluded, the device synchronized around each), CE is the
mean next-token cross-entropy over the same batches. The study: batch 2, sequence 2,048, 128
timed batches, bf16 on a GPU.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from megaloop.evaluation import harness
from megaloop.evaluation.settings import FixedKSettings


def run(settings: FixedKSettings) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    harness.check_data(settings.data)
    device, dtype = harness.device_and_dtype(settings.dtype, settings.device)
    opened = harness.open_model(settings.model, device, dtype)
    model = opened.model
    settings = opened.fitted(settings)
    batch_size, seq_len = settings.batch_size, settings.seq_len
    batches, warmup = settings.batches, settings.warmup
    windows = (
        harness.windows(
            harness.read_tokens(settings.data, opened.encode),
            seq_len,
            (warmup + batches) * batch_size,
        )
        .view(warmup + batches, batch_size, seq_len + 1)
        .to(device)
    )

    rows = []
    for k in tqdm(settings.loops, desc="fixed-K", unit="K"):
        times, ce = [], []
        for i, window in enumerate(windows):
            harness.synchronize(device)
            start = time.perf_counter()
            with torch.no_grad():
                logits = model(window[:, :-1], num_loops=k, use_cache=False).logits
            harness.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
                ce.append(
                    F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten()).item()
                )
        seconds = statistics.median(times)
        rows.append(
            {
                "loops": k,
                "tokens_per_s": batch_size * seq_len / seconds,
                "median_batch_s": seconds,
                "ce": float(np.mean(ce)),
            }
        )
    for row in rows:
        row["throughput_vs_k1"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    info = {
        "model": str(settings.model),
        "data": str(settings.data),
        "device": device,
        "dtype": dtype,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "timed_batches": batches,
        "warmup_batches": warmup,
        "rows": rows,
    }
    if settings.out is not None:
        settings.out.parent.mkdir(parents=True, exist_ok=True)
        settings.out.write_text(json.dumps(info, indent=1))
        plot_frontier(
            rows,
            settings.out.with_suffix(".png"),
            f"{settings.model.resolve().parent.name}/"
            f"{settings.model.name}, {device} {dtype}, "
            f"{batch_size} x {seq_len} tokens",
        )
    return rows


def plot_frontier(rows: list[dict], path: Path, title: str) -> None:
    """Perplexity against tokens/s, one point per K: the PPL–throughput frontier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    speed = [r["tokens_per_s"] for r in rows]
    ppl = [float(np.exp(r["ce"])) for r in rows]
    ax.plot(speed, ppl, "o-")
    for r, x, y in zip(rows, speed, ppl):
        ax.annotate(f"K={r['loops']}", (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("tokens/s")
    ax.set_ylabel("perplexity")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    lines = ["| K | tokens/s | vs first K | median batch s | CE / token |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['loops']} | {r['tokens_per_s']:,.0f} | {r['throughput_vs_k1']:.2f}x "
            f"| {r['median_batch_s']:.4f} | {r['ce']:.4f} |"
        )
    return "\n".join(lines)
