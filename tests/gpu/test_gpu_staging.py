"""The GPU decode's staging reads: the read threads (ReadPool) and several ranges of one file read with one
identity check (LocalStore.read_ranges_into)."""

from __future__ import annotations

import os
import threading

import pytest

from stoker.engine.gpu.staging import ReadPool
from stoker.errors import ShutdownError
from stoker.storage import FileChanged
from stoker.storage.local import LocalStore

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_the_read_threads_give_every_result_in_order(threads):
    pool = ReadPool(threads)
    seen = set()
    try:
        for n in (0, 1, 3, 17):
            assert pool.map(lambda x: (seen.add(threading.get_ident()), x * x)[1], list(range(n))) == \
                [x * x for x in range(n)]
    finally:
        pool.close()
    assert len(seen) <= threads


def test_a_read_that_fails_fails_the_map_once_every_slice_is_done():
    pool = ReadPool(3)
    done = []

    def read(x):
        if x == 4:
            raise OSError("disk gone")
        done.append(x)
        return x

    try:
        with pytest.raises(OSError, match="disk gone"):
            pool.map(read, list(range(9)))
    finally:
        pool.close()
    assert 4 not in done and {0, 1, 2, 3, 6, 7, 8} <= set(done)  # the other slices ran to their end


def test_close_ends_a_wait_for_a_blocked_read():
    pool = ReadPool(2)
    release = threading.Event()

    def read(x):
        if x == 0:  # the pool thread's slice blocks; the caller's slice returns at once
            release.wait(20.0)
        return x

    closer = threading.Timer(0.3, pool.close)
    closer.start()
    try:
        with pytest.raises(ShutdownError, match="closed while chunks were being read"):
            pool.map(read, [0, 1])
    finally:
        release.set()
        closer.cancel()


def test_ranges_of_one_file_are_read_with_one_identity_check(tmp_path, monkeypatch):
    path = tmp_path / "shard"
    path.write_bytes(bytes(range(256)) * 4)
    store = LocalStore()
    _, ident = store.read_current(str(path), lambda size: (0, 1))  # as a shard's index is read
    bufs = [bytearray(3), bytearray(5), bytearray(2)]
    stats = []
    real_stat, real_fstat = os.stat, os.fstat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (stats.append(p), real_stat(p, *a, **k))[1])
    monkeypatch.setattr(os, "fstat", lambda fd: (stats.append(fd), real_fstat(fd))[1])
    got = store.read_ranges_into(str(path), [0, 100, 1022], [memoryview(b) for b in bufs], ident)
    monkeypatch.undo()
    assert got == [3, 5, 2]
    assert len(stats) == 3, stats  # the path and the descriptor before the reads, the descriptor after
    assert bytes(bufs[0]) == bytes([0, 1, 2]) and bytes(bufs[1]) == bytes(range(100, 105))
    assert bytes(bufs[2]) == bytes([254, 255])
    assert store.read_ranges_into(str(tmp_path / "gone"), [0], [memoryview(bytearray(1))]) is None


def test_ranges_of_a_file_replaced_since_its_index_was_read_are_refused(tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(b"a" * 64)
    store = LocalStore()
    data, ident = store.read_current(str(path), lambda size: (0, 8))
    assert data == b"a" * 8
    fresh = tmp_path / "new"
    fresh.write_bytes(b"b" * 64)
    os.replace(fresh, path)  # a writer renames a new shard over the old one
    with pytest.raises(FileChanged):
        store.read_ranges_into(str(path), [0, 8], [memoryview(bytearray(8)), memoryview(bytearray(8))], ident)
    assert store.read_ranges_into(str(path), [0], [memoryview(bytearray(8))]) == [8]  # no identity asked: read
