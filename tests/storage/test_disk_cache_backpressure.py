"""A write queue that is full: a put waits for the writer (bounded), so an epoch read faster than the disk writes
keeps every entry; a stalled writer costs a put at most QUEUE_WAIT_S, then the entry is dropped; the store's event
loop never waits (a backlogged cache's answers are kept from a reader thread)."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest

from stoker.storage import diskcache
from stoker.storage.diskcache import DiskCache

from cached_arrays import write as _write
from store_fixtures import FAST_REMOTE, range_server_fixture, read_tree, written_tree_fixture

pytestmark = pytest.mark.timeout(120)

data = written_tree_fixture(_write)
http = range_server_fixture()


class _LockHeld:
    """The folder's lock held as another process evicting holds it: the writer waits for it, the queue fills."""

    def __init__(self, cache: DiskCache) -> None:
        assert cache.write("first", b"a" * 100)  # the folder and its lock file made
        self.fd = os.open(cache.root / ".index", os.O_RDWR)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _put_on_a_thread(cache: DiskCache, ident: str, value: bytes, wait: bool = True) -> threading.Thread:
    thread = threading.Thread(target=cache.put, args=(ident, value, wait), daemon=True)
    thread.start()
    return thread


def test_a_put_into_a_full_queue_waits_for_the_writer_and_every_entry_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(diskcache, "QUEUE_BYTES", 15_000)  # one entry of 10,000 bytes, not two
    monkeypatch.setattr(diskcache, "QUEUE_WAIT_S", 60.0)
    cache = DiskCache(str(tmp_path / "c"), 64 << 20)
    held = _LockHeld(cache)
    try:
        first, second = os.urandom(10_000), os.urandom(10_000)
        cache.put("one", first)  # queued; the writer takes it and waits for the lock
        put = _put_on_a_thread(cache, "two", second)
        put.join(0.5)
        assert put.is_alive(), "the put into a full queue returned while the writer could not write"
        assert cache.dropped == 0
    finally:
        held.release()  # the writer writes "one", then there is room for "two"
    put.join(30)
    assert not put.is_alive()
    assert cache.flush(30) and cache.dropped == 0
    assert bytes(cache.get("one")) == first and bytes(cache.get("two")) == second


@pytest.mark.filterwarnings("ignore:stoker's disk cache:RuntimeWarning")
@pytest.mark.parametrize("wait", [True, False])
def test_a_stalled_writer_costs_a_put_at_most_the_wait_then_the_entry_is_dropped(tmp_path, monkeypatch, wait):
    # the writer holds a batch it cannot write (the lock held longer than a put waits): the put gives up after
    # QUEUE_WAIT_S (at once with wait=False, as the store's event loop puts) and its entry is dropped, counted
    monkeypatch.setattr(diskcache, "QUEUE_BYTES", 15_000)
    monkeypatch.setattr(diskcache, "QUEUE_WAIT_S", 0.3 if wait else 60.0)
    cache = DiskCache(str(tmp_path / "c"), 64 << 20)
    held = _LockHeld(cache)
    try:
        cache.put("one", os.urandom(10_000))
        put = _put_on_a_thread(cache, "two", os.urandom(10_000), wait)
        put.join(20)
        assert not put.is_alive(), "the put waited past QUEUE_WAIT_S for a writer that could not write"
        assert cache.dropped == 1 and not cache.queued("two")
    finally:
        held.release()
    assert cache.flush(30)
    assert cache.get("one") is not None and cache.get("two") is None


def test_the_stores_event_loop_never_waits_for_a_backlogged_writer(http, data, tmp_path, monkeypatch):
    # a prefetch's answers (start_get_many) complete on the store's event loop: kept from there (never waiting)
    # while the queue has room, from a reader thread (which may wait) once it is backlogged; either way every
    # value is the object's, and every entry is kept
    from stoker.storage.cachingstore import CachingStore
    from stoker.storage.objectstore import ObjectStore

    cache = DiskCache(str(tmp_path / "c"), 64 << 20)
    kv = CachingStore(ObjectStore(http.url, **FAST_REMOTE), cache)
    puts: list[tuple[str, bool]] = []
    put = DiskCache.put

    def recorded(self, ident, value, wait=True):
        puts.append((threading.current_thread().name, wait))
        return put(self, ident, value, wait)

    monkeypatch.setattr(DiskCache, "put", recorded)
    keys = sorted(k for k in read_tree(data) if k.startswith("plain/c/"))
    try:
        for backlogged, some in ((False, keys[:4]), (True, keys[4:8])):
            monkeypatch.setattr(DiskCache, "backlogged", property(lambda self, b=backlogged: b))
            puts.clear()
            future = kv.start_get_many(some, [])
            future.result(30)  # settled (or raises)
            values, _ = kv.result_of(future)
            assert [bytes(v) for v in values] == [read_tree(data)[k] for k in some]
            assert len(puts) == len(some)
            if backlogged:
                assert all(name.startswith("stoker-diskcache-read") and wait for name, wait in puts), puts
            else:
                assert not any(name.startswith("stoker-diskcache-read") or wait for name, wait in puts), puts
        assert cache.flush(30) and cache.dropped == 0
        assert all(kv.entry_files(keys[:8], []))
    finally:
        kv.store.close()
