"""What a resume may change (megaloop.train.resumable): the expected lists are written by hand."""

from megaloop.train.resumable import config_changes


def test_recompute_and_the_layout_may_change_on_resume():
    saved = {"train": {"recompute": "full", "steps": 10}, "parallel": {"tp": 2, "pp": 2}}
    asked = {"train": {"recompute": "none", "steps": 20}, "parallel": {"tp": 1, "pp": 1}}
    assert config_changes(saved, asked) == []


def test_a_changed_seed_or_model_stops_the_resume():
    saved = {"train": {"recompute": "none", "seed": 0}, "model": {"hidden_size": 32}}
    asked = {"train": {"recompute": "loop", "seed": 1}, "model": {"hidden_size": 64}}
    assert config_changes(saved, asked) == ["model.hidden_size: 32 -> 64", "train.seed: 0 -> 1"]
