"""Downstream multiple-choice tasks with lm-eval (HFLM) on an exported model at a chosen K.

MODEL is an export, or a run directory or checkpoint folder exported for the command into a
temporary folder (harness.as_export, once the tasks are checked); the results record MODEL as
given and, for a run, the checkpoint's step.

Continuation likelihood, zero-shot, the study's nine tasks by default, each on its validation
split (`split="validation"`, the study's protocol) or on the split lm-eval evaluates by default
(`split="default"`: its test split where the config names one). Both the split and `data_dir`
(the built-in tasks from local files, DIR/<task>/<split>.jsonl in the hub dataset's schema) are
wired in by a generated task YAML per task that includes the built-in one and overrides keys
(lm-eval merges an include-path YAML with the built-in config; a dict of overrides passed to
simple_evaluate replaces it instead).

lm-eval scores each continuation whole, in one window of the model's max_seq_len tokens: a
context that does not fit is cut from the left (HFLM's convention), a continuation that does not
fit cannot be scored (HFLM asserts). Such a task is refused before any scoring, naming the task,
its longest continuation and max_seq_len (e.g. PIQA's longest solutions on a byte-level model of
max_seq_len 256): evaluate it with a model of a longer context, or leave it out of --tasks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megaloop.evaluation import harness
from megaloop.evaluation.exported import EvalError, Export, open_export, placement
from megaloop.evaluation.settings import SPLITS, DownstreamSettings

STUDY_TASKS = (
    "boolq",
    "winogrande",
    "commonsense_qa",
    "sciq",
    "piqa",
    "arc_easy",
    "arc_challenge",
    "hellaswag",
    "openbookqa",
)
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
TARGET_DELIMITER = " "  # lm-eval's default; none of the study's tasks sets another


@functools.cache
def builtin_tasks():
    """lm-eval's index of its built-in tasks: scanning their YAMLs takes ~15 s, so once."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def task_configs(tasks, split: str, data_dir: Path | None, into: Path) -> bool:
    """One YAML per task in `into`, the built-in task with its test split nulled (`validation`:
    lm-eval evaluates the test split when there is one) and/or reading DIR/<task>/<split>.jsonl.
    Returns whether any was needed (`default` from the hub runs the built-in tasks as they are).
    Refuses, before any model is loaded, a task that cannot be run as asked."""
    import yaml

    if split not in SPLITS:
        raise EvalError(f"--split {split}: one of {', '.join(SPLITS)}")
    if split == "default" and data_dir is None:
        return False
    from lm_eval.tasks._index import Kind

    for name in tasks:
        entry = builtin_tasks().task_index[name]
        if entry.kind is not Kind.TASK:
            raise EvalError(
                f"{name} is an lm-eval {entry.kind.name.lower()}, not a task: "
                f"give its tasks by name (--split {split}"
                f"{' and --data-dir' if data_dir else ''} are set per task)"
            )
        cfg = entry.cfg
        override = {"include": str(entry.yaml_path), "task": name}
        if split == "validation":
            if not cfg.get("validation_split"):
                raise EvalError(
                    f"--split validation: lm-eval's {name} has no validation split "
                    f"(its splits: {splits_of(cfg)}); run it with --split default"
                )
            override["test_split"] = None
        if data_dir is not None:
            override.update(local_data(name, {**cfg, **override}, Path(data_dir)))
        (into / f"{name}.yaml").write_text(yaml.safe_dump(override, sort_keys=False))
    return True


def splits_of(cfg: dict) -> dict:
    return {key: cfg[key] for key in SPLIT_KEYS if cfg.get(key)}


def evaluated_split(cfg: dict) -> str | None:
    """The split lm-eval evaluates (ConfigurableTask.eval_docs): test if set, else validation."""
    return cfg.get("test_split") or cfg.get("validation_split")


def local_data(name: str, cfg: dict, data_dir: Path) -> dict:
    """Overrides that read the task's splits from DIR/<task>/<split>.jsonl; splits without a
    file are nulled (zero-shot needs no training split), the evaluated one must be there."""
    override, files = {"dataset_path": "json", "dataset_name": None}, {}
    for key, split in splits_of(cfg).items():
        path = data_dir / name / f"{split}.jsonl"
        if path.is_file():
            files[split] = str(path.resolve())
        else:
            override[key] = None
    evaluated = evaluated_split(cfg)
    if evaluated not in files:
        raise EvalError(
            f"--data-dir {data_dir}: no {name}/{evaluated}.jsonl (lm-eval "
            f"evaluates {name} on its {evaluated!r} split here; one JSON object per "
            f"line in the schema of the hub dataset {cfg.get('dataset_path')})"
        )
    override["dataset_kwargs"] = {"data_files": files}
    return override


def choices(sample: dict) -> tuple[np.ndarray, list[str], int]:
    """Per-choice log-likelihoods, choice texts and gold index of one logged lm-eval sample, as
    lm-eval's ConfigurableTask.process_results forms them (zero-shot, no chat template).

    Most tasks put the choices in the continuation: `arguments` are (context, " " + choice) and
    `target` is the gold index, or the gold choice itself (CommonsenseQA's letter). WinoGrande
    ("multiple input") puts them in the context: `arguments` are (choice, " " + the shared
    rest of the sentence), `target` is that shared text, and lm-eval takes the gold from the
    doc (doc_to_text: `answer`, "1" or "2"). The choice texts are what acc_norm divides by.
    """
    lls = np.array([float(r[0]) for r in sample["filtered_resps"]])
    contexts, continuations = (list(side) for side in zip(*sample["arguments"]))
    target, doc = sample["target"], sample.get("doc", {})
    if len(set(contexts)) > 1:
        texts = contexts
        if str(doc.get("answer")) not in ("1", "2"):
            raise EvalError(
                f"doc {sample.get('doc_id')}: the choices differ in the context "
                f"(lm-eval's multiple input) but the doc has no WinoGrande answer"
            )
        gold = int(doc["answer"]) - 1
    else:
        texts = [
            c[len(TARGET_DELIMITER) :] if c.startswith(TARGET_DELIMITER) else c
            for c in continuations
        ]
        if isinstance(target, int) and 0 <= target < len(texts):
            gold = target
        elif isinstance(target, str) and target in texts:
            gold = texts.index(target)
        else:
            raise EvalError(
                f"doc {sample.get('doc_id')}: target {target!r} is neither a choice "
                f"index nor one of the choices {texts}"
            )
    if "acc" in sample and float(np.argmax(lls) == gold) != sample["acc"]:
        raise EvalError(
            f"doc {sample.get('doc_id')}: gold index {gold} disagrees with "
            f"lm-eval's acc {sample['acc']}"
        )
    return lls, texts, gold


def normalised(lls: np.ndarray, texts: list[str]) -> np.ndarray:
    """Log-likelihood per character of the choice text (lm-eval's acc_norm score)."""
    return lls / np.array([len(t) for t in texts], dtype=float)


def accuracies(samples: list[dict]) -> dict:
    """acc (argmax log-likelihood) and acc_norm (argmax per character, as lm-eval's acc_norm),
    recomputed from the logged samples, for every task alike."""
    acc, acc_norm = [], []
    for s in samples:
        lls, texts, gold = choices(s)
        acc.append(float(np.argmax(lls) == gold))
        acc_norm.append(float(np.argmax(normalised(lls, texts)) == gold))
    return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(acc_norm)), "n": len(samples)}


@functools.cache
def checked_lm_class():
    """HFLM that refuses, before scoring anything, requests whose continuation alone exceeds the
    model's max length (HFLM would die on an AssertionError midway), naming each such task."""
    from lm_eval.models.huggingface import HFLM

    class CheckedHFLM(HFLM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            longest: dict[str, tuple[int, object]] = {}
            for request in requests:
                context, continuation = request.args
                if context == "":  # as HFLM.loglikelihood: the prefix token is the context
                    n = len(self.tok_encode(continuation, add_special_tokens=False))
                else:
                    n = len(self._encode_pair(context, continuation)[1])
                task = request.task_name or "?"
                if n > self.max_length and n > longest.get(task, (0, None))[0]:
                    longest[task] = (n, request.doc_id)
            if longest:
                raise EvalError(
                    "; ".join(
                        f"task {task}: a continuation of {n} tokens (doc {doc}) is longer than the "
                        f"model's max_seq_len={self.max_length}"
                        for task, (n, doc) in longest.items()
                    )
                    + ". lm-eval scores a continuation whole (it cuts only the context), so "
                    "these cannot be scored: evaluate them with a model of a longer "
                    "max_seq_len, or leave them out of --tasks"
                )
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    return CheckedHFLM


HUB_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
"""Either set to 1: the datasets library reads the Hugging Face cache only, and asks no hub."""


def hub_address() -> tuple[str, int]:
    """Host and port of the hub the datasets library downloads from (HF_ENDPOINT, as
    huggingface_hub reads it)."""
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)


def check_hub(data_dir: Path | None, timeout: float = 5.0) -> None:
    """Without --data-dir, lm-eval downloads every task's dataset from the hub: where the hub
    cannot be reached, say so at once, naming --data-dir, instead of a traceback after a minute
    of the datasets library's retries. Offline mode (HUB_OFFLINE) reads the cache: not asked."""
    on = ("1", "ON", "YES", "TRUE")  # huggingface_hub's reading of a boolean variable
    if data_dir is not None or any(os.environ.get(v, "").upper() in on for v in HUB_OFFLINE):
        return
    host, port = hub_address()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise EvalError(
            f"the Hugging Face hub ({host}:{port}) cannot be reached from here ({e}), and without "
            "--data-dir lm-eval downloads each task's dataset from it: give --data-dir DIR with "
            "DIR/<task>/<split>.jsonl (one example per line in the hub dataset's schema, e.g. "
            "DIR/boolq/validation.jsonl), or HF_DATASETS_OFFLINE=1 to read datasets already in "
            "the Hugging Face cache"
        ) from None


def checked_lm(**kwargs):
    return checked_lm_class()(**kwargs)


@contextlib.contextmanager
def without_lm_eval_bars() -> Iterator[None]:
    """lm-eval draws a bar per task (building its requests) and one per request kind in every
    pass, with no switch for the first; `eval downstream --exit` runs K + thresholds passes, so
    it hides them (the modules' own `tqdm` names) and draws one bar over the passes."""
    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.models.huggingface
    from tqdm import tqdm

    def hidden(*args, **kwargs):
        return tqdm(*args, **{**kwargs, "disable": True})  # over lm-eval's own `disable=`

    modules = (lm_eval.api.model, lm_eval.api.task, lm_eval.models.huggingface)
    saved = [m.tqdm for m in modules]
    for m in modules:
        m.tqdm = hidden
    try:
        yield
    finally:
        for m, bar in zip(modules, saved, strict=True):
            m.tqdm = bar


@contextlib.contextmanager
def task_setup(settings: DownstreamSettings) -> Iterator[tuple[tuple[str, ...], object]]:
    """The tasks to run and the lm-eval TaskManager that holds them (their generated YAMLs live
    in a temporary folder for the duration); unknown or unrunnable tasks are refused here."""
    from lm_eval.tasks import TaskManager

    tasks = settings.tasks or STUDY_TASKS
    unknown = [t for t in tasks if t not in builtin_tasks().task_index]
    if unknown:
        raise EvalError(f"unknown lm-eval task(s): {', '.join(unknown)}")
    check_hub(settings.data_dir)
    with tempfile.TemporaryDirectory() as tmp:
        task_manager = builtin_tasks()
        if task_configs(tasks, settings.split, settings.data_dir, Path(tmp)):
            task_manager = TaskManager(include_path=tmp, include_defaults=False)
        yield tasks, task_manager


def scored(lm, tasks: tuple[str, ...], task_manager, limit: int | None) -> dict:
    """lm-eval's zero-shot results of `lm` on `tasks`, every sample logged."""
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=0,
        limit=limit,
        log_samples=True,
        task_manager=task_manager,
        bootstrap_iters=0,
    )


def run_info(settings: DownstreamSettings, results: dict, source: dict) -> dict:
    """What results.json and summary.json record of the run; `source`: harness.as_export's
    record of the model (its checkpoint step, None for an export)."""
    return {
        "model": str(settings.model),
        "step": source["step"],
        "loops": settings.loops,
        "limit": settings.limit,
        "data_dir": str(settings.data_dir) if settings.data_dir else None,
        "split": settings.split,
        "splits": {t: evaluated_split(cfg) for t, cfg in results["configs"].items()},
    }


def loaded(export: Export, settings: DownstreamSettings):
    """The export's model at K = settings.loops, its tokenizer and their device. The model is
    named MODEL as given: lm-eval records its _name_or_path as results.json's config.model,
    which for a run would be the temporary export folder."""
    device, dtype = placement(settings.device)
    model = export.model(device, dtype, num_loops=settings.loops)
    model.config._name_or_path = str(settings.model)
    return model, export.tokenizer(), device


def run(settings: DownstreamSettings) -> dict:
    harness.model_kind(settings.model)  # a folder of no model: refused before lm-eval's scan
    with (
        task_setup(settings) as (tasks, task_manager),
        harness.as_export(settings.model) as (folder, source),
    ):
        model, tokenizer, device = loaded(open_export(folder), settings)
        lm = checked_lm(
            pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size, device=device
        )
        results = scored(lm, tasks, task_manager, settings.limit)
    return write(results, settings.out, run_info(settings, results, source))


def write(results: dict, out: Path, run_info: dict, depth: dict[str, dict] | None = None) -> dict:
    """lm-eval's results.json (with `megaloop`: run_info) and samples_<task>.jsonl, plus
    summary.json: per task acc and acc_norm recomputed from the samples and the split
    evaluated (and `depth`'s entries of the task: its loops per token under early exit), their
    macro averages, and `n`, the examples scored in all (the study's nine full validation
    splits hold 20,007; it reports 19,169)."""
    out.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples")
    (out / "results.json").write_text(
        json.dumps({**results, "megaloop": run_info}, indent=1, default=str)
    )
    per_task = {}
    for task, rows in samples.items():
        with open(out / f"samples_{task}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
        per_task[task] = {
            **accuracies(rows),
            "split": run_info["splits"].get(task),
            **(depth or {}).get(task, {}),
        }
    summary = {
        **run_info,
        "tasks": per_task,
        "n": sum(t["n"] for t in per_task.values()),
        "macro_acc": float(np.mean([t["acc"] for t in per_task.values()])),
        "macro_acc_norm": float(np.mean([t["acc_norm"] for t in per_task.values()])),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def read_samples(folder: Path) -> dict[str, list[dict]]:
    """The samples of one `eval downstream` run; the folder of an `--exit` run holds one such
    run per fixed K and threshold, and the error names them."""
    files = sorted(folder.glob("samples_*.jsonl"))
    if not files:
        runs = sorted(p.parent.name for p in folder.glob("*/samples_*.jsonl"))
        if runs:
            runs = list(dict.fromkeys(runs))
            raise EvalError(
                f"{folder} holds the runs of `eval downstream --exit`, a folder each: "
                f"{', '.join(runs)}; give one of them (e.g. {folder / runs[-1]})"
            )
        raise EvalError(
            f"{folder}: no samples_<task>.jsonl; give a folder written by "
            f"`megaloop eval downstream`"
        )
    return {f.stem[len("samples_") :]: [json.loads(line) for line in f.open()] for f in files}


def table(summary: dict) -> str:
    lines = ["| task | split | n | acc | acc_norm |", "|---|---|---|---|---|"]
    for task, r in summary["tasks"].items():
        lines.append(
            f"| {task} | {r.get('split')} | {r['n']} | {r['acc']:.4f} | {r['acc_norm']:.4f} |"
        )
    lines.append(
        f"| **macro** | | {summary['n']} | {summary['macro_acc']:.4f} "
        f"| {summary['macro_acc_norm']:.4f} |"
    )
    return "\n".join(lines)
