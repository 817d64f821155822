"""The demo runs end to end (few steps here; `make demo` runs the full length)."""

import json

import numpy as np
import pytest

from megaloop.data import synthetic
from megaloop.demo import conclusions, run_demo
from megaloop.train.metrics import read as read_metrics


def test_demo_prints_the_table_for_both_readouts_over_seeds(tmp_path, capsys):
    results = run_demo(steps=4, out=str(tmp_path), seeds=(5, 6))
    out = capsys.readouterr().out
    assert "CE (all tokens)" in out and "hidden RMS" in out and "CE (answer digits)" in out
    assert "2 seeds (5, 6): mean [min, max] over seeds" in out and "Findings:" in out
    assert set(results) == {5, 6} and all(set(r) == {"norm", "raw"} for r in results.values())
    for r in (r[readout] for r in results.values() for readout in ("norm", "raw")):
        assert len(r["ce"]) == len(r["hidden_rms"]) == len(r["answer_ce"]) == 4
        assert all(np.isfinite(r["ce"]))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == {str(k): v for k, v in results.items()}
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    seeds = [read_metrics(tmp_path / f"seed{s}/norm")["config"]["train"]["seed"] for s in (5, 6)]
    assert seeds == [5, 6]


def result(ce_k, rms_k):
    return {"ce": [2.0, ce_k], "hidden_rms": [1.0, rms_k]}


def test_findings_are_what_every_seed_shows_clearly():
    # scale: norm 10x raw in both seeds; CE: raw better by 1% in one seed, worse in the other
    seeds = {
        0: {"norm": result(1.80, 10.0), "raw": result(1.78, 1.0)},
        1: {"norm": result(1.80, 12.0), "raw": result(1.82, 1.2)},
    }
    holds, mixed = conclusions(seeds)
    assert "final-loop hidden RMS is larger with the norm readout than with raw" in holds
    assert any(
        m.startswith("CE (all tokens) at loop K is lower with raw than with norm in 1 of 2 seeds")
        for m in mixed
    )
    # the same direction in every seed but by less than MIN_EFFECT: not a finding either
    seeds[1]["raw"] = result(1.79, 1.2)
    holds, mixed = conclusions(seeds)
    assert not any(h.startswith("CE (all tokens)") for h in holds)
    assert any("in every seed, but by less than 5% in some" in m for m in mixed)


def test_synthetic_corpus_is_a_function_of_seed_and_index():
    a = synthetic.sample("addition", 0, 5, 64, 4)
    assert np.array_equal(a, synthetic.sample("addition", 0, 5, 64, 4))
    assert not np.array_equal(a, synthetic.sample("addition", 0, 6, 64, 4))
    text = bytes(a.astype(np.uint8)).decode()
    for line in text.split("\n")[:-1]:
        lhs, rhs = line.split("=")
        x, y = lhs.split("+")
        assert int(x) + int(y) == int(rhs) and len(rhs) == 5


def test_answer_mask_marks_exactly_the_answer_digits():
    tokens = np.frombuffer(b"0473+0968=01441\n1111+2222=03333\n", dtype=np.uint8).astype(np.int64)
    mask = synthetic.answer_mask(tokens, "addition")
    predicted = bytes(tokens[1:][mask[:-1]].astype(np.uint8)).decode()
    assert predicted == "0144103333"
    tokens = np.frombuffer(b"b=a;a=4;?b=4\n", dtype=np.uint8).astype(np.int64)
    mask = synthetic.answer_mask(tokens, "lookup")
    assert bytes(tokens[1:][mask[:-1]].astype(np.uint8)).decode() == "4"


@pytest.mark.multiprocess
def test_the_demo_command_trains_its_runs_in_two_worker_processes(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megaloop",
            "demo",
            "--steps",
            "3",
            "--seeds",
            "2,",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "seed 2, raw readout: done" in proc.stdout and "Findings:" in proc.stdout
    for readout in ("norm", "raw"):  # each worker's output went to its run's log
        assert "step 3: valid CE/loop" in (tmp_path / f"seed2/{readout}/train.log").read_text()


def test_chase_answers_are_the_tables_iterates_and_marked_by_hop_count():
    """Each query's answer is f^h(start) of its episode's table, one cycle through 0..5, and
    answer_kinds marks the position before each answer with h."""
    for index in range(20):
        tokens = synthetic.sample("chase", 3, index, 15, 4)
        table = {}
        for byte in tokens[:6]:
            i, j = divmod(int(byte) - synthetic.CHASE_ENTRY, synthetic.CHASE_TABLE)
            table[i] = j
        assert sorted(table) == list(range(6)) and sorted(table.values()) == list(range(6))
        value, seen = 0, set()
        for _ in range(6):
            seen.add(value)
            value = table[value]
        assert seen == set(range(6))  # one cycle
        kinds = synthetic.answer_kinds(tokens, "chase")
        for h in range(1, 5):
            pos = 6 + 2 * (h - 1)
            asked, start = divmod(int(tokens[pos]) - synthetic.CHASE_QUERY, 6)
            assert asked + 1 == h and kinds[pos] == h
            value = start
            for _ in range(h):
                value = table[value]
            assert chr(tokens[pos + 1]) == str(value)
        assert (kinds > 0).sum() == 4
