"""The study's nine lm-eval tasks from local files in their hub schema: the split each is
scored on, the gold index of every sample format, and acc / acc_norm as lm-eval computes them;
lm-eval's built-in tasks from local files, a run directory evaluated as its export, and the hub
check."""

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from megaloop.evaluation import compare, downstream, harness
from megaloop.evaluation.exported import EvalError
from megaloop.evaluation.settings import DownstreamSettings
from support import eval_downstream


def lettered(id_: str, texts: list[str], answer: str, labels="ABCDE", **question) -> dict:
    """A hub row of a task whose gold is the label of a choice (ARC, CommonsenseQA, OpenBookQA),
    a label per text; `question` holds the row's other fields."""
    choices = {"text": texts, "label": list(labels[: len(texts)])}
    return {"id": id_, **question, "choices": choices, "answerKey": answer}


ARC = [  # hub rows of allenai/ai2_arc: 3-5 choices, some labelled "1".."4" instead of "A".."E"
    lettered(
        "Mercury_7175875",
        [
            "Planetary density will decrease.",
            "Planetary years will become longer.",
            "Planetary days will become shorter.",
            "Planetary gravity will become stronger.",
        ],
        "C",
        question="An astronomer observes that a planet rotates faster after a meteorite impact. "
        "Which is the most likely effect of this increase in rotation?",
    ),
    lettered(
        "NYSEDREGENTS_2015_4_8",
        ["a wooden spoon", "a copper wire", "a rubber band"],
        "2",
        labels="123",
        question="Which object is the best conductor?",
    ),
    lettered(
        "Mercury_SC_401169",
        ["chemical", "light", "electrical", "sound", "heat"],
        "D",
        question="Which form of energy is produced when a rubber band vibrates?",
    ),
    lettered(
        "MCAS_2000_4_6",
        ["a balance", "a ruler", "a thermometer", "a stopwatch"],
        "A",
        question="Which tool should a student use to measure mass?",
    ),
]

ROWS = {  # task -> (rows of its validation split, the gold index of each)
    "boolq": [
        {
            "question": "do iran and afghanistan speak the same language",
            "passage": "Persian, also known by its endonym Farsi, is one of the Western "
            "Iranian languages. It is primarily spoken in Iran, Afghanistan and Tajikistan.",
            "idx": 0,
            "label": 1,
        },
        {
            "question": "is a wolverine the same as a badger",
            "passage": "The wolverine is "
            "the largest land-dwelling species of the family Mustelidae.",
            "idx": 1,
            "label": 0,
        },
        {
            "question": "is there a sequel to the movie the golden compass",
            "passage": "A sequel was planned but was cancelled after the film's disappointing "
            "sales in North America.",
            "idx": 2,
            "label": 0,
        },
    ],
    "winogrande": [
        {
            "sentence": "Sarah was a much better surgeon than Maria so _ always got "
            "the easier cases.",
            "option1": "Sarah",
            "option2": "Maria",
            "answer": "2",
        },
        {
            "sentence": "The trophy doesn't fit into the brown suitcase because the _ "
            "is too large.",
            "option1": "trophy",
            "option2": "suitcase",
            "answer": "1",
        },
        {
            "sentence": "Kyle doesn't wear leg warmers to bed, while Logan almost "
            "always does. _ is more likely to live in a colder climate.",
            "option1": "Kyle",
            "option2": "Logan",
            "answer": "2",
        },
    ],
    "commonsense_qa": [
        lettered(
            "075e483d21c29a511267ef62bedc0461",
            ["ignore", "enforce", "authoritarian", "yell at", "avoid"],
            "A",
            question="The sanctions against the school were a punishing blow, and they seemed to "
            "what the efforts the school had made to change?",
            question_concept="punishing",
        ),
        lettered(
            "61fe6e879ff18686d7552425a36344c8",
            ["race track", "populated areas", "the desert", "apartment", "roadblock"],
            "B",
            question="Sammy wanted to go to where the people were. Where might he go?",
            question_concept="people",
        ),
        lettered(
            "4c1cb0e95b99f72d55c068ba0255c54d",
            ["jewelry store", "neck", "jewlery box", "jewelry box", "boutique"],
            "A",
            question="To locate a choker not located in a jewelry box or boutique where would "
            "you go?",
            question_concept="choker",
        ),
    ],
    "sciq": [
        {
            "question": "What type of organism is commonly used in preparation of foods "
            "such as cheese and yogurt?",
            "distractor3": "viruses",
            "distractor1": "protozoa",
            "distractor2": "gymnosperms",
            "correct_answer": "mesophilic organisms",
            "support": "Mesophiles grow best in moderate temperature.",
        },
        {
            "question": "What phenomenon makes global winds blow northeast to southwest?",
            "distractor3": "tropical effect",
            "distractor1": "muon effect",
            "distractor2": "centrifugal effect",
            "correct_answer": "coriolis effect",
            "support": "",
        },
    ],
    "piqa": [
        {
            "goal": "How do I ready a guinea pig cage for it's new occupants?",
            "sol1": "Provide the guinea pig with a cage full of a few inches of bedding made of "
            "ripped paper strips.",
            "sol2": "Provide the guinea pig with a cage full of a few "
            "inches of bedding made of ripped jeans material.",
            "label": 0,
        },
        {
            "goal": "dresser",
            "sol1": "replace drawer with bobby pin ",
            "sol2": "finish, woodgrain with  bobby pin ",
            "label": 1,
        },
    ],
    "arc_easy": ARC,
    "arc_challenge": ARC[:3],
    "hellaswag": [
        {
            "ind": 24,
            "activity_label": "Roof shingle removal",
            "ctx_a": "A man is sitting on a roof.",
            "ctx_b": "he",
            "ctx": "A man is sitting on a roof. he",
            "endings": [
                "is using wrap to wrap a pair of skis.",
                "is ripping level tiles off.",
                "is holding a rubik's cube.",
                "starts pulling up roofing on a roof.",
            ],
            "source_id": "activitynet~v_-JhWjGDPHMY",
            "split": "val",
            "split_type": "indomain",
            "label": "3",
        },
        {
            "ind": 92,
            "activity_label": "Clean and jerk",
            "ctx_a": "A lady walks to a barbell. She bends down and grabs the pole.",
            "ctx_b": "the lady",
            "ctx": "A lady walks to a barbell. She bends down and grabs the pole. the lady",
            "endings": [
                "swings and lands in her arms.",
                "pulls the barbell forward.",
                "pulls a rope attached to the barbell.",
                "stands and lifts the weight over her head.",
            ],
            "source_id": "activitynet~v_-lJS58hyo1c",
            "split": "val",
            "split_type": "zeroshot",
            "label": "3",
        },
        {
            "ind": 106,
            "activity_label": "Canoeing",
            "ctx_a": "Two women in a child are shown "
            "in a canoe while a man pulls the canoe while standing in the water, with other "
            "individuals visible in the background.",
            "ctx_b": "the child and a different man",
            "ctx": "",
            "endings": [
                "are then shown paddling down a river in a boat while a woman talks.",
                "are driving the canoe, they go down the river flowing side to side.",
                "sit in a canoe while the man paddles.",
                "walking go down the rapids, while the man in his helicopter "
                "almost falls and goes out of canoehood.",
            ],
            "source_id": "activitynet~v_-xQvJmC2jhk",
            "split": "val",
            "split_type": "indomain",
            "label": "2",
        },
    ],
    "openbookqa": [
        lettered(
            "8-376",
            ["Deep sea animals", "fish", "Long Sea Fish", "Far Sea Animals"],
            "A",
            question_stem="Frilled sharks and angler fish live far beneath the surface of the "
            "ocean, which is why they are known as",
        ),
        lettered(
            "8-80",
            [
                "a new pair of jeans.",
                "a steel spoon in a cafeteria.",
                "a cotton candy at a store.",
                "a calvin klein cotton hat.",
            ],
            "B",
            question_stem="Which of these would let the most heat travel through?",
        ),
    ],
}


def gold(task: str, row: dict) -> int:
    if task in ("boolq", "piqa"):
        return row["label"]
    if task == "winogrande":
        return int(row["answer"]) - 1
    if task == "sciq":
        return 3
    if task == "hellaswag":
        return int(row["label"])
    return row["choices"]["label"].index(row["answerKey"])


def choice_texts(task: str, row: dict) -> list[str]:
    """What lm-eval's doc_to_choice gives (the hellaswag endings above need no cleaning)."""
    if task == "boolq":
        return ["no", "yes"]
    if task == "winogrande":
        blank = row["sentence"].index("_")
        return [row["sentence"][:blank] + row[o] for o in ("option1", "option2")]
    if task == "commonsense_qa":
        return list("ABCDE")
    if task == "sciq":
        return [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    if task == "piqa":
        return [row["sol1"], row["sol2"]]
    if task == "hellaswag":
        return row["endings"]
    return row["choices"]["text"]


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    """ROWS as DIR/<task>/validation.jsonl, and a different test split for the tasks that
    lm-eval scores on test by default (its first row only)."""
    root = tmp_path_factory.mktemp("tasks")
    for task, rows in ROWS.items():
        (root / task).mkdir()
        splits = {"validation": rows}
        if task in ("sciq", "arc_easy", "arc_challenge", "openbookqa"):
            splits["test"] = rows[:1]
        for split, split_rows in splits.items():
            with open(root / task / f"{split}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in split_rows)
    return root


def check(out: Path, summary: dict, expected: dict[str, list[dict]], split: dict[str, str]):
    """Per task: counts, the gold index of every sample, the choice texts, acc and acc_norm
    (per sample and overall) as lm-eval computed them, and the split recorded."""
    results = json.loads((out / "results.json").read_text())
    assert results["megaloop"]["splits"] == summary["splits"] == split
    for task, rows in expected.items():
        samples = [json.loads(line) for line in open(out / f"samples_{task}.jsonl")]
        assert len(samples) == len(rows) == summary["tasks"][task]["n"]
        assert summary["tasks"][task]["split"] == split[task]
        lm_eval = results["results"][task]
        mine = downstream.accuracies(samples)
        assert mine["acc"] == pytest.approx(lm_eval["acc,none"], abs=1e-12), task
        for s in samples:
            row = rows[s["doc_id"]]
            lls, texts, gold_index = downstream.choices(s)
            assert gold_index == gold(task, row), (task, s["doc_id"])
            assert texts == choice_texts(task, row), (task, s["doc_id"])
            assert s["acc"] == float(np.argmax(lls) == gold_index)
            if "acc_norm" in s:
                assert s["acc_norm"] == float(
                    np.argmax(downstream.normalised(lls, texts)) == gold_index
                ), task
        if "acc_norm,none" in lm_eval:
            assert mine["acc_norm"] == pytest.approx(lm_eval["acc_norm,none"], abs=1e-12), task


def test_the_nine_tasks_on_their_validation_splits(export_dir, task_data, tmp_path):  # noqa: F811
    out = tmp_path / "val"
    summary = downstream.run(
        DownstreamSettings(
            model=export_dir,
            loops=2,
            tasks=downstream.STUDY_TASKS,
            out=out,
            data_dir=task_data,
            batch_size=16,
            split="validation",
        )
    )
    assert summary["split"] == "validation" and set(summary["tasks"]) == set(ROWS)
    check(out, summary, ROWS, {t: "validation" for t in ROWS})
    reported = json.loads((out / "results.json").read_text())["results"]
    assert {t for t in ROWS if "acc_norm,none" in reported[t]} == {
        "sciq",
        "piqa",
        "arc_easy",
        "arc_challenge",
        "hellaswag",
        "openbookqa",
    }


def test_split_default_keeps_lm_evals_choice(export_dir, task_data, tmp_path):  # noqa: F811
    out = tmp_path / "default"
    summary = downstream.run(
        DownstreamSettings(
            model=export_dir,
            loops=1,
            tasks=("arc_easy", "boolq"),
            out=out,
            data_dir=task_data,
            split="default",
        )
    )
    check(
        out,
        summary,
        {"arc_easy": ARC[:1], "boolq": ROWS["boolq"]},
        {"arc_easy": "test", "boolq": "validation"},
    )
    assert "| arc_easy | test | 1 |" in downstream.table(summary)


def test_the_hub_path_keeps_the_dataset_and_nulls_the_test_split(tmp_path):
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    assert downstream.task_configs(("arc_challenge", "piqa"), "validation", None, tmp_path)
    index = TaskManager(include_path=str(tmp_path), include_defaults=False).task_index
    arc = load_yaml(index["arc_challenge"].yaml_path, resolve_func=False)
    assert (arc["dataset_path"], arc["dataset_name"]) == ("allenai/ai2_arc", "ARC-Challenge")
    assert arc["test_split"] is None and arc["validation_split"] == "validation"
    assert load_yaml(index["piqa"].yaml_path, resolve_func=False)["dataset_path"] == "baber/piqa"
    assert not downstream.task_configs(("arc_challenge",), "default", None, tmp_path / "none")


def test_a_task_without_a_validation_split_is_refused_before_loading(export_dir, tmp_path):  # noqa: F811
    with pytest.raises(EvalError, match="lambada_openai has no validation split"):
        downstream.run(
            DownstreamSettings(
                model=export_dir,
                loops=1,
                tasks=("boolq", "lambada_openai"),
                out=tmp_path / "r",
                split="validation",
            )
        )


def logged(arguments, lls, target, doc=None) -> dict:
    return {
        "doc_id": 0,
        "doc": doc or {},
        "target": target,
        "arguments": arguments,
        "filtered_resps": [[ll, False] for ll in lls],
    }


def test_gold_index_and_choice_texts_of_each_sample_format():
    ctx = "Question: q\nAnswer:"
    letters = logged([[ctx, f" {c}"] for c in "ABCDE"], [-3, -2, -1, -4, -5], "B")
    assert downstream.choices(letters)[1:] == (list("ABCDE"), 1)
    index = logged([[ctx, " no"], [ctx, " yes"]], [-1, -2], 1)
    assert downstream.choices(index)[1:] == (["no", "yes"], 1)
    # WinoGrande: the choice is in the context, the continuation shared, the gold the answer
    wino = logged(
        [["The trophy", " is too large."], ["The suitcase", " is too large."]],
        [-9.0, -8.0],
        "is too large.",
        {"answer": "1"},
    )
    assert downstream.choices(wino)[1:] == (["The trophy", "The suitcase"], 0)
    with pytest.raises(EvalError, match="disagrees with lm-eval"):
        downstream.choices({**wino, "acc": 1.0})


def test_acc_norm_divides_by_the_choice_without_the_delimiting_space():
    # per character of " a" / " bbbb" the first wins (-0.55 > -0.8), of "a" / "bbbb" the second
    sample = logged([["Q:", " a"], ["Q:", " bbbb"]], [-1.1, -4.0], 1)
    assert downstream.accuracies([sample]) == {"acc": 0.0, "acc_norm": 1.0, "n": 1}


def test_compare_metrics_are_length_normalised():
    sample = logged([["Q:", " ab"], ["Q:", " c"], ["Q:", " defg"]], [-3.0, -2.5, -6.0], 0)
    s = np.array([-3.0 / 2, -2.5 / 1, -6.0 / 4])  # gold -1.5, distractors -2.5 and -1.5
    got = compare.per_example(sample)
    assert got["gold NLL / char"] == pytest.approx(1.5)
    assert got["margin / char"] == pytest.approx(0.0)
    assert got["p(gold)"] == pytest.approx(np.exp(-1.5) / np.exp(s).sum())
    raw_winner = logged([["Q:", " ab"], ["Q:", " c"]], [-3.0, -2.0], 0)
    assert compare.per_example(raw_winner)["margin / char"] == pytest.approx(-1.5 + 2.0)


# -- adaptive depth (`eval downstream --exit`) ----------------------------------------------------


@pytest.fixture(scope="module")
def gated_export(export_dir, tmp_path_factory) -> Path:
    """The tiny export with an exit gate drawn so that its tokens exit at different loops."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("gated") / "hf"
    shutil.copytree(export_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "exit_gate": True}, indent=1))
    weights = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    weights["exit_gate.weight"] = 0.3 * torch.randn(1, config["hidden_size"], generator=g)
    weights["exit_gate.bias"] = torch.zeros(1)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def lls_of(folder: Path, task: str) -> list[list[float]]:
    return [
        [float(r[0]) for r in json.loads(line)["filtered_resps"]]
        for line in open(folder / f"samples_{task}.jsonl")
    ]


def adaptive(model, data, out, *extra, loops="2", tasks="arc_easy,boolq") -> int:
    options = ["--tasks", tasks, "--data-dir", data, "--batch-size", "4", *extra]
    return eval_downstream(model, out, loops, *options)


def test_adaptive_depth_at_the_extremes_is_fixed_k(export_dir, task_data, tmp_path, capsys):
    """margin 1e30 never exits early: fixed K's log-likelihoods and K loops per token; margin 0
    exits every token at loop 1: K = 1's and 1 loop per token."""
    out = tmp_path / "adaptive"
    assert adaptive(export_dir, task_data, out, "--exit", "margin", "--threshold", "1e30,0") == 0
    printed = capsys.readouterr()
    assert "| **macro** | margin 1e+30 | 2.00 |" in printed.out
    # one bar over the 4 passes (K=1, 2 and two thresholds), not lm-eval's 3 a pass (the
    # export's loading draws its own, once)
    bars = {line.split(":")[0] for line in re.split(r"[\r\n]", printed.err) if "%|" in line}
    assert bars - {"Loading weights"} == {"lm-eval passes (K=1..2, then each threshold)"}, bars
    k1 = downstream.run(
        DownstreamSettings(
            model=export_dir,
            loops=1,
            tasks=("arc_easy", "boolq"),
            out=tmp_path / "k1",
            data_dir=task_data,
            batch_size=4,
        )
    )
    summary = json.loads((out / "adaptive.json").read_text())
    runs = {r["folder"]: r for r in summary["runs"]}
    assert list(runs) == ["fixed-k1", "fixed-k2", "margin-0.0", "margin-1e+30"]
    assert [r["threshold"] for r in summary["runs"]] == [None, None, 0.0, 1e30]
    for folder, reference, loops in (
        ("margin-1e+30", out / "fixed-k2", 2.0),
        ("margin-0.0", tmp_path / "k1", 1.0),
        ("fixed-k1", tmp_path / "k1", 1.0),
    ):
        run = runs[folder]
        assert run["mean_loops"] == loops
        for task in ("arc_easy", "boolq"):
            assert lls_of(out / folder, task) == lls_of(reference, task), (folder, task)
            assert run["tasks"][task]["mean_loops"] == loops
            assert run["exit"] == "fixed" or run["tasks"][task]["scored_tokens"] > 0
        per_run = json.loads((out / folder / "summary.json").read_text())
        assert per_run["exit"] == run["exit"] and per_run["mean_loops"] == loops
        assert per_run["loops"] == (1 if folder == "fixed-k1" else 2)
    assert runs["margin-0.0"]["macro_acc"] == k1["macro_acc"]
    assert runs["margin-1e+30"]["macro_acc"] == runs["fixed-k2"]["macro_acc"]
    assert runs["fixed-k2"]["mean_loops"] == 2.0 and runs["fixed-k2"]["exit"] == "fixed"
    # each equals its fixed K, so it is dominated: by that K, or by a shallower K as accurate
    fixed = {k: runs[f"fixed-k{k}"]["macro_acc"] for k in (1, 2)}
    for folder, k in (("margin-0.0", 1), ("margin-1e+30", 2)):
        best = max(range(1, k + 1), key=fixed.get)
        assert runs[folder]["dominated"] and runs[folder]["fixed_k_at_depth"] == best
        assert runs[folder]["acc_gain_at_depth"] == fixed[k] - fixed[best]
    table = (out / "adaptive.md").read_text()
    assert table.startswith("No threshold beat fixed K: each of the 2 is matched")
    assert "| boolq | margin 0 | 1.00 |" in table and "| arc_easy | fixed K=2 | 2.00 |" in table
    assert (out / "accuracy_vs_depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    paired = compare.compare(out / "fixed-k2", out / "margin-1e+30", 100, 0)
    assert paired  # the threshold folders are single runs `eval compare` reads


def test_each_threshold_is_placed_against_the_fixed_ks_at_no_more_depth():
    """By hand: the best fixed K at most as deep sets the gain; shallower than K = 1, none."""
    from megaloop.evaluation import adaptive_downstream

    fixed = [
        {"exit": "fixed", "mean_loops": float(k), "macro_acc": a}
        for k, a in ((1, 0.50), (2, 0.60), (3, 0.58))
    ]
    runs = fixed + [
        {"exit": "gate", "mean_loops": m, "macro_acc": a}
        for m, a in ((1.5, 0.55), (2.9, 0.59), (3.0, 0.61))
    ]
    adaptive_downstream.place(runs)
    placed = [
        (r["fixed_k_at_depth"], round(r["acc_gain_at_depth"], 6), r["dominated"]) for r in runs[3:]
    ]
    assert placed == [(1, 0.05, False), (2, -0.01, True), (2, 0.01, False)]


def test_adaptive_depth_counts_each_requests_scored_tokens(gated_export):
    """Through lm-eval's batching (right padding, sorted by length), each request's
    log-likelihood and the exit loops of its continuation tokens are those of a forward of
    the request alone."""
    import torch
    from lm_eval.api.instance import Instance

    from megaloop.evaluation import adaptive_downstream
    from megaloop.evaluation.exported import open_export

    export = open_export(gated_export)
    model = export.model("cpu", "float32", num_loops=4)
    model.config.early_exit, model.config.exit_threshold = "gate", 0.7
    lm = adaptive_downstream.depth_counting_class()(
        pretrained=model, tokenizer=export.tokenizer(), batch_size=3, device="cpu"
    )
    pairs = [
        ("Question: which object is the best conductor?\nAnswer:", " a copper wire"),
        ("Question: which object is the best conductor?\nAnswer:", " a wooden spoon"),
        ("A man is sitting on a roof. he", " starts pulling up roofing on a roof."),
        ("is a wolverine the same as a badger?", " no"),
        ("Sarah was a much better surgeon than", " Maria so she always got the easier cases."),
    ]
    requests = [
        Instance("loglikelihood", {}, pair, i, ("task" + str(i % 2), i, 1))
        for i, pair in enumerate(pairs)
    ]
    scores = lm.loglikelihood(requests, disable_tqdm=True)
    loops, tokens = {}, {}
    for i, (context, continuation) in enumerate(pairs):
        ctx, cont = lm._encode_pair(context, continuation)
        ids = torch.tensor((ctx + cont)[:-1])[None]
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
        logp = out.logits[0, -len(cont) :].log_softmax(-1)
        expected = logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()
        assert scores[i][0] == pytest.approx(expected, abs=1e-5)
        exits = out.exit_loops[0, -len(cont) :].numpy()
        assert (lm.by_request[(context, continuation)] == exits).all()
        task = "task" + str(i % 2)
        loops[task] = loops.get(task, 0) + int(exits.sum())
        tokens[task] = tokens.get(task, 0) + len(cont)
    per_task, mean = lm.depth()
    assert {t: r["scored_tokens"] for t, r in per_task.items()} == tokens
    assert {t: r["mean_loops"] for t, r in per_task.items()} == {
        t: loops[t] / tokens[t] for t in loops
    }
    assert mean == sum(loops.values()) / sum(tokens.values())
    assert 1 < mean < 4  # the gate's exits differ between tokens


def test_gate_never_exiting_is_fixed_k_and_at_zero_exits_at_loop_one(
    gated_export, task_data, tmp_path
):
    out = tmp_path / "gate"
    assert (
        adaptive(
            gated_export, task_data, out, "--exit", "gate", "--threshold", "1.01,0", tasks="boolq"
        )
        == 0
    )
    runs = {r["folder"]: r for r in json.loads((out / "adaptive.json").read_text())["runs"]}
    assert lls_of(out / "gate-1.01", "boolq") == lls_of(out / "fixed-k2", "boolq")
    assert runs["gate-1.01"]["mean_loops"] == 2.0 and runs["gate-0.0"]["mean_loops"] == 1.0
    k1 = tmp_path / "k1"
    settings = dict(model=gated_export, tasks=("boolq",), data_dir=task_data, batch_size=4)
    downstream.run(DownstreamSettings(loops=1, out=k1, **settings))
    assert lls_of(out / "gate-0.0", "boolq") == lls_of(k1, "boolq")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--exit", "margin"], "--exit needs --threshold"),
        (["--threshold", "0.5"], "--threshold needs --exit"),
        (["--exit", "margin", "--threshold", "0.5,nan"], "give finite numbers"),
        (["--exit", "margin", "--threshold", "a"], "give finite numbers"),
        (["--exit", "gate", "--threshold", "0.9"], "has no exit gate"),
    ],
)
def test_adaptive_depth_input_errors_before_scoring(
    export_dir, task_data, tmp_path, capsys, extra, message
):
    assert adaptive(export_dir, task_data, tmp_path / "r", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megaloop: error: ") and message in err[0]
    assert not (tmp_path / "r").exists()


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
