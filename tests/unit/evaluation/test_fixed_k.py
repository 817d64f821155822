"""The fixed-K benchmark (megaloop/evaluation/fixed_k.py): a row per K, each K's CE the exported
model's at that depth."""

import json

import numpy as np
import pytest
import torch

from megaloop.evaluation import fixed_k, harness
from megaloop.evaluation.exported import EvalError
from megaloop.evaluation.settings import FixedKSettings


def test_fixed_k_bench_gives_a_row_per_k(export_dir, tmp_path):
    text = tmp_path / "held_out.txt"
    text.write_text("".join(f"{i}+{2 * i}={3 * i}\n" for i in range(200)))
    settings = FixedKSettings(
        model=export_dir,
        data=text,
        loops=(1, 2, 3),
        batch_size=2,
        seq_len=32,
        batches=3,
        warmup=1,
        out=tmp_path / "fk.json",
    )
    rows = fixed_k.run(settings)
    assert [r["loops"] for r in rows] == [1, 2, 3]
    for r in rows:  # the speed figures agree with each other (their values depend on the machine)
        assert r["tokens_per_s"] > 0 and r["median_batch_s"] > 0
        assert r["tokens_per_s"] * r["median_batch_s"] == pytest.approx(2 * 32)
        assert r["throughput_vs_k1"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])
    # each row's CE is the exported model's CE at that K, loaded with num_loops=K, on the timed
    # batches (the 3 after the warm-up batch): a bench that ran one K for all would fail here
    from transformers import AutoModelForCausalLM

    tokens = np.frombuffer(text.read_bytes(), np.uint8).astype(np.int64)  # bytes tokenizer
    batches = harness.windows(tokens, 32, (1 + 3) * 2).view(4, 2, 33)[1:]
    for r in rows:
        model = AutoModelForCausalLM.from_pretrained(
            export_dir, trust_remote_code=True, num_loops=r["loops"]
        ).eval()
        with torch.no_grad():
            ce = [
                torch.nn.functional.cross_entropy(
                    model(b[:, :-1], use_cache=False).logits.flatten(0, 1), b[:, 1:].flatten()
                ).item()
                for b in batches
            ]
        assert r["ce"] == pytest.approx(np.mean(ce), rel=1e-5), (r, ce)
    assert len({r["ce"] for r in rows}) == 3, rows  # and depth changes it
    saved = json.loads((tmp_path / "fk.json").read_text())
    assert saved["rows"] == rows and saved["timed_batches"] == 3
    assert (tmp_path / "fk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(EvalError, match="--seq-len 4096: the model takes 1 to 256 positions"):
        fixed_k.run(FixedKSettings(model=export_dir, data=text, seq_len=4096))
    with pytest.raises(EvalError, match="are needed"):
        fixed_k.run(FixedKSettings(model=export_dir, data=text, seq_len=200, batches=100))
