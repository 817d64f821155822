"""Configs: YAML composition, overrides, every shipped file, and one clear error per bad value."""

import dataclasses
import math

import pytest

from megaloop import experiment
from megaloop.config import ConfigError
from support import ROOT, TINY

SHIPPED = sorted(p.relative_to(ROOT) for p in (ROOT / "configs").rglob("*.yaml"))


NEEDS = {"configs/experiments/adaptive_depth/stage2.yaml": ["train.init_from=stage1/checkpoint"]}
"""What a shipped config says it must be given on the command line."""


@pytest.mark.parametrize("path", SHIPPED, ids=str)
def test_every_shipped_config_loads_and_validates(path):
    given = NEEDS.get(str(path), [])
    if given:
        with pytest.raises(ConfigError, match=given[0].split("=")[0]):
            experiment.load(ROOT / path)
    cfg = experiment.load(ROOT / path, given)
    assert cfg.model.num_loops >= 1


def test_composition_and_overrides():
    cfg = experiment.load(
        ROOT / "configs/experiments/wikitext103/44m/per_loop_norm_penalty.yaml",
        ["train.steps=1200", "model.readout=raw", "optim.lr=1e-3"],
    )
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (512, 8)  # from model/44m.yaml
    assert cfg.optim.warmup_steps == 500  # from ../base.yaml
    assert cfg.objective.norm_penalty == pytest.approx(1e-3)  # from the row file
    assert (cfg.train.steps, cfg.model.readout, cfg.optim.lr) == (1200, "raw", 1e-3)


def test_data_kind_picks_a_section_with_only_its_keys():
    from megaloop.data import DataConfig, IndexedConfig, SyntheticConfig, switch_overrides

    cfg = experiment.load(ROOT / "configs/experiments/wikitext103/44m/per_loop_norm.yaml")
    assert type(cfg.data) is IndexedConfig and cfg.data.epochs == 4
    assert set(cfg.to_dict()["data"]) == {
        "kind", "seq_len", "tokenizer", "path", "valid_path", "epochs", "cache_dir", "stride"
    }  # fmt: skip
    fineweb = ROOT / "configs/experiments/fineweb/1p4b_baseline.yaml"
    with pytest.raises(ConfigError, match="'data.path'.*data.kind=webdataset, not of data.kind"):
        experiment.load(fineweb, ["data.kind=synthetic"])
    cfg = experiment.load(fineweb, switch_overrides("synthetic"))
    assert cfg.data == SyntheticConfig(seq_len=1664) and cfg.data.epochs is None
    # a checkpoint of an older megaloop saved every kind's keys, at their defaults
    saved = {
        "kind": "indexed", "path": "d/train", "valid_path": None, "seq_len": 64,
        "tokenizer": "bytes", "epochs": 2, "cache_dir": None, "task": "addition", "depth": 4,
        "valid_fraction": 0.05, "valid_shards": 1, "resampled": False,
    }  # fmt: skip
    assert DataConfig.from_dict(DataConfig.own_keys_only(saved)) == IndexedConfig(
        path="d/train", seq_len=64, epochs=2
    )


def test_ablation_table_has_one_file_per_row_for_both_sizes():
    rows = {
        "terminal_norm",
        "terminal_raw",
        "per_loop_norm",
        "per_loop_raw",
        "per_loop_norm_penalty",
        "terminal_norm_penalty",
        "final_norm",
        "exit_weighted",
        "spectral_damping",
        "spectral_damping_terminal",
        "interloop_rmsnorm",
    }
    for size, d in (("44m", 512), ("129m", 768)):
        files = {p.stem for p in (ROOT / f"configs/experiments/wikitext103/{size}").glob("*.yaml")}
        assert files == rows
        for row in rows:
            cfg = experiment.load(ROOT / f"configs/experiments/wikitext103/{size}/{row}.yaml")
            assert (cfg.model.hidden_size, cfg.model.num_loops) == (d, 4)


STUDY_ROWS = {
    "terminal_norm",
    "terminal_raw",
    "per_loop_norm",
    "per_loop_raw",
    "final_norm",
    "terminal_norm_penalty",
    "per_loop_norm_penalty",
    "exit_weighted",
    "spectral_damping",
    "spectral_damping_terminal",
    "interloop_rmsnorm",
}


@pytest.mark.parametrize(
    "size, d, batch, total, released_norm, released_raw",
    [
        ("44m", 512, 64, 43_934_208, 43_935_234, 43_934_722),
        ("129m", 768, 32, 128_822_016, 128_823_554, 128_822_786),
    ],
)
def test_the_study_preset_is_its_released_setup(size, d, batch, total, released_norm, released_raw):
    """Each Table 2 row of configs/experiments/study/ on the released code's settings; a row
    with a normalised readout and nothing added counts the released model's parameters."""
    from megaloop.parallel.cost import parameter_counts

    folder = ROOT / f"configs/experiments/study/{size}"
    assert {p.stem for p in folder.glob("*.yaml")} == STUDY_ROWS
    for row in STUDY_ROWS:
        cfg = experiment.load(folder / f"{row}.yaml")
        m, o = cfg.model, cfg.optim
        assert (m.hidden_size, m.num_loops, m.ffn_size, m.vocab_size) == (d, 4, 4 * d, 20_000)
        assert (m.position_embedding, m.max_seq_len, m.init, m.dropout) == (
            "learned",
            256,
            "pytorch",
            0.1,
        )
        assert (m.norm_eps, m.tie_embeddings) == (1e-6, True)
        assert (o.lr, o.schedule, o.warmup_steps, o.beta1, o.beta2, o.eps) == (
            3e-4,
            "constant",
            0,
            0.9,
            0.999,
            1e-8,
        )
        assert (o.weight_decay, o.decay, o.clip_grad) == (0.01, "all", 1.0)
        assert (cfg.data.seq_len, cfg.data.stride, cfg.data.epochs) == (256, 128, 4)
        assert (cfg.train.global_batch_size, cfg.train.bf16) == (batch, True)
        # one pass of the whole batch; the released seeds; H fp32 under autocast (issue 53)
        assert (cfg.train.micro_batch_size, cfg.train.seed, m.fp32_residual) == (batch, 42, True)
        extra = m.readout != "norm" or m.recurrence != "none" or m.exit_gate
        assert extra or parameter_counts(m)["total"] == total, row
        # the released code builds the loop norm (d), the gate (d + 1) and the damping scalar in
        # every row, and the readout norm (d) unless the readout is raw (src/models/ar_looplm.py)
        released = parameter_counts(
            dataclasses.replace(m, recurrence="none", exit_gate=False, readout="norm")
        )["total"] + (d + d + 1 + 1)
        assert released - (d if m.readout == "raw" else 0) == (
            released_raw if m.readout == "raw" else released_norm
        ), row
    assert experiment.load(folder / "exit_weighted.yaml").objective.entropy_beta == 0.1
    penalty = experiment.load(folder / "per_loop_norm_penalty.yaml").objective
    assert penalty.norm_penalty == 0.01
    # where the released code settles what its configs leave out (src/models/ar_looplm.py): the
    # gate reads the raw H_k, damping starts at sigmoid(raw_alpha = 2.0), and the final-only
    # norm is the last loop of the K run
    assert experiment.load(folder / "exit_weighted.yaml").model.exit_gate_input == "raw"
    for row in ("spectral_damping", "spectral_damping_terminal"):
        alpha = experiment.load(folder / f"{row}.yaml").model.damping_init
        assert math.log(alpha / (1 - alpha)) == pytest.approx(2.0, abs=1e-12), row
    assert experiment.load(folder / "final_norm.yaml").model.readout == "last_norm"


RELEASED_SIZES = {
    # configs/{44m,129m}/ar_looplm_*_base.yaml of readout-blind-spot (read at commit 338c155,
    # whose configs are 959dd3c's): d_model, num_heads, num_layers, ff_multiplier 4, vocabulary
    # 20,000, seq_len 256, batch_size
    "44m": dict(d=512, heads=8, layers=8, batch=64),
    "129m": dict(d=768, heads=12, layers=12, batch=32),
}
RELEASED_ROWS = {
    # row: (objective, readout, recurrence, damping (shape, raw_alpha) or None, lambda, beta,
    #       exit gate). The released configs: perstep_norm, perstep_raw, perstep_final_norm
    # (decode_norm_final_only), terminal_norm (= base), terminal_raw and terminal_norm_penalty
    # (norm_penalty_weight 0.01); the rest from the paper (lambda 0.01, beta 0.1, the gate on the
    # raw H_k, damping one scalar from raw_alpha 2.0), their configs not released.
    "per_loop_norm": ("per_loop", "norm", "none", None, 0.0, 0.0, False),
    "per_loop_raw": ("per_loop", "raw", "none", None, 0.0, 0.0, False),
    "final_norm": ("per_loop", "last_norm", "none", None, 0.0, 0.0, False),
    "terminal_norm": ("terminal", "norm", "none", None, 0.0, 0.0, False),
    "terminal_raw": ("terminal", "raw", "none", None, 0.0, 0.0, False),
    "terminal_norm_penalty": ("terminal", "norm", "none", None, 0.01, 0.0, False),
    "per_loop_norm_penalty": ("per_loop", "norm", "none", None, 0.01, 0.0, False),
    "exit_weighted": ("exit_weighted", "norm", "none", None, 0.0, 0.1, True),
    "interloop_rmsnorm": ("per_loop", "norm", "rmsnorm", None, 0.0, 0.0, False),
    "spectral_damping": ("per_loop", "norm", "damping", ("scalar", 2.0), 0.0, 0.0, False),
    "spectral_damping_terminal": ("terminal", "norm", "damping", ("scalar", 2.0), 0.0, 0.0, False),
}
RELEASED_RAW_PARAMETERS = {"44m": 43_934_722, "129m": 128_822_786}
"""What the released code builds for a raw row (`megaloop params` of the released model): its
loop norm (d), gate (d + 1) and damping scalar are built in every row."""


def hand_count(d: int, layers: int, readout_norm: bool, extra: int = 0) -> int:
    """Parameters by hand: token (20,000 x d) and position (256 x d) tables, per layer q, k, v,
    o (4 d^2), a SwiGLU FFN of 4d (3 x 4 d^2) and two norms (2d); the readout norm (d)."""
    return 20_000 * d + 256 * d + layers * (16 * d * d + 2 * d) + d * readout_norm + extra


@pytest.mark.parametrize("size", ["44m", "129m"])
def test_every_study_row_is_its_released_config(size):
    """Each row of configs/experiments/study/{size}/ against the table above, written from the
    released configs: objective, readout, recurrence, damping, lambda, beta, gate, shape; its
    parameter count by hand, and the released model's count for the raw rows."""
    from megaloop.parallel.cost import parameter_counts

    folder = ROOT / f"configs/experiments/study/{size}"
    assert {p.stem for p in folder.glob("*.yaml")} == set(RELEASED_ROWS)
    shape = RELEASED_SIZES[size]
    d = shape["d"]
    for row, (kind, readout, recurrence, damping, lam, beta, gate) in RELEASED_ROWS.items():
        cfg = experiment.load(folder / f"{row}.yaml")
        m, o = cfg.model, cfg.objective
        assert (o.kind, m.readout, m.recurrence) == (kind, readout, recurrence), row
        assert (o.norm_penalty, o.entropy_beta) == (lam, beta), row
        assert m.exit_gate == gate, row
        if gate:
            assert m.exit_gate_input == "raw", row
        if damping:
            assert m.damping_shape == damping[0], row
            assert math.log(m.damping_init / (1 - m.damping_init)) == pytest.approx(damping[1])
        assert (m.hidden_size, m.num_heads, m.num_layers, m.ffn_size) == (
            d,
            shape["heads"],
            shape["layers"],
            4 * d,
        ), row
        assert (m.vocab_size, m.max_seq_len, m.num_loops) == (20_000, 256, 4), row
        assert cfg.train.global_batch_size == shape["batch"], row
        extra = (d + 1) * gate + (1 if recurrence == "damping" else 0)
        extra += d if recurrence == "rmsnorm" else 0
        count = hand_count(d, shape["layers"], readout != "raw", extra)
        assert parameter_counts(m)["total"] == count, row
        if readout == "raw":  # + the loop norm, the gate and the damping scalar
            released = parameter_counts(m)["total"] + d + (d + 1) + 1
            assert released == RELEASED_RAW_PARAMETERS[size], row


def test_params_and_plan_run_on_the_study_rows():
    from support import megaloop

    out = megaloop("params", "configs/experiments/study/44m/per_loop_norm.yaml", cwd=ROOT)
    assert out.returncode == 0 and "43,934,208" in out.stdout, out.stderr
    out = megaloop(
        "plan",
        "configs/experiments/study/129m/per_loop_raw.yaml",
        "--gpus",
        "1",
        "--gpu-mem",
        "80",
        cwd=ROOT,
    )
    assert out.returncode == 0 and "fits in" in out.stdout, out.stdout + out.stderr


BAD = [
    # (overrides, words the one error message must contain)
    (["model.readuot=raw"], ["model.readuot", "unknown key", "readout"]),
    (["model.readout=nrom"], ["model.readout", "'nrom'", "norm, raw, final_norm, last_norm"]),
    (["model.recurrence=layernorm"], ["model.recurrence", "none, rmsnorm, damping"]),
    (["objective.kind=halting"], ["objective.kind", "terminal, per_loop, exit_weighted"]),
    (["train.steps=ten"], ["train.steps", "'ten'", "integer"]),
    (["model.num_loops=0"], ["model.num_loops", "0", ">= 1"]),
    (["model.num_heads=3"], ["model.num_heads", "3", "divide hidden_size=128"]),
    (["optim.lr=-1"], ["optim.lr", "-1", "> 0"]),
    (["objective.norm_penalty=-0.1"], ["objective.norm_penalty", "-0.1", ">= 0"]),
    (["objective.kind=exit_weighted"], ["model.exit_gate", "set model.exit_gate=true"]),
    (["train.global_batch_size=20"], ["train.global_batch_size", "20", "multiple of"]),
    (["model.damping_init=1.5"], ["model.damping_init", "(0, 1)"]),
    (["data.seq_len=512"], ["data.seq_len", "512", "model.max_seq_len=256"]),
    (["train.micro_batch_size=0"], ["train.micro_batch_size", "0", ">= 1"]),
    (["data.kind=text"], ["data.path", "data.kind=text needs a text file"]),
    (["data.epochs=2"], ["data.epochs", "of data.kind=indexed, not of data.kind=synthetic"]),
    (
        ["data.kind=indexed", "data.path=d/train", "data.task=lookup"],
        ["data.task", "data.kind=synthetic", "remove it", "data.task=null"],
    ),
    (["train.steps"], ["train.steps", "key=value"]),
    (["engine=deepspeed", "parallel.pp=2"], ["parallel.pp", "engine=megatron", "parallel.pp=1"]),
    (["engine=deepspeed", "deepspeed.zero_stage=4"], ["deepspeed.zero_stage", "0, 1, 2, 3"]),
    (
        ["engine=deepspeed", "train.bf16=true", "model.fp32_residual=true"],
        ["model.fp32_residual", "bf16 weights", "engine=megatron"],
    ),
    (["engine=fsdp"], ["engine", "megatron, deepspeed"]),
    (["model.dropout=1"], ["model.dropout", "[0, 1)"]),
    (["model.dropout=0.1", "train.recompute=loop"], ["train.recompute", "selective or none"]),
    (["model.init=xavier"], ["model.init", "megatron, pytorch"]),
    (["model.position_embedding=alibi"], ["model.position_embedding", "rope, learned"]),
    (["model.embedding_init_std=0"], ["model.embedding_init_std", "> 0"]),
    (["optim.schedule=linear"], ["optim.schedule", "cosine, constant"]),
    (["optim.decay=none"], ["optim.decay", "matrices, all"]),
    (["objective.exit_kv=share"], ["objective.exit_kv", "none, copy"]),
    (["objective.exit_rate=0.5"], ["objective.exit_rate", "exit_kv=copy"]),
    (["objective.exit_kv=copy", "objective.exit_rate=2"], ["objective.exit_rate", "[0, 1]"]),
    (
        ["objective.exit_kv=copy", "objective.exit_rate=0.5", "parallel.pp=2"],
        ["objective.exit_kv", "parallel.pp=1"],
    ),
    (
        ["objective.exit_kv=copy", "objective.exit_rate=0.5", "train.recompute=loop"],
        ["objective.exit_kv", "train.recompute=none"],
    ),
]


@pytest.mark.parametrize("overrides, words", BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_fails_with_one_clear_error(overrides, words):
    with pytest.raises(ConfigError) as err:
        experiment.load(TINY, overrides)
    message = str(err.value)
    for word in words:
        assert word in message, message


def test_bad_yaml_files(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: [missing.yaml]\n")
    with pytest.raises(ConfigError, match="missing.yaml.*not found"):
        experiment.load(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("model: [1, 2]\n")
    with pytest.raises(ConfigError, match="'model'.*mapping"):
        experiment.load(tmp_path / "b.yaml")
    (tmp_path / "c.yaml").write_text("model: {hidden_size: 64\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        experiment.load(tmp_path / "c.yaml")


def test_cli_reports_a_bad_config_before_any_compute(tmp_path, capsys):
    from megaloop.cli import main

    run_dir = tmp_path / "run"
    code = main(["train", TINY, f"train.dir={run_dir}", "model.readout=nrom"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "model.readout" in err
    assert not run_dir.exists()
