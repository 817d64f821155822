"""Downstream tasks with adaptive depth: lm-eval's accuracy when each token exits early.

`eval downstream --exit gate|margin|confidence --threshold T1,T2,...` scores the tasks at every
fixed K from 1 to K = --loops (the baselines) and then once per threshold with the model's exit
rule at that threshold and K_max = K; each threshold is placed against the fixed Ks at no more
loops a token (dominated or not). lm-eval scores teacher-forced, one forward of context +
continuation per request, so a threshold run takes the exported model's no-cache forward
(use_cache=False): every loop runs for every token and each position's logits are its exit
loop's, the logits the cached exiting forward gives too (docs/generation.md). The forward
returns each token's exit loop (LoopedOutput.exit_loops).

Loops per token counts the positions lm-eval scores: a request's continuation tokens, whose
logits make its log-likelihood (context and padding are not counted). `mean_loops` averages them
over a task's scored tokens (`scored_tokens`) and over the run's; a fixed-K run has K.

Writes OUT/fixed-k{k}/ (k = 1..K) and OUT/{rule}-{T}/, each the layout of a single run (so
`megaloop eval compare` pairs any two), and OUT/adaptive.json, adaptive.md and
accuracy_vs_depth.png.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from megaloop.evaluation import downstream, harness
from megaloop.evaluation.exported import (
    Export,
    open_export,
)
from megaloop.evaluation.settings import DownstreamSettings, check_gate


def check_rule(settings: DownstreamSettings, folder: Path) -> Export:
    """The export `folder` (MODEL's, harness.as_export), opened; EvalError, before its model is
    built, for a gate rule on a model without one."""
    export = open_export(folder)
    if settings.exit is not None:
        check_gate(settings.exit, bool(export.config.get("exit_gate")), settings.model)
    return export


@functools.cache
def depth_counting_class():
    """CheckedHFLM that scores with the no-cache exiting forward and keeps, per request, the
    exit loops of its scored positions, summed per task (`depth`)."""
    import torch

    class DepthCountingHFLM(downstream.checked_lm_class()):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.forward_exits, self.row = None, 0
            self.by_input: dict[bytes, np.ndarray] = {}
            self.by_request: dict[tuple[str, str], np.ndarray] = {}
            self.totals: dict[str, list[int]] = {}

        def _model_call(self, inps, attn_mask=None, labels=None):
            with torch.no_grad():
                out = self.model(input_ids=inps, use_cache=False)
            self.forward_exits, self.row = (inps.cpu().numpy(), out.exit_loops.cpu().numpy()), 0
            return out.logits

        def _select_cont_toks(self, logits, contlen=None, inplen=None):
            """Called once per row of the last forward, in order, with the row's real length:
            its input (the key its requests are found by) and its exit loops up to there."""
            tokens, exits = self.forward_exits
            key = tokens[self.row, :inplen].astype(np.int64).tobytes()
            self.by_input[key] = exits[self.row, :inplen].astype(np.int16)
            self.row += 1
            return super()._select_cont_toks(logits, contlen=contlen, inplen=inplen)

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
            scores = super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
            for pair, context, continuation in requests:  # the input as HFLM forms it
                inp = (context + continuation)[-(self.max_length + 1) :][:-1]
                exits = self.by_input[np.array(inp, dtype=np.int64).tobytes()]
                self.by_request[tuple(pair)] = exits[-len(continuation) :]
            self.by_input.clear()
            return scores

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            scores = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
            for request in requests:
                exits = self.by_request[tuple(request.args)]
                total = self.totals.setdefault(request.task_name, [0, 0])
                total[0] += int(exits.sum())
                total[1] += exits.size
            return scores

        def depth(self) -> tuple[dict[str, dict], float]:
            """Per task its mean loops per scored token and their count; the run's mean."""
            per_task = {
                task: {"mean_loops": loops / tokens, "scored_tokens": tokens}
                for task, (loops, tokens) in self.totals.items()
            }
            loops, tokens = np.sum(list(self.totals.values()), axis=0)
            return per_task, float(loops / tokens)

    return DepthCountingHFLM


def run(settings: DownstreamSettings) -> dict:
    """Each fixed K up to K, then each threshold; adaptive.json/.md and the figure over all."""
    harness.model_kind(settings.model)  # a folder of no model: refused before lm-eval's scan
    K, out = settings.loops, settings.out
    baselines = tuple(range(1, K + 1))  # the fixed-K runs, one lm-eval pass each
    runs = []
    with (
        downstream.task_setup(settings) as (tasks, task_manager),
        harness.as_export(settings.model) as (export_folder, source),
        downstream.without_lm_eval_bars(),
    ):
        export = check_rule(settings, export_folder)
        model, tokenizer, device = downstream.loaded(export, settings)
        passes = harness.progress(
            None,
            f"lm-eval passes (K=1..{K}, then each threshold)",
            "pass",
            total=K + len(settings.thresholds),
        )
        lm_args = dict(
            pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size, device=device
        )
        for k in baselines:
            model.config.num_loops = k
            results = downstream.scored(
                downstream.checked_lm(**lm_args), tasks, task_manager, settings.limit
            )
            info = downstream.run_info(settings, results, source) | {"loops": k}
            fixed = {"exit": "fixed", "threshold": None, "mean_loops": float(k)}
            depth = {task: {"mean_loops": float(k)} for task in results["configs"]}
            folder = out / f"fixed-k{k}"
            runs.append(record(downstream.write(results, folder, info | fixed, depth), folder))
            passes.update()
        model.config.num_loops, info["loops"] = K, K
        for threshold in settings.thresholds:
            model.config.early_exit, model.config.exit_threshold = settings.exit, threshold
            lm = depth_counting_class()(**lm_args)
            results = downstream.scored(lm, tasks, task_manager, settings.limit)
            depth, mean = lm.depth()
            rule = {"exit": settings.exit, "threshold": threshold, "mean_loops": mean}
            folder = out / f"{settings.exit}-{threshold!r}"
            runs.append(record(downstream.write(results, folder, info | rule, depth), folder))
            passes.update()
        passes.close()
    place(runs)
    summary = {
        **{k: info[k] for k in ("model", "step", "loops", "limit", "data_dir", "split", "splits")},
        "exit": settings.exit,
        "mean_loops_over": "each request's continuation tokens (the positions lm-eval scores)",
        "runs": runs,
    }
    (out / "adaptive.json").write_text(json.dumps(summary, indent=1))
    (out / "adaptive.md").write_text(table(summary) + "\n")
    plot(summary, out / "accuracy_vs_depth.png")
    return summary


def place(runs: list[dict]) -> None:
    """Each threshold run against the fixed Ks beside it, in macro accuracy: the best fixed K at
    no more loops a token (`acc_gain_at_depth`: how much more accurate the run is, and that K),
    and whether a fixed K is both as shallow and as accurate (`dominated`)."""
    fixed = [r for r in runs if r["exit"] == "fixed"]
    for r in runs:
        if r["exit"] == "fixed":
            continue
        shallower = [f for f in fixed if f["mean_loops"] <= r["mean_loops"]]
        best = max(shallower, key=lambda f: f["macro_acc"], default=None)
        r["fixed_k_at_depth"] = None if best is None else int(best["mean_loops"])
        r["acc_gain_at_depth"] = None if best is None else r["macro_acc"] - best["macro_acc"]
        r["dominated"] = best is not None and best["macro_acc"] >= r["macro_acc"]


def record(summary: dict, folder: Path) -> dict:
    """One run's entry of adaptive.json: its rule, depth and accuracies, per task too."""
    keep = ("acc", "acc_norm", "n", "mean_loops", "scored_tokens")
    return {
        "exit": summary["exit"],
        "threshold": summary["threshold"],
        "folder": folder.name,
        "mean_loops": summary["mean_loops"],
        "macro_acc": summary["macro_acc"],
        "macro_acc_norm": summary["macro_acc_norm"],
        "n": summary["n"],
        "tasks": {task: {k: r[k] for k in keep if k in r} for task, r in summary["tasks"].items()},
    }


def label(run: dict) -> str:
    return (
        f"fixed K={run['mean_loops']:g}"
        if run["exit"] == "fixed"
        else f"{run['exit']} {run['threshold']:g}"
    )


def table(summary: dict) -> str:
    """Whether a threshold beat every fixed K at no more loops a token; then per task, and over
    tasks (macro), each run's loops per token, acc and acc_norm."""
    adaptive = [r for r in summary["runs"] if r["exit"] != "fixed"]
    above = [r for r in adaptive if not r["dominated"]]
    if above:
        r = max(above, key=lambda r: r["acc_gain_at_depth"])
        lead = (
            f"{len(above)} of {len(adaptive)} thresholds beat every fixed K at no more loops a "
            f"token; the most: {label(r)} at {r['mean_loops']:.2f} loops, macro acc "
            f"{r['acc_gain_at_depth']:+.4f} over fixed K={r['fixed_k_at_depth']}."
        )
    else:
        lead = (
            f"No threshold beat fixed K: each of the {len(adaptive)} is matched by a fixed K "
            "at no more loops a token and at least its macro acc."
        )
    lines = [lead, "", "| task | run | loops / token | acc | acc_norm |", "|---|---|---|---|---|"]
    for task in summary["runs"][0]["tasks"]:
        for run in summary["runs"]:
            r = run["tasks"][task]
            lines.append(
                f"| {task} | {label(run)} | {r['mean_loops']:.2f} | {r['acc']:.4f} "
                f"| {r['acc_norm']:.4f} |"
            )
    for run in summary["runs"]:
        lines.append(
            f"| **macro** | {label(run)} | {run['mean_loops']:.2f} | {run['macro_acc']:.4f} "
            f"| {run['macro_acc_norm']:.4f} |"
        )
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    """Accuracy over tasks against mean loops per token: one point per threshold, the fixed Ks
    as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = [r for r in summary["runs"] if r["exit"] == "fixed"]
    adaptive = [r for r in summary["runs"] if r["exit"] != "fixed"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    xs, ys = [r["mean_loops"] for r in adaptive], [r["macro_acc"] for r in adaptive]
    ax.plot(xs, ys, "o-", label=f"{summary['exit']} exit")
    for r, x, y in zip(adaptive, xs, ys):
        ax.annotate(f"{r['threshold']:g}", (x, y), textcoords="offset points", xytext=(4, 4))
    ax.plot(
        [r["mean_loops"] for r in fixed], [r["macro_acc"] for r in fixed], "k*-", label="fixed K"
    )
    ax.set_xlabel("mean loops per scored token")
    ax.set_ylabel("accuracy (mean over tasks)")
    model = Path(summary["model"])
    ax.set_title(f"{model.resolve().parent.name}/{model.name}: accuracy vs depth", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
