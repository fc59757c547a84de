"""How the disk cache revalidates what it holds: against moto's S3 server (requests counted from its log) and
the loopback HTTP server (its log of arrivals), a new pipeline over a cached array revalidates it by one
listing where the store lists (no HEAD per object, no GET), HEADs over HTTP go out for the batches pulled
ahead before the first is popped, a replaced object is read new, the staleness bound is honoured by listing
again, and a failed HEAD is not asked again by the read it served. Every value is compared with zarr-python's."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import re
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.pipeline.prefetch import listed_whole, revalidate_ahead
from stoker.storage import cachingstore
from stoker.storage.diskcache import disk_cache
from stoker.storage.locate import Stores, locate

from range_server import RangeServer
from store_fixtures import (BUCKET, FAST_REMOTE, empty_s3_fixture, random_int_arrays, range_server_fixture, read_tree,
                            written_tree_fixture, zarr_values)

pytestmark = pytest.mark.timeout(180)

FAST = FAST_REMOTE
SHAPE = (64, 64)
#: one sharded (shard index and inner chunks as ranges), one plain (whole chunk values), 16 objects each
ARRAYS = {"sharded": dict(chunks=(4, 4), shards=(16, 16), dtype="uint16", compressors=ZstdCodec(level=1)),
          "plain": dict(chunks=(16, 16), dtype="int32", compressors=ZstdCodec(level=1))}
#: a batch of two boxes, each within one object of each array
BATCHES = [[((16 * i, 16 * i + 8), (16 * j, 16 * j + 8)) for j in (0, 2)] for i in range(4)] + \
          [[((16 * i + 8, 16 * i + 16), (16 * j + 8, 16 * j + 16)) for j in (1, 3)] for i in range(4)]


_write = random_int_arrays(ARRAYS, SHAPE)


class _BusyServer(RangeServer):
    request_queue_size = 64  # a burst of connections accepted at once, as a real server would (default 5)


s3 = empty_s3_fixture()
data = written_tree_fixture(_write)
http = range_server_fixture()
busy_http = range_server_fixture(_BusyServer)


@contextlib.contextmanager
def moto_log():
    """The requests moto's server answers meanwhile, ``(method, path and query)`` each, from its log."""
    got: list[tuple[str, str]] = []
    line = re.compile(r'"(\w+) (\S+) HTTP')

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            m = line.search(re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()))  # werkzeug colours some
            if m:
                got.append((m.group(1), m.group(2)))

    logger = logging.getLogger("werkzeug")
    handler, level, propagate = Handler(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield got
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _config(tmp_path, storage_options: dict | None = None, **more) -> stoker.Config:
    return stoker.Config(batch_size=2, dtype="native", n_compute_threads=1, pop_timeout_s=60,
                         storage_options=storage_options, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20,
                         **more)


def _on_s3(s3) -> dict:
    """The Config's storage_options of moto's server."""
    return {f"s3://{BUCKET}/": {**s3.options, **FAST}}


def _cached(tmp_path, options: dict | None = None, **more) -> dict:
    """storage_options of ``open_array`` (the server's ``options``, for S3) with the test's disk cache."""
    return {**(options or {}), **FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20, **more}


def _epoch(cfg: stoker.Config, uri: str, root: str, path: str, batches=BATCHES, p=None) -> None:
    """Every batch of ``batches`` read through a pipeline (a new one unless ``p``), each checked against
    zarr-python's values of the array now at ``root``; then the cache's writes flushed."""
    want = zarr_values(root, path)
    with contextlib.ExitStack() as stack:
        if p is None:
            p = stack.enter_context(stoker.Pipeline(cfg))
        for boxes in batches:
            p.push([stoker.Sample(uri, b) for b in boxes])
        for boxes in batches:
            b = p.pop()
            for got, box in zip(torch.from_dlpack(b), boxes):
                np.testing.assert_array_equal(got.numpy(), want[tuple(slice(*s) for s in box)])
            b.release()
    assert disk_cache(str(cfg.cache_dir), 64 << 20).flush(30)


def _upload(s3, root: str) -> str:
    prefix = f"reval-{uuid.uuid4().hex[:8]}"
    s3.upload(read_tree(root), prefix)
    return prefix


def _counted(log: list[tuple[str, str]], prefix: str, path: str) -> dict[str, int]:
    """Requests of ``log`` about the array: listings of it, HEADs and GETs of its objects (metadata apart)."""
    where = f"/{BUCKET}/{prefix}/{path}/"
    listed = f"prefix={prefix}/{path}/"
    return {"list": sum(m == "GET" and "list-type=2" in q and listed in q.replace("%2F", "/") for m, q in log),
            "head": sum(m == "HEAD" and q.startswith(where) for m, q in log),
            "get": sum(m == "GET" and q.startswith(where) and not q.endswith("zarr.json") for m, q in log)}


@pytest.mark.parametrize("path", list(ARRAYS))
def test_a_new_pipeline_over_a_cached_s3_array_lists_it_once_and_gets_nothing(s3, data, tmp_path, path):
    prefix = _upload(s3, data)
    uri = f"s3://{BUCKET}/{prefix}/{path}"
    cfg = _config(tmp_path, _on_s3(s3))
    with moto_log() as log:
        _epoch(cfg, uri, data, path)
    cold = _counted(log, prefix, path)
    assert cold["list"] == 0 and cold["head"] == 0 and cold["get"] > 0, cold  # nothing kept: nothing listed
    with moto_log() as log:
        _epoch(cfg, uri, data, path)
    # every object revalidated by one listing (16 objects: one page), none by HEAD; nothing fetched
    assert _counted(log, prefix, path) == {"list": 1, "head": 0, "get": 0}
    # replaced between epochs (new ETags): the next pipeline's listing says so, and the new bytes are read
    _write(data, 2)
    s3.upload(read_tree(data), prefix)
    with moto_log() as log:
        _epoch(cfg, uri, data, path)
    replaced = _counted(log, prefix, path)
    assert replaced["list"] == 1 and replaced["head"] == 0 and replaced["get"] > 0, replaced


def _all_of(log: list[tuple[str, str]], prefix: str, path: str) -> list[tuple[str, str]]:
    """Every request of ``log`` about the array (its documents included): listings of it, HEADs and GETs."""
    where, listed = f"/{BUCKET}/{prefix}/{path}/", f"prefix={prefix}/{path}/"
    return [(m, q) for m, q in log if q.startswith(where) or ("list-type=2" in q and listed in q.replace("%2F", "/"))]


@pytest.mark.parametrize("path", list(ARRAYS))
def test_a_new_pipeline_opens_a_cached_s3_array_with_its_listing_alone(s3, data, tmp_path, path):
    # the listing that revalidates the array's chunks states its zarr.json's ETag too: the document is served
    # from disk, so the second pipeline's one request about the array is that LIST (no GET of zarr.json)
    prefix = _upload(s3, data)
    uri = f"s3://{BUCKET}/{prefix}/{path}"
    cfg = _config(tmp_path, _on_s3(s3))
    _epoch(cfg, uri, data, path)
    with moto_log() as log:
        _epoch(cfg, uri, data, path)
    asked = _all_of(log, prefix, path)
    assert len(asked) == 1 and "list-type=2" in asked[0][1], asked
    # rewritten between pipelines with another dtype and shape: its zarr.json has a new ETag, so the next
    # pipeline reads it anew (the kept one is never served) and the values are the new array's
    spec = {**ARRAYS[path], "dtype": "float64", "fill_value": 0.5}
    arr = zarr.create_array(os.path.join(data, path), shape=(80, 72), overwrite=True, **spec)
    arr[...] = np.random.default_rng(3).random((80, 72))
    s3.upload(read_tree(data), prefix)
    with moto_log() as log:
        _epoch(cfg, uri, data, path)
    assert ("GET", f"/{BUCKET}/{prefix}/{path}/zarr.json") in log
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, ((70, 80), (60, 72))), stoker.Sample(uri, ((0, 10), (0, 12)))])
        b = p.pop()
        got = torch.from_dlpack(b).numpy()
        assert got.dtype == np.float64
        want = zarr_values(data, path)
        np.testing.assert_array_equal(got[0], want[70:80, 60:72])
        np.testing.assert_array_equal(got[1], want[0:10, 0:12])
        b.release()


def test_a_listing_goes_page_by_page_up_to_its_bound_then_heads(s3, data, tmp_path, monkeypatch):
    # pages of 5 keys, at most 10 listed: of the 16 objects (and zarr.json), the first 10 in key order come by
    # two listing requests, the 6 after them and zarr.json (kept on disk, read from there) by a HEAD each
    monkeypatch.setattr(cachingstore, "LIST_PAGE", 5)
    monkeypatch.setattr(cachingstore, "LIST_KEYS", 10)
    prefix = _upload(s3, data)
    uri = f"s3://{BUCKET}/{prefix}/plain"
    cfg = _config(tmp_path, _on_s3(s3))
    _epoch(cfg, uri, data, "plain")
    with moto_log() as log:
        _epoch(cfg, uri, data, "plain")
    assert _counted(log, prefix, "plain") == {"list": 2, "head": 7, "get": 0}
    heads = sorted(q.rsplit("/plain/", 1)[1] for m, q in log if m == "HEAD")
    assert heads == ["c/2/2", "c/2/3", "c/3/0", "c/3/1", "c/3/2", "c/3/3", "zarr.json"]
    assert not [q for m, q in log if m == "GET" and q.endswith("/plain/zarr.json")]


def test_a_listing_past_the_staleness_bound_is_made_again(s3, data, tmp_path):
    prefix = _upload(s3, data)
    uri = f"s3://{BUCKET}/{prefix}/plain"
    cfg = _config(tmp_path, _on_s3(s3), cache_staleness_s=1.0)
    _epoch(cfg, uri, data, "plain")
    with stoker.Pipeline(cfg) as p, moto_log() as log:
        _epoch(cfg, uri, data, "plain", p=p)
        assert _counted(log, prefix, "plain") == {"list": 1, "head": 0, "get": 0}
        _write(data, 3)  # rewritten while the pipeline runs: read new once the listing is older than the bound
        s3.upload(read_tree(data), prefix)
        time.sleep(1.1)
        _epoch(cfg, uri, data, "plain", p=p)
        counted = _counted(log, prefix, "plain")
    assert counted["list"] == 2 and counted["head"] == 0 and counted["get"] > 0, counted


def test_keys_missing_from_the_listing_are_read_through_as_missing(s3, tmp_path):
    root = str(tmp_path / "holes")
    arr = zarr.create_array(os.path.join(root, "a"), shape=(32, 32), chunks=(16, 16), dtype="int32", fill_value=9,
                            compressors=ZstdCodec(level=1))
    arr[:16] = np.arange(16 * 32, dtype="int32").reshape(16, 32)  # the chunks of rows 16.. are never written
    prefix = _upload(s3, root)
    options = _cached(tmp_path, s3.options)
    uri = f"s3://{BUCKET}/{prefix}/a"
    want = zarr_values(root, "a")
    a = stoker.open_array(uri, options, stores=Stores())
    np.testing.assert_array_equal(a.read((slice(0, 32), slice(0, 32))), want)
    assert a.kv.cache.flush(30)
    with moto_log() as log:
        a = stoker.open_array(uri, options, stores=Stores())
        np.testing.assert_array_equal(a.read((slice(0, 32), slice(0, 32))), want)
    # one listing; the written chunks from disk, the missing ones asked as without a cache (a GET each)
    assert _counted(log, prefix, "a") == {"list": 1, "head": 0, "get": 2}


def test_http_revalidations_of_later_batches_go_out_before_the_first_is_popped(busy_http, data, tmp_path):
    uri = f"{busy_http.url}/plain"
    # a prefetch buffer of one chunk: batches are not planned ahead for their bytes (the prefetch's
    # HEADs would go out early anyway), only pulled
    cfg = _config(tmp_path, {busy_http.url + "/": dict(FAST)}, lookahead_batches=1, prefetch_bytes=2048)
    _epoch(cfg, uri, data, "plain")
    busy_http.latency_s = 0.1
    start = len(busy_http.log)
    want = zarr_values(data, "plain")
    with stoker.Pipeline(cfg) as p:
        for boxes in BATCHES:
            p.push([stoker.Sample(uri, b) for b in boxes])
        popped = []
        for boxes in BATCHES:
            b = p.pop()
            popped.append(time.monotonic())
            for got, box in zip(torch.from_dlpack(b), boxes):
                np.testing.assert_array_equal(got.numpy(), want[tuple(slice(*s) for s in box)])
            b.release()
    heads = {path: t for t, method, path in busy_http.log[start:] if method == "HEAD"}
    gets = [path for _, method, path in busy_http.log[start:] if method == "GET" and "/c/" in path]
    assert not gets  # all from disk
    for k, boxes in enumerate(BATCHES[1:], 1):
        for box in boxes:
            key = f"/plain/c/{box[0][0] // 16}/{box[1][0] // 16}"
            # batch k's object revalidated before batch 0 was popped (the pulled batches' HEADs)
            assert heads[key] < popped[0], (k, key, heads[key] - popped[0])


def test_values_the_disk_cache_keeps_are_revalidated_ahead_not_prefetched(http, data, tmp_path):
    # A new pipeline over a warm cache: a batch planned ahead asks its chunks' generations (a HEAD each, no
    # body), not their bytes into the prefetch buffer (which the cache's threads read from disk in Python);
    # its read then has the engine read the entry files. In the cold epoch the same chunks are prefetched.
    uri = f"{http.url}/plain"
    cfg = _config(tmp_path, {http.url + "/": dict(FAST)}, lookahead_batches=1)
    with stoker.Pipeline(cfg) as p:
        _epoch(cfg, uri, data, "plain", p=p)
        cold = p._coordinator.ahead.buffer.counters.started
    assert cold > 0  # nothing on disk yet: fetched ahead
    http.latency_s = 0.05
    start = len(http.log)
    with stoker.Pipeline(cfg) as p:
        _epoch(cfg, uri, data, "plain", p=p)
        warm = p._coordinator.ahead.buffer.counters
        assert warm.started == 0, warm  # before: every chunk of the batches planned ahead
    heads = [path for _, method, path in http.log[start:] if method == "HEAD" and "/c/" in path]
    gets = [path for _, method, path in http.log[start:] if method == "GET" and "/c/" in path]
    assert not gets and sorted(heads) == sorted(set(heads)) and len(heads) == 16  # one HEAD an object


def test_a_failed_head_is_not_asked_again_by_its_read(http, data, tmp_path):
    options = _cached(tmp_path)
    a = stoker.open_array(f"{http.url}/plain", options, stores=Stores())
    key = "plain/c/0/0"
    value = bytes(a.kv.get_many([key], [])[0][0])
    assert a.kv.cache.flush(30)
    a.kv.forget()
    asked = http.requests
    http.fail(1, status=400)  # the HEAD fails for good (not a status that may pass)
    got = a.kv.result_of(a.kv.start_get_many([key], []))
    assert bytes(got[0][0]) == value == read_tree(data)[key]
    # the failed HEAD, then the value read through: no second HEAD on the way
    assert [m for _, m, _ in http.log[-(http.requests - asked):]] == ["HEAD", "GET"]


# -- listings and HEADs racing reads, re-opens and forget --------------------------------------------------


def _caching(a) -> cachingstore.CachingStore:
    kv = a.kv
    while not isinstance(kv, cachingstore.CachingStore):
        kv = kv.store
    return kv


def _warm(s3, data, tmp_path, path: str = "plain", **more):
    """The array ``path`` uploaded and read whole once through a disk cache: ``(prefix, uri, options, kv)``."""
    prefix = _upload(s3, data)
    uri = f"s3://{BUCKET}/{prefix}/{path}"
    options = _cached(tmp_path, s3.options, **more)
    a = stoker.open_array(uri, options, stores=Stores())
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, path))
    kv = _caching(a)
    assert kv.cache.flush(30)
    return prefix, uri, options, kv


class _HeldPages:
    """The store's listing pages held back: each asked at once, its answer given to the cache only when the
    test says (``release(n)``), so that a read can be made to look while a page is in flight."""

    def __init__(self, kv: cachingstore.CachingStore, monkeypatch) -> None:
        self.asked: list[tuple[concurrent.futures.Future, concurrent.futures.Future]] = []
        real = kv.store.start_list_versions

        def held(*args):
            shown: concurrent.futures.Future = concurrent.futures.Future()
            self.asked.append((real(*args), shown))
            return shown

        monkeypatch.setattr(kv.store, "start_list_versions", held)

    def release(self, n: int) -> None:
        real, shown = self.asked[n]
        shown.set_result(real.result(timeout=10))


def test_a_read_between_two_listing_pages_waits_for_the_next(s3, data, tmp_path, monkeypatch):
    # pages of 5 keys; page 1's answer came, page 2 is being asked (held up on the thread that learnt page 1):
    # a read of a key past page 1 in that gap once found page 1's finished future, looked again at once,
    # without end (RecursionError, swallowed by the future): the read was never settled
    monkeypatch.setattr(cachingstore, "LIST_PAGE", 5)
    prefix, uri, options, kv = _warm(s3, data, tmp_path)
    real = kv.store.start_list_versions
    asking, go = threading.Event(), threading.Event()

    def slow_after_first(path, offset=None, max_keys=1000):
        if offset is not None:  # page 2 on: the gap held open until the read below was made
            asking.set()
            go.wait(10)
        return real(path, offset, max_keys)

    monkeypatch.setattr(kv.store, "start_list_versions", slow_after_first)
    kv.forget()
    kv.opened(f"{prefix}/plain")
    assert asking.wait(10)
    key = f"{prefix}/plain/c/1/2"  # on page 2
    out = kv.start_get_many([key], [])
    go.set()
    assert bytes(out.result(timeout=15)[0][0]) == read_tree(data)["plain/c/1/2"]


@pytest.mark.parametrize("written", [lambda e: e.strip('"'), lambda e: "W/" + e], ids=["unquoted", "weak"])
def test_a_listing_confirms_entries_however_it_writes_their_etags(s3, data, tmp_path, monkeypatch, written):
    # Azure lists ETags unquoted (HEAD and GET quote them), a server may mark them weak in one answer: the
    # same object has one generation, so a listing still confirms what a read kept
    import obstore

    prefix = _upload(s3, data)
    uri = f"s3://{BUCKET}/{prefix}/plain"
    cfg = _config(tmp_path, _on_s3(s3))
    _epoch(cfg, uri, data, "plain")
    real = obstore.list

    def listed(*args, **kwargs):
        async def pages():
            async for chunk in real(*args, **kwargs):
                yield [{**m, "e_tag": written(m["e_tag"])} for m in chunk]
        return pages()

    monkeypatch.setattr(obstore, "list", listed)
    with moto_log() as log:
        _epoch(cfg, uri, data, "plain")
    assert _counted(log, prefix, "plain") == {"list": 1, "head": 0, "get": 0}


def test_a_listing_asked_before_a_forget_is_not_learnt(s3, data, tmp_path, monkeypatch):
    prefix, uri, options, kv = _warm(s3, data, tmp_path)
    pages = _HeldPages(kv, monkeypatch)
    kv.forget()
    kv.opened(f"{prefix}/plain")  # listing 1: the old ETags, its answer held back
    _write(data, 5)
    s3.upload(read_tree(data), prefix)  # rewritten
    kv.forget()
    kv.opened(f"{prefix}/plain")  # listing 2, asked after the rewrite, held back too
    pages.asked[0][0].result(timeout=10)
    pages.release(0)  # listing 1's answer comes now: it predates the forget, so nothing of it is learnt
    key = f"{prefix}/plain/c/0/0"
    out = kv.start_get_many([key], [])
    pages.release(1)
    assert bytes(out.result(timeout=15)[0][0]) == read_tree(data)["plain/c/0/0"]  # the new bytes


def test_a_head_in_flight_at_a_forget_is_not_shared_by_later_reads(http, data, tmp_path):
    options = _cached(tmp_path)
    kv = _caching(stoker.open_array(f"{http.url}/plain", options, stores=Stores()))
    key = "plain/c/0/0"
    want = bytes(kv.get_many([key], [])[0][0])
    assert kv.cache.flush(30)
    kv.forget()
    http.latency_s = 0.3
    first = kv.start_get_many([key], [])  # its HEAD in flight
    time.sleep(0.05)
    kv.forget()  # the object may have been rewritten since that HEAD was asked
    second = kv.start_get_many([key], [])
    assert bytes(first.result(timeout=15)[0][0]) == bytes(second.result(timeout=15)[0][0]) == want
    heads = [path for _, method, path in http.log if method == "HEAD" and path.endswith("/c/0/0")]
    assert len(heads) == 2  # the second read asked again, not the first's answer


def test_a_head_answered_after_a_newer_listing_does_not_replace_what_the_listing_learnt(s3, data, tmp_path,
                                                                                         monkeypatch):
    # a HEAD asked before the object was rewritten, its answer (the old ETag) held back; a listing asked after
    # the rewrite comes first and learns the new ETag; then the HEAD's answer comes. Before: it replaced the
    # listing's newer answer, and the next read within the bound was served the old bytes from disk
    prefix, uri, options, kv = _warm(s3, data, tmp_path)
    key = f"{prefix}/plain/c/1/1"
    old = read_tree(data)["plain/c/1/1"]
    fresh = cachingstore.CachingStore(kv.store, kv.cache)  # a new wrapper of the folder: nothing known, nothing opened
    asked: list[tuple[concurrent.futures.Future, concurrent.futures.Future]] = []
    real = kv.store.start_versions

    def held(keys):
        shown: concurrent.futures.Future = concurrent.futures.Future()
        asked.append((real(keys), shown))
        return shown

    monkeypatch.setattr(kv.store, "start_versions", held)
    fresh.revalidate([key])  # not under an opened array: a HEAD
    assert len(asked) == 1
    head = asked[0][0].result(timeout=10)  # answered by the server before the rewrite: the old ETag
    _write(data, 7)
    s3.upload(read_tree(data), prefix)
    new = read_tree(data)["plain/c/1/1"]
    assert new != old
    fresh.opened(f"{prefix}/plain")  # its marker is on disk: listed, after the rewrite
    deadline = time.monotonic() + 15
    while not fresh.listed(f"{prefix}/plain") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fresh.listed(f"{prefix}/plain")
    asked[0][1].set_result(head)  # the HEAD's answer comes now, older than the listing's
    got = fresh.result_of(fresh.start_get_many([key], []))
    assert bytes(got[0][0]) == new


def test_a_get_answered_after_a_newer_listing_does_not_replace_what_the_listing_learnt(s3, data, tmp_path,
                                                                                        monkeypatch):
    # a GET of a cold key (no HEAD first) asked before the object was rewritten, its answer (the old bytes
    # and ETag) held back; a listing asked after the rewrite comes first and learns the new ETag; then the
    # GET's answer comes. Before: it replaced the listing's newer answer (as a HEAD's did), and the next read
    # within the bound was served the old bytes from disk
    prefix, uri, options, kv = _warm(s3, data, tmp_path)
    key = f"{prefix}/plain/extra"
    s3.upload({"plain/extra": b"old" * 100}, prefix)
    fresh = cachingstore.CachingStore(kv.store, kv.cache)  # a new wrapper of the folder: nothing known, nothing opened
    asked: list[tuple[concurrent.futures.Future, concurrent.futures.Future]] = []
    real = kv.store.start_get_many

    def held(keys, requests, **kw):
        shown: concurrent.futures.Future = concurrent.futures.Future()
        asked.append((real(keys, requests, **kw), shown))
        return shown

    monkeypatch.setattr(kv.store, "start_get_many", held)
    first = fresh.start_get_many([key], [])  # never kept: read through, a GET
    deadline = time.monotonic() + 15
    while not asked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(asked) == 1
    answer = asked[0][0].result(timeout=10)  # answered by the server before the rewrite: the old ETag
    s3.upload({"plain/extra": b"new" * 100}, prefix)
    fresh.opened(f"{prefix}/plain")  # its marker is on disk: listed, after the rewrite
    while not fresh.listed(f"{prefix}/plain") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fresh.listed(f"{prefix}/plain")
    asked[0][1].set_result(answer)  # the GET's answer comes now, older than the listing's
    assert bytes(fresh.result_of(first)[0][0]) == b"old" * 100  # what it read, as it read it
    monkeypatch.setattr(kv.store, "start_get_many", real)
    assert kv.cache.flush(30)
    got = fresh.result_of(fresh.start_get_many([key], []))
    assert bytes(got[0][0]) == b"new" * 100


def test_a_get_in_flight_at_a_forget_does_not_teach_its_generation(http, data, tmp_path):
    # a read of a cold key asked before a forget and answered after it: its answer is kept on disk under
    # the generation it states, but that generation is not taken as the key's now (the object may have
    # been rewritten after it was read): the next read revalidates it by a HEAD
    options = _cached(tmp_path)
    kv = _caching(stoker.open_array(f"{http.url}/plain", options, stores=Stores()))
    key = "plain/c/0/1"
    http.latency_s = 0.3
    first = kv.start_get_many([key], [])  # cold: a GET, no HEAD
    time.sleep(0.05)
    kv.forget()
    http.latency_s = 0.0
    want = bytes(first.result(timeout=15)[0][0])
    assert kv.cache.flush(30)
    assert bytes(kv.get_many([key], [])[0][0]) == want
    heads = [path for _, method, path in http.log if method == "HEAD" and path.endswith("/c/0/1")]
    assert len(heads) == 1  # revalidated: the GET's answer came after the forget


def test_a_read_waits_for_one_listing_page_at_most(s3, data, tmp_path, monkeypatch):
    # pages of 2 keys: c/3/3 is on page 8. Its read waits for the page in flight, then asks a HEAD, not
    # the seven pages before its own one after the other
    monkeypatch.setattr(cachingstore, "LIST_PAGE", 2)
    prefix, uri, options, kv = _warm(s3, data, tmp_path)
    pages = _HeldPages(kv, monkeypatch)
    kv.forget()
    kv.opened(f"{prefix}/plain")
    key = f"{prefix}/plain/c/3/3"
    with moto_log() as log:
        out = kv.start_get_many([key], [])
        pages.release(0)  # page 1 comes, page 2 is asked (and held back)
        assert bytes(out.result(timeout=15)[0][0]) == read_tree(data)["plain/c/3/3"]
    assert len(pages.asked) == 2  # page 1, and page 2 still held back when the read was settled
    counted = _counted(log, prefix, "plain")
    assert (counted["head"], counted["get"]) == (1, 0), counted  # c/3/3's HEAD; from disk


def test_open_array_again_soon_after_lists_the_array_once(s3, data, tmp_path):
    # a program that opens the array for each item (a Dataset's __getitem__) lists it once per half of
    # cache_staleness_s, not at each open (each later open revalidates what it reads by HEAD); once that
    # has passed, an open lists it again
    prefix, uri, options, kv = _warm(s3, data, tmp_path, cache_staleness_s=2.0)
    want = zarr_values(data, "plain")
    with moto_log() as log:
        for _ in range(5):  # the process's stores, which open_array revalidates at an open
            a = stoker.open_array(uri, options)
            np.testing.assert_array_equal(a.read((slice(0, 16), slice(0, 16))), want[:16, :16])
        # c/0/0 and zarr.json at opens 2 to 5 (a HEAD each, no body; zarr.json served from disk, no GET)
        assert _counted(log, prefix, "plain") == {"list": 1, "head": 8, "get": 0}
        assert not [q for m, q in log if m == "GET" and q.endswith("plain/zarr.json")]
        time.sleep(1.1)
        a = stoker.open_array(uri, options)
        np.testing.assert_array_equal(a.read((slice(0, 16), slice(0, 16))), want[:16, :16])
    assert _counted(log, prefix, "plain") == {"list": 2, "head": 8, "get": 0}


# -- revalidation ahead of the pulled batches (engine/pipeline/prefetch.revalidate_ahead) -------------------


def _every_object(uri: str) -> list[stoker.Sample]:
    """Boxes touching each of the 16 objects of an array of ARRAYS once."""
    return [stoker.Sample(uri, box) for boxes in BATCHES for box in boxes]


def _heads_until(count, n: int, timeout: float = 15.0) -> int:
    """``count()`` once it reached ``n`` (or the timeout passed): HEADs asked ahead arrive on their own."""
    deadline = time.monotonic() + timeout
    while count() < n and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # none more after them
    return count()


def test_revalidate_ahead_asks_nothing_of_an_s3_array_its_listing_took(s3, data, tmp_path):
    # the open lists all 16 objects (and zarr.json): no key is built for them, no HEAD sent
    prefix, uri, options, _ = _warm(s3, data, tmp_path)
    with moto_log() as log:
        a = stoker.open_array(uri, options, stores=Stores())
        assert listed_whole(a)
        assert revalidate_ahead(_every_object(uri), lambda u: a) == 0
        np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert _counted(log, prefix, "plain") == {"list": 1, "head": 0, "get": 0}


def test_revalidate_ahead_heads_the_objects_past_what_a_listing_takes(s3, data, tmp_path, monkeypatch):
    # pages of 5 keys, at most 10 listed: the 6 chunks past them are asked ahead by a HEAD each, so the
    # read after finds every generation known and asks nothing more
    monkeypatch.setattr(cachingstore, "LIST_PAGE", 5)
    monkeypatch.setattr(cachingstore, "LIST_KEYS", 10)
    prefix, uri, options, _ = _warm(s3, data, tmp_path)
    with moto_log() as log:
        a = stoker.open_array(uri, options, stores=Stores())
        assert not listed_whole(a)
        assert revalidate_ahead(_every_object(uri), lambda u: a) == 16
        chunks = f"/{BUCKET}/{prefix}/plain/c/"

        def heads() -> list[str]:
            return sorted(q[len(chunks):] for m, q in log if m == "HEAD" and q.startswith(chunks))

        assert _heads_until(lambda: len(heads()), 6) == 6
        assert heads() == ["2/2", "2/3", "3/0", "3/1", "3/2", "3/3"]
        np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    # the open's listing (two pages) and its zarr.json's HEAD (past the listing); nothing more for the read
    assert _counted(log, prefix, "plain") == {"list": 2, "head": 7, "get": 0}


def test_revalidate_ahead_heads_every_object_over_http(http, data, tmp_path):
    options = _cached(tmp_path)
    uri = f"{http.url}/plain"
    a = stoker.open_array(uri, options, stores=Stores())
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert _caching(a).cache.flush(30)
    a = stoker.open_array(uri, options, stores=Stores())  # a new wrapper: nothing known
    assert not listed_whole(a)
    start = len(http.log)

    def heads() -> int:
        return sum(method == "HEAD" and "/plain/c/" in path for _, method, path in http.log[start:])

    assert revalidate_ahead(_every_object(uri), lambda u: a) == 16
    assert _heads_until(heads, 16) == 16
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert heads() == 16 and not [p for _, m, p in http.log[start:] if m == "GET" and "/plain/c/" in p]


def test_revalidate_ahead_asks_no_listing_of_a_store_that_holds_none(http, s3, data, tmp_path, monkeypatch):
    # over HTTP (and S3 arrays opened on a cold cache) the store holds no listing: revalidate_ahead asks it so once
    # a call (lists_any), not listed() once an array; an S3 array whose open listed it is still asked, and skipped
    calls: list[str] = []
    listed = cachingstore.CachingStore.listed
    monkeypatch.setattr(cachingstore.CachingStore, "listed", lambda self, prefix: calls.append(prefix) or
                        listed(self, prefix))
    options = _cached(tmp_path / "http")
    uri = f"{http.url}/plain"
    a = stoker.open_array(uri, options, stores=Stores())
    assert not _caching(a).lists_any()
    assert revalidate_ahead(_every_object(uri), lambda u: a) == 16
    assert calls == []
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    prefix, uri, options, _ = _warm(s3, data, tmp_path)
    with moto_log() as log:
        a = stoker.open_array(uri, options, stores=Stores())
        assert _caching(a).lists_any()
        assert revalidate_ahead(_every_object(uri), lambda u: a) == 0
        assert calls == [f"{prefix}/plain"]  # once a call and array
        np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert _counted(log, prefix, "plain") == {"list": 1, "head": 0, "get": 0}


def test_revalidate_ahead_skips_objects_its_store_knows_fresh_until_half_the_bound(http, data, tmp_path):
    # a pipeline asks about every pulled batch's objects: those its store said are known and younger than half
    # the staleness bound are not asked again (no key built, nothing asked: before, every chunk's key was built
    # and asked of the store each batch) until that half, and past it, where no listing covers them (HTTP: asking
    # does nothing then), until the bound; past the bound asked and HEADed, and the read after is served from
    # disk, equal to zarr-python's
    from stoker.engine.pipeline.prefetch import Revalidated

    options = _cached(tmp_path, cache_staleness_s=2.0)
    uri = f"{http.url}/plain"
    a = stoker.open_array(uri, options, stores=Stores())
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert _caching(a).cache.flush(30)  # every generation learnt by its GET
    start = len(http.log)

    def heads() -> int:
        return sum(method == "HEAD" and "/plain/c/" in path for _, method, path in http.log[start:])

    asked = Revalidated()
    assert revalidate_ahead(_every_object(uri), lambda u: a, asked) == 16  # known: each told fresh, kept
    assert revalidate_ahead(_every_object(uri), lambda u: a, asked) == 0
    assert revalidate_ahead(_every_object(uri), lambda u: a) == 16  # without the pipeline's record: asked
    time.sleep(1.1)  # past half the bound: no listing covers them (HTTP), asking does nothing until the bound
    assert revalidate_ahead(_every_object(uri), lambda u: a, asked) == 0
    assert heads() == 0
    time.sleep(1.0)  # past the bound: asked, and revalidated by a HEAD each
    assert revalidate_ahead(_every_object(uri), lambda u: a, asked) == 16
    assert _heads_until(heads, 16) == 16
    # the HEADs' answers learnt (as they come): the boxes' kept keys found fresh in one look-up each
    deadline = time.monotonic() + 15
    while revalidate_ahead(_every_object(uri), lambda u: a, asked) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert revalidate_ahead(_every_object(uri), lambda u: a, asked) == 0
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert heads() == 16 and not [p for _, m, p in http.log[start:] if m == "GET" and "/plain/c/" in p]


def _read_through_cache(http, data, tmp_path):
    """The array "plain" over ``http`` read whole once through a disk cache (its entries written):
    ``(reader, samples touching each of its 16 objects once)``."""
    uri = f"{http.url}/plain"
    a = stoker.open_array(uri, _cached(tmp_path), stores=Stores())
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert _caching(a).cache.flush(30)
    return a, _every_object(uri)


def test_revalidate_ahead_keys_a_box_by_the_runs_of_cells_it_touches():
    # the box record's key is built straight from the crop (every sample of a second epoch, every batch): the
    # same runs as cells_touched's ranges, crops past either end and crops that miss an axis included
    from stoker.engine.pipeline.prefetch import _box, cells_touched

    rng = np.random.default_rng(7)
    for _ in range(2000):
        rank = int(rng.integers(1, 5))
        shape = [int(x) for x in rng.integers(1, 70, rank)]
        cell = [int(x) for x in rng.integers(1, 20, rank)]
        lo = [int(x) for x in rng.integers(-30, 90, rank)]
        aabb = [(a, a + int(n)) for a, n in zip(lo, rng.integers(0, 60, rank))]
        expected = tuple((r.start, r.stop) for r in cells_touched(aabb, shape, cell))
        assert _box(aabb, shape, cell) == expected, (aabb, shape, cell)


def test_revalidate_ahead_skips_a_box_whose_chunks_were_all_fresh_in_one_look_up(http, data, tmp_path):
    # a second epoch asks about the same boxes again: once every chunk of a box was found fresh, the box is
    # kept with the earliest of their "until"s and skipped whole (one look-up, not one a chunk) till then;
    # past that, its store is asked in one look-up whether its kept keys are all fresh, chunk by chunk if not
    from stoker.engine.pipeline.prefetch import Revalidated

    a, samples = _read_through_cache(http, data, tmp_path)
    asked = Revalidated()
    assert revalidate_ahead(samples, lambda u: a, asked) == 16  # known: each told fresh, kept
    assert revalidate_ahead(samples, lambda u: a, asked) == 0  # each chunk fresh: the boxes kept
    held = asked.of(a)
    boxes = {k: v for k, v in held.items() if isinstance(k[0], tuple)}
    chunks = {k: v for k, v in held.items() if not isinstance(k[0], tuple)}
    assert len(chunks) == 16 and boxes
    for box, (keys, until) in boxes.items():
        inside = {k: v for k, v in chunks.items() if all(lo <= i < hi for i, (lo, hi) in zip(k, box))}
        assert inside and until == min(v[1] for v in inside.values())
        assert sorted(keys) == sorted(v[0] for v in inside.values())  # its chunks' keys, kept with it
    for value in chunks.values():  # the chunks' own record no longer fresh: the boxes alone skip them
        value[1] = 0.0
    assert revalidate_ahead(samples, lambda u: a, asked) == 0
    for value in boxes.values():  # nor the boxes': the store, asked per box, still knows every key fresh
        value[1] = 0.0
    assert revalidate_ahead(samples, lambda u: a, asked) == 0
    assert all(v[1] > 0 for v in boxes.values())  # (their "until" renewed from its answer)
    for value in boxes.values():
        value[1] = 0.0
    _caching(a).forget()  # nothing known any more: every chunk asked, and HEADed
    start = len(http.log)
    assert revalidate_ahead(samples, lambda u: a, asked) == 16
    assert _heads_until(lambda: sum(m == "HEAD" and "/plain/c/" in p for _, m, p in http.log[start:]), 16) == 16
    start = len(http.log)
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert not [p for _, m, p in http.log[start:] if m == "GET" and "/plain/c/" in p]


def test_a_box_of_more_chunks_than_box_keys_keeps_no_keys(http, data, tmp_path, monkeypatch):
    # the keys a box keeps are bounded (BOX_KEYS chunks): a larger box is kept with its "until" alone, and asked
    # about chunk by chunk once that passed, as before boxes kept keys
    from stoker.engine.pipeline import prefetch
    from stoker.engine.pipeline.prefetch import Revalidated

    monkeypatch.setattr(prefetch, "BOX_KEYS", 0)
    a, samples = _read_through_cache(http, data, tmp_path)
    asked = Revalidated()
    assert revalidate_ahead(samples, lambda u: a, asked) == 16
    assert revalidate_ahead(samples, lambda u: a, asked) == 0
    boxes = {k: v for k, v in asked.of(a).items() if isinstance(k[0], tuple)}
    assert boxes and all(keys is None and until > 0 for keys, until in boxes.values())
    for key, value in asked.of(a).items():  # every record out of date: each chunk asked again
        value[1] = 0.0
    assert revalidate_ahead(samples, lambda u: a, asked) == 16


def test_a_second_epoch_asks_about_boxes_its_first_asked_about_before_their_reads(http, data, tmp_path,
                                                                                  monkeypatch):
    # a pipeline's first epoch asks ahead about its boxes before their chunks are read (a cold cache: nothing
    # known, nothing HEADed, as a read states each generation), so the chunks' own record says nothing of
    # them; its second epoch finds each box's kept keys known fresh by one look-up per box, building no key,
    # not even the box's ranges of cells (a step a sample on the coordinator, every batch), and asking the
    # store nothing, and its reads ask nothing either
    from stoker.engine.pipeline import prefetch
    from stoker.engine.pipeline.prefetch import Revalidated

    options = _cached(tmp_path)
    uri = f"{http.url}/plain"
    a = stoker.open_array(uri, options, stores=Stores())
    samples = _every_object(uri)
    asked = Revalidated()
    start = len(http.log)
    assert revalidate_ahead(samples, lambda u: a, asked) == 16  # epoch 1, ahead of its reads: nothing known
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert _caching(a).cache.flush(30)
    assert not [p for _, m, p in http.log[start:] if m == "HEAD"]  # a cold cache: the GETs state generations
    assert all(v[1] == 0.0 for k, v in asked.of(a).items() if not isinstance(k[0], tuple))
    built: list = []
    key_of = a.key_of
    a.key_of = lambda path: built.append(path) or key_of(path)  # type: ignore[method-assign]
    ranges: list = []
    cells_touched = prefetch.cells_touched
    monkeypatch.setattr(prefetch, "cells_touched", lambda *box: ranges.append(box) or cells_touched(*box))
    start = len(http.log)
    try:
        assert revalidate_ahead(samples, lambda u: a, asked) == 0  # epoch 2: one look-up a box
        assert revalidate_ahead(samples, lambda u: a, asked) == 0
    finally:
        del a.key_of
    assert built == [] and ranges == []
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert [(m, p) for _, m, p in http.log[start:] if "/plain/" in p] == []
    assert prefetch.MAX_REVALIDATE >= 16


def test_a_pulled_batch_is_revalidated_once_its_own_arrays_are_open(http, data, tmp_path):
    # two batches pulled together, over two arrays: the first's objects are HEADed as soon as its array is
    # open, not once the second's open (held here) is done too; the second's once its own is
    import concurrent.futures

    from stoker.engine.pipeline.coordinator import revalidate_when_open

    options = _cached(tmp_path)
    uris = {path: f"{http.url}/{path}" for path in ("plain", "sharded")}
    for path, uri in uris.items():
        a = stoker.open_array(uri, options, stores=Stores())
        np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, path))
        assert _caching(a).cache.flush(30)
    stores = Stores()  # the new pipeline's: nothing known
    readers = {"plain": stoker.open_array(uris["plain"], options, stores=stores)}
    start = len(http.log)

    def heads(path: str) -> int:
        return sum(method == "HEAD" and f"/{path}/c/" in p for _, method, p in http.log[start:])

    opened, opening = concurrent.futures.Future(), concurrent.futures.Future()
    opened.set_result(None)
    reader_of = {uris[path]: path for path in uris}
    revalidate_when_open([(uris["plain"], opened), (uris["sharded"], opening)],
                         [_every_object(uris["plain"]), _every_object(uris["sharded"])],
                         lambda us: [readers.get(reader_of[u]) for u in us])
    assert _heads_until(lambda: heads("plain"), 16) == 16  # before: none until the other open was done
    assert heads("sharded") == 0
    readers["sharded"] = stoker.open_array(uris["sharded"], options, stores=stores)
    opening.set_result(None)
    assert _heads_until(lambda: heads("sharded"), 16) == 16  # its 16 shards
    for path, a in readers.items():  # read from the disk: every generation known, no GET
        np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, path))
    assert not [p for _, m, p in http.log[start:] if m == "GET" and "/c/" in p]
    assert heads("plain") == 16 and heads("sharded") == 16
    stores.close()


def test_a_pulled_batch_has_its_arrays_looked_up_once_for_revalidating_and_its_shard_indexes(http, data, tmp_path):
    # the coordinator's one callback a batch: its open arrays looked up together once (not once a sample for
    # each of the two reads ahead), then its objects HEADed ahead, and its shard indexes read on the thread given
    from stoker.engine.pipeline.coordinator import revalidate_when_open

    options = _cached(tmp_path)
    uri = f"{http.url}/sharded"
    a = stoker.open_array(uri, options, stores=Stores())
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "sharded"))
    assert _caching(a).cache.flush(30)
    a = stoker.open_array(uri, options, stores=Stores())  # a new pipeline's: nothing known, no index cached
    looked: list[list[str]] = []
    ran: list = []
    start = len(http.log)
    samples = _every_object(uri)
    revalidate_when_open([], [samples[:8], samples[8:]], lambda us: looked.append(list(us)) or [a] * len(us),
                         run=ran.append)
    assert looked == [[uri], [uri]]  # once a batch, each array of it once
    assert ran  # the shard indexes' reads handed to the thread given
    for fn in ran:
        fn()
    assert _heads_until(lambda: sum(m == "HEAD" and "/sharded/c/" in p for _, m, p in http.log[start:]), 16) == 16
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "sharded"))


def test_a_key_revalidated_ahead_then_read_looks_up_its_marker_once(data, tmp_path, monkeypatch):
    # a pipeline revalidates the objects of the batches pulled ahead, then reads them: each object's marker
    # (whether anything of it is kept) is looked up on disk once, not once per ask; the reads still HEAD
    # each object once and come from disk, equal to zarr-python's
    server = RangeServer(data)
    try:
        options = {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
        kv = _caching(stoker.open_array(f"{server.url}/plain", options, stores=Stores()))
        keys = [f"plain/c/{i}/{j}" for i in range(4) for j in range(4)]
        want = [bytes(v) for v in kv.get_many(keys, [])[0]]
        assert want == [read_tree(data)[k] for k in keys]
        assert kv.cache.flush(30)
        kv = cachingstore.CachingStore(kv.store, kv.cache)  # a new pipeline's: every generation revalidated
        looked: list[str] = []
        real = kv.cache.has
        monkeypatch.setattr(kv.cache, "has", lambda ident: looked.append(ident) or real(ident))
        server.latency_s = 0.1
        kv.revalidate(keys)  # the HEADs in flight
        again = kv.result_of(kv.start_get_many(keys, []))
        assert [bytes(v) for v in again[0]] == want
        assert [bytes(v) for v in kv.get_many(keys, [])[0]] == want
        assert len(looked) == len(keys), len(looked)  # one look-up a key (before: one per ask)
        heads = [path for _, method, path in server.log if method == "HEAD"]
        assert sorted(heads) == sorted(f"/{k}" for k in keys)
        assert not [path for _, method, path in server.log[-len(keys):] if method == "GET"]
    finally:
        server.stop()


def test_stale_objects_of_an_array_whose_open_listed_nothing_are_relisted_ahead(s3, data, tmp_path):
    # a first run on a cold cache: the open lists nothing (nothing kept yet), the reads learn the generations
    # by GET; once those are past the staleness bound, revalidate_ahead lists the array once (1,000 keys a
    # request) rather than asking each of its 16 objects by a HEAD (before: 16 HEADs, no LIST)
    prefix = _upload(s3, data)
    uri = f"s3://{BUCKET}/{prefix}/plain"
    options = _cached(tmp_path, s3.options, cache_staleness_s=2.0)
    with moto_log() as log:
        a = stoker.open_array(uri, options, stores=Stores())
        np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
        assert _caching(a).cache.flush(30)
    assert _counted(log, prefix, "plain")["list"] == 0
    time.sleep(2.2)
    assert not listed_whole(a)
    with moto_log() as log:
        assert revalidate_ahead(_every_object(uri), lambda u: a) == 16
        _heads_until(lambda: _counted(log, prefix, "plain")["list"], 1)
        np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert _counted(log, prefix, "plain") == {"list": 1, "head": 0, "get": 0}


@pytest.mark.parametrize("path", list(ARRAYS))
def test_a_pipeline_past_the_staleness_bound_relists_an_array_its_open_did_not_list(s3, data, tmp_path, path):
    # one pipeline from a cold cache (its open lists nothing): past the bound, its next epoch revalidates the
    # array's objects by one listing, not a HEAD each (before: a HEAD per object an epoch, no LIST), and an
    # object rewritten meanwhile (new ETag) is read new, never from disk
    prefix = _upload(s3, data)
    uri = f"s3://{BUCKET}/{prefix}/{path}"
    cfg = _config(tmp_path, _on_s3(s3), cache_staleness_s=2.0)
    with stoker.Pipeline(cfg) as p:
        with moto_log() as log:
            _epoch(cfg, uri, data, path, p=p)
        assert _counted(log, prefix, path)["list"] == 0
        time.sleep(2.1)
        with moto_log() as log:
            _epoch(cfg, uri, data, path, p=p)
        assert _counted(log, prefix, path) == {"list": 1, "head": 0, "get": 0}
        _write(data, 3)  # rewritten between epochs: every object has a new ETag
        s3.upload(read_tree(data), prefix)
        time.sleep(2.1)
        with moto_log() as log:
            _epoch(cfg, uri, data, path, p=p)  # checked against zarr-python's values of the new array
        counted = _counted(log, prefix, path)
    assert counted["list"] == 1 and counted["head"] == 0 and counted["get"] > 0, counted


def _each_object_headed_ahead_then_read(a, uri: str, prefix: str, data) -> None:
    """revalidate_ahead asks each of the array's 16 objects by a HEAD ahead; the read after asks nothing more
    (no LIST, no GET: from disk) and equals zarr-python's."""
    chunks = f"/{BUCKET}/{prefix}/plain/c/"
    with moto_log() as log:
        assert revalidate_ahead(_every_object(uri), lambda u: a) == 16
        assert _heads_until(lambda: sum(m == "HEAD" and q.startswith(chunks) for m, q in log), 16) == 16
        np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert _counted(log, prefix, "plain") == {"list": 0, "head": 16, "get": 0}


def test_revalidate_ahead_heads_the_objects_of_an_array_whose_listing_failed(s3, data, tmp_path, monkeypatch):
    # the open's listing of a cached array fails: its objects are known by nothing, so each is asked ahead
    # by a HEAD (before: the array was small enough for one listing, so it was skipped)
    prefix, uri, options, _ = _warm(s3, data, tmp_path)
    a = stoker.open_array(uri, options, stores=Stores())
    kv = _caching(a)
    assert listed_whole(a)

    def refused(*args, **kwargs):
        failed: concurrent.futures.Future = concurrent.futures.Future()
        failed.set_exception(OSError("ListObjectsV2 refused"))
        return failed

    monkeypatch.setattr(kv.store, "start_list_versions", refused)
    kv.forget()
    kv.opened(f"{prefix}/plain")
    assert not listed_whole(a)
    _each_object_headed_ahead_then_read(a, uri, prefix, data)


def test_revalidate_ahead_lists_again_an_array_whose_listing_is_half_stale(s3, data, tmp_path):
    # the open's listing is older than half the staleness bound: revalidate_ahead no longer skips the array,
    # and asking about its objects starts the next listing ahead (no HEAD), so the reads after it find
    # every generation known and wait for nothing
    prefix, uri, options, _ = _warm(s3, data, tmp_path, cache_staleness_s=4.0)
    with moto_log() as log:
        a = stoker.open_array(uri, options, stores=Stores())
        assert _heads_until(lambda: _counted(log, prefix, "plain")["list"], 1) == 1
        assert listed_whole(a)
        time.sleep(2.1)
        assert not listed_whole(a)
        assert revalidate_ahead(_every_object(uri), lambda u: a) == 16
        assert _heads_until(lambda: _counted(log, prefix, "plain")["list"], 2) == 2
        np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
        assert _heads_until(lambda: int(listed_whole(a)), 1) == 1  # the new listing, once learnt
    assert _counted(log, prefix, "plain") == {"list": 2, "head": 0, "get": 0}


def test_a_key_whose_marker_was_found_on_disk_still_marks_its_array_when_kept(s3, data, tmp_path):
    # chunks kept by a wrapper that never opened their array (no folder marker written), then rewritten: the
    # next wrapper finds their markers on disk, lists the array, reads the new values and keeps them, and marks
    # the array it opened, so the open after lists it (before: a marker found on disk counted as written
    # by the wrapper, so the array's folder marker was never written and the next open listed nothing)
    prefix = _upload(s3, data)
    uri = f"s3://{BUCKET}/{prefix}/plain"
    base = Stores().get(locate(uri), _cached(tmp_path, s3.options))[0]  # not opened: nothing read nor marked
    assert isinstance(base, cachingstore.CachingStore)
    keys = [f"{prefix}/plain/c/{i}/{j}" for i in range(4) for j in range(4)]
    first = cachingstore.CachingStore(base.store, base.cache)
    first.get_many(keys, [])
    assert first.cache.flush(30)
    _write(data, 2)
    s3.upload(read_tree(data), prefix)
    want = [read_tree(data)[k.split("/", 1)[1]] for k in keys]
    second = cachingstore.CachingStore(base.store, base.cache)
    second.opened(f"{prefix}/plain")
    assert second.counters.listings == 0  # no folder marker: the open lists nothing
    assert [bytes(v) for v in second.get_many(keys, [])[0]] == want
    # the stale kept keys of the opened array: revalidated by one listing of it, not a HEAD each
    assert second.counters.listings == 1 and second.counters.revalidations == 0 and second.counters.misses == 16
    assert second.cache.flush(30)
    third = cachingstore.CachingStore(base.store, base.cache)
    third.opened(f"{prefix}/plain")
    assert third.counters.listings == 1  # asked by the open itself: the folder marker was written
    assert [bytes(v) for v in third.get_many(keys, [])[0]] == want
    assert third.counters.listings == 1, third.counters
    assert third.counters.revalidations == 0 and third.counters.hits == 16, third.counters


@pytest.mark.parametrize("bound", [4, None])
def test_markers_found_on_disk_are_remembered_up_to_a_bound(data, tmp_path, monkeypatch, bound):
    # a warm cache read again once every generation is stale: the markers found the first time are not looked
    # up again, but the wrapper remembers MARKERS_FOUND of them at most (before: every key ever read from a
    # warm cache stayed remembered, without bound)
    if bound is not None:
        monkeypatch.setattr(cachingstore, "MARKERS_FOUND", bound, raising=False)  # before: no bound
    server = RangeServer(data)
    try:
        options = {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
        kv = _caching(stoker.open_array(f"{server.url}/plain", options, stores=Stores()))
        keys = [f"plain/c/{i}/{j}" for i in range(4) for j in range(4)]
        want = [read_tree(data)[k] for k in keys]
        assert [bytes(v) for v in kv.get_many(keys, [])[0]] == want
        assert kv.cache.flush(30)
        kv = cachingstore.CachingStore(kv.store, kv.cache, staleness_s=0.5)
        looked: list[str] = []
        real = kv.cache.has
        monkeypatch.setattr(kv.cache, "has", lambda ident: looked.append(ident) or real(ident))
        assert [bytes(v) for v in kv.get_many(keys, [])[0]] == want
        assert len(looked) == 16
        time.sleep(0.6)  # every generation stale: each key revalidated again, its marker asked again
        assert [bytes(v) for v in kv.get_many(keys, [])[0]] == want
        assert kv.counters.revalidations == 32 and kv.counters.hits == 32, kv.counters
        if bound is None:
            assert len(looked) == 16  # all remembered
        else:
            assert len(looked) >= 16 + 16 - bound, len(looked)  # those past the bound looked up again
    finally:
        server.stop()


def test_a_forgotten_folder_inside_a_listed_array_is_not_taught_by_its_listing(s3, data, tmp_path, monkeypatch):
    # the array's listing is asked (its answer held back: the old ETags), a chunk rewritten, then the folder
    # of that chunk forgotten (forget of a prefix below the listed array): the listing's answer, which
    # predates the forget, must not teach that chunk's old generation (before: only listings at or below
    # the forgotten prefix were dropped, so the array's listing taught it and the old bytes were served
    # from disk), and the array no longer counts as listed whole
    prefix, uri, options, kv = _warm(s3, data, tmp_path)
    pages = _HeldPages(kv, monkeypatch)
    kv.forget()
    kv.opened(f"{prefix}/plain")  # the listing: the old ETags, its answer held back
    _write(data, 7)
    s3.upload(read_tree(data), prefix)  # rewritten
    kv.forget(f"{prefix}/plain/c/0")
    assert not kv.listed(f"{prefix}/plain")
    pages.asked[0][0].result(timeout=10)
    pages.release(0)  # the listing's answer comes now
    keys = [f"{prefix}/plain/c/0/{j}" for j in range(4)]
    got = kv.get_many(keys, [])[0]
    assert [bytes(v) for v in got] == [read_tree(data)[k.split("/", 1)[1]] for k in keys]  # the new bytes
    assert kv.counters.revalidations == 4, kv.counters  # each asked by a HEAD


def test_the_keys_a_wrapper_marked_are_remembered_up_to_a_bound(data, tmp_path, monkeypatch):
    # a wrapper remembers the keys whose marker it wrote (so a key kept again is not marked again), but at
    # most MARKERS_FOUND of them (before: every key ever written stayed remembered, without bound); every
    # key is still marked, so a new wrapper revalidates each by a HEAD and serves it from disk
    monkeypatch.setattr(cachingstore, "MARKERS_FOUND", 4)
    server = RangeServer(data)
    try:
        options = {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
        kv = _caching(stoker.open_array(f"{server.url}/plain", options, stores=Stores()))
        keys = [f"plain/c/{i}/{j}" for i in range(4) for j in range(4)]
        want = [read_tree(data)[k] for k in keys]
        for key in keys:
            assert bytes(kv.get_many([key], [])[0][0]) == read_tree(data)[key]
        assert len(kv._marked) <= 4, len(kv._marked)
        assert kv.cache.flush(30)
        again = cachingstore.CachingStore(kv.store, kv.cache)
        assert [bytes(v) for v in again.get_many(keys, [])[0]] == want
        assert again.counters.revalidations == 16 and again.counters.hits == 16, again.counters
    finally:
        server.stop()


# -- a staleness bound shorter than a request's round trip ------------------------------------------------

TINY = 0.001  #: cache_staleness_s far shorter than one LIST or HEAD round trip to the test's servers


def _kept_unlisted(s3, data, tmp_path, listed_at_open: bool):
    """The plain array uploaded and read whole once through a wrapper of the default bound (``listed_at_open``:
    opened first, so its entries mark the array and a new wrapper's open lists it), then a new wrapper of
    the bound :data:`TINY` over the same folder: ``(prefix, keys, want, kv)``."""
    prefix = _upload(s3, data)
    base = Stores().get(locate(f"s3://{BUCKET}/{prefix}/plain"), _cached(tmp_path, s3.options))[0]
    keys = [f"{prefix}/plain/c/{i}/{j}" for i in range(4) for j in range(4)]
    want = [read_tree(data)[k.split("/", 1)[1]] for k in keys]
    first = cachingstore.CachingStore(base.store, base.cache)
    if listed_at_open:
        first.opened(f"{prefix}/plain")
    assert [bytes(v) for v in first.get_many(keys, [])[0]] == want
    assert first.cache.flush(30)
    return prefix, keys, want, cachingstore.CachingStore(base.store, base.cache, staleness_s=TINY)


@pytest.mark.parametrize("listed_at_open", [False, True])
def test_a_bound_shorter_than_a_listing_page_lists_the_array_once_a_call(s3, data, tmp_path, listed_at_open):
    # a listing asked after a call began is fresh enough for it (tensorstore's bound: data no older than it
    # at the time of the request). Before: the keys of each page, dated from the listing's start, were stale
    # as the page came, so revalidate() listed the array again, and again, a chain of LIST requests that
    # only close ended (from an open that listed the array, and from one on a cold cache that did not); a
    # read's listing then served nothing (16 GETs)
    prefix, keys, want, kv = _kept_unlisted(s3, data, tmp_path, listed_at_open)
    opened = int(listed_at_open)
    with moto_log() as log:
        kv.opened(f"{prefix}/plain")
        assert _heads_until(lambda: _counted(log, prefix, "plain")["list"], opened) == opened
        kv.revalidate(keys)  # one call, which nothing waits for: its listing once it came, and a second
        # more (a chain would list again meanwhile)
        _heads_until(lambda: _counted(log, prefix, "plain")["list"], opened + 1)
        time.sleep(1.0)
        assert _counted(log, prefix, "plain") == {"list": opened + 1, "head": 0, "get": 0}
        assert [bytes(v) for v in kv.get_many(keys, [])[0]] == want  # its own listing, then from disk
        time.sleep(0.5)
        counted = _counted(log, prefix, "plain")
    assert counted == {"list": opened + 2, "head": 0, "get": 0}, counted
    assert kv.counters.hits == 16 and kv.counters.misses == 0, kv.counters


def test_revalidations_ahead_under_a_short_bound_share_the_listing_in_flight(s3, data, tmp_path, monkeypatch):
    # a pipeline asks ahead for each batch it plans; with the bound shorter than a page's round trip, each
    # ask found the listing in flight too old and replaced it before its page came, so no listing was ever
    # learnt and every ask cost a LIST. A call that serves no read waits for the one in flight instead, and
    # starts none after it came
    prefix, keys, want, kv = _kept_unlisted(s3, data, tmp_path, True)
    pages = _HeldPages(kv, monkeypatch)
    kv.opened(f"{prefix}/plain")  # its listing asked, its answer held back
    for _ in range(5):
        time.sleep(0.01)  # past the bound: the listing in flight is older than it
        kv.revalidate(keys)
    assert len(pages.asked) == 1, len(pages.asked)
    pages.release(0)

    def learnt() -> int:  # keys[0]'s generation learnt from that listing (once its page was handled)
        listing, known = kv._listings.get(f"{prefix}/plain"), kv._known.get(keys[0])
        return int(listing is not None and known is not None and known[1] == listing.started)

    assert _heads_until(learnt, 1) == 1
    time.sleep(0.5)
    assert len(pages.asked) == 1, len(pages.asked)  # nothing listed again once it came
    out = kv.start_get_many(keys, [])  # a read lists again (the bound passed), and is served from disk
    _heads_until(lambda: len(pages.asked), 2)
    pages.release(1)
    assert [bytes(v) for v in kv.result_of(out)[0]] == want
    assert len(pages.asked) == 2 and kv.counters.hits == 16 and kv.counters.misses == 0, kv.counters


def test_under_a_short_bound_reads_come_from_disk_and_a_rewritten_array_is_read_new(s3, data, tmp_path):
    # open_array under a bound shorter than a LIST's round trip: each read revalidates (a listing it waits
    # for) and is served from disk at the generations it states (before: stale by the time they came, so
    # every read went to the store as without a cache); an array rewritten between two reads is read new
    prefix, uri, options, _ = _warm(s3, data, tmp_path, cache_staleness_s=TINY)
    everything = (slice(0, 64), slice(0, 64))
    with moto_log() as log:
        a = stoker.open_array(uri, options, stores=Stores())
        kv = _caching(a)
        np.testing.assert_array_equal(a.read(everything), zarr_values(data, "plain"))
        assert kv.counters.hits == 17 and kv.counters.misses == 0, kv.counters  # zarr.json and 16 chunks
        _write(data, 3)
        s3.upload(read_tree(data), prefix)
        np.testing.assert_array_equal(a.read(everything), zarr_values(data, "plain"))  # the new values
        assert kv.counters.hits == 17 and kv.counters.misses == 16, kv.counters
        listed = _counted(log, prefix, "plain")["list"]
        time.sleep(0.5)
        counted = _counted(log, prefix, "plain")
    assert counted["list"] == listed and counted["head"] == 0 and counted["get"] == 16, counted  # no chain


def test_under_a_short_bound_a_head_a_read_waited_for_serves_it_from_disk(http, data, tmp_path):
    # over HTTP (no listing) a read's HEAD answers in more than the bound: before, that answer was stale
    # once it came, and the read went to the server (a HEAD and a GET per object); now from disk
    options = _cached(tmp_path, cache_staleness_s=TINY)
    uri = f"{http.url}/plain"
    a = stoker.open_array(uri, options, stores=Stores())
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    assert _caching(a).cache.flush(30)
    a = stoker.open_array(uri, options, stores=Stores())
    kv = _caching(a)
    http.latency_s = 0.01
    start = len(http.log)
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 64))), zarr_values(data, "plain"))
    asked = [method for _, method, path in http.log[start:] if "/plain/c/" in path]
    assert asked == ["HEAD"] * 16, asked
    assert kv.counters.hits == 17 and kv.counters.misses == 0, kv.counters  # zarr.json and 16 chunks


def test_a_0d_arrays_one_chunk_is_kept_as_a_chunk_not_a_box(http, data, tmp_path):
    # a 0-d array's box () is its one chunk's index (): the record keeps the chunk's [key, until] there, never a
    # box's [keys, until] in its place (whose keys tuple would then be asked of the store as a key)
    import os

    from stoker.engine.pipeline.prefetch import Revalidated

    z = zarr.create_array(os.path.join(data, "scalar"), shape=(), dtype="uint16", fill_value=0)
    z[...] = 4321
    options = _cached(tmp_path)
    uri = f"{http.url}/scalar"
    a = stoker.open_array(uri, options, stores=Stores())
    assert int(a.read(())) == 4321
    assert _caching(a).cache.flush(30)
    asked = Revalidated()
    samples = [stoker.Sample(uri, [])]
    seen: list = []
    kv = _caching(a)
    revalidate = kv.revalidate
    kv.revalidate = lambda keys: seen.extend(keys) or revalidate(keys)  # type: ignore[method-assign]
    try:
        for _ in range(3):
            revalidate_ahead(samples, lambda u: a, asked)
    finally:
        del kv.revalidate
    assert seen and all(isinstance(k, str) for k in seen)
    ((index, held),) = asked.of(a).items()
    assert index == () and isinstance(held[0], str) and held[1] > 0


def test_listed_checks_its_prefix_whether_or_not_anything_is_listed(s3, data, tmp_path):
    # listed() answered False for any prefix, a path out of the store's root included, while nothing was listed
    # (an HTTP store's, a cold cache's opens), and raised InvalidArgument for the same prefix once a listing was
    # kept: one check, before anything else, as every other CachingStore call does
    prefix, uri, options, kv = _warm(s3, data, tmp_path)
    fresh = cachingstore.CachingStore(kv.store, kv.cache)  # nothing listed
    bad = ["a/../b", "/abs", "a//b", "a\\b", "..", f"{prefix}/./plain"]
    for prefix_ in bad:
        with pytest.raises(stoker.InvalidArgument, match="relative key"):
            fresh.listed(prefix_)
    assert not fresh.listed(f"{prefix}/plain")
    fresh.opened(f"{prefix}/plain")  # its marker is on disk: listed
    deadline = time.monotonic() + 15
    while not fresh.listed(f"{prefix}/plain") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fresh.listed(f"{prefix}/plain") and fresh.listed(f"{prefix}/plain/")
    for prefix_ in bad:
        with pytest.raises(stoker.InvalidArgument, match="relative key"):
            fresh.listed(prefix_)
