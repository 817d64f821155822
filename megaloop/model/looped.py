"""The looped language model: embedding → a shared stack of L layers applied K times → an exit
after every loop.

    H_0 = Embed(x)
    H_k = Stack(R(H_{k-1}))          k = 1..K, R = recurrence (identity for k = 1)
    logits_k = Readout_k(H_k)        one shared W_out

What R, the readout, the exit gate and the shared loop norm do is megaloop.model.semantics;
`enter` and `exit` are the two halves of a loop around the stack, which the pipeline's lap
chunks (megaloop.parallel.pipeline) call too.

The stack is megatron-core's own transformer layers (see specs.py), tensors are sequence-first
([s, b, d]) as in megatron-core. This file is single-device code: parallelism is applied
elsewhere (megaloop.parallel), and it never imports the CPU compatibility layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    sharded_state_dict_default,
)
from torch.utils.checkpoint import checkpoint

from megaloop.model import semantics
from megaloop.model.config import ModelConfig, Recompute
from megaloop.model.readout import Readout
from megaloop.model.sampled_exits import SampledExits, draw
from megaloop.model.specs import layer_spec, tp_group

POSITION_EMBEDDINGS = {"rope": "rope", "learned": "learned_absolute"}
"""model.position_embedding → megatron-core's LanguageModelEmbedding position_embedding_type."""


@dataclass
class LoopOutput:
    """Everything the objectives and diagnostics need, one entry per loop k = 1..K."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    """H_k, [s, b, d]."""
    logits: list[torch.Tensor] = field(default_factory=list)
    """Vocab-parallel logits [s, b, V/tp] (when no labels are given, or keep_logits)."""
    token_ce: list[torch.Tensor] = field(default_factory=list)
    """Per-token cross-entropy [b, s] (only when labels are given)."""
    gates: list[torch.Tensor] = field(default_factory=list)
    """Exit-gate λ_k, [b, s] (only with an exit gate)."""
    labels: torch.Tensor | None = None
    """[b, s], the targets of token_ce."""


class LoopedLM(LanguageModule):
    """A looped decoder. `pre_process`/`post_process` and `layer_ids` let a pipeline stage hold
    the embedding, the exits, or a slice of the shared stack; one process holds everything."""

    def __init__(
        self,
        cfg: ModelConfig,
        config: TransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        layer_ids: range | None = None,
        vp_stage=None,
        recompute: Recompute = "none",
        exit_rate: float = 0.0,
    ):
        super().__init__(config=config)
        self.cfg = cfg
        self.recompute = recompute
        """Activations recomputed in backward: `full` each layer's, `loop` each application of
        this module's layers (one loop, or under PP this stage's share of a lap) keeping only
        its input; `selective` (core attention) is megatron-core's, set in `config`."""
        self.exit_rate = exit_rate  # a training forward's early exits (sampled_exits)
        self.exits: SampledExits | None = None
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = cfg.tie_embeddings
        if vp_stage is not None:
            # megatron-core ties the embedding copies of the first and the last virtual stage;
            # under the circular pipeline this one module is every lap of its rank.
            self.vp_stage = config.virtual_pipeline_model_parallel_size - 1 if post_process else 0
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config,
                vocab_size=cfg.vocab_size,
                max_sequence_length=cfg.max_seq_len,
                position_embedding_type=POSITION_EMBEDDINGS[cfg.position_embedding],
                tp_group=tp_group(),
            )
        self.rotary_pos_emb = (
            RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=1.0,
                rotary_base=cfg.rope_base,
                use_cpu_initialization=config.use_cpu_initialization,
            )
            if cfg.position_embedding == "rope"
            else None
        )
        spec = layer_spec(cfg.attention, cfg.layer_norms, cfg.ffn_size, cfg.fp32_residual)
        self.layer_ids = list(layer_ids if layer_ids is not None else range(cfg.num_layers))
        self.layers = torch.nn.ModuleList(
            build_module(spec, config=config, layer_number=i + 1, vp_stage=vp_stage)
            for i in range(len(self.layer_ids))
        )
        self.hook_exited_keys()
        # H_k re-enters the stack where the embedding does; exits are read where W_out lives.
        if pre_process:
            self.recurrence = semantics.Recurrence(
                cfg.recurrence, cfg.hidden_size, cfg.norm_eps, cfg.damping_init, cfg.damping_shape
            )
        # The shared loop norm sits at the end of the loop, beside the exits; the next loop
        # receives its output, so under PP it needs no copy on the first stage.
        self.loop_norm = (
            semantics.loop_norm(cfg.loop_norm, cfg.hidden_size, cfg.norm_eps)
            if post_process
            else None
        )
        self.exit_gate = (
            semantics.ExitGate(cfg.hidden_size, cfg.exit_gate_input, cfg.norm_eps)
            if cfg.exit_gate and post_process
            else None
        )
        if post_process:
            self.readout = Readout(
                cfg.readout,
                config,
                cfg.vocab_size,
                tied=cfg.tie_embeddings and pre_process,
                trained_loops=cfg.num_loops,
                loop_norm=cfg.loop_norm,
            )
        self.setup_embeddings_and_output_layer()

    @property
    def output_layer(self):
        return self.readout.output_layer

    def global_name(self, name: str) -> str:
        """This module's parameter name → its name in the whole one-device model."""
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            return f"layers.{self.layer_ids[int(index)]}.{rest}"
        if name == "readout.output_layer.weight" and self.cfg.tie_embeddings:
            return "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
        return name

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline stages after the first receive H from the previous stage (megatron-core API)."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def rotary(self, seq_len: int) -> torch.Tensor | None:
        """The rotary tables every layer reads; None with learned positions (added to H_0)."""
        return None if self.rotary_pos_emb is None else self.rotary_pos_emb(seq_len)

    def stack(self, h: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        """One application of this module's layers of the shared stack."""
        if self.recompute == "loop" and torch.is_grad_enabled():
            return checkpoint(self._layers, h, rope, use_reentrant=False)
        return self._layers(h, rope)

    def _layers(self, h: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        full = self.recompute == "full" and torch.is_grad_enabled()
        for layer in self.layers:
            if full:
                h = checkpoint(self._layer, layer, h, rope, use_reentrant=False)
            else:
                h = self._layer(layer, h, rope)
        return h

    @staticmethod
    def _layer(layer, h: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        return layer(h, attention_mask=None, rotary_pos_emb=rope)[0]

    def hook_exited_keys(self) -> None:
        """Every layer's core attention reads `exited_keys` of its keys and values."""
        for i, layer in enumerate(self.layers):
            attention = layer.self_attention.core_attention
            attention.register_forward_pre_hook(partial(self.exited_keys, i))

    def exited_keys(self, layer: int, core_attention, args: tuple):
        """Core attention's (query, key, value, ...) with the exited tokens' keys and values,
        during a forward with exits."""
        if self.exits is None:
            return None
        query, key, value, *rest = args
        return (query, *self.exits.keys_values(layer, key, value), *rest)

    def logits(
        self, h: torch.Tensor, loop: int, last: int, normed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Exit `loop`'s logits in a run of `last` loops; `normed` is the shared loop norm's
        N(H), when the model has one."""
        weight = self.shared_embedding_or_output_weight() if self.cfg.tie_embeddings else None
        norm = None if normed is None else semantics.Reused(self.loop_norm, normed)
        return self.readout(h, loop, last, weight=weight, norm=norm)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        num_loops: int | None = None,
        clamp: bool = False,
        keep_logits: bool = False,
        exit_loops: torch.Tensor | None = None,
    ) -> LoopOutput:
        """tokens, labels: [b, s]. `num_loops` overrides K; `clamp` holds every token's RMS at
        its loop-1 value (inference-time recurrent-scale clamp); `keep_logits` keeps every
        exit's logits beside its CE (for objectives of the logits themselves); `exit_loops`
        [b, s], each token's exit under `copy` (sampled_exits), drawn in training when the
        model has an exit rate."""
        rope = self.rotary(tokens.shape[1])
        out = LoopOutput(labels=labels)
        held = semantics.Clamp() if clamp else None
        h, last = tokens, num_loops or self.cfg.num_loops
        if exit_loops is None and self.training and self.exit_rate > 0 and last > 1:
            exit_loops = draw(tokens, last, self.exit_rate)
        self.exits = None if exit_loops is None else SampledExits(exit_loops)
        try:
            for k in range(1, last + 1):
                if self.exits is not None:
                    self.exits.loop = k
                h = self.stack(self.enter(h, k), rope)
                if held is not None:
                    h = held(h)
                out.hidden.append(h)
                h = self.exit(out, h, k, last, labels, keep_logits)
        finally:
            self.exits = None
        return out

    def enter(self, x: torch.Tensor, loop: int) -> torch.Tensor:
        """What loop `loop` starts from: H_0 = Embed(tokens x) for loop 1, else R(x), x being
        what the previous loop's `exit` returned."""
        if loop > 1:
            return self.recurrence(x)
        positions = None
        if self.embedding.add_position_embedding:
            positions = torch.arange(x.shape[1], device=x.device).expand_as(x)
        return self.embedding(x, position_ids=positions)

    def exit(
        self,
        out: LoopOutput,
        h: torch.Tensor,
        loop: int,
        last: int,
        labels: torch.Tensor | None,
        keep_logits: bool = False,
    ) -> torch.Tensor:
        """Read out loop `loop`'s hidden state (of a run of `last` loops) into `out` (logits or
        per-token CE, and the gate); return what the next loop receives: H_k, or the shared loop
        norm's N(H_k)."""
        normed = self.loop_norm(h) if self.loop_norm is not None else None
        logits = self.logits(h, loop, last, normed)
        if labels is None or keep_logits:
            out.logits.append(logits)
        if labels is not None:
            # megatron-core's CE shifts its input in place: logits kept in `out` go in as a copy
            ce = tensor_parallel.vocab_parallel_cross_entropy(
                logits.to(torch.float32, copy=keep_logits), labels.t().contiguous()
            )
            out.token_ce.append(ce.t())
        if self.exit_gate is not None:
            out.gates.append(self.exit_gate(h, normed).t())
        return h if normed is None else normed

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron-core dist-checkpoint view: every tensor under its name in the one-device
        model (layers by global index, a last stage's tied W_out as a replica of the
        embedding), so a checkpoint loads into any parallel layout."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = {}
        for name, child in self.named_children():
            if name != "layers":
                state.update(
                    sharded_state_dict_default(
                        child, f"{prefix}{name}.", sharded_offsets, metadata, self.tp_group
                    )
                )
        for i, layer in enumerate(self.layers):
            local = f"{prefix}layers.{i}."
            layer_state = layer.sharded_state_dict(local, sharded_offsets, metadata)
            replace_prefix_for_sharding(layer_state, local, f"{prefix}layers.{self.layer_ids[i]}.")
            state.update(layer_state)
        if self.share_embeddings_and_output_weights:
            self.tie_embeddings_and_output_weights_state_dict(
                state,
                f"{prefix}readout.output_layer.weight",
                f"{prefix}embedding.word_embeddings.weight",
                metadata,
            )
        return state

    def num_parameters(self) -> dict[str, int]:
        """Embedding and non-embedding parameter counts (a tied W_out counts once)."""
        seen, total, embedding = set(), 0, 0
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if name.startswith(("embedding.", "readout.output_layer.")):
                embedding += p.numel()
        return {"embedding": embedding, "non_embedding": total - embedding, "total": total}


def build_model(
    cfg: ModelConfig,
    seed: int | None = 0,
    *,
    recompute: Recompute = "none",
    pre_process: bool = True,
    post_process: bool = True,
    layer_ids: range | None = None,
    vp_stage: int | None = None,
    trains: Callable[[str], bool] | None = None,
    exit_rate: float = 0.0,
    **transformer_overrides,
) -> LoopedLM:
    """The one way a LoopedLM is made: the whole model on one device, or (given the stage's
    place and megatron-core's parallel sizes in `transformer_overrides`) one pipeline stage,
    built already tensor-parallel sharded. Initialised from `seed` the same way in every layout
    (megaloop.model.init); `seed=None` leaves it for weights loaded next. It is built on the
    current default device: `with torch.device("cuda"): build_model(...)` for a GPU. `trains`
    (parameter name → whether it learns) freezes the others before an engine wraps the model,
    so neither gradient buffers nor optimizer state are made for them. `exit_rate`: the tokens
    a training forward exits early (sampled_exits)."""
    from megaloop.model.init import init_weights
    from megaloop.model.specs import recompute_config, transformer_config

    config = transformer_config(cfg, **recompute_config(recompute), **transformer_overrides)
    model = LoopedLM(
        cfg,
        config,
        pre_process=pre_process,
        post_process=post_process,
        layer_ids=layer_ids,
        vp_stage=vp_stage,
        recompute=recompute,
        exit_rate=exit_rate,
    )
    if seed is not None:
        init_weights(model, seed)
    if trains is not None:
        for name, param in model.named_parameters():
            param.requires_grad_(trains(name))
    return model
