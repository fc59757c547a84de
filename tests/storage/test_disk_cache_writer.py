"""The disk cache's writer keeps up with a busy pipeline: a batch of queued entries is written per hold of the
folder's lock, the compiled engine's ``write_entries`` (csrc/entries.c) making their files with the GIL released
once. Against the loopback HTTP server (a process of its own, as an object store is), a first epoch read while
the interpreter is busy leaves every entry on disk, so the second epoch fetches no chunk at all; the compiled
writer and its Python twin make the same files; bad input and failures mid-entry leave nothing served."""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import crc32c
import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.cpu import native
from stoker.storage import diskcache
from stoker.storage.diskcache import DiskCache, disk_cache

import preload_shim
from store_fixtures import FAST_REMOTE

pytestmark = pytest.mark.timeout(240)

compiled = pytest.mark.skipif(native.write_entries is None, reason="stoker._native is not built")


class _BusyInterpreter:
    """Python threads that hold the GIL as a busy pipeline's do (numpy, torch and other C code that keeps it
    while it works): each call holds it about ``hold_s`` before it is given up, so a thread that gave the GIL up
    for a system call waits up to that long to get it back, each time."""

    def __init__(self, threads: int = 2, hold_s: float = 0.005) -> None:
        self.threads = threads
        t0 = time.thread_time()
        sum(range(100_000))  # C all through: the GIL is not given up until it returns
        self.n = max(10_000, int(100_000 * hold_s / max(time.thread_time() - t0, 1e-4)))
        self._stop = threading.Event()

    def _spin(self) -> None:
        while not self._stop.is_set():
            sum(range(self.n))

    def __enter__(self) -> "_BusyInterpreter":
        self._spinners = [threading.Thread(target=self._spin, daemon=True) for _ in range(self.threads)]
        for t in self._spinners:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._spinners:
            t.join(10)


#: Modules whose functions make system calls, giving the GIL up and waiting to get it back (os's, the engine's).
_SYSTEM_CALLS = {"posix", "stoker._native"}
_NO_WAIT = {"fspath", "getpid"}  # of those, the ones that keep the GIL


@compiled
def test_the_writer_waits_for_the_gil_once_a_batch_not_at_each_system_call(tmp_path):
    # Every call that makes a system call gives the GIL up, and on a busy pipeline waits to get it back: written
    # one at a time in Python, each entry made a dozen such calls, and the writer fell behind a first epoch's
    # fetches (its queue full, the newest entries dropped). Queued while another process holds the folder's
    # lock, 100 entries are written in one batch: a few calls for them all.
    cache = DiskCache(str(tmp_path / "cache"), 1 << 30)
    assert cache.write("first", b"f")  # the folder made and scanned, as after a process's first entry
    calls: list[str] = []

    def profile(frame, event, arg) -> None:  # the writer thread's calls of builtins (it starts at the first put)
        if event == "c_call" and getattr(arg, "__module__", None) in _SYSTEM_CALLS and arg.__name__ not in _NO_WAIT:
            calls.append(arg.__name__)

    threading.setprofile(profile)
    try:
        lock = os.open(cache.root / ".index", os.O_RDWR)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            payloads = [os.urandom(50_000) for _ in range(4)]
            for i in range(100):
                cache.put(f"entry {i}", payloads[i % 4])
            time.sleep(0.2)  # the writer took what was queued and waits for the lock
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
        assert cache.flush(30)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert cache.written == 101 and cache.dropped == 0
    assert all(bytes(cache.get(f"entry {i}")) == payloads[i % 4] for i in range(100))
    assert calls.count("write_entries") <= 2  # the first entry (alone in the queue when the writer woke), the rest
    assert len(calls) <= 30, sorted(calls)  # one at a time: some 800


_SERVER = textwrap.dedent("""
    import sys
    from range_server import RangeServer
    server = RangeServer(sys.argv[1])
    print(server.url, flush=True)
    for line in sys.stdin:  # "gets": the GET requests of chunks so far
        gets = sum(1 for _, method, path in list(server.log) if method == "GET" and "/c/" in path)
        print(gets, flush=True)
    server.stop()
""")

CHUNK = (100, 2000)  # 200 KB of random bytes: zstd keeps them about that size
ROWS = 48


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(url, ask)``: a 19 MB array of 96 chunks served over HTTP by another process, which ``ask()`` asks how
    many chunk GETs it has answered."""
    root = tmp_path_factory.mktemp("served")
    values = np.random.default_rng(7).integers(0, 256, (ROWS * CHUNK[0], CHUNK[1]), dtype=np.uint8)
    zarr.create_array(str(root / "a"), shape=values.shape, chunks=CHUNK, dtype="uint8",
                      compressors=ZstdCodec(level=1))[...] = values
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])})
    url = server.stdout.readline().strip()
    assert url.startswith("http://"), url

    def ask() -> int:
        server.stdin.write("gets\n")
        server.stdin.flush()
        return int(server.stdout.readline())

    yield url, ask, values
    server.stdin.close()
    server.wait(30)


def _epoch(url: str, folder, values: np.ndarray) -> None:
    """Every chunk of the array once, a whole chunk a crop, 8 a batch, checked against the values written."""
    cfg = stoker.Config(batch_size=8, dtype="native", n_compute_threads=2, pop_timeout_s=120,
                        storage_options={url + "/": dict(FAST_REMOTE)}, cache_dir=str(folder), cache_bytes=1 << 30)
    boxes = [((r * CHUNK[0], (r + 1) * CHUNK[0]), (0, CHUNK[1])) for r in range(ROWS)]
    with stoker.Pipeline(cfg) as p:
        for start in range(0, ROWS, 8):
            p.push([stoker.Sample(f"{url}/a", box) for box in boxes[start:start + 8]])
        for start in range(0, ROWS, 8):
            with p.pop() as b:
                got = [t.numpy().copy() for t in torch.from_dlpack(b)]
            for crop, box in zip(got, boxes[start:start + 8]):
                np.testing.assert_array_equal(crop, values[tuple(slice(*s) for s in box)])


@compiled
def test_a_first_epoch_with_a_busy_interpreter_leaves_every_entry_on_disk(served, tmp_path):
    url, ask, values = served
    folder = tmp_path / "cache"
    cache = disk_cache(str(folder), 1 << 30)  # the pipelines' (one per folder, bound and process)
    with _BusyInterpreter():
        _epoch(url, folder, values)
        assert cache.flush(60)
    assert cache.dropped == 0, f"{cache.dropped} of {ROWS} entries dropped: the writer fell behind"
    fetched, hit_bytes = ask(), cache.hit_bytes
    _epoch(url, folder, values)  # a new pipeline: generations revalidated (HEAD), every chunk from disk
    assert ask() == fetched, "the second epoch fetched chunks: the first left them off the disk"
    assert cache.hit_bytes - hit_bytes >= values.nbytes * 0.9  # (zstd keeps random bytes about as they are)


# -- the compiled writer against its Python twin, and bad input ------------------------------------------------


def _tree(root) -> dict[str, bytes]:
    """Every file under ``root`` but the lock file: relative path -> bytes."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if name != ".index":
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = f.read()
    return out


@compiled
@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_writer_makes_the_files_its_python_twin_makes(tmp_path, seed):
    rng = np.random.default_rng(seed)
    idents = ["plain", "ünï\udcff", "x" * 3000, "", "dup", "dup", "marker"] + [f"k{i}" for i in range(20)]
    items = []
    for ident in idents:
        payload = None if ident == "marker" else rng.integers(0, 256, int(rng.integers(0, 300_000)),
                                                              dtype=np.uint8).tobytes()
        items.append((ident, payload))
    caches = {}
    for name, writer in (("compiled", native.write_entries), ("python", diskcache.write_entries)):
        previous = diskcache.use_entry_writer(writer)
        try:
            cache = caches[name] = DiskCache(str(tmp_path / name), 1 << 30)
            done = cache._write_batch(items)
        finally:
            diskcache.use_entry_writer(previous)
        # the second "dup" found there already: stored (no loss), not written twice
        assert done == [True] * len(idents) and cache.written == len(idents) - 1
        total = int.from_bytes((cache.root / ".index").read_bytes(), "little")
        assert total == cache.allocated(), (name, total, cache.allocated())  # counted as the disk holds it
    trees = {name: _tree(cache.root) for name, cache in caches.items()}
    assert trees["compiled"] == trees["python"]
    cache = caches["compiled"]
    kept: dict = {}
    for ident, payload in items:
        kept.setdefault(ident, payload)  # the first of two with one ident is the one kept
    for ident, payload in kept.items():
        if payload is not None:
            got = cache.get(ident)
            assert got is not None and bytes(got) == payload  # sound: the header, ident and crc32c check out
        else:
            assert cache.has(ident)


@compiled
def test_bad_items_are_refused_before_anything_is_written(tmp_path):
    path = os.fsencode(tmp_path / "v1" / "ab" / "abc")
    for items, error in [([("p", b"i", b"x")], ValueError), ([(path, b"i")], ValueError),
                         ([(path, b"i", b"x"), (b"a/b\0/c", b"i", b"x")], ValueError),
                         ([(path, b"i", 12)], TypeError), (12, TypeError)]:
        with pytest.raises(error):
            native.write_entries(items, "host-1", 1)
    with pytest.raises(ValueError):
        native.write_entries([], "a/b", 1)  # the tag is part of a file's name
    assert not (tmp_path / "v1").exists()


@pytest.mark.parametrize("writer", ["compiled", "python"])
def test_planted_links_and_names_without_a_subfolder_are_never_written_through(tmp_path, writer):
    write = native.write_entries if writer == "compiled" else diskcache.write_entries
    if write is None:
        pytest.skip("stoker._native is not built")
    root = tmp_path / "v1"
    elsewhere = tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, root / "ab")  # a subfolder that is a link
    os.symlink(elsewhere / "target", root / "cd-final")  # a final name that is a link
    (root / "cd").mkdir()
    os.symlink(elsewhere / "target", root / "cd" / "cdef")
    results, _, _ = write([(os.fsencode(root / "cd" / "cdef"), b"i", b"x" * 10)], "host-1", 3)
    assert results == [-errno.EEXIST]  # no entry there (a link): left as it is, its target never made
    results, _, _ = write([(os.fsencode(root / "ab" / "abcd"), b"i", b"x" * 10),
                           (os.fsencode(root / "cd" / "cd12"), b"i", b"x")], "host-1", 3)
    assert results == [-errno.ENOTDIR, 0]  # stopped there: the next not tried
    for bad in (b"name", b"/name", b"//name", os.fsencode(root) + b"//name", os.fsencode(root / "cd") + b"/"):
        results, _, grown = write([(bad, b"i", b"x")], "host-1", 3)
        assert results == [-errno.EINVAL] and grown == 0, bad
    assert os.listdir(elsewhere) == [] and os.listdir(root / "cd") == ["cdef"]


@pytest.mark.parametrize("writer", ["compiled", "python"])
@pytest.mark.parametrize("what", ["folder", "link", "fifo"])
@pytest.mark.parametrize("kind", ["entry", "marker"])
def test_something_not_a_file_at_an_entry_name_is_a_failed_write_with_one_warning(tmp_path, monkeypatch, writer,
                                                                                 what, kind):
    # Before: the writers took anything at an entry's name as "there already" (another writer won the race), so
    # a folder, link or FIFO planted there counted as stored: its key was fetched again at every read (readers
    # open regular files only, never through a link) and nothing said why. Now a failed write: the cache goes
    # off in this process with one warning, reads go on uncached, and what was planted is left as it was.
    write = native.write_entries if writer == "compiled" else diskcache.write_entries
    if write is None:
        pytest.skip("stoker._native is not built")
    monkeypatch.setattr(diskcache, "_entry_writer", [write])
    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    ident = "mem://bkt|a/c/0|0:-1|e1"
    assert cache.write("mem://bkt|a/c/1|0:-1|e1", b"w" * 100)  # the folder made, its first scan done
    path = cache.path(ident)
    path.parent.mkdir(exist_ok=True)
    _plant(str(path), what)
    with pytest.warns(RuntimeWarning, match="not a regular file") as warned:
        stored = cache.write(ident, b"v" * 1000) if kind == "entry" else cache.write_marker(ident)
        assert not stored and not cache.writable
        cache.put("mem://bkt|a/c/2|0:-1|e1", b"x" * 10)  # off: nothing more queued, nor warned
        assert not cache.queued("mem://bkt|a/c/2|0:-1|e1")
    assert len(warned) == 1
    assert cache.get(ident) is None  # a miss: fetched from the store
    assert bytes(cache.get("mem://bkt|a/c/1|0:-1|e1")) == b"w" * 100  # what was stored is still served
    mode = os.lstat(path).st_mode
    assert {"folder": stat.S_ISDIR, "link": stat.S_ISLNK, "fifo": stat.S_ISFIFO}[what](mode)  # left as it was


def test_a_link_planted_at_the_folders_total_is_never_written_through(tmp_path):
    # Before: the folder's lock and total (v1/.index) was opened following links: one planted there had the
    # total's 8 bytes written into its target. Now a failed write: one warning, reads uncached.
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's own bytes")
    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    cache.root.mkdir(parents=True)
    os.symlink(victim, cache.root / ".index")
    with pytest.warns(RuntimeWarning, match="stops caching") as warned:
        assert not cache.write("mem://bkt|a/c/0|0:-1|e1", b"v" * 1000)
        assert not cache.write("mem://bkt|a/c/1|0:-1|e1", b"v" * 1000)
    assert len(warned) == 1 and cache.get("mem://bkt|a/c/0|0:-1|e1") is None
    assert victim.read_bytes() == b"the victim's own bytes" and os.path.islink(cache.root / ".index")


_TOO_BIG = textwrap.dedent("""
    import os, resource, sys
    from stoker.engine.cpu import native
    from stoker.storage import diskcache
    write = native.write_entries if sys.argv[2] == "compiled" else diskcache.write_entries
    root = sys.argv[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))  # past it: EFBIG (Python ignores SIGXFSZ)
    results, allocated, grown = write([(os.fsencode(root + "/ab/ab1"), b"small", b"s" * 1000),
                                       (os.fsencode(root + "/ab/ab2"), b"big", b"b" * 100_000),
                                       (os.fsencode(root + "/ab/ab3"), b"after", b"a" * 10)], "host-1", 5)
    print(results, allocated[0] > 0, grown >= allocated[0])
""")


@pytest.mark.parametrize("writer", ["compiled", "python"])
def test_a_write_failing_mid_entry_leaves_no_file_and_stops_the_batch(tmp_path, writer):
    if writer == "compiled" and native.write_entries is None:
        pytest.skip("stoker._native is not built")
    root = tmp_path / "v1"
    root.mkdir()
    out = subprocess.run([sys.executable, "-c", _TOO_BIG, str(root), writer], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, check=True)
    assert out.stdout.split("\n")[0] == f"[1, {-errno.EFBIG}, 0] True True", out
    assert sorted(os.listdir(root / "ab")) == ["ab1"]  # the failed one's temporary file removed, the last untried
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY  # (the child's limit only)


# -- fuzzing: any batch, any folder state; the compiled writer answers and writes as its Python twin does -------

_LONG = os.environ.get("STOKER_FUZZ_EXAMPLES", "").strip()
_PLANTS = ["nothing", "file", "folder", "link", "fifo", "empty entry"]


def _plant(path: str, what: str) -> None:
    if what == "file":
        with open(path, "wb") as f:
            f.write(b"planted")
    elif what == "folder":
        os.mkdir(path)
    elif what == "link":
        os.symlink("/nonexistent/target", path)
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "empty entry":
        open(path, "wb").close()


def _sound(raw: bytes | None, ident: bytes, payload: bytes) -> None:
    """``raw`` is an entry of ``ident`` holding ``payload``: magic, lengths, crc32c (the crc32c package's)."""
    assert raw is not None
    magic, pad, crc, ident_len, length = diskcache.HEADER.unpack_from(raw)
    body = raw[diskcache.HEADER.size:]
    assert (magic, pad, ident_len, length) == (diskcache.MAGIC, 0, len(ident), len(payload))
    assert body == ident + payload and crc == crc32c.crc32c(body)


def _state(root: str) -> dict[str, tuple[str, bytes]]:
    """Every name under ``root``: its kind and, for a regular file, its bytes."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for name in (*dirs, *names):
            path = os.path.join(folder, name)
            mode = os.lstat(path).st_mode
            kind = "link" if os.path.islink(path) else "dir" if os.path.isdir(path) else \
                "file" if os.path.isfile(path) else "other"
            data = b""
            if kind == "file":
                with open(path, "rb") as f:
                    data = f.read()
            out[os.path.relpath(path, root)] = (kind, data, mode & 0o7777 if kind != "link" else 0)
    return out


@compiled
@pytest.mark.fuzz
@pytest.mark.timeout(600 if _LONG else 120)
def test_fuzz_batches_against_the_python_twin(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    names = st.sampled_from(["ab", "cd", "ef"])
    item = st.tuples(
        st.one_of(st.tuples(names, st.sampled_from(["ab01", "ab02", "cd01", "x"])).map(lambda p: f"{p[0]}/{p[1]}"),
                  st.sampled_from(["", "name", "/", "ab/", "ab//x", "../ab/x", "ab/../cd/x", "ab/./y"])),
        st.binary(max_size=300),
        st.one_of(st.none(), st.binary(max_size=2000), st.integers(0, 70_000).map(lambda n: os.urandom(n))))
    plant = st.tuples(st.sampled_from(["ab", "cd", "ab/ab01", "ab/ab02", "cd/cd01", "ef/x"]),
                      st.sampled_from(_PLANTS))
    runs = iter(range(10**9))

    @settings(max_examples=int(_LONG) if _LONG else 150, derandomize=not _LONG, database=None, deadline=None,
              print_blob=True, suppress_health_check=list(HealthCheck))
    @given(items=st.lists(item, max_size=8), plants=st.lists(plant, max_size=4), seed=st.integers(0, 2**64 - 1))
    def check(items, plants, seed):
        run = next(runs)
        answers, states = [], []
        for name, write in (("c", native.write_entries), ("py", diskcache.write_entries)):
            root = str(tmp_path / f"{run}-{name}" / "v1")
            os.makedirs(root)
            for where, what in plants:
                path = os.path.join(root, where)
                if not os.path.lexists(path) and os.path.isdir(os.path.dirname(path)) \
                        and not os.path.islink(os.path.dirname(path)):
                    _plant(path, what)
            batch = [(os.fsencode(f"{root}/{p}"), ident, payload) for p, ident, payload in items]
            results, allocated, grown = write(batch, "host-1", seed)
            answers.append(results)
            states.append(_state(root))
            assert all(a >= 0 for a in allocated)
            for (path, ident, payload), result in zip(batch, results):
                if result == 1 and payload is not None:  # written: sound, as the readers check it
                    _sound(diskcache.read_file(os.fsdecode(path), 1 << 30), ident, payload)
        assert answers[0] == answers[1]
        assert states[0] == states[1]
        assert not any(".tmp-" in name for name in states[0])  # no temporary file left behind

    check()


def test_an_entry_queued_for_writing_is_served_from_the_queue_and_queued_once(tmp_path, monkeypatch):
    # Not on disk yet (the writer waits for the lock another process holds, or is behind): a read of it was a
    # miss, so the chunk was fetched again and queued again, a second copy of its bytes in the queue, which
    # then dropped newer entries (a first epoch of scenario 1 queued a third of its entries twice)
    monkeypatch.setattr(diskcache, "QUEUE_BYTES", 15_000)  # one entry of 10,000 bytes, not two
    cache = DiskCache(str(tmp_path / "c"), 64 << 20)
    assert cache.write("first", b"a" * 100)  # the folder and its lock file made
    lock = os.open(tmp_path / "c" / "v1" / ".index", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        value = os.urandom(10_000)
        cache.put("queued", value)
        hits = cache.hits
        assert cache.entry_file("queued") is None  # not on disk: not for the engine
        got = cache.get_many(["queued", "first", "absent"])
        assert bytes(got[0]) == value and bytes(got[1]) == b"a" * 100 and got[2] is None
        assert cache.hits == hits + 2
        cache.put("queued", value)  # fetched again meanwhile (by a caller that did not ask first)
        assert cache.dropped == 0
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
    assert cache.flush(30)
    assert cache.written == 2 and bytes(cache.get("queued")) == value
    assert cache.entry_file("queued") is not None


# -- what the review found: batches that over-evicted, queued buffers shared, a list read without the GIL --------


class _Held:
    """The folder's lock held as another process holds it: what is put meanwhile waits in the queue, and the
    writer takes it in batches once the lock is let go."""

    def __init__(self, cache: DiskCache) -> None:
        os.makedirs(cache.root, exist_ok=True)
        self.fd = os.open(cache.root / ".index", os.O_RDWR | os.O_CREAT)

    def __enter__(self) -> "_Held":
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _du(root) -> int:
    """What ``root`` and everything under it takes on disk, as ``du`` counts (measured here, not by the cache)."""
    total = os.lstat(root).st_blocks * 512
    for folder, dirs, names in os.walk(root):
        total += sum(os.lstat(os.path.join(folder, n)).st_blocks * 512 for n in (*dirs, *names))
    return total


def _small_entries(cache: DiskCache, rounds: int, batched: bool) -> None:
    """``rounds`` of 250 entries of 100 bytes (a marker every tenth): queued behind the held lock and written in
    batches, or written one at a time; after each round the folder is within the bound as the disk counts it."""
    for r in range(rounds):
        if batched:
            with _Held(cache):
                for i in range(250):
                    cache.mark(f"round {r} {i}") if i % 10 == 9 else cache.put(f"round {r} {i}", b"v" * 100)
            assert cache.flush(60)
        else:
            for i in range(250):
                assert cache.write_marker(f"round {r} {i}") if i % 10 == 9 else cache.write(f"round {r} {i}",
                                                                                            b"v" * 100)
        assert _du(cache.root) <= diskcache.running_total(cache.root) <= cache.cache_bytes, r


@pytest.mark.parametrize("mib", [8, 3])
def test_a_batch_of_small_entries_evicts_no_more_than_writing_them_one_at_a_time(tmp_path, mib):
    # Each entry reserved its blocks and 3 more for its subfolder, so 250 entries of 100 bytes asked ~4 MiB of
    # an 8 MiB cache, and making room for that went down to cache - 2 * 4 MiB: half the cache evicted for a
    # MiB of entries (977 evicted, against 411 one at a time); in 3 MiB every entry evicted and a batch's tail
    # dropped though it would have fit
    one, batched = (DiskCache(str(tmp_path / name), mib << 20) for name in ("one", "batched"))
    _small_entries(one, 8, batched=False)
    _small_entries(batched, 8, batched=True)
    assert one.written == batched.written == 2000 and batched.dropped == 0
    # the same entries kept, give or take one sweep of eviction (a tenth of the bound, in 4 KiB entries)
    slack = (mib << 20) // 10 // 4096
    assert batched.evicted <= one.evicted + slack, (batched.evicted, one.evicted)
    assert _du(batched.root) >= 0.8 * (mib << 20)


def test_a_queued_buffer_changed_after_put_is_served_and_written_as_it_was_put(tmp_path, monkeypatch):
    # A bytearray (as a store's read returns) was queued by reference: the producer reusing it changed what
    # later reads were served and what was written (with a checksum of the changed bytes), a reader writing
    # into what it was served changed it for the next, and a buffer shrunk after put left its size counted in
    # the queue for good (later puts dropped)
    monkeypatch.setattr(diskcache, "QUEUE_BYTES", 3 << 19)  # one MiB entry at a time, not two
    cache = DiskCache(str(tmp_path / "c"), 64 << 20)
    with _Held(cache):
        data = bytearray(b"A" * 16)
        shrunk = bytearray(b"B" * (1 << 20))
        array = np.full(1000, 7, dtype=np.uint16)[::2]  # not contiguous: served as its bytes in C order
        cache.put("changed", data)
        cache.put("shrunk", shrunk)
        cache.put("array", array)
        data[:4] = b"ZZZZ"
        del shrunk[:]
        array[:] = 9
        served = cache.get("changed")
        assert bytes(served) == b"A" * 16 and served.readonly
        assert bytes(cache.get("shrunk")) == b"B" * (1 << 20)
        assert bytes(cache.get("array")) == np.full(500, 7, dtype=np.uint16).tobytes()
    assert cache.flush(30) and cache.written == 3
    assert bytes(cache.get("changed")) == b"A" * 16 and bytes(cache.get("shrunk")) == b"B" * (1 << 20)
    import obstore  # what the object stores return, immutable as bytes are: queued and served without a copy

    kept = [b"bytes" * 100, obstore.Bytes(b"obstore" * 100)]
    with _Held(cache):
        for i, value in enumerate(kept):
            cache.put(f"kept {i}", memoryview(value)[1:])
        assert all(cache.get(f"kept {i}").obj is value for i, value in enumerate(kept))
    assert cache.flush(30) and cache.written == 5
    cache.put("after", bytearray(1 << 20))  # the queue is empty again: taken, not dropped
    assert cache.flush(30) and cache.dropped == 0 and cache.written == 6


@compiled
def test_a_list_of_items_changed_by_another_thread_meanwhile_is_written_as_it_was_given(tmp_path):
    # write_entries read the paths and idents from the list's tuples with the GIL released: another thread
    # clearing the list freed them under the writer (heap-use-after-free under .ci/asan; here their memory
    # reused, the writer read other names). The list is taken whole before the GIL is let go.
    root = tmp_path / "v1"
    root.mkdir()
    payload = os.urandom(64 << 10)

    def path(i: int) -> bytes:
        return os.fsencode(root / f"{i % 16:02x}" / f"{i:032x}")

    items = [(path(i), f"ident {i}".encode() * 3, payload) for i in range(300)]
    first = os.fsdecode(path(0))
    junk = []

    def clear() -> None:
        deadline = time.monotonic() + 30
        while not os.path.exists(first) and time.monotonic() < deadline:
            time.sleep(0.0005)
        items[:] = []  # the list held the only references to the tuples and their bytes
        junk.extend(b"x" * len(path(0)) for _ in range(20_000))  # what was freed taken again, other bytes in it

    thread = threading.Thread(target=clear)
    thread.start()
    results, _, _ = native.write_entries(items, "host-1", 7)
    thread.join(60)
    assert results == [1] * 300
    assert sorted(os.path.join(f, n) for f, _, names in os.walk(root) for n in names) == \
        sorted(os.fsdecode(path(i)) for i in range(300))
    for i in range(300):
        _sound(diskcache.read_file(os.fsdecode(path(i)), 1 << 30), f"ident {i}".encode() * 3, payload)


# A C library put before libc (LD_PRELOAD) that has every call the writer makes on a path under an armed folder
# (and on the descriptors opened there) interrupted by a signal once (EINTR), as a FUSE or network file system
# does when a signal comes: the call made again succeeds. close releases the descriptor and says EINTR, as Linux.
_EINTR_SHIM = preload_shim.OPENS + r"""
#include <sys/stat.h>

enum { OPEN, LSTAT, FSTAT, MKDIR, RENAME, UNLINK, CLOSE, KINDS };
static char prefix[4096];
static size_t prefix_len;
static char opened_under[65536];
static int pending[KINDS];
static long interrupted[KINDS];

void eintr_arm(const char *p) { strncpy(prefix, p, sizeof prefix - 1); prefix_len = strlen(prefix); }
void eintr_disarm(void) { prefix_len = 0; }
long eintr_count(int kind) { return interrupted[kind]; }

static int interrupt(int kind, int armed) {  /* every other call of a kind: EINTR, then the real one */
    if (!armed || (pending[kind] ^= 1) == 0)
        return 0;
    interrupted[kind]++;
    errno = EINTR;
    return 1;
}
static int under(const char *path) { return prefix_len && path && strncmp(path, prefix, prefix_len) == 0; }
static int marked(int fd) { return prefix_len && fd >= 0 && fd < (int)sizeof opened_under && opened_under[fd]; }

static int opened(open_fn real, const char *path, int flags, mode_t mode) {
    if (interrupt(OPEN, under(path))) return -1;
    int fd = real(path, flags, mode);
    if (fd >= 0 && fd < (int)sizeof opened_under) opened_under[fd] = (char)under(path);
    return fd;
}
int lstat(const char *path, struct stat *st) {
    REAL(lstat);
    return interrupt(LSTAT, under(path)) ? -1 : real(path, st);
}
int fstat(int fd, struct stat *st) {
    REAL(fstat);
    return interrupt(FSTAT, marked(fd)) ? -1 : real(fd, st);
}
int fstat64(int fd, struct stat64 *st) {
    REAL(fstat64);
    return interrupt(FSTAT, marked(fd)) ? -1 : real(fd, st);
}
int mkdir(const char *path, mode_t mode) {
    REAL(mkdir);
    return interrupt(MKDIR, under(path)) ? -1 : real(path, mode);
}
int rename(const char *from, const char *to) {
    REAL(rename);
    return interrupt(RENAME, under(from)) ? -1 : real(from, to);
}
int unlink(const char *path) {
    REAL(unlink);
    return interrupt(UNLINK, under(path)) ? -1 : real(path);
}
int close(int fd) {
    REAL(close);
    int armed = marked(fd);
    if (fd >= 0 && fd < (int)sizeof opened_under) opened_under[fd] = 0;
    int rc = real(fd);
    if (rc == 0 && armed) { interrupted[CLOSE]++; errno = EINTR; return -1; }  /* closed all the same */
    return rc;
}
"""

_INTERRUPTED = textwrap.dedent("""
    import ctypes, os, sys
    from stoker.engine.cpu import native
    from stoker.storage import diskcache
    root = sys.argv[1]
    write = native.write_entries if sys.argv[2] == "compiled" else diskcache.write_entries
    os.mkdir(root + "/ef")  # a subfolder there before: lstat'd, not made
    items = [(os.fsencode(f"{root}/{sub}/{sub}{i:030x}"), b"ident %d" % i, None if i == 3 else bytes([i]) * 1000 * i)
             for i, sub in enumerate(["ab", "ab", "cd", "ef", "ef", "ab"])]
    shim = ctypes.CDLL(None)
    shim.eintr_arm(os.fsencode(root))
    results, allocated, grown = write(items, "host-1", 5)
    shim.eintr_disarm()
    print(results, [shim.eintr_count(kind) for kind in range(7)])
""")


@pytest.mark.parametrize("writer", ["compiled", "python"])
def test_calls_a_signal_interrupts_are_made_again(tmp_path, tmp_path_factory, writer):
    # A signal that comes during a call on a FUSE or network file system interrupts it (EINTR). The compiled
    # writer made only writev again, Python only open, fstat and writev (PEP 475): an interrupted lstat, mkdir or
    # rename (and the compiled writer's open and fstat) failed the entry, the rest of its batch, and every later
    # write of the process (the cache disabled); close's EINTR (the descriptor released all the same, on Linux:
    # not made again) failed it too.
    if writer == "compiled" and native.write_entries is None:
        pytest.skip("stoker._native is not built")
    shim = preload_shim.build(tmp_path_factory, _EINTR_SHIM)
    root = tmp_path / "v1"
    root.mkdir()
    out = preload_shim.run(shim, _INTERRUPTED, str(root), writer)
    assert out.returncode == 0, out.stderr
    results, counts = out.stdout.strip().split("] [")
    assert results == "[1, 1, 1, 1, 1, 1", out
    opens, lstats, fstats, mkdirs, renames, _, closes = map(int, counts.rstrip("]").split(", "))
    assert opens >= 3 and mkdirs >= 1 and renames >= 2 and closes == 6, out
    if writer == "compiled":  # (Python's lstat and fstat are other calls of the C library's)
        assert lstats >= 3 and fstats >= 3, out
    written = sorted(os.path.join(f, n) for f, _, names in os.walk(root) for n in names)
    assert sorted(os.path.basename(p)[2:] for p in written) == [f"{i:030x}" for i in range(6)]  # no temporary file
    for i, path in enumerate(sorted(written, key=lambda p: p[-30:])):
        if i == 3:
            assert os.path.getsize(path) == 0  # a marker
        else:
            _sound(diskcache.read_file(path, 1 << 30), b"ident %d" % i, bytes([i]) * 1000 * i)


# A C library put before libc (LD_PRELOAD): the first `times` O_EXCL opens of the armed path find a marker that
# another process made and an outside cleaner removed before this process's lstat (EEXIST, then nothing there).
_VANISHING_SHIM = preload_shim.OPENS + r"""
static char armed[4096];
static int left;
void vanish_arm(const char *p, int times) { strncpy(armed, p, sizeof armed - 1); left = times; }

static int opened(open_fn real, const char *path, int flags, mode_t mode) {
    if (left > 0 && (flags & O_EXCL) && strcmp(path, armed) == 0) {
        left--;
        int fd = real(path, flags, mode);  /* made by another process */
        if (fd >= 0) { close(fd); unlink(path); }  /* removed by a cleaner */
        errno = EEXIST;
        return -1;
    }
    return real(path, flags, mode);
}
"""

_VANISHING = textwrap.dedent("""
    import ctypes, os, sys, warnings
    from stoker.storage import diskcache
    from stoker.storage.diskcache import DiskCache
    from stoker.engine.cpu import native  # hands over the compiled writer
    if sys.argv[3] == "python":
        diskcache.use_entry_writer(None)
    assert (diskcache._entry_writer[0] is not None) == (sys.argv[3] == "compiled")
    cache = DiskCache(sys.argv[1], 64 << 20)
    ident = "mem://bkt\\na/c/0\\nkept"
    ctypes.CDLL(None).vanish_arm(os.fsencode(cache.path(ident)), int(sys.argv[2]))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        made = cache.write_marker(ident)
        after = cache.write_marker(ident + "x")  # the cache still on: a later marker is made
    print(made, after, cache.writable, os.path.isfile(cache.path(ident)), len(seen))
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("writer", ["compiled", "python"])
def test_a_marker_removed_between_its_open_and_its_lstat_is_tried_again_never_a_failure(tmp_path, tmp_path_factory,
                                                                                        writer):
    # Before: O_EXCL said EEXIST, the lstat then ENOENT (an outside cleaner removed it meanwhile): the writer said
    # "not a regular file" (-EEXIST) and the cache was turned off in the process, one warning with a wrong reason
    if writer == "compiled" and native.write_entries is None:
        pytest.skip("stoker._native is not built")
    shim = preload_shim.build(tmp_path_factory, _VANISHING_SHIM)

    def run(times: int) -> str:
        folder = tmp_path / f"cache{times}"
        out = preload_shim.run(shim, _VANISHING, str(folder), str(times), writer)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run(1) == "True True True True 0"  # made at the next try
    assert run(diskcache.MARKER_TRIES) == "False True True False 0"  # not made (a loss), the cache still on


def _writer_bug(self):
    raise RuntimeError("an injected bug in the writer's loop")


def test_a_put_that_checked_writable_as_the_writer_died_queues_nothing(tmp_path, monkeypatch):
    """A put past its check of ``writable`` when the writer's loop died (and its queue was dropped) queued its
    entry for nobody: flush() waited out its timeout and returned False, the entry queued for ever. Now the
    queue refuses it under its lock once the writer is dead."""
    monkeypatch.setattr(DiskCache, "_take", _writer_bug)
    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    checked, go = threading.Event(), threading.Event()
    enqueue = DiskCache._enqueue

    def enqueue_late(self, ident, *args, **kw):
        if ident == "late":
            checked.set()  # put() found the cache writable
            go.wait(30)  # ... and the writer dies now
        return enqueue(self, ident, *args, **kw)

    monkeypatch.setattr(DiskCache, "_enqueue", enqueue_late)
    late = threading.Thread(target=cache.put, args=("late", b"y" * 100))
    late.start()
    assert checked.wait(30)
    with pytest.warns(RuntimeWarning, match="internal error of stoker"):
        cache.put("first", b"x" * 100)  # starts the writer, which dies
        assert cache.flush(timeout_s=30.0)
    assert not cache.writable and not cache._thread.is_alive()
    go.set()
    late.join(30)
    assert not late.is_alive()
    assert not cache.queued("late") and not cache._queue
    assert cache.flush(timeout_s=0.0)  # nothing left to wait for


@pytest.mark.parametrize("warned_off", [False, True])
def test_the_writers_fault_drops_the_queue_even_where_warnings_are_errors(tmp_path, monkeypatch, warned_off):
    """With warnings made errors (python -W error), the writer's fault handler raised at its warning, before it
    dropped the queue: flush() waited out its timeout. Now the queue goes first, and the fault still warns (its
    own kind) after a failed write turned the cache off with a warning of its own."""
    monkeypatch.setattr(DiskCache, "_take", _writer_bug)
    hooked: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    if warned_off:
        with pytest.warns(RuntimeWarning, match="stops caching"):
            cache._disable(OSError(errno.EIO, "an earlier failed write"))  # warned "off" once
        cache.writable = True  # (as if the write failed after this put's check)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.put("a", b"x" * 100)
        assert cache.flush(timeout_s=10.0)
        cache._thread.join(30)
    assert not cache.queued("a") and not cache.writable
    # the warning, an error here, reached the thread's excepthook, and it was the fault's (not swallowed)
    assert [type(h.exc_value) for h in hooked] == [RuntimeWarning]
    assert "internal error of stoker" in str(hooked[0].exc_value)


@pytest.mark.timeout(60)
def test_a_child_forked_while_the_writer_holds_the_lock_lets_it_go(tmp_path, monkeypatch):
    # Before: the flock is the open file's, and the child kept its copy of the lock file the parent's writer had
    # open at the fork: the folder stayed locked for the child's life (a DataLoader worker's: the whole run),
    # and every write of the parent, of the child and of the node's other processes waited LOCK_WAIT_S, unmade
    import select

    from forking import fork_child, verdict

    monkeypatch.setattr(diskcache, "LOCK_WAIT_S", 2.0)
    real = diskcache._entry_writer[0] or diskcache.write_entries
    inside, go_on = threading.Event(), threading.Event()

    def held_at_the_fork(items, tag, seed):
        if not inside.is_set():  # the first batch: the lock is held here until the child is forked
            inside.set()
            go_on.wait(10)
        return real(items, tag, seed)

    monkeypatch.setattr(diskcache, "_entry_writer", [held_at_the_fork])
    cache = DiskCache(str(tmp_path), 64 << 20)
    cache.put("mem://bkt|a/c/0|0:-1|e1", b"a" * 1000)
    assert inside.wait(10)
    parent_done_r, parent_done_w = os.pipe()

    def child() -> bool:
        cache.put("mem://bkt|a/c/1|0:-1|e1", b"c" * 1000)
        written = cache.flush(10) and cache.get("mem://bkt|a/c/1|0:-1|e1") == b"c" * 1000
        select.select([parent_done_r], [], [], 20)  # alive while the parent writes
        return written

    pid = fork_child(child)
    try:
        go_on.set()
        assert cache.flush(10)
        cache.put("mem://bkt|a/c/2|0:-1|e1", b"p" * 1000)
        assert cache.flush(10)
        assert cache.get("mem://bkt|a/c/2|0:-1|e1") == b"p" * 1000  # written while the child lives
    finally:
        os.write(parent_done_w, b"x")
        outcome = verdict(pid, 30)
        os.close(parent_done_r)
        os.close(parent_done_w)
    assert outcome == "exit 0"  # the child's own write made too
