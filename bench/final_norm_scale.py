"""Why the final-only-norm hybrid is worse at K=4 than at K=3 in the miniature (docs/repro_mini/).

    python -m bench final_norm_scale [--out OUT]          ~10 minutes on 2 CPU cores; rewrites
                                                          docs/repro_mini/final_norm_scale.{md,json}
    python -m bench final_norm_scale --smoke --out OUT    a toy size, a minute

`final_norm` reads exits 1..K-1 raw (W_out·H_k) and exit K normalised (W_out·γ⊙H_K/‖H_K‖_rms),
one W_out for all. Per-loop CE gives the raw exits three of the four losses, so W_out is fitted
to hidden states of RMS ~2.5, while the normalised exit hands it unit RMS times γ, a 1-D weight
that starts at 1 and that Adam moves by at most ~lr a step. If that is the cause, the final exit's
logits are too small (too flat) by ~RMS(H_K)/γ, and a temperature of that size on them recovers
the loss. The repro_mini final_norm config is trained (seeds 0 and 1) with W_out tied, as in the
miniature, and untied (the other candidate: the embedding pulling on W_out), and on the first
160 validation windows each run gets: CE at K = 1..4; at exit K the mean γ, the mean token RMS of
H_{K-1} and H_K, the temperature t* (on a log grid) minimising CE of t·logits_K and that CE; and
the CE of reading exit K raw, as the other exits are read.

Environment: as bench/repro_mini (REPRO_SOURCE, PYTHON); FINAL_NORM_WORK (default
runs/final_norm_scale).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from bench.common import ROOT, SMOKE, miniature, report, workers
from megaloop.train import metrics

CONFIG = ROOT / "configs/experiments/repro_mini/final_norm.yaml"
VARIANTS = {"tied": [], "untied": ["model.tie_embeddings=false"]}
SEEDS = (0, 1)
WINDOWS = 8 if SMOKE else 160
TEMPERATURES = np.logspace(-0.5, 1.0, 31)


def train(work: Path, data: Path) -> dict[str, Path]:
    runs = {
        f"{name}/seed{seed}": (work / "runs" / name / f"seed{seed}", overrides, seed)
        for name, overrides in VARIANTS.items()
        for seed in SEEDS
    }

    def one(item):
        name, (run_dir, overrides, seed) = item
        if metrics.finished(run_dir):  # a run stopped midway resumes instead
            return
        argv = ["train", CONFIG, f"train.dir={run_dir}", f"train.seed={seed}"]
        argv += [f"data.path={data / 'train'}", f"data.valid_path={data / 'valid'}"]
        argv += ["wandb.mode=disabled", *overrides, *(miniature.REPRO_SMOKE_SHAPE if SMOKE else [])]
        log = work / "logs" / f"{name.replace('/', '-')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        if code := workers.megaloop(argv, log):
            sys.exit(f"final_norm_scale: training {name} exited {code}; see {log}")
        print(f"trained {name}", flush=True)

    workers.each(one, runs.items())
    return {name: run_dir for name, (run_dir, _, _) in runs.items()}


def measure(run_dir: Path, text: Path) -> dict:
    import torch

    from megaloop import _cpu_compat

    _cpu_compat.apply()
    from megaloop.evaluation import harness

    opened = harness.open_model(run_dir)
    model, K = opened.model, opened.trained_loops
    windows = harness.windows(
        harness.read_tokens(text, opened.encode), miniature.REPRO_SEQ_LEN, WINDOWS
    )
    ce, rms, tempered, raw_k = np.zeros(K), np.zeros(K), np.zeros(len(TEMPERATURES)), 0.0
    tokens = 0
    with torch.no_grad():
        for batch in harness.batches(windows, 8, "final_norm_scale"):
            inputs, targets = batch[:, :-1], batch[:, 1:]
            for k, h in harness.trajectory(model, inputs, K):
                logits = model.readout(h, k, K)
                ce[k - 1] += harness.token_ce(logits, targets).double().sum().item()
                rms[k - 1] += h.double().pow(2).mean(-1).sqrt().sum().item()
                if k == K:
                    for i, t in enumerate(TEMPERATURES):
                        tempered[i] += harness.token_ce(t * logits, targets).double().sum().item()
                    raw = model.readout(h, K - 1, K)  # exit K read the way exits 1..K-1 are
                    raw_k += harness.token_ce(raw, targets).double().sum().item()
            tokens += targets.numel()
    best = int(np.argmin(tempered))
    gamma = model.readout_norm.weight.detach().double()
    return {
        "ce": (ce / tokens).tolist(),
        "ppl": np.exp(ce / tokens).tolist(),
        "rms": (rms / tokens).tolist(),
        "gamma_mean": gamma.mean().item(),
        "gamma_rms": gamma.pow(2).mean().sqrt().item(),
        "t_star": float(TEMPERATURES[best]),
        "ce_at_t_star": tempered[best] / tokens,
        "ce_exit_k_read_raw": raw_k / tokens,
        "tokens": tokens,
    }


def markdown(results: dict) -> str:
    lines = [
        "# final_norm at K = 4: the normalised exit's scale",
        "",
        "Written by `bench/final_norm_scale.py` (see its docstring). CE in nats on the first "
        f"{WINDOWS} validation windows of {miniature.REPRO_SEQ_LEN} tokens; K = 4 (trained).",
        "",
        "| run | PPL K=1 | K=2 | K=3 | K=4 | ‖H_3‖_rms | ‖H_4‖_rms | mean γ | ‖H_4‖/γ | t* "
        "| CE K=4 | CE at t* | CE exit 4 read raw |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        p = r["ppl"]
        lines.append(
            f"| {name} | {p[0]:.1f} | {p[1]:.1f} | {p[2]:.1f} | {p[3]:.1f} | {r['rms'][2]:.2f} "
            f"| {r['rms'][3]:.2f} | {r['gamma_mean']:.2f} | {r['rms'][3] / r['gamma_mean']:.2f} "
            f"| {r['t_star']:.2f} | {r['ce'][3]:.3f} | {r['ce_at_t_star']:.3f} "
            f"| {r['ce_exit_k_read_raw']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str], out: Path | None) -> None:
    out = report.command("final_norm_scale", argv, out, docs="repro_mini")
    work = Path(os.environ.get("FINAL_NORM_WORK", ROOT / "runs/final_norm_scale")).resolve()
    source = Path(os.environ.get("REPRO_SOURCE", ROOT.parent / "shared/data/wikitext-103"))
    python = os.environ.get("PYTHON", sys.executable)
    data = miniature.prepare_bpe(work, source, python)
    runs = train(work, data)
    text = work / "source/wiki.valid.raw"
    measured = workers.each(lambda run_dir: workers.call(measure, run_dir, text), runs.values())
    results = dict(zip(runs, measured))
    (out / "final_norm_scale.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "final_norm_scale.md").write_text(markdown(results))
    print(markdown(results))
