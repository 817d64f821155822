"""Evaluation of exported models: lm-eval downstream tasks, paired comparisons, fixed-K."""
