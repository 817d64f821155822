"""Halting's calibration and what its report says (megaloop/evaluation/halting.py), by hand; halt on
trained models: test_depth.py."""

import numpy as np
import pytest

from megaloop.evaluation import halting


def test_calibration_picks_the_smallest_threshold_within_rho():
    """Against a brute force over every score as a threshold, on random scores and CE: the same
    exits, within ρ, and every smaller threshold that changes an exit breaks ρ. (Thresholds
    between two attained scores act alike; the calibration reports the attained one.)"""
    rng = np.random.default_rng(0)
    for trial in range(30):
        units, K, tokens = 30, 4, 300
        scores = rng.normal(size=(units, K - 1))
        ce = rng.gamma(2.0, size=(units, K)) * 10
        ce[:, -1] = ce.min(1)  # loop K tends to be best, as in a trained model
        rho = 1 + rng.uniform(0, 0.2)
        fixed = ce[:, -1].sum()

        def ratio(t):  # this trial's values: called within the iteration
            exits = halting.exit_loops(scores, t)  # noqa: B023
            return np.exp((ce[np.arange(units), exits - 1].sum() - fixed) / tokens)  # noqa: B023

        ok = [t for t in sorted(set(scores.ravel())) if ratio(t) <= rho]
        got = halting.calibrate(scores, ce, tokens, rho)
        t = got["threshold"]
        assert got["ppl_ratio"] == pytest.approx(ratio(t)) and ratio(t) <= rho, trial
        if not ok:
            assert t is None
            continue
        assert (halting.exit_loops(scores, t) == halting.exit_loops(scores, ok[0])).all(), trial
        # the next smaller threshold that changes any exit breaks ρ
        below = np.unique(np.maximum.accumulate(scores, axis=1))
        below = below[below < t]
        assert not len(below) or ratio(below[-1]) > rho, trial


def test_a_speedup_below_one_says_why():
    """halt's report explains a dynamic pass slower than fixed K_max: with no early exit at
    all, and with exits that saved less than the per-loop readouts cost; above 1 nothing."""
    none_early = {"speedup": 0.33, "mean_loops": 4.0}
    assert halting.speedup_note(none_early, 4).startswith(
        " No sequence exited before K_max = 4: the dynamic pass ran every loop"
    )
    some = halting.speedup_note({"speedup": 0.8, "mean_loops": 3.25}, 4)
    assert some.startswith(" Sequences exited after 3.25 of 4 loops on average")
    assert halting.speedup_note({"speedup": 1.6, "mean_loops": 2.5}, 4) == ""
