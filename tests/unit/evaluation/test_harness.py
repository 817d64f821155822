"""The measurement harness (megaloop/evaluation/harness.py): every kind of data read as one token
stream, cut into windows."""

import numpy as np
import torch

from megaloop.evaluation import harness


def test_every_kind_of_data_gives_the_same_token_stream(tmp_path):
    """Text, .npy, an indexed prefix, a webdataset shard and a prep folder (its last shard)."""
    import webdataset as wds
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    stream = np.arange(1000) % 90 + 32  # printable ASCII: one byte token per character
    encode = lambda text: np.frombuffer(text.encode(), np.uint8).astype(np.int64)  # noqa: E731
    (tmp_path / "a.txt").write_text(bytes(stream.astype(np.uint8)).decode())
    np.save(tmp_path / "a.npy", stream)
    builder = IndexedDatasetBuilder(str(tmp_path / "valid.bin"), dtype=np.uint16)
    for doc in np.split(stream, [3, 400, 401]):
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(str(tmp_path / "valid.idx"))
    (tmp_path / "prep/shards").mkdir(parents=True)
    (tmp_path / "prep/manifest.json").write_text("{}")
    for shard, rows in enumerate((stream[:500], stream[500:])):
        with wds.TarWriter(str(tmp_path / f"prep/shards/00000-{shard:05d}.tar")) as sink:
            for i, row in enumerate(rows.reshape(-1, 100)):
                sink.write({"__key__": f"{i:05d}", "tokens.npy": row})
    for data, expected in (
        ("a.txt", stream),
        ("a.npy", stream),
        ("valid", stream),
        ("prep/shards/00000-00000.tar", stream[:500]),
        ("prep", stream[500:]),
    ):
        got = harness.read_tokens(tmp_path / data, encode)
        assert np.array_equal(got, expected), data
    windows = harness.windows(stream, 10, 3, start=2)
    assert windows.tolist() == [
        stream[20:31].tolist(),
        stream[30:41].tolist(),
        stream[40:51].tolist(),
    ]
