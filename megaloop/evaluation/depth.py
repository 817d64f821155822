"""Fixed-depth perplexity at each K (the study's Table 5 columns, its "slice harness").

One pass at K_max reads every requested exit: exit k of a pass at K_max is what a pass at K = k
returns, since loop k never depends on the loops after it and `final_norm` reads each exit by the
trained depth, not the requested one. With `clamp`, every loop is held at its loop-1 RMS.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megaloop.evaluation import harness
from megaloop.evaluation.exported import EvalError


def run(
    model_path: Path,
    data: Path,
    loops: list[int],
    sequences: int = 160,
    seq_len: int = 256,
    batch_size: int = 8,
    clamp: bool = False,
    dtype: str = "float32",
    device: str | None = None,
    out: Path | None = None,
) -> dict:
    harness.check_data(data)
    if sequences < 1 or seq_len < 1 or batch_size < 1:
        raise EvalError(
            f"--sequences {sequences}, --seq-len {seq_len}, --batch-size "
            f"{batch_size}: each must be >= 1 (an empty slice measures nothing)"
        )
    device, dtype = harness.device_and_dtype(dtype, device)
    opened = harness.open_model(model_path, device, dtype)
    harness.check_seq_len(opened, seq_len)
    slice_ = harness.windows(harness.read_tokens(data, opened.encode), seq_len, sequences)
    model, deepest = opened.model, max(loops)
    totals, tokens = {k: 0.0 for k in loops}, 0
    with torch.no_grad():
        for batch in harness.batches(slice_, batch_size, f"depth (K up to {deepest})"):
            batch = batch.to(device)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            for k, h in harness.trajectory(model, inputs, deepest, clamp):
                if k in totals:
                    totals[k] += (
                        harness.token_ce(model.readout(h, k), targets).double().sum().item()
                    )
            tokens += targets.numel()
    rows = [
        {"loops": k, "ce": totals[k] / tokens, "ppl": harness.ppl(totals[k] / tokens)}
        for k in loops
    ]
    result = {
        "model": opened.info,
        "settings": {
            "data": str(data),
            "loops": loops,
            "sequences": sequences,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "clamp": clamp,
            "device": device,
            "dtype": dtype,
            "tokens": tokens,
        },
        "rows": rows,
    }
    if out is not None:
        harness.write(out, "depth", result, markdown(result))
    return result


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# Fixed-depth perplexity: {result['model']['path']}",
        "",
        f"{s['sequences']} sequences x {s['seq_len']} tokens of {s['data']} "
        f"({s['tokens']:,} predicted tokens){', recurrent-scale clamp on' if s['clamp'] else ''}; "
        f"trained at K = {result['model']['num_loops_trained']}.",
        "",
        "| K | CE / token | PPL |",
        "|---|---|---|",
    ]
    lines += [f"| {r['loops']} | {r['ce']:.4f} | {r['ppl']:.3f} |" for r in result["rows"]]
    return "\n".join(lines)
