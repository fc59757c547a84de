"""The disk cache's bound as the disk counts it (allocated blocks, as ``du`` and a full disk see them): every
entry in whole blocks, its subfolders and ``.index`` included; markers are empty files that take no block;
eviction removes the subfolders it empties; a folder an older stoker left (byte totals, full-entry markers)
is brought within the bound by the first write."""

from __future__ import annotations

import os
import struct
import time

import crc32c
import pytest

from stoker.storage import diskcache
from stoker.storage.diskcache import HEADER, MAGIC, DiskCache, FolderUsage, folder_usage, running_total

pytestmark = pytest.mark.timeout(120)


def du(root) -> int:
    """What ``root`` and everything under it takes on disk, as ``du`` counts (measured here, not by the cache)."""
    total = os.lstat(root).st_blocks * 512
    for folder, dirs, names in os.walk(root):
        total += sum(os.lstat(os.path.join(folder, n)).st_blocks * 512 for n in (*dirs, *names))
    return total


def _total(cache: DiskCache) -> int:
    return struct.unpack("<Q", (cache.root / ".index").read_bytes())[0]


def test_every_write_keeps_the_folder_within_cache_bytes_in_blocks(tmp_path):
    # small entries (as chunks of a few hundred bytes are) and larger ones, well past the bound: after every write the folder, as the disk counts it, is within cache_bytes, not even one entry over,
    # and the running total every process reads never counts less than the disk holds
    bound = 256 << 10
    cache = DiskCache(str(tmp_path / "c"), bound)
    for i in range(600):
        assert cache.write(f"entry {i}", os.urandom(100 if i % 2 else 5_000))
        on_disk = du(cache.root)
        assert on_disk <= _total(cache) <= bound, (i, on_disk, _total(cache))
    assert cache.evicted > 300  # under pressure all along
    assert du(cache.root) > 0.5 * bound
    assert du(cache.root) == cache.allocated()


def test_folder_usage_and_running_total_read_what_the_writes_left(tmp_path):
    # the two public reads of a folder (what the bench's CachePeak samples): one scan gives du's blocks, the
    # entries' bytes (markers and all, .index apart) and the largest entry; the running total is the writes'
    cache = DiskCache(str(tmp_path / "c"), 256 << 10)
    assert running_total(cache.root) is None and folder_usage(cache.root) == FolderUsage(0, 0, 0)  # nothing written yet
    sizes = []
    for i in range(120):
        if i % 3:
            assert cache.write(f"entry {i}", os.urandom(50 * i))
            sizes.append(HEADER.size + len(f"entry {i}") + 50 * i)
        else:
            assert cache.write_marker(f"marker {i}")
    assert cache.evicted > 0  # past the bound: entries evicted, subfolders emptied and removed
    usage = folder_usage(cache.root)
    files = [os.path.join(f, n) for f, _, names in os.walk(cache.root) for n in names if n != ".index"]
    assert usage.allocated == du(cache.root) == cache.allocated()
    assert usage.nbytes == cache.size_on_disk() == sum(os.path.getsize(f) for f in files)
    assert usage.largest == max(os.path.getsize(f) for f in files) and usage.largest in sizes
    assert running_total(cache.root) == _total(cache) and du(cache.root) <= running_total(cache.root) <= 256 << 10


def test_markers_count_as_the_disk_counts_them(tmp_path):
    # markers among small entries: the bound holds with them, and they add no blocks of their own
    bound = 128 << 10
    cache = DiskCache(str(tmp_path / "c"), bound)
    for i in range(300):
        assert cache.write_marker(f"marker {i}") if i % 2 else cache.write(f"entry {i}", b"e" * 100)
        assert du(cache.root) <= _total(cache) <= bound, i
    files = [os.path.join(f, n) for f, _, names in os.walk(cache.root) for n in names if n != ".index"]
    assert any(os.path.getsize(f) == 0 for f in files) and any(os.path.getsize(f) > 0 for f in files)
    assert all(os.lstat(f).st_blocks == 0 for f in files if os.path.getsize(f) == 0)


def test_markers_are_empty_files_that_take_no_block(tmp_path):
    cache = DiskCache(str(tmp_path / "c"), 1 << 20)
    cache.mark("s3://bkt\nc/0/1\nkept")
    assert cache.flush(10)
    path = cache.path("s3://bkt\nc/0/1\nkept")
    st = os.lstat(path)
    assert st.st_size == 0 and st.st_blocks == 0
    assert cache.has("s3://bkt\nc/0/1\nkept") and not cache.has("s3://bkt\nc/0/2\nkept")
    assert cache.written == 1
    cache.mark("s3://bkt\nc/0/1\nkept")  # again: already there, nothing written
    assert cache.flush(10) and cache.written == 1


def test_eviction_removes_the_subfolders_it_empties(tmp_path):
    # 256 possible subfolders of a block each would alone pass a 64 KiB bound; those eviction empties go
    block = os.statvfs(tmp_path).f_frsize
    cache = DiskCache(str(tmp_path / "c"), 64 << 10)
    for i in range(200):
        cache.write(f"entry {i}", b"e" * 200)
        assert du(cache.root) <= 64 << 10
    subfolders = [e for e in os.scandir(cache.root) if e.is_dir()]
    entries = [n for f in subfolders for n in os.listdir(f.path)]
    assert 0 < len(subfolders) <= len(entries) <= (64 << 10) // block
    assert all(os.listdir(f.path) for f in subfolders)  # none left empty
    assert cache.get("entry 199") is not None


def _old_entry(path: str, ident: str, payload: bytes) -> None:
    name = ident.encode()
    crc = crc32c.crc32c(payload, crc32c.crc32c(name))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, 0, crc, len(name), len(payload)) + name + payload)


def test_a_folder_an_older_stoker_left_is_brought_within_the_bound(tmp_path):
    # an older stoker counted bytes: its folder holds entries and full-entry markers (a header and ident, no
    # payload) in 4 KiB blocks each, far past the bound in blocks, and a byte total in .index that says it fits
    bound = 128 << 10
    old = DiskCache(str(tmp_path / "c"), bound)
    written = 0
    for i in range(80):
        ident = f"old {i}" if i % 2 else f"s3://bkt\nk{i}\nkept"
        payload = b"o" * 300 if i % 2 else b""
        _old_entry(str(old.path(ident)), ident, payload)
        written += HEADER.size + len(ident) + len(payload)
    (old.root / ".index").write_bytes(struct.pack("<Q", written))
    assert written < bound < du(old.root)
    cache = DiskCache(str(tmp_path / "c"), bound)  # a process of this version: its first write scans
    assert cache.write("new", b"n" * 1000)
    assert du(cache.root) <= _total(cache) <= bound
    assert bytes(cache.get("new")) == b"n" * 1000
    # what eviction left of the old folder is still served: entries read, old markers found
    kept = [i for i in range(1, 80, 2) if cache.path(f"old {i}").exists()]
    assert kept and all(bytes(cache.get(f"old {i}")) == b"o" * 300 for i in kept)
    markers = [i for i in range(0, 80, 2) if cache.path(f"s3://bkt\nk{i}\nkept").exists()]
    assert all(cache.has(f"s3://bkt\nk{i}\nkept") for i in markers)


def test_a_marker_found_is_not_looked_up_again_for_a_while(tmp_path, monkeypatch):
    # a pipeline opening hundreds of arrays asks for their markers: one found (or queued) a moment ago is taken
    # as there without a system call (before: each ask touched the file, which gave the GIL up on the opener
    # threads and waited for it back); it is looked at, and touched for the LRU (by the folder's writer thread:
    # flush), again once SEEN_S passed
    ident = "s3://bkt\nc/0/1\nkept"
    cache = DiskCache(str(tmp_path / "c"), 1 << 20)
    cache.mark(ident)
    assert cache.has(ident)  # queued: found before the writer made it
    assert cache.flush(10)
    other = DiskCache(str(tmp_path / "c"), 1 << 20)  # another process's view: nothing remembered
    path = other.path(ident)
    old = time.time() - 3600
    os.utime(path, (old, old))
    assert other.has(ident) and other.flush(10) and os.lstat(path).st_mtime > old + 3000  # looked at, touched
    os.utime(path, (old, old))
    assert other.has(ident) and other.flush(10) and os.lstat(path).st_mtime == old  # remembered: not looked at
    assert not other.has("s3://bkt\nc/0/2\nkept")
    monkeypatch.setattr(diskcache, "SEEN_S", 0.0)
    assert other.has(ident) and other.flush(10) and os.lstat(path).st_mtime > old + 3000  # SEEN_S passed: again
    os.unlink(path)
    assert not other.has(ident)  # evicted meanwhile: looked at, gone
