"""`megaloop report` (megaloop/evaluation/report.py) on results written by hand: variants' labels,
number formats, tables and figures; the report of trained models: test_depth.py."""

import math

import pytest

from megaloop.evaluation import report


def test_variants_are_named_by_their_folder_or_else_by_what_differs():
    def run(path, readout, lr):
        config = {"model": {"readout": readout}, "optim": {"lr": lr}, "train": {"seed": 0}}
        return {"path": path, "config": config, "metrics": {"evals": []}}

    apart = report.group([run("r/a/seed0", "norm", 1.0), run("r/b/seed0", "raw", 1.0)], [])
    assert [v.label for v in apart] == ["a", "b"]
    scales = report.group([run("44m/a/seed0", "norm", 1.0), run("129m/a/seed0", "raw", 1.0)], [])
    assert [v.label for v in scales] == ["129m/a", "44m/a"]  # the folder above tells them apart
    shared = report.group(
        [
            run("x/s/seed0", "norm", 1.0),
            run("x/s/seed1", "raw", 2.0),
            run("x/s/seed2", "raw", 2.0),
        ],
        [],
    )
    assert [v.label for v in shared] == ["readout=norm, lr=1.0", "readout=raw, lr=2.0"]
    assert [len(v.runs) for v in shared] == [1, 2]


@pytest.mark.parametrize(
    "value, text",
    [(6.1e20, "6.100e+20"), (1e6, "1.000e+06"), (999_999.4, "999999.400"), (12.34567, "12.346")],
)
def test_a_perplexity_past_a_million_prints_in_scientific_notation(value, text):
    from megaloop.evaluation import ppl_text

    assert ppl_text(value) == text
    assert report.stat([value]) == text  # the report's PPL columns print it alike
    assert report.stat([value, value]) == f"{text} ± 0.000"


def test_the_reports_l2_column_is_sqrt_d_times_the_rms():
    """Table 2 by hand: hidden size 16 and final-loop RMS 0.5 and 0.75 over two seeds are L2
    norms 4 x 0.5 = 2 and 4 x 0.75 = 3 (mean 2.5, sample std 1/sqrt(2)); hidden size 64 and RMS
    0.25 is 8 x 0.25 = 2. PPL is e^CE: 10 and 20, and 5."""

    def run(path, d, rms, ppl):
        config = {"model": {"hidden_size": d}, "train": {"seed": 0}}
        evals = [{"step": 40, "ce": [9.0, math.log(ppl)], "hidden_rms": [7.0, rms]}]
        return {"path": path, "config": config, "metrics": {"evals": evals}}

    variants = report.group(
        [
            run("r/d16/seed0", 16, 0.5, 10.0),
            run("r/d16/seed1", 16, 0.75, 20.0),
            run("r/d64/seed0", 64, 0.25, 5.0),
        ],
        [],
    )
    assert report.table_runs(variants)[2:] == [
        "| d16 | 2 | 40 | 15.000 ± 7.071 | 0.625 ± 0.1768 | 2.5 ± 0.7071 |",
        "| d64 | 1 | 40 | 5.000 | 0.25 | 2 |",
    ]


def diagnosed(a_rad, scale_step, update_rms, K=2, rms=(1.0, 2.0, 3.0, 9.0)):
    """A diagnose result by hand: a rollout of len(a_rad) + 1 loops, trained at K."""
    mean, p999, top = rms[0], rms[2], rms[3]
    dist = {"rms": {"mean": mean, "p50": mean, "p99": rms[1], "p99.9": p999, "max": top}}
    return {
        "settings": {"num_loops_trained": K},
        "rollout": {
            "loops": list(range(1, len(a_rad) + 2)),
            "a_rad": a_rad,
            "scale_step": scale_step,
            "update_rms": update_rms,
        },
        "scale": [dist] * K,
        "clamp": {"norm_ratio": 1.0, "delta_ce": 0.0},
    }


def test_the_radial_update_table_reads_the_loops_past_the_trained_depth():
    """Appendix F by hand: trained at K = 2, a rollout of 4 loops has updates into loops 2, 3,
    4; loops 3-4 are past K. a_rad there 4 and 6 (mean 5), Δs 5 and 5: ratio 1; the second
    seed 2 and 2 over 4 and 4: 0.5; ‖b‖ over those loops and seeds: 0.5 to 8 (the update into
    loop 2, 100, is the transient and left out). The tails: p99.9 3 and max 9 over mean 1."""
    variant = report.Variant("k", None, "norm")
    variant.results["diagnose"] = [
        diagnosed([100.0, 4.0, 6.0], [1.0, 5.0, 5.0], [100.0, 8.0, 7.0]),
        diagnosed([100.0, 2.0, 2.0], [1.0, 4.0, 4.0], [100.0, 0.5, 1.0], rms=(2, 4, 8, 10)),
    ]
    assert report.table_radial_step([variant])[2:] == [
        "| norm | 2 | 3-4 | 3.5 ± 2.121 | 4.5 ± 0.7071 | 0.75 ± 0.354 | [0.5, 8] |"
    ]
    scale = report.table_clamp_and_scale([variant])[1]
    assert scale[2].endswith("| 3.5 ± 0.707 | 7 ± 2.83 |"), scale[2]


def test_a_diverging_perplexity_does_not_flatten_the_depth_figure():
    """One variant's K = 1 PPL of 1e20 (study_mini's terminal raw) would set a linear axis:
    the axis is logarithmic, its top 10x the median of the curves' medians (raw's (1e4 + 130)
    / 2 and norm's (2200 + 2145) / 2), and the point beyond it is a triangle on the top edge."""
    import matplotlib

    matplotlib.use("Agg")

    def depth_result(ppl):
        rows = [{"loops": k, "ppl": p} for k, p in zip((1, 2, 3, 4), ppl)]
        return {"settings": {"clamp": False}, "rows": rows}

    variants = []
    for name, ppl in (("raw", [1e20, 1e4, 130.0, 100.0]), ("norm", [2500, 2200, 2140, 2145])):
        variants.append(report.Variant(name, None, name))
        variants[-1].results["depth"] = [depth_result(ppl)]
    ax = report.figures(variants)["ppl_vs_k"].axes[0]
    assert ax.get_yscale() == "log"
    low, top = ax.get_ylim()
    assert top == pytest.approx(10 * (5065.0 + 2172.5) / 2) and low == pytest.approx(100 / 1.5)
    edge = [line for line in ax.get_lines() if line.get_marker() == "^"]
    assert [(list(e.get_xdata()), list(e.get_ydata())) for e in edge] == [([1], [top])]
