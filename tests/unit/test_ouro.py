"""Ouro's format both ways: an Ouro folder imported, exported in megaloop's format and in Ouro's,
against a reference forward written here from the published architecture's facts (plain torch,
sharing no code with megaloop's model); refusals; training from an import at TP2 x PP2."""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from multiproc import BASE, free_port, metrics, train_here
from support import TINY, env, megaloop

# Ouro's architecture at a reduced width; the tiny experiment's byte vocabulary and 4 layers
SHAPE = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "intermediate_size": 48,
    "total_ut_steps": 4,
}
CONFIG = {
    "model_type": "ouro",
    "architectures": ["OuroForCausalLM"],
    "hidden_act": "silu",
    "max_position_embeddings": 64,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "layer_types": ["full_attention"] * 4,
    "early_exit_threshold": 1.0,
    **SHAPE,
}
# the same model as megaloop overrides of configs/experiments/tiny.yaml
OVERRIDES = [
    "model.vocab_size=256",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.num_query_groups=2",
    "model.num_layers=4",
    "model.ffn_hidden_size=48",
    "model.num_loops=4",
    "model.rope_base=1000000.0",
    "model.norm_eps=1e-6",
    "model.tie_embeddings=false",
    "model.layer_norms=sandwich",
    "model.loop_norm=shared",
    "model.exit_gate=true",
    "objective.kind=exit_mixture",
]


def ouro_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, f, V = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    hd = d // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * hd

    def randn(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1.0 + randn(d, std=0.1)

    w = {
        "model.embed_tokens.weight": randn(V, d, std=1.0),
        "model.norm.weight": norm(),
        "model.early_exit_gate.weight": randn(1, d),
        "model.early_exit_gate.bias": randn(1),
        "lm_head.weight": randn(V, d),
    }
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update(
            {
                p + "input_layernorm.weight": norm(),
                p + "input_layernorm_2.weight": norm(),
                p + "post_attention_layernorm.weight": norm(),
                p + "post_attention_layernorm_2.weight": norm(),
                p + "self_attn.q_proj.weight": randn(d, d),
                p + "self_attn.k_proj.weight": randn(kv, d),
                p + "self_attn.v_proj.weight": randn(kv, d),
                p + "self_attn.o_proj.weight": randn(d, d),
                p + "mlp.gate_proj.weight": randn(f, d),
                p + "mlp.up_proj.weight": randn(f, d),
                p + "mlp.down_proj.weight": randn(d, f),
            }
        )
    return w


def write_ouro(folder, config=CONFIG, weights=None):
    """A published-style folder: config.json, two safetensors shards with their index, a
    tokenizer file."""
    weights = ouro_weights() if weights is None else weights
    folder.mkdir(parents=True)
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, folder / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0")).save(
        str(folder / "tokenizer.json")
    )
    return folder


def reference(w: dict, tokens: torch.Tensor, loops: int) -> tuple[list, list]:
    """Per-loop logits and λ_k of Ouro's forward, from the facts: sandwich-norm layers (RoPE,
    grouped-query causal attention, SwiGLU, no biases), and after every loop one model.norm whose
    output feeds the next loop, lm_head and the exit gate."""
    eps, theta = CONFIG["rms_norm_eps"], CONFIG["rope_theta"]
    heads, kv_heads = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    d = SHAPE["hidden_size"]
    hd = d // heads
    b, s = tokens.shape

    def rmsnorm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    angles = torch.arange(s, dtype=torch.float64)[:, None] / theta ** (
        torch.arange(0, hd, 2, dtype=torch.float64) / hd
    )
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x):  # [b, h, s, hd]
        half = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos + half * sin

    def attention(x, p):
        q = (x @ w[p + "q_proj.weight"].T).view(b, s, heads, hd).transpose(1, 2)
        k = (x @ w[p + "k_proj.weight"].T).view(b, s, kv_heads, hd).transpose(1, 2)
        v = (x @ w[p + "v_proj.weight"].T).view(b, s, kv_heads, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        return out @ w[p + "o_proj.weight"].T

    h = w["model.embed_tokens.weight"][tokens]
    logits, gates = [], []
    for _ in range(loops):
        for i in range(SHAPE["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = attention(rmsnorm(h, w[p + "input_layernorm.weight"]), p + "self_attn.")
            h = h + rmsnorm(a, w[p + "input_layernorm_2.weight"])
            x = rmsnorm(h, w[p + "post_attention_layernorm.weight"])
            m = (
                F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
            ) @ w[p + "mlp.down_proj.weight"].T
            h = h + rmsnorm(m, w[p + "post_attention_layernorm_2.weight"])
        h = rmsnorm(h, w["model.norm.weight"])
        logits.append(h @ w["lm_head.weight"].T)
        gates.append(
            torch.sigmoid(
                h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"]
            )[..., 0]
        )
    return logits, gates


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("ouro")
    src = write_ouro(root / "published")
    proc = megaloop("import", "ouro", src, "--out", root / "imported")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return src, root / "imported"


def test_import_then_export_computes_ouros_per_loop_logits(imported, tmp_path):
    from transformers import AutoModelForCausalLM

    src, ckpt = imported
    proc = megaloop("export", ckpt, "--out", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    weights = {k: v.double() for k, v in ouro_weights().items()}
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    ref_logits, ref_gates = reference(weights, tokens, loops=6)
    with torch.no_grad():
        h0, rope = model.embed(tokens)
        for k, h in model.loops(h0, rope, 6):  # K_train = 4, and two loops beyond it
            got, want = model.readout(h, k, 6).double(), ref_logits[k - 1]
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, k
            gate = model.exit_probability(h)[..., 0].double()
            assert (gate - ref_gates[k - 1]).abs().max().item() <= 1e-5, k
    assert (tmp_path / "hf/tokenizer.json").is_file()


def test_an_imported_checkpoint_decodes_with_early_exit(imported, tmp_path):
    """Decoding an imported Ouro checkpoint through the cache with Ouro's gate (loaded by
    transformers with trust_remote_code): each token exits where the reference forward's
    cumulative exit probability first reaches q, runs no loop after it, and under `recompute`
    its logits are the reference's at that loop."""
    from transformers import AutoModelForCausalLM

    _, ckpt = imported
    assert megaloop("export", ckpt, "--out", tmp_path / "hf").returncode == 0
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    logits, gates = reference({k: v.double() for k, v in ouro_weights().items()}, tokens, 4)
    survive, cumulative = torch.ones_like(gates[0]), []
    for lam in gates:
        survive = survive * (1 - lam)
        cumulative.append(1 - survive)
    scores = torch.stack(cumulative[:-1]).flatten().sort().values
    q = scores[len(scores) // 2 - 1 : len(scores) // 2 + 1].mean().item()  # between two scores
    reached = torch.stack([c >= q for c in cumulative[:-1]] + [torch.ones_like(gates[0]) > 0])
    want_exit = reached.int().argmax(0) + 1
    assert 1 < want_exit.float().mean() < 4  # tokens exit at different loops
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf",
        trust_remote_code=True,
        early_exit="gate",
        exit_threshold=q,
        kv_policy="recompute",
    ).eval()
    cache = None
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            out = model(tokens[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            assert torch.equal(out.exit_loops[:, 0], want_exit[:, t]), t
            for row, k in enumerate(want_exit[:, t].tolist()):
                want = logits[k - 1][row, t]
                got = out.logits[row, 0].double()
                assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, (t, row)
    # no loop after the exit; the first token, a one-token prompt, is prefilled at full depth
    assert bool((cache.loops_run[0] == 4).all())
    assert torch.equal(torch.cat(cache.loops_run[1:], 1), want_exit[:, 1:])


def test_table6_diagnostics_of_an_imported_model(imported, tmp_path):
    """`diagnose` on the 1.4B architecture at a reduced width: label-path CE and logit statistics
    of Σ_k p_k·logits_k equal the reference forward's; final r_K and the scale sweep are there."""
    import numpy as np

    from megaloop.evaluation import diagnostics
    from megaloop.evaluation.settings import DiagnoseSettings
    from megaloop.parallel import distributed

    _, ckpt = imported
    stream = np.random.default_rng(5).integers(0, 256, 4 * 16 + 1)
    np.save(tmp_path / "tokens.npy", stream)
    distributed.init(seed=0)
    result = diagnostics.run(
        DiagnoseSettings(
            model=ckpt, data=tmp_path / "tokens.npy", tokens=64, seq_len=16, rollout=5, batch_size=2
        )
    )
    windows = torch.from_numpy(stream[np.arange(4)[:, None] * 16 + np.arange(17)[None]])
    logits, gates = reference(
        {k: v.double() for k, v in ouro_weights().items()}, windows[:, :-1], loops=4
    )
    survive, mixed = torch.ones_like(gates[0]), 0
    for k in range(4):
        p = survive if k == 3 else gates[k] * survive
        mixed, survive = mixed + p[..., None] * logits[k], survive * (1 - gates[k])
    logp = mixed.log_softmax(-1)
    top2 = mixed.topk(2, dim=-1).values
    want = {
        "ce": -logp.gather(-1, windows[:, 1:, None]).mean().item(),
        "entropy": -(logp.exp() * logp).sum(-1).mean().item(),
        "top_logit_margin": (top2[..., 0] - top2[..., 1]).mean().item(),
    }
    for key, value in want.items():
        assert result["label_path"][key] == pytest.approx(value, rel=1e-5), key
    assert len(result["radial"]["r"]) == 4 and result["radial"]["r"][-1] < 1e-6  # normalised
    assert len(result["scale_sweep"]["ce"]) == 17


def test_export_in_ouros_format_round_trips_bit_for_bit(imported, tmp_path):
    src, ckpt = imported
    proc = megaloop("export", ckpt, "--out", tmp_path / "ouro", "--format", "ouro")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = load_file(tmp_path / "ouro/model.safetensors")
    original = ouro_weights()
    assert sorted(out) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(out[name], tensor), name
    config = json.loads((tmp_path / "ouro/config.json").read_text())
    for key, value in CONFIG.items():
        assert config[key] == value, key
    assert config["auto_map"]["AutoModelForCausalLM"].endswith("modeling_ouro.OuroForCausalLM")
    assert not list((tmp_path / "ouro").glob("*.py"))  # Ouro's own code, not ours
    assert (tmp_path / "ouro/tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("command", [["export"], ["ckpt", "consolidate"]])
def test_overwrite_replaces_a_full_output_folder_whole(imported, tmp_path, command):
    """--overwrite leaves --out holding exactly what a new folder would: the same files, none of
    the ones it held before; byte for byte, but for the order of a safetensors header's metadata
    keys (safetensors writes them from a hash map: two saves of one dict may order them apart),
    so those files compare by their metadata and tensors."""
    from megaloop.cli import main

    _, ckpt = imported
    assert main([*command, str(ckpt), "--out", str(tmp_path / "new")]) == 0
    full = tmp_path / "full"
    (full / "sub").mkdir(parents=True)
    for name in ("model-00001-of-00002.safetensors", "config.json", "sub/tokenizer.json"):
        (full / name).write_text("an earlier export's")
    assert main([*command, str(ckpt), "--out", str(full), "--overwrite"]) == 0

    def files(folder):
        return {p.relative_to(folder): content(p) for p in folder.rglob("*") if p.is_file()}

    def content(path):
        if path.suffix != ".safetensors":
            return path.read_bytes()
        with safe_open(path, "pt") as f:
            tensors = {
                k: f.get_tensor(k).reshape(-1).view(torch.uint8).numpy().tobytes() for k in f.keys()
            }  # noqa: SIM118
            return f.metadata(), tensors

    assert files(full) == files(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "new"]  # no folder left beside


@pytest.mark.parametrize(
    "change, key",
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),  # yet lm_head.weight is present
    ],
)
def test_import_refuses_what_the_architecture_cannot_represent(tmp_path, change, key):
    src = write_ouro(tmp_path / "src", {**CONFIG, **change})
    proc = megaloop("import", "ouro", src, "--out", tmp_path / "out")
    assert proc.returncode == 2 and f"'{key}'" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_import_names_a_missing_weight(tmp_path):
    weights = ouro_weights()
    del weights["model.layers.1.input_layernorm_2.weight"]
    proc = megaloop(
        "import", "ouro", write_ouro(tmp_path / "src", weights=weights), "--out", tmp_path / "out"
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "'model.layers.1.input_layernorm_2.weight' is missing" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_export_in_ouros_format_refuses_another_architecture(reference_run, tmp_path):
    run_dir, _ = reference_run("per_loop+penalty")
    proc = megaloop("export", run_dir, "--out", tmp_path / "ouro", "--format", "ouro")
    assert proc.returncode == 2 and "model.layer_norms='pre'" in proc.stderr, proc.stderr
    assert not (tmp_path / "ouro").exists()


def test_ouros_architecture_has_rotary_positions():
    from megaloop.model import ModelConfig
    from megaloop.ouro import why_not_ouro

    ouro = dict(layer_norms="sandwich", loop_norm="shared", exit_gate=True)
    assert why_not_ouro(ModelConfig(**ouro)) is None
    learned = why_not_ouro(ModelConfig(**ouro, position_embedding="learned"))
    assert "model.position_embedding='learned'" in learned and "'rope'" in learned


@pytest.mark.multiprocess
def test_train_10_steps_from_an_import_at_tp2xpp2(imported, tmp_path):
    _, ckpt = imported
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        f"--master-port={free_port()}",
        "-m",
        "megaloop",
        "train",
        TINY,
        *BASE,
        *OVERRIDES,
        "parallel.tp=2",
        "parallel.pp=2",
        "train.steps=10",
        "train.save_every=0",
        f"train.init_from={ckpt}",
        f"train.dir={run_dir}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [r["loss"] for r in metrics(run_dir)["steps"]]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.95 * sum(losses[:3]) / 3, losses  # 6.18 -> 5.73 here
    # the run started from the import: the same run from the seed's initialisation does not (on
    # one process: its first loss is TP2 x PP2's within 1e-5, tests/multiprocess/test_parallel.py)
    fresh = tmp_path / "fresh"
    train_here(fresh, [*OVERRIDES, "train.steps=1", "train.save_every=0"])
    assert abs(metrics(fresh)["steps"][0]["loss"] - losses[0]) > 0.1


def test_init_from_another_model_is_refused_before_compute(imported, tmp_path):
    from megaloop import experiment
    from megaloop.config import ConfigError
    from megaloop.train import start

    _, ckpt = imported
    cfg = experiment.load(
        TINY,
        [
            *BASE,
            *OVERRIDES,
            "model.ffn_hidden_size=64",
            f"train.init_from={ckpt}",
            f"train.dir={tmp_path}",
        ],
    )
    with pytest.raises(ConfigError, match="ffn_hidden_size: 48 -> 64"):
        start.check_init_from(cfg)
