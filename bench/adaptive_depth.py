"""Adaptive depth against fixed depth on a task where depth matters (bench/adaptive_depth).

    bench/adaptive_depth               every model of VARIANTS, 3 seeds each: train (two stages),
                                       export, per-token CE by loop, `bench generate` at batch 1
                                       and 8, the exit path's profile; rewrites docs/adaptive_depth/
                                       (README.md, adaptive_depth.json, a folder per model)
    bench/adaptive_depth --smoke --out OUT
                                       the same flow at a toy size, into OUT
    bench/adaptive_depth --report [--out OUT]
                                       rewrites OUT's READMEs and PNGs from its JSON

1. The task: the built-in `addition` corpus at 4 digits (megaloop/data/synthetic.py), one sum a
   window: `0473+0968=01441` and a newline. An answer digit needs its column's carry, which the
   next column decides unless its digits sum to 9 (then the carry runs on through the columns
   below); the operand digits are random, so no loop helps them, and the format is fixed.
2. The models (VARIANTS), each in two stages per seed (configs/experiments/adaptive_depth/, the
   variant's overrides on both): stage 1 the exit-weighted objective with an entropy bonus, stage
   2 the exit gate alone trained on whether the next loop still lowers a token's CE (Ouro's two
   stages); then `megaloop export`. One layer a loop trained as before (the reference for what
   exit-aware training changes: evidence only), the same with exit-aware training under `copy`
   (objective.exit_kv, sampled_exits.py), and four layers a loop with it.
3. Per-token evidence: each loop's CE and accuracy on validation windows, by what the next token
   is (KINDS), and where each exit rule stops each kind (the no-cache reference of early exit),
   and through the cache under each KV policy.
4. The frontier: `megaloop bench generate --task addition` on each seed's export, one thread
   pinned to one core: every fixed K from 1 to 4 and every exit rule (the learned gate, the top-1
   margin, the top-1 probability) over its thresholds, under every KV policy (`copy`, `share`,
   `recompute`), sync and async, over EPISODES[b] windows at batch size b.
5. The profile (seed 0 of each benchmarked model): fixed K against the exiting path at a
   threshold no token reaches, under every policy and batching, so both run K loops and the
   difference is what the exit path itself costs a loop.
6. The verdict (VERDICT below, fixed before the run), per model.

Environment: ADAPTIVE_WORK, the scratch folder (default runs/adaptive_depth, or
runs/adaptive_depth_smoke under --smoke; finished runs are kept, and a stopped run resumes from
its last checkpoint, so a rerun resumes); PYTHON, the interpreter with megaloop installed
(default: this one).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.adaptive_depth_report import KINDS, result_lines, setting, variant_info, write_report
from bench.common import ROOT, SMOKE, report, workers
from megaloop.model.modes import EXIT_RULES, KV_POLICIES, asynchronous_policies

CONFIGS = ROOT / "configs/experiments/adaptive_depth"
SEEDS = (0, 1) if SMOKE else (0, 1, 2)
"""Under --smoke two, one round of the two worker lanes (a spread over seeds needs two)."""
TASK, DIGITS, SEQ_LEN, PROMPT = "addition", 4, 16, 6
"""One sum a window (16 tokens and the next sum's first digit as the last target); the first 6
tokens, the first operand and '+', are the prompt, prefilled at full depth."""
STEPS = (4, 2) if SMOKE else (3000, 400)
"""Stage 1 and stage 2 optimizer steps of a one-layer model."""
DEEP_STEPS = (4, 2) if SMOKE else (2000, 400)
"""Of the four-layer model (our choice: a step costs about three of the one-layer model's, and
the bench must end within 3 hours on 2 cores)."""
SMOKE_MODEL = [
    "model.hidden_size=32",
    "model.num_heads=2",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "train.log_every=2",
    "train.eval_batches=2",
]
SAVE_EVERY = 500
"""A stopped bench's training resumes from its last checkpoint (megaloop train resumes)."""


@dataclass(frozen=True)
class Variant:
    """A model the bench trains: its title, its overrides of both stages' configs, its steps,
    and whether `bench generate` and the profile run on it (else the evidence only)."""

    title: str
    overrides: tuple[str, ...]
    steps: tuple[int, int]
    bench: bool


EXITS = ("objective.exit_kv=copy", "objective.exit_rate=0.5")
"""Exit-aware training under `copy` (our choice of rate: half the tokens exit early, each at a
loop uniform in 1..K−1); stage 2 trains the gate under the same sampled exits."""
VARIANTS = {
    "one_layer": Variant("one layer a loop, trained at full depth", (), STEPS, bench=False),
    "one_layer_exits": Variant("one layer a loop, exit-aware training", EXITS, STEPS, bench=True),
    "four_layers_exits": Variant(
        "four layers a loop, exit-aware training",
        # our choice: in probes on these sums, stage 1's 3e-3 held a four-layer loop at CE 1.77
        # for 250 steps; at 1e-3 it fell to 1.62, with sampled exits or without
        (*EXITS, "model.num_layers=4", "optim.lr=1.0e-3", "optim.min_lr=1.0e-4"),
        DEEP_STEPS,
        bench=True,
    ),
}
"""The models, in the report's order; they train in the reverse one (the longest first, so the
two lanes end together)."""
EPISODES = {1: 4, 8: 16} if SMOKE else {1: 128, 8: 256}
"""Windows `bench generate` decodes per run at each batch size (batch size x --batches)."""
EVIDENCE = 32 if SMOKE else 1024
"""Validation windows the per-token evidence reads."""
THRESHOLDS = {rule: spec.thresholds for rule, spec in EXIT_RULES.items()}
"""bench generate's defaults (modes.EXIT_RULES), named here for the evidence."""
CACHED = {"gate": 0.5, "margin": 2.0, "confidence": 0.9}
"""The threshold per rule at which the evidence also decodes through the cache, per KV policy."""
BENCH = [
    "--kv",
    ",".join(KV_POLICIES),
    "--batching",
    "sync,async",
    "--repeats",
    "1" if SMOKE else "3",
    *(["--threshold", "0.5,0.9"] if SMOKE else []),
]
"""Under --smoke two thresholds, valid for every rule, rather than each rule's four: the flow, at
half the decoding."""
VERDICT = (
    "An exit setting (rule, threshold, KV policy, batching) beats fixed depth at a batch size "
    "if, in every seed, no fixed K is both as fast and as accurate on the answers, and either "
    "(a) its answer accuracy exceeds that of the most accurate fixed K at least as fast by more "
    "than that K's range over the seeds, or (b) its tokens/s exceed those of the fastest fixed K "
    "at least as accurate by more than the larger of the two runs' repeat spreads, in every seed."
)


def run_dir(work: Path, variant: str, seed: int, stage: int) -> Path:
    return work / variant / f"seed{seed}" / f"stage{stage}"


def checkpoint(work: Path, variant: str, seed: int, stage: int) -> Path:
    steps = VARIANTS[variant].steps[stage - 1]
    return run_dir(work, variant, seed, stage) / "checkpoints" / f"step_{steps:07d}"


def export_dir(work: Path, variant: str, seed: int) -> Path:
    return work / variant / f"seed{seed}" / "hf"


def train(work: Path) -> None:
    """Both stages of every model and seed not trained yet, and their exports, two at a time."""
    from megaloop.train.metrics import finished

    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def one(job: tuple[str, int]) -> None:
        variant, seed = job
        v = VARIANTS[variant]
        for stage, steps in zip((1, 2), v.steps):
            folder = run_dir(work, variant, seed, stage)
            if finished(folder, steps):
                continue
            start = [f"train.init_from={checkpoint(work, variant, seed, 1)}"] if stage == 2 else []
            argv = [
                "train",
                CONFIGS / f"stage{stage}.yaml",
                *(SMOKE_MODEL if SMOKE else []),
                *v.overrides,
                *start,
                f"train.steps={steps}",
                f"train.save_every={min(steps, SAVE_EVERY)}",
                f"train.seed={seed}",
                f"train.dir={folder}",
            ]
            began = time.time()
            log = logs / f"{variant}-seed{seed}-stage{stage}.log"
            if workers.megaloop(argv, log) != 0:
                sys.exit(f"adaptive_depth: {variant} seed {seed} stage {stage} failed; see {log}")
            print(f"trained {variant} seed {seed} stage {stage} in {time.time() - began:.0f} s")
        export = export_dir(work, variant, seed)
        if not exported(export):
            shutil.rmtree(export, ignore_errors=True)
            argv = ["export", run_dir(work, variant, seed, 2), "--out", export]
            if workers.megaloop(argv, logs / f"{variant}-seed{seed}-export.log") != 0:
                sys.exit(f"adaptive_depth: exporting {variant} seed {seed} failed; see {logs}")

    workers.each(one, [(variant, seed) for variant in reversed(VARIANTS) for seed in SEEDS])


def exported(export: Path) -> bool:
    """Whether `export` is a finished export of this megaloop's code (a bench resumed after a
    code change exports again, rather than stopping at the evidence on the stale code)."""
    from megaloop.export import code_problem

    config = export / "config.json"
    return config.is_file() and code_problem(export, json.loads(config.read_text())) is None


def train_minutes(work: Path, variant: str) -> dict[str, list[float]]:
    """Each seed's two stages' training minutes, read from the runs' logs (the last `elapsed`
    each printed), so that a resumed bench still reports what training took (its last part)."""
    minutes = {}
    for seed in SEEDS:
        for stage in (1, 2):
            log = (work / "logs" / f"{variant}-seed{seed}-stage{stage}.log").read_text()
            h, m, s = re.findall(r"elapsed (\d+):(\d\d):(\d\d)", log)[-1]
            minutes.setdefault(str(seed), []).append(round(int(h) * 60 + int(m) + int(s) / 60, 1))
    return minutes


def validation_text(work: Path) -> Path:
    """The validation stream's first sums as one text, window i (SEQ_LEN + 1 tokens from
    i x SEQ_LEN) holding sum i and sum i+1's first digit, as training windows do."""
    from megaloop.data import synthetic

    path = work / "valid.txt"
    count = max(EVIDENCE, *EPISODES.values()) + 1
    sums = [synthetic.sample(TASK, 0, i, SEQ_LEN, DIGITS, "valid") for i in range(count)]
    text = b"".join(s.astype("uint8").tobytes() for s in sums)
    assert text.count(b"\n") == count, "a sum is not SEQ_LEN characters"
    path.write_bytes(text)
    return path


def kind_of(windows):
    """Per target token of one-sum windows [N, SEQ_LEN + 1] → [N, SEQ_LEN], its index in KINDS."""
    import numpy as np

    digits = windows.astype(np.int64) - ord("0")
    a, b = digits[:, :DIGITS], digits[:, DIGITS + 1 : 2 * DIGITS + 1]
    kinds = np.zeros((len(windows), SEQ_LEN), dtype=np.int64)  # target t sits at column t - 1
    for t in (DIGITS, 2 * DIGITS + 1, SEQ_LEN - 1):  # '+', '=', the newline
        kinds[:, t - 1] = 1
    first = 2 * DIGITS + 2  # the answer's leading digit, the carry out of column 0
    kinds[:, first + DIGITS - 1] = 2  # the units digit: no carry in
    for j in range(DIGITS):  # answer digit j's carry comes out of column j
        kinds[:, first + j - 1] = np.where(a[:, j] + b[:, j] == 9, 4, 3)
    return kinds


def evidence(export: str, valid: str) -> dict:
    """Per kind: each loop's CE and accuracy, the mean loop of the gate's exit distribution, each
    rule's mean exit loop and accuracy at each threshold (the no-cache reference), and at CACHED's
    threshold through the cache under each KV policy (the decoded tokens; a worker runs it)."""
    import numpy as np
    import torch

    from megaloop.evaluation import harness
    from megaloop.evaluation.generate_bench import configured, decode_batch
    from megaloop.model import semantics

    opened = harness.open_model(Path(export))
    model = opened.model
    windows = harness.windows(opened.encode(Path(valid).read_text()), SEQ_LEN, EVIDENCE)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    kinds = torch.from_numpy(kind_of(windows.numpy()))
    ce, right, gates = [], [], []
    with torch.no_grad():
        h0, rope = model.embed(inputs)
        for k, h in model.loops(h0, rope, model.config.num_loops):
            logits = model.readout(h, k, model.config.num_loops)
            ce.append(harness.token_ce(logits, targets))
            right.append((logits.argmax(-1) == targets).float())
            gates.append(model.exit_probability(h)[..., 0])
        exit_at = semantics.exit_probabilities(gates)
        depth = torch.arange(1, len(gates) + 1, dtype=torch.float32)[:, None, None]
        gate_mean = (exit_at * depth).sum(0)
        rules = {}
        for rule, thresholds in THRESHOLDS.items():
            for t in thresholds:
                with configured(model, early_exit=rule, exit_threshold=t):
                    out = model(inputs, use_cache=False)
                rules[f"{rule} {t:g}"] = (
                    out.exit_loops.float(),
                    (out.logits.argmax(-1) == targets).float(),
                )
    cached = {}
    for (rule, t), kv in itertools.product(CACHED.items(), KV_POLICIES):
        spec = {"exit": rule, "threshold": t, "kv": kv, "batching": "sync", "loops": 4}
        loops, hits = [], []
        for rows in windows.split(64):
            _, logits, part = decode_batch(model, rows, PROMPT, spec, lambda: None)
            loops.append(part["exit_loops"].view(len(rows), -1).float())
            hits.append((logits.argmax(-1) == rows[:, PROMPT + 1 :]).float())
        cached[f"{rule} {t:g} {kv}"] = (torch.cat(loops), torch.cat(hits))
    decoded = kinds[:, PROMPT:]
    result = {}
    for i, name in enumerate(KINDS):
        at = kinds == i
        if not bool(at.any()):
            continue
        result[name] = {
            "tokens": int(at.sum()),
            "ce": [c[at].mean().item() for c in ce],
            "accuracy": [r[at].mean().item() for r in right],
            "gate_mean_exit_loop": gate_mean[at].mean().item(),
            "rules": {
                rule: {"mean_exit_loop": loops[at].mean().item(), "accuracy": hit[at].mean().item()}
                for rule, (loops, hit) in rules.items()
            },
        }
        if bool((decoded == i).any()):
            at = decoded == i
            result[name]["cached"] = {
                run: {"mean_exit_loop": loops[at].mean().item(), "accuracy": hit[at].mean().item()}
                for run, (loops, hit) in cached.items()
            }
    assert np.isfinite([v for e in result.values() for v in e["ce"]]).all()
    return result


def pinned(cores: queue.Queue, cmd: list, log: Path) -> int:
    """`cmd` on a core of its own (taken from `cores` and given back), one thread, its output
    into `log`: its exit code."""
    core = cores.get()
    try:
        pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        with open(log, "w") as f:
            return subprocess.run(
                [str(c) for c in [*pin, *cmd]], env=env, stdout=f, stderr=f
            ).returncode
    finally:
        cores.put(core)


def lane_cores() -> queue.Queue:
    cores = queue.Queue()
    for core in range(min(workers.LANES, os.cpu_count() or 1)):
        cores.put(core)
    return cores


def bench(work: Path, variant: str, valid: Path, python: str) -> dict[int, list[dict]]:
    """`megaloop bench generate` on each seed's export of `variant` at each batch size, two at a
    time, each pinned to a core of its own (timings): the seeds' runs."""
    cores = lane_cores()

    def one(job: tuple[int, int]) -> list[dict]:
        seed, b = job
        out = work / variant / f"seed{seed}" / f"generate_b{b}"
        if not (out / "generate.json").is_file():
            cmd = [
                python,
                "-m",
                "megaloop",
                "bench",
                "generate",
                export_dir(work, variant, seed),
                *("--data", valid, "--seq-len", SEQ_LEN, "--prompt-tokens", PROMPT),
                *("--task", TASK, "--batch-size", b, "--batches", EPISODES[b] // b),
                *BENCH,
                "--out",
                out,
            ]
            log = work / "logs" / f"{variant}-seed{seed}-generate_b{b}.log"
            if pinned(cores, cmd, log) != 0:
                sys.exit(
                    f"adaptive_depth: bench generate on {variant} seed {seed} failed; see {log}"
                )
            print(f"benchmarked {variant} seed {seed} at batch {b}", flush=True)
        return json.loads((out / "generate.json").read_text())["runs"]

    jobs = [(seed, b) for seed in SEEDS for b in EPISODES]
    runs = dict.fromkeys(SEEDS, ())
    for (seed, _), got in zip(jobs, workers.each(one, jobs)):
        runs[seed] = [*runs[seed], *got]
    return runs


def spread(r: dict) -> float:
    return max(r["seconds"]) / min(r["seconds"]) - 1


def verdicts(runs: dict[int, list[dict]]) -> list[dict]:
    """Per exit setting, its figures in each seed and whether it beats fixed depth (VERDICT)."""
    by_setting: dict[tuple, dict[int, dict]] = {}
    for seed, seed_runs in runs.items():
        for r in seed_runs:
            by_setting.setdefault(setting(r), {})[seed] = r
    rows = []
    for key, per_seed in by_setting.items():
        b, rule = key[0], key[1]
        if rule == "fixed" or len(per_seed) < len(runs):
            continue
        fixed = {
            seed: {
                r["loops"]: r for r in runs[seed] if r["batch_size"] == b and r["exit"] == "fixed"
            }
            for seed in per_seed
        }
        at_speed = [r["answer_accuracy_fixed_k_at_speed"] for r in per_seed.values()]
        gain = [r["answer_accuracy_gain_at_speed"] for r in per_seed.values()]
        by_accuracy = None not in gain and all(g > 0 for g in gain)
        if by_accuracy:
            range_of = [
                max(f[k]["answer_accuracy"] for f in fixed.values())
                - min(f[k]["answer_accuracy"] for f in fixed.values())
                for k in set(at_speed)
            ]
            by_accuracy = min(gain) > max(range_of)
        by_speed = all(
            r["speedup_at_answer_accuracy"] is not None
            and r["speedup_at_answer_accuracy"] - 1
            > max(spread(r), spread(fixed[seed][r["answer_accuracy_fixed_k_at_quality"]]))
            for seed, r in per_seed.items()
        )
        undominated = not any(r["dominated_answer_accuracy"] for r in per_seed.values())

        rows.append(
            {
                "batch_size": b,
                "exit": rule,
                "threshold": key[2],
                "kv": key[3],
                "batching": key[4],
                **{
                    name: [r[name] for r in per_seed.values()]
                    for name in ("tokens_per_s", "mean_loops", "answer_accuracy", "answer_ce", "ce")
                },
                "accuracy_gain_at_speed": gain,
                "fixed_k_at_speed": at_speed,
                "speedup_at_accuracy": [r["speedup_at_answer_accuracy"] for r in per_seed.values()],
                "fixed_k_at_accuracy": [
                    r["answer_accuracy_fixed_k_at_quality"] for r in per_seed.values()
                ],
                "undominated": undominated,
                "by_accuracy": undominated and by_accuracy,
                "by_speed": undominated and by_speed,
                "beats_fixed_depth": undominated and (by_accuracy or by_speed),
            }
        )
    return rows


NEVER = 1.01
"""A gate threshold no token reaches (the cumulative exit probability is at most 1)."""
PROFILE_REPEATS = 1 if SMOKE else 5


def profile(export: str, valid: str, core: int) -> dict:
    """Per batch size, seconds per decoded token (the fastest of PROFILE_REPEATS, in rounds, one
    thread on `core`): fixed K = 1..K and their fit t(K) = f + c·K, and the exiting path under
    each KV policy and batching at a threshold no token reaches, so that it runs K loops too:
    its excess over fixed K, a loop, is what the exit path itself costs (the rule, the masks,
    the cache's bookkeeping)."""
    import numpy as np
    import torch

    from megaloop.evaluation import harness
    from megaloop.evaluation.generate_bench import decode_batch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    opened = harness.open_model(Path(export))
    model, K = opened.model, opened.model.config.num_loops
    windows = harness.windows(opened.encode(Path(valid).read_text()), SEQ_LEN, max(EPISODES))
    result = {}
    for b in EPISODES:
        fixed = {f"fixed K={k}": {"exit": "fixed", "kv": None, "loops": k} for k in range(1, K + 1)}
        exiting = {
            f"{kv} {batching}": {"exit": "gate", "threshold": NEVER, "kv": kv, "loops": K}
            | {"batching": batching}
            for kv in KV_POLICIES
            for batching in ("sync", "async")
            if batching == "sync" or (b > 1 and kv in asynchronous_policies())
        }
        specs = {
            n: {"threshold": None, "batching": "sync"} | s for n, s in (fixed | exiting).items()
        }
        best = dict.fromkeys(specs, float("inf"))
        for spec in specs.values():  # warm-up
            decode_batch(model, windows[:b], PROMPT, spec, lambda: None)
        for _ in range(PROFILE_REPEATS):
            for name, spec in specs.items():
                seconds = decode_batch(model, windows[:b], PROMPT, spec, lambda: None)[0]
                best[name] = min(best[name], seconds / (b * (SEQ_LEN - PROMPT)))
        c, f = np.polyfit(np.arange(1, K + 1), [best[name] for name in fixed], 1)
        result[str(b)] = {
            "fixed_s_per_token": float(f),
            "loop_s_per_token": float(c),
            "s_per_token": best,
            "exit_path_s_per_loop": {n: (best[n] - best[f"fixed K={K}"]) / K for n in exiting},
        }
    return result


def profiles(work: Path, variants: list[str], valid: Path) -> dict[str, dict]:
    """The profile of each variant's seed 0, two at a time, each on a core of its own."""
    cores = lane_cores()

    def one(variant: str) -> dict:
        path = work / variant / "profile.json"
        if not path.is_file():
            core = cores.get()
            try:
                found = workers.call(profile, str(export_dir(work, variant, 0)), str(valid), core)
            finally:
                cores.put(core)
            path.write_text(json.dumps(found, indent=1))
        return json.loads(path.read_text())

    return dict(zip(variants, workers.each(one, variants)))


def main(argv: list[str], out: Path | None) -> None:
    out = report.command("adaptive_depth", argv, out, (write_report,))
    default = "runs/adaptive_depth_smoke" if SMOKE else "runs/adaptive_depth"
    work = Path(os.environ.get("ADAPTIVE_WORK", ROOT / default)).resolve()
    python = os.environ.get("PYTHON", sys.executable)
    work.mkdir(parents=True, exist_ok=True)
    clock = {"start": time.time()}
    train(work)
    clock["trained"] = time.time()
    valid = validation_text(work)
    jobs = [(variant, seed) for variant in VARIANTS for seed in SEEDS]
    found = workers.each(
        lambda job: workers.call(evidence, str(export_dir(work, *job)), str(valid)), jobs
    )
    clock["measured"] = time.time()
    benched = [name for name, v in VARIANTS.items() if v.bench]
    runs = {variant: bench(work, variant, valid, python) for variant in benched}
    clock["benchmarked"] = time.time()
    profiled = profiles(work, benched, valid)
    clock["profiled"] = time.time()
    info = {
        "smoke": SMOKE,
        "task": TASK,
        "digits": DIGITS,
        "seq_len": SEQ_LEN,
        "prompt_tokens": PROMPT,
        "seeds": list(SEEDS),
        "episodes": {str(b): n for b, n in EPISODES.items()},
        "evidence_windows": EVIDENCE,
        "bench": BENCH,
        "verdict_rule": VERDICT,
        "cpus": os.cpu_count(),
        "minutes": {
            f"{a}_to_{b}": round((clock[b] - clock[a]) / 60, 1)
            for a, b in zip(clock, list(clock)[1:])
        },
        "variants": {
            name: {
                "title": v.title,
                "overrides": list(v.overrides),
                "steps": list(v.steps),
                "train_minutes": train_minutes(work, name),
                "evidence": {
                    str(seed): e for (variant, seed), e in zip(jobs, found) if variant == name
                },
                **(
                    {
                        "runs": {str(seed): r for seed, r in runs[name].items()},
                        "verdicts": verdicts(runs[name]),
                        "profile": profiled[name],
                    }
                    if v.bench
                    else {}
                ),
            }
            for name, v in VARIANTS.items()
        },
    }
    # compact: three models' runs, each repeat's seconds kept, stay under 1 MB
    (out / "adaptive_depth.json").write_text(json.dumps(info, separators=(",", ":")) + "\n")
    write_report(info, out)
    for name in benched:
        print(name, *result_lines(variant_info(info, name)), sep="\n")
    print(f"adaptive_depth: {info['minutes']} minutes; report in {out}")
