"""LocalStore: positional reads, counters, its bounded descriptor cache under threads, errors, rewrites."""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zarr

import stoker
from stoker.storage import LocalStore

from descriptors import open_under

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# LocalStore


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(3)
    out = {}
    for i in range(5):
        data = rng.integers(0, 256, size=100 * i + 7, dtype=np.uint8).tobytes()
        path = str(tmp_path / f"f{i}")
        with open(path, "wb") as f:
            f.write(data)
        out[path] = data
    empty = str(tmp_path / "empty")
    open(empty, "wb").close()
    out[empty] = b""
    return out


def test_local_store_reads(files, tmp_path):
    store = LocalStore()
    for path, data in files.items():
        assert store.size(path) == len(data)
        assert store.read(path) == data
        assert store.read_range(path, 3, 50) == data[3:53]
        tail = max(0, len(data) - 2)
        assert store.read_range(path, tail, 50) == data[tail:]  # short at end of file
        assert store.read_range(path, len(data) + 10, 5) == b""
    missing = str(tmp_path / "nope")
    under_file = next(iter(files)) + "/child"  # ENOTDIR
    for path in (missing, under_file, str(tmp_path / "no" / "dir" / "x")):
        assert store.read(path) is None
        assert store.read_range(path, 0, 10) is None
        assert store.read_range_into(path, 0, memoryview(bytearray(1))) is None
        assert store.size(path) is None
    store.close()


def test_local_store_counters_and_reuse(files):
    store = LocalStore()
    path, data = list(files.items())[3]
    store.read_range(path, 0, 10)
    store.read_range(path, len(data) - 5, 50)  # short at the end of the file
    assert store.counters.files_opened == 1  # the descriptor is reused
    assert store.read(path) == data
    assert store.read(path) == data
    assert store.counters.files_opened == 3  # whole-file reads are not cached...
    assert list(store._handles) == [path]  # ...and leave the cached descriptor alone
    assert store.counters.reads == 4
    assert store.counters.bytes_read == 10 + 5 + 2 * len(data)
    store.close()
    store.read_range(path, 0, 1)
    assert store.counters.files_opened == 4


def test_local_store_directory_is_a_storage_error(tmp_path):
    store = LocalStore()
    with pytest.raises(stoker.StorageError) as info:
        store.read(str(tmp_path))
    assert isinstance(info.value, OSError) and str(tmp_path) in str(info.value)
    store.close()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads anything")
def test_local_store_permission_denied(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"x")
    path.chmod(0)
    with pytest.raises(stoker.StorageError, match="secret"):
        LocalStore().read(str(path))


def _write_many(root, n, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        data = rng.integers(0, 256, size=int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
        path = os.path.join(root, f"file{i:04d}")
        with open(path, "wb") as f:
            f.write(data)
        out[path] = data
    return out


@needs_proc
def test_local_store_descriptor_cache_is_bounded(tmp_path):
    files = _write_many(str(tmp_path), 60)
    paths = list(files)
    assert open_under(tmp_path) == 0
    store = LocalStore(max_open_files=8)
    for path in paths:
        assert store.read_range(path, 0, 1 << 20) == files[path]
        assert open_under(tmp_path) <= 8
    assert store.counters.files_opened == 60
    for path in paths[-8:]:  # the 8 most recent are still open
        store.read_range(path, 0, 1)
    assert store.counters.files_opened == 60
    store.read_range(paths[0], 0, 1)  # long evicted: reopened
    assert store.counters.files_opened == 61
    assert open_under(tmp_path) <= 8
    store.close()
    assert open_under(tmp_path) == 0


@needs_proc
@pytest.mark.parametrize("n_files,max_open,slow", [(300, 16, False), (300, 16, True), (24, 3, True)])
def test_local_store_concurrent_reads_with_eviction(tmp_path, monkeypatch, n_files, max_open, slow):
    """8 threads, many files, few descriptors: handles are evicted while other threads read them.

    With ``slow``, every read first sleeps briefly (releasing the GIL) so reads overlap far more
    often and a handle is regularly evicted, and even reopened, while a read through it is in flight.
    """
    files = _write_many(str(tmp_path), n_files, seed=1)
    paths = list(files)
    assert open_under(tmp_path) == 0
    store = LocalStore(max_open_files=max_open)
    errors = []
    if slow:
        real_pread = os.pread

        def slow_pread(fd, n, offset):
            time.sleep(0.0002)
            return real_pread(fd, n, offset)

        monkeypatch.setattr(os, "pread", slow_pread)

    def work(seed):
        rng = random.Random(seed)
        for _ in range(300 if slow else 500):
            path = rng.choice(paths)
            data = files[path]
            op = rng.randrange(4)
            if op == 0:
                got, want = store.read(path), data
            elif op == 1:
                off, n = rng.randrange(len(data) + 1), rng.randrange(200)
                got, want = store.read_range(path, off, n), data[off:off + n]
            elif op == 2:  # the executor's read of a shard's inner chunks
                off, n = rng.randrange(len(data) + 1), rng.randrange(200)
                buf = bytearray(n)
                got_n = store.read_range_into(path, off, memoryview(buf))
                got, want = bytes(buf[:got_n]), data[off:off + n]
            else:
                got, want = store.size(path), len(data)
            if got != want:
                errors.append((path, op))
            # cached ones, plus per thread at most: one evicted but in use, one just opened (not yet cached)
            if open_under(tmp_path) > max_open + 2 * 8:
                errors.append(("too many descriptors", open_under(tmp_path)))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert errors == []
    assert len(store._handles) <= max_open
    store.close()
    assert open_under(tmp_path) == 0, "descriptors leaked"


@needs_proc
def test_local_store_evicted_while_in_use_then_reopened_does_not_leak(tmp_path, monkeypatch):
    """A handle evicted while a read is in flight, and reopened meanwhile, is closed by its last user."""
    files = _write_many(str(tmp_path), 2, seed=2)
    (p1, d1), (p2, d2) = files.items()
    assert open_under(tmp_path) == 0
    store = LocalStore(max_open_files=1)
    inside, release = threading.Event(), threading.Event()
    real_pread = os.pread
    blocked_fd = []

    def slow_pread(fd, n, offset):
        if not blocked_fd:
            blocked_fd.append(fd)
            inside.set()
            assert release.wait(10)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", slow_pread)
    result = []
    reader = threading.Thread(target=lambda: result.append(store.read_range(p1, 0, 1 << 20)))
    reader.start()
    assert inside.wait(10)  # the reader is in the middle of reading p1
    assert store.read_range(p2, 0, 1 << 20) == d2  # evicts p1's handle (in use: stays open)
    assert store.read_range(p1, 0, 1 << 20) == d1  # p1 reopened with a new descriptor (evicting p2)
    release.set()
    reader.join(10)
    assert result == [d1]  # the first read was not disturbed by the eviction
    store.close()
    assert open_under(tmp_path) == 0, "the evicted descriptor was never closed"


def test_local_store_forget_makes_rewritten_file_visible(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "ab").mkdir()
    target = str(tmp_path / "a" / "chunk")
    sibling = str(tmp_path / "ab" / "chunk")  # shares the string prefix, not the directory
    for path in (target, sibling):
        with open(path, "wb") as f:
            f.write(b"old contents")
    store = LocalStore()
    assert store.read_range(target, 0, 64) == b"old contents" and store.read_range(sibling, 0, 64) == b"old contents"

    def replace(path, data):
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    replace(target, b"new")
    replace(sibling, b"new")
    assert store.read_range(target, 0, 64) == b"old contents"  # the cached descriptor still sees the old inode
    assert store.read(target) == b"new"  # a whole-file read opens the file afresh
    store.forget(str(tmp_path / "a"))
    assert store.read_range(target, 0, 64) == b"new"
    assert store.size(target) == 3
    assert store.read_range(sibling, 0, 64) == b"old contents"  # not under the forgotten prefix
    store.forget(str(tmp_path / "ab") + os.sep)  # trailing separator works too
    assert store.read_range(sibling, 0, 64) == b"new"
    store.close()


def test_reopen_array_sees_rewritten_chunk(tmp_path):
    """open_array forgets the array's cached descriptors, so a rewrite is visible after reopening."""
    uri = str(tmp_path / "a.zarr")
    arr = zarr.create_array(uri, shape=(4,), chunks=(4,), dtype="u1", fill_value=0)
    arr[...] = [1, 2, 3, 4]
    store = LocalStore()
    assert stoker.open_array(uri, store=store).read([(0, 4)]).tolist() == [1, 2, 3, 4]
    arr[...] = [5, 6, 7, 8]  # zarr writes a new file
    assert stoker.open_array(uri, store=store).read([(0, 4)]).tolist() == [5, 6, 7, 8]
    store.close()
