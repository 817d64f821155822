"""The demo runs end to end (few steps here; `make demo` runs the full length)."""

import json

import numpy as np

from megaloop.data import synthetic
from megaloop.demo import run_demo


def test_demo_prints_the_table_for_both_readouts(tmp_path, capsys):
    results = run_demo(steps=4, out=str(tmp_path))
    out = capsys.readouterr().out
    assert "CE (all tokens)" in out and "hidden RMS" in out and "CE (answer digits)" in out
    assert set(results) == {"norm", "raw"}
    for r in results.values():
        assert len(r["ce"]) == len(r["hidden_rms"]) == len(r["answer_ce"]) == 4
    assert json.loads((tmp_path / "summary.json").read_text()) == results
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_trains_on_a_text_file(tmp_path):
    text = tmp_path / "t.txt"
    # its last 5% (the validation text) must hold a micro-batch of 32 windows of 129 bytes
    text.write_text("The quick brown fox jumps over the lazy dog. " * 2000)
    results = run_demo(text=str(text), steps=3, out=str(tmp_path / "runs"))
    assert "answer_ce" not in results["norm"] and len(results["raw"]["ce"]) == 4


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
