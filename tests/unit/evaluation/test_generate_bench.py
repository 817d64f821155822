"""`megaloop bench generate` on a tiny export: one record per run with the issue's keys, the
counts the speed-up is judged by, recompute's CE equal to the no-cache forward with the same
exits, a never-exiting threshold equal to fixed K_max, and bad input refused before compute."""

import json
import math
import re

import numpy as np
import pytest
import torch

from megaloop.cli import main
from megaloop.evaluation import harness
from megaloop.evaluation.generate_bench import configured
from megaloop.evaluation.settings import EvalError, GenerateBenchSettings
from support import tiny_export, write_export

SEQ, PROMPT, BATCHES = 20, 2, (1, 3)
NEVER = 1000.0
THRESHOLDS = (0.0005, 0.5, NEVER)
"""Per rule on the tiny model: margin exits at different loops at 0.0005 (its margins are tiny)
and never at 0.5; gate exits at loop 1 at 0.0005 and at different loops at 0.5; neither at 1000."""
KEYS = ("exit", "threshold", "kv", "batch_size", "tokens_per_s", "mean_loops", "ce")
KEYS += ("loop_applications", "kv_slots_per_layer")


def saved_export(folder, **model):
    """A tiny export on disk, as `megaloop export` lays it out (byte tokenizer, vocab 128)."""
    return write_export(tiny_export(seed=3, vocab_size=128, tie_embeddings=False, **model), folder)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_generate")
    export = saved_export(root / "hf", readout="final_norm", recurrence="damping", exit_gate=True)
    rng = np.random.default_rng(7)
    text = "".join(f"{a:04d}+{b:04d}={a + b:05d}\n" for a, b in rng.integers(0, 10**4, (60, 2)))
    (root / "held_out.txt").write_text(text)
    args = ["--data", root / "held_out.txt", "--seq-len", SEQ, "--repeats", "1"]
    args += ["--batch-size", ",".join(map(str, BATCHES)), "--out", root / "out"]
    args += ["--threshold", ",".join(map(str, THRESHOLDS)), "--prompt-tokens", PROMPT]
    args += ["--task", "addition"]
    assert main(["bench", "generate", str(export), *map(str, args)]) == 0
    result = json.loads((root / "out/generate.json").read_text())
    return root, export, result


def runs_of(result, **fields):
    return [r for r in result["runs"] if all(r[k] == v for k, v in fields.items())]


def test_every_run_is_recorded_with_the_issues_keys_and_the_figure(bench):
    root, _, result = bench
    k_max = result["k_max"]
    exiting = 3 * len(THRESHOLDS) * (3 * len(BATCHES) + 2 * sum(b > 1 for b in BATCHES))
    assert len(result["runs"]) == exiting + k_max * len(BATCHES)
    assert {r["batching"] for r in runs_of(result, batch_size=1)} == {"sync"}
    for r in result["runs"]:
        assert all(key in r for key in KEYS), r
        assert isinstance(r["within_15pct"], bool) and np.isfinite(r["ratio"])
    for b in BATCHES:
        fixed = runs_of(result, exit="fixed", batch_size=b)
        assert [r["loops"] for r in fixed] == list(range(1, k_max + 1))
        assert all(r["threshold"] is None and r["kv"] is None for r in fixed)
    assert [f["batch_size"] for f in result["fixed_cost"]] == list(BATCHES)
    for fit in result["fixed_cost"]:  # its values are timings: only their presence is tested
        assert all(np.isfinite(fit[key]) for key in ("fixed_s_per_token", "loop_s_per_token"))
        f, c = fit["fixed_s_per_token"], fit["loop_s_per_token"]
        for r in runs_of(result, batch_size=fit["batch_size"]):  # the work it made, at K's price
            predicted = (f + c * k_max) / (f + c * r["step_max_loops"])
            assert r["predicted_speedup"] == pytest.approx(predicted), r
    mixed = runs_of(result, exit="gate", threshold=0.5) + runs_of(result, exit="margin")
    assert any(1 < r["mean_loops"] < k_max for r in mixed)  # the thresholds do exit early
    md = (root / "out/generate.md").read_text()
    assert md.count("\n| ") == 1 + len(result["runs"]) and "fixed cost per token" in md
    groups = {(r["batch_size"], r["batching"], r["kv"]) for r in result["runs"] if r["kv"]}
    for b, batching, kv in groups:
        group = runs_of(result, batch_size=b, batching=batching, kv=kv)
        within = sum(r["within_15pct"] for r in group)
        assert f"batch {b}, {batching}, `{kv}`: {within} of {len(group)}\n" in md
    assert (root / "out/generate.png").stat().st_size > 10_000


def test_copy_and_share_apply_the_stack_k_per_prompt_token_plus_each_exit(bench):
    _, _, result = bench
    k_max, steps = result["k_max"], SEQ - PROMPT
    for r in result["runs"]:
        b = r["batch_size"]
        if r["kv"] in ("copy", "share"):
            exits = r["mean_loops"] * b * steps
            assert r["loop_applications"] == k_max * PROMPT * b + round(exits), r
        elif r["kv"] == "recompute":
            assert r["loop_applications"] >= k_max * PROMPT * b + round(r["mean_loops"] * b * steps)


def test_each_run_records_the_kv_slots_its_cache_held(bench):
    """Counted on each run's cache, so a run named `share` that decoded another policy shows:
    one slot a layer under `share`, one a loop and layer under `copy`, `recompute` and fixed K."""
    _, _, result = bench
    k_max = result["k_max"]
    held = {(r["kv"], r["batching"], r["loops"], r["kv_slots_per_layer"]) for r in result["runs"]}
    fixed = {(None, "sync", k, k) for k in range(1, k_max + 1)}
    exiting = {("share", "sync", k_max, 1), ("share", "async", k_max, 1)}
    exiting |= {("copy", "sync", k_max, k_max), ("copy", "async", k_max, k_max)}
    assert held == fixed | exiting | {("recompute", "sync", k_max, k_max)}


def test_recompute_ce_is_the_no_cache_forward_with_the_same_exits(bench):
    root, export, result = bench
    opened = harness.open_model(export)
    model = opened.model
    tokens = harness.read_tokens(root / "held_out.txt", opened.encode)
    for r in runs_of(result, kv="recompute"):
        rows = harness.windows(tokens, SEQ, r["batch_size"])
        fields = dict(early_exit=r["exit"], exit_threshold=r["threshold"])
        with configured(model, **fields), torch.no_grad():
            reference = model(rows[:, :-1], use_cache=False)
        ce = harness.token_ce(reference.logits[:, PROMPT:], rows[:, PROMPT + 1 :]).mean().item()
        assert abs(r["ce"] - ce) <= 1e-5, r
        exits = reference.exit_loops[:, PROMPT:].float().mean().item()
        assert r["mean_loops"] == pytest.approx(exits, abs=1e-6), r


@pytest.mark.parametrize("exit_", ["fixed", "margin"])
def test_a_run_over_several_batches_scores_all_their_windows(bench, exit_):
    """--batches 2 at batch 1: CE, answer accuracy, mean loops and applications are those of
    the two windows decoded one at a time, combined (the same tokens in each)."""
    from megaloop.data.synthetic import answer_kinds
    from megaloop.evaluation.generate_bench import measure

    root, export, _ = bench
    opened = harness.open_model(export)
    rows = harness.windows(harness.read_tokens(root / "held_out.txt", opened.encode), SEQ, 2)
    kinds = torch.from_numpy(np.stack([answer_kinds(w.numpy(), "addition") for w in rows]))
    spec = {"exit": exit_, "threshold": 0.0005, "kv": "copy", "batching": "sync", "loops": 3}
    settings = {"model": "m", "data": "d", "prompt": PROMPT}
    _, both = measure(
        opened.model, rows, GenerateBenchSettings(**settings, batches=2), spec, lambda: None, kinds
    )
    alone = [
        measure(
            opened.model,
            rows[i : i + 1],
            GenerateBenchSettings(**settings),
            spec,
            lambda: None,
            kinds[i : i + 1],
        )[1]
        for i in range(2)
    ]
    assert both["batch_size"] == 1 and both["batches"] == 2
    for key in ("ce", "mean_loops", "stack_applications", "loop_applications"):
        assert both[key] == pytest.approx(sum(a[key] for a in alone) / 2, abs=1e-6), key
    asked = [int((k[PROMPT:-1] > 0).sum()) for k in kinds]
    right = sum(a["answer_accuracy"] * n for a, n in zip(alone, asked))
    assert both["answer_accuracy"] == pytest.approx(right / sum(asked), abs=1e-6)
    if exit_ == "margin":
        assert alone[0]["mean_loops"] != alone[1]["mean_loops"], "the test needs windows apart"


def test_a_threshold_that_never_exits_is_fixed_k_max(bench):
    _, _, result = bench
    k_max = result["k_max"]
    for b in BATCHES:
        (fixed,) = runs_of(result, exit="fixed", loops=k_max, batch_size=b)
        for r in runs_of(result, threshold=NEVER, batch_size=b):
            assert r["mean_loops"] == k_max
            if r["kv"] in ("copy", "recompute"):
                assert abs(r["ce"] - fixed["ce"]) <= 1e-5, r
                assert r["ce_vs_fixed_kmax"] == pytest.approx(0, abs=1e-5)


def test_async_decodes_as_sync_in_fewer_stack_applications(bench):
    """Teacher-forced, every row of the depth-asynchronous batching exits where it does in the
    synchronous batch and scores the same CE; the stack runs as often as the row with the most
    loops, at most the synchronous steps (each the deepest row's loop)."""
    _, _, result = bench
    k_max, steps = result["k_max"], SEQ - PROMPT
    for r in runs_of(result, batching="async"):
        same = {k: r[k] for k in ("exit", "threshold", "kv", "batch_size")}
        (sync,) = runs_of(result, batching="sync", **same)
        assert r["kv"] in ("copy", "share") and r["batch_size"] > 1
        assert abs(r["ce"] - sync["ce"]) <= 1e-5, (r, sync)
        assert r["mean_loops"] == pytest.approx(sync["mean_loops"], abs=1e-9)
        assert r["loop_applications"] == sync["loop_applications"]
        least = np.ceil(r["mean_loops"] * steps)  # the row with the most loops has at least it
        assert least <= r["stack_applications"] <= sync["stack_applications"], (r, sync)
        assert sync["stack_applications"] <= k_max * steps
    assert runs_of(result, batching="async", threshold=0.5)


@pytest.fixture(scope="module")
def gateless(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateless")
    (root / "held_out.txt").write_text("1234+5678=06912\n" * 20)
    return saved_export(root / "hf", exit_gate=False), root / "held_out.txt"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--threshold", ""], "--threshold '': give comma-separated numbers"),
        (["--threshold", "0.5,high"], "--threshold '0.5,high': give comma-separated numbers"),
        (["--threshold", "nan"], "--threshold 'nan': give finite numbers >= 0"),
        (["--kv", "foo"], "--kv 'foo': give one or more of copy, share, recompute"),
        (["--batching", "fast"], "--batching 'fast': give one or more of sync, async"),
        (["--exit", "fixed"], "--exit 'fixed': give one or more of gate, margin"),
        (["--exit", "gate"], "--exit gate: .* has no exit gate .*; use --exit margin"),
        (["--batch-size", "1,0"], "--batch-size '0,1': give batch sizes >= 1"),
        (["--seq-len", "4"], "--seq-len 4: must exceed --prompt-tokens 4"),
        (["--prompt-tokens", "1"], "--prompt-tokens 1: give 2 or more"),
    ],
)
def test_bad_input_is_one_error_before_any_compute(gateless, tmp_path, capsys, extra, message):
    export, data = gateless
    out = tmp_path / "out"
    argv = ["bench", "generate", str(export), "--data", str(data), "--out", str(out), *extra]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("megaloop: error: ")
    assert re.search(message, errors[0]), errors[0]
    assert not out.exists()


def test_each_exiting_run_is_placed_against_the_fixed_k_frontier(bench):
    """Per batch size and quality measure (CE; answer accuracy under --task): a run is dominated
    exactly when a fixed K is at least as fast and as good, and its gain at speed is measured
    against the best such fixed K; the report says first whether any run beat fixed K."""
    root, _, result = bench
    assert result["measures"] == ["ce", "answer_accuracy"]
    for measure, sign in (("ce", -1), ("answer_accuracy", 1)):
        for b in BATCHES:
            fixed = runs_of(result, exit="fixed", batch_size=b)
            for r in (r for r in runs_of(result, batch_size=b) if r["exit"] != "fixed"):
                assert 0 <= r["answer_accuracy"] <= 1 and np.isfinite(r["answer_ce"])
                as_fast = [f for f in fixed if f["tokens_per_s"] >= r["tokens_per_s"]]
                dominated = any(sign * f[measure] >= sign * r[measure] for f in as_fast)
                assert r[f"dominated_{measure}"] == dominated, r
                if as_fast:
                    best = max(sign * f[measure] for f in as_fast)
                    assert r[f"{measure}_gain_at_speed"] == pytest.approx(sign * r[measure] - best)
                else:
                    assert r[f"{measure}_gain_at_speed"] is None
    text = (root / "out/generate.md").read_text()
    assert text.index("beat fixed K") < text.index("| batch |")


def test_the_rules_default_to_those_the_model_has():
    settings = GenerateBenchSettings(model="m", data="d")
    assert settings.exit_rules(has_gate=True) == ("gate", "margin", "confidence")
    assert settings.exit_rules(has_gate=False) == ("margin", "confidence")
    assert settings.thresholds_of("gate") == (0.3, 0.5, 0.7, 0.9)
    assert GenerateBenchSettings(model="m", data="d", thresholds=(2, 1)).thresholds_of("gate") == (
        1.0,
        2.0,
    )
    with pytest.raises(EvalError, match="--repeats 0: must be >= 1"):
        GenerateBenchSettings(model="m", data="d", repeats=0)


def test_repeats_are_taken_in_rounds_over_a_batch_sizes_runs(monkeypatch):
    """Every run once, then every run again: a drift in the machine's speed falls on all runs;
    tokens/s from each run's fastest decode, every decode's seconds kept."""
    from megaloop.evaluation import generate_bench

    calls, took = [], {"a": [3.0, 1.0, 2.0], "b": [4.0, 4.0, 8.0]}

    def measure(model, rows, settings, spec, sync, kinds=None):
        calls.append(spec["name"])
        return took[spec["name"]][calls.count(spec["name"]) - 1], {"name": spec["name"]}

    monkeypatch.setattr(generate_bench, "measure", measure)
    settings = GenerateBenchSettings(model="m", data="d", repeats=3, prompt=2)
    rows = torch.zeros(4, 7, dtype=torch.long)  # 4 rows, 4 decoded tokens each
    records = generate_bench.timed(None, rows, settings, [{"name": "a"}, {"name": "b"}], None)
    assert calls == ["a", "b"] * 3
    assert [r["tokens_per_s"] for r in records] == [16 / 1.0, 16 / 4.0]  # the fastest
    assert [r["seconds"] for r in records] == [took["a"], took["b"]]


def test_answers_score_only_the_asked_positions():
    from megaloop.evaluation import generate_bench

    logits = torch.tensor([[[0.0, 5.0], [5.0, 0.0], [0.0, 5.0]]]).log_softmax(-1)
    targets = torch.tensor([[1, 1, 0]])
    kinds = torch.tensor([[0, 2, 1]])  # the first position is no answer
    got = generate_bench.answers(logits, targets, kinds)
    assert got["answer_accuracy"] == 0.0 and got["accuracy_by_kind"] == {1: 0.0, 2: 0.0}
    ce = -logits[0, 1:].gather(-1, targets[0, 1:, None]).squeeze(-1)
    assert got["answer_ce"] == pytest.approx(ce.mean().item())
    got = generate_bench.answers(logits, torch.tensor([[1, 0, 1]]), kinds)
    assert got["answer_accuracy"] == 1.0


def frontier_records():
    """Fixed K = 1..4 of one batch size (tokens/s falling, CE falling, accuracy rising) and two
    exiting runs: one between K=2 and K=3 in speed but better than K=3, one that K=3 beats."""
    fixed = [
        {"exit": "fixed", "loops": k, "tokens_per_s": tps, "ce": ce, "answer_accuracy": acc}
        for k, tps, ce, acc in (
            (1, 400.0, 3.0, 0.2),
            (2, 200.0, 2.5, 0.5),
            (3, 130.0, 2.2, 0.6),
            (4, 100.0, 2.0, 0.8),
        )
    ]
    spec = {"threshold": 0.5, "kv": "copy", "batching": "sync"}
    above = {"exit": "margin", **spec, "tokens_per_s": 160.0, "ce": 2.1, "answer_accuracy": 0.7}
    below = {"exit": "gate", **spec, "tokens_per_s": 120.0, "ce": 2.4, "answer_accuracy": 0.55}
    return [{**r, "batch_size": 1} for r in (*fixed, above, below)]


def test_the_frontier_by_hand():
    """The run at 160 tokens/s: the fixed K at least as fast are K=1, 2 (400, 200), the best of
    them K=2; the fixed K at least as good are K=4 alone (CE 2.0 <= 2.1, accuracy 0.8 >= 0.7),
    so it runs 160/100 = 1.6x the tokens/s of K=4 (not 160/400 = 0.4x of K=1). The run at 120
    tokens/s is beaten by K=3 (130 tokens/s, CE 2.2 <= 2.4, accuracy 0.6 >= 0.55)."""
    from megaloop.evaluation import generate_bench

    records = frontier_records()
    for measure in ("ce", "answer_accuracy"):
        generate_bench.frontier(records, measure)
    above, below = records[-2:]
    assert above["ce_gain_at_speed"] == pytest.approx(2.5 - 2.1)
    assert above["answer_accuracy_gain_at_speed"] == pytest.approx(0.7 - 0.5)
    for measure in ("ce", "answer_accuracy"):
        assert above[f"{measure}_fixed_k_at_speed"] == 2
        assert above[f"speedup_at_{measure}"] == pytest.approx(1.6)
        assert above[f"{measure}_fixed_k_at_quality"] == 4
        assert above[f"dominated_{measure}"] is False
        assert below[f"{measure}_fixed_k_at_speed"] == 3
        assert below[f"speedup_at_{measure}"] == pytest.approx(120 / 130)
        assert below[f"{measure}_fixed_k_at_quality"] == 3
        assert below[f"dominated_{measure}"] is True
    assert below["ce_gain_at_speed"] == pytest.approx(2.2 - 2.4)
    assert below["answer_accuracy_gain_at_speed"] == pytest.approx(0.55 - 0.6)
    (line,) = generate_bench.beat_fixed_k(records, "ce")
    assert line == (
        "- batch 1: 1 of 2 exiting runs beat fixed K in ce; margin 0.5 copy is better by 0.4 in "
        "ce than fixed K=2, at least as fast; margin 0.5 copy runs 1.60x the tokens/s of fixed "
        "K=4 at least as good in ce"
    )


class Counting(torch.nn.Module):
    """A stand-in model of vocabulary 10 that predicts token t + 1 (mod 10) after token t: logit
    5 there, 0 at the nine others, whatever the cache and depth."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(num_hidden_layers=1, early_exit="none", exit_threshold=0)

    def forward(self, input_ids, past_key_values=None, use_cache=False, num_loops=None):
        from types import SimpleNamespace

        return SimpleNamespace(logits=5.0 * torch.nn.functional.one_hot((input_ids + 1) % 10, 10))

    def cache_bytes_per_token(self, policy, loops):
        return 0


def test_answers_are_scored_at_the_answer_positions_of_a_decode():
    """One window decoded after a 2-token prompt: inputs 1 2 6 7 0 at positions 2..6 are
    followed by 2 6 7 0 5, so the counting model is right after positions 2 and 4 only, and
    those are the answers (kinds: what the NEXT token is). Right: CE log(1 + 9e^-5); wrong:
    log(e^5 + 9)."""
    from megaloop.evaluation import generate_bench

    rows = torch.tensor([[3, 8, 1, 2, 6, 7, 0, 5]])
    kinds = torch.tensor([[0, 0, 1, 0, 2, 0, 0, 0]])
    settings = GenerateBenchSettings(model="m", data="d", prompt=2, batches=1)
    spec = {"exit": "fixed", "threshold": None, "kv": None, "batching": "sync", "loops": 1}
    _, record = generate_bench.measure(Counting(), rows, settings, spec, lambda: None, kinds)
    right, wrong = math.log(1 + 9 * math.exp(-5)), math.log(math.exp(5) + 9)
    assert record["answer_accuracy"] == 1.0
    assert record["accuracy_by_kind"] == {1: 1.0, 2: 1.0}
    assert record["answer_ce"] == pytest.approx(right, rel=1e-5)
    assert record["ce"] == pytest.approx((2 * right + 3 * wrong) / 5, rel=1e-5)
