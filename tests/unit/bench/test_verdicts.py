"""bench/common/verdicts.py: each rule's figure per seed and its verdict, on figures written by
hand; and a run's figures read from its depth, halt and diagnose results."""

import json

import pytest

from bench.common import verdicts


def rule(start: str) -> verdicts.Rule:
    (found,) = [r for r in verdicts.RULES if r.claim.startswith(start)]
    return found


def run(l2_final, r=None, halt=None, ppl1=None, ppl4=None):
    f = {"l2_first": 20.0, "l2_last": l2_final, "l2_final": l2_final}
    if r is not None:
        f |= {"r": r, "halt_mean_loops": halt, "ppl": {"1": ppl1, "4": ppl4}, "ppl4": ppl4}
    return f


def test_a_ratio_follows_only_when_every_seed_passes_the_bar():
    drift = rule("per-loop CE through RMSNorm drifts")
    both = {"per_loop_norm": {"42": run(300.0), "101": run(100.0)}}
    both["per_loop_raw"] = {"42": run(4.0), "101": run(25.0)}
    j = verdicts.judge(drift, both)
    assert j["values"] == {"42": 75.0, "101": 4.0} and j["verdict"] == "mixed"  # 4 < 5
    both["per_loop_norm"]["101"] = run(125.0)
    assert verdicts.judge(drift, both)["verdict"] == "follows"  # 5x exactly
    flipped = {"per_loop_norm": both["per_loop_raw"], "per_loop_raw": both["per_loop_norm"]}
    assert verdicts.judge(drift, flipped)["verdict"] == "against"
    assert verdicts.judge(drift, {"per_loop_norm": both["per_loop_norm"]}) == {
        "values": {},
        "verdict": "not run",
    }


def test_the_radial_fraction_rule_reads_both_rows_and_halting_its_mean_exit():
    rows = {
        "per_loop_norm": {"42": run(300.0, r=[2e-8, 3e-8], halt=1.0, ppl1=101.0, ppl4=100.0)},
        "per_loop_raw": {"42": run(4.0, r=[0.1, 2e-3], halt=3.5, ppl1=150.0, ppl4=90.0)},
    }
    radial = verdicts.judge(rule("an RMSNorm readout leaves"), rows)
    assert radial == {"values": {"42": ([2e-8, 3e-8], [0.1, 2e-3])}, "verdict": "follows"}
    rows["per_loop_raw"]["42"]["r"] = [0.1, 5e-4]  # one raw exit under 1e-3
    assert verdicts.judge(rule("an RMSNorm readout leaves"), rows)["verdict"] == "mixed"
    assert verdicts.judge(rule("per-loop RMSNorm is nearly"), rows)["verdict"] == "follows"
    improves = verdicts.judge(rule("per_loop_raw improves"), rows)
    assert improves["values"]["42"] == pytest.approx(150 / 90) and improves["verdict"] == "follows"
    below = verdicts.judge(rule("per_loop_raw stays below"), rows)
    assert below["values"]["42"] == pytest.approx(0.9) and below["verdict"] == "follows"
    table = verdicts.table({"a": rows, "b": {}})
    assert len(table) == 2 + len(verdicts.RULES)
    assert all(line.endswith(" | – |") for line in table[2:])  # scale b has nothing


def test_a_runs_figures_are_read_from_its_measurements(tmp_path):
    """Trained at K = 2 with a 4-loop rollout: the settled update is the mean over the updates
    into loops 3 and 4 (rollout index 1 and 2)."""
    depth = {"rows": [{"loops": 1, "ppl": 30.0}, {"loops": 4, "ppl": 20.0}]}
    halt = {"benchmark": {"dynamic": {"mean_loops": 1.25}}}
    tail = {"rms": {"mean": 2.0, "p99.9": 5.0, "max": 8.0}}
    diagnose = {
        "settings": {"num_loops_trained": 2},
        "rollout": {
            "loops": [1, 2, 3, 4],
            "a_rad": [9.0, 2.0, 4.0],
            "scale_step": [9.0, 3.0, 3.0],
            "update_rms": [9.0, 1.0, 2.0],
        },
        "radial": {"r": [1e-8, 2e-8]},
        "clamp": {"delta_ce": 0.25},
        "scale": [tail, tail],
    }
    for name, result in (("depth", depth), ("halt", halt), ("diagnose", diagnose)):
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    trajectory = {"train_l2": [10.0, 20.0, 30.0, 40.0, 50.0, 60.0], "final_l2": 55.0}
    f = verdicts.run_figures(trajectory, tmp_path)
    assert f == {
        "l2_first": 10.0,
        "l2_last": 40.0,  # the mean of the last 5 steps
        "l2_final": 55.0,
        "ppl": {"1": 30.0, "4": 20.0},
        "ppl4": 20.0,
        "halt_mean_loops": 1.25,
        "r": [1e-8, 2e-8],
        "clamp_delta_ce": 0.25,
        "b_rms": 1.5,
        "a_rad_over_ds": 1.0,
        "p999_over_mean": 2.5,
        "max_over_mean": 4.0,
    }
    assert verdicts.run_figures(trajectory, None) == {
        k: f[k] for k in ("l2_first", "l2_last", "l2_final")
    }
