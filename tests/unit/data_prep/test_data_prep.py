"""Data preparation (datatrove) and the loaders, on data the tests generate."""

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

import data_prep
from data_prep import FineWebConfig, WikiTextConfig
from data_prep.common import PrepError
from data_prep.wikitext103 import split_articles
from multiproc import metrics as read_metrics
from support import TINY, article, source_dir, web_documents, wikitext


def web_config(**options) -> FineWebConfig:
    """`megaloop prep fineweb` as the tests run it: short sequences, small shards."""
    return FineWebConfig(**{"seq_len": 64, "shard_size": 16, **options})


def prep_wikitext(source: Path, tokenizer, out: Path) -> dict:
    """`megaloop prep wikitext103`: the manifests of the splits it prepared."""
    return data_prep.run(WikiTextConfig(source=str(source), tokenizer=str(tokenizer), out=str(out)))


def prep_web(source: Path, tokenizer, out: Path) -> dict:
    """`megaloop prep fineweb` at web_config's settings: its manifest."""
    return data_prep.run(web_config(source=str(source), tokenizer=str(tokenizer), out=str(out)))


def test_prep_flags_build_the_same_config_as_the_dataclass():
    import argparse

    parser = argparse.ArgumentParser()
    data_prep.add_parsers(parser.add_subparsers(dest="corpus"))
    flags = "fineweb --source s --tokenizer t.json --out o --seq-len 8 --workers 2 --time 1:00"
    built = data_prep.config_from_args(parser.parse_args(flags.split()))
    assert built == FineWebConfig(
        source="s",
        tokenizer="t.json",
        out="o",
        seq_len=8,
        execution=data_prep.ExecutorConfig(workers=2, time="1:00"),
    )
    assert data_prep.config_from_args(parser.parse_args("wikitext103 --out o".split())) == (
        WikiTextConfig(out="o")
    )
    for bad, flag in [
        (dict(seq_len=0), "--seq-len"),
        (dict(lang_threshold=2.0), "--lang-threshold"),
        (dict(max_doc_bytes=0), "--max-doc-bytes"),
        (dict(tokenizer="train:300"), "--tokenizer train:N is for WikiText"),
    ]:
        with pytest.raises(PrepError, match=flag):
            web_config(**{"source": "s", "tokenizer": "t.json", "out": "o", **bad})
    with pytest.raises(PrepError, match="--executor slurm needs --partition"):
        data_prep.ExecutorConfig(executor="slurm")


# -- WikiText --------------------------------------------------------------------------------


def test_articles_split_on_top_level_headings_only():
    rng = random.Random(0)
    text = wikitext(rng, ["Alpha", "Beta ( film )", "Gamma"])
    docs = split_articles(text)
    assert [d.splitlines()[0] for d in docs] == [
        " = Alpha = ",
        " = Beta ( film ) = ",
        " = Gamma = ",
    ]
    assert "".join(docs) == text[len(" \n") :]  # nothing lost or changed but the blank head


@pytest.fixture(scope="module")
def wikitext_prep(tmp_path_factory):
    root = tmp_path_factory.mktemp("wt")
    rng = random.Random(1)
    source = source_dir(root)
    (source / "wiki.train.raw").write_text(wikitext(rng, [f"Train {i}" for i in range(30)]))
    (source / "wiki.valid.raw").write_text(wikitext(rng, [f"Valid {i}" for i in range(5)]))
    out = root / "out"
    return source, out, prep_wikitext(source, "train:400", out)


def test_wikitext_tokens_read_back_equal_tokenizing_the_articles(wikitext_prep):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    source, out, manifests = wikitext_prep
    assert set(manifests) == {"train", "valid"}
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 400
    eos = tok.token_to_id("<|endoftext|>")
    for split in ("train", "valid"):
        articles = split_articles((source / f"wiki.{split}.raw").read_text())
        dataset = IndexedDataset(str(out / split))
        assert len(dataset) == len(articles) == manifests[split]["documents"]
        assert dataset.index.dtype == np.uint16
        for i, text in enumerate(articles):
            assert dataset[i].tolist() == tok.encode(text).ids + [eos]
        manifest = json.loads((out / f"{split}.manifest.json").read_text())
        assert manifest["tokens"] == sum(len(dataset[i]) for i in range(len(dataset)))
        assert manifest["tokenizer_sha256"] and manifest["source_sha256"]


def test_wikitext_rerun_resumes_without_rewriting(wikitext_prep, capsys):
    source, out, _ = wikitext_prep
    before = (out / "train.bin").stat().st_mtime_ns
    again = prep_wikitext(source, "train:400", out)
    assert again == {} and (out / "train.bin").stat().st_mtime_ns == before
    assert "train is already prepared" in capsys.readouterr().out


def next_run(text: str):
    """The summary's `next:` command, loaded as `megaloop train` would load it."""
    import shlex

    from megaloop import experiment

    (line,) = [x for x in text.splitlines() if x.startswith("next: ")]
    words = shlex.split(line.removeprefix("next: "))
    assert words[:2] == ["megaloop", "train"], line
    return experiment.load(words[2], words[3:])


def test_prep_ends_with_what_it_holds_and_the_command_that_trains_on_it(wikitext_prep, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megaloop.cli import main

    source, out, _ = wikitext_prep
    args = ["--source", str(source), "--tokenizer", "train:400", "--out", str(out)]
    assert main(["prep", "wikitext103", *args]) == 0  # a re-run: every split already there
    text = capsys.readouterr().out
    tokens = {
        split: sum(len(d) for d in IndexedDataset(str(out / split))) for split in ("train", "valid")
    }
    articles = {s: len(split_articles((source / f"wiki.{s}.raw").read_text())) for s in tokens}
    assert (
        f"megaloop prep: {out} holds train ({tokens['train']:,} tokens, {articles['train']:,} "
        f"articles) and valid ({tokens['valid']:,} tokens, {articles['valid']:,} articles); a "
        f"vocabulary of 400 tokens.\n"
    ) in text
    cfg = next_run(text)
    assert cfg.data.path == str(out / "train") and cfg.data.valid_path == str(out / "valid")
    assert cfg.model.vocab_size == 400 and cfg.data.kind == "indexed"
    cfg.data.check_files()  # the run finds its data


def test_web_prep_summary_counts_the_shards_sequences(web_prep):
    import tarfile

    from megaloop.commands import prep

    out, manifest, _, tokenizer, source = web_prep
    config = web_config(source=str(source), tokenizer=str(tokenizer), out=str(out))
    text = prep.summary(data_prep.prepared(config))
    names = [tarfile.open(s).getnames() for s in sorted((out / "shards").glob("*.tar"))]
    shards = [n for n in names if n]  # a task whose one file was unreadable leaves an empty tar
    sequences = sum(name.endswith("tokens.npy") for n in shards for name in n)
    assert f"holds {sequences:,} sequences of 64+1 tokens in {len(shards)} shards (" in text
    cfg = next_run(text)
    assert (cfg.data.kind, cfg.data.path, cfg.data.seq_len) == ("webdataset", str(out), 64)
    assert cfg.model.vocab_size == 300
    config.out = str(out / "nothing-here")
    assert data_prep.prepared(config) is None  # no manifest: not finished, nothing to say


def test_wikitext_bad_inputs(tmp_path):
    rng = random.Random(2)
    source = source_dir(tmp_path)
    good = wikitext(rng, ["Good"])
    bad_utf8 = b" = Broken = \n \n caf\xe9 \xff\xfe text . \n \n"
    junk = " = Junk = \n \n" + "".join(chr(c) for c in range(1, 9)) * 300 + "\n \n"
    (source / "wiki.train.raw").write_bytes(good.encode() + bad_utf8 + junk.encode())
    (source / "wiki.test.raw").write_text("")  # empty split
    manifests = prep_wikitext(source, "train:300", tmp_path / "out")
    assert set(manifests) == {"train"}
    m = manifests["train"]
    assert m["documents"] == 1 and m["non_utf8_documents"] == 1 and m["dropped"]["binary"] == 1
    with pytest.raises(PrepError, match="holds none of wiki.train.raw"):
        prep_wikitext(tmp_path / "out", "train:9", tmp_path / "o2")
    with pytest.raises(PrepError, match="no such folder"):
        prep_wikitext(tmp_path / "missing", "train:9", tmp_path / "o3")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "wiki.valid.raw").write_text(" \n \n")
    with pytest.raises(PrepError, match="nothing usable"):
        prep_wikitext(empty, tmp_path / "out/tokenizer.json", tmp_path / "o4")


# -- FineWeb-style web text ------------------------------------------------------------------


@pytest.fixture(scope="module")
def web_prep(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    rng = random.Random(3)
    source = source_dir(root)
    good, designed = web_documents(rng)
    with open(source / "a.jsonl", "wb") as f:
        for record in good + list(designed.values()):
            f.write(json.dumps(record).encode() + b"\n")
        f.write(b'{"text": "caf\xe9 with a broken byte"}\n')  # not UTF-8
        f.write(b'{"text": "unterminated\n')  # not JSON
    more = [{"text": article(rng, 3)} for _ in range(6)]
    with gzip.open(source / "b.jsonl.gz", "wb") as f:
        for record in more + [{"text": "word " * (11 * 2**20 // 5)}]:  # a single ~11 MB doc
            f.write(json.dumps(record).encode() + b"\n")
    table = [{"text": article(rng, 3), "id": str(i)} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(table), source / "c.parquet")
    (source / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:40])  # corrupt
    from data_prep.common import train_bpe

    tokenizer = train_bpe([r["text"] for r in good + more + table], 300, root / "tok.json")
    out = root / "out"
    manifest = prep_web(source, tokenizer, out)
    files = {"a.jsonl": good + list(designed.values()), "b.jsonl.gz": more, "c.parquet": table}
    return out, manifest, files, tokenizer, source


def expected_filtering(documents):
    """Kept documents (as the filters leave them: C4's also drops lines) and drops per step, by
    applying the same filters in this process."""
    from datatrove.data import Document

    from data_prep.common import BadDocumentGuard
    from data_prep.fineweb import quality_filters

    steps = [BadDocumentGuard(), *quality_filters(None, 0.65)]
    kept, dropped = [], {}
    for i, record in enumerate(documents):
        doc = Document(text=record["text"], id=str(i))
        for step in steps:
            result = step.filter(doc)
            if not (result[0] if isinstance(result, tuple) else result):
                dropped[step.name] = dropped.get(step.name, 0) + 1
                break
        else:
            kept.append(doc.text)
    return kept, dropped


def test_web_shards_hold_exactly_the_kept_documents_tokens(web_prep):
    import webdataset as wds

    out, manifest, files, tokenizer, _ = web_prep
    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    size = 65
    for task, name in enumerate(sorted(files)):
        kept, _ = expected_filtering(files[name])
        stream = np.concatenate([np.asarray(tok.encode(t).ids + [eos]) for t in kept])
        stream = stream[: len(stream) // size * size]
        shards = sorted((out / "shards").glob(f"{task:05d}-*.tar"))
        got = [
            s["tokens.npy"]
            for s in wds.WebDataset([str(p) for p in shards], shardshuffle=False).decode()
        ]
        assert np.array_equal(np.concatenate(got), stream), name
        assert all(len(g) == size for g in got)


def test_web_filter_counts_match_the_filters_applied_directly(web_prep):
    out, manifest, files, _, _ = web_prep
    everything = [r for name in sorted(files) for r in files[name]]
    kept, dropped = expected_filtering(everything)
    # the ~11 MB document only reaches the filters in the pipeline (it is 1 of b.jsonl.gz)
    dropped["🛡 bad-document guard"] = dropped.get("🛡 bad-document guard", 0) + 1
    got = {name: d["total"] for name, d in manifest["dropped"].items() if d["total"]}
    assert got == dropped
    assert manifest["documents_kept"] == len(kept)
    guard = manifest["dropped"]["🛡 bad-document guard"]
    assert (guard["empty"], guard["binary"], guard["too_long"]) == (1, 1, 1)
    assert manifest["dropped"]["🥇 Gopher Quality"]["gopher_enough_stop_words"] == 1
    assert manifest["dropped"]["👯 Gopher Repetition"]["dup_line_frac"] == 1
    assert manifest["dropped"]["⛰ C4 Quality"]["curly_bracket"] == 1
    assert manifest["documents_read"] == len(everything) + 1
    assert (
        manifest["unreadable_files"],
        manifest["non_utf8_records"],
        manifest["invalid_json_records"],
    ) == (1, 1, 1)
    assert manifest["sequences"] == sum(manifest["shards"].values())


def test_web_nothing_usable_is_one_clear_error(tmp_path, web_prep):
    _, _, _, tokenizer, _ = web_prep
    source = source_dir(tmp_path)
    (source / "x.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(PrepError, match="nothing usable"):
        prep_web(source, tokenizer, tmp_path / "out")
    (tmp_path / "void").mkdir()
    with pytest.raises(PrepError, match="holds no .parquet, .jsonl"):
        prep_web(tmp_path / "void", tokenizer, tmp_path / "out2")


# -- loaders ---------------------------------------------------------------------------------


def epoch_of(data, rank: int, size: int) -> list[str]:
    """This rank's shards in the first epoch."""
    order = np.random.default_rng([data.seed, 0]).permutation(len(data.train_shards))
    return [data.train_shards[i] for i in order][rank::size]


def test_shard_stream_dp_ranks_are_disjoint_and_cover_an_epoch(web_prep):
    from megaloop.data.shards import ShardData

    out, _, _, _, _ = web_prep
    data = ShardData(str(out), 64, seed=0, valid_shards=1, resampled=False, tokenizer=None)
    seen = []
    for rank in range(2):
        shards = epoch_of(data, rank, 2)
        got = take(data.batches(2, 1, dp_rank=rank, dp_size=2), sum(data.counts[s] for s in shards))
        assert [bytes(r) for r in got] == [bytes(r) for r in read_all(out, shards)]
        seen.append({bytes(r) for r in got})
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {bytes(r) for r in read_all(out, data.train_shards)}


def test_shard_stream_resumes_at_the_next_shard_boundary(web_prep):
    from megaloop.data.shards import ShardData

    out, _, _, _, _ = web_prep
    data = ShardData(str(out), 64, seed=0, valid_shards=1, resampled=False, tokenizer=None)
    shards = epoch_of(data, 0, 1)
    first = data.counts[shards[0]]
    full = take(data.batches(1, 1), first + data.counts[shards[1]])
    resumed = take(data.batches(1, 1, consumed_samples=first - 3), 5)  # mid-shard 0
    assert [bytes(r) for r in resumed] == [bytes(r) for r in full[first : first + 5]]
    exact = take(data.batches(1, 1, consumed_samples=first), 5)  # on the boundary
    assert [bytes(r) for r in exact] == [bytes(r) for r in full[first : first + 5]]


def test_shard_stream_resampled_is_endless_and_reproducible(web_prep):
    from megaloop.data.shards import ShardData

    out, _, _, _, _ = web_prep
    data = ShardData(str(out), 64, seed=0, valid_shards=1, resampled=True, tokenizer=None)
    total = sum(data.counts[s] for s in data.train_shards)
    a = take(data.batches(1, 1), 3 * total)
    b = take(data.batches(1, 1), 3 * total)
    assert len(a) == 3 * total and all(np.array_equal(x, y) for x, y in zip(a, b))


def read_all(out: Path, names):
    import webdataset as wds

    return [
        s["tokens.npy"].astype(np.int64)
        for s in wds.WebDataset(
            [str(out / "shards" / n) for n in names], shardshuffle=False
        ).decode()
    ]


def take(batches, n: int) -> list:
    rows = []
    while len(rows) < n:
        rows += [row.numpy() for mb in batches.next_step() for row in mb]
    return rows[:n]


def test_indexed_dp_ranks_disjoint_resume_exact_and_epochs(wikitext_prep):
    from megaloop.data.indexed import IndexedData, samples_for_epochs
    from megaloop.data.tokenizer import load_tokenizer

    _, out, _ = wikitext_prep
    tokenizer = load_tokenizer(str(out / "tokenizer.json"))
    samples = samples_for_epochs(str(out / "train"), 32, epochs=4)
    data = IndexedData(
        str(out / "train"),
        str(out / "valid"),
        32,
        seed=5,
        num_train_samples=samples,
        tokenizer=tokenizer,
    )
    # exactly four passes: every document appears four times in GPTDataset's document order
    counts = np.bincount(data.train.document_index)
    assert (counts == 4).all() and len(data.train) == samples
    gbs = 8
    steps = samples // gbs
    per_rank = [[], []]
    for rank in range(2):
        batches = data.batches(gbs, 2, dp_rank=rank, dp_size=2)
        for _ in range(steps):
            per_rank[rank] += [row for mb in batches.next_step() for row in mb]
    assert len(per_rank[0]) == len(per_rank[1]) == steps * gbs // 2
    union = torch_rows(per_rank[0]) + torch_rows(per_rank[1])  # disjoint and complete:
    whole = [tuple(data.sample(i).tolist()) for i in range(steps * gbs)]
    assert sorted(union) == sorted(whole)
    # resume after N samples: the next step is the one an uninterrupted run takes
    straight = data.batches(gbs, 2)
    for _ in range(3):
        straight.next_step()
    resumed = data.batches(gbs, 2, consumed_samples=3 * gbs)
    assert all((a == b).all() for a, b in zip(straight.next_step(), resumed.next_step()))


def torch_rows(rows) -> list:
    return [tuple(r.tolist()) for r in rows]


def test_train_on_prepared_data_indexed_epochs_and_webdataset(wikitext_prep, web_prep, tmp_path):
    from megaloop import experiment
    from megaloop.data.indexed import samples_for_epochs

    _, out, _ = wikitext_prep
    common = [
        "model.vocab_size=512",
        "model.max_seq_len=64",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "wandb.mode=disabled",
        "train.log_every=1",
    ]
    cfg = experiment.load(
        TINY,
        [
            *common,
            "data.kind=indexed",
            f"data.path={out}/train",
            f"data.valid_path={out}/valid",
            "data.epochs=2",
            "train.steps=null",
            "data.seq_len=32",
            f"train.dir={tmp_path / 'wt'}",
        ],
    )
    experiment.build_trainer(cfg).fit()
    metrics = read_metrics(tmp_path / "wt")
    steps = samples_for_epochs(str(out / "train"), 32, 2) // 8
    assert metrics["config"]["train"]["steps"] == steps == len(metrics["steps"])
    web_out = web_prep[0]
    cfg = experiment.load(
        TINY,
        [
            *common,
            "data.kind=webdataset",
            f"data.path={web_out}",
            "data.seq_len=64",
            "train.steps=3",
            "train.eval_batches=all",
            f"train.dir={tmp_path / 'web'}",
        ],
    )
    trainer = experiment.build_trainer(cfg)
    result = trainer.fit()
    assert len(result["ce"]) == 4
    assert result["valid_windows"] == trainer.dataset.valid_windows // 4 * 4 > 0


def test_prep_cli_reports_bad_sources_in_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megaloop",
            "prep",
            "wikitext103",
            "--source",
            str(tmp_path / "missing"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("megaloop prep: error: --source")


def test_web_rerun_redoes_only_the_unfinished_task(web_prep, tmp_path):
    import shutil

    source_out, manifest, _, tokenizer, source = web_prep
    out = tmp_path / "out"
    shutil.copytree(source_out, out)
    (out / "manifest.json").unlink()
    (out / "logs/completions/00001").unlink()  # task 1 "died"
    for shard in (out / "shards").glob("00001-*.tar"):
        shard.unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("0000[02]-*.tar")}
    again = prep_web(source, tokenizer, out)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("0000[02]-*.tar")} == kept
    assert again["shards"] == manifest["shards"] and again["sequences"] == manifest["sequences"]


def test_prepared_datas_tokenizer_is_found_from_any_directory_or_named_missing(
    tmp_path, monkeypatch
):
    """A manifest whose tokenizer path was recorded relative to another directory (preparations
    before this one) still finds the file beside the data by its sha256; gone, it is an error
    naming the fix, not the byte tokenizer in its place (an export or a measurement would read
    the text with another vocabulary)."""
    import hashlib

    from megaloop.config import DataError
    from megaloop.data import IndexedConfig

    data = tmp_path / "work/data"
    data.mkdir(parents=True)
    tokenizer = data / "tokenizer.json"
    tokenizer.write_text('{"a": "tokenizer"}')
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    recorded = {"tokenizer": "data/tokenizer.json", "tokenizer_sha256": digest}
    (data / "train.manifest.json").write_text(json.dumps(recorded))
    cfg = IndexedConfig(path=str(data / "train"), valid_path=str(data / "train"))
    monkeypatch.chdir(tmp_path / "work")  # where it was prepared
    assert Path(cfg.tokenizer_spec()).resolve() == tokenizer
    monkeypatch.chdir(tmp_path)
    assert cfg.tokenizer_spec() == str(tokenizer)
    tokenizer.write_text('{"another": "tokenizer"}')
    with pytest.raises(DataError, match=r"set data.tokenizer=PATH"):
        cfg.tokenizer_spec()
    given = tmp_path / "given.json"
    given.write_text("{}")
    cfg = IndexedConfig(
        path=str(data / "train"), valid_path=str(data / "train"), tokenizer=str(given)
    )
    assert cfg.tokenizer_spec() == str(given)
