"""Exit-aware training (megaloop/model/sampled_exits.py): the training forward with exits is what
`copy` decodes, and a training forward draws its exits."""

import pytest
import torch

from megaloop.model.decoding import LoopCache
from megaloop.model.sampled_exits import draw
from support import MODELS, middle_thresholds, prompts, teacher_forced, tiny_pair

PROMPT = 6


@pytest.mark.parametrize("wiring", list(MODELS))
def test_the_training_forward_with_exits_is_what_copy_decodes(wiring):
    """Teacher-forced decoding through a `copy` cache, the gate exiting tokens at different
    loops, gives each decoded token the trainer's logits of its exit loop when the trainer's
    forward is given the same exits (the prompt's at K, as prefill runs it): every later
    token's deeper loops read the exited tokens' keys and values as the decoder does. Without
    the exits the trainer's logits are not the decoder's, so the test sees the keys."""
    trainer, hf = tiny_pair(seed=3, **MODELS[wiring])
    clamp = hf.config.clamp = wiring == "own"
    fields = dict(early_exit="gate", exit_threshold=middle_thresholds(hf)["gate"])
    K, tokens = hf.config.num_loops, prompts(4, 24, seed=4)
    cache = LoopCache("copy")
    teacher_forced(hf, tokens[:, :PROMPT], cache, early_exit="none")
    decoded = teacher_forced(hf, tokens[:, PROMPT:], cache, **fields)  # [b, m, V]
    exits = torch.cat(cache.exit_loops[PROMPT:], 1)  # [b, m]
    assert len(exits[:, :-1].unique()) >= 3, exits
    given = torch.cat([torch.full_like(tokens[:, :PROMPT], K), exits], 1)
    with torch.no_grad():
        with_exits = trainer(tokens, num_loops=K, clamp=clamp, exit_loops=given).logits
        full_depth = trainer(tokens, num_loops=K, clamp=clamp).logits

    def at_exits(logits):  # per loop [s, b, V] → the decoded tokens' at their exits [b, m, V]
        stacked = torch.stack(logits).transpose(1, 2)[:, :, PROMPT:]  # [K, b, m, V]
        return stacked.gather(0, (exits - 1)[None, ..., None].expand_as(stacked[:1]))[0]

    scale = decoded.abs().max()
    assert (at_exits(with_exits) - decoded).abs().max() / scale <= 1e-5
    assert (at_exits(full_depth) - decoded).abs().max() / scale > 1e-3


def test_draw_exits_a_rate_of_tokens_uniformly_before_k():
    """With rate r, a fraction r of the tokens exits before K, each loop 1..K−1 equally often."""
    torch.manual_seed(0)
    exits = draw(torch.zeros(200, 500, dtype=torch.long), 4, 0.6)
    share = torch.bincount(exits.flatten(), minlength=5)[1:] / exits.numel()
    assert share.tolist() == pytest.approx([0.2, 0.2, 0.2, 0.4], abs=0.005)


def test_a_training_forward_draws_its_exits():
    """In training mode a model with an exit rate draws exits (the forward is the one given the
    draw of the same random state); in eval mode, and without a rate, it runs full depth."""
    trainer, _ = tiny_pair(seed=1, readout="final_norm")
    tokens = prompts(2, 16, seed=5)
    with torch.no_grad():
        full = torch.stack(trainer(tokens).logits)
        trainer.train()
        assert torch.equal(torch.stack(trainer(tokens).logits), full)  # no dropout, no rate
        trainer.exit_rate = 0.75
        torch.manual_seed(7)
        sampled = torch.stack(trainer(tokens).logits)
        torch.manual_seed(7)
        given = torch.stack(trainer(tokens, exit_loops=draw(tokens, 4, 0.75)).logits)
        trainer.eval()
        assert torch.equal(torch.stack(trainer(tokens).logits), full)
    assert torch.equal(sampled, given)
    assert torch.equal(sampled[0], full[0])  # loop 1 reads every token's own keys
    assert (sampled[1:] - full[1:]).abs().max() > 1e-3
