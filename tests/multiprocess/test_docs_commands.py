"""Every command the README and docs/ show either runs here, as written (at small sizes: extra
arguments appended, which win), or is listed below with the reason it cannot. A documented
command that fails fails this test; a new one fails it until it is listed."""

import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from multiproc import free_port
from support import ROOT, env

pytestmark = pytest.mark.multiprocess  # two torchrun launches among them

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "slurm/README.md"]
PROGRAMS = ("megaloop", "torchrun", "make", "python", "bash", "srun", "sbatch")

# In the order they run: later ones read what earlier ones wrote (runs/tiny, its export).
RUN = {
    "megaloop --help": [],
    "megaloop params configs/model/129m.yaml": [],
    "megaloop params configs/experiments/study/44m/per_loop_norm.yaml": [],
    "megaloop params configs/experiments/study/129m/per_loop_norm.yaml": [],
    "megaloop plan configs/experiments/study/129m/per_loop_norm.yaml --gpus 1 --gpu-mem 80": [],
    "megaloop plan configs/experiments/fineweb/1p4b_42b_tokens.yaml --gpus 128 --gpu-mem 80 "
    "--search": [],
    "megaloop train configs/experiments/tiny.yaml train.dir=runs/tiny train.steps=200": [
        "train.steps=6",
        "train.eval_batches=1",
    ],
    "torchrun --nproc-per-node 4 -m megaloop train configs/experiments/tiny.yaml parallel.tp=2 "
    "parallel.pp=2 train.micro_batch_size=4 train.dir=runs/tiny-tp2pp2": ["train.steps=2"],
    "megaloop ckpt consolidate runs/tiny-tp2pp2 --out runs/tiny-tp2pp2/consolidated": [],
    "torchrun --nproc-per-node 2 -m megaloop train configs/experiments/tiny.yaml engine=deepspeed "
    "deepspeed.zero_stage=3 train.micro_batch_size=4 train.dir=runs/tiny-zero3": ["train.steps=2"],
    "megaloop export runs/tiny --out runs/tiny/hf": [],
    "megaloop bench fixed-k runs/tiny/hf --data held_out.txt --loops 1,2,3,4": [
        "--batches",
        "2",
        "--warmup",
        "1",
        "--seq-len",
        "64",
    ],
    "megaloop bench generate runs/tiny/hf --data held_out.txt --batch-size 1,8 --out "
    "runs/tiny/bench-generate": ["--seq-len", "16", "--repeats", "1", "--threshold", "0.5"],
    'megaloop generate runs/tiny/hf --prompt "12+34=" --exit margin --threshold 2 --show-depth': [
        "--max-new-tokens",
        "8",
    ],
    "megaloop depth runs/tiny --data held_out.txt --loops 1,2,3,4,8 --out runs/tiny/measure": [
        "--sequences",
        "8",
        "--seq-len",
        "64",
    ],
    "megaloop halt runs/tiny --data held_out.txt --rho 1.01 --out runs/tiny/measure": [
        "--calib",
        "8",
        "--bench",
        "8",
        "--seq-len",
        "64",
    ],
    "megaloop diagnose runs/tiny --data held_out.txt --out runs/tiny/measure": [
        "--tokens",
        "256",
        "--seq-len",
        "64",
        "--rollout",
        "4",
    ],
    "megaloop report runs/ --out runs/report": [],
}
DRY_RUN = [  # Slurm submissions: rendered and checked, not submitted
    "megaloop slurm submit configs/experiments/fineweb/1p4b_42b_tokens.yaml --nodes 16 --gpus-per-node 8 --partition gpu --time 2-00:00:00 --sbatch-arg=--exclusive --dry-run train.dir=/path/to/shared/runs/fineweb-1p4b",
]
SKIP = {
    "make demo": "the demo itself (tests/unit/test_demo.py runs it short)",
    "make test": "this test suite",
    "make test-fast": "this test suite, less the multi-process and Slurm tests",
    "megaloop train configs/experiments/wikitext103/44m/per_loop_norm.yaml train.seed=1": "a 44M model on prepared WikiText-103 (bench/repro_mini trains the miniature)",
    "megaloop sweep configs/experiments/wikitext103/44m/*.yaml --seeds 0,1,2": "33 full runs (tests/unit/test_sweep.py sweeps the tiny config)",
    "megaloop sweep configs/experiments/wikitext103/44m/*.yaml --seeds 0,1,2 --executor slurm --nodes 1 --gpus-per-node 8 --partition gpu --time 1-00:00:00": "a Slurm cluster with GPUs (tests/cluster/test_slurm.py submits sweeps to a local cluster)",
    "megaloop sweep configs/experiments/fineweb/1p4b_{baseline,no_readout_norm}.yaml --seeds 0 --executor slurm --nodes 2 --gpus-per-node 8 --partition gpu": "a Slurm cluster with GPUs (tests/cluster/test_slurm.py)",
    "megaloop prep fineweb --source HuggingFaceFW/fineweb/sample/10BT --tokenizer tokenizer.json --seq-len 1664 --out data/fineweb_1664 --executor slurm --partition cpu": "FineWeb from the hub, on a Slurm cluster (tests/unit/data_prep/test_data_prep.py and tests/cluster/test_slurm.py prepare generated JSONL, locally and as a Slurm job)",
    "megaloop eval downstream runs/tiny/hf --loops 4 --out runs/tiny/eval-K4": "the tasks' data come from the hub (tests/unit/evaluation/test_downstream.py runs it on local task files)",
    "megaloop eval downstream runs/tiny/hf --loops 8 --out runs/tiny/eval-K8": "the tasks' data come from the hub (tests/unit/evaluation/test_downstream.py)",
    "megaloop eval compare runs/tiny/eval-K4 runs/tiny/eval-K8": "reads the two downstream runs above (tests/unit/evaluation/test_compare.py compares generated ones)",
    "megaloop import ouro path/to/Ouro-1.4B --out runs/ouro-1p4b": "Ouro-1.4B's weights from the hub (tests/unit/test_ouro.py imports a generated Ouro folder)",
    "megaloop train configs/experiments/fineweb/1p4b_baseline.yaml train.init_from=runs/ouro-1p4b": "a 1.4B model (tests/unit/test_ouro.py trains from an import)",
    "megaloop export runs/fineweb/1p4b_baseline/seed0 --out runs/1p4b-ouro --format ouro": "a 1.4B run (tests/unit/test_ouro.py exports a small one in Ouro's format)",
    "megaloop prep wikitext103 --source Salesforce/wikitext --tokenizer words:20000 --layout stream --out data/wikitext103_study": "WikiText-103 from the hub (tests/unit/data_prep/test_wikitext103.py prepares generated text the same way)",
    "megaloop sweep configs/experiments/study/44m/*.yaml --seeds 42,101,202 --executor slurm --nodes 1 --gpus-per-node 1 --partition gpu": "a Slurm cluster with GPUs (tests/cluster/test_slurm.py)",
    "megaloop sweep configs/experiments/study/129m/*.yaml --seeds 42,101,202 --executor slurm --nodes 1 --gpus-per-node 1 --partition gpu": "a Slurm cluster with GPUs (tests/cluster/test_slurm.py)",
    'megaloop depth "$run" --data data/wikitext103_study/valid --loops 1,2,3,4,8 --out "$run/measure"': "the study's runs (bench/study_mini measures its miniature so; tests/multiprocess/test_study_mini.py)",
    'megaloop halt "$run" --data data/wikitext103_study/valid --out "$run/measure"': "the study's runs (bench/study_mini)",
    'megaloop diagnose "$run" --data data/wikitext103_study/valid --dtype bf16 --out "$run/measure"': "the study's runs (bench/study_mini)",
    "megaloop report runs/study/44m --out reports/study-44m": "the study's runs (bench/study_mini reports its miniature)",
    "python tests/mutants/run.py": "minutes of test runs over every mutant; not a CI step (docs/testing.md)",
    "megaloop prep wikitext103 --source data/wikitext103_cpu_source --tokenizer words:20000 --layout stream --out data/wikitext103_cpu": "the real WikiText-103 text beside the repository (bench/study_mini runs this prep; tests/multiprocess/test_study_mini.py its smoke, on generated text)",
    "megaloop train configs/experiments/adaptive_depth/stage1.yaml objective.exit_kv=copy objective.exit_rate=0.5 train.dir=runs/exits/stage1": "3,000 steps of exit-aware training (bench/adaptive_depth trains it; tests/unit/train/test_trainer.py takes steps of it)",
    "megaloop train configs/experiments/adaptive_depth/stage2.yaml objective.exit_kv=copy objective.exit_rate=0.5 train.init_from=runs/exits/stage1/checkpoints/step_0003000 train.dir=runs/exits/stage2": "reads the run above (bench/adaptive_depth trains both stages; its smoke test a few steps of each)",
    "megaloop train configs/experiments/study/44m/per_loop_norm.yaml train.bf16=false data.path=data/wikitext103_cpu/train data.valid_path=data/wikitext103_cpu/valid model.vocab_size=17457 model.hidden_size=96 model.num_heads=4 model.num_layers=2 model.max_seq_len=128 data.seq_len=128 data.stride=64 data.epochs=null train.steps=200 train.micro_batch_size=16 train.global_batch_size=16 train.eval_every=50 train.eval_batches=16 wandb.mode=disabled": "reads the prep above: 10 minutes on 2 cores (bench/study_mini trains this shape; its smoke test a few steps of it)",
}


def documented() -> list[str]:
    """The commands in the docs' shell blocks: continuation lines joined, comments and the
    `.venv/bin/` prefix dropped; synopses (CAPITALS or [options] as placeholders) left out."""
    commands = []
    for path in DOCS:
        for language, block in re.findall(r"```(\w*)\n(.*?)```", path.read_text(), re.S):
            if language not in ("", "bash", "sh"):
                continue
            for line in re.sub(r"\\\n\s*", "", block).splitlines():
                line = re.sub(r"\s+#.*$", "", line.strip()).removeprefix(".venv/bin/")
                words = line.split()
                if not words or words[0] not in PROGRAMS or "..." in line:
                    continue
                if "[" in line or any(re.match(r"[A-Z][A-Z_]{2,}", w) for w in words):
                    continue  # a synopsis: MODEL, CONFIG, DIR_..., [--options]
                commands.append(" ".join(words))
    return commands


def test_every_documented_command_is_run_here_or_says_why_not():
    unlisted = [c for c in documented() if c not in RUN and c not in DRY_RUN and c not in SKIP]
    assert not unlisted, "documented commands this test does not know (add them): " + "\n".join(
        unlisted
    )
    stale = [c for c in [*RUN, *DRY_RUN, *SKIP] if c not in documented()]
    assert not stale, "listed here, documented nowhere: " + "\n".join(stale)


def test_prepared_data_is_what_the_configs_after_it_read():
    """The commands chain: a config a README block trains or sweeps after `megaloop prep` reads
    the folder prep wrote, at the window prep packed (data.path, data.seq_len)."""
    from megaloop import experiment

    prepared = {}
    for command in documented():
        words = command.split()
        if words[:2] == ["megaloop", "prep"] and "--out" in words and "--seq-len" in words:
            out, seq_len = words[words.index("--out") + 1], words[words.index("--seq-len") + 1]
            prepared[out] = int(seq_len)
        elif words[:2] in (["megaloop", "sweep"], ["megaloop", "train"]) and prepared:
            for pattern in (w for w in words[2:] if w.startswith("configs/")):
                for config in expand(pattern):
                    overrides = [w for w in words[2:] if "=" in w and not w.startswith("-")]
                    data = experiment.load(ROOT / config, overrides).data
                    path = getattr(data, "path", None)
                    if data.kind in ("indexed", "webdataset") and path in prepared:
                        assert prepared[path] == data.seq_len, (config, path)
                    elif data.kind in ("indexed", "webdataset"):
                        near = [p for p in prepared if p.split("_")[0] == path.split("_")[0]]
                        assert not near, f"{config} reads {path}; the docs prepare {near}"


def expand(pattern: str) -> list[str]:
    """A shell word's configs: {a,b} alternatives and * globs, as bash expands them."""
    match = re.search(r"\{([^}]*)\}", pattern)
    if match:
        return [
            c
            for alt in match.group(1).split(",")
            for c in expand(pattern[: match.start()] + alt + pattern[match.end() :])
        ]
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern)) or [pattern]


def argv(command: str, extra: list[str]) -> list[str]:
    words = shlex.split(command)
    if words[0] == "megaloop":
        return [sys.executable, "-m", "megaloop", *words[1:], *extra]
    assert words[0] == "torchrun"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--master-port={free_port()}",
        *words[1:],
        *extra,
    ]


def lanes() -> list[list[str]]:
    """RUN's commands in two lanes that run side by side, each in RUN's order: what reads or
    writes runs/tiny (the one-process run, its export and measurements), and the rest. The
    report, which reads every run, is left for after both."""
    tiny = [
        c for c in RUN if re.search(r"runs/tiny[ /]", c) and not c.startswith("megaloop report")
    ]
    rest = [c for c in RUN if c not in tiny and not c.startswith("megaloop report")]
    return [tiny, rest]


def test_the_documented_commands_run(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "held_out.txt").write_text(
        "".join(f"{a:04d}+{b:04d}={a + b:05d}\n" for a, b in rng.integers(0, 10**4, (400, 2)))
    )

    def run(commands: list[str]) -> None:
        for command in commands:
            proc = subprocess.run(
                argv(command, RUN[command]),
                cwd=tmp_path,
                env=env(),
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"

    with ThreadPoolExecutor(2) as pool:  # one process of a lane at a time beside the other's
        for done in [pool.submit(run, lane) for lane in lanes()]:
            done.result()
    run([c for c in RUN if c.startswith("megaloop report")])
    for command in DRY_RUN:
        proc = subprocess.run(
            argv(command, ["--dry-run"]),
            cwd=tmp_path,
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0 and "#SBATCH --nodes=16" in proc.stdout, proc.stderr[-3000:]
    assert (tmp_path / "runs/report").is_dir() and (tmp_path / "runs/tiny/hf/config.json").is_file()
