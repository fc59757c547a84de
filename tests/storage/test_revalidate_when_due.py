"""What ``CachingStore.revalidate`` asks of the store, counted on the loopback HTTP server's log: nothing for
objects whose generation is known and younger than half of ``cache_staleness_s`` (a pipeline asks it for the
chunks of every batch it plans: a second epoch within the bound asks the server nothing), a HEAD each once
past the bound, and a replaced object read new past the bound. A malformed key is still refused."""

from __future__ import annotations

import time

import pytest

import stoker
from stoker.errors import InvalidArgument
from stoker.storage import cachingstore
from stoker.storage.locate import Stores

from store_fixtures import FAST_REMOTE, random_int_arrays, range_server_fixture, read_tree, written_tree_fixture
from zarr.codecs import ZstdCodec

pytestmark = pytest.mark.timeout(120)

SHAPE = (32, 32)
ARRAYS = {"plain": dict(chunks=(16, 16), dtype="int32", compressors=ZstdCodec(level=1))}
KEYS = [f"plain/c/{i}/{j}" for i in range(2) for j in range(2)]

_write = random_int_arrays(ARRAYS, SHAPE)
data = written_tree_fixture(_write)
http = range_server_fixture()


def _store(http, tmp_path, staleness_s: float) -> cachingstore.CachingStore:
    options = {**FAST_REMOTE, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 16 << 20,
               "cache_staleness_s": staleness_s}
    kv = stoker.open_array(f"{http.url}/plain", options, stores=Stores()).kv
    while not isinstance(kv, cachingstore.CachingStore):
        kv = kv.store
    return kv


def _read(kv: cachingstore.CachingStore) -> list[bytes]:
    return [bytes(v) for v in kv.result_of(kv.start_get_many(KEYS, []))[0]]


def _asked(http, start: int, method: str) -> list[str]:
    return [path for _, m, path in http.log[start:] if m == method and "/c/" in path]


def test_keys_known_within_half_the_bound_ask_nothing(http, data, tmp_path):
    kv = _store(http, tmp_path, 600.0)
    assert _read(kv) == [read_tree(data)[k] for k in KEYS]  # generations learnt from the reads
    assert kv.cache.flush(30)
    start = len(http.log)
    before = time.monotonic()
    for _ in range(50):  # as a pipeline does, a batch at a time
        fresh = kv.revalidate(KEYS)
        assert sorted(fresh) == sorted(KEYS)
        assert all(until > before + 290 for until in fresh.values())  # learnt + 300 s (half the bound)
    assert http.log[start:] == []  # no HEAD, no GET


def test_past_half_the_bound_keys_no_listing_covers_ask_nothing_until_the_bound(http, data, tmp_path):
    # over HTTP no listing covers a key: past half the bound asking does nothing (no HEAD) until the bound, so
    # revalidate says so, until the bound; before, it said nothing of them, and a pipeline whose second epoch
    # began past half the bound asked about every chunk of every batch again, for nothing. Past the bound: HEADs
    kv = _store(http, tmp_path, 4.0)
    before = time.monotonic()
    _read(kv)
    assert kv.cache.flush(30)
    time.sleep(max(0.0, before + 2.2 - time.monotonic()))  # past half the bound, within it
    start = len(http.log)
    fresh = kv.revalidate(KEYS)
    assert time.monotonic() < before + 4.0
    assert sorted(fresh) == sorted(KEYS)
    assert all(before + 4.0 <= until <= time.monotonic() + 4.0 for until in fresh.values())  # learnt + the bound
    assert kv.fresh_until(KEYS) == min(fresh.values())
    assert http.log[start:] == []
    time.sleep(max(0.0, max(fresh.values()) - time.monotonic() + 0.05))  # past the bound: a HEAD each
    assert kv.fresh_until(KEYS) == 0.0 and kv.revalidate(KEYS) == {}
    deadline = time.monotonic() + 15
    while len(_asked(http, start, "HEAD")) < len(KEYS) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(p.lstrip("/") for p in _asked(http, start, "HEAD")) == sorted(KEYS)


def test_past_half_the_bound_revalidate_heads_and_a_replaced_object_is_read_new(http, data, tmp_path):
    kv = _store(http, tmp_path, 0.5)
    old = _read(kv)
    assert kv.cache.flush(30)
    time.sleep(0.6)  # past the bound: each known key is asked again
    start = len(http.log)
    assert kv.revalidate(KEYS) == {}
    deadline = time.monotonic() + 15
    while len(_asked(http, start, "HEAD")) < len(KEYS) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(p.lstrip("/") for p in _asked(http, start, "HEAD")) == sorted(KEYS)  # one HEAD a key, no GET
    assert _asked(http, start, "GET") == []
    _write(data, 9)  # replaced on the server
    time.sleep(0.6)  # past the whole bound: the read revalidates, finds new ETags and reads the new bytes
    new = _read(kv)
    assert new == [read_tree(data)[k] for k in KEYS] and new != old


def test_a_malformed_key_is_still_refused(http, data, tmp_path):
    kv = _store(http, tmp_path, 600.0)
    _read(kv)
    for bad in (["plain/../x"], ["plain//c"], [KEYS[0], "a\\b"]):
        with pytest.raises(InvalidArgument):
            kv.revalidate(bad)
    with pytest.raises(InvalidArgument):
        kv.revalidate([["not", "a", "key"]])  # type: ignore[list-item]
