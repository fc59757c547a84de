"""Prefetch (``Config.prefetch_bytes``/``prefetch_requests``): the remote chunks of batches waiting for a slot
are fetched ahead into a bounded buffer. Against moto's S3 server and the loopback HTTP server (with
latency): every batch equals zarr-python's; the requests of later batches are made before the first batch is
popped (the server's request log); the buffer never holds more than its cap; an object rewritten between a
prefetch and its use is read as without prefetch; close() with prefetches in flight is prompt; local arrays
never prefetch."""

from __future__ import annotations

import os
import time
import uuid
import warnings

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

import stoker
from stoker.errors import NotFound
from stoker.storage import ByteRange, ObjectStore
from stoker.storage.prefetch import PrefetchBuffer, PrefetchStore

from range_server import RangeServer
from store_fixtures import (BUCKET, FAST_REMOTE, empty_s3_fixture, range_server_fixture, read_tree, written_tree_fixture,
                            zarr_values)

pytestmark = pytest.mark.timeout(180)

SHAPE = (64, 256)
FAST = {**FAST_REMOTE, "timeout_s": 10.0}
#: path -> how zarr-python writes it: whole chunk values, blosc frames (cut into spans), ranges of shards
ARRAYS = {"plain": dict(chunks=(16, 16), dtype="int32", compressors=ZstdCodec(level=1)),
          "blosc": dict(chunks=(16, 32), dtype="uint16", compressors=BloscCodec(cname="lz4", clevel=1)),
          "sharded": dict(chunks=(8, 8), shards=(32, 64), dtype="uint16", compressors=ZstdCodec(level=1))}


def _write(root: str, seed: int, hole: bool = False) -> None:
    """The arrays written by zarr-python; ``hole``: each shard's first inner chunk left empty (not stored), so
    the shards are shorter and their chunks sit at other offsets than before."""
    rng = np.random.default_rng(seed)
    for path, spec in ARRAYS.items():
        arr = zarr.create_array(os.path.join(root, path), shape=SHAPE, fill_value=0, overwrite=True, **spec)
        data = rng.integers(1, 5000, size=SHAPE).astype(spec["dtype"])
        if hole:
            data.reshape(2, 32, 4, 64)[:, :8, :, :8] = 0
        arr[...] = data


def _boxes(n: int, seed: int = 3, size: tuple[int, int] = (12, 20)) -> list[list[tuple[int, int]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        y, x = int(rng.integers(0, SHAPE[0] - size[0] + 1)), int(rng.integers(0, SHAPE[1] - size[1] + 1))
        out.append([(y, y + size[0]), (x, x + size[1])])
    return out


def _crop(data: np.ndarray, box) -> np.ndarray:
    (a, b), (c, d) = box
    return data[a:b, c:d]


def _config(options: dict | None, **kw) -> stoker.Config:
    base = dict(batch_size=4, dtype="native", n_compute_threads=2, lookahead_batches=1, pop_timeout_s=60,
                host_buffer_bytes=32 << 20, storage_options=options)
    return stoker.Config(**{**base, **kw})


def _pop(p: stoker.Pipeline) -> np.ndarray:
    """The next batch, copied (a function: no name of the caller's keeps the batch, and its slot, alive)."""
    with p.pop() as b:
        return torch.from_dlpack(b).clone().numpy()


def _counters(p: stoker.Pipeline):
    return p._coordinator.ahead.buffer.counters


def _until(what, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.01)
    return False


s3 = empty_s3_fixture()


data = written_tree_fixture(_write)


http = range_server_fixture()


def _on_s3(s3, root: str) -> tuple[str, dict, callable]:
    prefix = f"prefetch-{uuid.uuid4().hex[:8]}"

    def upload() -> None:
        s3.upload(read_tree(root), prefix)

    upload()
    return f"s3://{BUCKET}/{prefix}", {f"s3://{BUCKET}/": {**s3.options, **FAST}}, upload


@pytest.mark.parametrize("kind", ["s3", "http"])
@pytest.mark.parametrize("path", list(ARRAYS))
def test_every_batch_equals_zarr_python_with_prefetch(kind, path, s3, http, data, decode_path):
    if kind == "s3":
        uri, options, _ = _on_s3(s3, data)
    else:
        http.latency_s = 0.02
        uri, options = http.url, {http.url + "/": FAST}
    boxes = _boxes(48)
    want = zarr_values(data, path)
    with stoker.Pipeline(_config(options)) as p:
        p.push([stoker.Sample(f"{uri}/{path}", box) for box in boxes])
        for k in range(len(boxes) // 4):
            got = _pop(p)
            for row, box in zip(got, boxes[4 * k:4 * k + 4]):
                assert np.array_equal(row, _crop(want, box)), f"batch {k}"
        counters = _counters(p)
        assert counters.used > 0, counters  # later batches were served from the buffer
        assert counters.peak_bytes <= p.cfg.prefetch_bytes


def _chunk_box(n: int) -> list[tuple[int, int]]:
    """The box of chunk file ``n`` of the plain array (16 x 16 chunks, 16 along x)."""
    r, c = divmod(n, 16)
    return [(16 * r, 16 * r + 16), (16 * c, 16 * c + 16)]


def _chunk_path(n: int) -> str:
    r, c = divmod(n, 16)
    return f"/plain/c/{r}/{c}"


@pytest.mark.parametrize("prefetch_bytes", [128 << 20, 0])
def test_the_chunks_of_later_batches_are_requested_before_the_first_pop(http, prefetch_bytes):
    # Two slots (lookahead 1), a batch of 2 samples each reading its own chunk file: batches 0 and 1 go in the
    # slots, batch 2 waits for one; without prefetch nothing later is requested before a pop. With it, batch 5
    # (and more) is requested while nobody has popped anything.
    http.latency_s = 0.05
    cfg = _config({http.url + "/": FAST}, batch_size=2, prefetch_bytes=prefetch_bytes)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(f"{http.url}/plain", _chunk_box(n)) for n in range(40)])
        first = [_chunk_path(n) for n in (0, 1, 2, 3)]
        assert _until(lambda: all(x in http.paths for x in first))
        later = [_chunk_path(n) for n in (10, 11)]  # batch 5
        if prefetch_bytes:
            assert _until(lambda: all(x in http.paths for x in later)), http.paths
        else:
            time.sleep(1.0)
            assert not any(x in http.paths for x in later), http.paths
        want = zarr_values(http.root, "plain")
        for k in range(20):
            got = _pop(p)
            assert np.array_equal(got[0], _crop(want, _chunk_box(2 * k)))
            assert np.array_equal(got[1], _crop(want, _chunk_box(2 * k + 1)))


@pytest.mark.parametrize("path", ["plain", "sharded"])
def test_the_buffer_never_holds_more_than_its_cap(http, path):
    http.latency_s = 0.02
    stored = stoker.open_array(os.path.join(http.root, path)).metadata.codec.max_stored_nbytes
    cap = 5 * stored  # a few chunks: most batches fit only in part
    cfg = _config({http.url + "/": FAST}, prefetch_bytes=cap, prefetch_requests=3)
    boxes = _boxes(48, seed=9)
    want = zarr_values(http.root, path)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(f"{http.url}/{path}", box) for box in boxes])
        for k in range(len(boxes) // 4):
            got = _pop(p)
            for row, box in zip(got, boxes[4 * k:4 * k + 4]):
                assert np.array_equal(row, _crop(want, box))
            counters = _counters(p)
            assert 0 <= counters.held_bytes <= cap and counters.peak_bytes <= cap, counters
            assert counters.peak_requests <= 3, counters
        assert counters.started > 0 and counters.skipped > 0, counters  # it prefetched, and the cap bit


def test_a_prefetched_range_carries_the_generation_it_was_read_at(s3, data):
    uri, options, upload = _on_s3(s3, data)
    store = ObjectStore(uri.rsplit("/", 1)[0], {k: v for k, v in options[f"s3://{BUCKET}/"].items()
                                                if k not in FAST})
    prefix = uri.rsplit("/", 1)[1]
    kv = PrefetchStore(store, PrefetchBuffer(1 << 20, 8))
    key = f"{prefix}/plain/c/0/0"
    old, old_version = store.get(key), store.versions([key])[0]
    r = ByteRange(key, 2, 10)
    try:
        assert kv.prefetch([], [], [r], seq=1) == 1
        assert _until(lambda: kv.buffer.counters.requests_in_flight == 0)
        _write(data, 2)
        upload()
        new_version = store.versions([key])[0]
        assert new_version != old_version
        _, parts, _, versions = kv.get_many([], [r], versions=True)  # what a read at the prefetch would have seen
        assert bytes(parts[0]) == bytes(old)[2:12] and versions[0] == old_version
        assert kv.buffer.counters.held_bytes == 0 and len(kv.buffer) == 0  # read by its batch: gone
        _, parts, _, versions = kv.get_many([], [r], versions=True)  # a later read: the store's, as it is now
        assert bytes(parts[0]) == bytes(store.get(key))[2:12] and versions[0] == new_version
        # once a read states the new generation (a shard index read anew), what was prefetched at the old one
        # is never served: a reader that re-read the index retries for a fresh read
        other = ByteRange(key, 0, 8)
        _write(data, 3)
        upload()
        newest = store.versions([key])[0]
        assert kv.prefetch([], [], [other], seq=3) == 1
        assert _until(lambda: kv.buffer.counters.requests_in_flight == 0)
        _write(data, 4)
        upload()
        kv.get_each([ByteRange.suffix(key, 4)])  # states the newest generation
        _, parts, _, versions = kv.get_many([], [other], versions=True)
        assert versions[0] != newest and bytes(parts[0]) == bytes(store.get(key))[:8]
        assert kv.prefetch([], [], [other], seq=4) == 0  # a rewritten object is not prefetched again
        # a failed prefetch (a missing value) is read again: the store's answer, typed
        gone = f"{prefix}/plain/c/9/9"
        kv.prefetch([gone], [1 << 10], [ByteRange(gone, 0, 4)], seq=2)
        assert _until(lambda: kv.buffer.counters.requests_in_flight == 0)
        assert kv.get_many([gone], [])[0] == [None]
        with pytest.raises(NotFound):
            kv.get_many([], [ByteRange(gone, 0, 4)])
    finally:
        store.close()


def test_an_array_rewritten_between_prefetch_and_use_is_read_as_without_prefetch(s3, data, decode_path):
    # Batches prefetched before the rewrite are the old array's, whole (their ranges were read at the
    # generation their indexes came from); batches pushed after it are the new array's: their ranges, located
    # by the cached old indexes, come back from the new generation, and the indexes and chunks are read anew.
    uri, options, upload = _on_s3(s3, data)
    old = zarr_values(data, "sharded")
    boxes = _boxes(40, seed=4)
    with stoker.Pipeline(_config(options)) as p:
        p.push([stoker.Sample(f"{uri}/sharded", box) for box in boxes[:28]])
        for k in range(2):  # two pops: a view of a popped slot may outlive its release a while (Python path)
            got = _pop(p)
            assert all(np.array_equal(row, _crop(old, box)) for row, box in zip(got, boxes[4 * k:4 * k + 4]))
        # (not asserted: on the Python path a view of a released slot may linger until the next pop, so the
        # coordinator may wait for that slot before it plans further; the same without prefetch)
        _until(lambda: _counters(p).started > 0 and _counters(p).requests_in_flight == 0, timeout=5.0)
        _write(data, 2, hole=True)
        upload()
        new = zarr_values(data, "sharded")
        p.push([stoker.Sample(f"{uri}/sharded", box) for box in boxes[28:]])
        for k in range(2, 10):
            got = _pop(p)
            for row, box in zip(got, boxes[4 * k:4 * k + 4]):
                if k < 7:  # pushed before the rewrite: each value the old or the new one (a crop across
                    # shards may meet both, as without prefetch), never a chunk located by another's index
                    assert np.all((row == _crop(old, box)) | (row == _crop(new, box))), k
                else:
                    assert np.array_equal(row, _crop(new, box)), k
        assert _counters(p).started > 0 and _counters(p).used > 0, _counters(p)


def test_close_with_prefetches_in_flight_returns_promptly(http):
    http.latency_s = 3.0
    cfg = _config({http.url + "/": {**FAST, "timeout_s": 30.0}}, batch_size=2)
    p = stoker.Pipeline(cfg)
    try:
        p.push([stoker.Sample(f"{http.url}/plain", _chunk_box(n)) for n in range(40)])
        # the prefetches of several batches in flight, in several calls (a call per batch here)
        assert _until(lambda: _counters(p).requests_in_flight >= 8), _counters(p)
    finally:
        t0 = time.monotonic()
        p.close()
        took = time.monotonic() - t0
    assert took < 2.0, took
    assert len(p._coordinator.ahead.buffer) == 0


def test_local_arrays_never_prefetch(data, decode_path):
    boxes = _boxes(32)
    want = zarr_values(data, "sharded")
    with stoker.Pipeline(_config(None)) as p:
        p.push([stoker.Sample(os.path.join(data, "sharded"), box) for box in boxes])
        for k in range(len(boxes) // 4):
            got = _pop(p)
            assert all(np.array_equal(row, _crop(want, box)) for row, box in zip(got, boxes[4 * k:4 * k + 4]))
            assert len(p._coordinator.ahead.queue) <= 1  # one batch planned past the slots, as without prefetch
        assert _counters(p).started == 0


def test_the_knobs_are_validated():
    from stoker.errors import InvalidArgument

    for bad in [dict(prefetch_bytes=-1), dict(prefetch_requests=0), dict(prefetch_bytes=1.5),
                dict(prefetch_requests=True)]:
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            stoker.Config(**bad)
    assert stoker.Config(prefetch_bytes=0).prefetch_bytes == 0  # off


def test_the_generations_remembered_are_bounded(monkeypatch):
    """Every key read states its generation; a buffer remembers at most MAX_KNOWN_KEYS of them (the most recent),
    so a long run over a dataset of many objects does not grow it without bound, and a rewrite seen among the
    recent ones is still refused."""
    from stoker.storage import prefetch as pf

    monkeypatch.setattr(pf, "MAX_KNOWN_KEYS", 8)
    buffer = pf.PrefetchBuffer(1 << 20, 4)
    store = object()
    buffer.seen(store, [f"c/{i}" for i in range(100)], ["g1"] * 100)
    assert len(buffer._generations) == 8
    assert buffer._observe(id(store), "c/99", "g1")  # recent, same generation
    assert not buffer._observe(id(store), "c/99", "g2")  # rewritten: refused, and remembered so
    assert not buffer._observe(id(store), "c/99", "g1")
    buffer.seen(store, [f"d/{i}" for i in range(100)], ["g1"] * 100)
    assert len(buffer._generations) <= 8 and len(buffer._changed) <= 8


def _requests_of(http, paths) -> int:
    return sum(1 for x in list(http.paths) if x in paths)


def test_a_chunk_asked_for_a_queued_batch_is_shared_by_later_batches(http):
    # Every batch reads the same four chunk files (two a batch, alternating): with sharing, a later batch
    # queued behind one that asked a chunk gets it from that request (the server's log counts the requests),
    # and every batch equals zarr-python's.
    http.latency_s = 0.05
    cfg = _config({http.url + "/": FAST}, batch_size=2)
    n_batches = 24
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(f"{http.url}/plain", _chunk_box(n % 4)) for n in range(2 * n_batches)])
        chunks = {_chunk_path(n) for n in range(4)}
        assert _until(lambda: _counters(p).shared >= 8), _counters(p)
        want = zarr_values(http.root, "plain")
        for k in range(n_batches):
            got = _pop(p)
            assert np.array_equal(got[0], _crop(want, _chunk_box((2 * k) % 4))), k
            assert np.array_equal(got[1], _crop(want, _chunk_box((2 * k + 1) % 4))), k
        # 48 reads of 4 chunk files; without sharing each batch but the first two's prefetch asks its own
        asked = _requests_of(http, chunks)
        assert asked <= 2 * n_batches // 3, (asked, _counters(p))
        assert _counters(p).used >= _counters(p).shared > 0


def test_a_range_asked_before_a_push_serves_no_batch_of_it(http):
    # The freshness rule, on the buffer: an entry asked when one push had been made is shared by a later batch
    # of that push, not by a batch of a second push (which asks nothing: its batch reads itself), and once a
    # batch of the second push is submitted (fresh_from) it is served to no read.
    http.latency_s = 0.05
    store = ObjectStore(http.url, **FAST)
    try:
        kv = PrefetchStore(store, PrefetchBuffer(1 << 20, 8))
        key = _chunk_path(0).lstrip("/")
        r = ByteRange(key, 0, 16)
        assert kv.ask([], [], [r], seq=1, pushed=1, mark=1).started == 1
        assert kv.ask([], [], [r], seq=2, pushed=1, mark=1).shared == 1  # same push: one request, two uses
        late = kv.ask([], [], [r], seq=3, pushed=2, mark=2)  # a batch of a later push: neither
        assert (late.started, late.shared) == (0, 0) and kv.buffer.counters.skipped == 1
        assert _until(lambda: kv.buffer.counters.requests_in_flight == 0)
        assert http.paths.count("/" + key) == 1
        want = open(os.path.join(http.root, key), "rb").read()[:16]
        assert bytes(kv.get_many([], [r])[1][0]) == want and kv.buffer.counters.used == 1  # batch 1's use
        kv.buffer.fresh_from(2)  # a batch of the second push is submitted: the entry serves nobody now
        assert bytes(kv.get_many([], [r])[1][0]) == want
        assert kv.buffer.counters.used == 1 and http.paths.count("/" + key) == 2  # read from the store
    finally:
        store.close()


def test_planning_ahead_goes_on_while_no_slot_is_free(http):
    # The consumer pops nothing: both slots stay taken. Each batch's prefetch fills the buffer's requests
    # (prefetch_requests=2); once they end the coordinator plans the next batch and prefetches it, rather
    # than waiting in acquire for a slot nobody frees, so batch 8's chunks are asked with nothing popped.
    http.latency_s = 0.05
    cfg = _config({http.url + "/": FAST}, batch_size=2, prefetch_requests=2)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(f"{http.url}/plain", _chunk_box(n)) for n in range(40)])
        later = [_chunk_path(n) for n in (16, 17)]  # batch 8
        assert _until(lambda: all(x in http.paths for x in later)), (http.paths, _counters(p))
        assert _counters(p).peak_requests <= 2
        want = zarr_values(http.root, "plain")
        for k in range(20):
            got = _pop(p)
            assert np.array_equal(got[0], _crop(want, _chunk_box(2 * k)))
            assert np.array_equal(got[1], _crop(want, _chunk_box(2 * k + 1)))


def test_a_batch_prefetch_is_asked_in_calls_of_max_in_flight(http):
    # A store's call has at most max_in_flight requests open; a batch's 16 chunk files asked in one call
    # take four round trips at max_in_flight=4. Asked in four calls side by side they are all open at once
    # (the server holds each request until 16 were open together, 10 s at most: seen however loaded the
    # machine is; one call never opens more than 4)
    store = ObjectStore(http.url, **FAST, max_in_flight=4)
    try:
        keys = [_chunk_path(n).lstrip("/") for n in range(16)]
        store.get_many(keys, [])  # connections opened
        http.latency_s = 0.05
        http.peak_in_flight = 0
        store.get_many(keys, [])
        assert http.peak_in_flight <= 4, http.peak_in_flight
        http.latency_s = 0.0
        http.hold_until_in_flight(16, timeout_s=10.0, under="/plain/c/")
        kv = PrefetchStore(store, PrefetchBuffer(64 << 20, 64))
        assert kv.prefetch(keys, [1 << 16] * 16, [], seq=1) == 16
        assert _until(lambda: kv.buffer.counters.requests_in_flight == 0, timeout=60.0)
        assert http.peak_in_flight == 16, http.peak_in_flight
        http.hold_until_in_flight(None)
        values, _ = kv.get_many(keys, [])
        assert kv.buffer.counters.used == 16
        assert all(bytes(v) == open(os.path.join(http.root, k), "rb").read() for k, v in zip(keys, values))
    finally:
        store.close()


def test_a_batch_prefetch_makes_a_future_per_call_not_per_chunk(http, monkeypatch):
    # The coordinator asks tens of chunks a batch: a Future (a lock and a condition each) per chunk asked was
    # most of what asking cost it. The entries of one call share its future; what each serves is its own.
    import concurrent.futures
    import threading

    store = ObjectStore(http.url, **FAST, max_in_flight=4)
    try:
        keys = [_chunk_path(n).lstrip("/") for n in range(16)]
        made = {"n": 0}
        init = concurrent.futures.Future.__init__
        me = threading.get_ident()

        def counted(self):
            if threading.get_ident() == me:  # the asking thread's (the coordinator's), not the loop's
                made["n"] += 1
            init(self)

        kv = PrefetchStore(store, PrefetchBuffer(64 << 20, 64))
        monkeypatch.setattr(concurrent.futures.Future, "__init__", counted)
        assert kv.prefetch(keys, [1 << 16] * 16, [], seq=1) == 16
        monkeypatch.setattr(concurrent.futures.Future, "__init__", init)
        # four calls of max_in_flight=4: a future each, and the store's own for each call (before: 16 + 4)
        assert made["n"] <= 8, made
        assert _until(lambda: kv.buffer.counters.requests_in_flight == 0)
        values, _ = kv.get_many(keys, [])
        assert kv.buffer.counters.used == 16
        assert all(bytes(v) == open(os.path.join(http.root, k), "rb").read() for k, v in zip(keys, values))
        assert sum(1 for p in http.paths if p.lstrip("/") in keys) == 16  # each chunk asked once
    finally:
        store.close()


def test_the_arrays_of_batches_pulled_ahead_are_opened_together(tmp_path):
    # Every sample reads an array not opened yet (two a batch). Batches of remote arrays are pulled a few at
    # a time and their arrays opened together: the metadata of batches 1-6 is asked in a few round trips,
    # where opening them batch by batch takes two each (zarr.json, then again for its CF attributes): 12+.
    root = str(tmp_path / "many")
    rng = np.random.default_rng(5)
    arrays = {}
    for i in range(16):
        arr = zarr.create_array(os.path.join(root, f"a{i}"), shape=(32, 32), chunks=(16, 16), dtype="uint16",
                                compressors=ZstdCodec(level=1), fill_value=0)
        arr[...] = arrays[i] = rng.integers(0, 5000, size=(32, 32)).astype("uint16")
    server = RangeServer(root)
    try:
        server.latency_s = 0.3
        cfg = _config({server.url + "/": FAST}, batch_size=2)
        box = [(4, 20), (8, 24)]
        with stoker.Pipeline(cfg) as p:
            t0 = time.monotonic()
            p.push([stoker.Sample(f"{server.url}/a{i}", box) for i in range(16)])
            assert _until(lambda: "/a1/zarr.json" in server.paths)  # batch 0 opened
            t1 = time.monotonic()
            wanted = [f"/a{i}/zarr.json" for i in range(2, 14)]  # batches 1-6
            assert _until(lambda: all(w in server.paths for w in wanted), timeout=30.0), server.paths
            took = time.monotonic() - t1
            assert took < 10 * server.latency_s, (took, t1 - t0)
            for k in range(8):
                got = _pop(p)
                for j in range(2):
                    assert np.array_equal(got[j], _crop(arrays[2 * k + j], box))
    finally:
        server.latency_s = 0
        server.stop()


def test_the_default_requests_in_flight_do_not_cap_a_distant_store(tmp_path):
    # At the defaults a distant store has more than the old 64 requests open at once (the chunk files of
    # batches queued ahead, prefetched together), never more than requests_in_flight; the buffer asks at most
    # prefetch_requests, itself at most three quarters of requests_in_flight. (The server holds each chunk's
    # request until 65 have been open at once, 8 s at most: a client capped at 64 waits that long and fails the count, a
    # loaded machine only plans later.)
    root = str(tmp_path / "wide")
    arr = zarr.create_array(os.path.join(root, "w"), shape=(16, 1280), chunks=(8, 8), dtype="uint8",
                            compressors=ZstdCodec(level=1), fill_value=0)
    arr[...] = want = np.random.default_rng(6).integers(0, 255, size=(16, 1280)).astype("uint8")
    server = RangeServer(root)
    try:
        server.latency_s = 0.6  # batches queued ahead asked together
        server.hold_until_in_flight(65, timeout_s=8.0, under="/w/c/")
        cfg = _config({server.url + "/": FAST}, batch_size=16)
        assert (cfg.requests_in_flight, cfg.prefetch_requests) == (512, 384)
        boxes = [[(8 * (n % 2), 8 * (n % 2) + 8), (8 * (n // 2), 8 * (n // 2) + 8)] for n in range(320)]
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(f"{server.url}/w", box) for box in boxes])
            for k in range(20):
                got = _pop(p)
                for row, box in zip(got, boxes[16 * k:16 * k + 16]):
                    assert np.array_equal(row, _crop(want, box))
            counters = _counters(p)
            assert counters.peak_requests <= 384
        assert 64 < server.peak_in_flight <= 512, (server.peak_in_flight, counters)
    finally:
        server.latency_s = 0
        server.hold_until_in_flight(None)
        server.stop()
    tight = stoker.Pipeline(_config(None, requests_in_flight=8))
    try:
        assert tight._coordinator.ahead.buffer.max_requests == 6
    finally:
        tight.close()


def test_prefetched_ranges_a_gap_apart_are_not_merged(http, data):
    # The store merges ranges of one object less than max_gap apart into one read (gap included). Prefetched
    # ranges of one object a gap apart go in separate calls, so each is read alone (the gap's bytes, the
    # chunks of other batches, are not read and thrown away); ranges that touch are read as one.
    store = ObjectStore(http.url, **FAST)
    try:
        kv = PrefetchStore(store, PrefetchBuffer(1 << 20, 16))
        shard = "sharded/c/0/0"
        size = os.path.getsize(os.path.join(data, shard))
        apart = [ByteRange(shard, 0, 64), ByteRange(shard, size // 2, 64)]
        touching = [ByteRange(shard, 200, 50), ByteRange(shard, 250, 50)]
        before = http.paths.count("/" + shard)
        assert kv.prefetch([], [], apart + touching, seq=1) == 4
        assert _until(lambda: kv.buffer.counters.requests_in_flight == 0)
        assert http.paths.count("/" + shard) - before == 3  # two apart, one for the two that touch
        _, parts = kv.get_many([], apart + touching)
        whole = open(os.path.join(data, shard), "rb").read()
        assert [bytes(x) for x in parts] == [whole[r.start:r.start + r.length] for r in apart + touching]
        assert kv.buffer.counters.used == 4
    finally:
        store.close()


class _BreaksOnce:
    """A user's sample iterator that raises at its 17th ``next()`` (a KeyError: a broken sampler), and would
    give more samples if asked again; counts the calls made after it raised."""

    def __init__(self, uri: str, boxes: list) -> None:
        self.uri, self.boxes, self.calls, self.after = uri, boxes, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.calls += 1
        if self.calls == 17:
            raise KeyError("source broke")
        if self.calls > 17:
            self.after += 1
        if self.calls > len(self.boxes):
            raise StopIteration
        return stoker.Sample(self.uri, self.boxes[self.calls - 1])


def test_nothing_is_pulled_from_any_source_once_one_raised(http):
    # Batches of remote arrays are pulled several at a time: the one that meets the source's error ends the
    # pulling, as one batch at a time does. The broken source is not asked again, a source pushed behind it
    # (the next epoch's sampler) is dropped unread, and the consumer gets the batches before it, then the error.
    http.latency_s = 0.02
    boxes = _boxes(40)
    broken = _BreaksOnce(f"{http.url}/plain", boxes)
    behind = []

    def next_epoch():
        for box in boxes:
            behind.append(box)
            yield stoker.Sample(f"{http.url}/plain", box)

    want = zarr_values(http.root, "plain")
    with stoker.Pipeline(_config({http.url + "/": FAST})) as p:
        p.push(broken)
        p.push(next_epoch())
        for k in range(4):
            got = _pop(p)
            for j in range(4):
                assert np.array_equal(got[j], _crop(want, boxes[4 * k + j]))
        with pytest.raises(stoker.InvalidArgument, match="source broke") as raised:
            p.pop()
        assert isinstance(raised.value.__cause__, KeyError), raised.value.__cause__
        time.sleep(0.5)  # (the coordinator's rounds after the error: none may pull)
    assert broken.calls == 17 and broken.after == 0, broken.calls
    assert behind == []


def test_a_prefetch_whose_keeping_raises_still_settles_its_readers(http, monkeypatch):
    # Keeping what a call brought raised for one of its chunks (a bug): its call's future was never settled,
    # and a read waiting on it hung until its own bound. Now every entry's future is settled (the entry that
    # raised served nothing: its read fetches it), and the error is counted and warned of once.
    store = ObjectStore(http.url, **FAST, max_in_flight=4)
    try:
        keys = [_chunk_path(n).lstrip("/") for n in range(8)]
        kv = PrefetchStore(store, PrefetchBuffer(64 << 20, 64))
        real = kv.buffer._observe
        raised = []

        def observe_once(sid, key, generation):
            if not raised:
                raised.append(key)
                raise RuntimeError("a broken observe")
            return real(sid, key, generation)

        monkeypatch.setattr(kv.buffer, "_observe", observe_once)
        http.latency_s = 0.2
        with pytest.warns(RuntimeWarning, match="a broken observe") as warned:
            assert kv.prefetch(keys, [1 << 16] * 8, [], seq=1) == 8
            out = kv.start_get_many(keys, [])  # waits on the calls in flight
            out.result(timeout=15)  # before: never settled (a TimeoutError here)
            values = kv.result_of(out)[0]
            assert _until(lambda: kv.buffer.counters.requests_in_flight == 0)
        assert all(bytes(v) == open(os.path.join(http.root, k), "rb").read() for k, v in zip(keys, values))
        assert raised and kv.buffer.counters.errors == 1
        assert kv.buffer.counters.used == 7  # the chunk whose keeping raised was fetched by the read
        assert len([w for w in warned if "prefetch" in str(w.message)]) == 1
    finally:
        store.close()


def test_a_failing_late_look_up_of_kept_entries_is_counted_and_warned_of(http, tmp_path, monkeypatch):
    # Values a disk cache keeps, their generations unknown, are looked up again once revalidated (_later, on
    # a cache reader thread). That look-up raising (a bug) was dropped silently, and the late prefetch quietly
    # stopped. Now it is counted and warned of once, and the reads still get every value right.
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.locate import Stores

    options = {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
    a = stoker.open_array(f"{http.url}/plain", options, stores=Stores())
    np.testing.assert_array_equal(a.read((slice(0, 64), slice(0, 256))), zarr_values(http.root, "plain"))
    kept = a.kv
    while not isinstance(kept, CachingStore):
        kept = kept.store
    assert kept.cache.flush(30)
    fresh = CachingStore(kept.store, kept.cache)  # nothing known: every kept key looked up once revalidated
    kv = PrefetchStore(fresh, PrefetchBuffer(64 << 20, 64))
    keys = [_chunk_path(n).lstrip("/") for n in range(8)]
    real, calls = fresh.kept_entries, []

    def broken_after_first(names):
        calls.append(list(names))
        if len(calls) > 1:
            raise RuntimeError("a broken kept_entries")
        return real(names)

    monkeypatch.setattr(fresh, "kept_entries", broken_after_first)
    with pytest.warns(RuntimeWarning, match="a broken kept_entries") as warned:
        assert kv.prefetch(keys, [1 << 16] * 8, [], seq=1) == 0  # kept: revalidated, not fetched
        # the warning itself waited for (it comes from a cache reader thread), then the count
        assert _until(lambda: any("a broken kept_entries" in str(w.message) for w in warned))
        assert _until(lambda: kv.buffer.counters.errors == 1)  # before: no count, nothing said
    assert len(calls) == 2 and sorted(calls[1]) == sorted(keys)
    values = kv.get_many(keys, [])[0]
    assert all(bytes(v) == open(os.path.join(http.root, k), "rb").read() for k, v in zip(keys, values))


def test_errors_of_a_prefetch_are_each_counted_and_warned_of_once(http):
    buf = PrefetchBuffer(64 << 20, 64)
    store = ObjectStore(http.url, **FAST)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            buf.report_error(store, "keeping 2 values", RuntimeError("first"))
            buf.report_error(store, "keeping 3 values", RuntimeError("second"))
        assert buf.counters.errors == 2
        assert [str(w.message).count("first") for w in warned] == [1]  # one warning, of the first
    finally:
        store.close()


def test_a_prefetch_error_warned_of_as_an_error_still_wakes_the_coordinator(http, monkeypatch):
    # Under warnings-as-errors (pytest -W error, a project's filterwarnings = error) report_error's warning
    # raised in _arrived before on_room, the coordinator's wake, which was skipped: it planned no more until
    # its own timeout. Now on_room runs whatever the report raised, and the error is counted.
    store = ObjectStore(http.url, **FAST, max_in_flight=4)
    try:
        keys = [_chunk_path(n).lstrip("/") for n in range(4)]
        kv = PrefetchStore(store, PrefetchBuffer(64 << 20, 64))
        woken: list[int] = []
        kv.buffer.on_room = lambda: woken.append(1)

        def observe(sid, key, generation):
            raise RuntimeError("a broken observe")

        monkeypatch.setattr(kv.buffer, "_observe", observe)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                kv.prefetch(keys, [1 << 16] * 4, [], seq=1)
            except RuntimeWarning:  # its call came back at once: the warning raised to the asker
                pass
            assert _until(lambda: kv.buffer.counters.requests_in_flight == 0 and kv.buffer.counters.errors == 1)
            assert _until(lambda: woken)  # before: never woken
    finally:
        store.close()


def test_the_disk_cache_attributes_a_batch_reads_are_reached_without_the_fallback(http, tmp_path, monkeypatch):
    # what the coordinator reads of a PrefetchStore every batch is the disk cache's, through a property, not
    # __getattr__'s fallback (an AttributeError raised and caught first); one the store lacks is still missing
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.diskcache import DiskCache

    hot = ("fetched", "cache", "changes", "settled", "revalidate", "fresh_until", "listed", "lists_any")
    fallback: list[str] = []
    getattr_ = PrefetchStore.__getattr__
    monkeypatch.setattr(PrefetchStore, "__getattr__", lambda self, name: fallback.append(name) or getattr_(self, name))
    kv = CachingStore(ObjectStore(http.url), DiskCache(str(tmp_path / "cache"), 1 << 20))
    buffer = PrefetchBuffer(1 << 20, 4)
    try:
        wrapped = PrefetchStore(kv, buffer)
        for name in hot:
            assert getattr(wrapped, name) == getattr(kv, name)
        assert wrapped.cache is kv.cache and wrapped.lists_any() is False
        assert fallback == []
        bare = PrefetchStore(ObjectStore(http.url), buffer)  # no disk cache: none of them
        assert all(getattr(bare, name, None) is None for name in hot)
    finally:
        buffer.close()
        kv.close()
