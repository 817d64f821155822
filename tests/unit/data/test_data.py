"""Validation reads the validation split in file order, the same for every seed: window i is
tokens[i·s : i·s + s + 1]; `train.eval_batches: all` evaluates the longest prefix that splits
over DP and PP, and says which."""

import json
import math

import numpy as np
import pytest
import torch

from megaloop import experiment
from megaloop.config import ConfigError
from megaloop.data import IndexedConfig, SyntheticConfig, TextConfig
from multiproc import metrics as read_metrics
from support import ROOT, TINY

SEQ = 16


def windows(tokens: np.ndarray, count: int, seq_len: int = SEQ) -> np.ndarray:
    return np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)])


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)
    words = ["river", "city", "music", "the", "of", "and", "winter", "station", "quiet"]
    (root / "train.txt").write_text(" ".join(rng.choice(words, 3000)) + "\n")
    (root / "valid.txt").write_text(" ".join(rng.choice(words, 300)) + "\n")
    return root


def test_text_validation_is_the_files_windows_in_order_for_every_seed(text_files):
    cfg = TextConfig(
        path=str(text_files / "train.txt"),
        valid_path=str(text_files / "valid.txt"),
        seq_len=SEQ,
    )
    a, b = cfg.build(seed=0), cfg.build(seed=7)
    assert torch.equal(a.batch(range(8), split="valid"), b.batch(range(8), split="valid"))
    tokens = np.frombuffer((text_files / "valid.txt").read_bytes(), dtype=np.uint8)
    assert a.valid_windows == b.valid_windows == (len(tokens) - 1) // SEQ
    n = a.valid_windows
    assert np.array_equal(a.batch(range(n), split="valid").numpy(), windows(tokens, n))
    assert not torch.equal(a.batch(range(4)), b.batch(range(4)))  # training still follows the seed
    with pytest.raises(IndexError, match=f"has {n} windows"):
        a.batch([n], split="valid")


def test_text_without_a_valid_file_reads_the_tail_in_order(text_files):
    cfg = TextConfig(path=str(text_files / "train.txt"), seq_len=SEQ, valid_fraction=0.1)
    data = cfg.build(seed=3)
    tokens = np.frombuffer((text_files / "train.txt").read_bytes(), dtype=np.uint8)
    tail = tokens[int(len(tokens) * 0.9) :]
    assert np.array_equal(data.batch(range(5), split="valid").numpy(), windows(tail, 5))


@pytest.fixture(scope="module")
def indexed_files(tmp_path_factory):
    """train and valid prefixes written by megatron-core's IndexedDatasetBuilder; valid holds
    documents of 5, 11, 1 and 30 tokens whose stream is 1000, 1001, ..."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("indexed")
    rng = np.random.default_rng(1)
    docs = {
        "train": [rng.integers(1, 256, n) for n in rng.integers(20, 80, 40)],
        "valid": np.split(np.arange(1000, 1047), [5, 16, 17]),
    }
    for split, documents in docs.items():
        builder = IndexedDatasetBuilder(str(root / f"{split}.bin"), dtype=np.uint16)
        for doc in documents:
            builder.add_document(torch.from_numpy(doc), [len(doc)])
        builder.finalize(str(root / f"{split}.idx"))
        (root / f"{split}.manifest.json").write_text(json.dumps({"eos_id": 0}))
    return root, docs


def test_indexed_validation_is_the_documents_stream_in_file_order(indexed_files, tmp_path):
    root, docs = indexed_files
    cfg = IndexedConfig(
        path=str(root / "train"),
        valid_path=str(root / "valid"),
        seq_len=SEQ,
        cache_dir=str(tmp_path),
    )
    a, b = cfg.build(seed=0, train_samples=16), cfg.build(seed=1, train_samples=16)
    got = a.batch(range(2), split="valid")
    assert torch.equal(got, b.batch(range(2), split="valid"))
    stream = np.concatenate(docs["valid"])
    assert np.array_equal(got.numpy(), windows(stream, 2))  # across document boundaries
    assert a.valid_windows == b.valid_windows == (len(stream) - 1) // SEQ == 2
    assert not torch.equal(a.batch(range(4)), b.batch(range(4)))  # GPTDataset shuffles training


def test_indexed_without_a_valid_prefix_reads_the_training_stream(indexed_files, tmp_path):
    root, docs = indexed_files
    cfg = IndexedConfig(path=str(root / "train"), seq_len=SEQ, cache_dir=str(tmp_path))
    data = cfg.build(seed=0, train_samples=16)
    stream = np.concatenate(docs["train"])
    assert data.valid_windows == (len(stream) - 1) // SEQ
    assert np.array_equal(data.batch(range(3), split="valid").numpy(), windows(stream, 3))


def test_synthetic_validation_is_a_fixed_stream_apart_from_training():
    a, b = SyntheticConfig(seq_len=SEQ).build(seed=0), SyntheticConfig(seq_len=SEQ).build(seed=11)
    assert torch.equal(a.batch(range(8), split="valid"), b.batch(range(8), split="valid"))
    assert not torch.equal(a.batch(range(8)), b.batch(range(8)))
    assert a.valid_windows is None
    from megaloop.data.synthetic import VALID_SEED

    # numpy reads the training key [VALID_SEED, i] as [VALID_SEED, i, 0], validation's is ≠
    clash = SyntheticConfig(seq_len=SEQ).build(seed=VALID_SEED)
    assert not torch.equal(clash.batch(range(8)), a.batch(range(8), split="valid"))


def test_webdataset_validation_is_the_held_out_sequences_in_order(tmp_path):
    import webdataset as wds

    from megaloop.data.shards import ShardData

    (tmp_path / "shards").mkdir()
    sequences = {}
    for shard in range(3):
        name = f"00000-{shard:05d}.tar"
        rows = [np.full(SEQ + 1, 100 * shard + i, dtype=np.int64) for i in range(4)]
        with wds.TarWriter(str(tmp_path / "shards" / name)) as sink:
            for i, row in enumerate(rows):
                sink.write({"__key__": f"{shard}-{i}", "tokens.npy": row})
        sequences[name] = rows
    (tmp_path / "manifest.json").write_text(
        json.dumps({"seq_len": SEQ, "shards": {n: len(r) for n, r in sequences.items()}})
    )
    data = ShardData(str(tmp_path), SEQ, seed=0, valid_shards=2, resampled=False, tokenizer=None)
    held_out = sequences["00000-00001.tar"] + sequences["00000-00002.tar"]
    assert data.valid_windows == 8
    assert np.array_equal(data.batch(range(8)).numpy(), np.stack(held_out))
    with pytest.raises(IndexError, match="hold 8"):
        data.batch(range(6, 10))


def test_eval_microbatches_fit_dp_and_pp():
    from megaloop.parallel.layout import eval_microbatches
    from megaloop.train.config import TrainConfig

    train = TrainConfig(micro_batch_size=2, global_batch_size=8, eval_batches="all")
    assert eval_microbatches(train, 37, dp=1, pp=1) == 18  # 36 of 37 windows
    assert eval_microbatches(train, 37, dp=2, pp=2) == 16  # a multiple of DP·PP = 4
    with pytest.raises(ConfigError, match="fewer than one micro-batch"):
        eval_microbatches(train, 7, dp=2, pp=2)
    with pytest.raises(ConfigError, match="no finite validation split"):
        eval_microbatches(train, None, dp=1, pp=1)
    train.eval_batches = 5
    assert eval_microbatches(train, 10, dp=1, pp=1) == 5
    assert eval_microbatches(train, None, dp=1, pp=1) == 5
    with pytest.raises(ConfigError, match="validation split has 9; use train.eval_batches=all"):
        eval_microbatches(train, 9, dp=1, pp=1)


@pytest.mark.parametrize(
    "value, words",
    [
        ("ALL", ["train.eval_batches", "'ALL'", "an integer or 'all'"]),
        ("1.5", ["train.eval_batches", "1.5", "an integer or 'all'"]),
        ("true", ["train.eval_batches", "True", "an integer or 'all'"]),
        ("0", ["train.eval_batches", "must be >= 1, or `all`"]),
    ],
)
def test_bad_eval_batches_is_one_clear_error(value, words):
    with pytest.raises(ConfigError) as err:
        experiment.load(TINY, [f"train.eval_batches={value}"])
    for word in words:
        assert word in str(err.value), str(err.value)


def test_all_is_refused_without_a_finite_split_before_any_compute():
    with pytest.raises(ConfigError, match="data.kind=synthetic has no finite validation split"):
        experiment.load(TINY, ["train.eval_batches=all"])


def test_wikitext_configs_evaluate_the_whole_split():
    for path in sorted((ROOT / "configs/experiments/wikitext103").rglob("*.yaml")):
        assert experiment.load(path).train.eval_batches == "all", path


def text_run(tmp_path, text_files, *overrides):
    return experiment.load(
        TINY,
        [
            f"train.dir={tmp_path}",
            "data.kind=text",
            f"data.path={text_files / 'train.txt'}",
            f"data.valid_path={text_files / 'valid.txt'}",
            f"data.seq_len={SEQ}",
            "train.steps=2",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            "train.log_every=1",
            "wandb.mode=disabled",
            *overrides,
        ],
    )


def test_eval_all_covers_the_stated_prefix(tmp_path, text_files):
    cfg = text_run(tmp_path, text_files, "train.eval_batches=all")
    trainer = experiment.build_trainer(cfg)
    result = trainer.fit()
    metrics = read_metrics(tmp_path)
    assert all(math.isfinite(r["loss"]) for r in metrics["steps"])
    total = trainer.dataset.valid_windows
    assert result["valid_windows"] == total // 4 * 4 and total - result["valid_windows"] < 4
    assert result["valid_tokens"] == result["valid_windows"] * SEQ
    assert metrics["evals"][-1]["valid_windows"] == result["valid_windows"]
    # the record's CE is the CE of exactly those windows
    batch = trainer.dataset.batch(range(result["valid_windows"]), split="valid")
    model = trainer.engine.module
    model.eval()
    with torch.no_grad():
        out = model(batch[:, :-1], labels=batch[:, 1:])
    assert result["ce"] == pytest.approx([c.mean().item() for c in out.token_ce], rel=1e-5)


def test_too_few_windows_for_all_or_a_number_is_refused_before_the_model(
    tmp_path, text_files, monkeypatch
):
    from megaloop.parallel import megatron

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the check")

    monkeypatch.setattr(megatron, "MegatronEngine", no_model)
    cfg = text_run(
        tmp_path,
        text_files,
        "train.eval_batches=all",
        "train.micro_batch_size=200",
        "train.global_batch_size=200",
    )
    with pytest.raises(ConfigError, match="fewer than one micro-batch"):
        experiment.build_trainer(cfg)
    cfg = text_run(tmp_path, text_files, "train.eval_batches=40")
    with pytest.raises(ConfigError, match="train.eval_batches.*asks for 160 windows"):
        experiment.build_trainer(cfg)
