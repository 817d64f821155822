"""Export to transformers: the exported model computes the trainer model's logits, generates
with a KV cache as without, and loads offline in a fresh process from any checkpoint layout."""

import itertools
import json
import os
import shutil
import subprocess
import sys
from typing import get_args

import pytest
import torch

from conftest import build
from megaloop.export import hf_model
from megaloop.model import ModelConfig
from megaloop.model.config import (
    DampingShape,
    GateInput,
    LayerNorms,
    LoopNorm,
    ReadoutMode,
    RecurrenceMode,
)
from megaloop.model.modeling_megaloop import MegaloopForCausalLM
from multiproc import train
from support import left_padded, tiny_config

# every mode the config types name: a new mode is tested here without a new row
READOUTS, RECURRENCES = get_args(ReadoutMode), get_args(RecurrenceMode)


def exported(model, cfg: ModelConfig, **overrides) -> MegaloopForCausalLM:
    """The export of `model` (a trainer LoopedLM), in memory, with config `overrides`."""
    state = {
        k: v
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and "_extra_state" not in k
    }
    hf = hf_model(state, cfg)
    for key, value in overrides.items():
        setattr(hf.config, key, value)
    return hf


def variant(
    readout,
    recurrence,
    gate,
    tie=True,
    gate_input="normed",
    damping="channel",
    layer_norms="pre",
    loop_norm="separate",
    **more,
) -> tuple:
    cfg = tiny_config(
        num_query_groups=2,
        readout=readout,
        recurrence=recurrence,
        exit_gate=gate,
        tie_embeddings=tie,
        exit_gate_input=gate_input,
        damping_shape=damping,
        layer_norms=layer_norms,
        loop_norm=loop_norm,
        **more,
    )
    model = build(cfg).eval()
    with torch.no_grad():  # norms, damping and gate away from their initial constants
        for name, p in model.named_parameters():
            if any(part in name for part in ("norm", "damping", "exit_gate")):
                p.add_(0.1 * torch.randn_like(p))
    return cfg, model


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


# exit_weighted is the only objective that changes the model (it needs the exit gate)
@pytest.mark.parametrize(
    "readout, recurrence, gate",
    list(itertools.product(READOUTS, RECURRENCES, [False, True])),
)
def test_exported_logits_equal_the_trainer_models_at_any_k(readout, recurrence, gate):
    cfg, model = variant(readout, recurrence, gate, tie=gate)  # untied W_out with the gate
    hf = exported(model, cfg)
    clamped = exported(model, cfg, clamp=True)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for k in (1, 2, 4, 8):
            ref = model(tokens, num_loops=k).logits[-1].transpose(0, 1)
            assert rel_err(hf(tokens, num_loops=k, use_cache=False).logits, ref) <= 1e-5, k
            ref = model(tokens, num_loops=k, clamp=True).logits[-1].transpose(0, 1)
            assert rel_err(clamped(tokens, num_loops=k, use_cache=False).logits, ref) <= 1e-5


@pytest.mark.parametrize("readout", READOUTS)
@pytest.mark.parametrize(
    "layer_norms, loop_norm",
    [
        wiring
        for wiring in itertools.product(get_args(LayerNorms), get_args(LoopNorm))
        if wiring != ("pre", "separate")  # the test above
    ],
)
def test_ouro_wiring_exports_the_same_logits_and_gate(readout, layer_norms, loop_norm):
    """Sandwich norms and the shared loop norm (next loop, gate, normalising readout) in the
    export: every exit's logits and λ_k at any K, and the parameter count, equal the trainer's."""
    cfg, model = variant(
        readout, "none", gate=True, tie=False, layer_norms=layer_norms, loop_norm=loop_norm
    )
    hf = exported(model, cfg)
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for k in (1, 4, 6):
            out = model(tokens, num_loops=k)
            h0, rope = hf.embed(tokens)
            for j, h in hf.loops(h0, rope, k):
                assert rel_err(hf.readout(h, j, k), out.logits[j - 1].transpose(0, 1)) <= 1e-5
                assert rel_err(hf.exit_probability(h)[..., 0], out.gates[j - 1]) <= 1e-5


@pytest.mark.parametrize("readout", READOUTS)
def test_learned_positions_export_the_trainer_models_logits(readout):
    """The study's released setup: a position table added to H_0, no rotation, PyTorch's
    default initialisation; generation with a cache as without; a position past the table is
    one clear error."""
    cfg, model = variant(readout, "none", gate=False, position_embedding="learned", init="pytorch")
    hf = exported(model, cfg)
    assert hf.embed_positions.weight.shape == (cfg.max_seq_len, cfg.hidden_size)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for k in (1, 4, 8):
            ref = model(tokens, num_loops=k).logits[-1].transpose(0, 1)
            assert rel_err(hf(tokens, num_loops=k, use_cache=False).logits, ref) <= 1e-5, k
        out = hf.generate(tokens[:1, :7], max_new_tokens=10, do_sample=False, pad_token_id=0)
        x = tokens[:1, :7]
        for _ in range(10):
            x = torch.cat([x, hf(x, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
        assert out.tolist() == x.tolist()
        with pytest.raises(ValueError, match="past the learned position table's 32 rows"):
            hf(torch.zeros(1, 33, dtype=torch.long), use_cache=False)


@pytest.mark.parametrize("damping", get_args(DampingShape))
def test_every_damping_shape_exports(damping):
    cfg, model = variant("norm", "damping", gate=False, damping=damping)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for k in (1, 4, 6):
            ref = model(tokens, num_loops=k).logits[-1].transpose(0, 1)
            assert (
                rel_err(exported(model, cfg)(tokens, num_loops=k, use_cache=False).logits, ref)
                <= 1e-5
            )


@pytest.mark.parametrize(
    "readout, recurrence, clamp",
    [(r, RECURRENCES[i % len(RECURRENCES)], i % 2 == 1) for i, r in enumerate(READOUTS)],
)
def test_greedy_generate_with_cache_equals_the_no_cache_argmax(readout, recurrence, clamp):
    cfg, model = variant(readout, recurrence, gate=False)
    hf = exported(model, cfg, clamp=clamp)
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
        x = prompt
        for _ in range(10):
            x = torch.cat([x, hf(x, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert out.shape[1] == 17 and out.tolist() == x.tolist()
    cache = hf(prompt, use_cache=True).past_key_values  # an entry per (loop, layer)
    assert len(cache.layers) == cfg.num_loops * cfg.num_layers


def test_left_padded_batches_equal_each_sequence_alone():
    cfg, model = variant("final_norm", "damping", gate=False)
    hf = exported(model, cfg, clamp=True)
    long, short, batch, mask = left_padded()
    with torch.no_grad():
        logits = hf(batch, attention_mask=mask, use_cache=False).logits
        assert rel_err(logits[1, 4:], hf(short, use_cache=False).logits[0]) <= 1e-5
        assert rel_err(logits[0], hf(long, use_cache=False).logits[0]) <= 1e-5
        out = hf.generate(
            batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        )
        for row, prompt, pad in ((0, long, 0), (1, short, 4)):
            alone = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert out[row, pad:].tolist() == alone[0].tolist()


@pytest.mark.parametrize("gate_input", get_args(GateInput))
def test_early_exit_takes_each_tokens_exit_loop(gate_input):
    cfg, model = variant("norm", "rmsnorm", gate=True, tie=False, gate_input=gate_input)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = [lg.transpose(0, 1) for lg in model(tokens).logits]
        gates = torch.stack([g for g in model(tokens).gates])  # [K, b, s]
        first = exported(model, cfg, early_exit="gate", exit_threshold=0.0)(tokens).logits
        never = exported(model, cfg, early_exit="gate", exit_threshold=1.01)(tokens).logits
        q = 0.5
        mid = exported(model, cfg, early_exit="gate", exit_threshold=q)(tokens).logits
    assert rel_err(first, ref[0]) <= 1e-5 and rel_err(never, ref[-1]) <= 1e-5
    survive, expected, chosen = torch.ones_like(gates[0]), torch.empty_like(ref[0]), None
    for k in range(cfg.num_loops):
        survive = survive * (1 - gates[k])
        stop = (1 - survive >= q) if k < cfg.num_loops - 1 else torch.ones_like(survive).bool()
        take = stop if chosen is None else stop & ~chosen
        expected[take] = ref[k][take]
        chosen = take if chosen is None else chosen | take
    assert rel_err(mid, expected) <= 1e-5


@pytest.mark.multiprocess
def test_export_of_a_tp2_pp2_checkpoint_loads_offline_in_a_fresh_process(tmp_path):
    from megaloop import experiment
    from megaloop.cli import main
    from megaloop.model import build_model

    run = tmp_path / "run"
    train(4, run, ["parallel.tp=2", "parallel.pp=2", "model.num_query_groups=2", "train.steps=2"])
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_megaloop.MegaloopForCausalLM"
    )
    # the trainer's model, from the same checkpoint in this process
    from megaloop.parallel import distributed

    distributed.init(seed=0)
    state, cfg, _ = experiment.consolidated(run)
    model = build_model(cfg.model).eval()
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all("_extra_state" in k for k in missing)
    tokens = torch.tensor([list(b"12+34=46\n7+8=")])
    with torch.no_grad():
        ref = {k: model(tokens, num_loops=k).logits[-1].transpose(0, 1) for k in (1, 2, 4, 8)}
    torch.save(tokens, tmp_path / "tokens.pt")
    moved = tmp_path / "moved"  # nothing may point back at the training run or the repo
    shutil.copytree(out, moved)
    script = f"""
import torch, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
path = {str(moved)!r}
tokens = torch.load({str(tmp_path / "tokens.pt")!r})
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
assert tok("12+34=46\\n7+8=", return_tensors="pt").input_ids.tolist() == tokens.tolist()
out = {{}}
for k in (1, 2, 4, 8):
    m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, num_loops=k).eval()
    assert m.config.num_loops == k
    assert "megaloop" not in sys.modules and "megatron" not in sys.modules
    with torch.no_grad():
        out[k] = m(tokens, use_cache=False).logits
gen = m.generate(tokens, max_new_tokens=6, do_sample=False, pad_token_id=0)
x = tokens
with torch.no_grad():
    for _ in range(6):
        x = torch.cat([x, m(x, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
assert gen.tolist() == x.tolist()
torch.save(out, {str(tmp_path / "logits.pt")!r})
"""
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "m"))
    # a network namespace of its own where we may make one (root): no network at all
    isolate = ["unshare", "-n"] if shutil.which("unshare") and os.geteuid() == 0 else []
    proc = subprocess.run(
        [*isolate, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "logits.pt")
    for k in (1, 2, 4, 8):
        assert rel_err(got[k], ref[k]) <= 1e-5, k


def test_every_model_option_reaches_the_exported_config_and_back():
    """One table (configuration_megaloop.FIELDS) carries ModelConfig into config.json: changing
    any field an export carries changes what it writes, and the loaded config reads it back."""
    import dataclasses
    import typing

    from megaloop.model.config import TRAINING_ONLY
    from megaloop.model.configuration_megaloop import FIELDS, MegaloopConfig, exported

    base = ModelConfig(num_query_groups=2, ffn_hidden_size=96)
    hints = typing.get_type_hints(ModelConfig)
    for field in dataclasses.fields(ModelConfig):
        if field.name in TRAINING_ONLY:
            continue
        value = getattr(base, field.name)
        kind = hints[field.name]
        modes = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else ()
        if modes:
            other = next(m for m in modes if m != value)
        elif isinstance(value, bool):
            other = not value
        else:
            other = value * 2
        changed = dataclasses.replace(base, **{field.name: other})
        assert exported(changed) != exported(base), f"{field.name} is not in the exported config"
    loaded = MegaloopConfig(**exported(base))
    for f in FIELDS:
        assert getattr(loaded, f.name) == exported(base)[f.name], f.name


@pytest.mark.parametrize("command", [["export"], ["ckpt", "consolidate"]])
def test_an_output_that_is_a_file_or_a_full_folder_is_refused_before_any_work(
    command, tmp_path, capsys, monkeypatch
):
    """One line naming --out, before the checkpoint is read, and what --out held is kept: a
    file, a folder that is not empty (without --overwrite), a folder that holds the source or
    the current directory (with it)."""
    from megaloop import experiment
    from megaloop.cli import main

    def read(*args):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(experiment, "consolidated", read)
    (tmp_path / "run").mkdir()
    (tmp_path / "model.bin").write_text("mine")
    (tmp_path / "full/here").mkdir(parents=True)
    (tmp_path / "full/notes.txt").write_text("mine")
    cases = [
        ("model.bin", [], "is a file, not a folder: give a new or empty folder"),
        ("full", [], "is a folder that is not empty: give a new or empty folder, or --overwrite"),
        (".", ["--overwrite"], f"holds the source ({tmp_path / 'run'})"),
        ("full", ["--overwrite"], f"holds the current directory ({tmp_path / 'full/here'})"),
    ]
    monkeypatch.chdir(tmp_path)
    for out, options, says in cases:
        if "current directory" in says:
            monkeypatch.chdir(tmp_path / "full/here")
        capsys.readouterr()
        code = main([*command, str(tmp_path / "run"), "--out", str(tmp_path / out), *options])
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith(f"megaloop: error: --out {tmp_path / out} ") and says in err, err
    assert (tmp_path / "model.bin").read_text() == (tmp_path / "full/notes.txt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "model.bin", "run"]
