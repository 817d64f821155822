"""Two models on the same examples: paired bootstrap CIs of per-example differences.

Accuracy moves in steps of 1/n and hides how much more likely the right answer became, so the
study compares continuous per-example quantities of the gold answer, paired by (task, doc_id).
Like the study (Table 7) every one is computed from length-normalised scores
s_i = log p(choice i) / len(choice i in characters), lm-eval's acc_norm score, so that long
choices are not penalised for their length (the choice is doc_to_choice's text, without the
delimiting space; for WinoGrande the option-filled context: downstream.choices):

    gold NLL / char   −s_gold (lower is better)
    margin / char     s_gold − max over distractors of s_i
    p(gold)           softmax(s)_gold, over the choices

and reports B − A with a 95% percentile CI from 10,000 resamples of the paired examples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megaloop.evaluation.downstream import accuracies, choices, normalised, read_samples
from megaloop.evaluation.exported import EvalError
from megaloop.evaluation.settings import RESAMPLES

METRICS = {"gold NLL / char": "lower", "margin / char": "higher", "p(gold)": "higher"}


def per_example(sample: dict) -> dict[str, float]:
    lls, texts, gold = choices(sample)
    s = normalised(lls, texts)
    others = np.delete(s, gold)
    p = np.exp(s - s.max())
    return {
        "gold NLL / char": float(-s[gold]),
        "margin / char": float(s[gold] - others.max()) if others.size else 0.0,
        "p(gold)": float(p[gold] / p.sum()),
    }


def paired_bootstrap(
    diffs: np.ndarray, resamples: int = RESAMPLES, seed: int = 0, chunk: int = 500
) -> tuple[float, float, float]:
    """Mean of `diffs` and the 2.5/97.5 percentiles of its mean over resamples of the pairs."""
    rng = np.random.default_rng(seed)
    n, means = len(diffs), []
    for start in range(0, resamples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, resamples - start), n))
        means.append(diffs[idx].mean(axis=1))
    low, high = np.percentile(np.concatenate(means), [2.5, 97.5])
    return float(diffs.mean()), float(low), float(high)


def compare(a: Path, b: Path, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    samples_a, samples_b = read_samples(a), read_samples(b)
    tasks = sorted(set(samples_a) & set(samples_b))
    if not tasks:
        raise EvalError(f"{a} and {b} have no task in common")
    rows = {m: ([], []) for m in METRICS}
    for task in tasks:
        by_doc = {s["doc_id"]: s for s in samples_b[task]}
        for s in samples_a[task]:
            if s["doc_id"] not in by_doc:
                continue
            for side, values in enumerate((per_example(s), per_example(by_doc[s["doc_id"]]))):
                for m, v in values.items():
                    rows[m][side].append(v)
    n = len(rows["gold NLL / char"][0])
    if n == 0:
        raise EvalError(f"{a} and {b} share no (task, doc_id) pairs")
    result = {"tasks": tasks, "pairs": n, "resamples": resamples, "seed": seed, "metrics": {}}
    for m, (va, vb) in rows.items():
        va, vb = np.array(va), np.array(vb)
        delta, low, high = paired_bootstrap(vb - va, resamples, seed)
        result["metrics"][m] = {
            "a": float(va.mean()),
            "b": float(vb.mean()),
            "delta": delta,
            "ci95": [low, high],
            "better": METRICS[m],
        }
    result["macro_acc"] = {
        side: float(np.mean([accuracies(samples[t])["acc"] for t in tasks]))
        for side, samples in (("a", samples_a), ("b", samples_b))
    }
    return result


def table(result: dict, a: str = "A", b: str = "B") -> str:
    lines = [
        f"| metric ({result['pairs']} paired examples, {len(result['tasks'])} tasks; "
        f"scores per character) | {a} | {b} | Δ (B − A) | 95% CI |",
        "|---|---|---|---|---|",
    ]
    for m, r in result["metrics"].items():
        arrow = "↓" if r["better"] == "lower" else "↑"
        lines.append(
            f"| {m} {arrow} | {r['a']:.4f} | {r['b']:.4f} | {r['delta']:+.4f} | "
            f"[{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}] |"
        )
    lines.append(
        f"| macro accuracy (acc) ↑ | {result['macro_acc']['a']:.4f} | "
        f"{result['macro_acc']['b']:.4f} | "
        f"{result['macro_acc']['b'] - result['macro_acc']['a']:+.4f} | |"
    )
    return "\n".join(lines)
