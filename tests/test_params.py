"""`megaloop params` reports the study's shapes exactly."""

import pytest

from megaloop import experiment
from megaloop.model.params import count_parameters
from megaloop.parallel.layout import params_per_rank


@pytest.mark.parametrize("path, overrides, total", [
    ("configs/model/44m.yaml", [], 44_048_896),
    ("configs/model/129m.yaml", [], 128_994_048),
    # Ouro-1.4B exactly (the count of its published checkpoint) ...
    ("configs/model/1p4b.yaml", [], 1_434_652_673),
    # ... less the second norm of each sublayer (2 x 24 x d), the shared loop norm and the gate
    ("configs/model/1p4b.yaml", ["model.layer_norms=pre", "model.loop_norm=separate",
                                 "model.readout=raw", "model.exit_gate=false"],
     1_434_652_673 - 2 * 24 * 2048 - 2048 - 2049),
    ("configs/model/44m.yaml", ["model.recurrence=damping"], 44_048_896 + 512),
    ("configs/model/44m.yaml", ["model.recurrence=damping", "model.damping_shape=scalar"],
     44_048_896 + 1),
])
def test_parameter_counts(path, overrides, total):
    model = experiment.load(path, overrides).model
    counts = count_parameters(model)
    assert counts["total"] == total
    assert counts["embedding"] + counts["non_embedding"] == total
    assert params_per_rank(model, tp=1, pp=1, pp_rank=0) == total  # the layout formula agrees


def test_embedding_counts_tied_once_and_untied_twice():
    tied = count_parameters(experiment.load("configs/model/44m.yaml").model)
    assert tied["embedding"] == 20480 * 512
    untied = count_parameters(experiment.load("configs/model/1p4b.yaml").model)
    assert untied["embedding"] == 2 * 49152 * 2048


def test_params_cli_prints_the_counts(capsys):
    from megaloop.cli import cmd_params, build_parser

    args = build_parser().parse_args(["params", "configs/model/129m.yaml", "parallel.tp=2",
                                      "train.global_batch_size=32", "train.eval_batches=4",
                                      "--world", "8"])
    assert cmd_params(args) == 0
    out = capsys.readouterr().out
    assert "128,994,048" in out and "15,728,640" in out
    assert "per rank at TP=2 PP=1 DP=4" in out
