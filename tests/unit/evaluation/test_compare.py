"""`megaloop eval compare` (megaloop/evaluation/compare.py): the paired bootstrap over two
evaluations' examples. (lm-eval through local task data: test_downstream.py; the fixed-K
benchmark: test_fixed_k.py.)"""

import json

import numpy as np
import pytest

from megaloop.evaluation import compare


def test_paired_bootstrap_reproduces_the_normal_theory_ci():
    rng = np.random.default_rng(1)
    diffs = rng.normal(0.2, 1.0, size=4000)
    mean, low, high = compare.paired_bootstrap(diffs, resamples=10_000, seed=0)
    half = 1.959964 * diffs.std(ddof=1) / np.sqrt(len(diffs))
    assert mean == pytest.approx(diffs.mean())
    assert abs(low - (mean - half)) < 0.01 and abs(high - (mean + half)) < 0.01
    assert compare.paired_bootstrap(diffs, seed=0) == (mean, low, high)  # fixed seed


def sample(doc_id: int, lls, gold: int, continuations) -> dict:
    return {
        "doc_id": doc_id,
        "target": gold,
        "filtered_resps": [[ll, False] for ll in lls],
        "arguments": [["ctx", c] for c in continuations],
    }


def test_compare_points_into_the_folder_of_an_exit_run(tmp_path, capsys):
    """B written by `eval downstream --exit` holds one run a folder (fixed-k1.., rule-threshold):
    one line naming them and a folder to give, in place of "no samples"."""
    from megaloop.cli import main

    for run in ("a", "b/fixed-k1", "b/fixed-k2", "b/margin-0.5"):
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "samples_arc_easy.jsonl").write_text("")
    (tmp_path / "b/margin-0.5/samples_boolq.jsonl").write_text("")
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"megaloop: error: {tmp_path / 'b'} holds the runs of `eval downstream --exit`, a folder "
        f"each: fixed-k1, fixed-k2, margin-0.5; give one of them (e.g. {tmp_path / 'b/margin-0.5'})"
    )
    (tmp_path / "c").mkdir()
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    assert "no samples_<task>.jsonl" in capsys.readouterr().err


def test_compare_pairs_examples_and_reports_the_differences(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    rng = np.random.default_rng(0)
    rows_a, rows_b = [], []
    for i in range(50):
        lls = rng.normal(-5, 1, size=4)
        gold = i % 4
        better = lls.copy()
        better[gold] += 0.5  # B: the gold answer 0.5 nats more likely, distractors unchanged
        rows_a.append(sample(i, lls, gold, [" a", " bb", " ccc", " dddd"]))
        rows_b.append(sample(i, better, gold, [" a", " bb", " ccc", " dddd"]))
    rows_b.append(sample(99, [0.0, -1.0], 0, [" x", " y"]))  # unpaired: ignored
    for folder, rows in ((a, rows_a), (b, rows_b)):
        with open(folder / "samples_task.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    result = compare.compare(a, b, resamples=2000)
    assert result["pairs"] == 50
    nll = result["metrics"]["gold NLL / char"]
    expected = np.mean([-0.5 / len(c) for c in ["a", "bb", "ccc", "dddd"] * 13][:50])
    assert nll["delta"] == pytest.approx(expected)
    assert nll["ci95"][0] <= nll["delta"] <= nll["ci95"][1] < 0
    assert result["metrics"]["p(gold)"]["delta"] > 0
    assert result["macro_acc"]["b"] >= result["macro_acc"]["a"]
    assert result["metrics"]["margin / char"]["delta"] == pytest.approx(-expected)
    assert "| margin / char ↑ |" in compare.table(result)
