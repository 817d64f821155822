"""Memory measured on a running model: what the engines' memory reports and the planner's tests
compare with the cost model's figures."""

from __future__ import annotations

import torch


def optimizer_state_bytes(optimizer, module) -> int:
    """Measured: the bytes a torch optimizer holds beyond the model's own weights, i.e. its
    per-element state (Adam's moments) and master copies that do not share the weights'
    storage (DeepSpeed's fp32 partitions). Scalars such as Adam's step are left out."""
    own = set()
    for p in module.parameters():
        own.add(p.untyped_storage().data_ptr())
        if hasattr(p, "ds_tensor"):
            own.add(p.ds_tensor.untyped_storage().data_ptr())
    held = {}
    # ZeRO-3 empties param_groups between steps: the state's keys are the parameters too
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params + list(optimizer.state):
        if p.untyped_storage().data_ptr() not in own:
            held[p.untyped_storage().data_ptr()] = p.numel() * p.element_size()
        for t in optimizer.state.get(p, {}).values():
            if torch.is_tensor(t) and t.dim() > 0:
                held[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
    return sum(held.values())


def saved_activation_bytes(model, tokens) -> int:
    """Measured activation memory: the bytes of the distinct tensors autograd keeps for backward
    over one training forward of `model` on `tokens` (saved-tensor hooks), parameters (which
    layers also save) not counted."""
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
