"""megatron-core 0.16.1 and DeepSpeed 0.19.8 on a machine without CUDA (CPU tensors, gloo).

megatron-core assumes CUDA: it asks for the current CUDA device, tracks the CUDA RNG, and
creates small bookkeeping tensors with device="cuda". DeepSpeed picks its accelerator by probing
and compiles a shared-memory comm op on first use (~30 s) that training does not need. Each
patch below names the library's file and line(s) it stands in for. This is the only CPU
compatibility code: `apply()` is called by entry points only (the CLI, tests, bench scripts);
nothing under megaloop/ imports this module. It does nothing when CUDA is present, and refuses a
megatron-core or DeepSpeed version it was not tested against before any patch applies. (A fix
every device needs lives in its engine, e.g. parallel/megatron.py's optimizer-state copy.)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import logging
import os
import queue
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megaloop.parallel.versions import TESTED, installed, require_tested


class _CudaOnCPU(types.SimpleNamespace):
    """`torch.cuda` as seen by a patched module: the CPU generator, no-op synchronize."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


_CUDA_ON_CPU = _CudaOnCPU(
    current_device=lambda: "cpu",
    synchronize=lambda *a, **k: None,
    get_rng_state=lambda *a, **k: torch.get_rng_state(),
    set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
    manual_seed=lambda seed: torch.default_generator.manual_seed(seed),
)


def _on_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


class _TorchOnCPU(types.ModuleType):
    """Stands in for `torch` inside one megatron-core module: device="cuda" becomes "cpu"."""

    cuda = _CUDA_ON_CPU
    zeros, ones, empty, full, tensor, empty_like = (
        staticmethod(_on_cpu(f))
        for f in (torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.empty_like)
    )

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _cpu_tensors_pass_as_cuda():
    """Inside: `t.type()` of a CPU tensor reads 'torch.cuda.*Tensor' and `t.cuda()` is `t`."""
    type_, cuda = torch.Tensor.type, torch.Tensor.cuda

    def spoofed_type(self, *args, **kwargs):
        name = type_(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = spoofed_type
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = type_, cuda


@dataclass(frozen=True)
class Patch:
    where: str
    """The library's file:line(s) the patch stands in for (megatron-core's relative to
    megatron/core/)."""
    replaces: str
    apply: Callable[[], None]
    library: str = "megatron-core"


def _module_torch(module: str) -> Callable[[], None]:
    def apply():
        mod = importlib.import_module(f"megatron.core.{module}")
        mod.torch = _TorchOnCPU("torch")

    return apply


def _run_with_cpu_tensors_as_cuda(module: str, qualname: str) -> Callable[[], None]:
    def apply():
        owner = importlib.import_module(f"megatron.core.{module}")
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = inspect.getattr_static(owner, name)
        descriptor = type(original) if isinstance(original, (staticmethod, classmethod)) else None
        function = original.__func__ if descriptor else original

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with _cpu_tensors_pass_as_cuda():
                return function(*args, **kwargs)

        setattr(owner, name, descriptor(wrapper) if descriptor else wrapper)

    return apply


def _cpu_autocast_functions(*names: str) -> Callable[[], None]:
    """Re-decorate megatron-core's autograd Functions for CPU autocast (they are for CUDA's)."""

    def apply():
        layers = importlib.import_module("megatron.core.tensor_parallel.layers")
        for name in names:
            fn = getattr(layers, name)
            fwd, bwd = fn.forward, fn.backward
            fn.forward = staticmethod(torch.amp.custom_fwd(fwd.__wrapped__, device_type="cpu"))
            fn.backward = staticmethod(torch.amp.custom_bwd(bwd.__wrapped__, device_type="cpu"))

    return apply


def _set(target, name: str, value) -> Callable[[], None]:
    """Set `name` (or `Class.name`) on an object, or on a megatron-core module given by its
    dotted name."""

    def apply():
        owner = (
            importlib.import_module(f"megatron.core.{target}")
            if isinstance(target, str)
            else target
        )
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, value)

    return apply


def _drop_log_message(logger: str, message: str) -> Callable[[], None]:
    """A logging filter on `logger` that drops records whose message is `message`."""

    def apply():
        logging.getLogger(logger).addFilter(lambda record: record.getMessage() != message)

    return apply


def _import_megatron_with_eager_fusions() -> None:
    """Import megatron-core while `torch.compile` hands functions back unchanged, so its
    `jit_fuser` (jit.py binds it to torch.compile at import) stays eager for the process."""
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda m: m)
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = compile_


def _write_results_queue_in_this_process():
    """megatron-core's checkpoint results queue as a plain queue: a save that runs in this
    process (megaloop's saves are synchronous) puts its results and reads them here."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    return filesystem_async._results_queue


def _set_env(name: str, value: str) -> Callable[[], None]:
    return lambda: os.environ.setdefault(name, value)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once `name` has been imported (now, if it already has been), so a
    patch of an optional, slow-to-import library costs nothing until the library is used."""

    def __init__(self, name: str, then: Callable[[types.ModuleType], None]):
        self.name, self.then = name, then

    def install(self) -> None:
        if self.name in sys.modules:
            self.then(sys.modules[self.name])
        else:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        load, then = spec.loader.exec_module, self.then

        def exec_module(module):
            load(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


def _after_import(name: str, then: Callable[[types.ModuleType], None]) -> Callable[[], None]:
    return lambda: _AfterImport(name, then).install()


PATCHES = [
    Patch(
        "jit.py:21 (jit_fuser), e.g. fusions/fused_bias_swiglu.py:15, transformer/utils.py:54",
        "@jit_fuser = torch.compile on megatron-core's fused kernels: eager functions. Calling "
        "one on a CPU would compile it with inductor's C++ backend; megaloop turns the fusions "
        "off, and decorating them imported torch._dynamo and inductor (~2.5 s a process)",
        _import_megatron_with_eager_fusions,
    ),
    Patch(
        "~175 call sites, e.g. models/common/embeddings/rotary_pos_embedding.py:162, "
        "tensor_parallel/layers.py:261, pipeline_parallel/p2p_communication.py:190",
        "device=torch.cuda.current_device()",
        _set(torch.cuda, "current_device", _CUDA_ON_CPU.current_device),
    ),
    Patch(
        "pipeline_parallel/p2p_communication.py:242,398; "
        "distributed/distributed_data_parallel.py:588",
        "torch.cuda.synchronize()",
        _set(torch.cuda, "synchronize", _CUDA_ON_CPU.synchronize),
    ),
    Patch(
        "tensor_parallel/random.py:41-111 (_get_cuda_rng_state, _set_cuda_rng_state), "
        "235-240 and 422 (torch.cuda.get_rng_state/manual_seed)",
        "the CUDA RNG tracker: it tracks the CPU generator instead",
        _module_torch("tensor_parallel.random"),
    ),
    Patch(
        "tensor_parallel/random.py:41",
        "_get_cuda_rng_state(...)",
        _set(
            "tensor_parallel.random", "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()
        ),
    ),
    Patch(
        "tensor_parallel/random.py:72",
        "_set_cuda_rng_state(new_state, ...)",
        _set(
            "tensor_parallel.random",
            "_set_cuda_rng_state",
            lambda state, *a, **k: torch.set_rng_state(state),
        ),
    ),
    Patch(
        "tensor_parallel/random.py:258-265 (CudaRNGStatesTracker.fork)",
        "a warning when the CPU generator's state changes inside fork: with the tracker on the "
        "CPU generator, every dropout inside fork (attention's) changes it, as it should",
        _drop_log_message(
            "megatron.core.tensor_parallel.random", "CPU RNG state changed within GPU RNG context"
        ),
    ),
    Patch(
        "pipeline_parallel/schedules.py:596,983,2138",
        "total_num_tokens = torch.zeros(..., device='cuda')",
        _module_torch("pipeline_parallel.schedules"),
    ),
    Patch(
        "optimizer/optimizer.py:473,481,485,907",
        "torch.tensor(..., device='cuda')",
        _module_torch("optimizer.optimizer"),
    ),
    Patch(
        "optimizer/clip_grads.py:90,103,115,174,207",
        "torch.tensor/zeros(..., device='cuda')",
        _module_torch("optimizer.clip_grads"),
    ),
    Patch(
        "tensor_parallel/layers.py:68-69 (applied at 335, 347, 447, 494)",
        "custom_fwd = partial(torch.amp.custom_fwd, device_type='cuda'), same for custom_bwd",
        _cpu_autocast_functions(
            "LinearWithFrozenWeight", "LinearWithGradAccumulationAndAsyncCommunication"
        ),
    ),
    Patch(
        "utils.py:1207 (local_multi_tensor_l2_norm, used for the gradient norm)",
        "l2_cuda = torch.tensor([...], device='cuda')",
        _module_torch("utils"),
    ),
    Patch(
        "optimizer/grad_scaler.py:15,88,91,94",
        "torch.tensor(..., device='cuda')",
        _module_torch("optimizer.grad_scaler"),
    ),
    Patch(
        "distributed/param_and_grad_buffer.py:768",
        "torch.zeros([1], device='cuda')",
        _module_torch("distributed.param_and_grad_buffer"),
    ),
    Patch(
        "transformer/utils.py:35,40",
        "torch.ones(sq, sq, device='cuda') (causal masks)",
        _module_torch("transformer.utils"),
    ),
    Patch(
        "rerun_state_machine.py:261,265",
        "torch.tensor(value, device='cuda')",
        _module_torch("rerun_state_machine"),
    ),
    Patch(
        "dist_checkpointing/strategies/state_dict_saver.py:204",
        "torch.tensor(..., device='cuda')",
        _module_torch("dist_checkpointing.strategies.state_dict_saver"),
    ),
    Patch(
        "dist_checkpointing/strategies/filesystem_async.py:51-56 (_get_write_results_queue)",
        "mp.get_context('spawn').Manager().Queue(): a server interpreter per saving process, "
        "which imports torch to unpickle the first save's results (~2.5 s a rank); megaloop "
        "saves synchronously, so its results never leave the process",
        _set(
            "dist_checkpointing.strategies.filesystem_async",
            "_get_write_results_queue",
            _write_results_queue_in_this_process,
        ),
    ),
    Patch(
        "dist_checkpointing/exchange_utils.py:98-110,326,336,499",
        "init_data('cuda') / torch.empty(..., device='cuda') / .cuda()",
        _module_torch("dist_checkpointing.exchange_utils"),
    ),
    Patch(
        "models/common/language_module/language_module.py:244",
        "weight.data = weight.data.cuda()",
        _run_with_cpu_tensors_as_cuda(
            "models.common.language_module.language_module",
            "LanguageModule.setup_embeddings_and_output_layer",
        ),
    ),
    Patch(
        "optimizer/optimizer.py:671,690",
        "param.type() == 'torch.cuda.FloatTensor'",
        _run_with_cpu_tensors_as_cuda(
            "optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"
        ),
    ),
    Patch(
        "optimizer/clip_grads.py:167 (as imported by optimizer/optimizer.py:50)",
        "assert param.grad.type() == 'torch.cuda.FloatTensor'",
        _run_with_cpu_tensors_as_cuda("optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    ),
    Patch(
        "optimizer/distrib_optimizer.py:361,420",
        "model_param.type() == 'torch.cuda.FloatTensor'",
        _run_with_cpu_tensors_as_cuda(
            "optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"
        ),
    ),
    Patch(
        "optimizer/distrib_optimizer.py:1089 (fully reshardable checkpoints)",
        "send_tensor = send_tensor.cuda()",
        _run_with_cpu_tensors_as_cuda(
            "optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero"
        ),
    ),
    Patch(
        "deepspeed/accelerator/real_accelerator.py:116-216",
        "accelerator auto-detection (xpu, npu, ..., cuda): DS_ACCELERATOR=cpu, gloo without oneCCL",
        _set_env("DS_ACCELERATOR", "cpu"),
        library="deepspeed",
    ),
    Patch(
        "deepspeed/comm/torch.py:49 (build_shm_op)",
        "deepspeed.ops.__compatible_ops__ probing, then compiling the shared-memory comm op: "
        "no compiled ops",
        _after_import("deepspeed.ops", lambda ops: setattr(ops, "__compatible_ops__", {})),
        library="deepspeed",
    ),
]

_applied = False

PATCHER = "megaloop's CPU compatibility layer"


def check_versions(versions: dict[str, str | None] | None = None) -> None:
    """Every patched library at the version its patches were written for; `versions` maps a
    distribution to its version (default: the installed ones; None: not installed)."""
    versions = versions if versions is not None else {d: installed(d) for d in TESTED}
    for distribution in TESTED:
        require_tested(distribution, versions.get(distribution), PATCHER)


def apply() -> None:
    """Make megatron-core and DeepSpeed run on the CPU; a no-op when CUDA is available or
    already applied."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    check_versions()
    for patch in PATCHES:
        patch.apply()
    _applied = True
