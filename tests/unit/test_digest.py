"""megaloop.digest: a file read in blocks hashes as its whole bytes do, with both algorithms the
records use (a checkpoint manifest written before the helper still verifies)."""

import hashlib

import pytest
import xxhash

from megaloop.digest import file_digest


def test_a_file_over_many_blocks_hashes_as_its_bytes(tmp_path):
    data = bytes(range(256)) * 5000 + b"tail"  # 1.28 MB: several of file_digest's blocks
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    assert file_digest(path) == hashlib.sha256(data).hexdigest()
    assert file_digest(path, "xxh64") == xxhash.xxh64(data).hexdigest()


def test_an_unknown_algorithm_is_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ValueError):
        file_digest(tmp_path / "f", "md6")
