"""`megaloop params` reports the study's shapes exactly (the counts: parallel/test_planner.py)."""

from megaloop import experiment
from megaloop.parallel.cost import parameter_counts as count_parameters


def test_embedding_counts_tied_once_and_untied_twice():
    tied = count_parameters(experiment.load("configs/model/44m.yaml").model)
    assert tied["embedding"] == 20480 * 512
    untied = count_parameters(experiment.load("configs/model/1p4b.yaml").model)
    assert untied["embedding"] == 2 * 49152 * 2048


def test_params_cli_prints_the_counts(capsys):
    from megaloop.cli import build_parser

    args = build_parser().parse_args(
        [
            "params",
            "configs/model/129m.yaml",
            "parallel.tp=2",
            "train.global_batch_size=32",
            "train.eval_batches=4",
            "--world",
            "8",
        ]
    )
    assert args.fn(args) == 0
    out = capsys.readouterr().out
    assert "128,994,048" in out and "15,728,640" in out
    assert "per rank at TP=2 PP=1 DP=4" in out and "optimizer" in out
