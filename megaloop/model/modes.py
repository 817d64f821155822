"""The looped model's modes, and the parameters each one owns: the torch-free half of its meaning.

The Literal types are the modes a config may name (model/config.py and the exported config read
them from here); the tables say what each mode is made of, which the planner needs without torch
(model/structure.py) and semantics.py builds. semantics.py holds what each mode computes, keyed
by the same names (tests/unit/model/test_readout.py holds the two to the same modes). Standard
library only: `megaloop export` copies this file beside semantics.py and the exported model's code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

ReadoutMode = Literal["norm", "raw", "final_norm", "last_norm"]
RecurrenceMode = Literal["none", "rmsnorm", "damping"]
DampingShape = Literal["channel", "scalar"]
GateInput = Literal["normed", "raw"]
LayerNorms = Literal["pre", "sandwich"]
LoopNorm = Literal["separate", "shared"]
PositionEmbedding = Literal["rope", "learned"]
EarlyExit = Literal["none", "gate", "margin", "confidence"]
KVPolicy = Literal["copy", "share", "recompute"]

READOUT_NORMALIZES: dict[ReadoutMode, Callable[[int, int, int], bool]] = {
    "norm": lambda loop, trained, last: True,
    "raw": lambda loop, trained, last: False,
    # the normalised interface belongs to the trained final loop, at any K the model runs at
    "final_norm": lambda loop, trained, last: loop >= trained,
    # the study's released code (decode_norm_final_only): the last loop of the K run is normalised
    "last_norm": lambda loop, trained, last: loop >= last,
}
"""(exit k, K_train, the last loop of this run) → whether exit k reads H_k through the exit
norm. `final_norm` and `last_norm` agree at K = K_train and differ at any other K: exit k of a
K-loop run reads its norm from k = K_train on under the first, only at k = K under the second.
A mode that does at its trained depth owns an RMSNorm, unless the shared loop norm is the norm
it reads."""

DAMPING_SIZE: dict[DampingShape, Callable[[int], int]] = {
    "channel": lambda hidden_size: hidden_size,
    "scalar": lambda hidden_size: 1,
}
"""`damping`: how many learned factors, one per channel or one for the whole state."""

RECURRENCE_PARAMS: dict[RecurrenceMode, Callable[[int, DampingShape], dict[str, int]]] = {
    "none": lambda d, shape: {},
    "rmsnorm": lambda d, shape: {"norm.weight": d},
    "damping": lambda d, shape: {"damping_logit": DAMPING_SIZE[shape](d)},
}
"""(hidden size, damping shape) → the recurrence's parameters, name → length."""

KV_LOOP_SLOTS: dict[KVPolicy, Callable[[int], int]] = {
    "copy": lambda loops: loops,
    "share": lambda loops: 1,
    "recompute": lambda loops: loops,
}
"""(K) → the (loop, layer) cache slots per layer under each KV policy of early exit: `copy`
fills a skipped loop's slot with the exit loop's keys and values, `share` keeps one slot per
layer (the last loop computed), `recompute` computes a skipped slot when a later token needs it."""

KEEPS_HIDDEN: dict[KVPolicy, bool] = {"copy": False, "share": False, "recompute": True}
"""Whether the cache also keeps each token's latest hidden state (to resume its loops later)."""

SHARES_LOOP_NORM: dict[LoopNorm, bool] = {"separate": False, "shared": True}
"""Whether one RMSNorm after every loop serves the next loop, the gate and the readout (Ouro)."""


def readout_owns_norm(readout: ReadoutMode, trained_loops: int, loop_norm: LoopNorm) -> bool:
    return (
        READOUT_NORMALIZES[readout](trained_loops, trained_loops, trained_loops)
        and not SHARES_LOOP_NORM[loop_norm]
    )
