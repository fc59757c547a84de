"""What a process remembers of its disk cache, and its own eviction: ``DiskCache.has`` remembers the markers it
found (or ``mark`` queued) for ``SEEN_S``; an eviction of this process, which may have unlinked them, forgets
them (but the markers still queued, written after it). So a marker evicted is looked for again: a new pipeline
asks no HEAD for keys whose entries are gone (their reads fetch, as a cold cache's do), a key kept again gets
its marker again, and every batch read after the eviction equals zarr-python's."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from zarr.codecs import ZstdCodec

import stoker
from stoker.storage import diskcache
from stoker.storage.diskcache import DiskCache, disk_cache, running_total, use_entry_writer

from store_fixtures import FAST_REMOTE, random_int_arrays, range_server_fixture, written_tree_fixture, zarr_values

pytestmark = pytest.mark.timeout(120)

T0 = 1_700_000_000
IDENT = "s3://bkt\nc/0/1\nkept"
SHAPE = (64, 48)
ARRAYS = {"plain": dict(chunks=(16, 16), dtype="int32", compressors=ZstdCodec(level=1))}
BOXES = [[(0, 20), (0, 20)], [(3, 23), (5, 25)], [(40, 60), (20, 40)], [(44, 64), (0, 20)]]

data = written_tree_fixture(random_int_arrays(ARRAYS, SHAPE))
http = range_server_fixture()


def test_a_marker_this_process_evicted_is_looked_for_again(tmp_path):
    cache = DiskCache(str(tmp_path / "c"), 64 << 10)
    assert cache.write_marker(IDENT) and cache.has(IDENT)  # found on disk: remembered for SEEN_S
    path = cache.path(IDENT)
    os.utime(path, (T0, T0))  # the least recently used: the first an eviction unlinks
    for i in range(40):  # 40 entries of a block each: over the bound, so this process evicts
        assert cache.write(f"entry {i}", b"e" * 3000)
    assert cache.evicted > 0 and not os.path.lexists(path)
    assert not cache.has(IDENT)  # before: still "there" for SEEN_S after its own eviction unlinked it
    cache.mark(IDENT)  # before: not queued (seen a moment ago), so the marker stayed missing
    assert cache.flush(10) and os.path.lexists(path)


def test_a_marker_queued_through_an_eviction_is_still_found(tmp_path):
    # the eviction that makes room for a batch forgets what has() found, not the batch's own queued markers:
    # they are on disk only once the batch is written, after the eviction
    bound = 1 << 20
    cache = DiskCache(str(tmp_path / "c"), bound)
    for i in range(8):
        assert cache.write(f"entry {i}", b"e" * 3000)
    assert cache.write("filler", b"f" * (bound - running_total(cache.root) - (40 << 10)))  # 40 KiB left
    at_write = []
    write = diskcache._entry_writer[0] or diskcache.write_entries

    def writer(items, tag, seed):
        at_write.append((len(items), cache.evicted, cache.has(IDENT)))
        return write(items, tag, seed)

    previous = use_entry_writer(writer)
    evicted = cache.evicted
    try:
        with cache._cond:  # both queued before the writer thread takes a batch: one batch, one eviction
            cache.put("big", b"b" * 30_000)
            cache.mark(IDENT)
        assert cache.flush(10)
    finally:
        use_entry_writer(previous)
    assert at_write == [(2, at_write[0][1], True)] and at_write[0][1] > evicted  # evicted, then still found
    assert cache.has(IDENT) and os.path.lexists(cache.path(IDENT))


def _config(url: str, folder) -> stoker.Config:
    return stoker.Config(batch_size=len(BOXES), dtype="native", n_compute_threads=2, pop_timeout_s=60,
                         storage_options={url + "/": dict(FAST_REMOTE)}, cache_dir=str(folder), cache_bytes=4 << 20,
                         prefetch_bytes=0)


def _read(url: str, folder, data: str) -> None:
    """A new pipeline's batch of the crops, checked against zarr-python's values."""
    with stoker.Pipeline(_config(url, folder)) as p:
        p.push([stoker.Sample(f"{url}/plain", box) for box in BOXES])
        with p.pop() as b:
            got = [t.numpy().copy() for t in torch.from_dlpack(b)]
    want = zarr_values(data, "plain")
    for crop, box in zip(got, BOXES):
        np.testing.assert_array_equal(crop, want[tuple(slice(*s) for s in box)])


def test_entries_this_process_evicted_are_fetched_with_no_head(http, data, tmp_path):
    folder = tmp_path / "cache"
    cache = disk_cache(str(folder), 4 << 20)  # the process's one for the folder: the pipelines' too
    asked = http.requests
    _read(http.url, folder, data)  # cold: GETs only, entries and markers kept
    cold = http.requests - asked
    assert cache.flush(30)
    _read(http.url, folder, data)  # a new pipeline: its markers found (remembered), a HEAD a key, hits
    assert cache.flush(30)
    kept = [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names if n != ".index"]
    assert any(os.path.getsize(p) == 0 for p in kept)  # markers among them
    for p in kept:
        os.utime(p, (T0, T0))  # older than what comes next
    assert cache.write("filler", b"f" * ((4 << 20) - (24 << 10)))  # this process evicts them all for it
    assert cache.evicted > 0 and not any(os.path.lexists(p) for p in kept)
    asked = http.requests
    _read(http.url, folder, data)  # every entry gone: fetched, with zarr-python's values
    # as the cold read asked: no HEAD for keys whose markers this process evicted (before: one a key, the
    # markers still remembered as found)
    assert http.requests - asked == cold


def test_a_long_lived_wrapper_marks_its_keys_again_after_this_process_evicted_them(http, data, tmp_path):
    # one wrapper reads on through this process's own eviction of its entries and markers: what it keeps
    # afresh is marked again, so another wrapper of the folder (another pipeline, rank, open_array) finds
    # it on disk. Before: the wrapper still remembered writing those markers and never wrote them again,
    # so the other read every key from the server
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.locate import Stores

    options = {**FAST_REMOTE, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 4 << 20}
    a = stoker.open_array(f"{http.url}/plain", options, stores=Stores())
    kv = a.kv
    while not isinstance(kv, CachingStore):
        kv = kv.store
    everything = (slice(0, SHAPE[0]), slice(0, SHAPE[1]))
    want = zarr_values(data, "plain")
    np.testing.assert_array_equal(a.read(everything), want)  # kept, markers written
    assert kv.cache.flush(30)
    kept = [os.path.join(d, n) for d, _, names in os.walk(kv.cache.root) for n in names if n != ".index"]
    for p in kept:
        os.utime(p, (T0, T0))
    assert kv.cache.write("filler", b"f" * ((4 << 20) - (24 << 10)))  # this process evicts them all
    assert kv.cache.evicted > 0 and not any(os.path.lexists(p) for p in kept)
    kv.forget()  # the same wrapper reads on (the next epoch, past the bound): fetched, kept again
    np.testing.assert_array_equal(a.read(everything), want)
    assert kv.cache.flush(30)
    other = stoker.open_array(f"{http.url}/plain", options, stores=Stores())  # a new wrapper of the folder
    asked = len(http.log)
    np.testing.assert_array_equal(other.read(everything), want)
    gets = [path for _, method, path in http.log[asked:] if method == "GET" and "/plain/c/" in path]
    assert gets == [], gets  # every chunk from disk (its HEAD only)
