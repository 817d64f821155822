"""The megatron engine: builds this rank's part of the model, wraps it in megatron-core DDP
(with the distributed optimizer over data-parallel ranks), and runs megatron-core's schedules.

This is the one place parallelism is applied; the trainer sees `step` and `reduce`, the model
sees nothing of it.
"""

from __future__ import annotations

import contextlib
import math
import types
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megaloop import objectives
from megaloop.model.looped import build_model
from megaloop.parallel import comm
from megaloop.parallel.distributed import reduce_terms, terms_finite
from megaloop.parallel.engine import StepResult
from megaloop.parallel.engines import ENGINES
from megaloop.parallel.measure import optimizer_state_bytes
from megaloop.parallel.pipeline import ExitStore, LapChunk
from megaloop.parallel.versions import installed, require_tested
from megaloop.safe_load import untrusted

OPTIMIZER_CHECKPOINT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _copy_only_loaded_optimizer_states(self, model_param, tensors):
    """megatron-core 0.16.1's DistributedOptimizer._set_main_param_and_optimizer_states
    (distrib_optimizer.py:911-940), copying only the states the checkpoint carries. Without
    Transformer Engine or Apex (on any device) its optimizer is torch's AdamW, which also keeps
    a per-parameter "step" that megatron-core restores from the param groups and never puts in
    `tensors`: the original raised KeyError('step') on every resume. Every device needs it, so
    it lives here, not in the CPU layer; refused on an untested megatron-core (versions.py)."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    destination = {"param": main_param, **self.optimizer.state[main_param]}
    for key, value in tensors.items():
        destination[key].copy_(value)


class MegatronEngine:
    spec = ENGINES["megatron"]
    name = spec.name

    def __init__(self, cfg, seq_len: int, micro_batch_size: int):
        require_tested("megatron-core", installed("megatron-core"), "the megatron engine")
        model_cfg, par = cfg.model, cfg.parallel
        self.objective = cfg.objective
        self.bf16 = cfg.train.bf16
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_size = par.pp
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        pipelined = par.pp > 1
        K, L = model_cfg.num_loops, model_cfg.num_layers
        per_rank = L // par.pp
        self.device = comm.device()
        with self.device:  # the rank's GPU under NCCL (comm.device), else the CPU
            self.module = build_model(
                model_cfg,
                cfg.train.seed,
                recompute=cfg.train.recompute,
                trains=cfg.objective.trains,
                exit_rate=cfg.objective.exit_rate,
                pre_process=self.pp_rank == 0,
                post_process=self.pp_rank == par.pp - 1,
                layer_ids=range(self.pp_rank * per_rank, (self.pp_rank + 1) * per_rank),
                vp_stage=0 if pipelined else None,
                tensor_model_parallel_size=par.tp,
                pipeline_model_parallel_size=par.pp,
                # the ring is K·L layer applications: K virtual stages of L/PP layers per rank
                virtual_pipeline_model_parallel_size=K if pipelined else None,
                num_layers=K * L if pipelined else L,
                pipeline_dtype=torch.float32,
                batch_p2p_comm=False,
            )
        self.config = self.module.config
        self.ddp = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
            self.module,
        )
        self.config.no_sync_func = self.ddp.no_sync
        self.config.finalize_model_grads_func = lambda _chunks, *args, **kwargs: (
            finalize_model_grads([self.ddp], *args, **kwargs)
        )
        self.optimizer, self.scheduler = cfg.optim.build([self.ddp], cfg.train.steps)
        for opt in self.optimizer.chained_optimizers:
            if isinstance(opt, DistributedOptimizer):
                opt._set_main_param_and_optimizer_states = types.MethodType(
                    _copy_only_loaded_optimizer_states, opt
                )
        self.store = ExitStore()
        if pipelined:
            self.chunks = [
                LapChunk(self.module, lap, self.objective, self.store, self.pp_rank, par.pp)
                for lap in range(K)
            ]
        else:
            self.chunks = [self.ddp]

    def autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def layout(self) -> dict:
        return {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": self.pp_size,
            "dp": self.dp_size,
        }

    def train_step(self, microbatches: list) -> StepResult:
        """One optimizer step over this rank's micro-batches: (terms, grad norm, lr used, whether
        the update was applied). A non-finite loss on any rank or a non-finite gradient norm
        leaves weights, optimizer and schedule as they were (megatron-core's own step checks
        only fp16's loss scaler): every rank decides the same from the same collectives."""
        self.optimizer.zero_grad()  # param.grad aliases the DDP buffer after a step: unlink it
        outputs = self.step(microbatches, forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]
        finite_loss = not comm.any_rank(not terms_finite(outputs))
        self.optimizer.prepare_grads()
        grad_norm = self.optimizer.get_grad_norm()
        if not (finite_loss and math.isfinite(grad_norm)):
            return StepResult(outputs, grad_norm, lr, False)
        for opt in self.optimizer.chained_optimizers:  # ChainedOptimizer.step's clip, then step
            params = opt.get_parameters()
            if opt.config.clip_grad > 0.0 and params:
                megatron_optimizer.clip_grad_by_total_norm_fp32(
                    params, max_norm=opt.config.clip_grad, total_norm=grad_norm
                )
        self.optimizer.step_with_ready_grads()
        self.scheduler.step(increment=1)
        return StepResult(outputs, grad_norm, lr, True)

    def step(
        self, microbatches: list, forward_only: bool = True, num_loops: int | None = None
    ) -> list[dict]:
        """Forward (and backward) over this rank's micro-batches ([b, s+1] tokens each); returns
        the objective's terms per micro-batch on last-stage ranks, [] elsewhere."""
        if not forward_only:
            self.ddp.zero_grad_buffer()
        self.store.reset(len(microbatches))
        if self.pp_size > 1:
            if num_loops not in (None, self.module.cfg.num_loops):
                raise ValueError(
                    "a pipelined model runs exactly model.num_loops laps; evaluate "
                    "other depths on one process (or an exported model)"
                )
            for chunk in self.chunks:
                chunk.microbatch = 0
            step_fn, data = self._pipelined_step, [iter(microbatches) for _ in self.chunks]
        else:
            step_fn, data = partial(self._whole_step, num_loops=num_loops), iter(microbatches)
        return get_forward_backward_func()(
            forward_step_func=step_fn,
            data_iterator=data,
            model=self.chunks,
            num_microbatches=len(microbatches),
            seq_length=self.seq_len,
            micro_batch_size=self.micro_batch_size,
            forward_only=forward_only,
        )

    def _whole_step(self, data_iterator, model, num_loops=None):
        batch = next(data_iterator).to(self.device, non_blocking=True)
        with self.autocast():
            out = model(
                batch[:, :-1],
                labels=batch[:, 1:],
                num_loops=num_loops,
                keep_logits=self.objective.needs_logits,
            )
        return out, self._loss_of_output

    def _loss_of_output(self, out):
        loss, terms = objectives.compute(self.objective, out)
        return loss, {"loss": loss.detach().clone(), **terms}

    def _pipelined_step(self, data_iterator, chunk):
        batch = next(data_iterator).to(self.device, non_blocking=True)
        with self.autocast():
            out = chunk(batch[:, :-1], batch[:, 1:])
        return out, partial(self._loss_of_chunk, chunk)

    @staticmethod
    def _loss_of_chunk(chunk, loss):
        return loss, {"loss": loss.detach().clone(), **chunk.terms}

    def reduce(self, outputs: list[dict]) -> dict:
        return reduce_terms(outputs, holds_terms=ps.get_tensor_model_parallel_rank() == 0)

    def memory_report(self) -> dict:
        """Parameters, gradient buffer and optimizer state held by each rank, measured (gathered
        on every rank; after a step, when the optimizer's state exists): what a layout costs,
        and a check that PP really splits the stack."""
        params = list(self.module.parameters())
        layer = sum(p.numel() for n, p in self.module.named_parameters() if n.startswith("layers."))
        grads = sum(
            buf.grad_data.numel() * buf.grad_data.element_size() for buf in self.ddp.buffers
        )
        optim = sum(
            optimizer_state_bytes(opt.optimizer, self.module)
            for opt in self.optimizer.chained_optimizers
        )
        mine = {
            "rank": dist.get_rank(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "params": sum(p.numel() for p in params),
            "layer_params": layer,
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": grads,
            "optimizer_bytes": optim,
        }
        ranks = comm.all_gather_object(mine)
        return {
            "tp": self.config.tensor_model_parallel_size,
            "pp": self.pp_size,
            "dp": self.dp_size,
            "ranks": ranks,
        }

    # -- checkpoints: megatron-core dist_checkpointing (torch_dist) ----------------------------

    def _sharded_state(self, loading: bool) -> dict:
        model = self.module.sharded_state_dict()
        return {
            "model": model,
            "optimizer": self.optimizer.sharded_state_dict(
                model, is_loading=loading, metadata=OPTIMIZER_CHECKPOINT
            ),
        }

    def _rng_state(self) -> ShardedObject:
        """This rank's RNG states; restored only into the same layout (the data order does not
        depend on them: it is a function of the sample index)."""
        layout = self.layout()
        state = {
            "cpu": torch.get_rng_state(),
            "tracker": get_cuda_rng_tracker().get_states(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        }
        return ShardedObject(
            "rng_state",
            state,
            (layout["pp"], layout["tp"], layout["dp"]),
            (self.pp_rank, ps.get_tensor_model_parallel_rank(), self.dp_rank),
            replica_id=0,
        )

    def run_files(self) -> dict[str, str]:
        return {}

    def save_state(self, folder, position: dict) -> None:
        state = self._sharded_state(loading=False)
        state.update(rng=self._rng_state(), scheduler=self.scheduler.state_dict(), **position)
        dist_checkpointing.save(state, str(folder))

    def load_weights(self, folder) -> None:
        """Only the model's weights of a checkpoint of any layout (train.init_from); the
        optimizer's fp32 main parameters are copied from them again."""
        with untrusted(folder):
            loaded = dist_checkpointing.load(
                {"model": self.module.sharded_state_dict()}, str(folder)
            )
        self.module.load_state_dict(loaded["model"])
        self.optimizer.reload_model_params()

    def load_state(self, folder, same_layout: bool) -> None:
        """Load a checkpoint saved in any layout into this rank's model and optimizer."""
        for opt in self.optimizer.chained_optimizers:
            if not opt.optimizer.state:
                # torch's AdamW has no state (no "step") before its first step; the dummy step
                # is overwritten by what is loaded (megatron-core does the same for FSDP)
                opt._init_optimizer_states_with_dummy_values()
        state = self._sharded_state(loading=True)
        state["scheduler"] = None
        if same_layout:
            state["rng"] = self._rng_state()
        with untrusted(folder):
            loaded = dist_checkpointing.load(state, str(folder))
        self.module.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        for opt in self.optimizer.chained_optimizers:
            for param_state in opt.optimizer.state.values():
                if "step" in param_state:
                    # megatron-core hands every parameter the same "step" tensor, which torch's
                    # AdamW then increments once per parameter on every step: give each its own
                    param_state["step"] = param_state["step"].clone()
        self.scheduler.load_state_dict(loaded["scheduler"])
        if "rng" in loaded:
            rng = loaded["rng"]
            torch.set_rng_state(rng["cpu"])
            get_cuda_rng_tracker().set_states(rng["tracker"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])


def consolidated_state(folder, cfg, layout: dict) -> dict[str, torch.Tensor]:
    """The whole model's tensors from a megatron checkpoint of any layout (one process)."""
    with torch.device("cpu"):
        module = build_model(cfg.model, seed=None)
    with untrusted(folder):
        loaded = dist_checkpointing.load({"model": module.sharded_state_dict()}, str(folder))
    module.load_state_dict(loaded["model"])
    return {
        k: v.detach().contiguous()
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor) and "_extra_state" not in k
    }
