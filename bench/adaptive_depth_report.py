"""docs/adaptive_depth/README.md and its frontier figures, from adaptive_depth.json alone (so
that `python -m bench adaptive_depth --report` rewrites them): the verdict per batch size, why,
the per-token evidence and the frontier tables."""

from __future__ import annotations

from pathlib import Path

from bench.common import report

KINDS = (
    "operand digit",
    "format (+ = newline)",
    "answer, units digit",
    "answer, carry from the next column",
    "answer, carry through a 9-sum column",
)
"""What a target token is: the operand digits (and the next sum's first digit) are random; an
answer digit's carry comes from no column (the units), from the next column alone (its digits do
not sum to 9), or through a column whose digits sum to 9, so from the columns below it too."""
MATCH = 0.005
"""Answer accuracy within which a run counts as matching a fixed K's in the report's why."""


def setting(r: dict) -> tuple:
    return (r["batch_size"], r["exit"], r["threshold"], r["kv"], r["batching"])


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def fixed_rows(info: dict, b: int) -> dict[int, dict]:
    """Fixed K at batch b: per K, its figures over the seeds."""
    rows: dict[int, dict] = {}
    for seed_runs in info["runs"].values():
        for r in seed_runs:
            if r["batch_size"] == b and r["exit"] == "fixed":
                row = rows.setdefault(
                    r["loops"],
                    {"tokens_per_s": [], "answer_accuracy": [], "answer_ce": [], "ce": []},
                )
                for key in row:
                    row[key].append(r[key])
    return dict(sorted(rows.items()))


def spread_of(values: list[float], fmt: str = ".3f") -> str:
    return f"{mean(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def label(v: dict) -> str:
    return f"{v['exit']} {v['threshold']:g} {v['kv']} {v['batching']}"


def result_lines(info: dict) -> list[str]:
    """Per batch size, whether an exit setting beat fixed depth and by how much, or how close
    the best one came."""
    lines = []
    for b in sorted({v["batch_size"] for v in info["verdicts"]}):
        rows = [v for v in info["verdicts"] if v["batch_size"] == b]
        winners = [v for v in rows if v["beats_fixed_depth"]]
        best_k = max(fixed_rows(info, b).items(), key=lambda kv: mean(kv[1]["answer_accuracy"]))
        if winners:
            best = max(
                winners,
                key=lambda v: (
                    mean(v["speedup_at_accuracy"])
                    if v["by_speed"]
                    else 1 + mean(v["accuracy_gain_at_speed"])
                ),
            )
            how = (
                f"{mean(best['speedup_at_accuracy']):.2f}x the tokens/s of the fastest fixed "
                f"K at least as accurate (K={best['fixed_k_at_accuracy']})"
                if best["by_speed"]
                else f"{mean(best['accuracy_gain_at_speed']):+.3f} answer accuracy over the best "
                f"fixed K at least as fast (K={best['fixed_k_at_speed']})"
            )
            lines.append(
                f"- **Batch {b}: yes, {len(winners)} of {len(rows)} exit settings beat fixed "
                f"depth.** The largest margin: {label(best)} ({mean(best['mean_loops']):.2f} "
                f"loops a token, answer accuracy {mean(best['answer_accuracy']):.3f}) runs "
                f"{how}."
            )
            continue
        undominated = [v for v in rows if v["undominated"]]
        lines.append(
            f"- **Batch {b}: no exit setting beats fixed depth.** "
            + (
                f"{len(undominated)} of {len(rows)} lie off the fixed-K frontier in every "
                "seed, none by more than the seeds' or the repeats' spread."
                if undominated
                else f"Each of the {len(rows)} is matched, in some seed, by a fixed K at least "
                "as fast and as accurate on the answers."
            )
            + f" The most accurate fixed K is K={best_k[0]} (answer accuracy "
            f"{mean(best_k[1]['answer_accuracy']):.3f}, {mean(best_k[1]['tokens_per_s']):,.0f} "
            "tokens/s)."
        )
    return lines


def why_lines(info: dict) -> list[str]:
    """Per batch size, where the loops a rule saves go: the exact policy's (recompute) run that
    matches the most accurate fixed K in the fewest loops, its loop applications and its wall
    time against the fixed-K cost fit; and what copy and share cost in accuracy."""
    import numpy as np

    lines = []
    for b in sorted({v["batch_size"] for v in info["verdicts"]}):
        fixed = fixed_rows(info, b)
        k, top = max(fixed.items(), key=lambda kv: mean(kv[1]["answer_accuracy"]))
        slope, intercept = np.polyfit(
            list(fixed), [1 / mean(r["tokens_per_s"]) for r in fixed.values()], 1
        )
        rows = [v for v in info["verdicts"] if v["batch_size"] == b]
        exact = [
            v
            for v in rows
            if v["kv"] == "recompute"
            and mean(v["answer_accuracy"]) >= mean(top["answer_accuracy"]) - MATCH
        ]
        if exact:
            v = min(exact, key=lambda v: mean(v["mean_loops"]))
            key = (b, v["exit"], v["threshold"], v["kv"], v["batching"])
            runs = [r for seed in info["runs"].values() for r in seed if setting(r) == key]
            decoded = info["seq_len"] - info["prompt_tokens"]
            prefill = info["prompt_tokens"] * max(fixed) * b
            applied = mean([(r["loop_applications"] - prefill) / (b * decoded) for r in runs])
            lines.append(
                f"- Batch {b}: {label(v)} matches fixed K={k}'s answer accuracy (within "
                f"{MATCH}) at {mean(v['mean_loops']):.2f} exit loops a token; with the earlier "
                f"tokens' resumed loops it applies the stack {applied:.2f} times a decoded "
                f"token, against {k}. A fit of the fixed-K runs' cost, t(K) = f + c·K, "
                f"predicts {(intercept + slope * k) / (intercept + slope * applied):.2f}x fixed "
                f"K={k}'s tokens/s for that "
                f"work; it decodes at {mean(v['tokens_per_s']) / mean(top['tokens_per_s']):.2f}x. "
                + (
                    "The exiting path's own cost per loop (the exit rule, the cache's per-row "
                    "bookkeeping) outweighs a loop of this one-layer d=128 stack."
                    if "stack" not in info
                    else "The rest is the exiting path's own cost (the exit rule, the cache's "
                    f"bookkeeping, the catch-up rows) beside a loop of this {info['stack']} "
                    "stack: the profile in the top README measures it a loop."
                )
            )
        saving = [v for v in rows if v["kv"] != "recompute" and mean(v["mean_loops"]) <= k - 1]
        if saving and k > 1:
            v = max(saving, key=lambda v: mean(v["answer_accuracy"]))
            kept = mean(v["answer_accuracy"]) >= mean(fixed[k - 1]["answer_accuracy"]) - MATCH
            lines.append(
                f"- Batch {b}: under `copy` and `share`, "
                + ("a" if kept else "no")
                + " setting that saves a loop a token keeps the answers: the most accurate, "
                f"{label(v)} at {mean(v['mean_loops']):.2f} loops, reaches "
                f"{mean(v['answer_accuracy']):.3f}, against fixed K={k - 1}'s "
                f"{mean(fixed[k - 1]['answer_accuracy']):.3f} at "
                f"{mean(v['tokens_per_s']) / mean(fixed[k - 1]['tokens_per_s']):.2f}x its "
                "tokens/s. The per-kind table below shows "
                + (
                    "each kind's accuracy through the cache."
                    if kept
                    else "where: the answers, whose deeper loops read the exited tokens' keys "
                    "and values."
                )
            )
    return lines


def exit_table(per_kind: dict, kinds: list[str], section: str, first: str, intro: str) -> list:
    """A table of each run of `section` (a row) by token kind: mean exit loop (accuracy), the
    mean over seeds."""
    lines = ["", intro, "", f"| {first} | " + " | ".join(kinds) + " |"]
    lines.append("|---|" + "---|" * len(kinds))
    for run in per_kind[kinds[0]][0][section]:
        cells = [
            f"{mean([e[section][run]['mean_exit_loop'] for e in per_kind[k]]):.2f} "
            f"({mean([e[section][run]['accuracy'] for e in per_kind[k]]):.3f})"
            for k in kinds
        ]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    return lines


def write_report(info: dict, out: Path) -> None:
    """OUT/README.md: the result per model first, what exit-aware training changes, the exit
    path's profile and its measured against predicted speed-up; each benchmarked model's own
    report in OUT/MODEL/. A report of one model (the runs before issue 57) as it was."""
    if "variants" not in info:
        return model_report(info, out)
    lines = ["# Adaptive depth against fixed depth: 4-digit addition", ""]
    if info["smoke"]:
        lines += ["**SMOKE run: a toy size, its numbers mean nothing.**", ""]
    benched = [name for name, v in info["variants"].items() if "verdicts" in v]
    lines += ["## Result", ""]
    for name in benched:
        sub = variant_info(info, name)
        lines += [f"**{sub['title']}** ([{name}/]({name}/README.md)):", "", *result_lines(sub), ""]
    lines += [f"The rule, fixed before the run: {info['verdict_rule']}", ""]
    lines += comparison_lines(info) + profile_lines(info, benched) + ratio_lines(info, benched)
    reference = [name for name in info["variants"] if name not in benched]
    for name in reference:
        sub = variant_info(info, name)
        lines += [f"## {sub['title']}: the reference model's evidence", ""]
        lines += [line.replace("## ", "### ", 1) for line in evidence_lines(sub)] + [""]
    lines += [
        "Training, minutes per seed (stage 1, stage 2; one thread each, two runs at a time): "
        + "; ".join(f"{n}: {v['train_minutes']}" for n, v in info["variants"].items())
        + f". Then the evidence, the benchmark and the profile: {info['minutes']}.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))
    for stale in out.glob("frontier_b*.png"):  # a one-model report's, now each model's folder's
        stale.unlink()
    for name in benched:
        (out / name).mkdir(exist_ok=True)
        model_report(variant_info(info, name), out / name)


def variant_info(info: dict, name: str) -> dict:
    """One model's figures with the run's shared ones, as a report of one model reads them."""
    shared = {k: v for k, v in info.items() if k != "variants"}
    v = info["variants"][name]
    given = dict(o.split("=", 1) for o in v["overrides"])
    layers = given.get("model.num_layers", "1")
    exit_aware = given.get("objective.exit_kv", "none") != "none"
    return shared | v | {"stack": f"{layers}-layer d=128", "exit_aware": exit_aware}


def model_report(info: dict, out: Path) -> None:
    """OUT/README.md of one model: the verdict first, then the per-token evidence and the
    frontier tables."""
    sizes = sorted({v["batch_size"] for v in info["verdicts"]})
    title = info.get("title", "one layer a loop")
    lines = [f"# Adaptive depth against fixed depth: 4-digit addition, {title}", ""]
    if info["smoke"]:
        lines += ["**SMOKE run: a toy size, its numbers mean nothing.**", ""]
    lines += [
        "## Result",
        "",
        *result_lines(info),
        "",
        f"The rule, fixed before the run: {info['verdict_rule']}",
        "",
        "Why, in the runs below:",
        "",
        *why_lines(info),
        "",
        *evidence_lines(info),
    ]
    for b in sizes:
        lines += batch_lines(info, b)
    episodes = ", ".join(f"{n} at batch {b}" for b, n in info["episodes"].items())
    lines += [
        "",
        "Each cell: the mean over the seeds [lowest, highest]. `megaloop bench "
        f"generate` decodes the same sums in every run ({episodes}), each "
        f"row's tokens after its {info['prompt_tokens']}-token prompt (prefilled at full "
        "depth), teacher-forced, one thread pinned to one core; tokens/s is the fastest "
        "of its repeats. Off the frontier: in every seed, no fixed K is both as fast and "
        f"as accurate. Training, minutes per seed (stage 1, stage 2; one thread each, two seeds "
        f"at a time): {info['train_minutes']}; then the evidence and the benchmark: "
        f"{info['minutes']}.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))
    for b in sizes:
        plot(info, b, out / f"frontier_b{b}.png")


def evidence_lines(info: dict) -> list[str]:
    """Each loop's CE and accuracy by token kind, then where each rule stops each kind."""
    lines = [
        "## Per-token evidence: which tokens need their loops",
        "",
        f"Each loop's readout on {info['evidence_windows']:,} validation sums, mean over "
        f"{len(info['seeds'])} seeds, by what the next token is. The gate's column is the mean "
        "loop of its exit distribution after stage 2.",
        "",
        "| next token | tokens | "
        + " | ".join(f"CE loop {k}" for k in range(1, 5))
        + " | "
        + " | ".join(f"acc. loop {k}" for k in range(1, 5))
        + " | gate's mean exit loop |",
        "|---|---|" + "---|" * 9,
    ]
    per_kind = {kind: [e[kind] for e in info["evidence"].values() if kind in e] for kind in KINDS}
    for kind, per_seed in per_kind.items():
        if not per_seed:
            continue
        loops = range(len(per_seed[0]["ce"]))
        lines.append(
            f"| {kind} | {per_seed[0]['tokens']:,} | "
            + " | ".join(f"{mean([e['ce'][k] for e in per_seed]):.3f}" for k in loops)
            + " | "
            + " | ".join(f"{mean([e['accuracy'][k] for e in per_seed]):.3f}" for k in loops)
            + f" | {mean([e['gate_mean_exit_loop'] for e in per_seed]):.2f} |"
        )
    kinds = [k for k, v in per_kind.items() if v]
    lines += exit_table(
        per_kind,
        kinds,
        "rules",
        "rule",
        "Where each rule stops each kind of token: its mean exit loop (and accuracy) over the "
        "same sums, read by the no-cache reference of early exit (every earlier token at full "
        "depth).",
    )
    return lines + exit_table(
        per_kind,
        [k for k in kinds if "cached" in per_kind[k][0]],
        "cached",
        "rule, policy",
        "The same through the cache (teacher-forced, sync, the tokens after the prompt): each "
        "policy at one threshold per rule, mean exit loop (and accuracy). Under `copy` a later "
        "token's deeper loops read an exited token's keys and values of its exit loop, and "
        "under `share` every loop reads each earlier token's last computed loop: "
        + (
            "`copy`'s are what this model's training forward gave it (exit-aware training), "
            "`share`'s are not. "
            if info.get("exit_aware")
            else "states this model never attended to in training. "
        )
        + "`recompute` runs the exited tokens' missing "
        "loops instead, so it decodes as the no-cache reference above.",
    )


def batch_lines(info: dict, b: int) -> list[str]:
    """The frontier at batch b: its figure, then fixed K and every exit setting, a row each."""
    lines = [
        "",
        f"## Batch {b}",
        "",
        f"![frontier at batch {b}](frontier_b{b}.png)",
        "",
        "| run | mean loops | tokens/s | answer accuracy | answer CE | CE "
        "| off the frontier | beats fixed depth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, row in fixed_rows(info, b).items():
        lines.append(
            f"| fixed K={k} | {k} | {spread_of(row['tokens_per_s'], ',.0f')} "
            f"| {spread_of(row['answer_accuracy'])} | {spread_of(row['answer_ce'])} "
            f"| {spread_of(row['ce'])} | | |"
        )
    for v in (v for v in info["verdicts"] if v["batch_size"] == b):
        lines.append(
            f"| {label(v)} | {mean(v['mean_loops']):.2f} "
            f"| {spread_of(v['tokens_per_s'], ',.0f')} | {spread_of(v['answer_accuracy'])} "
            f"| {spread_of(v['answer_ce'])} | {spread_of(v['ce'])} "
            f"| {'yes' if v['undominated'] else 'no'} "
            f"| {'**yes**' if v['beats_fixed_depth'] else 'no'} |"
        )
    return lines


def plot(info: dict, b: int, path: Path) -> None:
    """Answer accuracy against tokens/s at batch b, means over seeds: fixed K as a line, each
    rule x policy x batching over its thresholds; filled where the setting beats fixed depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megaloop.evaluation.generate_bench import COLOURS, MARKERS

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    fixed = fixed_rows(info, b)
    ax.plot(
        [mean(r["tokens_per_s"]) for r in fixed.values()],
        [mean(r["answer_accuracy"]) for r in fixed.values()],
        "k.-",
        label="fixed K",
    )
    for k, r in fixed.items():
        ax.annotate(f"K={k}", (mean(r["tokens_per_s"]), mean(r["answer_accuracy"])), fontsize=8)
    groups: dict[tuple, list[dict]] = {}
    for v in info["verdicts"]:
        if v["batch_size"] == b:
            groups.setdefault((v["exit"], v["kv"], v["batching"]), []).append(v)
    for (rule, kv, batching), vs in sorted(groups.items()):
        vs.sort(key=lambda v: v["threshold"])
        x = [mean(v["tokens_per_s"]) for v in vs]
        y = [mean(v["answer_accuracy"]) for v in vs]
        ax.plot(
            x,
            y,
            color=COLOURS.get(kv),
            linestyle="--" if batching == "async" else "-",
            linewidth=0.6,
            label=f"{rule} {kv} {batching}",
            marker=MARKERS.get(rule, "o"),
            markerfacecolor="none",
        )
        for v, xi, yi in zip(vs, x, y):
            if v["beats_fixed_depth"]:
                ax.plot(xi, yi, marker=MARKERS.get(rule, "o"), color=COLOURS.get(kv))
    ax.set_xlabel("tokens/s")
    ax.set_ylabel("answer accuracy")
    ax.set_title(
        f"batch {b}: means of {len(info['seeds'])} seeds (filled: beats fixed depth)", fontsize=9
    )
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def comparison_lines(info: dict) -> list[str]:
    """Per token kind, accuracy through the cache of the model trained at full depth against
    the same stack trained exit-aware, each policy at one threshold per rule."""
    subs = [variant_info(info, name) for name in info["variants"]]
    lines = []
    for ref in (s for s in subs if not s["exit_aware"]):
        for sub in (s for s in subs if s["exit_aware"] and s["stack"] == ref["stack"]):
            seeds = [*ref["evidence"].values(), *sub["evidence"].values()]
            kinds = [k for k in KINDS if all("cached" in e.get(k, {}) for e in seeds)]
            runs = list(seeds[0][kinds[0]]["cached"]) if kinds else []
            lines += [
                f"## What exit-aware training changes: {ref['title']} against {sub['title']}",
                "",
                "Answer accuracy through the cache (teacher-forced, sync) by what the next token "
                "is, mean over the seeds: trained at full depth → trained exit-aware (mean exit "
                "loop in brackets, the same order).",
                "",
                *report.table(
                    ["rule, policy", *kinds],
                    [[run, *(transition(ref, sub, kind, run) for kind in kinds)] for run in runs],
                ),
                "",
            ]
    return lines


def transition(ref: dict, sub: dict, kind: str, run: str) -> str:
    def of(info: dict, key: str) -> float:
        return mean([e[kind]["cached"][run][key] for e in info["evidence"].values()])

    return (
        f"{of(ref, 'accuracy'):.3f} → {of(sub, 'accuracy'):.3f} "
        f"({of(ref, 'mean_exit_loop'):.2f} → {of(sub, 'mean_exit_loop'):.2f})"
    )


def profile_lines(info: dict, benched: list[str]) -> list[str]:
    """Where a decoded token's time goes (seed 0 of each benchmarked model): fixed K's fit
    t(K) = f + c·K, and the exiting path at a threshold no token reaches (K loops as well),
    its excess over fixed K a loop against c."""
    rows = []
    for name in benched:
        for b, p in info["variants"][name]["profile"].items():
            f, c = p["fixed_s_per_token"], p["loop_s_per_token"]
            K = sum(n.startswith("fixed") for n in p["s_per_token"])
            fixed = p["s_per_token"][f"fixed K={K}"]
            rows.append([name, b, f"fixed K={K}", f"{fixed * 1e3:.3f}", f"{f * 1e3:.3f}"])
            rows[-1] += [f"{c * 1e3:.3f}", "", ""]
            for run, extra in p["exit_path_s_per_loop"].items():
                ms = p["s_per_token"][run] * 1e3
                rows.append([name, b, run, f"{ms:.3f}", "", "", f"{extra * 1e3:.3f}"])
                rows[-1].append(f"{extra / c:.2f}")
    if not rows:
        return []
    return [
        "## Where a decoded token's time goes",
        "",
        "Seed 0 of each model, one thread, the fastest of its repeats: fixed K's cost per "
        "decoded token and its fit t(K) = f + c·K (f the embedding, readout and cache, c a "
        "loop), and the exiting path under each policy and batching at a threshold no token "
        "reaches, so that it runs the K loops too: its excess over fixed K, a loop, is what "
        "the exit path itself costs (the rule's λ, the masks, the cache's bookkeeping).",
        "",
        *report.table(
            ["model", "batch", "run", "ms a token", "f, ms", "c, ms a loop"]
            + ["exit path, ms a loop", "÷ c"],
            rows,
        ),
        "",
    ]


def ratio_lines(info: dict, benched: list[str]) -> list[str]:
    """Per model, batch size, policy and batching: the exiting runs' measured ÷ predicted
    speed-up (the prediction: the stack applications each made, at fixed K's price)."""
    rows = []
    for name in benched:
        groups: dict[tuple, list[float]] = {}
        for seed_runs in info["variants"][name]["runs"].values():
            for r in seed_runs:
                if r["exit"] != "fixed":
                    key = (r["batch_size"], r["kv"], r["batching"])
                    groups.setdefault(key, []).append(r["ratio"])
        for (b, kv, batching), ratios in sorted(groups.items()):
            middle = sorted(ratios)[len(ratios) // 2]
            rows.append([name, str(b), kv, batching, f"{middle:.2f}"])
            rows[-1] += [f"{min(ratios):.2f}", f"{max(ratios):.2f}", str(len(ratios))]
    if not rows:
        return []
    return [
        "## Measured against predicted",
        "",
        "Each exiting run's speed-up over fixed K_max, measured ÷ predicted from the stack "
        "applications it made at fixed K's price (`bench generate`): 1 is an exit path that "
        "costs nothing beyond its loops.",
        "",
        *report.table(
            ["model", "batch", "policy", "batching", "median", "lowest", "highest", "runs"], rows
        ),
        "",
    ]
