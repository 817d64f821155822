"""bench/adaptive_depth's own logic, by hand: which kind each target token of a sum is, and
the verdict rule (domination, the seeds' range, the repeats' spread), and which exports a resumed
bench keeps."""

import json

import numpy as np

from bench import adaptive_depth as bench
from megaloop.data import synthetic


def test_each_target_of_a_sum_gets_its_kind():
    # 0473+0968=01441: columns 0..3 sum to 0, 13, 13, 11 (none is 9); 0452+0547=00999: 0, 9, 9, 9
    text = b"0473+0968=01441\n0452+0547=00999\n0"
    tokens = np.frombuffer(text, dtype=np.uint8)
    windows = np.stack([tokens[0:17], tokens[16:33]])
    operand, fmt, units, next_column, chain = range(5)
    first = [operand] * 3 + [fmt] + [operand] * 4 + [fmt]  # targets 4 7 3 + 0 9 6 8 =
    assert bench.kind_of(windows)[0].tolist() == first + [next_column] * 4 + [units, fmt, operand]
    # answer 00999: the leading 0 reads column 0 (sum 0); digits 0, 9, 9 read columns 1..3 (sum 9)
    assert bench.kind_of(windows)[1].tolist() == first + [next_column] + [chain] * 3 + [
        units,
        fmt,
        operand,
    ]


def test_a_resumed_bench_keeps_only_exports_of_this_code(tmp_path):
    from support import tiny_export, write_export

    export = write_export(tiny_export(), tmp_path / "hf")
    assert bench.exported(export)
    config = json.loads((export / "config.json").read_text())
    config["megaloop_code"]["decoding.py"] = "0" * 64  # exported before decoding.py changed
    (export / "config.json").write_text(json.dumps(config))
    assert not bench.exported(export)
    assert not bench.exported(tmp_path / "never_exported")


def test_validation_sums_fill_one_window_each():
    sums = [
        synthetic.sample("addition", 0, i, bench.SEQ_LEN, bench.DIGITS, "valid") for i in range(3)
    ]
    text = b"".join(s.astype(np.uint8).tobytes() for s in sums)
    for i in range(2):
        window = text[i * bench.SEQ_LEN : (i + 1) * bench.SEQ_LEN + 1]
        assert window[bench.SEQ_LEN - 1 : bench.SEQ_LEN] == b"\n" and window.count(b"=") == 1


def run(loops, tokens_per_s, accuracy, seconds=(1.0, 1.0), **exit_):
    r = {
        "batch_size": 1,
        "exit": "fixed",
        "threshold": None,
        "kv": None,
        "batching": "sync",
        "loops": loops,
        "tokens_per_s": tokens_per_s,
        "answer_accuracy": accuracy,
        "answer_ce": 1.0,
        "ce": 1.0,
        "mean_loops": float(loops),
        "seconds": list(seconds),
    }
    return r | exit_


def placed(runs):
    """What `bench generate` records of each exiting run against the fixed Ks beside it."""
    from megaloop.evaluation.generate_bench import frontier

    frontier(runs, "answer_accuracy")
    return runs


def test_the_verdict_needs_every_seed_and_more_than_the_spreads():
    gate = dict(exit="gate", threshold=0.5, kv="copy")
    seeds = {
        0: placed([run(1, 100, 0.50), run(2, 60, 0.70), run(2, 80, 0.70, **gate)]),
        1: placed([run(1, 100, 0.52), run(2, 60, 0.69), run(2, 75, 0.69, **gate)]),
    }
    (row,) = bench.verdicts(seeds)
    # above K = 1 (as fast) by 0.20 and 0.17, more than K = 1's range 0.02; faster than K = 2
    assert row["undominated"] and row["by_speed"] and row["by_accuracy"]
    assert row["beats_fixed_depth"] and row["fixed_k_at_accuracy"] == [2, 2]
    assert row["fixed_k_at_speed"] == [1, 1]
    # K = 1's range over the seeds now exceeds the gain (0.68 - 0.50 > 0.01), and the speed-up
    # (75/60) lies inside the repeats' spread of fixed K = 2 in seed 1: no verdict
    seeds[1] = placed(
        [run(1, 100, 0.68), run(2, 60, 0.69, seconds=(1.0, 1.3)), run(2, 75, 0.69, **gate)]
    )
    (row,) = bench.verdicts(seeds)
    assert row["undominated"] and not row["by_accuracy"] and not row["by_speed"]
    assert not row["beats_fixed_depth"]
    # slower than fixed K = 2 at the same accuracy in one seed: dominated there
    seeds[1] = placed([run(1, 100, 0.52), run(2, 60, 0.69), run(2, 55, 0.69, **gate)])
    (row,) = bench.verdicts(seeds)
    assert not row["undominated"] and not row["beats_fixed_depth"]


def variants_info():
    """A run's JSON in miniature: the reference model (evidence only) and an exit-aware one with
    its runs and profile, figures chosen by hand."""
    cached = lambda acc, loops: {"gate 0.5 copy": {"accuracy": acc, "mean_exit_loop": loops}}  # noqa: E731
    kind = "answer, units digit"
    exits = [
        run(4, 100, 0.9, ratio=r, exit="gate", threshold=0.5, kv="copy", batch_size=8)
        for r in (0.8, 0.95, 0.9)
    ]
    profile = {
        "8": {
            "fixed_s_per_token": 1e-4,
            "loop_s_per_token": 2e-4,
            "s_per_token": {"fixed K=1": 3e-4, "fixed K=2": 5e-4, "copy sync": 1.3e-3},
            "exit_path_s_per_loop": {"copy sync": 1e-4},
        }
    }
    return {
        "verdict_rule": "the rule",
        "smoke": False,
        "variants": {
            "one_layer": {
                "title": "plain",
                "overrides": [],
                "evidence": {"0": {kind: {"cached": cached(0.5, 2.0)}}},
            },
            "one_layer_exits": {
                "title": "exits",
                "overrides": ["objective.exit_kv=copy"],
                "evidence": {"0": {kind: {"cached": cached(0.75, 2.5)}}},
                "runs": {"0": [run(4, 100, 0.9, batch_size=8), *exits]},
                "profile": profile,
            },
        },
    }


def test_the_top_report_publishes_the_comparison_profile_and_ratios_as_measured():
    from bench import adaptive_depth_report as report

    info = variants_info()
    comparison = "\n".join(report.comparison_lines(info))
    assert "| gate 0.5 copy | 0.500 → 0.750 (2.00 → 2.50) |" in comparison
    profile = report.profile_lines(info, ["one_layer_exits"])
    # fixed K=2 at 0.5 ms a token, f 0.1 ms and c 0.2 ms; the exit path 0.1 ms a loop, 0.5 c
    assert "| one_layer_exits | 8 | fixed K=2 | 0.500 | 0.100 | 0.200 |  |  |" in profile
    assert "| one_layer_exits | 8 | copy sync | 1.300 |  |  | 0.100 | 0.50 |" in profile
    ratios = report.ratio_lines(info, ["one_layer_exits"])
    assert "| one_layer_exits | 8 | copy | sync | 0.90 | 0.80 | 0.95 | 3 |" in ratios
