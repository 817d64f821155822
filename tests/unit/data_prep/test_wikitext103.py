"""The study's data setup: its word-level tokenizer (`--tokenizer words:N`) and its stream layout
(`--layout stream`), on data the tests generate; and the whole preparation on the real
WikiText-103 files where they are (its overlapping windows, `data.stride`: data/test_indexed.py).

The references here are written from the study's released code (readout-blind-spot, commit
959dd3c: src/train_ar_looplm.py build_dataset, src/data/dataset.py RegexTokenizer.from_texts
and BaseTokenizer.encode) with their own literal pattern, not megaloop's constant: the
vocabulary counted row by row over the train and valid rows, each split's rows joined with
"\\n\\n" and encoded as one text, nothing appended."""

import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer

import data_prep
from data_prep import FineWebConfig, WikiTextConfig, wikitext103
from data_prep.common import WORD_PATTERN, PrepError, train_words, word_pre_tokenizer
from data_prep.wikitext103 import stream_pieces
from megaloop.data.tokenizer import WORD_SPECIALS
from support import ROOT, TINY, article, wikitext

REAL = ROOT.parent / "shared/data/wikitext-103"
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
EOS_ID, UNK_ID = 2, 3
STUDY_PATTERN = r"\s+|[A-Za-z0-9_]+|[^\w\s]"
"""The pattern of the study's configs (data.pattern), spelled here on its own."""
JOIN = " \n\n\n "
"""Where two rows that end with " \\n" and start with " " meet in the joined text: one token
that no single row holds."""
ODD_LINES = [
    # é and ½ are word characters to Python but not [A-Za-z0-9_]: dropped; ² likewise
    " café costs ½ of 2² . \n",
    # U+001C separates lines for str.splitlines, not for the dataset's rows; it is \s to Python
    " a x\x1c y line \n",
    # U+1000 is a letter (dropped), U+102D a vowel sign: not \w to Python, so a token of its own
    " \u1000\u102d script \n",
]
VALID_ONLY = " vvonly is only in the valid text : vvonly , vvonly . \n"
"""A token three times in the valid split and never in train: a word only if valid counts."""
ACROSS = ("qqacross here once \n", " and qqacross there once \n")
"""A token once in each split: a word only if both are counted together."""


def rows(text: str) -> list[str]:
    """The hub dataset's rows of a raw file that the study keeps: its lines, each with its
    "\\n", less the empty ones (a line of spaces is an empty row on the hub)."""
    lines = text.split("\n")
    with_newline = [line + "\n" for line in lines[:-1]] + [lines[-1]]
    return [row for row in with_newline if row.strip()]


def reference_vocab(counted: list[str], size: int) -> dict[str, int]:
    """RegexTokenizer.from_texts(rows, pattern, max_vocab_size=size, min_token_freq=2)."""
    counts = Counter()
    for row in counted:
        counts.update(re.findall(STUDY_PATTERN, row))
    words = [(t, n) for t, n in counts.items() if n >= 2 and t not in SPECIALS]
    words.sort(key=lambda item: (-item[1], item[0]))
    return {t: i for i, t in enumerate(SPECIALS + [t for t, _ in words[: size - len(SPECIALS)]])}


def reference_ids(split_rows: list[str], vocab: dict) -> list[int]:
    """tokenizer.encode("\\n\\n".join(rows)): no <bos>, no <eos>."""
    return [vocab.get(t, UNK_ID) for t in re.findall(STUDY_PATTERN, "\n\n".join(split_rows))]


def generated_text(seed: int, titles: int) -> str:
    rng = random.Random(seed)
    return wikitext(rng, [f"Title {i}" for i in range(titles)]) + "".join(ODD_LINES * 2)


def stored(prefix: Path) -> list[int]:
    from megaloop.data.indexed import TokenStream

    stream = TokenStream(str(prefix))
    return stream.read(0, stream.num_tokens).tolist()


def folder_state(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


# -- options -------------------------------------------------------------------------------


def test_words_specs_layout_and_the_eos_default():
    import argparse

    parser = argparse.ArgumentParser()
    data_prep.add_parsers(parser.add_subparsers(dest="corpus"))
    args = "wikitext103 --out o --tokenizer words:100 --layout stream".split()
    built = data_prep.config_from_args(parser.parse_args(args))
    assert built == WikiTextConfig(out="o", tokenizer="words:100", layout="stream")
    assert built.eos_token is None  # the stream appends nothing
    assert WikiTextConfig(out="o", tokenizer="words:9").eos_token == "<eos>"  # articles
    assert WikiTextConfig(out="o").eos_token == "<|endoftext|>"
    assert WikiTextConfig(out="o", tokenizer="words:9", eos_token="<bos>").eos_token == "<bos>"
    with pytest.raises(PrepError, match="--eos-token <eos>: --layout stream appends no end"):
        WikiTextConfig(out="o", tokenizer="words:9", layout="stream", eos_token="<eos>")
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
    assert WORD_PATTERN == STUDY_PATTERN
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    tokens = [t for t, _ in word_pre_tokenizer().pre_tokenize_str(text)]
    assert tokens == re.findall(STUDY_PATTERN, text)


HAND_SPLIT = [
    # (text, the study's tokens: whitespace runs, [A-Za-z0-9_] runs, one token per other
    # character that is neither word nor space; characters none of them match are dropped)
    ("c...", ["c", ".", ".", "."]),
    (" @-@ ", [" ", "@", "-", "@", " "]),
    ("1 @,@ 000", ["1", " ", "@", ",", "@", " ", "000"]),
    ("a+b++c", ["a", "+", "b", "+", "+", "c"]),
    ("don't", ["don", "'", "t"]),
    ("(1.5%)", ["(", "1", ".", "5", "%", ")"]),
    (" = = Valkyria = = \n", [" ", "=", " ", "=", " ", "Valkyria", " ", "=", " ", "=", " \n"]),
    ("foo_bar9 \t\n\n x", ["foo_bar9", " \t\n\n ", "x"]),
    ("café — ½ ok", ["caf", " ", "\u2014", " ", " ", "ok"]),
    ("<unk>", ["<", "unk", ">"]),
]


def test_the_words_split_on_hand_written_examples(tmp_path):
    """The words tokenizer's split (its pre-tokenizer, its counts and a trained tokenizer's
    tokens) on examples split by hand, and the pattern it is written as spelled out here."""
    from data_prep.common import count_words

    assert WORD_PATTERN == r"\s+|[A-Za-z0-9_]+|[^\w\s]"
    texts = [text for text, _ in HAND_SPLIT]
    pre = word_pre_tokenizer()
    tok = Tokenizer.from_file(str(train_words(iter(texts * 2), 1000, tmp_path / "tok.json")))
    for text, expected in HAND_SPLIT:
        assert re.findall(r"\s+|[A-Za-z0-9_]+|[^\w\s]", text) == expected, text  # re's split
        assert [t for t, _ in pre.pre_tokenize_str(text)] == expected, text
        assert count_words([text]) == Counter(expected), text
        assert tok.encode(text).tokens == expected, text


def test_the_vocabulary_is_the_studys_rule(tmp_path):
    counted = rows(generated_text(0, 6))
    counts = Counter(t for row in counted for t in re.findall(STUDY_PATTERN, row))
    qualifying = [t for t, n in counts.items() if n >= 2]
    assert any(n == 1 for n in counts.values()) and len(set(counts.values())) < len(counts)
    for size in (10_000, 40):
        vocab = Tokenizer.from_file(
            str(train_words(iter(counted), size, tmp_path / f"tok{size}.json"))
        ).get_vocab()
        assert vocab == reference_vocab(counted, size)
        assert len(vocab) == min(size, len(WORD_SPECIALS) + len(qualifying))
        ordered = sorted(vocab, key=vocab.get)
        assert ordered[:4] == list(WORD_SPECIALS) == SPECIALS
        keys = [(-counts[t], t) for t in ordered[4:]]
        assert keys == sorted(keys) and all(counts[t] >= 2 for t in ordered[4:])
        left_out = [(-counts[t], t) for t in qualifying if t not in vocab]
        assert all(key > keys[-1] for key in left_out) and (size == 40) == bool(left_out)


def test_a_token_that_only_a_row_join_makes_is_unk(tmp_path):
    """Counted row by row, the whitespace run where two rows meet is never seen: the joined text
    encodes it as <unk>, while the row's own end (" \\n") is a word. Counted on the joined text
    (what megaloop did before), the join would have been a word."""
    counted = rows(generated_text(1, 6))
    joined = "\n\n".join(counted)
    in_rows = Counter(t for row in counted for t in re.findall(STUDY_PATTERN, row))
    in_joined = Counter(re.findall(STUDY_PATTERN, joined))
    only_joined = {t for t in in_joined if t not in in_rows}
    assert JOIN in only_joined and in_joined[JOIN] >= 2 and in_rows[" \n"] >= 2
    tok = Tokenizer.from_file(str(train_words(iter(counted), 10_000, tmp_path / "tok.json")))
    vocab = tok.get_vocab()
    assert " \n" in vocab and not only_joined & set(vocab)
    ids = tok.encode(joined).ids
    assert ids == reference_ids(counted, vocab)
    tokens = re.findall(STUDY_PATTERN, joined)
    assert [i for i, t in zip(ids, tokens) if t in only_joined] == [UNK_ID] * sum(
        in_joined[t] for t in only_joined
    )


def test_the_tokenizer_is_the_reference_token_for_token(tmp_path):
    counted = rows(generated_text(1, 6))
    tok = Tokenizer.from_file(str(train_words(iter(counted), 10_000, tmp_path / "tok.json")))
    vocab = tok.get_vocab()
    joined = "\n\n".join(counted)
    ids = tok.encode(joined).ids
    assert ids == reference_ids(counted, vocab) and UNK_ID in ids
    expected = "".join(t if t in vocab else "<unk>" for t in re.findall(STUDY_PATTERN, joined))
    assert tok.decode(ids) == expected != joined  # count-1 tokens, the joins, é, ½, ² are gone
    ascii_rows = rows(article(random.Random(2), 3) * 2)  # every token twice, in rows
    assert "".join(ascii_rows).isascii()
    ascii_tok = Tokenizer.from_file(
        str(train_words(iter(ascii_rows), 10_000, tmp_path / "ascii.json"))
    )
    one_row = "".join(ascii_rows)  # a text with no join in it decodes to itself
    assert ascii_tok.decode(ascii_tok.encode(one_row).ids) == one_row


def test_stream_pieces_end_where_tokens_end():
    lines = rows(generated_text(3, 4))
    whole = "\n\n".join(lines)
    for chars in (1, 7, 60, 10**7):
        pieces = list(stream_pieces(lines, chars))
        assert "".join(pieces) == whole
        assert all(len(p) >= chars and re.search(r"[!-~]\Z", p) for p in pieces[:-1])
        assert all(p.startswith(" ") for p in pieces[1:])
        tokens = [t for p in pieces for t in re.findall(STUDY_PATTERN, p)]
        assert tokens == re.findall(STUDY_PATTERN, whole)
        assert (len(pieces) == 1) == (chars == 10**7)


# -- the stream layout ---------------------------------------------------------------------

SIZE = 10_000
"""The generated splits' vocabulary: every token seen twice (the rule's cut at N ids is held by
test_the_vocabulary_is_the_studys_rule)."""


def write_source(source: Path) -> Path:
    source.mkdir()
    (source / "wiki.train.raw").write_text(generated_text(4, 8) + ACROSS[0])
    (source / "wiki.valid.raw").write_text(generated_text(5, 2) + VALID_ONLY + ACROSS[1])
    return source


@pytest.fixture(scope="module")
def study_prep(tmp_path_factory):
    """words:SIZE, layout stream, pieces of ~200 characters: several documents per split."""
    root = tmp_path_factory.mktemp("study")
    source = write_source(root / "source")
    out = root / "out"
    config = WikiTextConfig(
        source=str(source), tokenizer=f"words:{SIZE}", layout="stream", out=str(out)
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wikitext103, "PIECE_CHARS", 200)
        manifests = data_prep.run(config)
    return source, out, manifests, config


def split_rows(source: Path) -> dict[str, list[str]]:
    return {s: rows((source / f"wiki.{s}.raw").read_text()) for s in ("train", "valid")}


def test_the_vocabulary_counts_the_train_and_valid_rows(study_prep):
    source, out, _, _ = study_prep
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab()
    split = split_rows(source)
    assert vocab == reference_vocab(split["train"] + split["valid"], SIZE)
    assert {"vvonly", "qqacross", " \n"} <= set(vocab) and JOIN not in vocab
    train_only = reference_vocab(split["train"], SIZE)  # what counting train alone would give
    assert "vvonly" not in train_only and "qqacross" not in train_only
    assert json.loads((out / "tokenizer.words.json").read_text())["tokenizer"] == f"words:{SIZE}"


def test_the_stream_layout_stores_the_studys_ids_with_no_end_token(study_prep):
    from megaloop.data.indexed import TokenStream

    source, out, manifests, _ = study_prep
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab()
    for split, counted in split_rows(source).items():
        stream = TokenStream(str(out / split))
        assert len(stream.lengths) > 3  # cut into pieces, the ids all the same:
        ids = stored(out / split)
        assert ids == reference_ids(counted, vocab) and EOS_ID not in ids
        assert ids[re.findall(STUDY_PATTERN, "\n\n".join(counted)).index(JOIN)] == UNK_ID
        m = manifests[split]
        assert (m["layout"], m["eos_token"], m["eos_id"]) == ("stream", None, None)
        assert m["lines"] == len(counted) and m["non_utf8_lines"] == 0
        assert m["documents"] == len(stream.lengths) and m["tokens"] == len(ids)


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


def _old_words_tokenizer(out: Path) -> str:
    """An older megaloop's folder: its words tokenizer came with no tokenizer.words.json."""
    (out / "tokenizer.words.json").unlink()
    return (
        "tokenizer.json has no tokenizer.words.json beside it, so it is not the study's "
        "vocabulary: an older megaloop counted words:N on the train split's joined text"
    )


def _old_stream(out: Path) -> str:
    """An older megaloop's stream: its manifest names the <eos> it ended with."""
    path = out / "valid.manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token": "<eos>", "eos_id": 2}))
    return r"valid.manifest.json: the valid stream ends with '<eos>', as an older megaloop"


def _gone_tokenizer(out: Path) -> str:
    for name in ("tokenizer.json", "tokenizer.words.json"):
        (out / name).unlink()
    return "holds work of an earlier preparation .*, but not the tokenizer.json it was made with"


def _other_tokenizer(out: Path) -> str:
    path = out / "valid.manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_sha256": "0" * 64}))
    return "the valid split was made with another tokenizer"


@pytest.mark.parametrize(
    "damage, overrides",
    [
        (_old_words_tokenizer, {}),
        (_old_stream, {}),
        (_gone_tokenizer, {}),
        (_other_tokenizer, {}),
        (lambda out: "holds the --tokenizer words:10000 vocabulary, not words:500", {"size": 500}),
        (lambda out: "the valid split in the stream layout, and --layout is articles", {}),
    ],
    ids=["old-words", "old-stream", "gone-tokenizer", "other-tokenizer", "other-size", "layout"],
)
def test_a_folder_another_rule_made_is_refused_before_any_work(
    study_prep, tmp_path, monkeypatch, damage, overrides
):
    """A resumed prep into a folder that an older megaloop (or other options) made: one error
    naming the problem and the fix, before any compute, nothing deleted or rewritten."""
    import data_prep.common

    _, prepared, _, config = study_prep
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    for done in ("train.manifest.json", "train.bin", "train.idx"):  # left to do: train
        (out / done).unlink()
    words = damage(out)
    before = folder_state(out)

    def no_work(*args, **kwargs):
        raise AssertionError("work was done before the error")

    for module, name in ((data_prep.common, "count_words"), (wikitext103, "run_pipeline")):
        monkeypatch.setattr(module, name, no_work)
    options = {**vars(config), "out": str(out)}
    if "size" in overrides:
        options["tokenizer"] = f"words:{overrides['size']}"
    if "layout" in words:
        options.update(layout="articles", eos_token=None)
    with pytest.raises(PrepError, match=words) as err:
        data_prep.run(WikiTextConfig(**options))
    assert "prepare into a new --out folder (nothing here was changed or deleted)" in str(err.value)
    assert folder_state(out) == before


def test_a_words_vocabulary_needs_the_valid_split(study_prep, tmp_path, monkeypatch):
    import data_prep.common

    source, _, _, config = study_prep
    (tmp_path / "source").mkdir()
    shutil.copy(source / "wiki.train.raw", tmp_path / "source")
    monkeypatch.setattr(data_prep.common, "count_words", None)  # nothing is counted
    options = {**vars(config), "source": str(tmp_path / "source"), "out": str(tmp_path / "out")}
    with pytest.raises(
        PrepError,
        match=r"over the train and valid splits .* has no wiki.valid.raw; add it, or pass the "
        r"tokenizer.json of an earlier preparation",
    ):
        data_prep.run(WikiTextConfig(**options))
    assert not (tmp_path / "out/tokenizer.json").exists()
    assert not (tmp_path / "out/tokenizer.words.json").exists()


def test_a_line_that_is_not_utf8_is_skipped_for_the_vocabulary_and_the_ids(study_prep, tmp_path):
    source, prepared, _, _ = study_prep
    (tmp_path / "source").mkdir()
    good = (source / "wiki.valid.raw").read_bytes()
    bad = b" zzbad caf\xe9 zzbad \xff zzbad \n \n"  # zzbad: three times, on that line only
    (tmp_path / "source/wiki.valid.raw").write_bytes(bad + good)
    shutil.copy(source / "wiki.train.raw", tmp_path / "source")
    config = WikiTextConfig(
        source=str(tmp_path / "source"),
        tokenizer=f"words:{SIZE}",
        layout="stream",
        out=str(tmp_path / "out"),
    )
    m = data_prep.run(config)["valid"]
    assert (m["non_utf8_lines"], m["lines"]) == (1, len(rows(good.decode())))
    tok = tmp_path / "out/tokenizer.json"
    assert tok.read_bytes() == (prepared / "tokenizer.json").read_bytes()  # zzbad is no word
    assert stored(tmp_path / "out/valid") == stored(prepared / "valid")


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
    manifest = data_prep.run(config)["valid"]
    assert (manifest["eos_token"], manifest["eos_id"]) == ("<eos>", EOS_ID)
    tok = Tokenizer.from_file(tokenizer)
    articles = split_articles((source / "wiki.valid.raw").read_text())
    dataset = IndexedDataset(str(tmp_path / "valid"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        tok.encode(a).ids + [EOS_ID] for a in articles
    ]


def test_a_run_on_the_study_data_exports_its_tokenizer(study_prep, tmp_path):
    """Trained on the word stream with overlapping windows, validated on the valid stream's
    overlapping windows, then exported: transformers loads the word vocabulary with its four
    special tokens and encodes as megaloop did."""
    from transformers import AutoTokenizer

    from megaloop import experiment
    from megaloop.data.batches import strided_windows
    from megaloop.data.indexed import TokenStream
    from megaloop.export import export

    source, out, manifests, _ = study_prep
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
            f"model.vocab_size={manifests['train']['vocab_size']}",
            "model.max_seq_len=16",
            "model.position_embedding=learned",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            "train.eval_batches=all",
            f"train.dir={tmp_path / 'run'}",
        ],
    )
    trainer = experiment.build_trainer(cfg, log=False)
    result = trainer.fit()
    windows = (TokenStream(str(out / "train")).num_tokens - 17) // 8 + 1
    assert cfg.train.steps == windows // 4  # one epoch of the windows
    valid = strided_windows(TokenStream(str(out / "valid")).num_tokens, 16, 8)
    assert trainer.dataset.valid_windows == valid
    assert result["valid_windows"] == valid // 4 * 4 > 0  # the longest prefix of micro-batches
    hf = export(tmp_path / "run", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(hf)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    text = (source / "wiki.valid.raw").read_text()
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok(text, add_special_tokens=False).input_ids == ours.encode(text).ids


# -- the real text ---------------------------------------------------------------------------

REAL_TRAIN_TOKENS, REAL_JOINS = 491_141, 2_890
"""wiki.test.raw as the study encodes a split (issue 53): its tokens, and how many of them are
the join JOIN (<unk>, every one)."""


@pytest.fixture(scope="module")
def real_prep(tmp_path_factory):
    """`prep wikitext103 --tokenizer words:20000 --layout stream` of the real text as the
    miniature benches prepare it: wiki.test.raw as the train split, wiki.valid.raw as valid."""
    for name in ("wiki.test.raw", "wiki.valid.raw"):
        if not (REAL / name).is_file():
            pytest.skip(f"{REAL / name} is not here (the shared WikiText-103 files)")
    root = tmp_path_factory.mktemp("real")
    source = root / "source"
    source.mkdir()
    for link, name in (("wiki.train.raw", "wiki.test.raw"), ("wiki.valid.raw", "wiki.valid.raw")):
        (source / link).symlink_to(REAL / name)
    out = root / "out"
    config = WikiTextConfig(
        source=str(source), tokenizer="words:20000", layout="stream", out=str(out)
    )
    manifests = data_prep.run(config)
    texts = {s: (source / f"wiki.{s}.raw").read_bytes().decode("utf-8") for s in manifests}
    return out, manifests, {s: rows(t) for s, t in texts.items()}


def test_the_real_text_is_the_studys_vocabulary_and_ids(real_prep):
    out, manifests, split = real_prep
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab()
    expected = reference_vocab(split["train"] + split["valid"], 20_000)
    assert vocab == expected
    assert len(vocab) == 17_457  # 4 + every token seen twice in wiki.test.raw + wiki.valid.raw
    for name, counted in split.items():
        ids = stored(out / name)
        assert ids == reference_ids(counted, expected), name
        assert manifests[name]["tokens"] == len(ids) and manifests[name]["eos_id"] is None
    tokens = re.findall(STUDY_PATTERN, "\n\n".join(split["train"]))
    assert len(tokens) == REAL_TRAIN_TOKENS and " \n" in vocab and JOIN not in vocab
    assert tokens.count(JOIN) == REAL_JOINS == len(split["train"]) - 1


def test_the_real_validation_windows(real_prep):
    """The valid split at the study's seq_len 256 and stride 128: its windows, in order."""
    from megaloop.data.indexed import IndexedData
    from megaloop.data.tokenizer import load_tokenizer

    out, manifests, _ = real_prep
    data = IndexedData(
        str(out / "train"),
        str(out / "valid"),
        256,
        0,
        1,
        load_tokenizer(str(out / "tokenizer.json")),
        stride=128,
    )
    assert manifests["valid"]["tokens"] == 435_582
    assert data.valid_windows == (435_582 - 257) // 128 + 1 == 3_401
    last = data.batch([3_400], split="valid")[0].tolist()
    assert last == stored(out / "valid")[3_400 * 128 : 3_400 * 128 + 257]
