"""Ouro's checkpoint format, both ways: `megaloop import ouro` and `megaloop export --format ouro`.

A published Ouro folder (ByteDance/Ouro-1.4B: config.json + safetensors, its code on the hub)
holds the architecture megaloop builds with `layer_norms: sandwich`, `loop_norm: shared`, the
exit gate and a normalised readout. Names, one layer shown:

    Ouro                                        megaloop (one process)
    model.embed_tokens.weight                   embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight       layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj       layers.i.self_attention.linear_qkv (fused,
                                                grouped per key/value head as [q..., k, v])
    model.layers.i.self_attn.o_proj             layers.i.self_attention.linear_proj
    model.layers.i.input_layernorm_2            layers.i.self_attention.linear_proj.post_norm
    model.layers.i.post_attention_layernorm     layers.i.pre_mlp_layernorm
    model.layers.i.mlp.{gate,up}_proj           layers.i.mlp.linear_fc1 ([gate; up])
    model.layers.i.mlp.down_proj                layers.i.mlp.linear_fc2
    model.layers.i.post_attention_layernorm_2   layers.i.mlp.linear_fc2.post_norm
    model.norm.weight                           loop_norm.weight
    model.early_exit_gate.{weight,bias}         exit_gate.proj.{weight,bias}
    lm_head.weight                              readout.output_layer.weight (untied)

Import writes a megaloop checkpoint folder (a megatron-core dist checkpoint of the model, no
optimizer) that export, the measurement commands and `train.init_from` read. Export writes
Ouro's names and config keys with `auto_map` pointing at the published code: the folder carries
no code of ours.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megaloop.config import ConfigError
from megaloop.model import ModelConfig

OURO_CODE = "ByteDance/Ouro-1.4B"
AUTO_MAP = {
    "AutoConfig": f"{OURO_CODE}--configuration_ouro.OuroConfig",
    "AutoModel": f"{OURO_CODE}--modeling_ouro.OuroModel",
    "AutoModelForCausalLM": f"{OURO_CODE}--modeling_ouro.OuroForCausalLM",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


class FormatError(ConfigError):
    """A folder or a run that the Ouro format cannot carry; the message names the key (a
    ConfigError: one line from every command)."""


def model_config(cfg: dict, lm_head_present: bool) -> ModelConfig:
    """ModelConfig of an Ouro config.json; what this architecture cannot represent is refused."""

    def refuse(key, why):
        raise FormatError(f"Ouro config key '{key}': got {cfg.get(key)!r}; {why}")

    if cfg.get("model_type", "ouro") != "ouro":
        refuse("model_type", "not an Ouro checkpoint")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse(
            "hidden_act",
            "megaloop's layers are SwiGLU (silu); another activation cannot be represented",
        )
    if cfg.get("use_sliding_window"):
        refuse(
            "use_sliding_window",
            "megaloop attends over the full causal context; sliding-"
            "window layers cannot be represented",
        )
    if any(t != "full_attention" for t in cfg.get("layer_types") or []):
        refuse("layer_types", "only full_attention layers can be represented")
    if cfg.get("rope_scaling"):
        refuse("rope_scaling", "megaloop's RoPE has no scaling")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        refuse(
            "attention_bias" if cfg.get("attention_bias") else "mlp_bias",
            "megaloop's projections have no biases",
        )
    heads = cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, cfg["hidden_size"] // heads):
        refuse(
            "head_dim",
            f"megaloop's head dimension is hidden_size / num_attention_heads = "
            f"{cfg['hidden_size'] // heads}",
        )
    tied = bool(cfg.get("tie_word_embeddings", False))
    if tied == lm_head_present:
        refuse(
            "tie_word_embeddings",
            "the weights disagree: "
            + (
                "lm_head.weight is present, so the embeddings are not tied"
                if tied
                else "there is no lm_head.weight, so the output layer must be the tied embedding"
            ),
        )
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_query_groups=(
            None if cfg.get("num_key_value_heads") in (None, heads) else cfg["num_key_value_heads"]
        ),
        num_layers=cfg["num_hidden_layers"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_loops=cfg.get("total_ut_steps", 4),
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        rope_base=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        init_std=float(cfg.get("initializer_range", 0.02)),
        tie_embeddings=tied,
        readout="norm",
        recurrence="none",
        layer_norms="sandwich",
        loop_norm="shared",
        exit_gate=True,
    )


def why_not_ouro(model: ModelConfig) -> str | None:
    """None if Ouro's code computes what `model` computes, else the reason it does not."""
    wanted = {
        "layer_norms": "sandwich",
        "loop_norm": "shared",
        "recurrence": "none",
        "readout": "norm",
        "exit_gate": True,
        "position_embedding": "rope",
    }
    for key, value in wanted.items():
        if getattr(model, key) != value:
            return (
                f"model.{key}={getattr(model, key)!r}: Ouro's architecture has "
                f"{key}={value!r}"
                + (
                    " (its lm_head reads model.norm's output; export the "
                    "no-readout-norm model in megaloop format)"
                    if key == "readout"
                    else ""
                )
            )
    return None


def ouro_config(model: ModelConfig) -> dict:
    from megaloop.export import shape_config

    return {
        "model_type": "ouro",
        "architectures": ["OuroForCausalLM"],
        "auto_map": AUTO_MAP,
        **shape_config(model),
        "head_dim": model.hidden_size // model.num_heads,
        "hidden_act": "silu",
        "initializer_range": model.init_std,
        "total_ut_steps": model.num_loops,
        "early_exit_threshold": 1.0,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * model.num_layers,
        "use_cache": True,
    }


def to_ouro(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """megaloop's one-process names → Ouro's (via the megaloop export's, which share Ouro's
    layer names)."""
    from megaloop.export import to_hf

    out = {}
    for name, tensor in to_hf(state, model).items():
        if name == "exit_gate.weight" or name == "exit_gate.bias":
            name = "model.early_exit_gate." + name.split(".")[-1]
        elif name != "lm_head.weight":
            name = "model." + name
        out[name] = tensor
    return out


def from_ouro(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Ouro's names → megaloop's one-process names, q/k/v and gate/up fused as megatron-core
    holds them."""
    heads, groups = model.num_heads, model.num_query_groups or model.num_heads
    head_dim = model.hidden_size // heads
    take = dict(tensors)

    def pop(name: str) -> torch.Tensor:
        if name not in take:
            raise FormatError(
                f"weight {name!r} is missing: config.json describes a model the "
                f"safetensors files do not hold"
            )
        return take.pop(name)

    out = {
        "embedding.word_embeddings.weight": pop("model.embed_tokens.weight"),
        "loop_norm.weight": pop("model.norm.weight"),
        "exit_gate.proj.weight": pop("model.early_exit_gate.weight"),
        "exit_gate.proj.bias": pop("model.early_exit_gate.bias"),
    }
    if not model.tie_embeddings:
        out["readout.output_layer.weight"] = pop("lm_head.weight")
    for i in range(model.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = (pop(src + f"self_attn.{p}_proj.weight") for p in "qkv")
        qkv = torch.cat(
            [
                q.view(groups, heads // groups * head_dim, -1),
                k.view(groups, head_dim, -1),
                v.view(groups, head_dim, -1),
            ],
            dim=1,
        )
        out.update(
            {
                dst + "input_layernorm.weight": pop(src + "input_layernorm.weight"),
                dst + "self_attention.linear_qkv.weight": qkv.reshape(-1, model.hidden_size),
                dst + "self_attention.linear_proj.weight": pop(src + "self_attn.o_proj.weight"),
                dst + "self_attention.linear_proj.post_norm.weight": pop(
                    src + "input_layernorm_2.weight"
                ),
                dst + "pre_mlp_layernorm.weight": pop(src + "post_attention_layernorm.weight"),
                dst + "mlp.linear_fc1.weight": torch.cat(
                    [pop(src + "mlp.gate_proj.weight"), pop(src + "mlp.up_proj.weight")]
                ),
                dst + "mlp.linear_fc2.weight": pop(src + "mlp.down_proj.weight"),
                dst + "mlp.linear_fc2.post_norm.weight": pop(
                    src + "post_attention_layernorm_2.weight"
                ),
            }
        )
    take = {k: v for k, v in take.items() if not k.endswith("rotary_emb.inv_freq")}
    if take:
        raise FormatError(f"weights this architecture has no place for: {sorted(take)[:8]}")
    return {k: v.float().contiguous() for k, v in out.items()}


def read_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder: model.safetensors, or the shards its index names."""
    from safetensors.torch import load_file

    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FormatError(
            f"{src} holds neither model.safetensors nor "
            f"model.safetensors.index.json (only safetensors are read)"
        )
    tensors = {}
    for name in files:
        tensors.update(load_file(src / name))
    return tensors


def import_ouro(src: Path, out: Path) -> Path:
    """A published Ouro folder → a megaloop checkpoint folder (model weights, config, meta).
    Everything is checked before anything is written; `out` must not exist yet."""
    from megatron.core import dist_checkpointing

    from megaloop.experiment import ExperimentConfig
    from megaloop.model.looped import build_model
    from megaloop.train import checkpoint

    if not (src / "config.json").is_file():
        raise FormatError(f"{src} has no config.json; give the folder of a published Ouro model")
    if out.exists():
        raise FormatError(f"{out} exists; import into a new folder (nothing is overwritten)")
    tensors = read_tensors(src)
    model = model_config(
        json.loads((src / "config.json").read_text()), lm_head_present="lm_head.weight" in tensors
    )
    seq_len = min(ExperimentConfig().data.seq_len, model.max_seq_len)
    cfg = ExperimentConfig.from_dict({"model": model.to_dict(), "data": {"seq_len": seq_len}})
    state = from_ouro(tensors, model)
    with torch.device("cpu"):
        module = build_model(model, seed=None)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [m for m in missing if "_extra_state" not in m]
    if missing or unexpected:
        raise FormatError(
            f"the weights do not fit the architecture of config.json: missing "
            f"{missing[:8]}, unexpected {unexpected[:8]}"
        )
    tmp = out.with_name(f".tmp_{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    if (tmp / "tokenizer.json").is_file():
        cfg.data.tokenizer = str((out / "tokenizer.json").resolve())
    dist_checkpointing.save({"model": module.sharded_state_dict()}, str(tmp))
    checkpoint.write_meta(
        tmp,
        {
            "step": 0,
            "consumed_samples": 0,
            "engine": "megatron",
            "layout": {"tp": 1, "pp": 1, "dp": 1},
            "num_loops_trained": model.num_loops,
            "config": cfg.to_dict(),
            "imported_from": str(src.resolve()),
        },
    )
    tmp.rename(out)
    return out


def export_ouro(source: Path, out: Path) -> Path:
    """A megaloop run or checkpoint of Ouro's architecture → an Ouro folder (safetensors,
    Ouro's config keys, auto_map to the published code, the tokenizer if the run has one)."""
    from safetensors.torch import save_file

    from megaloop import experiment
    from megaloop.export import save_tokenizer
    from megaloop.train import checkpoint

    folder = checkpoint.resolve(source)
    cfg = experiment.config_of(folder)
    reason = why_not_ouro(cfg.model)
    if reason:
        raise FormatError(f"{source} cannot be exported in Ouro's format: {reason}")
    state, cfg, folder = experiment.consolidated(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        to_ouro(state, cfg.model),
        out / "model.safetensors",
        metadata={"format": "pt", "source": str(folder)},
    )
    (out / "config.json").write_text(json.dumps(ouro_config(cfg.model), indent=1))
    if (folder / "tokenizer.json").is_file():  # an imported folder: Ouro's own files
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
    else:
        save_tokenizer(cfg.data.tokenizer_spec(), out)
    return out
