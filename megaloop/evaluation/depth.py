"""Fixed-depth perplexity at each K (the study's Table 5 columns, its "slice harness").

One pass at K_max reads every requested exit: exit k of a pass at K_max is what a pass at K = k
returns, since loop k never depends on the loops after it and each exit is read as the last
loop of its own pass (what `last_norm` normalises; `final_norm` reads each exit by the trained
depth, not the requested one). With `clamp`, every loop is held at its loop-1 RMS.
"""

from __future__ import annotations

import torch

from megaloop.evaluation import harness, ppl_text
from megaloop.evaluation.settings import DepthSettings


def run(settings: DepthSettings) -> dict:
    harness.check_data(settings.data)
    device, dtype = harness.device_and_dtype(settings.dtype, settings.device)
    opened = harness.open_model(settings.model, device, dtype)
    settings = opened.fitted(settings)
    slice_ = harness.windows(
        harness.read_tokens(settings.data, opened.encode), settings.seq_len, settings.sequences
    )
    model, deepest, clamp = opened.model, max(settings.loops), settings.clamp
    totals, tokens = {k: 0.0 for k in settings.loops}, 0
    with torch.no_grad():
        for batch in harness.batches(slice_, settings.batch_size, f"depth (K up to {deepest})"):
            batch = batch.to(device)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            for k, h in harness.trajectory(model, inputs, deepest, clamp):
                if k in totals:
                    totals[k] += (
                        harness.token_ce(model.readout(h, k, k), targets).double().sum().item()
                    )
            tokens += targets.numel()
    rows = [
        {"loops": k, "ce": totals[k] / tokens, "ppl": harness.ppl(totals[k] / tokens)}
        for k in settings.loops
    ]
    result = {
        "model": opened.info,
        "settings": settings.record(device=device, dtype=dtype, tokens=tokens),
        "rows": rows,
    }
    if settings.out is not None:
        harness.write(settings.out, "depth", result, markdown(result))
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
    lines += [f"| {r['loops']} | {r['ce']:.4f} | {ppl_text(r['ppl'])} |" for r in result["rows"]]
    return "\n".join(lines)
