"""Local arrays go through the Store protocol: an array opened from a directory is read by key through a
FileStore (its reads counted by a CountingStore wrapped around it, like any store's), whose generations are
the files' identities; and the Store base class gives every store its bulk reads and declared capabilities."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec, ShardingCodec

import stoker
from stoker.errors import DecodeError, StorageError
from stoker.storage import ByteRange, CountingStore, FileStore, LocalStore, MemoryStore, ObjectStore, Store, ZipStore
from stoker.storage.local import identity


def _sharded(path, data):
    arr = zarr.create_array(str(path), shape=data.shape, chunks=(4, 4), dtype=data.dtype, fill_value=0,
                            compressors=None, serializer=ShardingCodec(chunk_shape=(2, 2), codecs=[BytesCodec()]))
    arr[...] = data
    return arr


def test_a_local_array_is_read_through_its_file_store(tmp_path):
    data = np.arange(64, dtype="uint16").reshape(8, 8)
    _sharded(tmp_path / "a.zarr", data)
    arr = stoker.open_array(str(tmp_path / "a.zarr"))
    assert isinstance(arr.kv, FileStore) and arr.kv.is_local and arr.kv.root == str(tmp_path / "a.zarr")
    loc = arr.locate((0, 1))
    assert loc.path == os.path.join(str(tmp_path / "a.zarr"), "c", "0", "0")  # a file, as the engine reads it
    assert arr.key_of(loc.path) == "c/0/0" and loc.ident == identity(os.stat(loc.path))
    arr.kv = CountingStore(arr.kv)
    np.testing.assert_array_equal(arr.read([(0, 8), (0, 8)]), data)
    # the indexes of the three shards not located yet, one call each, then one call for the 16 inner chunks:
    # every byte through the store
    counts = arr.kv.counters
    assert (counts.calls, counts.requests) == (4, 3 + 16) and counts.bytes > data.nbytes


def test_a_range_read_from_a_file_replaced_since_its_descriptor_was_cached_is_the_new_file(tmp_path):
    """A FileStore keeps shard descriptors open: a range read after the file was replaced by rename must read
    the file now at the path, with that file's identity as its generation, never the old file's bytes."""
    (tmp_path / "s").write_bytes(b"old-old-old-")
    store = FileStore(tmp_path, LocalStore())
    assert bytes(store.get_ranges([ByteRange("s", 4, 3)])[0]) == b"old"  # the descriptor is now cached
    (tmp_path / "t").write_bytes(b"new-new-new-")
    os.replace(tmp_path / "t", tmp_path / "s")
    _, (part,), _, (generation,) = store.get_many([], [ByteRange("s", 4, 3)], versions=True)
    assert bytes(part) == b"new" and generation == identity(os.stat(tmp_path / "s"))


def test_a_range_past_the_end_of_a_file_says_the_files_size(tmp_path):
    (tmp_path / "s").write_bytes(b"0123456789")
    with pytest.raises(StorageError) as caught:
        FileStore(tmp_path).get_ranges([ByteRange("s", 4, 64)])
    assert caught.value.context["value_size"] == 10


def test_a_shard_shorter_than_its_index_at_its_start_is_corrupt_data(tmp_path):
    arr = zarr.create_array(str(tmp_path / "a.zarr"), shape=(4, 4), chunks=(4, 4), dtype="uint8", fill_value=0,
                            compressors=None, serializer=ShardingCodec(chunk_shape=(2, 2), codecs=[BytesCodec()],
                                                                       index_location="start"))
    arr[...] = 1
    shard = tmp_path / "a.zarr" / "c" / "0" / "0"
    shard.write_bytes(shard.read_bytes()[:5])
    with pytest.raises(DecodeError, match="is truncated: 5 bytes"):
        stoker.open_array(str(tmp_path / "a.zarr")).read([(0, 4), (0, 4)])


class _Dict(Store):
    """A store of its own: only get and get_ranges; the bulk reads are the base class's."""

    uri = "dict://"
    supports_list = False

    def __init__(self, values):
        self.values = values

    def get(self, key):
        if key not in self.values:
            raise stoker.errors.NotFound(f"no {key}", uri=self.uri, key=key)
        return self.values[key]

    def get_ranges(self, requests):
        return [self.get(r.key)[r.start:r.start + r.length] for r in requests]


def test_a_store_gets_its_bulk_reads_and_capabilities_from_the_base_class():
    kv = _Dict({"a": b"abcdef"})
    assert kv.get_many(["a", "b"], [ByteRange("a", 1, 2)], versions=True) == (
        [b"abcdef", None], [b"bc"], [None, None], [None])
    out, generations = kv.get_each([ByteRange("a", 0, 1), ByteRange("b", 0, 1)], versions=True)
    assert out[0] == b"a" and isinstance(out[1], stoker.errors.NotFound) and generations == [None, None]
    assert (kv.is_local, kv.reports_versions, kv.starts_reads, kv.max_gap) == (False, False, False, 0)
    with pytest.raises(NotImplementedError, match="starts_reads"):
        kv.start_get_many([], [])


def test_every_store_declares_its_capabilities(tmp_path):
    import zipfile

    with zipfile.ZipFile(tmp_path / "z.zip", "w") as z:
        z.writestr("k", b"v")
    files, zipped, memory = FileStore(tmp_path), ZipStore(tmp_path / "z.zip"), MemoryStore({"k": b"v"})
    assert all(isinstance(s, Store) for s in (files, zipped, memory, CountingStore(files)))
    assert [s.is_local for s in (files, zipped, memory)] == [True, False, False]
    assert [s.starts_reads for s in (files, zipped, memory, CountingStore(files))] == [False] * 4
    assert ObjectStore.starts_reads and ObjectStore.reports_versions and not ObjectStore.is_local
    assert CountingStore(files).root == files.root and CountingStore(zipped).max_gap == zipped.max_gap
    zipped.close()
