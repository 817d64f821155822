"""The study's data setup: its word-level tokenizer (`--tokenizer words:N`), its stream layout
(`--layout stream`) and its overlapping, shuffled training windows (`data.stride`), on data the
tests generate; and the tokenizer on the real WikiText-103 files where they are."""

import random
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import data_prep
from data_prep import FineWebConfig, WikiTextConfig, wikitext103
from data_prep.common import WORD_PATTERN, PrepError, train_words, word_pre_tokenizer
from data_prep.wikitext103 import stream_pieces
from megaloop.data.tokenizer import WORD_SPECIALS
from support import ROOT, TINY, article, wikitext

REAL = ROOT.parent / "shared/data/wikitext-103"
EOS_ID, UNK_ID = 2, 3
ODD_LINES = [
    # é and ½ are word characters to Python but not [A-Za-z0-9_]: dropped; ² likewise
    " café costs ½ of 2² . \n",
    # U+001C separates lines for str.splitlines, not for the dataset's rows; it is \s to Python
    " a x\x1c y line \n",
    # U+1000 is a letter (dropped), U+102D a vowel sign: not \w to Python, so a token of its own
    " \u1000\u102d script \n",
]


def rows(text: str) -> list[str]:
    """The hub dataset's rows of a raw file: its lines, each with its "\\n"."""
    return re.findall(r".*\n|.+", text)


def study_stream(text: str) -> str:
    """The study's text of a split, written out: non-empty rows joined by blank lines."""
    return "\n\n".join(row for row in rows(text) if row.strip())


def reference_ids(stream: str, vocab: dict) -> list[int]:
    return [vocab.get(t, UNK_ID) for t in re.findall(WORD_PATTERN, stream)]


def generated_text(seed: int, titles: int) -> str:
    rng = random.Random(seed)
    return wikitext(rng, [f"Title {i}" for i in range(titles)]) + "".join(ODD_LINES * 2)


def trained(tmp_path: Path, stream: str, size: int) -> Tokenizer:
    """The words tokenizer of `stream`, counted in pieces of ~100 characters."""
    pieces = stream_pieces([stream], 97)
    return Tokenizer.from_file(
        str(train_words(pieces, size, tmp_path / f"tok{size}-{len(stream)}.json"))
    )


# -- options -------------------------------------------------------------------------------


def test_words_specs_layout_and_the_eos_default():
    import argparse

    parser = argparse.ArgumentParser()
    data_prep.add_parsers(parser.add_subparsers(dest="corpus"))
    args = "wikitext103 --out o --tokenizer words:100 --layout stream".split()
    built = data_prep.config_from_args(parser.parse_args(args))
    assert built == WikiTextConfig(out="o", tokenizer="words:100", layout="stream")
    assert built.eos_token == "<eos>"
    assert WikiTextConfig(out="o").eos_token == "<|endoftext|>"
    assert WikiTextConfig(out="o", tokenizer="words:9", eos_token="<bos>").eos_token == "<bos>"
    for spec in ("words:4", "words:x", "words:", "words:-5", "words:1.5", "words:²"):
        with pytest.raises(PrepError, match=rf"--tokenizer '{re.escape(spec)}': use words:N with"):
            WikiTextConfig(out="o", tokenizer=spec)
    with pytest.raises(PrepError, match="--tokenizer words:N is for WikiText"):
        FineWebConfig(out="o", source="s", seq_len=8, tokenizer="words:100")
    with pytest.raises(PrepError, match="--layout lines: use articles or stream"):
        WikiTextConfig(out="o", layout="lines")


# -- the words tokenizer -------------------------------------------------------------------


def test_the_pre_tokenizer_is_pythons_re_on_every_code_point():
    """Every code point but the surrogates, in one text: the tokenizer splits it as Python's `re`
    does, whose \\w and \\s differ from those of the tokenizer's own regex engine (½, ², vowel
    signs), so the pattern spells them out."""
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    tokens = [t for t, _ in word_pre_tokenizer().pre_tokenize_str(text)]
    assert tokens == re.findall(WORD_PATTERN, text)


def test_the_vocabulary_is_the_studys_rule(tmp_path):
    stream = study_stream(generated_text(0, 6))
    counts = Counter(re.findall(WORD_PATTERN, stream))
    qualifying = [t for t, n in counts.items() if n >= 2]
    assert any(n == 1 for n in counts.values()) and len(set(counts.values())) < len(counts)
    for size in (10_000, 40):
        vocab = trained(tmp_path, stream, size).get_vocab()
        assert len(vocab) == min(size, len(WORD_SPECIALS) + len(qualifying))
        ordered = sorted(vocab, key=vocab.get)
        assert ordered[:4] == list(WORD_SPECIALS) == ["<pad>", "<bos>", "<eos>", "<unk>"]
        keys = [(-counts[t], t) for t in ordered[4:]]
        assert keys == sorted(keys) and all(counts[t] >= 2 for t in ordered[4:])
        left_out = [(-counts[t], t) for t in qualifying if t not in vocab]
        assert all(key > keys[-1] for key in left_out) and (size == 40) == bool(left_out)


def test_the_tokenizer_is_the_reference_token_for_token(tmp_path):
    stream = study_stream(generated_text(1, 6))
    tok = trained(tmp_path, stream, 10_000)
    vocab = tok.get_vocab()
    ids = tok.encode(stream).ids
    assert ids == reference_ids(stream, vocab) and UNK_ID in ids
    expected = "".join(t if t in vocab else "<unk>" for t in re.findall(WORD_PATTERN, stream))
    assert tok.decode(ids) == expected != stream  # count-1 tokens and é, ½, ² are gone
    ascii_text = study_stream(article(random.Random(2), 3) * 2)  # every token twice
    assert ascii_text.isascii()
    ascii_tok = trained(tmp_path, ascii_text, 10_000)
    assert ascii_tok.decode(ascii_tok.encode(ascii_text).ids) == ascii_text


def test_stream_pieces_end_where_tokens_end():
    lines = [row for row in rows(generated_text(3, 4)) if row.strip()]
    whole = "\n\n".join(lines)
    for chars in (1, 7, 60, 10**7):
        pieces = list(stream_pieces(lines, chars))
        assert "".join(pieces) == whole
        assert all(len(p) >= chars and re.search(r"[!-~]\Z", p) for p in pieces[:-1])
        assert all(p.startswith(" ") for p in pieces[1:])
        tokens = [t for p in pieces for t in re.findall(WORD_PATTERN, p)]
        assert tokens == re.findall(WORD_PATTERN, whole)
        assert (len(pieces) == 1) == (chars == 10**7)


# -- the stream layout ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def study_prep(tmp_path_factory):
    """words:60, layout stream, pieces of ~200 characters: several documents per split."""
    root = tmp_path_factory.mktemp("study")
    source = root / "source"
    source.mkdir()
    (source / "wiki.train.raw").write_text(generated_text(4, 8))
    (source / "wiki.valid.raw").write_text(generated_text(5, 2))
    out = root / "out"
    config = WikiTextConfig(source=str(source), tokenizer="words:60", layout="stream", out=str(out))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wikitext103, "PIECE_CHARS", 200)
        manifests = data_prep.run(config)
    return source, out, manifests, config


def test_the_stream_layout_stores_the_studys_token_stream(study_prep):
    from megaloop.data.indexed import TokenStream

    source, out, manifests, _ = study_prep
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab()
    assert len(vocab) == 60
    for split in ("train", "valid"):
        text = (source / f"wiki.{split}.raw").read_text()
        stream = TokenStream(str(out / split))
        assert len(stream.lengths) > 3  # cut into pieces, one EOS all the same:
        stored = stream.read(0, stream.num_tokens).tolist()
        assert stored == reference_ids(study_stream(text), vocab) + [EOS_ID]
        m = manifests[split]
        assert (m["layout"], m["eos_token"], m["eos_id"]) == ("stream", "<eos>", EOS_ID)
        assert m["lines"] == sum(1 for row in rows(text) if row.strip())
        assert m["documents"] == len(stream.lengths) and m["tokens"] == len(stored)


def test_a_resumed_prep_reuses_the_words_tokenizer(study_prep, tmp_path, monkeypatch):
    import data_prep.common

    _, prepared, manifests, config = study_prep
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    for done in ("train.manifest.json", "train.bin", "train.idx"):  # the train split "died"
        (out / done).unlink()
    shutil.rmtree(out / "logs/train")

    def no_training(*args):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(data_prep.common, "train_words", no_training)
    monkeypatch.setattr(wikitext103, "PIECE_CHARS", 200)
    again = data_prep.run(WikiTextConfig(**{**vars(config), "out": str(out)}))
    assert set(again) == {"train"} and again["train"]["tokens"] == manifests["train"]["tokens"]
    assert (out / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    assert (out / "train.bin").read_bytes() == (prepared / "train.bin").read_bytes()


def test_a_stream_skips_and_counts_lines_that_are_not_utf8(study_prep, tmp_path):
    source, prepared, _, _ = study_prep
    (tmp_path / "source").mkdir()
    good = (source / "wiki.valid.raw").read_bytes()
    (tmp_path / "source/wiki.valid.raw").write_bytes(b" caf\xe9 \xff line \n \n" + good)
    config = WikiTextConfig(
        source=str(tmp_path / "source"),
        tokenizer=str(prepared / "tokenizer.json"),
        eos_token="<eos>",
        layout="stream",
        out=str(tmp_path / "out"),
    )
    m = data_prep.run(config)["valid"]
    assert (m["non_utf8_lines"], m["lines"]) == (
        1,
        sum(1 for r in rows(good.decode()) if r.strip()),
    )
    assert (tmp_path / "out/valid.bin").read_bytes() == (prepared / "valid.bin").read_bytes()


def test_articles_with_the_words_tokenizer_end_each_with_eos(study_prep, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from data_prep.wikitext103 import split_articles

    source, prepared, _, _ = study_prep
    tokenizer = str(prepared / "tokenizer.json")
    with pytest.raises(PrepError, match=r"no '<\|endoftext\|>' token .* --eos-token <eos>"):
        data_prep.run(WikiTextConfig(source=str(source), tokenizer=tokenizer, out=str(tmp_path)))
    config = WikiTextConfig(
        source=str(source), tokenizer=tokenizer, eos_token="<eos>", out=str(tmp_path)
    )
    data_prep.run(config)
    tok = Tokenizer.from_file(tokenizer)
    articles = split_articles((source / "wiki.valid.raw").read_text())
    dataset = IndexedDataset(str(tmp_path / "valid"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        tok.encode(a).ids + [EOS_ID] for a in articles
    ]


def test_a_run_on_the_study_data_exports_its_tokenizer(study_prep, tmp_path):
    """Trained on the word stream with overlapping windows, then exported: transformers loads
    the word vocabulary with its four special tokens and encodes as megaloop did."""
    from transformers import AutoTokenizer

    from megaloop import experiment
    from megaloop.data.indexed import TokenStream
    from megaloop.export import export

    source, out, _, _ = study_prep
    cfg = experiment.load(
        TINY,
        [
            "data.kind=indexed",
            "data.task=null",
            "data.depth=null",
            f"data.path={out / 'train'}",
            f"data.valid_path={out / 'valid'}",
            "data.seq_len=16",
            "data.stride=8",
            "data.epochs=1",
            "train.steps=null",
            "model.vocab_size=60",
            "model.max_seq_len=16",
            "model.position_embedding=learned",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            "train.eval_batches=1",
            f"train.dir={tmp_path / 'run'}",
        ],
    )
    experiment.build_trainer(cfg, log=False).fit()
    windows = (TokenStream(str(out / "train")).num_tokens - 17) // 8 + 1
    assert cfg.train.steps == windows // 4  # one epoch of the windows
    hf = export(tmp_path / "run", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(hf)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    text = (source / "wiki.valid.raw").read_text()
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok(text, add_special_tokens=False).input_ids == ours.encode(text).ids


# -- data.stride -----------------------------------------------------------------------------

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


def strided(prefix: str, seq_len: int, stride: int, seed: int = 0):
    from megaloop.data.indexed import IndexedData
    from megaloop.data.tokenizer import load_tokenizer

    return IndexedData(prefix, None, seq_len, seed, 1, load_tokenizer("bytes"), stride=stride)


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


def test_each_epoch_visits_every_window_once_in_its_own_order(counting):
    data = strided(counting, 16, 8, seed=1)
    n = data.train.windows
    epochs = [starts(data, e * n, n) for e in range(3)]
    assert all(sorted(e) == list(range(0, 8 * n, 8)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert starts(strided(counting, 16, 8, seed=1), 0, n) == epochs[0]
    assert starts(strided(counting, 16, 8, seed=2), 0, n) != epochs[0]


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


# -- the real text ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wiki.valid.raw", "wiki.test.raw"])
def test_the_words_tokenizer_on_the_real_text_is_the_reference(name, tmp_path):
    """The study's 20,000-token rule on a real split: as many tokens as the reference count gives,
    and the tokenizer (trained on ~64 KiB pieces) equal to re.findall + the vocabulary over the
    whole file: Rust's regex engine against Python's `re` on real text."""
    path = REAL / name
    if not path.is_file():
        pytest.skip(f"{path} is not here (the shared WikiText-103 files)")
    from data_prep.wikitext103 import study_lines

    lines, bad = study_lines(path)
    stream = study_stream(path.read_bytes().decode("utf-8"))
    assert bad == 0 and "\n\n".join(lines) == stream
    counts = Counter(re.findall(WORD_PATTERN, stream))
    tok = Tokenizer.from_file(
        str(train_words(stream_pieces(lines, 2**16), 20_000, tmp_path / "tok.json"))
    )
    vocab = tok.get_vocab()
    assert len(vocab) == min(20_000, 4 + sum(1 for n in counts.values() if n >= 2))
    assert tok.encode(stream).ids == reference_ids(stream, vocab)
