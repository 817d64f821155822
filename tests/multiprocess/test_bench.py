"""Every benchmark script runs end to end at tiny shapes, and what it prints is sane: its figures
agree with each other and with what the test computes on its own (token, FLOP and document
counts, the sign test behind a verdict, equal losses where a script promises them), and every
verdict it prints is the passing one (bf16.py's is also run past a tolerance, to see it fail).
Timings themselves are never checked, nor a verdict that depends on them: they depend on the
machine and its load. (bench/gpu.sh has a test of its own; bench/gpu_wheels.sh's is in
tests/unit/bench/test_bench_scripts.py.)
"""

import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from megaloop.train.metrics import read as read_metrics
from support import ROOT, article, bench_env, miniature_source, web_documents, wikitext

pytestmark = pytest.mark.multiprocess

NUMBER = r"([-+]?\d[\d,]*\.?\d*(?:e[-+]?\d+)?)"
FLOAT = r"(\d[\d,]*\.\d+)"
TORCHRUN_2 = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "2",
]


def run(
    name: str,
    *args: str,
    smoke: bool = True,
    launcher=None,
    timeout: int = 300,
    exit_code: int = 0,
    env: dict | None = None,
) -> str:
    """`python -m bench NAME [--smoke] ARGS` from the repository root (`launcher` in place of
    `python`), one thread a process, `env` added to the environment; its stdout (it must exit
    with `exit_code`)."""
    proc = subprocess.run(
        [
            *(launcher or [sys.executable]),
            *("-m", "bench", name),
            *(["--smoke"] if smoke else []),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})},
    )
    assert proc.returncode == exit_code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def num(text: str) -> float:
    return float(text.replace(",", ""))


def ratio(out: str, label: str) -> float:
    match = re.search(re.escape(label) + r": " + NUMBER + "x", out)
    assert match, out
    value = float(match.group(1))
    assert math.isfinite(value) and value > 0
    return value


def table_rows(out: str) -> list[list[str]]:
    """The cells of a Markdown table's body rows."""
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows[1:]]


def table_numbers(out: str) -> list[float]:
    cells = [c for row in table_rows(out) for c in row]
    numbers = [num(m) for c in cells for m in re.findall(NUMBER, c)]
    assert numbers and all(math.isfinite(n) for n in numbers), out
    return numbers


def rounded(value: float, printed: float, decimals: int) -> bool:
    """`printed` is `value` shown with `decimals` decimals (a unit of slack for float error)."""
    return abs(value - printed) <= 10**-decimals


def quotient_interval(a: float, b: float, decimals_a: int, decimals_b: int) -> tuple:
    """The range of a/b for the true values behind a and b printed with those decimals."""
    ea, eb = 0.5 * 10**-decimals_a, 0.5 * 10**-decimals_b
    return (a - ea) / (b + eb), (a + ea) / (b - eb) if b > eb else math.inf


def sign_test(slower: int, pairs: int) -> float:
    """Two-sided sign-test p of `slower` of `pairs` ratios above 1 (computed here, not
    imported from bench/common/alternation.py, so the test checks the script's arithmetic)."""
    tail = sum(math.comb(pairs, i) for i in range(min(slower, pairs - slower) + 1)) / 2**pairs
    return min(1.0, 2 * tail)


# -- the alternating-process benchmarks (bench/overhead.py and its users) ---------------------


def test_overhead_smoke():
    """Both thread counts, every comparison; with one round a ratio is the quotient of the two
    times it prints, the once-a-run parts add up to their total, and the outside view follows
    from that total and the warm steps."""
    out = run("overhead", "--steps", "100")
    ours, ref = re.search(r"parameters " + NUMBER + " = " + NUMBER, out).groups()
    assert ours == ref
    losses = re.search(r"loss at init (\S+) \(megaloop\) vs (\S+) \(reference\), (\S+) ", out)
    assert losses and len(set(losses.groups())) == 1, out
    rows = table_rows(out)
    steps = [r for r in rows if r[0] in ("1", "2") and "x (" in r[4]]
    assert [(r[0], r[1].split(":")[0].split(",")[0]) for r in steps] == [
        (t, what)
        for t in ("1", "2")
        for what in ("model", "training step (optimizer included)", "model")
    ], out
    warm = {}
    for threads, what, a, b, wall, _cpu in steps:
        low, high = quotient_interval(num(a), num(b), 1, 1)
        value = float(wall.split("x")[0])
        assert low - 1e-3 <= value <= high + 1e-3, (what, a, b, wall)
        if what.startswith("training step"):
            warm[threads] = num(a) / 1e3, num(b) / 1e3
    rope = [r for r in rows if len(r) == 6 and r[4].endswith("%")]
    assert [r[0] for r in rope] == ["1", "2"], out
    for threads, stock, once, saved, share, _masks in rope:
        assert abs(num(stock) - num(once) - num(saved)) <= 0.011, (stock, once, saved)
        step_ms = 1e3 * warm[threads][0]
        low, high = quotient_interval(100 * num(saved), step_ms, 0, 1)  # saved: 2 decimals
        assert low - 0.01 <= num(share.rstrip("%")) <= high + 0.01, (saved, step_ms, share)
    table_numbers(out)
    once = {r[0]: (num(r[1]), num(r[2])) for r in rows if len(r) == 3 and r[0] != "part"}
    total = once.pop("total")
    for side in (0, 1):
        assert abs(sum(v[side] for v in once.values()) - total[side]) <= 0.005 * len(once) + 1e-9
    seen = re.search(
        r"measured from outside over 100 steps \(megaloop / plain PyTorch\): 1 thread\(s\) "
        + FLOAT
        + r"x, 2 thread\(s\) "
        + FLOAT
        + "x",
        out,
    )
    assert seen, out
    for threads, printed in zip(("1", "2"), seen.groups()):
        (a, b), err = warm[threads], 0.005 + 100 * 0.05e-3  # the printed figures' rounding
        low = (total[0] + 100 * a - err) / (total[1] + 100 * b + err)
        high = (total[0] + 100 * a + err) / (total[1] + 100 * b - err)
        assert low - 1e-3 <= num(printed) <= high + 1e-3, (threads, printed, out)


VERDICT = re.compile(
    r"^(?P<label>on / off|CPU time on / off): (?P<ratio>\d+\.\d+)x \(median of (?P<n>\d+) "
    r"per-pair ratios, min\.\.max (?P<low>\d+\.\d+)\.\.(?P<high>\d+\.\d+), bootstrap 95% of "
    r"the median (?P<ci_low>\d+\.\d+)\.\.(?P<ci_high>\d+\.\d+)\); (?P<slower>\d+) of "
    r"(?P<n2>\d+) pairs slower with the penalty, sign test p = (?P<p>\d+\.\d+): overhead "
    r"(?P<verdict>resolvable|not resolvable) at 5%$"
)


def test_norm_penalty_smoke():
    """Whether the overhead is resolvable depends on the timings; that each line's verdict
    follows from its own counts does not."""
    out = run("norm_penalty")
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["0 (off)", "0.001 (on)"], out
    table_numbers(out)
    for label in ("on / off", "CPU time on / off"):
        lines = [line for line in out.splitlines() if line.startswith(label + ":")]
        assert len(lines) == 1, out
        m = VERDICT.match(lines[0])
        assert m and m["label"] == label, lines[0]
        n, slower = int(m["n"]), int(m["slower"])
        assert n == int(m["n2"]) == 1 and 0 <= slower <= n  # --smoke: one pair
        low, mid, high = float(m["low"]), float(m["ratio"]), float(m["high"])
        assert 0 < low <= mid <= high and low <= float(m["ci_low"]) <= float(m["ci_high"]) <= high
        if n == 1 and mid != 1.0:  # one ratio: it is the median, and slower says which side of 1
            assert slower == int(mid > 1), lines[0]
        p = sign_test(slower, n)
        assert m["p"] == f"{p:.2f}", lines[0]
        assert m["verdict"] == ("resolvable" if p < 0.05 else "not resolvable"), lines[0]


BF16_SMALL = [  # bf16.py's --smoke shapes; run without --smoke, which allows one pair only
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.num_layers=1",
    "model.num_loops=2",
    "data.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]


@pytest.mark.one_at_a_time
def test_bf16_smoke(tmp_path):
    # two processes a side, so that "curves identical" compares two runs of each precision
    written = tmp_path / "bf16.json"
    out = run(
        "bf16",
        *("--pairs", "2", "--steps", "3", "--warmup", "1", "--json", str(written)),
        *BF16_SMALL,
        smoke=False,
    )
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    rel = []
    for _, fp32, bf16, delta, percent in rows:
        fp32, bf16, delta = float(fp32), float(bf16), float(delta)
        assert fp32 > 0 and bf16 > 0, rows
        assert rounded(bf16 - fp32, delta, 4), rows
        rel.append(float(percent.rstrip("%")))
        assert abs(rel[-1] - 100 * abs(delta) / fp32) <= 0.01 + 100 * 1.5e-4 / fp32, rows
    worst = re.search(r"max \|Δloss\|/loss_fp32 " + FLOAT + r"% \(step (\d)\)", out)
    assert worst and float(worst[1]) == max(rel) and rel[int(worst[2]) - 1] == max(rel), out
    assert re.search(r"; tolerance 2% a step: PASS$", out, re.M), out  # not FAIL
    assert max(rel) <= 2.0
    assert "curves identical across each side's 2 processes: yes" in out
    ratio(out, "bf16 / fp32")
    # the bf16 side ran under autocast: its curve is not the fp32 one (the table's 4 decimals can
    # round a gap of bf16 roundings to +0.0000, the JSON keeps it whole)
    curves = json.loads(written.read_text())
    assert all(rounded(d, float(r[3]), 4) for d, r in zip(curves["delta"], rows)), curves
    assert any(b != a for a, b in zip(curves["loss_fp32"], curves["loss_bf16"])), curves


@pytest.mark.one_at_a_time
def test_bf16_fails_a_step_past_its_tolerance(tmp_path):
    """The verdict can fail: a tolerance below the gap bf16's roundings leave (about 2e-5 of the
    loss at these shapes) prints FAIL and exits 1."""
    written = tmp_path / "bf16.json"
    out = run(
        "bf16",
        *("--pairs", "1", "--steps", "3", "--warmup", "1", "--json", str(written)),
        *("--tolerance", "1e-6"),
        *BF16_SMALL,
        smoke=False,
        exit_code=1,
    )
    curves = json.loads(written.read_text())
    gap = max(abs(b - a) / a for a, b in zip(curves["loss_fp32"], curves["loss_bf16"]))
    assert gap > 1e-6, curves  # the run's own gap is past the tolerance it was given
    assert re.search(r"; tolerance 0\.0001% a step: FAIL$", out, re.M), out


# -- the other scripts ------------------------------------------------------------------------


@pytest.mark.one_at_a_time
def test_attention_smoke():
    out = run(
        "attention",
        *("--hidden", "32", "--heads", "4", "--layers", "1", "--loops", "2"),
        *("--seq", "16", "--batch", "2", "--repeats", "2"),
        smoke=False,
    )
    assert "shape: d=32 heads=4 L=1 K=2 T=16 B=2, 2 timed steps each, 1 threads" in out, out
    med = dict(re.findall(r"^ +(megatron|sdpa): median step +" + FLOAT + " ms$", out, re.M))
    assert set(med) == {"megatron", "sdpa"}, out
    megatron, sdpa = float(med["megatron"]), float(med["sdpa"])
    assert megatron > 0 and sdpa > 0
    low, high = quotient_interval(megatron, sdpa, 2, 2)
    r = ratio(out, "megatron DotProductAttention / SDPA step time")
    assert low - 0.005 <= r <= high + 0.005, (r, megatron, sdpa)


def test_engines_smoke(tmp_path):
    out = run(
        "engines",
        "--steps",
        "1",
        *("model.hidden_size=32", "model.num_layers=1", "model.num_loops=2", "data.seq_len=16"),
        *("train.micro_batch_size=2", "train.global_batch_size=4", f"train.dir={tmp_path}"),
        smoke=False,
        launcher=TORCHRUN_2,
    )
    assert "2 ranks x 1 threads, 1 OMP threads; median of 1 steps" in out, out
    rows = re.findall(r"^(\S.*?) +" + FLOAT + " +" + FLOAT + "x$", out, re.M)
    names = ["torch DDP", "megatron engine", *(f"deepspeed ZeRO-{s}" for s in range(4))]
    assert [r[0] for r in rows] == names, out
    ref = float(rows[0][1])
    assert rows[0][2] == "1.00"
    for _, ms, vs in rows:
        assert float(ms) > 0
        low, high = quotient_interval(float(ms), ref, 1, 1)
        assert low - 0.005 <= float(vs) <= high + 0.005, rows


@pytest.mark.one_at_a_time
def test_mfu_smoke():
    """FLOPs per token recovered from the printed TFLOP/s and tokens/s equal the planner's
    count at each K; the step and MFU columns follow from the printed figures."""
    import torch

    from megaloop import experiment
    from megaloop.parallel.cost import flops_per_token, loss_exits

    config = "configs/experiments/tiny.yaml"
    small = ["model.hidden_size=32", "model.num_layers=1", "data.seq_len=16"]
    small += ["train.micro_batch_size=2"]
    peak = 0.001  # TFLOP/s: so that the MFU column shows more than 0.0%
    out = run(
        "mfu",
        config,
        "--steps",
        "2",
        "--warmup",
        "1",
        "--peak-tflops",
        str(peak),
        *small,
        smoke=False,
    )
    assert re.search(r" on \S+, 32 tokens a step, median of 2 steps after 1 warm-up", out), out
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["4", "1"], out  # the config's K, then K=1
    tps = {}
    for k, step_s, tokens_s, tflops, mfu, memory, _ in rows:
        cfg = experiment.load(config, [*small, f"model.num_loops={k}"])
        expected = flops_per_token(cfg.model, 16, loss_exits(cfg))
        tps[k], tflops = num(tokens_s), float(tflops)
        assert tps[k] > 0 and tflops > 0, rows
        # tokens/s printed to the unit, TFLOP/s to 3 significant digits
        assert tflops * 1e12 / tps[k] == pytest.approx(expected, rel=0.01), (k, expected, rows)
        low, high = quotient_interval(32, float(step_s), 9, 3)
        assert low * 0.999 <= tps[k] + 0.5 and tps[k] - 0.5 <= high * 1.001, rows
        assert float(mfu.rstrip("%")) == pytest.approx(100 * tflops / peak, rel=0.006, abs=0.05)
        if not torch.cuda.is_available():
            assert memory == "0.0"
    assert rows[1][6] == "1.00x"
    assert float(rows[0][6].rstrip("x")) == pytest.approx(tps["1"] / tps["4"], rel=0.01, abs=0.006)


@pytest.mark.one_at_a_time  # one process, memory counted, not timed
def test_residual_memory_smoke():
    """An fp32 residual keeps more for backward than a bf16 one, by at least one H-sized tensor
    a layer application at 2 bytes more a value and at most two a layer application plus the
    K readouts' inputs (the sublayer inputs and what each exit reads); the extra does not depend
    on dropout, and the ratio column is the quotient of the two cells."""
    d, layers, loops, seq, batch = 64, 2, 4, 32, 2
    out = run(
        "residual_memory",
        *("--config", "configs/experiments/study/44m/per_loop_norm.yaml"),
        *("--seq", str(seq), "--batch", str(batch)),
        f"model.hidden_size={d}",
        *("model.num_heads=4", f"model.num_layers={layers}", f"model.num_loops={loops}"),
        *("model.vocab_size=512", "model.max_seq_len=32", "data.stride=16"),
        smoke=False,
    )
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["0.1", "0"], out
    value = 2 * d * seq * batch / 2**20  # MiB: 2 bytes more for each value of one H
    extras = []
    for _, fp32, bf16, ratio, extra, _ in rows:
        fp32, bf16, extra = float(fp32), float(bf16), float(extra)
        assert float(ratio.rstrip("x")) == pytest.approx(fp32 / bf16, abs=0.002), rows
        assert extra == pytest.approx(fp32 - bf16, abs=0.0011)
        assert layers * loops * value * 0.99 <= extra <= (2 * layers + 1) * loops * value * 1.01
        extras.append(extra)
    assert extras[0] == extras[1], rows


@pytest.mark.one_at_a_time
def test_recompute_memory_smoke():
    """Memory counted, not timed: it grows with K for every option, recompute keeps less than
    none (loop least: one tensor a loop against full's one a layer), the ratio column is the
    cell over none, and `megaloop plan` is within 15% (the bound of
    tests/unit/parallel/test_planner.py)."""
    out = run(
        "recompute_memory",
        *("--hidden", "64", "--heads", "4", "--layers", "2", "--seq", "128", "--batch", "4"),
        *("--vocab", "256", "--loops", "1,2,4"),
        smoke=False,
    )
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["1", "2", "4"], out
    options = ("none", "selective", "full", "loop")
    mib = {o: [] for o in options}
    for row in rows:
        cells = dict(zip(options, row[1:], strict=True))
        for option, cell in cells.items():
            m = re.fullmatch(FLOAT + r" \(" + FLOAT + r"x\) / " + FLOAT, cell)
            assert m, cell
            kept, vs_none, planned = (float(g) for g in m.groups())
            mib[option].append(kept)
            low, high = quotient_interval(kept, mib["none"][-1], 1, 1)
            assert low - 0.005 <= vs_none <= high + 0.005, (option, row)
            assert abs(planned - kept) <= 0.15 * kept + 0.1, (option, row)
        assert cells["none"].split()[1] == "(1.00x)"
        assert mib["loop"][-1] <= mib["full"][-1] < 0.5 * mib["none"][-1], row
        assert mib["selective"][-1] <= mib["none"][-1], row
    for option, values in mib.items():
        assert values == sorted(set(values)), (option, values)  # strictly more at each K


@pytest.mark.one_at_a_time
def test_preempt_resume_smoke(tmp_path):
    """The round trip's two loss curves are equal at every step, the table is what the two
    runs logged, and the verdict is PASS. The caller's environment holds a LOCAL_RANK (as
    DeepSpeed's one-process default leaves one): the signal still goes to the worker, not to
    torchrun's agent."""
    out = run(
        "preempt_resume",
        *("--out", str(tmp_path)),
        *("--steps", "4", "--at", "2"),
        *("model.hidden_size=32", "model.num_layers=1", "data.seq_len=16"),
        *("train.micro_batch_size=2", "train.global_batch_size=2"),
        smoke=False,
        env={"LOCAL_RANK": "0"},
    )
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["1", "2", "3", "4"], out
    logged = {
        name: [s["loss"] for s in read_metrics(tmp_path / name)["steps"]]
        for name in ("reference", "preempted")
    }
    for (step, uninterrupted, resumed, rel), a, b in zip(
        rows, logged["reference"], logged["preempted"], strict=True
    ):
        assert uninterrupted == resumed == f"{a:.6f}" == f"{b:.6f}", (step, a, b)
        assert float(rel) == 0.0
    log = (tmp_path / "preempted.log").read_text()
    assert "preempted at step 2" in log and f"resumed from {tmp_path}/preempted" in log
    assert re.search(
        r"^largest relative difference 0\.0e\+00 \(accepted: 1e-05\): PASS$", out, re.M
    )


@pytest.mark.one_at_a_time
def test_prep_throughput_smoke(tmp_path):
    """On a tiny corpus made here in the layout the script reads (--data): the documents and
    tokens it reports are the articles and their tokens counted here, the web documents read
    are those kept plus those each filter dropped, and the packed sequences are the kept
    tokens in whole sequences of 1,025."""
    import random

    from tokenizers import Tokenizer

    from data_prep.common import train_bpe
    from data_prep.wikitext103 import split_articles

    rng = random.Random(0)
    data = tmp_path / "data"
    (data / "wikitext-103").mkdir(parents=True)
    wiki = {
        split: wikitext(rng, [f"{split} {i}" for i in range(n)])
        for split, n in (("valid", 3), ("test", 4))
    }
    for split, text in wiki.items():
        (data / f"wikitext-103/wiki.{split}.raw").write_text(text)
    good, designed = web_documents(rng)
    good += [{"text": article(rng, 3)} for _ in range(12)]
    web = data / "web/dolma-cc-sample"
    web.mkdir(parents=True)
    records = [*good, *designed.values()]
    (web / "cc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (data / "tokenizers/gpt2").mkdir(parents=True)
    tok_path = train_bpe(
        [*wiki.values(), *(r["text"] for r in records)],
        300,
        data / "tokenizers/gpt2/tokenizer.json",
    )
    out = run("prep_throughput", "--data", str(data), "--out", str(tmp_path / "out"), smoke=False)

    tok = Tokenizer.from_file(str(tok_path))
    articles = [a for text in wiki.values() for a in split_articles(text)]
    tokens = sum(len(tok.encode(a).ids) + 1 for a in articles)  # each article and its EOS
    m = re.search(
        rf"^wikitext103 \(valid\+test\): (\d+) documents, {NUMBER} tokens, {FLOAT} s wall "
        rf"\({NUMBER} tokens/s\), {FLOAT} s in pipeline steps \({NUMBER} tokens/s\); "
        rf"tokenizer\.encode_batch alone {NUMBER} tokens/s; pipeline steps / tokenizer = "
        rf"{FLOAT}$",
        out,
        re.M,
    )
    assert m, out
    assert int(m[1]) == len(articles) == 7 and num(m[2]) == tokens, (m[0], tokens)
    wall, steps = float(m[3]), float(m[5])
    # seconds print to 0.01: the steps' share of a tiny corpus can round to 0.00 on a fast machine
    assert 0 <= steps <= wall + 0.01 and num(m[6]) > 0 and num(m[7]) > 0 and float(m[8]) > 0, m[0]

    m = re.search(
        rf"^fineweb \(Common Crawl sample\): (\d+) documents read, (\d+) kept \({FLOAT}%\), "
        rf"{NUMBER} tokens, (\d+) sequences of 1,025 in (\d+) shards;",
        out,
        re.M,
    )
    assert m, out
    read, kept, percent, tokens, sequences, shards = (num(g) for g in m.groups())
    assert read == len(records) and kept == len(good), (m[0], len(records), len(good))
    assert rounded(100 * kept / read, percent, 1)
    assert sequences == tokens // 1025 >= 1 and shards == math.ceil(sequences / 64), m[0]
    dropped = re.findall(
        r"^  .+? dropped +(\d+) \( *" + FLOAT + r"% of read\)(?:: (.*))?$", out, re.M
    )
    assert dropped and kept + sum(int(d[0]) for d in dropped) == read, (out, read, kept)
    for total, share, reasons in dropped:
        assert rounded(100 * int(total) / read, float(share), 1), dropped
        if reasons:  # the reasons of a filter add up to its total
            assert sum(int(r.rsplit(" ", 1)[1]) for r in reasons.split(", ")) == int(total)


@pytest.mark.one_at_a_time
def test_metrics_log_smoke():
    """One log call's cost at each size, both sides: a table row per size and the growth line
    (which side grows is the benchmark's to report, not this test's)."""
    out = run("metrics_log", "--records", "10,200", "--calls", "3", smoke=False)
    rows = re.findall(
        r"^\| ([\d,]+) \| ([\d,]+) µs \| ([\d,]+) µs \| " + FLOAT + r"x \|$", out, re.M
    )
    assert [r[0] for r in rows] == ["10", "200"], out
    for _, append, rewrite, ratio in rows:
        a, r = (float(x.replace(",", "")) for x in (append, rewrite))
        assert a > 0 and r > 0 and float(ratio) == pytest.approx(a / r, rel=0.05, abs=1e-4), out
    assert re.search(r"one call at 200 records / at 10: append " + FLOAT + r"x \(goal <= 2\)", out)


@pytest.mark.one_at_a_time  # its commands one after another, one thread each under --smoke
def test_generate_mini_smoke(tmp_path):
    """bench/generate_mini --smoke: its exit-gate model trained and exported at a toy size, then
    every run of `bench generate` at batch 1 and 8 recorded, each with the KV slots its policy
    holds, its speed and CE finite and consistent with its own timings and with fixed K_max."""
    env = bench_env()
    script, work, out = str(ROOT / "bench/generate_mini"), tmp_path / "work", tmp_path / "out"
    # refused before any work: no OUT (--smoke never writes docs/generation/), no source text
    env["GEN_WORK"], env["REPRO_SOURCE"] = str(work), str(tmp_path / "missing")
    for args, message in (([], "needs an OUT folder"), (["--out", str(out)], "set REPRO_SOURCE")):
        proc = subprocess.run(
            [script, "--smoke", *args], capture_output=True, text=True, env=env, timeout=60
        )
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert not work.exists() and not out.exists()

    source = miniature_source(tmp_path, seed=5)
    env["REPRO_SOURCE"] = str(source)
    smoke = [script, "--smoke", "--out", str(out)]
    proc = subprocess.run(smoke, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (work / "source/wiki.valid.raw").resolve() == (source / "wiki.valid.raw").resolve()
    trained = read_metrics(work / "run")["config"]
    assert trained["objective"]["kind"] == "exit_weighted" and trained["model"]["exit_gate"]
    assert trained["model"]["hidden_size"] == 32 and trained["train"]["steps"] == 4
    assert (work / "run/checkpoints/step_0000004").is_dir()
    exported = json.loads((work / "hf/config.json").read_text())
    assert exported["exit_gate"] and exported["hidden_size"] == 32

    result = json.loads((out / "generate.json").read_text())
    assert (out / "generate.png").is_file()
    # recorded relative to the scratch folder, which lies outside the repository here
    assert result["model"]["path"] == "hf" and result["settings"]["data"] == result["data"]
    assert result["data"] == "source/wiki.valid.raw"
    settings, k_max, decoded = result["settings"], result["k_max"], result["decoded_tokens_per_row"]
    # the gate was trained
    assert k_max == 4 and settings["rules"] == ["gate", "margin", "confidence"]
    assert settings["batch_sizes"] == [1, 8] and settings["repeats"] == 2
    assert result["seq_len"] == 16 and decoded == 16 - result["prompt_tokens"]
    runs = result["runs"]
    fixed = {(r["batch_size"], r["loops"]) for r in runs if r["exit"] == "fixed"}
    assert fixed == {(b, k) for b in (1, 8) for k in range(1, k_max + 1)}
    groups = Counter(
        (r["batch_size"], r["exit"], r["kv"], r["batching"]) for r in runs if r["exit"] != "fixed"
    )
    # async decodes copy and share only, and only with more than one row
    assert groups == {
        (b, rule, kv, batching): 4  # the default thresholds, four per rule
        for b in (1, 8)
        for rule in ("gate", "margin", "confidence")
        for kv in ("copy", "share", "recompute")
        for batching in ("sync", "async")
        if batching == "sync" or (b > 1 and kv != "recompute")
    }
    for b in (1, 8):
        base = next(
            r for r in runs if r["batch_size"] == b and r["exit"] == "fixed" and r["loops"] == k_max
        )
        assert base["ce_vs_fixed_kmax"] == 0 and base["speedup"] == pytest.approx(1)
        for r in (r for r in runs if r["batch_size"] == b):
            slots = r["loops"] if r["exit"] == "fixed" else 1 if r["kv"] == "share" else k_max
            assert r["kv_slots_per_layer"] == slots, r
            assert len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"]), r
            assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
            assert r["tokens_per_s"] == pytest.approx(b * decoded / min(r["seconds"]))
            assert math.isfinite(r["ce"]) and 0 < r["ce"] < 2 * math.log(exported["vocab_size"])
            assert r["ce_vs_fixed_kmax"] == pytest.approx(r["ce"] - base["ce"], abs=1e-9)
            assert 1 <= r["mean_loops"] <= k_max, r
    report = (out / "generate.md").read_text()
    assert len(re.findall(r"^\| [18] \| ", report, re.M)) == len(runs)
    assert report.startswith("# bench generate: hf\n")


def test_adaptive_depth_smoke(tmp_path):  # two worker lanes, then two pinned processes
    """bench/adaptive_depth --smoke: three models (one layer a loop trained at full depth and
    exit-aware, four layers exit-aware), two seeds each, trained in two stages (exit-weighted,
    then the gate alone from stage 1's checkpoint, the model's overrides on both) and exported,
    the per-token evidence over each kind of token, every run of `bench generate` at batch 1
    and 8 over its batches on the exit-aware models, their profile, one verdict per exit
    setting, and the reports with their figures."""
    script, work, out = str(ROOT / "bench/adaptive_depth"), tmp_path / "work", tmp_path / "out"
    env = bench_env()
    env["ADAPTIVE_WORK"] = str(work)
    proc = subprocess.run([script, "--smoke"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1 and "needs an OUT folder" in proc.stderr, proc.stderr
    assert not work.exists()
    smoke = [script, "--smoke", "--out", str(out)]
    proc = subprocess.run(smoke, capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    layers = {"one_layer": 1, "one_layer_exits": 1, "four_layers_exits": 4}
    for (variant, n), seed in itertools.product(layers.items(), (0, 1)):
        one = read_metrics(work / variant / f"seed{seed}/stage1")["config"]
        two = read_metrics(work / variant / f"seed{seed}/stage2")["config"]
        assert one["objective"]["kind"] == "exit_weighted" and one["data"]["task"] == "addition"
        assert two["objective"]["kind"] == "gate_gain" and one["model"]["hidden_size"] == 32
        assert one["model"]["num_layers"] == two["model"]["num_layers"] == n
        rate = 0.0 if variant == "one_layer" else 0.5
        assert one["objective"]["exit_rate"] == two["objective"]["exit_rate"] == rate
        assert two["train"]["init_from"] == str(
            work / variant / f"seed{seed}/stage1/checkpoints/step_0000004"
        )
        assert (one["train"]["seed"], two["train"]["seed"]) == (seed, seed)
        hf = json.loads((work / variant / f"seed{seed}/hf/config.json").read_text())
        assert hf["exit_gate"] and hf["num_hidden_layers"] == n

    info = json.loads((out / "adaptive_depth.json").read_text())
    assert info["smoke"] and info["seeds"] == [0, 1] and info["episodes"] == {"1": 4, "8": 16}
    assert list(info["variants"]) == list(layers)
    always = {
        "operand digit",
        "format (+ = newline)",
        "answer, units digit",
        "answer, carry from the next column",
    }
    for found in (e for v in info["variants"].values() for e in v["evidence"].values()):
        assert always <= set(found) <= always | {"answer, carry through a 9-sum column"}
        assert found["operand digit"]["tokens"] == 8 * info["evidence_windows"]
        assert found["answer, units digit"]["tokens"] == info["evidence_windows"]
        # through the cache: three rules at one threshold each, under each KV policy
        cached = found["answer, units digit"]["cached"]
        assert len(cached) == 9 and "margin 2 recompute" in cached
        for kind in found.values():
            assert len(kind["ce"]) == 4 and all(math.isfinite(c) for c in kind["ce"])
            assert 1 <= kind["gate_mean_exit_loop"] <= 4
            assert len(kind["rules"]) == 12  # three rules, four thresholds each
            assert all(1 <= r["mean_exit_loop"] <= 4 for r in kind["rules"].values())
    assert "runs" not in info["variants"]["one_layer"]  # the reference: evidence only
    for name in ("one_layer_exits", "four_layers_exits"):
        variant = info["variants"][name]
        for runs in variant["runs"].values():
            for b, batches in ((1, 4), (8, 2)):
                at_b = [r for r in runs if r["batch_size"] == b]
                assert {r["batches"] for r in at_b} == {batches}
                assert sorted(r["loops"] for r in at_b if r["exit"] == "fixed") == [1, 2, 3, 4]
                exiting = [r for r in at_b if r["exit"] != "fixed"]
                assert len(exiting) == 3 * 2 * (5 if b > 1 else 3)  # async: copy, share
                for r in at_b:
                    assert 0 <= r["answer_accuracy"] <= 1 and math.isfinite(r["answer_ce"])
                    decoded = b * batches * (16 - 6)
                    assert r["tokens_per_s"] == pytest.approx(decoded / min(r["seconds"]))
        assert len(variant["verdicts"]) == 3 * 2 * (3 + 5)
        for v in variant["verdicts"]:
            assert len(v["answer_accuracy"]) == 2 and isinstance(v["beats_fixed_depth"], bool)
            assert v["beats_fixed_depth"] == (
                v["undominated"] and (v["by_accuracy"] or v["by_speed"])
            )
        for b, p in variant["profile"].items():
            runs = {"copy sync", "share sync", "recompute sync"}
            runs |= {"copy async", "share async"} if b == "8" else set()
            assert set(p["exit_path_s_per_loop"]) == runs
            assert len(p["s_per_token"]) == 4 + len(runs)
        sub = (out / name / "README.md").read_text()
        assert sub.startswith(
            f"# Adaptive depth against fixed depth: 4-digit addition, {variant['title']}"
        )
        assert sub.count("\n| fixed K=") == 8 and "\n| gate 0.5 copy | " in sub
        for b in (1, 8):
            assert (out / name / f"frontier_b{b}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "README.md").read_text()
    assert report.startswith("# Adaptive depth against fixed depth: 4-digit addition\n")
    assert "**SMOKE run" in report and report.count("- **Batch 1: ") == 2
    assert "## What exit-aware training changes" in report and "\n| gate 0.5 copy | " in report
    assert report.count("\n| four_layers_exits | 8 | copy | async | ") == 1
    assert report.count("\n| one_layer_exits | 1 | recompute sync | ") == 1
    # --report redraws the same reports from the JSON
    sub = (out / "four_layers_exits/README.md").read_text()
    (out / "README.md").unlink()
    (out / "four_layers_exits/README.md").unlink()
    again = [script, "--report", "--out", str(out)]
    proc = subprocess.run(again, capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and (out / "README.md").read_text() == report
    assert (out / "four_layers_exits/README.md").read_text() == sub
