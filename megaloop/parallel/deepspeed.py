"""The DeepSpeed engine: the same model (megatron-core layers, so tensor parallelism works) under
DeepSpeed ZeRO stage 0-3 over the data-parallel ranks.

Everything DeepSpeed needs is derived from megaloop's config (written to RUN/deepspeed.json):
micro-batch and accumulation, clipping (always set: DeepSpeed 0.19.8 defaults it to 1.0), torch's
AdamW with the megatron engine's parameter groups (OptimConfig.decays), bf16, and the ZeRO
stage. The learning-rate schedule is megatron-core's (linear warmup from 0, then cosine to
min_lr or constant), so the two engines follow the same curve. Tensor parallelism comes from
megatron-core's process groups through `MegatronMPU`, so ZeRO partitions over the data-parallel
group only; pipeline parallelism stays with the megatron engine.
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megaloop import objectives
from megaloop.config import ConfigError
from megaloop.model.looped import build_model
from megaloop.parallel import comm
from megaloop.parallel.distributed import NonFiniteUpdate, reduce_terms, terms_finite
from megaloop.parallel.engine import StepResult
from megaloop.parallel.engines import ENGINES
from megaloop.parallel.measure import optimizer_state_bytes
from megaloop.safe_load import deepspeed_globals, untrusted

TAG = "deepspeed"


class MegatronMPU:
    """megatron-core's parallel_state as DeepSpeed's `mpu`: its "model parallel" is TP."""

    get_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(ps.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(ps.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(ps.get_data_parallel_group)


def deepspeed_config(cfg, dp: int) -> dict:
    t, o = cfg.train, cfg.optim
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * dp),
        "gradient_clipping": o.clip_grad,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": [o.beta1, o.beta2],
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                "torch_adam": True,
            },
        },
        "bf16": {"enabled": t.bf16},
        "zero_optimization": {
            "stage": cfg.deepspeed.zero_stage,
            "stage3_param_persistence_threshold": cfg.deepspeed.param_persistence_threshold,
        },
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def megatron_lr(o, steps: int):
    """megatron-core's OptimizerParamScheduler (init_lr=0, cosine or constant), as a LambdaLR
    factor of the step count: step n of training uses the value at n (n = 0 for the first
    update)."""
    decay_steps = max(steps, o.warmup_steps + 1)

    def factor(n: int) -> float:
        if o.warmup_steps > 0 and n <= o.warmup_steps:
            return n / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        ratio = min(1.0, (n - o.warmup_steps) / (decay_steps - o.warmup_steps))
        lr = o.min_lr + (o.lr - o.min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return lr / o.lr

    return factor


def _import_deepspeed():
    """DeepSpeed with its INFO logging quieted (on a CPU the CPU compatibility layer set it up)."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


class DeepSpeedEngine:
    spec = ENGINES["deepspeed"]
    name = spec.name

    def __init__(self, cfg, seq_len: int, micro_batch_size: int):
        deepspeed = _import_deepspeed()
        os.environ.setdefault("LOCAL_RANK", "0")  # a one-process run without a launcher
        self.objective = cfg.objective
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.stage = cfg.deepspeed.zero_stage
        self.device = comm.device()
        with self.device:  # the rank's GPU under NCCL (comm.device), else the CPU
            self.module = build_model(
                cfg.model,
                cfg.train.seed,
                recompute=cfg.train.recompute,
                trains=cfg.objective.trains,
                exit_rate=cfg.objective.exit_rate,
                tensor_model_parallel_size=cfg.parallel.tp,
            )
        self.config = self.module.config
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        decay = [p for n, p in named if cfg.optim.decays(n, p)]
        no_decay = [p for n, p in named if not cfg.optim.decays(n, p)]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        ds_json = self.ds_config = deepspeed_config(cfg, self.dp_size)
        factor = megatron_lr(cfg.optim, cfg.train.steps)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.module,
            model_parameters=groups,
            config=ds_json,
            mpu=MegatronMPU,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
            dist_init_required=False,
        )
        if self.stage == 3 and cfg.model.tie_embeddings:
            # the readout multiplies by the embedding's weight outside the embedding module
            deepspeed.zero.register_external_parameter(
                self.module.readout, self.module.embedding.word_embeddings.weight
            )

    def layout(self) -> dict:
        return {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": 1,
            "dp": self.dp_size,
            "zero_stage": self.stage,
        }

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    def train_step(self, microbatches: list) -> StepResult:
        """(terms, grad norm, lr used, whether the update was applied). A non-finite loss on any
        rank stops before DeepSpeed's update (train.nonfinite=stop; skipping would desynchronise
        its accumulation counter, so `skip` is refused at config time). A non-finite gradient
        with finite losses is only seen after DeepSpeed has applied it: NonFiniteUpdate."""
        lr = self.optimizer.param_groups[0]["lr"]
        outputs = []
        for i, batch in enumerate(microbatches):
            batch = batch.to(self.device, non_blocking=True)
            out = self.ds(
                batch[:, :-1], labels=batch[:, 1:], keep_logits=self.objective.needs_logits
            )
            loss, terms = objectives.compute(self.objective, out)
            self.ds.backward(loss)  # DeepSpeed divides by the accumulation steps
            outputs.append({"loss": loss.detach().clone(), **terms})
            if i == len(microbatches) - 1 and comm.any_rank(not terms_finite(outputs)):
                return StepResult(outputs, float("nan"), lr, False)
            self.ds.step()  # an optimizer step only at the accumulation boundary
        norm = self.ds.get_global_grad_norm()  # None under ZeRO-0 (DeepSpeed does not keep it)
        if norm is not None and not math.isfinite(float(norm)):
            raise NonFiniteUpdate(
                f"DeepSpeed applied a non-finite gradient (norm {norm}): the "
                f"weights in memory are lost; the newest checkpoint is intact"
            )
        return StepResult(outputs, None if norm is None else float(norm), lr, True)

    def step(
        self, microbatches: list, forward_only: bool = True, num_loops: int | None = None
    ) -> list[dict]:
        assert forward_only, "training goes through train_step"
        outputs = []
        for batch in microbatches:
            batch = batch.to(self.device, non_blocking=True)
            out = self.ds(
                batch[:, :-1],
                labels=batch[:, 1:],
                num_loops=num_loops,
                keep_logits=self.objective.needs_logits,
            )
            loss, terms = objectives.compute(self.objective, out)
            outputs.append({"loss": loss.detach().clone(), **terms})
        return outputs

    def reduce(self, outputs: list[dict]) -> dict:
        return reduce_terms(outputs, holds_terms=ps.get_tensor_model_parallel_rank() == 0)

    def memory_report(self) -> dict:
        """Elements each rank holds (under ZeRO-3 a partitioned parameter keeps 1/DP of it), the
        gradient buffers and the optimizer's state, measured between steps. ZeRO-0/1/2 free
        their gradients after each step (the planner counts their peak during backward); ZeRO-3
        keeps its flat gradient partition."""
        local = {
            n: (
                p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel(),
                getattr(p, "ds_numel", p.numel()),
            )
            for n, p in self.module.named_parameters()
        }
        mine = {
            "rank": dist.get_rank(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": 0,
            "dp_rank": self.dp_rank,
            "params": sum(held for held, _ in local.values()),
            "layer_params": sum(h for n, (h, _) in local.items() if n.startswith("layers.")),
            "param_bytes": 4 * sum(held for held, _ in local.values()),
            "grad_bytes": self._gradient_bytes(),
            "optimizer_bytes": optimizer_state_bytes(
                getattr(self.ds.optimizer, "optimizer", self.ds.optimizer), self.module
            ),
            "held_of_full": {n: list(v) for n, v in local.items() if v[1] >= 4096},
        }
        ranks = comm.all_gather_object(mine)
        return {**self.layout(), "ranks": ranks}

    def _gradient_bytes(self) -> int:
        held = {
            id(p.grad): p.grad.numel() * p.grad.element_size()
            for p in self.module.parameters()
            if p.grad is not None
        }
        flat = getattr(self.ds.optimizer, "grad_partitions_flat_buffer", None)  # ZeRO-3
        if isinstance(flat, torch.Tensor):
            held[id(flat)] = flat.numel() * flat.element_size()
        return sum(held.values())

    def run_files(self) -> dict[str, str]:
        return {"deepspeed.json": json.dumps(self.ds_config, indent=1)}

    # -- checkpoints: DeepSpeed's own format, inside megaloop's atomic step folders ----------

    def save_state(self, folder, position: dict) -> None:
        rng = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
        self.ds.save_checkpoint(
            str(folder), tag=TAG, client_state={"rng": rng, **position}, save_latest=False
        )

    def load_weights(self, folder) -> None:
        raise ConfigError(
            "train.init_from is read by engine=megatron only (megatron-core dist checkpoints, any "
            "layout); start from it with engine=megatron"
        )

    def load_state(self, folder, same_layout: bool) -> None:
        # DeepSpeed's own loader unpickles with weights_only=False
        with untrusted(folder, allowed=deepspeed_globals()):
            path, client = self.ds.load_checkpoint(
                str(folder), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        if path is None:
            raise ValueError(f"DeepSpeed could not load {folder}")
        if same_layout:
            torch.set_rng_state(client["rng"]["cpu"])
            get_cuda_rng_tracker().set_states(client["rng"]["tracker"])


def consolidated_state(folder, cfg, layout: dict) -> dict[str, torch.Tensor]:
    """fp32 weights of a ZeRO checkpoint through DeepSpeed's Python API (its command-line
    zero_to_fp32.py needs huggingface_hub and shards at 5 GB)."""
    if layout["tp"] > 1:
        raise ValueError(
            f"{folder} was saved with TP={layout['tp']}; consolidating tensor-"
            f"parallel DeepSpeed checkpoints is not supported: resume it with "
            f"engine=megatron is not possible either, so train with parallel.tp=1 "
            f"under DeepSpeed when a single file is needed"
        )
    _import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with untrusted(folder, allowed=deepspeed_globals()):  # zero_to_fp32: weights_only=False
        state = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=TAG)
    return {k: v.contiguous() for k, v in state.items()}
