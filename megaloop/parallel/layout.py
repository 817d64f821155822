"""The parallel layout (TP × PP × DP) and its checks against the model, the batch and the
world, made before any compute; the validation split's sizing in that layout."""

from __future__ import annotations

from dataclasses import dataclass

from megaloop.config import Config, check, fail


@dataclass
class ParallelConfig(Config):
    tp: int = 1
    """Tensor parallel size (megatron-core column/row parallel layers)."""
    pp: int = 1
    """Pipeline parallel size: the circular pipeline, one lap of the ring per loop."""
    timeout_s: float = 600.0
    """How long a collective waits for the other ranks before the run gives up (the process
    groups' timeout): the bound on a run whose rank died. Our choice: 10 minutes (torch's
    default is 10 for NCCL, 30 for gloo); a checkpoint save must fit in it."""

    def validate(self, prefix: str = "") -> None:
        check(self.tp >= 1, prefix + "tp", self.tp, "must be >= 1")
        check(self.pp >= 1, prefix + "pp", self.pp, "must be >= 1")
        check(self.timeout_s > 0, prefix + "timeout_s", self.timeout_s, "must be > 0 seconds")


def data_parallel_size(cfg, world_size: int) -> int:
    """Check the layout against the model, the batch and the world; return DP."""
    par, model, train = cfg.parallel, cfg.model, cfg.train
    if world_size % (par.tp * par.pp):
        fail(
            "parallel",
            f"tp={par.tp} pp={par.pp}",
            f"world size {world_size} must be a multiple of tp*pp={par.tp * par.pp} "
            f"(world size = TP*PP*DP); launch with a matching --nproc-per-node/--ntasks or "
            f"change parallel.tp / parallel.pp",
        )
    dp = world_size // (par.tp * par.pp)
    groups = model.num_query_groups or model.num_heads
    check(
        model.num_heads % par.tp == 0 and groups % par.tp == 0,
        "parallel.tp",
        par.tp,
        f"must divide model.num_heads={model.num_heads} and the key/value heads ({groups})",
    )
    check(
        model.ffn_size % par.tp == 0,
        "parallel.tp",
        par.tp,
        f"must divide the SwiGLU hidden size {model.ffn_size}",
    )
    check(
        model.vocab_size % par.tp == 0,
        "parallel.tp",
        par.tp,
        f"must divide model.vocab_size={model.vocab_size}",
    )
    check(
        model.num_layers % par.pp == 0,
        "parallel.pp",
        par.pp,
        f"must divide model.num_layers={model.num_layers} (each rank holds L/PP layers)",
    )
    per_rank = train.global_batch_size // dp
    check(
        train.global_batch_size % (train.micro_batch_size * dp) == 0,
        "train.global_batch_size",
        train.global_batch_size,
        f"must be a multiple of micro_batch_size*DP = {train.micro_batch_size}*{dp}",
    )
    microbatches = per_rank // train.micro_batch_size
    check(
        par.pp == 1 or microbatches % par.pp == 0,
        "train.global_batch_size",
        train.global_batch_size,
        f"gives {microbatches} micro-batches per step on each pipeline; the circular pipeline "
        f"(megatron-core's interleaved schedule) needs a multiple of parallel.pp={par.pp}",
    )
    check(
        train.eval_batches == "all"
        or (train.eval_batches % dp == 0 and (train.eval_batches // dp) % par.pp == 0),
        "train.eval_batches",
        train.eval_batches,
        f"must split evenly over DP={dp} ranks into a multiple of parallel.pp={par.pp} "
        f"micro-batches each (or be `all`)",
    )
    return dp


def eval_microbatches(train, valid_windows: int | None, dp: int, pp: int) -> int:
    """Validation micro-batches of a run: micro-batch j holds windows [j·b, (j+1)·b) of the
    validation split (b = micro_batch_size), so a number evaluates the same windows in every
    layout. `all` is as many as fit the split evenly over DP ranks and the pipeline's multiple
    of PP micro-batches: the split's longest such prefix. Checked before any compute."""
    b, per_round = train.micro_batch_size, dp * pp
    if train.eval_batches == "all":
        check(
            valid_windows is not None,
            "train.eval_batches",
            "all",
            "this data has no finite validation split (data.kind=synthetic); give a number of "
            "micro-batches, e.g. train.eval_batches=16",
        )
        count = valid_windows // (b * per_round) * per_round
        check(
            count > 0,
            "train.eval_batches",
            "all",
            f"the validation split has {valid_windows} windows of data.seq_len+1 tokens, fewer "
            f"than one micro-batch (train.micro_batch_size={b}) on each of the DP={dp} x "
            f"PP={pp} pipelines; use more validation data or a smaller micro-batch",
        )
        return count
    check(
        valid_windows is None or train.eval_batches * b <= valid_windows,
        "train.eval_batches",
        train.eval_batches,
        f"asks for {train.eval_batches * b} windows (x micro_batch_size={b}), but the "
        f"validation split has {valid_windows}; use train.eval_batches=all or at most "
        f"{(valid_windows or 0) // b}",
    )
    return train.eval_batches
