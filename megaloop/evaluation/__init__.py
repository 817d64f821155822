"""Evaluation of exported models: lm-eval downstream tasks, paired comparisons, fixed-K."""


def ppl_text(value: float) -> str:
    """A perplexity as printed: three decimals, in scientific notation from 1e6 on (a diverged
    readout's 6e20 is not read digit by digit)."""
    return f"{value:.3e}" if abs(value) >= 1e6 else f"{value:.3f}"
