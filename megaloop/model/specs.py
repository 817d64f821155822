"""What a layer of the shared stack is made of, as megatron-core specs.

The stack uses megatron-core's local (non-Transformer-Engine) GPT layer: pre-norm RMSNorm,
causal self-attention (with RoPE, or none where learned positions are added to H_0), SwiGLU MLP,
no biases. Dropout (model.dropout) falls where the study's code has it: the attention
probabilities, the FFN output and, through megatron-core's embedding, H_0; the attention
sublayer's residual add never drops out (residual_add). Under bf16 autocast megatron-core's
bias-dropout-add casts the residual to the sublayer's dtype, so H is bf16 between sublayers;
with model.fp32_residual the sum keeps the residual's dtype (fp32 + bf16 → fp32), as the study's
code does under autocast. Two slots can change. Core attention:
`sdpa` (torch's scaled_dot_product_attention) instead of megatron-core's `DotProductAttention`,
which materialises the score matrix (1.25x slower steps on CPU here; bench/attention.py measures
it). And the sublayers' output projections: with `sandwich` norms (Ouro's layer) each is followed
by an RMSNorm before the residual add, x + N₂(f(N₁(x))), four norms a layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPAttention(MegatronModule):
    """Core attention through `F.scaled_dot_product_attention`, in megatron-core's slot.

    Same constructor and call signature as `DotProductAttention`: q, k, v arrive as
    [s, b, heads_per_partition, head_dim] and the output is [s, b, heads_per_partition*head_dim].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal masks only, got {attn_mask_type}")
        tp = (
            pg_collection.tp.size()
            if pg_collection is not None
            else (tensor_parallel.get_tensor_model_parallel_world_size())
        )
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if (
            attention_mask is not None
            or attention_bias is not None
            or packed_seq_params is not None
        ):
            raise ValueError("SDPAttention takes no mask, bias or packed sequences (causal only)")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        dropout = self.dropout if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork():
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                dropout_p=dropout,
                scale=self.softmax_scale,
                enable_gqa=self.groups != self.heads,
            )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class PostNormLinear(RowParallelLinear):
    """A sublayer's output projection followed by RMSNorm (the second norm of a sandwich). The
    norm sees the full, tensor-parallel-reduced output, so it is replicated like the layer's
    other norms. The projection has no bias, so normalising before the bias-add is exact."""

    def __init__(
        self, input_size: int, output_size: int, *, config: TransformerConfig, norm, **kwargs
    ):
        if kwargs.get("bias"):
            raise ValueError("PostNormLinear normalises the output of a projection without bias")
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_norm = build_module(
            norm, config=config, hidden_size=output_size, eps=config.layernorm_epsilon
        )

    def forward(self, x):
        out, bias = super().forward(x)
        return self.post_norm(out), bias


def residual_add(dropout: bool, fp32_residual: bool):
    """A sublayer's bias-dropout-add slot: residual + dropout(f(x) + bias). `dropout`: whether
    the sublayer's output drops out (the study's code drops out the FFN output, not the attention
    output projection). `fp32_residual`: the sum is taken in the residual's dtype when the
    sublayer's output has another (bf16 under autocast), where megatron-core's casts the residual
    to the output's dtype."""

    def bias_dropout_add(training: bool, fused: bool):
        add = get_bias_dropout_add(training, fused)

        def apply(x_with_bias, residual, prob):
            prob = prob if dropout else 0.0
            x, bias = x_with_bias
            if not fp32_residual or x.dtype == residual.dtype:
                return add(x_with_bias, residual, prob)
            x = x if bias is None else x + bias
            return residual + F.dropout(x, p=prob, training=training)

        return apply

    return bias_dropout_add


def tp_group():
    """This rank's tensor-parallel group, given to the layers the model builds itself (megatron-core
    deprecates finding it implicitly); None before megatron-core's parallel state exists."""
    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def layer_spec(
    attention: str, layer_norms: str, ffn_hidden_size: int, fp32_residual: bool = False
) -> ModuleSpec:
    """megatron-core's local GPT layer with RMSNorm; `attention` picks the core-attention slot,
    `layer_norms` (pre | sandwich) whether the sublayer outputs are normalised too,
    `fp32_residual` whether the residual adds keep the residual's dtype (residual_add)."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.mlp.params = {"ffn_hidden_size": ffn_hidden_size}
    spec.submodules.self_attn_bda = residual_add(dropout=False, fp32_residual=fp32_residual)
    spec.submodules.mlp_bda = residual_add(dropout=True, fp32_residual=fp32_residual)
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    if attention == "sdpa":
        attn.core_attention = SDPAttention
    if layer_norms == "sandwich":
        post = ModuleSpec(module=PostNormLinear, params={"norm": spec.submodules.input_layernorm})
        attn.linear_proj, mlp.linear_fc2 = post, post
    return spec


def transformer_config(model, **overrides) -> TransformerConfig:
    """megatron-core's TransformerConfig for a `ModelConfig` (one source of truth for the shape).

    `overrides` carries what parallelism decides (tensor/pipeline sizes, dtypes); the model's
    own choices (no biases, SwiGLU, RMSNorm, no CUDA fusions) are fixed here.
    """
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_size,
        kv_channels=model.hidden_size // model.num_heads,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=model.dropout,
        attention_dropout=model.dropout,
        init_method_std=model.init_std,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # megatron-core puts its weights on the current CUDA device unless told the CPU: follow
        # the device the model is built under (`with torch.device(...)`), as torch's own modules do
        use_cpu_initialization=torch.get_default_device().type != "cuda",
        params_dtype=torch.float32,
        cuda_graph_scope=[],  # no CUDA graphs; megatron-core's default "full" is deprecated
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def recompute_config(recompute: str) -> dict:
    """TransformerConfig keys of `train.recompute`: only `selective` is megatron-core's own (its
    full recompute lives in TransformerBlock, which the looped model does not use; `full` and
    `loop` are the model's)."""
    return {"recompute_granularity": "selective"} if recompute == "selective" else {}
