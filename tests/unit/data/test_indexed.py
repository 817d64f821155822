"""`data.stride` on an indexed dataset (megaloop/data/indexed.py): shuffled training windows every
stride tokens, each (seed, epoch) in its own order, and validation windows in order."""

import numpy as np
import pytest

from support import TINY

TOKENS = 1000


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """An indexed dataset whose token i is i, in three documents: a window names its start."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("counting") / "train"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for a, b in ((0, 100), (100, 350), (350, TOKENS)):
        builder.add_document(np.arange(a, b), [b - a])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def strided(prefix: str, seq_len: int, stride: int, seed: int = 0, valid: str | None = None):
    from megaloop.data.indexed import IndexedData
    from megaloop.data.tokenizer import load_tokenizer

    return IndexedData(prefix, valid, seq_len, seed, 1, load_tokenizer("bytes"), stride=stride)


def starts(data, first: int, count: int) -> list[int]:
    return [int(data.sample(i)[0]) for i in range(first, first + count)]


@pytest.mark.parametrize("seq_len, stride", [(16, 8), (16, 16), (16, 17), (16, 1), (255, 128)])
def test_windows_start_every_stride_tokens(counting, seq_len, stride):
    data = strided(counting, seq_len, stride)
    expected = [s for s in range(0, TOKENS, stride) if s + seq_len + 1 <= TOKENS]
    assert data.train.windows == len(expected)
    assert sorted(starts(data, 0, len(expected))) == expected
    for i in range(len(expected)):
        start = int(data.sample(i)[0])
        assert data.sample(i).tolist() == list(range(start, start + seq_len + 1))


@pytest.mark.parametrize("seq_len, stride", [(16, 8), (16, 16), (16, 17), (255, 128)])
def test_validation_windows_overlap_with_the_stride_in_order(counting, seq_len, stride):
    """With data.stride the validation split is cut as the study's validation loader cuts it:
    window j is tokens[j·stride : j·stride + seq_len + 1], in order, the same for every seed;
    without it, one window every seq_len tokens as before."""
    from megaloop.data.batches import Windows
    from megaloop.data.indexed import TokenStream

    expected = [list(range(s, s + seq_len + 1)) for s in range(0, TOKENS - seq_len, stride)]
    for seed in (0, 1):
        data = strided(counting, seq_len, stride, seed, valid=counting)
        assert data.valid_windows == len(expected)
        assert data.batch(range(len(expected)), split="valid").tolist() == expected
    with pytest.raises(IndexError, match=rf"{len(expected)} windows .* every {stride} tokens"):
        data.valid[len(expected)]
    stream = TokenStream(counting)
    plain = Windows(stream.read, stream.num_tokens, seq_len, counting)
    assert len(plain) == (TOKENS - 1) // seq_len
    assert plain.batch(range(len(plain))).tolist() == [
        list(range(s, s + seq_len + 1)) for s in range(0, len(plain) * seq_len, seq_len)
    ]


def test_each_epoch_visits_every_window_once_in_its_own_order(counting):
    data = strided(counting, 16, 8, seed=1)
    n = data.train.windows
    epochs = [starts(data, e * n, n) for e in range(3)]
    assert all(sorted(e) == list(range(0, 8 * n, 8)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert starts(strided(counting, 16, 8, seed=1), 0, n) == epochs[0]
    assert starts(strided(counting, 16, 8, seed=2), 0, n) != epochs[0]


def test_every_seed_and_epoch_shuffles_the_windows_its_own_way(counting):
    """Each (seed, epoch) draws its own order: seed s+1's epoch 0 is not seed s's epoch 1 (as an
    rng seeded with seed + epoch would make it), nor any other pair's; each is a permutation of
    the windows' starts."""
    seeds, epochs = range(4), range(4)
    orders = {}
    for seed in seeds:
        data = strided(counting, 16, 8, seed=seed)
        n = data.train.windows
        for epoch in epochs:
            order = starts(data, epoch * n, n)
            assert sorted(order) == list(range(0, 8 * n, 8)), (seed, epoch)
            orders[seed, epoch] = tuple(order)
    assert n > 50  # two equal orders by chance: about 1/n!
    pairs = [(a, b) for a in orders for b in orders if a < b and orders[a] == orders[b]]
    assert pairs == []


def test_strided_samples_resume_exactly_in_any_layout(counting):
    data = strided(counting, 16, 8, seed=3)
    gbs, n = 8, data.train.windows
    steps = 2 * n // gbs + 1  # across two epoch boundaries
    straight = data.batches(gbs, 2)
    rows = [row.tolist() for _ in range(steps) for mb in straight.next_step() for row in mb]
    assert rows == [data.sample(i).tolist() for i in range(steps * gbs)]
    consumed = (n // gbs) * gbs  # a checkpoint before the first epoch ends
    for dp_size in (1, 2, 4):
        resumed = [data.batches(gbs, 2, r, dp_size, consumed) for r in range(dp_size)]
        got = [
            row.tolist()
            for _ in range(steps - consumed // gbs)
            for batches in resumed  # the ranks' slices of one step, in rank order
            for mb in batches.next_step()
            for row in mb
        ]
        assert got == rows[consumed:], dp_size


def test_stride_epochs_set_the_steps_and_bad_strides_are_one_error(counting):
    from megaloop import experiment
    from megaloop.config import ConfigError, DataError

    def load(*overrides):
        common = ["model.max_seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=4"]
        data = ["data.kind=indexed", f"data.path={counting}", "data.seq_len=16"]
        return experiment.load(TINY, [*common, *data, *overrides])

    cfg = load("data.stride=8", "data.epochs=4", "train.steps=null")
    experiment.resolve_steps(cfg)
    assert cfg.train.steps == 4 * strided(counting, 16, 8).train.windows // 8 == 61
    for stride, words in ((0, "must lie in"), (18, "a longer stride skips tokens")):
        with pytest.raises(
            ConfigError, match=rf"config key 'data.stride': got {stride}; .*{words}"
        ):
            load(f"data.stride={stride}")
    with pytest.raises(ConfigError, match="data.stride.*is a key of data.kind=indexed"):
        experiment.load(TINY, ["data.kind=synthetic", "data.stride=8"])
    with pytest.raises(DataError, match="fewer than one training window of data.seq_len"):
        strided(counting, 1000, 8)
