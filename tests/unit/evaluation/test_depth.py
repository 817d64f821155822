"""The study's measurements on tiny trained models: depth, halting, diagnostics and the report."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from megaloop.evaluation import depth, diagnostics, halting, harness, report
from megaloop.evaluation.exported import EvalError
from megaloop.evaluation.settings import DepthSettings, DiagnoseSettings, HaltSettings
from megaloop.model.modes import top1_margin

SHORT_RUN = [
    "data.seq_len=32",
    "train.steps=40",
    "train.micro_batch_size=16",
    "train.global_batch_size=16",
    "train.log_every=10",
    "train.save_every=40",
    "train.eval_batches=2",
    "wandb.mode=disabled",
]
"""Overrides on multiproc.BASE for the measured models: 40 steps of 16 sequences of 32 tokens,
one checkpoint."""
VARIANTS = {
    "norm": ["model.readout=norm"],
    "raw": ["model.readout=raw"],
    "final_norm": ["model.readout=final_norm"],
}
SEQ = 32


def held_out(settings, runs, model, **fields):
    """`settings` (a measurement's settings class) for `model` on the runs' held-out text, SEQ
    tokens a sequence."""
    return settings(model=model, data=runs / "held_out.txt", seq_len=SEQ, **fields)


def halt(runs, model, out, **fields) -> dict:
    """`megaloop halt` of `model` at K_max = 4 on the held-out text: its result."""
    return halting.run(held_out(HaltSettings, runs, model, k_max=4, out=out, **fields))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """3 readouts x 2 seeds of the tests' tiny per-loop model (multiproc.BASE: d=32, L=4, K=4),
    40 steps each, and held-out addition text."""
    from multiproc import train_here

    root = tmp_path_factory.mktemp("measure")
    for name, overrides in VARIANTS.items():
        for seed in (0, 1):
            train_here(
                root / "runs" / name / f"seed{seed}", [*SHORT_RUN, *overrides, f"train.seed={seed}"]
            )
    rng = np.random.default_rng(7)
    text = "".join(f"{a:04d}+{b:04d}={a + b:05d}\n" for a, b in rng.integers(0, 10**4, (900, 2)))
    (root / "held_out.txt").write_text(text)
    return root


def test_radial_fraction_and_clamp_separate_the_readouts(runs, tmp_path):
    results = {}
    for name in VARIANTS:
        results[name] = diagnostics.run(
            held_out(
                DiagnoseSettings,
                runs,
                runs / "runs" / name / "seed0",
                tokens=512,
                rollout=6,
                out=tmp_path / name / "seed0",
            )
        )
    norm, raw, final = (results[n]["radial"]["r"] for n in ("norm", "raw", "final_norm"))
    assert max(norm) < 1e-6 and min(raw) > 1e-4, (norm, raw)
    assert min(final[:-1]) > 1e-4 and final[-1] < 1e-6, final  # raw-like, then K_train normed
    assert abs(results["norm"]["radial"]["g_K"]) < 1e-3 * abs(results["raw"]["radial"]["g_K"])
    # flat under the norm readout (up to RMSNorm's eps at c = 0.01), not under raw
    sweep = {n: np.ptp(results[n]["scale_sweep"]["ce"]) for n in ("norm", "raw")}
    assert sweep["norm"] < 0.05 * sweep["raw"], sweep
    for r in results.values():
        assert r["clamp"]["max_rms_drift_from_loop1"] < 1e-5
        assert len(r["rollout"]["s"]) == 6 and len(r["rollout"]["a_rad"]) == 5
        assert all(np.isfinite(r["rollout"]["ce"]))
        stats = r["scale"][-1]["rms"]
        assert stats["p50"] <= stats["p99"] <= stats["p99.9"] <= stats["max"]
        d = r["settings"]["hidden_size"]
        assert r["scale"][-1]["l2"]["mean"] == pytest.approx(stats["mean"] * d**0.5)
    saved = json.loads((tmp_path / "norm/seed0/diagnose.json").read_text())
    assert saved["command"] == "diagnose" and saved["settings"]["tokens"] == 512
    assert saved["model"]["run_config"]["model"]["readout"] == "norm"


def test_bf16_radial_floor_lies_above_fp32s_for_a_norm_readout(runs, tmp_path):
    """A normalising readout's r_k is a rounding floor: (ε/ms)² in float32, far higher in
    bfloat16 (the study's ~1e-8), on the same checkpoint and slice; raw readouts' r_k is a real
    share of the gradient (~1e-2) in both."""
    r = {
        (name, dtype): diagnostics.run(
            held_out(
                DiagnoseSettings,
                runs,
                runs / "runs" / name / "seed0",
                tokens=256,
                rollout=2,
                out=tmp_path / f"{name}-{dtype}",
                dtype=dtype,
            )
        )["radial"]["r"]
        for name in ("norm", "raw")
        for dtype in ("fp32", "bf16")
    }
    norm32, norm16 = np.array(r["norm", "fp32"]), np.array(r["norm", "bf16"])
    assert (norm16 > norm32).all(), (norm16, norm32)
    # the float32 floor falls as the state grows over the loops; bfloat16's does not
    assert (np.diff(norm32) < 0).all() and norm16[-1] > 100 * norm32[-1], (norm16, norm32)
    assert (norm16 < 1e-4).all(), norm16  # still many orders below raw's
    assert min(r["raw", "bf16"]) > 1e-4 and min(r["raw", "fp32"]) > 1e-4, r
    saved = json.loads((tmp_path / "norm-bf16/diagnose.json").read_text())
    assert saved["settings"]["dtype"] == "bfloat16"


def test_the_clamp_holds_every_tokens_rms_at_loop_1(runs):
    opened = harness.open_model(runs / "runs/raw/seed0")
    tokens = harness.read_tokens(runs / "held_out.txt", opened.encode)
    batch = harness.windows(tokens, SEQ, 4)[:, :-1]
    with torch.no_grad():
        states = [h for _, h in harness.trajectory(opened.model, batch, 6, clamp=True)]
    for h in states[1:]:
        torch.testing.assert_close(
            diagnostics.rms(h), diagnostics.rms(states[0]), rtol=1e-5, atol=0
        )


def test_depth_at_k_equals_the_exported_model_at_num_loops_k(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from megaloop.export import export

    run = runs / "runs/final_norm/seed0"
    settings = held_out(
        DepthSettings,
        runs,
        run,
        loops=(1, 2, 3, 4, 6),
        sequences=12,
        batch_size=5,
        out=tmp_path / "depth",
    )
    result = depth.run(settings)
    folder = export(run, tmp_path / "hf")
    again = depth.run(dataclasses.replace(settings, model=folder, batch_size=8, out=None))
    for row, same in zip(result["rows"], again["rows"]):  # the run and its export
        assert same["ce"] == pytest.approx(row["ce"], rel=1e-6)
    tokens = harness.read_tokens(
        runs / "held_out.txt", lambda t: np.frombuffer(t.encode(), np.uint8).astype(np.int64)
    )
    windows = harness.windows(tokens, SEQ, 12)
    for row in result["rows"]:
        model = AutoModelForCausalLM.from_pretrained(
            folder, trust_remote_code=True, num_loops=row["loops"]
        ).eval()
        with torch.no_grad():
            logits = model(windows[:, :-1], use_cache=False).logits
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        assert row["ce"] == pytest.approx(ce.item(), rel=1e-5), row
    assert (tmp_path / "depth/depth.md").read_text().startswith("# Fixed-depth perplexity")


def test_halting_meets_rho_and_dynamic_batching_counts_its_steps(runs, tmp_path):
    run = runs / "runs/raw/seed1"
    result = halt(runs, run, tmp_path, rho=1.02, calib=24, bench=16, batch_size=5)
    cal = result["calibration"]
    # recompute the calibrated dynamic PPL independently: each sequence at its exit depth
    opened = harness.open_model(run)
    windows = harness.windows(harness.read_tokens(runs / "held_out.txt", opened.encode), SEQ, 24)
    with torch.no_grad():
        total, fixed, exits = 0.0, 0.0, []
        for window in windows:
            x, y = window[None, :-1], window[None, 1:]
            margins, ce = [], []
            for k, h in harness.trajectory(opened.model, x, 4):
                logits = opened.model.readout(h, k, 4)
                top = logits.topk(2, -1).values
                margins.append((top[..., 0] - top[..., 1]).mean().item())
                ce.append(torch.nn.functional.cross_entropy(logits[0], y[0], reduction="sum"))
            t = cal["threshold"]  # one sequence's margin exactly: allow for batch-size rounding
            k = next(
                (
                    i + 1
                    for i, m in enumerate(margins[:-1])
                    if t is not None and m >= t - 1e-6 * abs(t)
                ),
                4,
            )
            exits.append(k)
            total, fixed = total + ce[k - 1].item(), fixed + ce[-1].item()
    assert np.exp((total - fixed) / windows[:, 1:].numel()) <= 1.02 + 1e-9
    assert np.bincount(exits, minlength=5)[1:].tolist() == cal["exit_histogram"]
    bench = result["benchmark"]
    assert [r["loops"] for r in bench["fixed"]] == [1, 2, 3, 4]
    assert bench["dynamic"]["tokens_per_s"] > 0 and (tmp_path / "halt.md").is_file()

    # dynamic batching: count the rows that really enter the stack, loop by loop
    slice_ = harness.windows(harness.read_tokens(runs / "held_out.txt", opened.encode), SEQ, 16)
    with torch.no_grad():
        first = [
            top1_margin(opened.model.readout(h, 1, 1)).mean(-1)
            for k, h in harness.trajectory(opened.model, slice_[:, :-1], 1)
        ][0]
    tau = float(first.median())
    counted = []
    hook = opened.model.layers[0].register_forward_pre_hook(
        lambda _, args: counted.append(args[0].shape[0] * args[0].shape[1])
    )
    with torch.no_grad():
        _, steps, seq_exit, _ = halting.dynamic_depth(opened.model, slice_, 4, "margin", tau)
    hook.remove()
    tokens = slice_[:, :-1].numel()
    assert sum(counted) == steps == np.mean(seq_exit) * tokens < 4 * tokens
    assert min(seq_exit) == 1 and 1 < np.mean(seq_exit) < 4


def test_gate_rule_calibrates_q_like_the_exported_early_exit(runs, tmp_path):
    from multiproc import train_here

    run = tmp_path / "gate"
    train_here(
        run,
        [
            *SHORT_RUN,
            "objective.kind=exit_weighted",
            "model.exit_gate=true",
            "objective.entropy_beta=0.05",
            "train.steps=20",
        ],
    )
    per_token_rule_calibrates_like_the_exported_early_exit(runs, run, tmp_path, "gate")


def test_confidence_rule_calibrates_like_the_exported_early_exit(runs, tmp_path):
    """Any per-token rule of modes.EXIT_RULES halts as the exported model exits: confidence
    needs no gate."""
    result = per_token_rule_calibrates_like_the_exported_early_exit(
        runs, runs / "runs/raw/seed1", tmp_path, "confidence"
    )
    assert result["calibration"]["mean_exit_loop"] < 4  # the calibrated rule exits early


def per_token_rule_calibrates_like_the_exported_early_exit(runs, run, tmp_path, rule):
    from transformers import AutoModelForCausalLM

    from megaloop.export import export

    result = halt(runs, run, tmp_path / "h", rho=1.05, calib=8, bench=8, batch_size=4, rule=rule)
    q = result["calibration"]["threshold"]
    folder = export(run, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        trust_remote_code=True,
        early_exit=rule,
        exit_threshold=q if q is not None else 1.5,
    ).eval()
    windows = harness.windows(
        harness.read_tokens(
            runs / "held_out.txt", lambda t: np.frombuffer(t.encode(), np.uint8).astype(np.int64)
        ),
        SEQ,
        8,
    )
    with torch.no_grad():
        logits = model(windows[:, :-1], use_cache=False).logits
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert result["calibration"]["ce_dynamic"] == pytest.approx(ce.item(), rel=1e-5)
    assert result["calibration"]["ppl_ratio"] <= 1.05 + 1e-9
    assert 1 <= result["benchmark"]["dynamic"]["mean_token_exit_loop"] <= 4
    return result


def test_report_renders_every_table_and_figure(runs, tmp_path):
    # every input is this test's own: its results folder holds only what it writes here (it
    # used to reuse runs/results, where another test's diagnostics at other settings were
    # found or not depending on which tests ran before)
    results = tmp_path / "results"
    for name in VARIANTS:
        for seed in (0, 1):
            run, out = runs / "runs" / name / f"seed{seed}", results / name / f"seed{seed}"
            depth.run(held_out(DepthSettings, runs, run, out=out, loops=(1, 2, 3, 4), sequences=8))
            halting.run(held_out(HaltSettings, runs, run, out=out, calib=8, bench=8, batch_size=4))
            diagnostics.run(held_out(DiagnoseSettings, runs, run, out=out, tokens=256, rollout=6))
    path = report.build([runs / "runs", results], tmp_path / "report")
    text = path.read_text()
    for name in VARIANTS:  # runs | depth | halt | diagnose: both seeds of each, nothing else
        rows = [line for line in text.splitlines() if line.startswith(f"| {name} | ")]
        assert f"| {name} | 2 | 2 | 2 | 2 |" in rows, rows
    for title in (
        "(Table 2)",
        "(Table 5)",
        "(Appendix H)",
        "(Table 3)",
        "(Table 4)",
        "(Appendix D",
        "(Figure 3)",
    ):
        assert title in text
    for name in VARIANTS:  # one row per variant, seeds pooled
        assert f"| {name} | 2 | 40 |" in text  # named by their runs' folder
        assert f"| {name} | 2 | margin |" in text
    assert "No `megaloop" not in text
    variants = report.group(*report.collect([runs / "runs", results]))
    figures = report.figures(variants)
    assert set(figures) == {"ppl_vs_k", "frontier", "rollout", "scale_sweep", "norm_distribution"}
    for name, fig in figures.items():
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), name
        png = (tmp_path / "report" / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
        assert f"![{name}]({name}.png)" in text


def test_bad_input_gets_one_clear_error_before_any_compute(runs, tmp_path, capsys):
    from megaloop.cli import main

    data, run = str(runs / "held_out.txt"), str(runs / "runs/norm/seed0")
    cases = [
        (
            ["depth", "nowhere", "--data", str(tmp_path / "missing.txt")],
            "missing.txt: no such file",
        ),
        (["halt", "nowhere", "--data", data, "--rho", "0.99"], "--rho 0.99"),
        (["halt", run, "--data", data, "--exit", "gate"], "has no exit gate"),
        (["depth", "nowhere", "--data", data, "--sequences", "0"], "empty slice"),
        (
            ["depth", run, "--data", data, "--sequences", "5000", "--seq-len", str(SEQ)],
            "windows of 32 + 1 tokens; 5000 are needed",
        ),
        (["diagnose", "nowhere", "--data", data], "MODEL nowhere: no such folder"),
    ]
    for argv, message in cases:
        out = tmp_path / "out"
        assert main([*argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("megaloop: error:") and message in err[-1], (argv, err)
        assert not out.exists()
    with pytest.raises(EvalError, match="no runs"):
        report.build([tmp_path], tmp_path / "r")


def test_depth_and_halt_default_to_the_models_positions(runs, tmp_path):
    """No --seq-len on a model of 32 positions: windows of 32 tokens (a fixed default of 256
    used to be refused by such a model), and --dtype auto: float32 on a CPU, bfloat16 on a GPU."""
    from megaloop.cli import main

    run, data, out = str(runs / "runs/norm/seed0"), str(runs / "held_out.txt"), str(tmp_path)
    assert main(["depth", run, "--data", data, "--sequences", "4", "--out", out]) == 0
    assert main(["halt", run, "--data", data, "--calib", "4", "--bench", "4", "--out", out]) == 0
    for command in ("depth", "halt"):
        s = json.loads((tmp_path / f"{command}.json").read_text())["settings"]
        assert s["seq_len"] == SEQ, command
        assert s["dtype"] == ("bfloat16" if s["device"].startswith("cuda") else "float32")
    depth_json = json.loads((tmp_path / "depth.json").read_text())
    assert depth_json["settings"]["tokens"] == 4 * SEQ
