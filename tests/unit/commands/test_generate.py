"""`megaloop generate`: the text and exit loops it prints, batched prompts, sampling, and its
errors before any model is loaded. On tiny random exports written to disk here."""

import json
import re

import pytest
import torch

from megaloop.evaluation import generation
from megaloop.evaluation.settings import EvalError, GenerateSettings
from support import tiny_export, write_export

K = 4
MARK = re.compile(r"⟨(\d+)⟩")
PROMPTS = ["the river", "a small harbour town", "music"]


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    hf = tiny_export(seed=3, vocab_size=256, num_loops=K, exit_gate=True, gate_scale=1.0)
    return write_export(hf, tmp_path_factory.mktemp("gated"))


@pytest.fixture(scope="module")
def ouro_wired(tmp_path_factory):
    """Ouro's architecture, as `megaloop import ouro` gives it: sandwich norms, one shared loop
    norm, the exit gate."""
    ouro = dict(readout="norm", layer_norms="sandwich", loop_norm="shared", tie_embeddings=False)
    hf = tiny_export(seed=5, vocab_size=256, num_loops=K, exit_gate=True, **ouro)
    return write_export(hf, tmp_path_factory.mktemp("ouro"))


@pytest.fixture(scope="module")
def gateless(tmp_path_factory):
    return write_export(tiny_export(seed=4, vocab_size=256), tmp_path_factory.mktemp("gateless"))


@pytest.fixture
def megaloop_here(capsys):
    """`megaloop ARGS` in this process: (return code, stdout, stderr)."""
    from megaloop.cli import main

    def run(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def generate(megaloop_here):
    """`megaloop generate MODEL ARGS` on the CPU, at most `new_tokens` new tokens: (return code,
    stdout, stderr)."""

    def run(model, *args, new_tokens=10):
        return megaloop_here(
            "generate", model, *args, "--max-new-tokens", new_tokens, "--device", "cpu"
        )

    return run


def generated(export, tmp_path, *args, prompt="the river", name="out.json"):
    """Settings from `args` run through the library, its JSON record."""
    path = tmp_path / name
    settings = dict(model=export, prompt=prompt, max_new_tokens=10, out=path, device="cpu")
    flags = dict(zip(args[::2], args[1::2]))
    generation.run(GenerateSettings(**settings, **flags))
    return json.loads(path.read_text())


def depths_printed(stdout: str) -> list[int]:
    return [int(k) for k in MARK.findall(stdout)]


@pytest.mark.parametrize("wiring", ["gated", "ouro_wired"])
def test_a_never_exiting_gate_prints_what_fixed_k_prints(wiring, generate, request):
    common = [request.getfixturevalue(wiring), "--prompt", "the river"]
    fixed = generate(*common, "--exit", "fixed", new_tokens=12)
    never = generate(*common, "--exit", "gate", "--threshold", "1.01", new_tokens=12)
    assert fixed[0] == never[0] == 0
    assert fixed[1] == never[1] and fixed[1].startswith("the river")
    assert "never exits early" in never[2]
    summary = fixed[2].strip().splitlines()[-1]
    assert re.match(r"megaloop generate: \d+ new tokens, mean exit loop 4\.00 of K=4", summary)


@pytest.mark.parametrize("wiring", ["gated", "ouro_wired"])
@pytest.mark.parametrize("threshold, depth", [("0", 1), ("1.01", K)])
def test_show_depth_marks_every_new_token_with_its_exit_loop(
    wiring, request, generate, tmp_path, threshold, depth
):
    out = tmp_path / "g.json"
    flags = ["--prompt", "the river", "--exit", "gate", "--threshold", threshold, "--show-depth"]
    code, stdout, stderr = generate(request.getfixturevalue(wiring), *flags, "--out", out)
    assert code == 0, stderr
    (result,) = json.loads(out.read_text())["results"]
    visible = [t for t in result["tokens"] if t != 0]  # end of text (id 0) is not marked
    assert result["exit_loops"] == [depth] * len(result["tokens"])
    assert depths_printed(stdout) == [depth] * len(visible) and visible
    assert MARK.sub("", stdout) == f"the river{result['completion']}\n"


def test_each_tokens_depth_is_the_exit_of_the_forward_that_chose_it(gated, tmp_path, capsys):
    """Streamed marks, the JSON's exit loops and the no-cache forward agree: a new token's depth
    is the exit loop of the position whose logits produced it (recompute: exact exits).
    Sampled, so that the tokens, and so their exits, differ."""
    sampled = ("exit", "gate", "kv", "recompute", "show_depth", True, "temperature", 1.0)
    for threshold in (0.5, 0.3, 0.7):
        capsys.readouterr()
        record = generated(gated, tmp_path, *sampled, "seed", 0, "threshold", threshold)
        (result,) = record["results"]
        if len(set(result["exit_loops"])) > 2:
            break
    else:
        pytest.fail("no threshold made new tokens exit at three different loops")
    stdout = capsys.readouterr().out
    visible = [d for t, d in zip(result["tokens"], result["exit_loops"]) if t != 0]
    assert depths_printed(stdout) == visible
    model, tokenizer = generation.open_export(
        GenerateSettings(**record["settings"]), record["model"]["path"]
    )
    prompt = tokenizer("the river")["input_ids"]
    ids = torch.tensor([prompt + result["tokens"][:-1]])
    with torch.no_grad():
        reference = model(ids, use_cache=False).exit_loops[0, len(prompt) - 1 :]
    assert reference.tolist() == result["exit_loops"]
    marked = generation.marked(tokenizer, result, show_depth=True)
    assert stdout == f"the river{marked}\n"


@pytest.mark.parametrize("batching", ["sync", "async"])
@pytest.mark.parametrize("rule", [("fixed",), ("gate", "--threshold", "0.7")])
def test_a_batch_of_prompts_completes_each_as_alone(gated, generate, tmp_path, rule, batching):
    """Either batching: each prompt's completion and exit loops are its own at batch 1 (through
    synchronous batching, streamed)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n{PROMPTS[2]}\n")
    out = tmp_path / "batch.json"
    code, stdout, stderr = generate(
        gated, "--prompts", prompts, "--exit", *rule, "--out", out, "--batching", batching
    )
    assert code == 0, stderr
    batch = json.loads(out.read_text())["results"]
    assert [r["prompt"] for r in batch] == PROMPTS
    flags = ["exit", rule[0]] + (["threshold", float(rule[2])] if len(rule) > 1 else [])
    for i, (prompt, row) in enumerate(zip(PROMPTS, batch)):
        alone = generated(gated, tmp_path, *flags, prompt=prompt, name=f"{i}.json")["results"][0]
        assert row == alone
        assert f"{prompt}{row['completion']}\n" in stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["new_tokens"] == sum(len(r["tokens"]) for r in batch)
    assert summary["batching"] == [batching]


@pytest.mark.parametrize("batching", ["sync", "async"])
def test_sampling_with_a_seed_is_reproducible(gated, tmp_path, batching):
    flags = ("temperature", 1.0, "top_k", 20, "seed", 7, "batching", batching)
    runs = [generated(gated, tmp_path, *flags, name=f"{i}.json") for i in range(2)]
    assert runs[0]["results"] == runs[1]["results"]
    greedy = generated(gated, tmp_path, name="greedy.json")["results"][0]["tokens"]
    assert runs[0]["results"][0]["tokens"] != greedy


def test_auto_batching_is_async_where_rows_can_exit_apart(tmp_path):
    """The default: depth-asynchronous for a batch under an exit rule with copy or share; one
    prompt (it streams), fixed K (no row waits) and recompute decode in sync."""
    (tmp_path / "p.txt").write_text("a\nb\n")

    def batching(rows, **fields):
        settings = GenerateSettings(model=tmp_path, prompts=tmp_path / "p.txt", **fields)
        return settings.batching_of(rows)

    gate = dict(exit="gate", threshold=0.5)
    assert batching(2, **gate) == batching(2, exit="margin", threshold=1.0, kv="share") == "async"
    assert batching(1, **gate) == batching(2) == batching(2, **gate, kv="recompute") == "sync"
    assert batching(1, **gate, batching="async") == "async"
    assert batching(2, **gate, batching="sync") == "sync"


def test_loop_applications_count_the_prompt_at_k_and_each_new_tokens_exit(gated, tmp_path):
    record = generated(gated, tmp_path, "exit", "gate", "threshold", 0.0, "kv", "copy")
    (result,) = record["results"]
    prompt = len("the river")  # bytes
    summary = record["summary"]
    # the prompt at K; then each new token but the last is decoded, choosing the next one at
    # its exit loop
    assert summary["loop_applications"] == prompt * K + sum(result["exit_loops"][1:])
    assert summary["mean_exit_loop"] == 1.0 and summary["num_loops"] == K
    assert summary["batching"] == ["sync"]  # --batching auto, one prompt


def never_loads(monkeypatch):
    from megaloop.evaluation.exported import Export

    calls = []
    real = Export.model
    monkeypatch.setattr(Export, "model", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts", "{tmp}/missing.txt"], "--prompts .*missing.txt: no such file"),
        (["--prompts", "{tmp}/empty.txt"], "--prompts .*empty.txt: no prompts"),
        (["--prompt", "a", "--exit", "gate"], "--exit gate needs --threshold T"),
        (["--prompt", "a", "--exit", "margin"], "--exit margin needs --threshold T"),
        (
            ["--prompt", "a", "--threshold", "0.5"],
            r"--threshold is for an exit rule \(gate, margin, confidence\)",
        ),
        (["--prompt", "a", "--loops", "0"], "--loops 0: must be >= 1"),
        (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (
            ["--prompt", "a", "--top-k", "5"],
            "--top-k and --top-p shape sampling.* give --temperature T > 0",
        ),
        (["--prompt", ""], "--prompt is empty"),
        (
            ["--prompt", "a", "--batching", "async", "--kv", "recompute"],
            "--batching async decodes --kv copy or share",
        ),
    ],
)
def test_bad_input_is_one_line_before_any_model_is_loaded(
    gated, megaloop_here, monkeypatch, tmp_path, args, message
):
    (tmp_path / "empty.txt").write_text("\n  \n")
    calls = never_loads(monkeypatch)
    code, stdout, stderr = megaloop_here(
        "generate", gated, *[a.format(tmp=tmp_path) for a in args], "--device", "cpu"
    )
    assert code == 2 and stdout == "" and not calls
    (line,) = stderr.strip().splitlines()
    assert re.match(f"megaloop: error: {message}", line), line


def test_the_gate_on_a_model_without_one_names_the_margin_rule(
    gateless, megaloop_here, generate, monkeypatch
):
    calls = never_loads(monkeypatch)
    args = ["--prompt", "a", "--exit", "gate", "--threshold", "0.5", "--device", "cpu"]
    code, stdout, stderr = megaloop_here("generate", gateless, *args)
    assert code == 2 and stdout == "" and not calls
    (line,) = stderr.strip().splitlines()
    assert "has no exit gate" in line and "use --exit margin" in line
    margin = ["--exit", "margin", "--threshold", "2"]
    code, stdout, _ = generate(gateless, *args[:2], *margin, new_tokens=3)
    assert code == 0 and stdout.startswith("a")


def test_a_threshold_out_of_the_rules_range_says_what_it_means():
    def note(exit, threshold):
        return GenerateSettings(
            model="m", prompt="a", exit=exit, threshold=threshold
        ).threshold_note()

    assert "never exits early" in note("gate", 1.5)
    assert "never exits early" in note("margin", float("inf"))
    assert "at loop 1" in note("margin", 0.0) and "at loop 1" in note("gate", -1)
    assert note("gate", 0.9) is None and note("margin", 3.0) is None
    assert GenerateSettings(model="m", prompt="a", exit="none").early_exit == "none"
    with pytest.raises(EvalError, match="--threshold nan"):
        GenerateSettings(model="m", prompt="a", exit="gate", threshold=float("nan"))


@pytest.mark.parametrize("kv", ["copy", "share", "recompute"])
def test_the_summary_reports_the_kv_policys_cache_bytes_per_token(gated, tmp_path, kv):
    record = generated(gated, tmp_path, "exit", "gate", "threshold", 0.5, "kv", kv)
    model, _ = generation.open_export(
        GenerateSettings(**record["settings"]), record["model"]["path"]
    )
    assert record["summary"]["kv_bytes_per_token"] == model.cache_bytes_per_token(kv)
    assert record["summary"]["kv"] == kv


def test_an_export_is_checked_once_per_open(gated, monkeypatch):
    """`--exit margin` is early_exit="margin" in the model opened, and opening it reads and
    checks the export once (its code hashes are not recomputed for the model and tokenizer)."""
    from megaloop.evaluation import exported

    checks = []
    real = exported.check_export
    monkeypatch.setattr(exported, "check_export", lambda p: checks.append(p) or real(p))
    settings = GenerateSettings(model=gated, prompt="a", exit="margin", threshold=1.0)
    model, _ = generation.open_export(settings, settings.model)
    assert checks == [gated]
    assert model.config.early_exit == "margin" and model.config.exit_threshold == 1.0


def test_loops_past_the_trained_depth_get_a_note(gated, generate):
    rc, _, err = generate(gated, "--prompt", "the river", "--loops", str(K + 2), new_tokens=2)
    assert rc == 0
    assert f"--loops {K + 2} runs past the depth the model was trained at (K_train = {K})" in err
    rc, _, err = generate(gated, "--prompt", "the river", "--loops", str(K), new_tokens=2)
    assert rc == 0 and "runs past the depth" not in err


def test_a_run_directory_generates_what_its_export_does(
    export_dir, generate, tmp_path, monkeypatch
):
    """MODEL a run directory or a checkpoint folder: exported for the command (one line on
    stderr says which step), then the same greedy tokens and exit loops as its `megaloop
    export`; the JSON records MODEL as given and the step, not the temporary export."""
    run = export_dir.parent / "run"
    (checkpoint,) = (run / "checkpoints").glob("step_*")
    prompt = ["--prompt", "the river", "--exit", "margin", "--threshold", "2"]
    code, expected, _ = generate(export_dir, *prompt, "--out", tmp_path / "export.json")
    assert code == 0
    reference = json.loads((tmp_path / "export.json").read_text())
    assert reference["model"] == {"path": str(export_dir), "kind": "export", "step": None}
    from megaloop.train import checkpoint as checkpoints

    verified = []
    real = checkpoints.verify
    monkeypatch.setattr(checkpoints, "verify", lambda f: verified.append(f) or real(f))
    for model, kind in ((run, "run"), (checkpoint, "checkpoint")):
        out = tmp_path / f"{kind}.json"
        code, stdout, stderr = generate(model, *prompt, "--out", out)
        assert code == 0, stderr
        assert verified == [checkpoint]  # its files read and checked once
        verified.clear()
        assert stdout == expected
        assert f"megaloop: exporting {checkpoint} (step 6) to a temporary folder" in stderr
        record = json.loads(out.read_text())
        assert record["results"] == reference["results"]
        assert record["settings"]["model"] == str(model)
        assert record["model"] == {
            "path": str(model),
            "kind": kind,
            "checkpoint": str(checkpoint),
            "step": 6,
        }
        assert torch.initial_seed() != 0  # unseeded: exporting seeded torch with 0, not kept


def test_a_folder_that_holds_no_model_is_refused_naming_the_three_kinds(
    megaloop_here, monkeypatch, tmp_path
):
    calls = never_loads(monkeypatch)
    (tmp_path / "notes").mkdir()
    for folder, message in (
        (
            tmp_path / "notes",
            "not a run directory (no checkpoints/), a checkpoint folder (no meta.json) or a "
            "`megaloop export` folder (no config.json)",
        ),
        (
            tmp_path / "missing",
            "no such folder (give a run directory, a checkpoint folder or a `megaloop export` "
            "folder)",
        ),
    ):
        code, stdout, stderr = megaloop_here("generate", folder, "--prompt", "a")
        assert code == 2 and stdout == "" and not calls
        assert stderr.strip().splitlines() == [f"megaloop: error: MODEL {folder}: {message}"]


def rule_scores(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each rule's score [K, s] at every loop of every position of `ids` [1, s], computed here
    from the fixed-depth trajectory: gate, the cumulative exit probability 1 - prod(1 - lambda);
    margin, the top-1 minus the top-2 logit; confidence, the largest softmax probability."""
    with torch.no_grad():
        h, rope = model.embed(ids)
        logits, lams = [], []
        for k, hk in model.loops(h, rope, K):
            logits.append(model.readout(hk, k, K)[0].double())
            lams.append(model.exit_probability(hk)[0, :, 0].double())
    survive, gate = torch.ones(ids.shape[1], dtype=torch.float64), []
    for lam in lams:
        survive = survive * (1 - lam)
        gate.append(1 - survive)
    ranked = [row.sort(-1, descending=True).values for row in logits]
    return {
        "gate": torch.stack(gate),
        "margin": torch.stack([r[:, 0] - r[:, 1] for r in ranked]),
        "confidence": torch.stack([row.exp().amax(-1) / row.exp().sum(-1) for row in logits]),
    }


def first_reaching(score: torch.Tensor, threshold: float) -> list[int]:
    """Per position, the first loop (1-based) whose score reaches the threshold, else K."""
    return [next((k + 1 for k in range(K) if column[k] >= threshold), K) for column in score.T]


@pytest.mark.parametrize("rule", ["gate", "margin", "confidence", "fixed"])
def test_each_exit_rule_decides_what_its_definition_says(gated, tmp_path, rule):
    """`generate --exit R` (exact recompute cache): each new token's exit loop is the first loop
    at which R's score, computed here from the fixed-depth trajectory, reaches the threshold
    (fixed: K). Sampled (the greedy tiny model repeats one token) and the threshold the median
    of R's scores over the prompt, so that tokens exit at different loops."""
    prompt = "the river"
    reference, tokenizer = generation.open_export(
        GenerateSettings(model=gated, prompt=prompt, exit="fixed"), gated
    )
    prompt_ids = tokenizer(prompt)["input_ids"]
    flags = ["exit", rule, "kv", "recompute", "temperature", 1.0, "seed", 0]
    threshold = None
    if rule != "fixed":
        threshold = rule_scores(reference, torch.tensor([prompt_ids]))[rule].median().item()
        flags += ["threshold", threshold]
    record = generated(gated, tmp_path, *flags, prompt=prompt)
    assert record["settings"]["exit"] == rule
    (result,) = record["results"]
    ids = torch.tensor([prompt_ids + result["tokens"][:-1]])
    scores = rule_scores(reference, ids)
    start = len(prompt_ids) - 1  # the prompt's last position chose the first new token
    if rule == "fixed":
        expected = [K] * (ids.shape[1] - start)
    else:
        expected = first_reaching(scores[rule], threshold)[start:]
        assert len(set(expected)) > 1, expected  # the rule decides something here
    assert result["exit_loops"] == expected


def test_an_unknown_exit_rule_lists_every_rule():
    with pytest.raises(EvalError) as error:
        GenerateSettings(model="m", prompt="a", exit="entropy", threshold=0.5)
    message = str(error.value)
    assert message.startswith("--exit entropy: give one of")
    for rule in ("gate", "margin", "confidence", "fixed"):
        assert re.search(rf"\b{rule}\b", message), (rule, message)


def test_a_run_directory_leaves_no_temporary_export_behind(
    export_dir, generate, tmp_path, monkeypatch
):
    """MODEL a run directory: its export is written into the temporary folder (TMPDIR, here an
    empty folder of the test's) and is gone when the command ends."""
    import tempfile

    from megaloop import export

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    written, real = [], export.write
    monkeypatch.setattr(export, "write", lambda *a, **k: written.append(a[3]) or real(*a, **k))
    code, _, stderr = generate(export_dir.parent / "run", "--prompt", "the river", new_tokens=2)
    assert code == 0, stderr
    assert len(written) == 1 and written[0].parent == scratch  # exported there
    assert list(scratch.iterdir()) == []
