"""Export a checkpoint as a Hugging Face transformers model (remote code, safetensors).

The folder loads anywhere transformers does, with no megaloop or megatron-core installed:

    AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True, num_loops=8)

The code is megaloop/model/{configuration,modeling}_megaloop.py, the decoding.py and semantics.py
they import (semantics.py is the one definition of the loop the training model uses too) and
modes.py, copied in, with the sha256 of each
recorded in config.json ("megaloop_code"; config.json is written last, so a folder without it is
not a finished export); megaloop itself loads an export only when its code is that record and
this megaloop's own (megaloop.evaluation.exported). The weights are the
consolidated checkpoint (any layout) renamed to that code's modules, with megatron-core's fused
projections split: linear_qkv is grouped per key/value head as [q heads of the group, k, v],
and the SwiGLU linear_fc1 is [gate; up].
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megaloop.digest import file_digest

CODE_DIR = Path(__file__).parent / "model"
AUTO_MAP = {
    "AutoConfig": "configuration_megaloop.MegaloopConfig",
    "AutoModelForCausalLM": "modeling_megaloop.MegaloopForCausalLM",
}
CODE_FILES = (
    "configuration_megaloop.py",
    "modeling_megaloop.py",
    "decoding.py",
    "semantics.py",
    "modes.py",
)


def own_code() -> dict[str, str]:
    """sha256 of this megaloop's export code, by file name."""
    return {name: file_digest(CODE_DIR / name) for name in CODE_FILES}


def code_problem(folder: Path, config: dict) -> str | None:
    """None if `folder` (an export, its config.json read as `config`) carries exactly this
    megaloop's code, as recorded at export; else what is wrong."""
    recorded, own = config.get("megaloop_code"), own_code()
    if not isinstance(recorded, dict):
        return (
            "config.json records no megaloop_code (the sha256 of its code files), so it was "
            "not written by `megaloop export`, or the export did not finish"
        )
    if recorded != own:
        return (
            "its recorded code is not this megaloop's (exported by another version, or "
            "edited); export the checkpoint again with this megaloop"
        )
    if config.get("auto_map") != AUTO_MAP:
        return f"its auto_map {config.get('auto_map')!r} points at code other than {AUTO_MAP}"
    for name, digest in recorded.items():
        if not (folder / name).is_file():
            return f"{name} is missing"
        if file_digest(folder / name) != digest:
            return f"{name} differs from the code recorded at export (sha256)"
    return None


def shape_config(model) -> dict:
    """The transformers config keys of a `ModelConfig`'s shape (shared by megaloop's and Ouro's
    config.json)."""
    from megaloop.model.configuration_megaloop import FIELDS, exported

    values = exported(model)
    return {**{f.name: values[f.name] for f in FIELDS if f.shape}, "torch_dtype": "float32"}


def hf_config(model) -> dict:
    """config.json of a `ModelConfig`: every field of the exported config's table."""
    from megaloop.model.configuration_megaloop import exported

    return {
        "model_type": "megaloop",
        "architectures": ["MegaloopForCausalLM"],
        "auto_map": AUTO_MAP,
        **exported(model),
        "torch_dtype": "float32",
    }


def split_qkv(w: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, ...]:
    head_dim = w.shape[0] // (heads + 2 * groups)
    per_group = w.view(groups, (heads // groups + 2) * head_dim, -1)
    q, k, v = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, w.shape[1]).contiguous() for t in (q, k, v))


def to_hf(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """megaloop's one-process parameter names → the exported model's."""
    out = {"embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    heads, groups = model.num_heads, model.num_query_groups or model.num_heads
    for i in range(model.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        q, k, v = split_qkv(state[src + "self_attention.linear_qkv.weight"], heads, groups)
        gate, up = state[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update(
            {
                dst + "input_layernorm.weight": state[src + "input_layernorm.weight"],
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": state[src + "self_attention.linear_proj.weight"],
                dst + "post_attention_layernorm.weight": state[src + "pre_mlp_layernorm.weight"],
                dst + "mlp.gate_proj.weight": gate.contiguous(),
                dst + "mlp.up_proj.weight": up.contiguous(),
                dst + "mlp.down_proj.weight": state[src + "mlp.linear_fc2.weight"],
            }
        )
        if model.layer_norms == "sandwich":
            out[dst + "input_layernorm_2.weight"] = state[
                src + "self_attention.linear_proj.post_norm.weight"
            ]
            out[dst + "post_attention_layernorm_2.weight"] = state[
                src + "mlp.linear_fc2.post_norm.weight"
            ]
    renames = {
        "embedding.position_embeddings.weight": "embed_positions.weight",
        "recurrence.norm.weight": "recurrence.norm.weight",
        "recurrence.damping_logit": "recurrence.damping_logit",
        "readout.norm.weight": "readout_norm.weight",
        "loop_norm.weight": "norm.weight",
        "exit_gate.proj.weight": "exit_gate.weight",
        "exit_gate.proj.bias": "exit_gate.bias",
    }
    if not model.tie_embeddings:
        renames["readout.output_layer.weight"] = "lm_head.weight"
    out.update({dst: state[src] for src, dst in renames.items() if src in state})
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def hf_model(state: dict[str, torch.Tensor], model):
    """The exported model, in memory: what `from_pretrained` of an export of `state` gives."""
    from megaloop.model.configuration_megaloop import MegaloopConfig
    from megaloop.model.modeling_megaloop import MegaloopForCausalLM

    config = {
        k: v
        for k, v in hf_config(model).items()
        if k not in ("auto_map", "architectures", "model_type", "torch_dtype")
    }
    hf = MegaloopForCausalLM(MegaloopConfig(**config))
    missing, unexpected = hf.load_state_dict(to_hf(state, model), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if model.tie_embeddings else set()):
        raise ValueError(
            f"the checkpoint does not fit the exported model: missing {missing}, "
            f"unexpected {unexpected}"
        )
    hf.tie_weights()
    return hf.eval()


def save_tokenizer(spec: str, out: Path) -> None:
    """tokenizer.json (+ config) for AutoTokenizer: the run's own, or the byte tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from megaloop.data.tokenizer import BYTE_EOS, byte_level_tokenizer, special_tokens

    if spec == "bytes":
        tok, roles = byte_level_tokenizer(), {"eos_token": BYTE_EOS}
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(spec)
        roles = special_tokens(tok)  # a BPE's end of text; the word vocabulary's four
    PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, **roles
    ).save_pretrained(out)


def export(source: Path, out: Path) -> Path:
    """A run directory or checkpoint folder (any engine, any layout) → a transformers folder."""
    from megaloop import experiment

    return write(*experiment.consolidated(source), out)


def write(state: dict, cfg, folder: Path, out: Path) -> Path:
    """`experiment.consolidated`'s tensors, config and checkpoint folder as a transformers
    folder `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)  # an earlier export's: written again last
    tensors = to_hf(state, cfg.model)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt", "source": str(folder)})
    for name in CODE_FILES:
        shutil.copyfile(CODE_DIR / name, out / name)
    save_tokenizer(cfg.data.tokenizer_spec(), out)
    (out / "config.json").write_text(
        json.dumps(
            {
                **hf_config(cfg.model),
                "run_config": cfg.to_dict(),
                "megaloop_code": {name: file_digest(out / name) for name in CODE_FILES},
            },
            indent=1,
        )
    )
    return out
