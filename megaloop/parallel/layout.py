"""The parallel layout (TP × PP × DP) and its checks, made before any compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaloop.config import Config, check, fail


@dataclass
class ParallelConfig(Config):
    tp: int = 1
    """Tensor parallel size (megatron-core column/row parallel layers)."""
    pp: int = 1
    """Pipeline parallel size: the circular pipeline, one lap of the ring per loop."""

    def validate(self, prefix: str = "") -> None:
        check(self.tp >= 1, prefix + "tp", self.tp, "must be >= 1")
        check(self.pp >= 1, prefix + "pp", self.pp, "must be >= 1")


def data_parallel_size(cfg, world_size: int) -> int:
    """Check the layout against the model, the batch and the world; return DP."""
    par, model, train = cfg.parallel, cfg.model, cfg.train
    if world_size % (par.tp * par.pp):
        fail("parallel", f"tp={par.tp} pp={par.pp}",
             f"world size {world_size} must be a multiple of tp*pp={par.tp * par.pp} "
             f"(world size = TP*PP*DP); launch with a matching --nproc-per-node/--ntasks or "
             f"change parallel.tp / parallel.pp")
    dp = world_size // (par.tp * par.pp)
    groups = model.num_query_groups or model.num_heads
    check(model.num_heads % par.tp == 0 and groups % par.tp == 0, "parallel.tp", par.tp,
          f"must divide model.num_heads={model.num_heads} and the key/value heads ({groups})")
    check(model.ffn_size % par.tp == 0, "parallel.tp", par.tp,
          f"must divide the SwiGLU hidden size {model.ffn_size}")
    check(model.vocab_size % par.tp == 0, "parallel.tp", par.tp,
          f"must divide model.vocab_size={model.vocab_size}")
    check(model.num_layers % par.pp == 0, "parallel.pp", par.pp,
          f"must divide model.num_layers={model.num_layers} (each rank holds L/PP layers)")
    per_rank = train.global_batch_size // dp
    check(train.global_batch_size % (train.micro_batch_size * dp) == 0,
          "train.global_batch_size", train.global_batch_size,
          f"must be a multiple of micro_batch_size*DP = {train.micro_batch_size}*{dp}")
    microbatches = per_rank // train.micro_batch_size
    check(par.pp == 1 or microbatches % par.pp == 0, "train.global_batch_size",
          train.global_batch_size,
          f"gives {microbatches} micro-batches per step on each pipeline; the circular pipeline "
          f"(megatron-core's interleaved schedule) needs a multiple of parallel.pp={par.pp}")
    check(train.eval_batches == "all" or (train.eval_batches % dp == 0
                                           and (train.eval_batches // dp) % par.pp == 0),
          "train.eval_batches", train.eval_batches,
          f"must split evenly over DP={dp} ranks into a multiple of parallel.pp={par.pp} "
          f"micro-batches each (or be `all`)")
    return dp


def eval_microbatches(train, valid_windows: Optional[int], dp: int, pp: int) -> int:
    """Validation micro-batches of a run: micro-batch j holds windows [j·b, (j+1)·b) of the
    validation split (b = micro_batch_size), so a number evaluates the same windows in every
    layout. `all` is as many as fit the split evenly over DP ranks and the pipeline's multiple
    of PP micro-batches: the split's longest such prefix. Checked before any compute."""
    b, per_round = train.micro_batch_size, dp * pp
    if train.eval_batches == "all":
        check(valid_windows is not None, "train.eval_batches", "all",
              "this data has no finite validation split (data.kind=synthetic); give a number of "
              "micro-batches, e.g. train.eval_batches=16")
        count = valid_windows // (b * per_round) * per_round
        check(count > 0, "train.eval_batches", "all",
              f"the validation split has {valid_windows} windows of data.seq_len+1 tokens, fewer "
              f"than one micro-batch (train.micro_batch_size={b}) on each of the DP={dp} x "
              f"PP={pp} pipelines; use more validation data or a smaller micro-batch")
        return count
    check(valid_windows is None or train.eval_batches * b <= valid_windows,
          "train.eval_batches", train.eval_batches,
          f"asks for {train.eval_batches * b} windows (x micro_batch_size={b}), but the "
          f"validation split has {valid_windows}; use train.eval_batches=all or at most "
          f"{(valid_windows or 0) // b}")
    return train.eval_batches


def params_per_rank(model, tp: int, pp: int, pp_rank: int) -> int:
    """Parameters held by one rank of pipeline stage `pp_rank` (any tensor-parallel rank):
    the stage's L/PP layers once (not once per loop), plus the embedding on the first stage and
    the readout (with the shared loop norm, if any) on the last (a tied W_out is a copy there
    when PP > 1)."""
    d, ffn, V = model.hidden_size, model.ffn_size, model.vocab_size
    head = d // model.num_heads
    kv = (model.num_query_groups or model.num_heads) * head
    norms = 4 if model.layer_norms == "sandwich" else 2
    layer = (d * (d + 2 * kv) + d * d + 3 * ffn * d) // tp + norms * d
    count = layer * model.num_layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        recurrence = {"none": 0, "rmsnorm": d,
                      "damping": d if model.damping_shape == "channel" else 1}
        count += V * d // tp + recurrence[model.recurrence]
    if last:
        shared = model.loop_norm == "shared"
        count += d if shared or model.readout != "raw" else 0  # the loop's or readout's norm
        count += (d + 1) if model.exit_gate else 0
        if not model.tie_embeddings or not first:
            count += V * d // tp
    return count


def memory_per_rank(model, tp: int, pp: int, dp: int) -> dict:
    """Bytes of the largest stage's rank: fp32 parameters, fp32 gradient buffer, and Adam's two
    fp32 moments sharded over DP by the distributed optimizer (activations not included)."""
    params = max(params_per_rank(model, tp, pp, r) for r in range(pp))
    return {"params": params, "param_bytes": 4 * params, "grad_bytes": 4 * params,
            "optimizer_bytes": 8 * params // dp,
            "total_bytes": 8 * params + 8 * params // dp}


def saved_activation_bytes(model, tokens) -> int:
    """Measured activation memory: the bytes of the distinct tensors autograd keeps for backward
    over one training forward of `model` on `tokens` (saved-tensor hooks), parameters (which
    layers also save) not counted."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, labels=tokens)
    del out
    return sum(seen.values())
