"""Warnings that dependencies raise about themselves, silenced by exact message and origin.

Each was read and found harmless to megaloop: it names a dependency's own call (megatron-core
calling a deprecated torch API, its optimizer touching a view's `.grad`), an optional backend
we do not use, or a deprecation inside the dependency. Warnings about megaloop's own calls are
fixed at the call instead (the tensor-parallel group passed to the layers we build, the MLP's
width in the layer spec, no CUDA-graph scope). A new dependency version that moves a line shows
its warning again, to be read again.

The CLI installs these at start-up; tests/conftest.py adds them to pytest's filters.
"""

from __future__ import annotations

import re
import warnings
from typing import NamedTuple


class Known(NamedTuple):
    message: str
    """A regular expression matched at the start of the warning's text."""
    category: type[Warning]
    module: str
    """The module the warning is attributed to (a prefix, as `warnings.filterwarnings` has it)."""
    lineno: int = 0
    """0: any line of `module`."""


KNOWN = (
    Known(r"(Transformer Engine and Apex are|Apex is) not installed", UserWarning, "megatron.core"),
    # RowParallelLinear.forward passes tp_group=None itself (megatron-core 0.16.1)
    Known(
        r"Warning: tp_group is None, using default tp group",
        DeprecationWarning,
        "megatron.core.tensor_parallel.layers",
        713,
    ),
    Known(r"`torch.jit.script_method` is deprecated", DeprecationWarning, "torch.jit"),
    Known(
        r"The following imports from `dynamic_context.py` will be removed",
        DeprecationWarning,
        "megatron.core.inference.contexts",
    ),
    Known(
        r"The 'megatron.core.transformer.custom_layers.transformer_engine'",
        DeprecationWarning,
        "megatron.core.transformer.multi_latent_attention",
    ),
    Known(
        r"__array__ implementation doesn't accept a copy keyword",
        DeprecationWarning,
        "megatron.core.datasets.indexed_dataset",
    ),
    Known(
        r"`load_state_dict` is deprecated and will be removed",
        FutureWarning,
        "megatron.core.dist_checkpointing.strategies.torch",
    ),
    # megatron-core's distributed optimizer and DDP call these through torch's c10d logger
    Known(
        r"`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        FutureWarning,
        "torch.distributed.c10d_logger",
    ),
    # the distributed optimizer's fp32 shards are views of the parameters
    Known(
        r"The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        UserWarning,
        "megatron.core.optimizer.optimizer",
    ),
    # train.recompute=selective: a note for Transformer Engine's fused attention, not used here
    Known(
        r"If you are using transformer_engine as the transformer implementation, the core_attn",
        UserWarning,
        "megatron.core.transformer.transformer_config",
    ),
)


def install() -> None:
    """Silence the known warnings in this process (from now on)."""
    for k in KNOWN:
        warnings.filterwarnings("ignore", k.message, k.category, k.module, k.lineno)


def pytest_filters() -> list[str]:
    """The same, as pytest `filterwarnings` entries (which split on every colon: a colon in a
    message is matched by `.`)."""
    return [
        ":".join(
            [
                "ignore",
                k.message.replace(":", "."),
                k.category.__name__,
                re.escape(k.module),
                str(k.lineno),
            ]
        )
        for k in KNOWN
    ]
