"""bench/study_mini_long's runs keep every checkpoint its measurements read: each step of
MEASURE_AT is a save, and keep_last holds all the saves of a run."""

from pathlib import Path

from bench import study_mini_long


def test_every_measured_step_is_a_kept_checkpoint():
    jobs = study_mini_long.jobs(Path("data"), 100)
    assert sorted((j.name, j.seed) for j in jobs) == sorted(
        (f"long/{row}", seed) for row, seeds in study_mini_long.ROWS.items() for seed in seeds
    )
    for job in jobs:
        saves = range(job.save_every, job.steps + 1, job.save_every)
        assert set(study_mini_long.MEASURE_AT) <= set(saves) and job.steps in saves
        kept = dict(o.split("=") for o in job.overrides)["train.keep_last"]
        assert int(kept) >= len(saves)
        assert "train.global_batch_size=8" in job.overrides  # LONG: half the miniature's 16
