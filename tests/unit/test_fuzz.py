"""Fuzzed input (issue 15): config files and `key=value` overrides, and every reader of data
files, fed wrong types, out-of-range numbers, typos, contradictory layouts, random bytes,
truncated, empty and non-UTF-8 files. Each case asserts ONE error of megaloop's own type
(ConfigError, DataError, PrepError, EvalError) whose message names the offending key, file or
record, and that nothing is left looking complete. Reproducible (derandomized, no database)."""

import contextlib
import dataclasses
import gzip
import io
import json
import random
import typing
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megaloop import experiment
from megaloop.config import Config, ConfigError, DataError
from megaloop.data import KINDS, DataConfig
from megaloop.experiment import ExperimentConfig
from support import TINY


def fuzz(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def config_keys(cls=ExperimentConfig, prefix: str = "") -> dict:
    """Every dotted key of the config tree and its type."""
    keys = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if hint is DataConfig:  # one section class per data.kind: every kind's keys
            for kind in KINDS.values():
                keys.update(config_keys(kind, f"{prefix}{f.name}."))
        elif isinstance(hint, type) and issubclass(hint, Config):
            keys.update(config_keys(hint, f"{prefix}{f.name}."))
        else:
            keys[prefix + f.name] = hint
    return keys


KEYS = config_keys()
SECTIONS = sorted({k.split(".")[0] for k in KEYS})


def names(message: str, key: str) -> bool:
    """The message names `key`: the full dotted key, or its last part next to its section's
    (a cross-field check names the field it is checked against, e.g. 'divide hidden_size=6')."""
    return key in message or key.rsplit(".", 1)[-1] in message


def load_error(overrides, path=TINY) -> str | None:
    """None when the config loads; the message when it raises ConfigError; any other exception
    type propagates and fails the test."""
    try:
        experiment.load(path, overrides)
    except ConfigError as e:
        return str(e)
    return None


# -- overrides -------------------------------------------------------------------------------

scalars = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.sampled_from(["all", "bytes", "norm", "deepspeed", "1e-3"]),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.dictionaries(st.text(max_size=4), scalars, max_size=2),
)


def render(value) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6)
        .strip()
        .removesuffix("\n...")
        .removesuffix("...")
        .strip()
    )


raw_values = st.one_of(
    values.map(render),
    st.text(max_size=12),
    st.sampled_from(
        [
            "[",
            "{",
            "]",
            "!!python/object:os.system",
            "*x",
            "&a",
            "%TAG",
            ": :",
            "'",
            '"',
            "{a: [}",
            "\t",
            "1e999",
            "-.inf",
            ".nan",
            "9" * 5000,
        ]
    ),
)


@fuzz(250)
@given(st.sampled_from(sorted(KEYS)), raw_values)
def test_any_value_for_any_key_loads_or_names_the_key(key, raw):
    message = load_error([f"{key}={raw}"])
    if message is not None:
        assert names(message, key), (key, raw, message)


def typo(key: str, data) -> str:
    parts = key.split(".")
    i = data.draw(st.integers(0, len(parts) - 1))
    word = parts[i]
    op = data.draw(st.sampled_from(["insert", "delete", "swap", "replace", "case"]))
    j = data.draw(st.integers(0, max(len(word) - 1, 0)))
    c = data.draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_0"))
    word = {
        "insert": word[:j] + c + word[j:],
        "delete": word[:j] + word[j + 1 :],
        "swap": word[:j] + word[j + 1 : j + 2] + word[j : j + 1] + word[j + 2 :],
        "replace": word[:j] + c + word[j + 1 :],
        "case": word.upper(),
    }[op]
    parts[i] = word
    return ".".join(parts)


def offending_prefix(key: str) -> str:
    """The dotted prefix of `key` up to the first part that is no field (or a scalar field
    given sub-keys): what the unknown-key error must name."""
    parts = key.split(".")
    for n in range(1, len(parts) + 1):
        prefix = ".".join(parts[:n])
        if prefix not in KEYS and not any(k.startswith(prefix + ".") for k in KEYS):
            return prefix
        if prefix in KEYS and n < len(parts):
            return prefix
    raise AssertionError(key)


@fuzz(150)
@given(st.sampled_from(sorted(KEYS)), st.data())
def test_typos_in_keys_name_the_unknown_key(key, data):
    bad = typo(key, data)
    assume(bad not in KEYS and bad)
    message = load_error([f"{bad}=1"])
    if bad.split(".")[-1] == "" or "" in bad.split("."):
        assert message and "key=value" in message
        return
    assert message is not None, bad
    expected = offending_prefix(bad)
    assert f"'{expected}'" in message, (bad, message)


MALFORMED = [
    "train.steps",
    "=5",
    "model..hidden_size=4",
    ".model=1",
    "model.=1",
    "",
    "=",
    "model.hidden_size:64",
]


@fuzz(60)
@given(st.one_of(st.sampled_from(MALFORMED), st.text(max_size=15).filter(lambda t: "=" not in t)))
def test_malformed_overrides_name_the_override(text):
    message = load_error([text])
    assert message is not None and repr(text) in message and "key=value" in message, message


# -- YAML files ------------------------------------------------------------------------------

yaml_keys = st.one_of(
    st.sampled_from(SECTIONS + ["defaults", "modle", "train_steps"]),
    st.sampled_from(sorted({k.split(".")[-1] for k in KEYS})),
    st.text(max_size=5),
    st.integers(-3, 3),
    st.none(),
    st.booleans(),
)
trees = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(yaml_keys, children, max_size=4)
    ),
    max_leaves=12,
)


def path_in(data, dotted: str) -> bool:
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or not any(str(k) == part for k in node):
            return False
        node = next(v for k, v in node.items() if str(k) == part)
    return True


def written_keys(data) -> set[str]:
    if isinstance(data, dict):
        return {str(k) for k in data} | {k for v in data.values() for k in written_keys(v)}
    return set()


def names_a_written_key(message: str, data) -> bool:
    """The message names a key of the config tree, or one the file holds."""
    if not message.startswith("config key '"):
        return False
    named = message[len("config key '") :]
    ends = [i for i in range(len(named)) if named.startswith("': ", i)]
    return any(  # a written key may hold a quote, even "': ", itself: try every end
        path_in(data, key.split("[")[0])
        or key in KEYS
        or any(key.endswith(k) for k in written_keys(data))
        for key in (named[:i] for i in ends)
    )


@fuzz(150)
@given(st.one_of(trees, st.dictionaries(yaml_keys, trees, max_size=4)))
def test_random_yaml_structures_name_the_file_or_the_key(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("yaml") / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data))
    message = load_error([], path)
    if message is not None:
        assert str(path) in message or names_a_written_key(message, data), (data, message)


@fuzz(80)
@given(st.binary(max_size=64))
def test_random_bytes_as_a_config_file(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("yaml") / "bytes.yaml"
    path.write_bytes(raw)
    message = load_error([], path)
    if message is not None:
        parsed = yaml.safe_load(raw.decode("utf-8")) if str(path) not in message else None
        assert str(path) in message or names_a_written_key(message, parsed), (raw, message)


def test_bad_defaults_name_the_file(tmp_path):
    cases = {
        "scalar.yaml": ("defaults: 5\n", ["scalar.yaml", "'defaults' must be a list"]),
        "nested.yaml": ("defaults: [[a.yaml]]\n", ["nested.yaml", "'defaults' must be a list"]),
        "dict.yaml": ("defaults: [{model: 1}]\n", ["dict.yaml", "YAML file names"]),
        "missing.yaml": ("defaults: [nowhere.yaml]\n", ["nowhere.yaml", "not found"]),
        "self.yaml": ("defaults: [self.yaml]\n", ["self.yaml", "includes itself"]),
        "binary.yaml": ("defaults: [junk.yaml]\n", ["junk.yaml", "not UTF-8", "byte 2"]),
        "badinner.yaml": ("defaults: [broken.yaml]\n", ["broken.yaml", "not valid YAML"]),
        "list.yaml": ("- 1\n- 2\n", ["list.yaml", "mapping"]),
    }
    (tmp_path / "junk.yaml").write_bytes(b"a:\xff\xfe\x00")
    (tmp_path / "broken.yaml").write_text("model: {hidden_size: [\n")
    for name, (text, words) in cases.items():
        (tmp_path / name).write_text(text)
        message = load_error([], tmp_path / name)
        assert message and all(w in message for w in words), (name, message)
    assert "config file" in load_error([], tmp_path / "no_such.yaml")


# -- contradictory layouts and engines -------------------------------------------------------


@fuzz(200)
@given(
    engine=st.sampled_from(["megatron", "deepspeed"]),
    tp=st.integers(0, 8),
    pp=st.integers(0, 8),
    heads=st.sampled_from([1, 2, 3, 4, 8]),
    layers=st.integers(1, 8),
    loops=st.integers(-1, 4),
    mbs=st.integers(0, 4),
    gbs=st.integers(1, 16),
    evals=st.sampled_from([1, 2, 3, 4, 6, 8, "all"]),
    stage=st.integers(-1, 4),
    kind=st.sampled_from(["per_loop", "exit_weighted"]),
)
def test_contradictory_layouts_fail_at_load_naming_a_key(
    engine, tp, pp, heads, layers, loops, mbs, gbs, evals, stage, kind
):
    overrides = {
        "engine": engine,
        "parallel.tp": tp,
        "parallel.pp": pp,
        "model.num_heads": heads,
        "model.hidden_size": 96,
        "model.num_layers": layers,
        "model.num_loops": loops,
        "train.micro_batch_size": mbs,
        "train.global_batch_size": gbs,
        "train.eval_batches": evals,
        "deepspeed.zero_stage": stage,
        "objective.kind": kind,
    }
    message = load_error([f"{k}={v}" for k, v in overrides.items()])
    if message is not None:
        assert any(names(message, k) for k in overrides), (overrides, message)
        return
    from megaloop.parallel.layout import data_parallel_size

    cfg = experiment.load(TINY, [f"{k}={v}" for k, v in overrides.items()])
    # what loads is runnable: some world (TP x PP x 1) takes this layout
    assert data_parallel_size(cfg, tp * pp) == 1
    assert loops >= 1 and mbs >= 1 and gbs % mbs == 0 and 96 % heads == 0
    assert engine == "megatron" or (pp == 1 and stage in (0, 1, 2, 3))
    assert kind == "per_loop"  # exit_weighted needs model.exit_gate=true


# -- through the CLI -------------------------------------------------------------------------


def cli(argv) -> tuple[int, str, str]:
    from megaloop.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


CLI_BAD = [
    (["model.hidden_size=["], "model.hidden_size"),
    (["optim.lr=.nan"], "optim.lr"),
    (["train.steps=1e999"], "train.steps"),
    (["parallel.tp=3"], "parallel.tp"),
    (["parallel.pp=3"], "parallel.pp"),
    (["model.hidden_size=" + "9" * 30], "hidden_size"),
    (["modle.hidden_size=64"], "modle"),
    (["model.readout=nrom"], "model.readout"),
    (["model.num_loops=0"], "model.num_loops"),
    (["train.global_batch_size=7"], "train.global_batch_size"),
    (["engine=deepspeed", "parallel.pp=2"], "parallel.pp"),
    (["model={1: 2}"], "model.1"),
    (["train.steps"], "train.steps"),
    (["model=!!binary AAAA"], "model"),
]


@fuzz(40)
@given(st.sampled_from(CLI_BAD), st.sampled_from(["params", "plan"]))
def test_cli_one_error_line_naming_the_key(case, command):
    overrides, key = case
    extra = ["--gpus", "2", "--gpu-mem", "80"] if command == "plan" else []
    code, out, err = cli([command, TINY, *overrides, *extra])
    assert code == 2 and "Traceback" not in err and out == "", (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("megaloop: error:") and key in lines[0], err


def test_cli_bad_config_files(tmp_path):
    (tmp_path / "bytes.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (tmp_path / "keys.yaml").write_text("1: 2\n")
    for name, words in (
        ("bytes.yaml", ["bytes.yaml", "not UTF-8"]),
        ("keys.yaml", ["'1'"]),
        ("absent.yaml", ["absent.yaml", "not found"]),
    ):
        code, out, err = cli(["params", str(tmp_path / name)])
        assert code == 2 and "Traceback" not in err and err.count("megaloop: error:") == 1
        assert all(w in err for w in words), err


# -- data: text files ------------------------------------------------------------------------


def build_text(path: Path, **options):
    from megaloop.data import TextConfig

    return TextConfig(path=str(path), seq_len=8, **options).build(seed=0)


@fuzz(120)
@given(
    st.one_of(
        st.binary(max_size=80),
        st.text(max_size=60).map(str.encode),
        st.binary(max_size=40).map(lambda b: b"long enough ascii text " * 3 + b),
    )
)
def test_text_files_of_random_bytes(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_bytes(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        with pytest.raises(DataError) as err:
            build_text(path)
        assert f"data.path={path}" in str(err.value) and f"byte {e.start}" in str(err.value)
        return
    train = int(len(text.encode()) * 0.95)
    if train >= 9 and len(text.encode()) - train >= 9:
        build_text(path)
    else:
        with pytest.raises(DataError, match="fewer than data.seq_len") as err:
            build_text(path)
        assert f"data.path={path}" in str(err.value)


def test_text_empty_and_non_utf8_validation_files(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("some training text, long enough. " * 4)
    for name, raw, words in (
        ("empty.txt", b"", ["has 0 tokens"]),
        ("latin1.txt", "caf\u00e9 ".encode("latin-1") * 9, ["not UTF-8", "byte 3 (line 1)"]),
        ("utf16.txt", "text".encode("utf-16"), ["not UTF-8", "byte 0"]),
    ):
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(DataError) as err:
            build_text(train, valid_path=str(tmp_path / name))
        assert f"data.valid_path={tmp_path / name}" in str(err.value)
        assert all(w in str(err.value) for w in words), str(err.value)


# -- data: tokenizer files -------------------------------------------------------------------


def tokenizer_json() -> bytes:
    from megaloop.data.tokenizer import byte_level_tokenizer

    return byte_level_tokenizer().to_str().encode()


@fuzz(40)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.integers(0, 2000).map(lambda n: tokenizer_json()[:n]),
        st.just(b"{}"),
        st.just(b"[1, 2]"),
    )
)
def test_tokenizer_files_random_or_truncated(tmp_path_factory, raw):
    from megaloop.data.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_bytes(raw)
    with pytest.raises(DataError) as err:
        load_tokenizer(str(path))
    assert f"tokenizer {path}" in str(err.value)


# -- data: megatron-core indexed datasets ----------------------------------------------------


def write_indexed(prefix: Path, docs, dtype=np.uint16) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=np.int64), [len(doc)])
    builder.finalize(f"{prefix}.idx")


DOCS = [list(range(1, 40)), list(range(50, 90)), [7] * 25]


@fuzz(150)
@given(
    part=st.sampled_from(["idx", "bin"]),
    damage=st.sampled_from(["truncate", "random", "empty", "flip", "extend"]),
    data=st.data(),
)
def test_damaged_indexed_datasets_name_the_file(tmp_path_factory, part, damage, data):
    from megaloop.data.indexed import TokenStream

    prefix = tmp_path_factory.mktemp("indexed") / "train"
    write_indexed(prefix, DOCS)
    path = Path(f"{prefix}.{part}")
    raw = path.read_bytes()
    if damage == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif damage == "random":
        raw = data.draw(st.binary(min_size=1, max_size=len(raw) + 8))
    elif damage == "empty":
        raw = b""
    elif damage == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1 :]
    else:
        raw = raw + data.draw(st.binary(min_size=1, max_size=8))
    path.write_bytes(raw)
    try:
        stream = TokenStream(str(prefix))
    except DataError as e:
        assert str(prefix) in str(e), str(e)
        return
    # what is accepted is a consistent pair: a flipped token byte, or a header flip that
    # megatron-core does not read (e.g. the document table)
    assert stream.num_tokens == sum(map(len, DOCS))
    assert len(stream.read(0, stream.num_tokens)) == stream.num_tokens


def test_indexed_tokens_outside_the_vocabulary_and_missing_files(tmp_path):
    from megaloop.data import IndexedConfig
    from megaloop.data.indexed import IndexedData, check_indexed
    from megaloop.data.tokenizer import ByteTokenizer

    write_indexed(tmp_path / "train", [*DOCS, [300, 1, 2]])
    with pytest.raises(DataError, match="token id 300, outside model.vocab_size=256") as err:
        check_indexed(str(tmp_path / "train"), 256)  # as experiment.build_trainer does
    assert str(tmp_path / "train.bin") in str(err.value)
    write_indexed(tmp_path / "empty", [])
    with pytest.raises(DataError, match="holds no documents"):
        IndexedData(str(tmp_path / "empty"), None, 8, 0, 4, ByteTokenizer())
    (tmp_path / "train.manifest.json").write_bytes(b"\xff{")
    with pytest.raises(DataError, match="train.manifest.json is not a JSON manifest"):
        IndexedConfig(path=str(tmp_path / "train")).build(0)
    with pytest.raises(ConfigError, match="'data.path'.*no PREFIX.bin"):
        IndexedConfig(path=str(tmp_path / "nothing")).build(0)


# -- data: webdataset folders (manifest; the shards' own reader is megaloop/data/shards.py) --


def test_webdataset_manifests(tmp_path):
    from megaloop.data import WebDatasetConfig

    def check(manifest, words, **options):
        folder = tmp_path / f"w{len(list(tmp_path.iterdir()))}"
        (folder / "shards").mkdir(parents=True)
        (folder / "shards" / "00000-000000.tar").write_bytes(b"")
        if isinstance(manifest, bytes):
            (folder / "manifest.json").write_bytes(manifest)
        else:
            (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ConfigError) as err:
            WebDatasetConfig(path=str(folder), **options).build(0)
        assert all(w in str(err.value) for w in words), str(err.value)
        assert "manifest.json" in str(err.value) or f"data.path={folder}" in str(err.value)

    check(b"\x00\x01garbage", ["not a JSON manifest"])
    check(b'{"seq_len": 8, "shards": {', ["not a JSON manifest"])  # truncated
    check([1, 2], ["JSON list"])
    check({"seq_len": "8", "shards": {}}, ["lacks `seq_len`"])
    check(
        {"seq_len": 8, "shards": {"00000-000000.tar": 4, "00001-000000.tar": 4}},
        ["lists shard 00001-000000.tar"],
        seq_len=8,
    )
    check(
        {"seq_len": 16, "shards": {"00000-000000.tar": 4}},
        ["data.seq_len", "--seq-len 8"],
        seq_len=8,
    )
    check(
        {"seq_len": 8, "shards": {"00000-000000.tar": 4}},
        ["data.valid_shards", "1 shard"],
        seq_len=8,
    )


# -- data preparation (datatrove readers) ----------------------------------------------------


@pytest.fixture(scope="module")
def prep_tokenizer(tmp_path_factory):
    from data_prep.common import train_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(["the river and the city were quiet in the morning"] * 20, 300, path)


def bad_web_files(folder: Path) -> dict[str, str]:
    """Files of every broken kind; the words each one's message must hold."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    good = json.dumps({"text": "A record before the damage."}) + "\n"
    (folder / "random.jsonl").write_bytes(random.Random(0).randbytes(300))
    (folder / "truncated.jsonl").write_text(good * 3 + '{"text": "cut in the mid')
    (folder / "latin1.jsonl").write_bytes(
        good.encode() + '{"text": "caf\u00e9"}\n'.encode("latin-1")
    )
    (folder / "empty.jsonl").write_bytes(b"")
    (folder / "wrongtype.jsonl").write_text('{"text": 5}\n[1, 2]\n"just a string"\n')
    gz = gzip.compress((good * 50).encode())
    (folder / "truncated.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": ["a parquet record"] * 50}), buffer)
    (folder / "truncated.parquet").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (folder / "empty.parquet").write_bytes(b"")
    return {
        "random.jsonl": "record(s), the first at line",
        "truncated.jsonl": "skipped 1 invalid JSON record(s), the first at line 4",
        "latin1.jsonl": "skipped 1 non-UTF-8 record(s), the first at line 2",
        "wrongtype.jsonl": "skipped 2 invalid JSON record(s), the first at line 2",
        "truncated.jsonl.gz": "unreadable (EOFError",
        "truncated.parquet": "unreadable",
        "empty.parquet": "unreadable",
    }


def test_prep_web_broken_files_are_named_and_nothing_looks_complete(
    tmp_path, prep_tokenizer, capfd
):
    import data_prep
    from data_prep import FineWebConfig
    from data_prep.common import PrepError

    expected = bad_web_files(tmp_path / "source")
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("{}")  # a finished earlier run's mark
    with pytest.raises(PrepError, match="nothing usable"):
        data_prep.run(
            FineWebConfig(
                source=str(tmp_path / "source"),
                tokenizer=str(prep_tokenizer),
                out=str(out),
                seq_len=4096,
            )
        )
    printed = capfd.readouterr()
    lines = (printed.out + printed.err).splitlines()
    for name, words in expected.items():
        assert any(name in line and words in line for line in lines), (name, words)
    assert "Traceback" not in printed.out + printed.err
    assert not (out / "manifest.json").exists()


def test_prep_bad_tokenizer_files_are_one_prep_error(tmp_path, prep_tokenizer):
    from functools import partial

    import data_prep
    from data_prep import FineWebConfig, WikiTextConfig
    from data_prep.common import PrepError

    sources = {"wikitext103": tmp_path / "wt", "fineweb": tmp_path / "web"}
    recipes = {"wikitext103": WikiTextConfig, "fineweb": partial(FineWebConfig, seq_len=64)}
    for source in sources.values():
        source.mkdir()
    (sources["wikitext103"] / "wiki.train.raw").write_bytes(b"\x00\xff random \xfe bytes" * 10)
    (sources["fineweb"] / "a.jsonl").write_text('{"text": "a record"}\n')
    for i, raw in enumerate([b"", b"\xff\xfe", prep_tokenizer.read_bytes()[:100]]):
        bad = tmp_path / f"tok{i}.json"
        bad.write_bytes(raw)
        for corpus in ("wikitext103", "fineweb"):
            with pytest.raises(PrepError, match=f"--tokenizer {bad} is not a Hugging Face"):
                data_prep.run(
                    recipes[corpus](
                        source=str(sources[corpus]),
                        tokenizer=str(bad),
                        out=str(tmp_path / "out"),
                    )
                )


def test_prep_wikitext_random_bytes_is_one_error_and_no_manifest(tmp_path, prep_tokenizer):
    import data_prep
    from data_prep import WikiTextConfig
    from data_prep.common import PrepError

    source = tmp_path / "wt"
    source.mkdir()
    (source / "wiki.train.raw").write_bytes(random.Random(1).randbytes(3000))
    (source / "wiki.valid.raw").write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(PrepError, match="nothing usable"):
        data_prep.run(
            WikiTextConfig(source=str(source), tokenizer=str(prep_tokenizer), out=str(out))
        )
    assert not list(out.glob("*.manifest.json")) and not list(out.glob("train.*"))


# -- lm-eval: a continuation longer than the model's context ---------------------------------


def test_a_continuation_longer_than_the_context_names_the_task(export_dir):
    from lm_eval.api.instance import Instance

    from megaloop.evaluation.downstream import checked_lm
    from megaloop.evaluation.exported import EvalError, open_export

    export = open_export(export_dir)
    model = export.model("cpu", "float32", num_loops=2)
    lm = checked_lm(pretrained=model, tokenizer=export.tokenizer(), batch_size=2, device="cpu")
    assert lm.max_length == 256

    def request(task, doc, context, continuation):
        return Instance("loglikelihood", {}, (context, continuation), 0, (task, doc, 1))

    fits = [
        request("piqa", 0, "Goal: open a jar.", " Twist the lid."),
        request("piqa", 0, "x" * 1000, " A long context is cut from the left."),
    ]
    assert len(lm.loglikelihood(fits)) == 2
    long = [
        *fits,
        request("piqa", 7, "Goal: x", " " + "y" * 300),
        request("piqa", 9, "Goal: x", " " + "y" * 280),
        request("sciq", 3, "", "z" * 400),
    ]
    with pytest.raises(EvalError) as err:
        lm.loglikelihood(long)
    message = str(err.value)
    assert "task piqa: a continuation of 301 tokens (doc 7)" in message
    assert "task sciq: a continuation of 400 tokens (doc 3)" in message
    assert "max_seq_len=256" in message


@pytest.mark.parametrize("damage", ["empty", "random", "truncated", "zeros"])
def test_damaged_webdataset_shards_name_the_shard(tmp_path, damage):
    import webdataset as wds

    from megaloop.data import WebDatasetConfig

    (tmp_path / "shards").mkdir()
    for name in ("a.tar", "b.tar"):
        with wds.TarWriter(str(tmp_path / "shards" / name)) as sink:
            for i in range(4):
                sink.write({"__key__": f"{i:04d}", "tokens.npy": np.arange(9, dtype=np.uint16)})
    (tmp_path / "manifest.json").write_text(
        json.dumps({"seq_len": 8, "shards": {"a.tar": 4, "b.tar": 4}})
    )
    shard = tmp_path / "shards" / "b.tar"  # the held-out (validation) shard
    shard.write_bytes(
        {
            "empty": b"",
            "random": random.Random(0).randbytes(700),
            "truncated": shard.read_bytes()[:700],
            "zeros": bytes(1024),
        }[damage]
    )
    with pytest.raises(DataError) as err:
        WebDatasetConfig(path=str(tmp_path), seq_len=8).build(0)
    assert str(shard) in str(err.value)
