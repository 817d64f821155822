"""Calibrated halting and its real speedup (the study's Appendix H).

Any exit rule of modes.EXIT_RULES, by its unit (ExitRuleSpec.halts). Per sequence (`margin`,
the study's): the score at loop k is the mean over the sequence's tokens of theirs (top-1 minus
top-2 logit); a sequence exits at the first k whose score reaches τ, else at K_max. Per token
(`gate`, Ouro's; `confidence`): a token exits at the first k whose score (the cumulative exit
probability 1 − Π_{j≤k}(1 − λ_j); the top-1 probability) reaches the threshold, else at K_max;
its prediction is that loop's.

Calibration (one slice): a single K_max pass caches every loop's per-token CE and the rule's
scores; the threshold is the smallest whose dynamic PPL is within ρ of fixed-K_max PPL on the
same slice. Dynamic CE only changes where the threshold crosses a score, so every candidate
(each distinct score, and "never early") is evaluated exactly, in one sort.

Benchmark (a different slice): batches of the same geometry at fixed K = 1..K_max, and with
dynamic batching: a sequence that halts at loop k leaves the batch before loop k+1 (under the
gate rule, when all its tokens have exited), so later loops run on fewer rows. Throughput is
total tokens over total wall-clock time, the removal of halted rows included.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from megaloop.evaluation import harness, ppl_text
from megaloop.evaluation.settings import HaltSettings, check_gate
from megaloop.model.modes import EXIT_RULES, ExitRuleSpec
from megaloop.model.semantics import Loops, Survival, each_loop, exits


def exit_loops(scores: np.ndarray, threshold: float | None) -> np.ndarray:
    """1-based exit loop of each unit: the first k < K with scores[:, k-1] ≥ threshold, else K.
    `scores` is [units, K-1]; threshold None never exits early."""
    K = scores.shape[1] + 1
    if threshold is None:
        return np.full(len(scores), K)
    hit = scores >= threshold
    return np.where(hit.any(1), hit.argmax(1) + 1, K)


def calibrate(scores: np.ndarray, ce: np.ndarray, tokens: int, rho: float) -> dict:
    """The smallest threshold whose dynamic PPL ≤ ρ · fixed-K_max PPL.

    scores [units, K-1]: the rule's score of each unit at loops 1..K-1; ce [units, K]: each
    unit's summed CE if it exits at loop k; tokens: the tokens all units hold together."""
    K = ce.shape[1]
    fixed = ce[:, -1].sum()
    budget = fixed + tokens * np.log(rho)
    # a unit exits at the first k whose prefix maximum of scores reaches τ: as τ passes
    # M[u, k-1] the unit moves from exit k to exit k+1
    prefix_max = np.maximum.accumulate(scores, axis=1)
    values = prefix_max.ravel()
    deltas = (ce[:, 1:] - ce[:, :-1]).ravel()
    order = np.argsort(values, kind="stable")
    values, cumulative = values[order], np.concatenate([[0.0], np.cumsum(deltas[order])])
    candidates = np.unique(values)
    dynamic = ce[:, 0].sum() + cumulative[np.searchsorted(values, candidates, side="left")]
    meets = np.nonzero(dynamic <= budget)[0]
    threshold = float(candidates[meets[0]]) if len(meets) else None
    exits = exit_loops(scores, threshold)
    dynamic_ce = ce[np.arange(len(ce)), exits - 1].sum() / tokens
    return {
        "threshold": threshold,
        "candidates": len(candidates) + 1,
        "ce_fixed": fixed / tokens,
        "ppl_fixed": harness.ppl(fixed / tokens),
        "ce_dynamic": dynamic_ce,
        "ppl_dynamic": harness.ppl(dynamic_ce),
        "ppl_ratio": harness.ppl(dynamic_ce - fixed / tokens),
        "rho": rho,
        "exit_histogram": np.bincount(exits, minlength=K + 1)[1:].tolist(),
        "mean_exit_loop": float(exits.mean()),
    }


def token_scores(model, rule: ExitRuleSpec, survival: Survival, h, logits) -> torch.Tensor:
    """The rule's score [b, s] of every token of H_k, from its logits (a rule that reads them)
    or its gate (λ in double precision, as survival accumulates it)."""
    lam = model.exit_probability(h).squeeze(-1).double() if rule.needs_gate else None
    return rule.score(survival, lam, logits)


def unit_scores(rule: ExitRuleSpec, scores: torch.Tensor) -> torch.Tensor:
    """A unit's score: per sequence the mean of its tokens' [b, s] → [b]; per token as is."""
    return scores.mean(-1) if rule.halts == "sequence" else scores


def cached_pass(
    model, slice_: torch.Tensor, k_max: int, rule: str, batch_size: int, device: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per-unit scores [units, K-1] and per-unit summed CE [units, K] from one K_max pass
    (units: sequences or tokens, by the rule's ExitRuleSpec.halts)."""
    scores, ce, spec = [], [], EXIT_RULES[rule]
    per_sequence = spec.halts == "sequence"
    with torch.no_grad():
        for batch in harness.batches(slice_, batch_size, "calibration pass"):
            batch = batch.to(device)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            loop_ce, loop_score, survival = [], [], Survival()
            for k, h in harness.trajectory(model, inputs, k_max):
                logits = model.readout(h, k, k_max)
                token_ce = harness.token_ce(logits, targets).double()
                score = unit_scores(spec, token_scores(model, spec, survival, h, logits))
                loop_ce.append(token_ce.sum(1) if per_sequence else token_ce.flatten())
                loop_score.append(score.double().flatten())
            ce.append(torch.stack(loop_ce, 1).cpu().numpy())
            scores.append(
                torch.stack(loop_score[:-1], 1).cpu().numpy()
                if k_max > 1
                else np.zeros((len(loop_ce[0]), 0))
            )
    return np.concatenate(scores), np.concatenate(ce)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fixed_depth(model, batch: torch.Tensor, k: int) -> tuple[float, int]:
    """Summed CE of one batch at fixed depth k, and its loop×token forward steps."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    h = next(h for loop, h in harness.trajectory(model, inputs, k) if loop == k)
    ce = harness.token_ce(model.readout(h, k, k), targets).double().sum().item()
    return ce, k * inputs.numel()


def reaches(score: torch.Tensor, threshold: float | None, last: bool) -> torch.Tensor:
    """Where a score meets the threshold, the early-exit rule (all at the last loop; none early
    without a threshold)."""
    if last or threshold is None:
        return torch.full_like(score, last, dtype=torch.bool)
    return exits(score, threshold)


def dynamic_depth(
    model, batch: torch.Tensor, k_max: int, rule: str, threshold: float | None
) -> tuple[float, int, list[int], list[int]]:
    """One batch with dynamic batching: summed CE, loop×token forward steps, each sequence's
    exit loop and (a per-token rule) each token's exit loop. A sequence leaves the batch once
    it halts: at its score's exit (per sequence), or once every token has exited (per token;
    a token is read out at its own exit)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    h, rope = model.embed(inputs)
    run = DynamicBatch(model, EXIT_RULES[rule], threshold, k_max, h, targets)
    each_loop(run.loops, lambda: run.loop(rope))
    return run.total_ce, run.steps, run.seq_exit, run.token_exit


class DynamicBatch:
    """`dynamic_depth`'s state, loop by loop: the sequences still running and what the ones
    that halted have read out."""

    def __init__(self, model, rule: ExitRuleSpec, threshold, k_max: int, h, targets):
        self.model, self.rule, self.threshold, self.k_max = model, rule, threshold, k_max
        self.h, self.targets = h, targets
        self.loops = Loops(model, k_max)
        self.rows = torch.arange(len(h), device=h.device)
        self.seq_exit, self.token_exit = [0] * len(h), []
        self.total_ce, self.steps, self.survival, self.exited = 0.0, 0, Survival(), None

    def loop(self, rope) -> bool:
        """Loop k for the running sequences; whether any still runs after it."""
        k = self.loops.loop
        h = self.h = self.model.step(self.h, self.loops, rope)
        self.steps += h.shape[0] * h.shape[1]
        per_sequence = self.rule.halts == "sequence"
        halt = self.sequences_halt(h, k) if per_sequence else self.tokens_halt(h, k)
        for r in self.rows[halt].tolist():
            self.seq_exit[r] = k
        keep = ~halt
        if not keep.any():
            return False
        self.h, self.rows = h[keep], self.rows[keep]
        if self.survival.survive is not None:
            self.survival.keep(keep)
        if not per_sequence:
            self.exited = self.exited[keep]
        return True

    def sequences_halt(self, h: torch.Tensor, k: int) -> torch.Tensor:
        logits = self.model.readout(h, k, self.k_max)
        scores = token_scores(self.model, self.rule, self.survival, h, logits)
        score = unit_scores(self.rule, scores)
        halt = reaches(score, self.threshold, k == self.k_max)
        if halt.any():
            ce = harness.token_ce(logits[halt], self.targets[self.rows[halt]])
            self.total_ce += ce.double().sum().item()
        return halt

    def tokens_halt(self, h: torch.Tensor, k: int) -> torch.Tensor:
        logits = self.model.readout(h, k, self.k_max) if self.rule.reads == "logits" else None
        score = token_scores(self.model, self.rule, self.survival, h, logits)
        if self.exited is None:
            self.exited = torch.zeros_like(score, dtype=torch.bool)
        new = reaches(score, self.threshold, k == self.k_max) & ~self.exited
        if new.any():  # only the tokens that exit here are read out
            read = self.model.readout(h[new], k, self.k_max) if logits is None else logits[new]
            ce = harness.token_ce(read[None], self.targets[self.rows][new][None])
            self.total_ce += ce.double().sum().item()
            self.token_exit += [k] * int(new.sum())
        self.exited = self.exited | new
        return self.exited.all(1)


def benchmark(
    model,
    slice_: torch.Tensor,
    k_max: int,
    rule: str,
    threshold: float | None,
    batch_size: int,
    device: str,
) -> dict:
    """Timed fixed K = 1..K_max and dynamic batching over the same batches."""
    batches = [b.to(device) for b in slice_.split(batch_size)]
    tokens = sum(b[:, :-1].numel() for b in batches)

    def timed(fn):
        fn(batches[0])  # warm-up, untimed
        _sync(device)
        start = time.perf_counter()
        results = [fn(b) for b in batches]
        _sync(device)
        return time.perf_counter() - start, results

    fixed = []
    with torch.no_grad():
        for k in harness.progress(range(1, k_max + 1), "fixed-K benchmark", unit="K"):
            seconds, results = timed(lambda b, k=k: fixed_depth(model, b, k))
            ce = sum(r[0] for r in results) / tokens
            fixed.append(
                {
                    "loops": k,
                    "tokens_per_s": tokens / seconds,
                    "seconds": seconds,
                    "ce": ce,
                    "ppl": harness.ppl(ce),
                    "loop_token_steps": sum(r[1] for r in results),
                }
            )
        seconds, results = timed(lambda b: dynamic_depth(model, b, k_max, rule, threshold))
    seq_exits = np.array([e for r in results for e in r[2]])
    ce = sum(r[0] for r in results) / tokens
    dynamic = {
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "ce": ce,
        "ppl": harness.ppl(ce),
        "mean_loops": float(seq_exits.mean()),
        "exit_histogram": np.bincount(seq_exits, minlength=k_max + 1)[1:].tolist(),
        "loop_token_steps": sum(r[1] for r in results),
        "speedup": (tokens / seconds) / fixed[-1]["tokens_per_s"],
    }
    if EXIT_RULES[rule].halts == "token":
        dynamic["mean_token_exit_loop"] = float(np.mean([e for r in results for e in r[3]]))
    return {"tokens": tokens, "fixed": fixed, "dynamic": dynamic}


def run(settings: HaltSettings) -> dict:
    """Calibrate (unless `settings.threshold` is given) and benchmark."""
    harness.check_data(settings.data)
    device, dtype = harness.device_and_dtype(settings.dtype, settings.device)
    opened = harness.open_model(settings.model, device, dtype)
    model = opened.model
    check_gate(settings.rule, model.exit_gate is not None, settings.model)
    settings = opened.fitted(settings)
    tokens = harness.read_tokens(settings.data, opened.encode)
    calib_slice = harness.windows(
        tokens, settings.seq_len, settings.calib, what="--data (calibration slice)"
    )
    bench_slice = harness.windows(
        tokens,
        settings.seq_len,
        settings.bench,
        start=settings.calib,
        what="--data (benchmark slice, after the calibration slice)",
    )
    scores, ce = cached_pass(
        model, calib_slice, settings.k_max, settings.rule, settings.batch_size, device
    )
    calibration = calibrate(scores, ce, calib_slice[:, 1:].numel(), settings.rho)
    if settings.threshold is not None:
        calibration = {
            **evaluate_threshold(scores, ce, calib_slice[:, 1:].numel(), settings.threshold),
            "given": True,
        }
    timing = benchmark(
        model,
        bench_slice,
        settings.k_max,
        settings.rule,
        calibration["threshold"],
        settings.batch_size,
        device,
    )
    recorded = settings.record(device=device, dtype=dtype)
    recorded["threshold_given"] = recorded.pop("threshold")
    result = {
        "model": opened.info,
        "settings": {
            **recorded,
            "calib_windows": [0, settings.calib],
            "bench_windows": [settings.calib, settings.calib + settings.bench],
        },
        "calibration": calibration,
        "benchmark": timing,
    }
    if settings.out is not None:
        harness.write(settings.out, "halt", result, markdown(result))
    return result


def evaluate_threshold(scores: np.ndarray, ce: np.ndarray, tokens: int, threshold: float) -> dict:
    """Calibration-slice figures of a given threshold (no search)."""
    exits = exit_loops(scores, threshold)
    fixed, dynamic = ce[:, -1].sum() / tokens, ce[np.arange(len(ce)), exits - 1].sum() / tokens
    return {
        "threshold": threshold,
        "ce_fixed": fixed,
        "ppl_fixed": harness.ppl(fixed),
        "ce_dynamic": dynamic,
        "ppl_dynamic": harness.ppl(dynamic),
        "ppl_ratio": harness.ppl(dynamic - fixed),
        "exit_histogram": np.bincount(exits, minlength=ce.shape[1] + 1)[1:].tolist(),
        "mean_exit_loop": float(exits.mean()),
    }


def markdown(result: dict) -> str:
    s, c, b = result["settings"], result["calibration"], result["benchmark"]
    name = f"threshold ({EXIT_RULES[s['rule']].summary})"
    threshold = "never early" if c["threshold"] is None else f"{c['threshold']:.4g}"
    d = b["dynamic"]
    lines = [
        f"# Halting ({s['rule']} rule): {result['model']['path']}",
        "",
        f"K_max = {s['k_max']}, ρ = {s['rho']}, {s['calib']} calibration and {s['bench']} "
        f"benchmark sequences of {s['seq_len']} tokens, batch {s['batch_size']}, "
        f"{s['device']} {s['dtype']}.",
        "",
        f"Calibration: {name} = {threshold}"
        f"{' (given)' if c.get('given') else ''}; dynamic PPL {ppl_text(c['ppl_dynamic'])} vs "
        f"fixed-K_max {ppl_text(c['ppl_fixed'])} (ratio {c['ppl_ratio']:.4f}); mean exit loop "
        f"{c['mean_exit_loop']:.2f}; exits per loop {c['exit_histogram']}.",
        "",
        "| depth | tokens/s | PPL | loop×token steps |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| K = {r['loops']} | {r['tokens_per_s']:,.0f} | {ppl_text(r['ppl'])} | "
        f"{r['loop_token_steps']:,} |"
        for r in b["fixed"]
    ]
    lines += [
        f"| dynamic (mean {d['mean_loops']:.2f} loops) | {d['tokens_per_s']:,.0f} | "
        f"{ppl_text(d['ppl'])} | {d['loop_token_steps']:,} |",
        "",
        f"Speedup over fixed K_max: {d['speedup']:.2f}x.{speedup_note(d, s['k_max'])}",
    ]
    return "\n".join(lines)


def speedup_note(dynamic: dict, k_max: int) -> str:
    """Why a speed-up is below 1, in a sentence (empty when it is not): the dynamic pass reads
    an exit at every loop to score the rule, which fixed K_max does at its last only."""
    if dynamic["speedup"] >= 1:
        return ""
    if dynamic["mean_loops"] >= k_max:
        return (
            f" No sequence exited before K_max = {k_max}: the dynamic pass ran every loop and "
            f"also read an exit at each to score the rule, which fixed K_max does not, so it is "
            f"slower. A lower threshold exits earlier, at some cost in PPL."
        )
    return (
        f" Sequences exited after {dynamic['mean_loops']:.2f} of {k_max} loops on average, but "
        f"the loops saved cost less than reading an exit at every loop to score the rule."
    )
