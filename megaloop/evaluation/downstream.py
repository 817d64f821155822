"""Downstream multiple-choice tasks with lm-eval (HFLM) on an exported model at a chosen K.

Continuation likelihood, zero-shot, the study's nine tasks by default. `data_dir` runs the same
built-in tasks from local files (no hub): DIR/<task>/<split>.jsonl in the hub dataset's schema,
wired in by a generated task YAML that includes the built-in one and overrides where the data
comes from (lm-eval merges an include-path YAML with the built-in config; a dict of overrides
passed to simple_evaluate replaces it instead).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from megaloop.evaluation.exported import EvalError, load_model, load_tokenizer, placement

STUDY_TASKS = ("boolq", "winogrande", "commonsense_qa", "sciq", "piqa", "arc_easy",
               "arc_challenge", "hellaswag", "openbookqa")
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


def local_task_configs(tasks, data_dir: Path, into: Path, task_manager) -> None:
    """One YAML per task in `into`: the built-in task, reading DIR/<task>/<split>.jsonl."""
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    for name in tasks:
        entry = task_manager.task_index[name]
        cfg = load_yaml(entry.yaml_path, resolve_func=False)
        evaluated = cfg.get("test_split") or cfg.get("validation_split")
        override = {"include": str(entry.yaml_path), "task": name, "dataset_path": "json",
                    "dataset_name": None}
        files = {}
        for key in SPLIT_KEYS:
            split = cfg.get(key)
            if split is None:
                continue
            path = data_dir / name / f"{split}.jsonl"
            if path.is_file():
                files[split] = str(path.resolve())
            else:
                override[key] = None
        if evaluated not in files:
            raise EvalError(f"--data-dir {data_dir}: no {name}/{evaluated}.jsonl (lm-eval "
                            f"evaluates {name} on its {evaluated!r} split; one JSON object per "
                            f"line in the schema of the hub dataset {cfg.get('dataset_path')})")
        override["dataset_kwargs"] = {"data_files": files}
        (into / f"{name}.yaml").write_text(yaml.safe_dump(override, sort_keys=False))


def choices(sample: dict) -> tuple[np.ndarray, list[str], int]:
    """Per-choice log-likelihoods, continuations and the gold index of one logged sample."""
    lls = np.array([float(r[0]) for r in sample["filtered_resps"]])
    continuations = [context_and_continuation[1] for context_and_continuation in
                     sample["arguments"]]
    return lls, continuations, int(sample["target"])


def accuracies(samples: list[dict]) -> dict:
    """acc (argmax log-likelihood) and acc_norm (argmax per character, as lm-eval's acc_norm),
    recomputed from the logged samples, for every task alike."""
    acc, acc_norm = [], []
    for s in samples:
        lls, continuations, gold = choices(s)
        lengths = np.array([len(c) for c in continuations], dtype=float)
        acc.append(float(np.argmax(lls) == gold))
        acc_norm.append(float(np.argmax(lls / lengths) == gold))
    return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(acc_norm)), "n": len(samples)}


def run(model_path: Path, loops: int, tasks=STUDY_TASKS, out: Path = Path("eval_results"),
        limit: int | None = None, data_dir: Path | None = None, batch_size: int = 8,
        device: str | None = None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager()
    unknown = [t for t in tasks if t not in task_manager.task_index]
    if unknown:
        raise EvalError(f"unknown lm-eval task(s): {', '.join(unknown)}")
    if loops < 1:
        raise EvalError(f"--loops {loops}: must be >= 1")
    tokenizer = load_tokenizer(model_path)
    device, dtype = placement(device)
    model = load_model(model_path, device, dtype, num_loops=loops)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        if data_dir is not None:
            local_task_configs(tasks, Path(data_dir), Path(tmp), task_manager)
            task_manager = TaskManager(include_path=tmp)
        results = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=0, limit=limit,
                                  log_samples=True, task_manager=task_manager,
                                  bootstrap_iters=0)
    return write(results, out, {"model": str(model_path), "loops": loops, "limit": limit,
                                "data_dir": str(data_dir) if data_dir else None})


def write(results: dict, out: Path, run_info: dict) -> dict:
    """lm-eval's results.json and samples_<task>.jsonl, plus summary.json: per task acc and
    acc_norm recomputed from the samples, and their macro averages."""
    out.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples")
    (out / "results.json").write_text(json.dumps({**results, "megaloop": run_info}, indent=1,
                                                 default=str))
    per_task = {}
    for task, rows in samples.items():
        with open(out / f"samples_{task}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
        per_task[task] = accuracies(rows)
    summary = {**run_info, "tasks": per_task,
               "macro_acc": float(np.mean([t["acc"] for t in per_task.values()])),
               "macro_acc_norm": float(np.mean([t["acc_norm"] for t in per_task.values()]))}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def read_samples(folder: Path) -> dict[str, list[dict]]:
    files = sorted(folder.glob("samples_*.jsonl"))
    if not files:
        raise EvalError(f"{folder}: no samples_<task>.jsonl; give a folder written by "
                        f"`megaloop eval downstream`")
    return {f.stem[len("samples_"):]: [json.loads(line) for line in f.open()] for f in files}


def table(summary: dict) -> str:
    lines = ["| task | n | acc | acc_norm |", "|---|---|---|---|"]
    for task, r in summary["tasks"].items():
        lines.append(f"| {task} | {r['n']} | {r['acc']:.4f} | {r['acc_norm']:.4f} |")
    lines.append(f"| **macro** | | {summary['macro_acc']:.4f} | {summary['macro_acc_norm']:.4f} |")
    return "\n".join(lines)
