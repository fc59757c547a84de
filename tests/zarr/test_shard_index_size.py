"""A shard's index size comes from metadata alone (16 bytes per inner chunk): one that would not fit the
shard index cache is refused when the array is opened, before any shard is read."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr

import stoker
from stoker.reader.array import index_size
from stoker.storage.cache import SizedLRU
from stoker.storage import LocalStore

pytestmark = pytest.mark.timeout(60)


def test_a_shard_index_larger_than_the_index_cache_is_refused_at_open(tmp_path):
    """8 Mi inner chunks per shard: a 128 MiB index, read (and decoded) whole for every chunk before."""
    uri = str(tmp_path / "huge.zarr")
    zarr.create_array(uri, shape=(4096, 4096), chunks=(1, 2), shards=(4096, 4096), dtype="uint8", fill_value=0)
    os.makedirs(os.path.join(uri, "c", "0"))
    with open(os.path.join(uri, "c", "0", "0"), "wb") as f:  # sparse: as large as its index claims
        f.truncate(4096 * 2048 * 16 + 4)
    store = LocalStore()
    with pytest.raises(stoker.UnsupportedFormat, match=r"8,388,608 inner chunks \(4096 x 2048\)") as info:
        stoker.open_array(uri, store=store).read(np.s_[0:1, 0:2])
    assert "re-shard" in str(info.value) and info.value.uri == uri and info.value.inner_chunks == 4096 * 2048
    assert store.counters.bytes_read < 1 << 16  # the metadata document only
    cfg = stoker.Config(batch_size=1, dtype="f32", host_buffer_bytes=64 << 20, device="cpu", pop_timeout_s=20.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, [(0, 1), (0, 2)])])
        with pytest.raises(stoker.UnsupportedFormat, match="re-shard"):
            p.pop()


def test_the_limit_is_the_index_cache_capacity(tmp_path):
    """With a 1 KiB index cache: 60 inner chunks per shard fit ((1024 - 64) / 16), 64 do not."""
    data = np.arange(16 * 16, dtype="uint16").reshape(16, 16)
    small = str(tmp_path / "small.zarr")
    zarr.create_array(small, shape=(16, 16), chunks=(1, 1), shards=(6, 10), dtype="uint16")[...] = data
    large = str(tmp_path / "large.zarr")
    zarr.create_array(large, shape=(16, 16), chunks=(1, 1), shards=(8, 8), dtype="uint16")[...] = data
    cache = SizedLRU(1 << 10, index_size)
    np.testing.assert_array_equal(stoker.open_array(small, index_cache=cache).read(np.s_[:, :]), data)
    with pytest.raises(stoker.UnsupportedFormat, match="at most 60 inner chunks per shard"):
        stoker.open_array(large, index_cache=cache)
