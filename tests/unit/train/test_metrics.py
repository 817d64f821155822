"""Where per-step records go (megaloop/train/metrics.py): metrics.jsonl grows by appends, and the
progress line says what the run knows."""

from megaloop import experiment
from support import TINY


def test_progress_line_shows_mfu_where_the_device_peak_is_known(tmp_path):
    from megaloop.parallel.cost import flops_per_token, peak_tflops
    from megaloop.train.metrics import MetricsLogger, WandbConfig

    assert peak_tflops("NVIDIA H200") == peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and peak_tflops("cpu") is None
    cfg = experiment.load(TINY)
    logger = MetricsLogger(tmp_path, {}, WandbConfig(mode="disabled"), 100)
    record = {"step": 10, "loss": 2.0, "ce": [2.1, 2.0], "hidden_rms": [1.0, 2.0], "lr": 1e-3}
    record.update(grad_norm=0.5, tokens_per_s=1e6)
    assert "MFU" not in logger.progress_line(record)  # a CPU run: no peak, no figure
    fpt = flops_per_token(cfg.model, cfg.data.seq_len, cfg.model.num_loops)
    record["mfu"] = 1e6 * fpt / (8 * 989.4e12)  # as the trainer computes it on 8 H200s
    assert f"MFU {100 * record['mfu']:.1f}%" in logger.progress_line(record)
    logger.close()


def test_metrics_are_appended_never_rewritten(tmp_path):
    """metrics.jsonl grows by appends: across log calls of every kind the file keeps its inode
    and only grows, what it held before staying its prefix (a rewrite of the whole file at each
    call costs more every step, and a reader following the file loses its place)."""
    from megaloop.train.metrics import METRICS, MetricsLogger, WandbConfig, read

    logger = MetricsLogger(tmp_path, {"train": {"steps": 4}}, WandbConfig(mode="disabled"), 4)

    def step(n: int) -> dict:
        return {
            "step": n,
            "loss": 2.0 / n,
            "ce": [2.1 / n, 2.0 / n],
            "hidden_rms": [1.0, 2.0],
            "hidden_rms_max": [1.5, 2.5],
            "lr": 1e-3,
            "grad_norm": 0.5,
            "tokens_per_s": 1e6,
        }

    alarm = {"step": 3, "loop": 2, "rule": "max_rms", "value": 90.0, "limit": 50.0}
    calls = [
        lambda: logger.log(step(1)),
        lambda: logger.layout({"tp": 1, "pp": 1, "dp": 1, "ranks": []}),
        lambda: logger.log(step(2)),
        lambda: logger.skipped(3, "loss"),
        lambda: logger.alarm(alarm, "scale alarm at step 3"),
        lambda: logger.log(step(4)),
        lambda: logger.log({**step(4), "valid_windows": 16, "valid_tokens": 512}, kind="evals"),
    ]
    path = tmp_path / METRICS
    inode, before = path.stat().st_ino, path.read_bytes()
    for n, call in enumerate(calls):
        call()
        stat, now = path.stat(), path.read_bytes()
        assert stat.st_ino == inode, f"call {n} replaced the file"
        assert stat.st_size >= len(before) and now.startswith(before), f"call {n} rewrote it"
        before = now
    logger.close()
    metrics = read(tmp_path)
    assert [r["step"] for r in metrics["steps"]] == [1, 2, 4]
    assert metrics["evals"][0]["valid_windows"] == 16 and metrics["alarms"] == [alarm]
    assert metrics["skipped_steps"] == [{"step": 3, "what": "loss"}] and metrics["layout"]
