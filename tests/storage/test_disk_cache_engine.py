"""A pipeline's disk-cache hits read by the compiled engine (csrc/entries.c), as local files are: against moto's
S3 server and the loopback HTTP server, once a pipeline knows an object's generation its cached chunks (whole
values, and ranges of shards) are read, checked and decoded on the engine's threads, never in Python; an entry
with a flipped payload bit, a truncated one and one evicted (unlinked) between planning and reading are never
served: each is fetched again, and every read equals zarr-python's."""

from __future__ import annotations

import collections
import threading
import os
import time

import numpy as np
import pytest
import torch

import stoker
from stoker.engine.cpu import decode_native, entry_table, native
from stoker.engine.pipeline import prefetch as ahead
from stoker.storage import cachingstore
from stoker.storage.diskcache import DiskCache, disk_cache

from batch_oracle import host_executor
from cached_arrays import ARRAYS, BOXES, cache_folder, damage_entries, payloads, remote_fixture, upload
from cached_arrays import check_batch as _batch, write as _write
from store_fixtures import (FAST_REMOTE, empty_s3_fixture, range_server_fixture, read_tree, written_tree_fixture,
                            zarr_values)

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(native.Engine is None or not native.zstd, reason="no compiled engine")]

FAST = FAST_REMOTE

s3 = empty_s3_fixture()
data = written_tree_fixture(_write)
http = range_server_fixture()
remote = remote_fixture("engine")


class _Reads:
    """Counts the chunk entries read in Python (DiskCache.get_many, the real one, still called; an array's
    zarr.json, which its open reads from disk, apart), the entries handed to the engine (those of each
    engine job reading disk-cache entries: decode_native._FromDisk), the chunks whose entries the decoder
    asked its stores about (not found in its table: NativeDecoder._asked), the entry files
    made (DiskCache.entry_file) and the batches found whole in the table by its compiled look-up
    (EntryTable.hits)."""

    def __init__(self, monkeypatch) -> None:
        self.python = self.engine = self.made = self.asked = self.compiled = 0
        get_many, entry_file = DiskCache.get_many, DiskCache.entry_file
        asked = decode_native.NativeDecoder._asked
        hits = entry_table.EntryTable.hits
        reads = self

        def counted_hits(table, *args):
            found = hits(table, *args)
            reads.compiled += found is not None
            return found

        def counted_asked(decoder, plan, them, *args):
            reads.asked += len(them)
            return asked(decoder, plan, them, *args)

        class CountedFromDisk(decode_native._FromDisk):
            __slots__ = ()

            def __init__(self, stores, owner, kind, sources) -> None:
                reads.engine += len(owner)
                super().__init__(stores, owner, kind, sources)

        def counted_get_many(cache, idents, read_files=None):
            self.python += sum(1 for i in idents if not i.endswith("\nkept")
                               and i.split("\n")[1].rsplit("/", 1)[-1] not in cachingstore.DOCUMENTS)
            return get_many(cache, idents, read_files)

        def counted_entry_file(cache, ident):
            self.made += 1
            return entry_file(cache, ident)

        monkeypatch.setattr(DiskCache, "get_many", counted_get_many)
        monkeypatch.setattr(DiskCache, "entry_file", counted_entry_file)
        monkeypatch.setattr(decode_native, "_FromDisk", CountedFromDisk)
        monkeypatch.setattr(decode_native.NativeDecoder, "_asked", counted_asked)
        monkeypatch.setattr(entry_table.EntryTable, "hits", counted_hits)


def _config(options: dict, folder, **knobs) -> stoker.Config:
    # no prefetch: each batch is planned after the one before it is made, so what it knows is what they learnt
    knobs = {"batch_size": len(BOXES), "dtype": "native", "n_compute_threads": 2, "pop_timeout_s": 60,
             "prefetch_bytes": 0, **knobs}
    return stoker.Config(storage_options=options, cache_dir=str(folder), cache_bytes=64 << 20, **knobs)


def _first_epoch(cfg: stoker.Config, cache: DiskCache, uri: str, data: str, path: str) -> None:
    """An epoch in a pipeline of its own: the batch of ``path``'s crops fetched, checked and kept on disk."""
    with stoker.Pipeline(cfg) as p:
        _batch(p, uri, data, path)
    assert cache.flush(30)


@pytest.mark.parametrize("path", list(ARRAYS))
def test_hits_of_known_generations_are_read_by_the_engine(remote, data, tmp_path, monkeypatch, path):
    uri, options, server = remote
    folder, cache = cache_folder(tmp_path)
    _first_epoch(_config(options, folder), cache, uri, data, path)
    reads = _Reads(monkeypatch)
    with stoker.Pipeline(_config(options, folder)) as p:  # epoch 2, a new pipeline
        _batch(p, uri, data, path)
        first = reads.python
        if server is None:  # S3 lists the array's prefix when it opens: the first batch's chunks (not the
            assert reads.engine > 0  # shard indexes, which planning reads in Python) go to the engine already
            if path == "plain":
                assert first == 0
        else:  # HTTP: the first batch revalidates (HEAD) and reads the hits in Python
            assert first > 0
        hits, hit_bytes = cache.hits, cache.hit_bytes
        asked = server.requests if server else None
        _batch(p, uri, data, path)  # generations known now: the engine reads every entry itself
        assert reads.python == first, "a hit of a known generation was read in Python"
        assert reads.engine > 0
        assert cache.hits > hits and cache.hit_bytes > hit_bytes  # counted as the cache's hits
        if server is not None:
            assert server.requests == asked  # no request at all: no refetch, no revalidation


@pytest.mark.parametrize("path", list(ARRAYS))
def test_what_was_never_kept_is_not_handed_to_the_engine(remote, data, tmp_path, monkeypatch, path):
    # a cold cache: a shard's index read by planning states the shard's generation, yet none of its inner
    # chunks' ranges is on disk; those are fetched (or prefetched), not handed to the engine to find missing
    # and then fetched while the batch waits. Once kept, they are
    uri, options, _ = remote
    folder, cache = cache_folder(tmp_path)
    reads = _Reads(monkeypatch)
    with stoker.Pipeline(_config(options, folder)) as p:
        _batch(p, uri, data, path)
        assert reads.engine == 0, reads.engine
        assert cache.flush(30)
        _batch(p, uri, data, path)
        assert reads.engine > 0


def test_a_batch_of_many_arrays_asks_its_store_once(remote, data, tmp_path, monkeypatch):
    # the decoder asks a store's disk cache for the entries of a batch's chunks its table does not hold in one
    # call, however many of the store's arrays the batch reads (it asked once per array: a batch of crops of 8
    # arrays, 8 calls); in the pipeline's second epoch its table holds every entry its fetches made: no call
    uri, options, _ = remote
    folder, cache = cache_folder(tmp_path)
    calls: list[int] = []
    real = decode_native.NativeDecoder._asked

    def counted(decoder, plan, them, *args):
        calls.append(len(them))
        return real(decoder, plan, them, *args)

    monkeypatch.setattr(decode_native.NativeDecoder, "_asked", counted)
    cfg = _config(options, folder, batch_size=2 * len(ARRAYS), dtype="i64")
    samples = [stoker.Sample(f"{uri}/{path}", box) for path in ARRAYS for box in BOXES[:2]]
    per_epoch = []
    with stoker.Pipeline(cfg) as p:
        for epoch in range(2):
            del calls[:]
            p.push(samples)
            with p.pop() as b:
                for got, s in zip(torch.from_dlpack(b), samples):
                    want = zarr_values(data, s.uri.rsplit("/", 1)[1])
                    np.testing.assert_array_equal(got.numpy(), want[tuple(slice(*a) for a in s.aabb)])
            assert cache.flush(30)
            per_epoch.append(list(calls))
    chunks = per_epoch[0][0] if per_epoch[0] else 0
    # the first batch: every chunk asked, of both arrays, in one call; the second: none (the table's)
    assert len(per_epoch[0]) == 1 and chunks >= 2 * len(ARRAYS), per_epoch
    assert per_epoch[1] == [], per_epoch
    with stoker.Pipeline(cfg) as p:  # a new pipeline (an empty table): every chunk asked again, in one call
        del calls[:]
        p.push(samples)
        with p.pop() as b:
            pass
    assert calls == [chunks], calls


@pytest.mark.parametrize("path", list(ARRAYS))
def test_a_hit_touches_its_entry_at_most_once_a_minute(remote, data, tmp_path, path):
    # the LRU clock: a hit on an entry last used (or written) a minute ago or more sets its mtime to now; one
    # used within the minute is not touched again (as relatime: no futimens, no dirty inode per hit)
    uri, options, _ = remote
    folder, cache = cache_folder(tmp_path)

    def dated(age_s: float) -> dict[str, float]:
        """Every entry with a payload (not the markers) dated ``age_s`` ago: {path: that mtime}."""
        when = time.time() - age_s
        entries = payloads(folder)
        for e in entries:
            os.utime(e, (when, when))
        return {e: os.stat(e).st_mtime for e in entries}

    with stoker.Pipeline(_config(options, folder)) as p:
        _batch(p, uri, data, path)
        assert cache.flush(30)
        old = dated(3600)
        hits = cache.hits
        _batch(p, uri, data, path)
        assert cache.hits > hits
        touched = [e for e, t in old.items() if os.stat(e).st_mtime > t + 3000]
        assert touched  # the entries read: used now
        recent = dated(5)
        _batch(p, uri, data, path)
        again = [e for e, t in recent.items() if os.stat(e).st_mtime != t]
        assert not again, again  # read again within the minute: not touched


@pytest.mark.parametrize("damage", ["flip", "truncate", "unlink"])
@pytest.mark.parametrize("path", list(ARRAYS))
def test_an_unsound_entry_read_by_the_engine_is_fetched_again(remote, data, tmp_path, monkeypatch, damage, path):
    # the pipeline learns every generation from its first batch's answers; the entries are then damaged (or
    # evicted) before the second batch is planned and read: the engine reads none of them as sound, and
    # each chunk is fetched again (a corrupt entry removed and written anew), with zarr-python's values
    uri, options, server = remote
    folder, cache = cache_folder(tmp_path)
    reads = _Reads(monkeypatch)
    with stoker.Pipeline(_config(options, folder)) as p:
        _batch(p, uri, data, path)
        assert cache.flush(30)
        damage_entries(folder, damage)  # the entries with a payload (not the empty markers)
        engine, corrupt, misses = reads.engine, cache.corrupt, cache.misses
        asked = server.requests if server else None
        _batch(p, uri, data, path)
        assert reads.engine > engine  # handed to the engine, which found them unsound
        assert cache.misses > misses  # then fetched from the store
        if damage != "unlink":
            assert cache.corrupt > corrupt  # found corrupt again in Python, removed, and written anew
        if server is not None:
            assert server.requests > asked
        assert cache.flush(30)
        hits = cache.hits
        _batch(p, uri, data, path)  # the entries written anew are sound: served from disk again
        assert cache.hits > hits


def test_an_entry_queued_for_writing_is_not_handed_to_the_engine(tmp_path):
    # put queues the write; while the writer waits (another holder of the folder's lock), the entry is not
    # on disk, so entry_file says None and the chunk is fetched as before, not read by the engine as missing
    # and then fetched (and queued) once more
    cache = DiskCache(str(tmp_path / "c"), 64 << 20)
    assert cache.write("first", b"a" * 100)  # the folder and its lock file made
    import fcntl

    lock = os.open(tmp_path / "c" / "v1" / ".index", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        cache.put("second", b"b" * 5000)
        assert cache.entry_file("second") is None
        assert cache.entry_file("first") == (os.fsencode(cache.path("first")), b"first")
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
    assert cache.flush(30)
    assert cache.entry_file("second") == (os.fsencode(cache.path("second")), b"second")


def test_a_write_ticket_settles_once_the_entry_is_on_disk(tmp_path):
    # what a decoder's table checks before handing a queued entry to the engine: the ticket a put took is past
    # the writer's settled count while the writer waits (another holder of the folder's lock), and within it
    # once the entry is written; the writer settles in queue order
    cache = DiskCache(str(tmp_path / "c"), 64 << 20)
    assert cache.write("first", b"a" * 100)
    assert cache.tickets == cache.settled == 0  # written at once, never queued
    import fcntl

    lock = os.open(tmp_path / "c" / "v1" / ".index", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        for n in range(3):
            cache.put(f"queued {n}", bytes([n]) * 5000)
        ticket = cache.tickets
        assert ticket == 3 and cache.settled < ticket
        assert not os.path.exists(cache.path("queued 2"))
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
    assert cache.flush(30)
    assert cache.settled == ticket and os.path.exists(cache.path("queued 2"))


@pytest.mark.parametrize("path", list(ARRAYS))
def test_an_entry_a_fetch_queued_is_handed_to_the_engine_only_once_written(s3, data, tmp_path, monkeypatch, path):
    # the decoder's table keeps what each fetch queued for writing (no look-up per chunk in the next epoch);
    # while the folder's writer waits (another process holds its lock) those entries are not on disk: the
    # next batch reads them from the write queue, never has the engine find them missing; once written, the
    # batch after finds them in the table (nothing asked of the store) and the engine reads them
    uri, options, _ = upload(s3, data, "queued")
    folder, cache = cache_folder(tmp_path)
    cfg = _config(options, folder, cache_staleness_s=600.0)
    assert cache.write("first", b"a" * 100)  # the folder and its lock file made
    import fcntl

    with stoker.Pipeline(cfg) as p:
        reads = _Reads(monkeypatch)
        lock = os.open(folder / "v1" / ".index", os.O_RDWR)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _batch(p, uri, data, path)  # fetched: entries queued, and kept in the table with their tickets
            _batch(p, uri, data, path)  # not written yet: from the queue, none to the engine
            assert reads.engine == 0 and cache.settled < cache.tickets
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
        assert cache.flush(30)
        asked = reads.asked
        _batch(p, uri, data, path)  # written: from the table, read by the engine
        assert reads.engine > 0 and reads.asked == asked, (reads.engine, reads.asked, asked)


def test_entry_rows_give_a_queued_entry_its_ticket_and_one_on_disk_none(http, data, tmp_path):
    # CachingStore.entry_rows, what a decoder keeps in its table: an entry this wrapper queued comes with the
    # cache's ticket (found by the table once settled), one found on disk by another wrapper with ticket 0;
    # each with until = when its generation was learnt + the staleness bound; an unknown generation: None
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.objectstore import ObjectStore

    folder = str(tmp_path / "cache")
    kv = CachingStore(ObjectStore(http.url, **FAST), DiskCache(folder, 64 << 20), staleness_s=600.0)
    key = sorted(k for k in read_tree(data) if k.startswith("plain/c/"))[0]
    assert kv.entry_rows([key], []) == [None]  # no generation known
    before = time.monotonic()
    kv.get_many([key], [])  # fetched: its generation learnt, its entry queued
    rows = kv.entry_rows([key], [])
    path, ident, until, ticket = rows[0]
    assert 0 < ticket <= kv.cache.tickets and before + 600.0 <= until <= time.monotonic() + 600.0
    assert kv.entries_made([key], []) == rows
    assert kv.cache.flush(30) and kv.settled >= ticket and os.path.exists(os.fsdecode(path))
    other = CachingStore(ObjectStore(http.url, **FAST), DiskCache(folder, 64 << 20), staleness_s=600.0)
    other.get_many([key], [])  # a hit: its generation learnt, its entry found on disk
    found = other.entry_rows([key], [])[0]
    assert found[:2] == (path, ident) and found[3] == 0
    kv.close()
    other.close()


def test_what_the_prefetch_buffer_holds_is_not_read_from_disk_again(http, data, tmp_path):
    # a value prefetched (its bytes read from disk into the buffer, or its request in flight) is served from
    # the buffer: entry_files says None for it, so the engine does not read its entry a second time
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.objectstore import ObjectStore
    from stoker.storage.prefetch import PrefetchBuffer, PrefetchStore
    from stoker.storage.store import ByteRange

    cache = disk_cache(str(tmp_path / "cache"), 64 << 20)
    store = ObjectStore(http.url, **FAST)
    kv = CachingStore(store, cache)
    keys = sorted(k for k in read_tree(data) if k.startswith("plain/c/"))[:3]
    ranges = [ByteRange("sharded/c/0/0", 0, 16)]
    kv.get_many(keys, ranges)  # fetched: generations known, entries written
    assert cache.flush(30)
    assert all(e is not None for e in kv.entry_files(keys, ranges))
    buffer = PrefetchBuffer(64 << 20, 16)
    pkv = PrefetchStore(kv, buffer)
    # a whole value the cache keeps is not fetched ahead (its generation is asked; the engine reads its entry),
    # a range is (a kept object need not hold that range's entry)
    assert pkv.ask(keys[:1], [1 << 20], ranges, seq=1).started == 1
    found = pkv.entry_files(keys, ranges)
    assert found[3] is None  # held by the buffer
    assert found[:3] == kv.entry_files(keys, [])  # the rest: read from disk by the engine
    assert PrefetchStore(store, buffer).entry_files is None  # no disk cache: nothing to read from disk
    buffer.close()
    store.close()


def test_a_range_of_a_whole_value_read_in_the_same_call_is_cut_from_it(http, data, tmp_path, monkeypatch):
    # one call asking an object's whole value and a range of it (kept whole only): the value is read from
    # disk once, and the range cut from it, equal to the object's bytes
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.objectstore import ObjectStore
    from stoker.storage.store import ByteRange

    cache = disk_cache(str(tmp_path / "cache"), 64 << 20)
    store = ObjectStore(http.url, **FAST)
    kv = CachingStore(store, cache)
    key = sorted(k for k in read_tree(data) if k.startswith("plain/c/"))[0]
    kv.get_many([key], [])
    assert cache.flush(30)
    reads = _Reads(monkeypatch)
    values, parts = kv.get_many([key], [ByteRange(key, 3, 10)])
    whole = read_tree(data)[key]
    assert bytes(values[0]) == whole and bytes(parts[0]) == whole[3:13]
    assert reads.python == 2  # the range's own entry (none), then the whole value once
    store.close()


@pytest.mark.filterwarnings("ignore:stoker's disk cache:RuntimeWarning")  # it stops caching: can write no entry
def test_entry_paths_too_long_for_the_engine_are_fetched(remote, data, tmp_path):
    # a cache folder so deep that its entries' paths reach the engine's PATH_CAP (4096 bytes, as Linux's
    # PATH_MAX: no entry can be written there either): the hits it would hand the engine are fetched instead,
    # and the batch is whole, rather than the engine refusing the whole batch's tables
    uri, options, _ = remote
    folder = str(tmp_path)
    while len(folder) < native.PATH_CAP - 26 - 200:
        folder += "/" + "d" * 200
    folder += "/" + "c" * (native.PATH_CAP - 26 - len(folder) - 1)  # an entry: folder/v1/ab/ + 32 hex digits
    os.makedirs(folder)
    assert len(folder) + 36 >= native.PATH_CAP > len(folder) + 3
    for path in ARRAYS:
        with stoker.Pipeline(_config(options, folder)) as p:
            for _ in range(3):
                _batch(p, uri, data, path)


class _Asked:
    """Counts each key and range the pipeline asks ``CachingStore.entry_files`` (the prefetch) or ``entry_rows``
    (the decoder, for what its table does not hold) about (the real ones answer), and the batches prefetched
    (``prefetch_plan``, the real one) with the entries they found on disk."""

    def __init__(self, monkeypatch) -> None:
        self.asked: collections.Counter = collections.Counter()
        self.planned: list[int] = []  # per batch planned ahead: its chunks found on disk
        real, rows, plan = cachingstore.CachingStore.entry_files, cachingstore.CachingStore.entry_rows, \
            ahead.prefetch_plan

        def counted(kv, keys, requests):
            self.asked.update(keys)
            self.asked.update((r.key, r.start, r.length) for r in requests)
            return real(kv, keys, requests)

        def counted_rows(kv, keys, requests):
            self.asked.update(keys)
            self.asked.update((r.key, r.start, r.length) for r in requests)
            return rows(kv, keys, requests)

        def prefetched(table, *args):
            out = plan(table, *args)
            self.planned.append(len(getattr(table, "disk_entries", None) or ()))
            return out

        monkeypatch.setattr(cachingstore.CachingStore, "entry_files", counted)
        monkeypatch.setattr(cachingstore.CachingStore, "entry_rows", counted_rows)
        monkeypatch.setattr(ahead, "prefetch_plan", prefetched)


#: 8 x 8 crops in 12 different chunks of "plain" (16 x 16) and 12 different inner chunks of "sharded" (8 x 8)
ONE_EACH = [[(16 * i, 16 * i + 8), (16 * j, 16 * j + 8)] for i in range(4) for j in range(3)]


def _six_batches(p, asked: _Asked, uri: str, want) -> None:
    """The crops of ONE_EACH in six batches of two, pushed at once; popped (each checked) once batches 3 to 6
    were planned ahead of their slots (two slots, not released meanwhile)."""
    planned = len(asked.planned)
    for k in range(0, len(ONE_EACH), 2):
        p.push([stoker.Sample(uri, box) for box in ONE_EACH[k:k + 2]])
    deadline = time.monotonic() + 20
    while len(asked.planned) < planned + 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    for k in range(0, len(ONE_EACH), 2):
        with p.pop() as b:
            for got, box in zip(torch.from_dlpack(b), ONE_EACH[k:k + 2]):
                np.testing.assert_array_equal(got.numpy(), want[tuple(slice(*s) for s in box)])
    assert len(asked.planned) == planned + 4, asked.planned


@pytest.mark.parametrize("path", list(ARRAYS))
def test_each_chunk_of_a_batch_is_asked_of_the_disk_cache_once(remote, data, tmp_path, monkeypatch, path):
    # batches planned ahead of their slots are prefetched: their chunks on disk were asked of the cache's
    # entry_files by the prefetch, and the decoder reads them from disk without asking again; those it
    # prefetched are not asked again either. A chunk asked twice in a batch was the prefetch's and the
    # decoder's look-up each
    uri, options, server = remote
    folder, cache = cache_folder(tmp_path)
    want = zarr_values(data, path)
    cfg = stoker.Config(batch_size=2, dtype="native", n_compute_threads=2, pop_timeout_s=60, lookahead_batches=1,
                        storage_options=options, cache_dir=str(folder), cache_bytes=64 << 20)

    def chunks(asked: _Asked) -> list[int]:
        """How often each chunk (not a document) was asked."""
        return sorted(n for what, n in asked.asked.items() if "/c/" in (what if isinstance(what, str) else what[0]))

    # a cold pipeline (fetched, prefetched), then a new one over what it kept (hits, or, planned ahead while
    # their generations are being asked, whole values asked again by the decoder: kept ones are not fetched
    # ahead, so their entries are read by the engine, not read in Python into the buffer), which reads them
    # all again once it knows every generation
    for epoch in (1, 2):
        asked = _Asked(monkeypatch)
        with stoker.Pipeline(cfg) as p:
            _six_batches(p, asked, f"{uri}/{path}", want)
            assert cache.flush(30)
            if epoch == 2 and path == "plain":
                # 8: batches 3 to 6's, planned before their generations were known (no stat then), looked up
                # again once known to prefetch what is not on disk (a stat, on a cache reader thread, remembered:
                # a marker outlives evicted entries), then by the decoder (remembered: no stat)
                found = chunks(asked)
                assert found[:4] == [1] * 4 and set(found[4:]) <= {1, 2, 3}, found
            else:
                assert chunks(asked) == [1] * 12, (epoch, chunks(asked))
            if epoch == 2:
                asked.asked.clear()
                found, hits = sum(asked.planned), cache.hits
                _six_batches(p, asked, f"{uri}/{path}", want)
                # batches 3 to 6's 8 chunks asked once, by their prefetch; batches 1 and 2's 4 (not planned
                # ahead: the decoder's look-up) once too, or not at all where the decoder's table holds the
                # entries it was given in the pass before: its entries are stale once their store's stamp
                # moves on, and each lasts while its generation is known, so any of the 4 may be asked. None
                # is asked twice
                counts = chunks(asked)
                assert set(counts) == {1} and 8 <= len(counts) <= 12, (len(counts), counts)
                # batches 3 to 6 found their 8 chunks on disk when planned: all 12 read by the engine from disk
                assert sum(asked.planned) - found == 8 and cache.hits - hits == 12, (asked.planned, cache.hits)
        monkeypatch.undo()


def _planned_while_held(p, asked: _Asked, uri: str, boxes: list, want, expect: int) -> int:
    """Push a batch of one crop per box of ``boxes``; with the two slots taken and not released, the batches
    planned ahead of them (``prefetch_plan`` calls) once ``expect`` were (or 20 s passed) and half a second
    more; then pop each (checked). Returns that count."""
    planned = len(asked.planned)
    for box in boxes:
        p.push([stoker.Sample(uri, box)])
    deadline = time.monotonic() + 20
    while len(asked.planned) < planned + expect and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # any more planned ahead meanwhile is counted
    seen = len(asked.planned) - planned
    for box in boxes:
        with p.pop() as b:
            np.testing.assert_array_equal(torch.from_dlpack(b)[0].numpy(), want[tuple(slice(*s) for s in box)])
    return seen


@pytest.mark.parametrize("path", list(ARRAYS))
def test_a_second_epoch_from_disk_stops_planning_ahead(remote, data, tmp_path, monkeypatch, path):
    # batches whose every chunk is on disk have no latency to hide: after QUIET_AFTER such batches in a row
    # the coordinator plans no more ahead of their slots (it planned up to MAX_AHEAD, looking up each chunk's
    # entry early); a batch that needs a fetch again (another array, not cached) plans ahead again
    uri, options, server = remote
    folder, cache = cache_folder(tmp_path)
    want = zarr_values(data, path)
    other = next(a for a in ARRAYS if a != path)
    # i64: the two arrays' dtypes (int32, uint16) in one pipeline, exact
    cfg = stoker.Config(batch_size=1, dtype="i64", n_compute_threads=2, pop_timeout_s=60, lookahead_batches=1,
                        storage_options=options, cache_dir=str(folder), cache_bytes=64 << 20)
    asked = _Asked(monkeypatch)
    assert len(ONE_EACH) - 2 > ahead.QUIET_AFTER  # two batches take the slots, the rest could be planned ahead
    with stoker.Pipeline(cfg) as p:
        # epoch 1, cold: every batch past the slots fetches, and is planned ahead
        cold = len(ONE_EACH) - 2
        assert _planned_while_held(p, asked, f"{uri}/{path}", ONE_EACH, want, cold) == cold
        assert cache.flush(30)
        # epoch 2 in the same pipeline, every chunk on disk at a generation known: QUIET_AFTER planned ahead
        assert _planned_while_held(p, asked, f"{uri}/{path}", ONE_EACH, want, ahead.QUIET_AFTER) == ahead.QUIET_AFTER
        assert all(n == 1 for n in asked.planned[-ahead.QUIET_AFTER:]), asked.planned  # each found on disk
        # crops of an array not read yet: fetched, so planned ahead again
        want = zarr_values(data, other)
        assert _planned_while_held(p, asked, f"{uri}/{other}", ONE_EACH, want, cold) == cold


@pytest.mark.parametrize("path", list(ARRAYS))
def test_entries_asked_again_at_their_generation_are_not_made_again(s3, data, tmp_path, monkeypatch, path):
    # a second epoch asks the cache for the entry of every chunk of every batch: one asked before at the same
    # generation is not made again (no ident, hash or path per chunk), yet the engine still reads and checks
    # it; an object rewritten (a new ETag, learnt once its generation is stale) gets its new entry, never the
    # kept one, and its new values
    uri, options, prefix = upload(s3, data, "kept")
    folder, cache = cache_folder(tmp_path)
    cfg = _config(options, folder, cache_staleness_s=2.0)
    _first_epoch(cfg, cache, uri, data, path)
    reads = _Reads(monkeypatch)
    with stoker.Pipeline(cfg) as p:  # epoch 2: the listing at the open states every generation
        _batch(p, uri, data, path)
        assert reads.engine > 0 and reads.made == reads.engine == reads.asked  # each entry asked and made once
        engine, hits, python = reads.engine, cache.hits, reads.python
        for _ in range(2):
            _batch(p, uri, data, path)
        # not asked again (the decoder's table of what it was given, at generations still known) nor made again;
        # read by the engine from disk all the same
        assert reads.asked == engine and reads.made == engine, (reads.asked, reads.made)
        assert reads.engine == 3 * engine, (reads.engine, engine)
        assert cache.hits - hits == 2 * engine, (cache.hits, hits, engine)
        # read from disk by the engine, none in Python (a shard's index, read by planning, is kept in memory)
        assert cache.hits > hits and reads.python == python
        rewritten = str(tmp_path / "rewritten")
        _write(rewritten, 2)
        s3.upload(read_tree(rewritten), prefix)  # new values, new ETags
        time.sleep(2.2)  # every generation stale: the next batch revalidates
        _batch(p, uri, rewritten, path)
        assert cache.flush(30)
        engine = reads.engine
        # the new generations' entries (made as they were kept): read by the engine, with the new values
        _batch(p, uri, rewritten, path)
        assert reads.engine > engine


@pytest.mark.parametrize("path", list(ARRAYS))
def test_the_decoders_table_of_entries_never_serves_a_generation_no_longer_known(s3, data, tmp_path, monkeypatch,
                                                                                 path):
    # the decoder keeps the entries its stores gave (no key built, no lock, per chunk of a later batch) while
    # their generations stay known within the staleness bound: generations forgotten (as a reopen forgets them)
    # of objects rewritten meanwhile are learnt anew by the next batch, which reads the new values; the table's
    # entries made at the old ones are never used for them (before the store counted changes, they would be)
    uri, options, prefix = upload(s3, data, "memo")
    folder, cache = cache_folder(tmp_path)
    cfg = _config(options, folder, cache_staleness_s=600.0)
    with stoker.Pipeline(cfg) as p:
        _batch(p, uri, data, path)  # fetched, kept
        assert cache.flush(30)
        reads = _Reads(monkeypatch)
        _batch(p, uri, data, path)  # from disk: the entries its fetches made, in the table
        given, hits = reads.engine, cache.hits
        assert given > 0 and reads.asked == 0
        _batch(p, uri, data, path)  # from the table again: nothing asked, all read from disk
        assert reads.engine == 2 * given and reads.asked == 0 and cache.hits - hits == given
        assert reads.compiled == 2  # each batch whole, in one compiled look-up
        rewritten = str(tmp_path / "rewritten")
        _write(rewritten, 2)
        s3.upload(read_tree(rewritten), prefix)  # new values, new ETags
        kv = _caching_of(p, f"{uri}/{path}")
        changes = kv.changes
        kv.forget()  # every generation forgotten: learnt anew (the new ETags) by the next read
        assert kv.changes > changes
        _batch(p, uri, rewritten, path)  # the new values (zarr-python's), not the table's old entries
        assert reads.compiled == 2  # the table's entries stale: nothing found whole
        assert cache.flush(30)
        _batch(p, uri, rewritten, path)  # the new generations' entries, read from disk
        assert cache.hits > hits + given


def test_opening_another_array_on_the_store_keeps_the_table_of_entries(s3, data, tmp_path, monkeypatch):
    # each open of an array through revalidating stores forgets what its store learnt under the array's prefix:
    # an array not read since taught nothing there, so the other arrays' entries in the decoder's table stay
    # good (every memo of the store was emptied before, and each open of a new array on it cost their chunks a
    # look-up again); forgetting what was learnt does make them stale
    uri, options, prefix = upload(s3, data, "open")
    folder, cache = cache_folder(tmp_path)
    cfg = _config(options, folder, cache_staleness_s=600.0)
    with stoker.Pipeline(cfg) as p:
        _batch(p, uri, data, "plain")  # fetched, kept
        assert cache.flush(30)
        reads = _Reads(monkeypatch)
        _batch(p, uri, data, "plain")  # from disk: the entries its fetches made, in the table
        assert reads.engine > 0 and reads.asked == 0
        kv = _caching_of(p, f"{uri}/plain")
        changes = kv.changes
        kv.forget(f"{prefix}/sharded")  # what opening another array through open_array's Stores calls
        assert kv.changes == changes
        hits = cache.hits
        _batch(p, uri, data, "plain")  # from the table: nothing asked, all read from disk
        assert reads.asked == 0 and cache.hits > hits
        kv.forget(f"{prefix}/plain")  # what was learnt under it forgotten: the table's entries made at it stale
        assert kv.changes > changes
        _batch(p, uri, data, "plain")  # not from the table: its generations learnt again
        _batch(p, uri, data, "plain")  # and their entries asked for again
        assert reads.asked > 0


@pytest.mark.parametrize("path", list(ARRAYS))
def test_chunks_past_the_tables_bound_keep_hits_and_cost_no_more(s3, data, tmp_path, monkeypatch, path):
    # more cached chunks than the decoder's table holds (entry_table.SLOTS, 8 here: one set, against ONE_EACH's
    # 12 chunks, in two batches), read in the same order each epoch: the table keeps the first 8 its fetches
    # made, which are hits every epoch (a set full of live entries drops newcomers, rather than replace the
    # entries the next batch needs: all misses), and the other 4 are asked of the store each epoch, as without
    # a table
    monkeypatch.setattr(entry_table, "SLOTS", 8)
    root, options, _ = upload(s3, data, "full")
    uri = f"{root}/{path}"
    folder, cache = cache_folder(tmp_path)
    cfg = _config(options, folder, batch_size=6, cache_staleness_s=600.0)
    want = zarr_values(data, path)

    def epoch(p) -> None:
        for k in (0, 6):  # ONE_EACH's crops: 12 chunks, each once
            p.push([stoker.Sample(uri, box) for box in ONE_EACH[k:k + 6]])
            with p.pop() as b:
                for got, box in zip(torch.from_dlpack(b), ONE_EACH[k:k + 6]):
                    np.testing.assert_array_equal(got.numpy(), want[tuple(slice(*s) for s in box)])

    with stoker.Pipeline(cfg) as p:
        epoch(p)  # fetched, kept; the first 8 entries in the table
        assert cache.flush(30)
        reads = _Reads(monkeypatch)
        for _ in range(3):
            given, asked, hits = reads.engine, reads.asked, cache.hits
            epoch(p)
            assert reads.engine - given == 12 and cache.hits - hits == 12  # all read from disk by the engine
            assert reads.asked - asked == 12 - 8, reads.asked - asked  # 8 from the table, 4 asked each epoch


def _caching_of(p, uri: str) -> cachingstore.CachingStore:
    """The CachingStore the pipeline ``p`` reads the array at ``uri`` through."""
    kv = p._coordinator._readers.get(uri).kv
    while not isinstance(kv, cachingstore.CachingStore):
        kv = kv.store
    return kv


@pytest.mark.parametrize("path", list(ARRAYS))
def test_a_batch_read_whole_from_disk_is_settled_by_its_waiter(s3, data, tmp_path, monkeypatch, path):
    # as a batch of local files: the thread that pops it finishes it, no finisher thread woken for it; a batch
    # with an unsound entry still goes to the finisher, which fetches that chunk again
    from stoker.engine.cpu.decode_native import NativeDecoder

    uri, options, prefix = upload(s3, data, "settle")
    folder, cache = cache_folder(tmp_path)
    cfg = _config(options, folder)
    _first_epoch(cfg, cache, uri, data, path)
    finished = collections.Counter()
    finish = NativeDecoder._finish_from_disk

    def counted(self, job, bjob, eids, disk):
        finished[threading.current_thread().name] += 1
        return finish(self, job, bjob, eids, disk)

    monkeypatch.setattr(NativeDecoder, "_finish_from_disk", counted)
    with stoker.Pipeline(cfg) as p:  # epoch 2: the listing at the open states every generation
        for _ in range(3):
            hits = cache.hits
            _batch(p, uri, data, path)
            assert cache.hits > hits  # read from disk by the engine
        assert not finished, finished
        damage_entries(folder, "flip")
        corrupt = cache.corrupt
        _batch(p, uri, data, path)  # zarr-python's values: every chunk fetched again
        assert cache.corrupt > corrupt
        assert set(finished) == {"stoker-engine-finisher"}, finished


def test_an_error_finishing_a_batch_from_disk_fails_that_batch_alone(s3, data, tmp_path, monkeypatch):
    """What finishing a batch read from disk-cache entries raises on the finisher thread (here a stand-in
    error; in earnest a bug, or a fetch of an unsound entry's chunk refused) is what that batch's pop raises,
    and the finisher thread goes on. Its clean-up took the batch's _FromDisk for a fetch's buffers
    (``fetched[1]``): a TypeError ended the thread, and the decoder failed every later job with an
    InternalError naming that TypeError, not the error that happened."""
    from stoker.engine.cpu.decode_native import NativeDecoder

    path = "plain"
    uri, options, prefix = upload(s3, data, "finisher")
    folder, cache = cache_folder(tmp_path)
    cfg = _config(options, folder)
    _first_epoch(cfg, cache, uri, data, path)
    finish = NativeDecoder._finish_from_disk

    def failing(self, job, bjob, eids, disk):
        raise RuntimeError("finishing failed")

    with stoker.Pipeline(cfg) as p:  # epoch 2: entries read by the engine
        _batch(p, uri, data, path)
        damage_entries(folder, "flip")  # an unsound entry: its batch goes to the finisher
        monkeypatch.setattr(NativeDecoder, "_finish_from_disk", failing)
        with pytest.raises(RuntimeError, match="finishing failed"):
            _batch(p, uri, data, path)
        decoder = p._coordinator.executor.decoders.native
        assert decoder._fault is None and all(t.is_alive() for t in decoder.threads())
    monkeypatch.setattr(NativeDecoder, "_finish_from_disk", finish)
    with stoker.Pipeline(cfg) as p:  # (a pipeline's error is sticky: another one reads the entries again)
        _batch(p, uri, data, path)


@pytest.mark.parametrize("executor", ["engine", "python", "gpu", "hybrid"])
@pytest.mark.parametrize("path", list(ARRAYS))
def test_a_batch_of_local_and_cached_remote_arrays_reads_both(remote, data, tmp_path, monkeypatch, path, executor):
    """A batch whose samples read one array from local files and one from an object store behind the disk
    cache (raw on a local disk, labels in a bucket) failed every batch with a TypeError: each store of the batch
    was asked for its stamp number, and the local one has none (None into an int64 array). Both are read,
    the remote one's entries from the disk cache in later batches, each crop equal to zarr-python's; by every
    executor (the compiled engine, the Python decode path, the GPU decode's and the hybrid on CPU tensors)."""
    uri, options, server = remote
    if executor == "python":
        monkeypatch.setattr(native, "Engine", None)
    elif executor != "engine":
        from stoker.engine.pipeline import facade

        monkeypatch.setattr(facade, "make_executor", host_executor(executor))
    folder, cache = cache_folder(tmp_path)
    want = zarr_values(data, path)
    with stoker.Pipeline(_config(options, folder, batch_size=2 * len(BOXES), device="cpu")) as p:
        for _ in range(3):
            p.push([stoker.Sample(f"{root}/{path}", box) for box in BOXES for root in (data, uri)])
            with p.pop() as b:
                got = [t.numpy().copy() for t in torch.from_dlpack(b)]
            for k, crop in enumerate(got):
                np.testing.assert_array_equal(crop, want[tuple(slice(*s) for s in BOXES[k // 2])])
            assert cache.flush(30)
    assert cache.hits > 0
