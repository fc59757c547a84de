"""A loss (DiskCache.lost: an eviction, a write not made, an entry another process evicted) costs O(1): what was
seen before it is looked for on disk again when next asked, markers still there are refreshed rather than written
again, and a write that finds its entry already there is no loss. Real folders, real writer threads and flocks."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest

from stoker.storage import diskcache
from stoker.storage.diskcache import SEEN_IDENTS, DiskCache


def _markers(cache: DiskCache, n: int) -> list[str]:
    idents = [f"mem://bkt\na/c/{i}\nkept" for i in range(n)]
    for ident in idents:
        cache.mark(ident)
    assert cache.flush(30)
    return idents


@pytest.mark.timeout(60)
def test_markers_kept_again_after_a_loss_are_refreshed_not_written_again(tmp_path):
    # Before: every loss forgot every marker seen, so each key kept again queued its marker; the writer found it
    # there (0: "not written") and that counted as one more loss, its mtime (the LRU's clock) never refreshed.
    cache = DiskCache(str(tmp_path), 64 << 20)
    idents = _markers(cache, 50)
    assert cache.written == 50
    for ident in idents:
        os.utime(cache.path(ident), (1, 1))  # long unused
    losses = cache.losses
    cache.lost()  # the engine found an entry gone (another process evicted it)
    for ident in idents:
        cache.mark(ident)
    assert cache.flush(30)
    assert cache.written == 50 and cache.losses == losses + 1  # none written again, no loss more
    assert all(os.stat(cache.path(ident)).st_mtime > 1 for ident in idents)  # refreshed: a utime each
    assert all(cache.has(ident) for ident in idents)


@pytest.mark.timeout(60)
def test_a_marker_gone_after_a_loss_is_looked_for_and_made_again(tmp_path):
    cache = DiskCache(str(tmp_path), 64 << 20)
    idents = _markers(cache, 4)
    os.unlink(cache.path(idents[0]))  # another process evicted it
    assert cache.has(idents[0])  # seen a moment ago: not looked for (SEEN_S)
    cache.lost()
    assert not cache.has(idents[0]) and cache.has(idents[1])  # looked for on disk again after the loss
    cache.mark(idents[0])
    assert cache.flush(30) and os.path.exists(cache.path(idents[0])) and cache.written == 5


@pytest.mark.timeout(60)
def test_a_loss_with_a_full_memo_is_cheap(tmp_path):
    # Before: lost() rebuilt the memo of what has() found (up to SEEN_IDENTS) under the lock every reader and the
    # writer take: some 10 ms a loss. Now a floor time: a loss costs what an int and a float cost.
    cache = DiskCache(str(tmp_path), 64 << 20)
    took = 0.0
    for _ in range(20):
        now = time.monotonic()
        cache._seen = {f"m{i}": now for i in range(SEEN_IDENTS)}  # as many as has() and mark() remember
        began = time.process_time()
        cache.lost()
        took += time.process_time() - began
    assert took < 0.04  # before: 20 sweeps of 65,536 entries, 150 ms and more
    assert cache.losses == 20 and not cache.has("m1")  # and what was seen is looked for again (not there)


@pytest.mark.timeout(60)
def test_a_marker_whose_batch_fails_while_mark_runs_is_not_taken_as_there(tmp_path, monkeypatch):
    # mark() recorded the marker as seen after _enqueue let the lock go; a batch that failed in between (its
    # lost() first) left the marker taken as on disk for SEEN_S: its key's entries never found by another
    # wrapper. Now recorded in _enqueue, under the lock, before the writer can take it.
    monkeypatch.setattr(diskcache, "LOCK_WAIT_S", 0.2)
    cache = DiskCache(str(tmp_path), 64 << 20)
    assert cache.write("first", b"a" * 100)  # the folder and its lock file made
    held = os.open(os.path.join(cache.root, ".index"), os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # another process holds the folder's lock: the marker's batch fails
    real = cache._enqueue

    def enqueue(*args):
        real(*args)
        assert cache.flush(30)  # the writer ran between the lock let go and mark()'s own step after it

    try:
        monkeypatch.setattr(cache, "_enqueue", enqueue)
        losses = cache.losses
        cache.mark("mem://bkt\na/c/0\nkept")
        assert cache.losses == losses + 1  # not made: a loss
        assert not os.path.exists(cache.path("mem://bkt\na/c/0\nkept"))
        assert not cache.has("mem://bkt\na/c/0\nkept")
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
        os.close(held)


@pytest.mark.timeout(60)
def test_a_write_that_finds_its_entry_there_is_no_loss(tmp_path):
    # Before: the writer's 0 ("there already") counted as a write not made: lost(), so every wrapper forgot the
    # entries it knew on disk and the next epoch looked each up again (a stat an entry).
    one, other = DiskCache(str(tmp_path), 64 << 20), DiskCache(str(tmp_path), 64 << 20)  # two processes
    one.put("mem://bkt|a/c/0|0:-1|e1", b"v" * 1000)
    assert one.flush(30) and one.written == 1
    other.put("mem://bkt|a/c/0|0:-1|e1", b"v" * 1000)  # fetched by both at once: written by one
    assert other.flush(30) and other.written == 0 and other.losses == 0
    one.put("mem://bkt|a/c/0|0:-1|e1", b"v" * 1000)  # queued again after its write (a later batch's fetch)
    assert one.flush(30) and one.written == 1 and one.losses == 0
    assert bytes(other.get("mem://bkt|a/c/0|0:-1|e1")) == b"v" * 1000
    assert one.write("mem://bkt|a/c/0|0:-1|e1", b"v" * 1000)  # stored: there already


def _utimes_by_thread(monkeypatch) -> list[str]:
    """The names of the threads that call ``os.utime`` from now on (the LRU clock's refreshes)."""
    names: list[str] = []
    real = os.utime

    def utime(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(os, "utime", utime)
    return names


@pytest.mark.timeout(60)
def test_markers_kept_again_after_a_loss_are_refreshed_on_the_writer_thread(tmp_path, monkeypatch):
    # Before: mark() of a marker seen before a loss refreshed its mtime with a utime on the caller's thread (a
    # fetch's, or a pipeline's coordinator): on a network file system a round trip each, on a hot path. Now the
    # folder's writer thread makes it; the caller only queues.
    cache = DiskCache(str(tmp_path), 64 << 20)
    idents = _markers(cache, 20)
    for ident in idents:
        os.utime(cache.path(ident), (1, 1))  # long unused
    cache.lost()
    utimes = _utimes_by_thread(monkeypatch)
    for ident in idents:
        cache.mark(ident)
    assert threading.current_thread().name not in utimes
    assert cache.flush(30)
    assert utimes == ["stoker-diskcache"] * 20 and cache.written == 20  # refreshed there, none written again
    assert all(os.stat(cache.path(ident)).st_mtime > 1 for ident in idents)


@pytest.mark.timeout(60)
def test_has_after_a_loss_looks_on_the_caller_and_refreshes_on_the_writer_thread(tmp_path, monkeypatch):
    cache = DiskCache(str(tmp_path), 64 << 20)
    idents = _markers(cache, 10)
    for ident in idents[:5]:
        os.utime(cache.path(ident), (1, 1))  # long unused; the rest used a moment ago (made now)
    cache.lost()
    utimes = _utimes_by_thread(monkeypatch)
    assert all(cache.has(ident) for ident in idents)  # looked for on disk again after the loss: there
    assert threading.current_thread().name not in utimes  # no utime on the caller's thread
    assert cache.flush(30)
    assert utimes == ["stoker-diskcache"] * 5  # only the old ones, as an entry's hit touches (at most once a minute)
    assert all(os.stat(cache.path(ident)).st_mtime > 1 for ident in idents)
    assert cache.written == 10 and not cache.has(idents[0] + "x")


@pytest.mark.timeout(60)
def test_a_marker_gone_before_the_writer_refreshes_it_is_a_loss_not_made_again(tmp_path, monkeypatch):
    # has() found it (an lstat), another process evicted it before the writer's utime: a loss (what this process
    # counted on is gone), and has() never makes a marker (only mark(), for a key kept)
    cache = DiskCache(str(tmp_path), 64 << 20)
    ident = _markers(cache, 1)[0]
    os.utime(cache.path(ident), (1, 1))
    cache.lost()
    losses, real = cache.losses, cache._enqueue

    def enqueue(*args, **kwargs):
        os.unlink(cache.path(ident))  # evicted between the look and the refresh
        real(*args, **kwargs)

    monkeypatch.setattr(cache, "_enqueue", enqueue)
    assert cache.has(ident)
    assert cache.flush(30)
    assert cache.losses == losses + 1 and not os.path.exists(cache.path(ident)) and cache.written == 1
    assert not cache.has(ident)  # looked for again after the loss


@pytest.mark.timeout(60)
def test_puts_in_the_batch_of_a_refresh_whose_marker_is_gone_are_still_written(tmp_path):
    # Before: `gone or not all(write_batch(...))` short-circuited, so a refresh finding its marker evicted
    # dropped every entry of its batch unwritten and uncounted
    cache = DiskCache(str(tmp_path), 64 << 20)
    ident = _markers(cache, 1)[0]
    os.utime(cache.path(ident), (1, 1))  # long unused: has() queues a refresh
    cache.lost()  # seen before a loss: has() looks on disk
    keys = [f"mem://bkt|a/c/{i}|0:-1|e1" for i in range(5)]
    losses = cache.losses
    with cache._cond:  # all queued before the writer takes a batch: one batch
        assert cache.has(ident)
        os.unlink(cache.path(ident))  # another process evicts the marker before the writer's utime
        for i, key in enumerate(keys):
            cache.put(key, bytes([i]) * 1000)
    assert cache.flush(30)
    assert [cache.get(key) for key in keys] == [bytes([i]) * 1000 for i in range(5)]
    assert all(os.path.isfile(cache.path(key)) for key in keys)
    assert cache.written == 1 + 5 and cache.losses == losses + 1  # the marker lost, the puts stored


@pytest.mark.timeout(60)
def test_a_forked_child_refreshes_and_writes_on_a_writer_of_its_own(tmp_path):
    # Before: the child inherited the parent's writer thread, which does not run there: has() queued a refresh
    # never made, queued() stayed True, flush() timed out and a put was never written
    from forking import fork_child, held_by_another_thread, verdict

    cache = DiskCache(str(tmp_path), 64 << 20)
    ident = _markers(cache, 1)[0]  # the writer thread runs in the parent
    os.utime(cache.path(ident), (1, 1))
    cache.lost()
    key = "mem://bkt|a/c/9|0:-1|e1"

    def child() -> bool:
        refreshed = cache.has(ident) and cache.flush(10) and not cache.queued(ident)
        cache.put(key, b"v" * 1000)
        written = cache.flush(10) and cache.get(key) == b"v" * 1000 and os.path.isfile(cache.path(key))
        return refreshed and os.stat(cache.path(ident)).st_mtime > 1 and written

    with held_by_another_thread(cache._cond):  # held by a thread of the parent's at the fork, for ever there
        pid = fork_child(child)
    assert verdict(pid, 30) == "exit 0"
    assert os.stat(cache.path(ident)).st_mtime > 1 and cache.get(key) == b"v" * 1000


@pytest.mark.timeout(60)
def test_a_refresh_has_queued_is_not_taken_as_there_after_a_loss_and_mark_makes_it(tmp_path):
    # Before: has() queued its refresh (a touch) among the pending writes, and _trusted took anything pending as
    # there: after a loss, has() said True for a marker gone, and mark() returned at once, not making it again
    # (made a round later). Now a touch is kept apart: looked for on disk, and a mark's refresh is queued too.
    cache = DiskCache(str(tmp_path), 64 << 20)
    ident = _markers(cache, 1)[0]
    os.utime(cache.path(ident), (1, 1))  # long unused: has() queues a refresh
    cache.lost()  # seen before a loss: has() looks on disk
    with cache._cond:  # the writer takes nothing meanwhile: the refresh stays queued
        assert cache.has(ident)  # there: a touch queued
        os.unlink(cache.path(ident))  # another process evicts it
        cache.lost()  # and this one counts a loss (its own eviction, a write not made, an entry found missing)
        assert not cache.has(ident)  # looked for on disk: gone
        cache.mark(ident)  # its key kept again: queued to be made where gone
        assert cache.queued(ident) and cache.has(ident)  # made after the loss: trusted
    assert cache.flush(30)
    assert os.path.isfile(cache.path(ident)) and cache.written == 2
    cache.lost()
    assert cache.has(ident)  # on disk


@pytest.mark.timeout(60)
def test_a_refresh_queued_while_its_marker_is_trusted_is_not_queued_twice(tmp_path, monkeypatch):
    cache = DiskCache(str(tmp_path), 64 << 20)
    ident = _markers(cache, 1)[0]
    os.utime(cache.path(ident), (1, 1))
    cache.lost()
    utimes = _utimes_by_thread(monkeypatch)
    with cache._cond:
        assert cache.has(ident)  # a touch queued
        cache.mark(ident)  # seen since the last loss: nothing queued
        cache._seen.clear()  # as after SEEN_S: has() looks again, and queues no second touch
        assert cache.has(ident) and len(cache._queue) == 1
    assert cache.flush(30) and utimes == ["stoker-diskcache"] and cache.written == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["folder", "link"])
def test_a_folder_or_link_at_a_marker_name_is_no_marker(tmp_path, what):
    # Before: has() took any lstat as a marker there, and the writer's refresh (a utime not following links)
    # counted one as there: a mark never wrote it, and its key's entries were never found. Now only a regular
    # file is there (as the writers say): has() says False, and a mark's refresh is a failed write, one warning.
    cache = DiskCache(str(tmp_path), 64 << 20)
    ident, other = _markers(cache, 2)
    assert cache.has(ident)  # seen: the mark below is a refresh
    path = str(cache.path(ident))
    os.unlink(path)
    if what == "folder":
        os.mkdir(path)
    else:
        os.symlink(cache.path(other), path)  # to a marker: a regular file if followed
    cache.lost()
    assert not cache.has(ident)
    with pytest.warns(RuntimeWarning, match="not a regular file") as warned:
        cache.mark(ident)  # refreshed on the writer thread: not there, so written, which fails
        assert cache.flush(30)
    assert len(warned) == 1 and not cache.writable and cache.written == 2
    assert (os.path.isdir if what == "folder" else os.path.islink)(path)  # left as it was
    assert not cache.has(ident) and cache.has(other)
