"""The disk cache's eviction scan (``DiskCache._evict``) is the compiled engine's (csrc/evict.c), the GIL released
once for it: beside a thread busy in Python it takes what it takes alone, not a wait for the GIL after each of its
system calls (two a file) with the folder's lock held. It evicts what its Python twin (``diskcache.evict_entries``)
evicts: least recently used first (mtime), down to the target, emptied subfolders removed, nothing followed
through a link, dead writers' temporary files removed, an entry a reader opened still read whole."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time

import pytest

from stoker.engine.cpu import native
from stoker.storage import diskcache
from stoker.storage.diskcache import DiskCache, allocated_on_disk
from stoker.storage.fsutil import HOST

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(native.evict_entries is None, reason="stoker._native is not built")]

BLOCK = 4096
T0 = 1_700_000_000


def _name(i: int) -> str:  # as DiskCache names an entry: spread over 256 subfolders
    return hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest()


def _folder(root, n: int, seed: int = 0) -> dict[str, int]:
    """A cache folder's ``v1`` of ``n`` entries (sizes and mtimes drawn), markers, and what else may lie there:
    a dead writer's temporary file, a link to a folder and one to an entry, a stray file, a nested folder, an
    ``.index``. Returns each entry's relative path -> its mtime (s)."""
    import random

    draw = random.Random(seed)
    mtimes = {}
    for i in range(n):
        name = _name(i + 1000 * seed)
        sub = root / name[:2]
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / name
        path.write_bytes(b"\0" * (0 if i % 11 == 0 else draw.randrange(1, 40_000)))  # every 11th: a marker
        mtime = T0 + draw.randrange(0, 10_000)
        os.utime(path, (mtime, mtime))
        mtimes[f"{name[:2]}/{name}"] = mtime
    (root / ".index").write_bytes((123).to_bytes(8, "little"))
    some = sorted(p for p in root.iterdir() if p.is_dir())[0]
    (some / f".{_name(99_999)}.tmp-nohost-999999999-0000abcd").write_bytes(b"x" * 5000)  # another machine's
    (root / "zz").mkdir()
    (root / "zz" / "nested").mkdir()
    (root / "zz" / "stray").write_bytes(b"s" * 100)
    (root / "ln").symlink_to(some)  # a link to a folder: not entered
    (some / ("f" * 32)).symlink_to(some / os.listdir(some)[0])  # a link named as an entry: unlinked, not followed
    return mtimes


def _tree(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root) for f in (*dirs, *files)}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("hold_if_temp", [False, True])
def test_the_compiled_scan_evicts_what_its_python_twin_evicts(tmp_path, seed, hold_if_temp):
    base = tmp_path / "base"
    mtimes = _folder(base, 300, seed)
    size = allocated_on_disk(base)
    got = {}
    for name, scan in (("compiled", native.evict_entries), ("python", diskcache.evict_entries)):
        root = tmp_path / name
        shutil.copytree(base, root, symlinks=True)  # (copy2: the mtimes kept)
        target = size // (seed + 2)
        got[name] = scan(str(root), size - 1, target, 0, BLOCK, hold_if_temp), _tree(root)
        total, evicted, temp = got[name][0]
        assert temp == [sorted(p for p in os.listdir(base) if len(p) == 2)[0].encode()]
        if hold_if_temp:  # a temporary file found: nothing unlinked
            assert evicted == 0 and got[name][1] == _tree(base)
            continue
        assert total == allocated_on_disk(root) and total <= target  # counted as the disk holds it
        gone = {p for p in mtimes if p not in got[name][1]}
        assert len(gone) == evicted > 0
        # least recently used first: every entry evicted is at most as recent as every one kept
        assert max(mtimes[p] for p in gone) <= min(mtimes[p] for p in mtimes if p not in gone)
        assert "ln" in got[name][1] and os.path.isdir(root / "ln")  # the link to a folder: left as it is
    assert got["compiled"][0] == got["python"][0] and got["compiled"][1] == got["python"][1]


def test_eviction_removes_dead_writers_files_keeps_the_bound_and_an_open_entry_reads_on(tmp_path):
    cache = DiskCache(str(tmp_path), 2 << 20)
    payloads = {f"k{i}": bytes([i]) * 30_000 for i in range(60)}  # 60 x 32 KiB in blocks: over the bound
    for i, (ident, data) in enumerate(payloads.items()):
        assert cache.write(ident, data)
        if i == 0:
            opened = open(cache.path(ident), "rb")  # a reader of the least recently used entry
            dead = cache.path(ident).parent / f".x.tmp-{HOST}-999999999-00000001"
            dead.write_bytes(b"d" * 10_000)  # a dead writer's file (no process has that pid)
    try:
        assert cache.evicted > 0 and not cache.path("k0").exists()
        assert opened.read()[-30_000:] == payloads["k0"]  # evicted while open: read whole
    finally:
        opened.close()
    assert not dead.exists()
    assert allocated_on_disk(cache.root) <= cache.cache_bytes
    assert cache.get("k59") is not None  # the most recent kept


class _Spinner:
    """A thread busy in Python beside the scan, each hold of the GIL ``interval_s`` long (the switch interval):
    a thread that gives the GIL up for a system call waits about that long to get it back, each time."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = False

    def _spin(self) -> None:
        n = 0
        while not self._stop:
            n += 1

    def __enter__(self) -> "_Spinner":
        self._previous = sys.getswitchinterval()
        sys.setswitchinterval(self.interval_s)
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join(10)
        sys.setswitchinterval(self._previous)


def test_a_scan_beside_a_busy_interpreter_waits_for_the_gil_once_not_per_file(tmp_path):
    """500 entries, a switch interval of 20 ms: the Python scan waited for the GIL after each of its ~1,000 system
    calls (some 20 s); the compiled one waits once (the lock held that long too)."""
    cache = DiskCache(str(tmp_path), 1 << 30)
    _folder(cache.root, 500)
    cache._open_lock()  # (the folder's block size learnt, as a write does before it scans)
    t0 = time.monotonic()
    with _Spinner(0.02):
        s0 = time.monotonic()
        total = cache._evict(1 << 40)  # everything must go
        took = time.monotonic() - s0
    assert cache.evicted == 500 + 1  # every entry, and the link named as one
    assert total == allocated_on_disk(cache.root)
    assert took < 2.0, f"the scan took {took:.2f} s beside a busy thread ({time.monotonic() - t0:.1f} s in all)"


def test_a_folder_not_made_yet_or_a_bad_path_is_answered_alike(tmp_path):
    for scan in (native.evict_entries, diskcache.evict_entries):
        assert scan(str(tmp_path / "none"), 1, 0, 10, BLOCK, False) == (0, 0, [])
    with pytest.raises(ValueError):
        native.evict_entries(str(tmp_path) + "\0x", 1, 0, 10, BLOCK, False)
