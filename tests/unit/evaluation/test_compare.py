"""Evaluation of exported models: lm-eval through local task data, the paired bootstrap, and the
fixed-K benchmark."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from megaloop.evaluation import compare, downstream, fixed_k, harness
from megaloop.evaluation.exported import EvalError
from megaloop.evaluation.settings import FixedKSettings
from support import eval_downstream


def write_tasks(root: Path) -> Path:
    """Two built-in tasks in their hub schema: ARC-Easy (3-5 choices, evaluated on `test`) and
    BoolQ (yes/no, evaluated on `validation`)."""
    rng = random.Random(0)
    (root / "arc_easy").mkdir(parents=True)
    with open(root / "arc_easy/test.jsonl", "w") as f:
        for i in range(7):
            labels = ["A", "B", "C", "D", "E"][: 3 + i % 3]
            texts = [str(rng.randint(0, 99)) for _ in labels]
            f.write(
                json.dumps(
                    {
                        "id": f"q{i}",
                        "question": f"What is {i} + {i}?",
                        "choices": {"text": texts, "label": labels},
                        "answerKey": labels[i % len(labels)],
                    }
                )
                + "\n"
            )
    (root / "boolq").mkdir()
    with open(root / "boolq/validation.jsonl", "w") as f:
        for i in range(5):
            f.write(
                json.dumps(
                    {
                        "question": f"is {i} even",
                        "passage": f"{i} is a number.",
                        "idx": i,
                        "label": i % 2,
                    }
                )
                + "\n"
            )
    return root


def test_lm_eval_runs_builtin_tasks_from_local_files(export_dir, tmp_path, capsys):
    data = write_tasks(tmp_path / "data")
    out = tmp_path / "results"
    options = ["--tasks", "arc_easy,boolq", "--data-dir", data, "--split", "default"]
    assert eval_downstream(export_dir, out, 2, *options) == 0
    assert "| **macro** | | 12 |" in capsys.readouterr().out  # 7 + 5 examples scored
    results = json.loads((out / "results.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 12
    assert summary["loops"] == 2 and summary["split"] == "default"
    assert summary["splits"] == {"arc_easy": "test", "boolq": "validation"}
    for task, n in (("arc_easy", 7), ("boolq", 5)):
        samples = [json.loads(line) for line in open(out / f"samples_{task}.jsonl")]
        assert len(samples) == n == summary["tasks"][task]["n"]
        assert [len(s["filtered_resps"]) for s in samples] == (
            [3 + i % 3 for i in range(7)] if task == "arc_easy" else [2] * 5
        )
        # accuracy recomputed from the log-likelihoods equals lm-eval's, per sample and overall
        mine = downstream.accuracies(samples)
        assert mine["acc"] == pytest.approx(results["results"][task]["acc,none"], abs=1e-12)
        assert [s["acc"] for s in samples] == [
            float(np.argmax([float(r[0]) for r in s["filtered_resps"]]) == s["target"])
            for s in samples
        ]
        if task == "arc_easy":
            assert mine["acc_norm"] == pytest.approx(results["results"][task]["acc_norm,none"])
    assert summary["macro_acc"] == pytest.approx(
        np.mean([summary["tasks"][t]["acc"] for t in ("arc_easy", "boolq")])
    )


def test_local_task_data_must_hold_the_evaluated_split(export_dir, tmp_path, capsys):
    data = write_tasks(tmp_path / "data")
    arc_easy = ["--tasks", "arc_easy", "--data-dir", data]
    assert eval_downstream(export_dir, tmp_path / "r", 1, *arc_easy) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megaloop: error: --data-dir") and (
        "arc_easy/validation.jsonl" in err[-1]
    )  # --split validation by default
    (data / "arc_easy/test.jsonl").rename(data / "arc_easy/validation.jsonl")
    assert eval_downstream(export_dir, tmp_path / "r", 1, *arc_easy, "--split", "default") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megaloop: error: --data-dir") and "arc_easy/test.jsonl" in err[-1]
    assert eval_downstream(export_dir, tmp_path / "r", 1, "--tasks", "nope") == 2
    assert "unknown lm-eval task(s): nope" in capsys.readouterr().err


def test_a_run_directory_is_evaluated_as_its_export(export_dir, tmp_path, capsys):
    """MODEL a run directory: exported for the command, then the same accuracies as its export,
    on the plain path and under --exit; the results record MODEL as given and the step."""
    run = export_dir.parent / "run"
    options = ["--tasks", "arc_easy,boolq", "--data-dir", write_tasks(tmp_path / "data")]
    options += ["--split", "default", "--batch-size", "4"]
    for model in (export_dir, run):
        assert eval_downstream(model, tmp_path / model.name, 2, *options) == 0
    of_export, of_run = (
        json.loads((tmp_path / name / "summary.json").read_text()) for name in ("hf", "run")
    )
    assert of_run["tasks"] == of_export["tasks"] and of_run["n"] == 12
    assert (of_export["model"], of_export["step"]) == (str(export_dir), None)
    assert (of_run["model"], of_run["step"]) == (str(run), 6)
    results = json.loads((tmp_path / "run/results.json").read_text())
    assert results["megaloop"]["model"] == results["config"]["model"] == str(run)
    assert "megaloop: exporting" in capsys.readouterr().err
    out = tmp_path / "adaptive"
    assert eval_downstream(run, out, 1, *options, "--exit", "margin", "--threshold", "0") == 0
    adaptive = json.loads((out / "adaptive.json").read_text())
    assert (adaptive["model"], adaptive["step"]) == (str(run), 6)
    assert json.loads((out / "margin-0.0/summary.json").read_text())["model"] == str(run)
    (tmp_path / "empty").mkdir()
    assert eval_downstream(tmp_path / "empty", tmp_path / "r", 1, *options) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"megaloop: error: MODEL {tmp_path / 'empty'}: not a run directory (no checkpoints/), "
        "a checkpoint folder (no meta.json) or a `megaloop export` folder (no config.json)"
    )
    assert not (tmp_path / "r").exists()
    for exit_rule in ([], ["--exit", "margin", "--threshold", "0"]):  # before lm-eval's task scan
        assert eval_downstream(tmp_path / "empty", tmp_path / "r", 1, "--tasks", "nope", *exit_rule)
        assert "MODEL" in capsys.readouterr().err


@pytest.mark.parametrize("exit_rule", [[], ["--exit", "margin", "--threshold", "0"]])
def test_an_unreachable_hub_is_one_line_naming_data_dir(
    export_dir, tmp_path, capsys, monkeypatch, exit_rule
):
    """Without --data-dir and with the hub out of reach (HF_ENDPOINT at a closed local port),
    one line naming --data-dir and its layout, before the model is exported or lm-eval
    evaluates; offline mode (the Hugging Face cache) and --data-dir ask no hub."""

    def never(*args, **kwargs):
        raise AssertionError("got past the hub check")

    monkeypatch.setattr(harness, "as_export", never)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for variable in downstream.HUB_OFFLINE:
        monkeypatch.delenv(variable, raising=False)
    out = tmp_path / "r"
    assert eval_downstream(export_dir, out, 1, "--tasks", "arc_easy", *exit_rule) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "megaloop: error: the Hugging Face hub (127.0.0.1:9) cannot be reached from here"
    ), err
    assert "give --data-dir DIR with DIR/<task>/<split>.jsonl" in err[0]
    assert not out.exists()
    assert downstream.hub_address() == ("127.0.0.1", 9)
    with pytest.raises(EvalError, match="cannot be reached"):
        downstream.check_hub(None)
    downstream.check_hub(tmp_path)  # --data-dir: no hub asked
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    downstream.check_hub(None)  # the cache: no hub asked
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.org")
    assert downstream.hub_address() == ("hub.example.org", 443)


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


def test_fixed_k_bench_gives_a_row_per_k(export_dir, tmp_path):
    text = tmp_path / "held_out.txt"
    text.write_text("".join(f"{i}+{2 * i}={3 * i}\n" for i in range(200)))
    settings = FixedKSettings(
        model=export_dir,
        data=text,
        loops=(1, 2, 3),
        batch_size=2,
        seq_len=32,
        batches=3,
        warmup=1,
        out=tmp_path / "fk.json",
    )
    rows = fixed_k.run(settings)
    assert [r["loops"] for r in rows] == [1, 2, 3]
    for r in rows:  # the speed figures agree with each other (their values depend on the machine)
        assert r["tokens_per_s"] > 0 and r["median_batch_s"] > 0
        assert r["tokens_per_s"] * r["median_batch_s"] == pytest.approx(2 * 32)
        assert r["throughput_vs_k1"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])
    # each row's CE is the exported model's CE at that K, loaded with num_loops=K, on the timed
    # batches (the 3 after the warm-up batch): a bench that ran one K for all would fail here
    from transformers import AutoModelForCausalLM

    tokens = np.frombuffer(text.read_bytes(), np.uint8).astype(np.int64)  # bytes tokenizer
    batches = harness.windows(tokens, 32, (1 + 3) * 2).view(4, 2, 33)[1:]
    for r in rows:
        model = AutoModelForCausalLM.from_pretrained(
            export_dir, trust_remote_code=True, num_loops=r["loops"]
        ).eval()
        with torch.no_grad():
            ce = [
                torch.nn.functional.cross_entropy(
                    model(b[:, :-1], use_cache=False).logits.flatten(0, 1), b[:, 1:].flatten()
                ).item()
                for b in batches
            ]
        assert r["ce"] == pytest.approx(np.mean(ce), rel=1e-5), (r, ce)
    assert len({r["ce"] for r in rows}) == 3, rows  # and depth changes it
    saved = json.loads((tmp_path / "fk.json").read_text())
    assert saved["rows"] == rows and saved["timed_batches"] == 3
    assert (tmp_path / "fk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(EvalError, match="--seq-len 4096: the model takes 1 to 256 positions"):
        fixed_k.run(FixedKSettings(model=export_dir, data=text, seq_len=4096))
    with pytest.raises(EvalError, match="are needed"):
        fixed_k.run(FixedKSettings(model=export_dir, data=text, seq_len=200, batches=100))
