"""The local disk cache of remote chunks (``cache_dir``/``cache_bytes``): against moto's S3 server and the
loopback HTTP server, every read equals zarr-python's; a second read is served from disk (revalidation
costs bodiless HEAD requests only); a replaced object is read new; four processes share one folder under
eviction pressure within the bound; a writer killed mid-entry, a corrupt entry, a too-small bound and an
unwritable folder never fail a read."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import warnings

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.errors import InvalidArgument, StorageError
from stoker.engine.cpu import native
from stoker.storage.cachingstore import CachingStore
from stoker.storage import diskcache
from stoker.storage.diskcache import DiskCache, disk_cache
from stoker.storage.locate import Stores, locate
from stoker.storage.store import ByteRange

from range_server import RangeServer
from store_fixtures import (BUCKET, FAST_REMOTE, empty_s3_fixture, random_int_arrays, read_tree, written_tree_fixture,
                            zarr_values)

pytestmark = pytest.mark.timeout(180)

SHAPE = (64, 48)
FAST = FAST_REMOTE
#: path -> how zarr-python writes it: one sharded (ranges of shards), one plain (whole chunk values)
ARRAYS = {"sharded": dict(chunks=(8, 8), shards=(32, 24), dtype="uint16", compressors=ZstdCodec(level=1)),
          "plain": dict(chunks=(16, 16), dtype="int32", compressors=ZstdCodec(level=1))}
BOXES = [(slice(0, 64), slice(0, 48)), (slice(3, 29), slice(5, 33)), (slice(40, 64), slice(20, 48))]


_write = random_int_arrays(ARRAYS, SHAPE)


s3 = empty_s3_fixture()


data = written_tree_fixture(_write)


@pytest.fixture(params=["python", "engine"])
def read_files(request):
    """How a test's hits are read: in Python (None), or by the compiled engine's ``read_files`` (a pipeline's;
    skipped where it is not built)."""
    if request.param == "engine" and native.read_files is None:
        pytest.skip("no compiled engine")
    return native.read_files if request.param == "engine" else None


@pytest.fixture(params=["s3", "http"])
def remote(request, s3, data):
    """``(uri of the root, storage options, upload())``: the fixture's arrays on moto's S3 or over HTTP;
    ``upload()`` puts what is under the local root now (HTTP serves the folder itself)."""
    if request.param == "s3":
        prefix = f"cache-{uuid.uuid4().hex[:8]}"

        def upload() -> None:
            s3.upload(read_tree(data), prefix)

        upload()
        yield f"s3://{BUCKET}/{prefix}", {**s3.options, **FAST}, upload
        return
    server = RangeServer(data)
    yield server.url, dict(FAST), lambda: None
    server.stop()


def _read_all(root_uri: str, options: dict, stores: Stores | None = None) -> dict[str, list[np.ndarray]]:
    out = {}
    for path in ARRAYS:
        arr = stoker.open_array(f"{root_uri}/{path}", options, stores=stores)
        out[path] = [arr.read(box) for box in BOXES]
    return out


def _check(got: dict, root: str) -> None:
    for path, crops in got.items():
        want = zarr_values(root, path)
        for box, crop in zip(BOXES, crops):
            np.testing.assert_array_equal(crop, want[box])


def _store_of(root_uri: str, options: dict) -> CachingStore:
    kv, _ = stoker.storage.locate.default_stores().get(locate(f"{root_uri}/plain"), options)
    assert isinstance(kv, CachingStore)
    return kv


def test_second_read_is_served_from_disk(remote, data, tmp_path):
    uri, options, _ = remote
    options = {**options, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
    _check(_read_all(uri, options), data)
    kv = _store_of(uri, options)
    assert kv.cache.flush(30)
    first = kv.counters.miss_bytes
    # the first pass fetched its bytes (a chunk two boxes share may already be a hit: entries are written
    # on the cache's own thread, so whether the second box finds it depends on timing)
    assert first > kv.counters.hit_bytes
    before = (kv.counters.hit_bytes, kv.counters.miss_bytes, kv.counters.revalidations + kv.counters.listings)
    _check(_read_all(uri, options), data)
    hit = kv.counters.hit_bytes - before[0]
    missed = kv.counters.miss_bytes - before[1]
    assert hit >= 0.99 * (hit + missed), (hit, missed)
    # each open revalidated its objects (a LIST where the store lists, else HEADs: no body)
    assert kv.counters.revalidations + kv.counters.listings > before[2]


def test_revalidation_costs_only_head_requests(data, tmp_path):
    server = RangeServer(data)
    try:
        options = {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
        arrays = {path: stoker.open_array(f"{server.url}/{path}", options, stores=Stores()) for path in ARRAYS}
        _check({path: [a.read(box) for box in BOXES] for path, a in arrays.items()}, data)
        kv = arrays["plain"].kv
        assert kv.cache.flush(30)
        asked, heads = server.requests, sum(a.kv.counters.revalidations for a in arrays.values())
        for a in arrays.values():
            a.kv.forget()  # as a new pipeline would: every object's generation asked again
        _check({path: [a.read(box) for box in BOXES] for path, a in arrays.items()}, data)
        # every request of the second pass was a revalidation (a HEAD): no chunk came over the network
        revalidated = sum(a.kv.counters.revalidations for a in arrays.values()) - heads
        assert server.requests - asked == revalidated > 0
    finally:
        server.stop()


def test_an_object_replaced_between_epochs_is_read_new(remote, data, tmp_path):
    uri, options, upload = remote
    options = {**options, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
    _check(_read_all(uri, options), data)
    assert _store_of(uri, options).cache.flush(30)
    time.sleep(1.1)  # a new Last-Modified second for servers whose generation is their mtime
    _write(data, 2)  # new bytes, same keys: new ETags
    upload()
    _check(_read_all(uri, options), data)


def _date_files(root: str, when: float) -> None:
    """Every file under ``root`` dated ``when`` (what a server without ETags names as each one's version)."""
    for folder, _, names in os.walk(root):
        for name in names:
            os.utime(os.path.join(folder, name), (when, when))


def test_a_same_second_rewrite_over_a_last_modified_server_is_never_served_from_disk(tmp_path):
    """A server without ETags versions an object by its size and Last-Modified time, in whole seconds: an
    entry kept while its object's second was still running may be rewritten within that second at the same
    size (an uncompressed chunk always has its size), and would then be served for ever, however long
    after, where without the cache the new bytes are read. Such an object is read through until its
    second is over; one dated long ago is kept (the second read is served from disk)."""
    root = str(tmp_path / "data")
    spec = {"raw": dict(chunks=(16, 16), dtype="int32", compressors=None)}
    write = random_int_arrays(spec, SHAPE)
    write(root, 1)
    server = RangeServer(root)
    server.etags = False
    try:
        options = {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
        second = float(int(time.time()))  # written within this second, read within it too
        _date_files(root, second)
        arr = stoker.open_array(f"{server.url}/raw", options)
        np.testing.assert_array_equal(arr[...], zarr_values(root, "raw"))
        assert arr.kv.cache.flush(30)
        write(root, 2)  # a rewrite of the same size, dated the same second
        _date_files(root, second)
        time.sleep(1.1)  # long past that second: the read below would see any later rewrite by its date
        np.testing.assert_array_equal(stoker.open_array(f"{server.url}/raw", options)[...], zarr_values(root, "raw"))
        _date_files(root, second - 3600)  # dated long ago: kept, and the next read served from disk
        arr = stoker.open_array(f"{server.url}/raw", options)
        np.testing.assert_array_equal(arr[...], zarr_values(root, "raw"))
        assert arr.kv.cache.flush(30)
        hits = arr.kv.counters.hit_bytes
        np.testing.assert_array_equal(stoker.open_array(f"{server.url}/raw", options)[...], zarr_values(root, "raw"))
        assert arr.kv.counters.hit_bytes - hits >= 64 * 48 * 4  # every chunk from disk
    finally:
        server.stop()


@pytest.mark.parametrize("path", list(ARRAYS))
def test_a_pipeline_reads_new_data_after_the_staleness_bound(s3, data, tmp_path, path):
    prefix = f"cache-{uuid.uuid4().hex[:8]}"
    s3.upload(read_tree(data), prefix)
    uri = f"s3://{BUCKET}/{prefix}/{path}"
    cfg = stoker.Config(batch_size=2, dtype="native", n_compute_threads=1, pop_timeout_s=60,
                        storage_options={f"s3://{BUCKET}/": {**s3.options, **FAST}}, cache_dir=str(tmp_path / "c"),
                        cache_bytes=64 << 20, cache_staleness_s=0.5)
    boxes = [[(0, 16), (0, 16)], [(20, 36), (10, 26)]]

    def epoch(p) -> list[np.ndarray]:
        p.push([stoker.Sample(uri, b) for b in boxes])
        b = p.pop()
        out = [t.numpy().copy() for t in torch.from_dlpack(b)]
        b.release()
        return out

    cache = disk_cache(str(tmp_path / "c"), 64 << 20)  # the process's one for the folder: the pipeline's too
    with stoker.Pipeline(cfg) as p:
        for _ in range(2):
            for got, box in zip(epoch(p), boxes):
                np.testing.assert_array_equal(got, zarr_values(data, path)[tuple(slice(*s) for s in box)])
            assert cache.flush(30)
        assert cache.hits > 0 and cache.written > 0  # the second epoch was served from disk
        _write(data, 3)
        s3.upload(read_tree(data), prefix)
        time.sleep(0.6)
        for got, box in zip(epoch(p), boxes):
            np.testing.assert_array_equal(got, zarr_values(data, path)[tuple(slice(*s) for s in box)])


def _reader(args) -> tuple[int, int, int, int]:
    """One of the processes sharing a cache: reads every box of every array ``passes`` times, each checked
    against ``want``; returns (hit bytes, miss bytes, the most disk the folder took, entries it evicted)."""
    uri, options, want, passes, seed = args
    rng = np.random.default_rng(seed)
    cache = disk_cache(os.path.abspath(options["cache_dir"]), options["cache_bytes"])
    most = 0
    kv = None
    for _ in range(passes):
        for path in rng.permutation(list(ARRAYS)):
            arr = stoker.open_array(f"{uri}/{path}", options)
            for b in rng.permutation(len(BOXES)):
                got = arr.read(BOXES[b])
                if not np.array_equal(got, want[path][BOXES[b]]):
                    raise AssertionError(f"{path} {BOXES[b]} differs from zarr-python's read")
            kv = arr.kv
            most = max(most, cache.allocated())
    cache.flush(30)
    most = max(most, cache.allocated())
    return kv.counters.hit_bytes, kv.counters.miss_bytes, most, cache.evicted


def test_four_processes_share_one_folder_under_eviction_pressure(s3, data, tmp_path):
    prefix = f"cache-{uuid.uuid4().hex[:8]}"
    values = read_tree(data)
    s3.upload(values, prefix)
    want = {path: zarr_values(data, path) for path in ARRAYS}
    block = os.statvfs(tmp_path).f_frsize
    # an entry: a value and its header, in whole blocks
    biggest = -(-(max(len(v) for k, v in values.items() if "/c/" in k) + 512) // block) * block
    # the disk one pass's entries take (whole blocks, their subfolders'), measured; a third of it as the
    # bound: far less than one pass reads, so entries are evicted all the time
    one = {**s3.options, **FAST, "cache_dir": str(tmp_path / "one"), "cache_bytes": 1 << 30}
    _reader((f"s3://{BUCKET}/{prefix}", one, want, 1, 0))
    bound = DiskCache(one["cache_dir"], 1 << 30).allocated() // 3
    options = {**s3.options, **FAST, "cache_dir": str(tmp_path / "shared"), "cache_bytes": bound}
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(_reader, [(f"s3://{BUCKET}/{prefix}", options, want, 4, seed) for seed in range(4)],
                           chunksize=1)
    hits = sum(r[0] for r in results)
    assert hits > 0, results  # some reads were served from the shared folder
    assert sum(r[3] for r in results) > 0, results  # and entries were evicted under the bound
    assert max(r[2] for r in results) <= bound + biggest, (results, bound)  # as the disk counts it
    shared = DiskCache(options["cache_dir"], bound)
    assert shared.allocated() <= bound + biggest
    # the running total all four kept under the lock never counts less than the disk holds
    total = int.from_bytes((shared.root / ".index").read_bytes(), "little")
    assert shared.allocated() <= total <= bound, (shared.allocated(), total, bound)


_KILLED_WRITER = textwrap.dedent("""
    import resource, signal, sys
    from stoker.storage import diskcache
    if sys.argv[2] == "python":
        diskcache.use_entry_writer(None)
    cache = diskcache.DiskCache(sys.argv[1], 1 << 20)
    # the writer dies in the middle of the entry's bytes, the folder's lock held and its room reserved: a file
    # may not grow past 50,000 bytes, and passing it is SIGXFSZ, whose default action (which Python sets
    # aside) ends the process at once, as kill -9 would (no core file)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))
    cache.write("killed", b"x" * 100_000)
    print("survived", flush=True)
""")


@pytest.mark.parametrize("writer", ["compiled", "python"])
def test_a_writer_killed_mid_entry_leaves_nothing_served(tmp_path, writer):
    if writer == "compiled" and native.write_entries is None:
        pytest.skip("stoker._native is not built")
    folder = str(tmp_path / "cache")
    child = subprocess.run([sys.executable, "-c", _KILLED_WRITER, folder, writer], capture_output=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == -signal.SIGXFSZ, child
    cache = DiskCache(folder, 1 << 20)
    leftovers = [n for _, _, names in os.walk(folder) for n in names if n != ".index"]
    assert leftovers and all(n.startswith(".") for n in leftovers)  # its temporary file, never the entry
    assert cache.get("killed") is None
    assert cache.write("other", b"y" * 1000)  # the first write of a process scans: the dead writer's file goes
    assert cache.get("killed") is None and bytes(cache.get("other")) == b"y" * 1000
    assert cache.size_on_disk() < 2000


def test_a_range_of_a_value_kept_whole_is_served_from_disk(data, tmp_path):
    # an epoch reads a blosc chunk whole, the next asks only the blocks its crops need (other ranges, as
    # the pipeline learns its frames in another order): cut from the whole value, no request but a HEAD
    server = RangeServer(data)
    try:
        stores = Stores(cache=stoker.Config(cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20).cache)
        kv = stoker.open_array(f"{server.url}/plain", FAST, stores=stores).kv
        tree = read_tree(data)
        keys = sorted(k for k in tree if k.startswith("plain/c/"))[:3]
        values, _ = kv.get_many(keys, [])
        assert [bytes(v) for v in values] == [tree[k] for k in keys]
        assert kv.cache.flush(30)
        kv.forget()
        asked, revalidated = server.requests, kv.counters.revalidations
        ranges = [ByteRange(keys[0], 3, 10), ByteRange.suffix(keys[1], 7), ByteRange(keys[2], 0, len(tree[keys[2]]))]
        _, parts = kv.get_many([], ranges)
        assert [bytes(p) for p in parts] == [tree[keys[0]][3:13], tree[keys[1]][-7:], tree[keys[2]]]
        assert server.requests - asked == kv.counters.revalidations - revalidated == 3  # a HEAD each
        past = ByteRange(keys[0], len(tree[keys[0]]) - 2, 5)  # past the value's end: the store's error
        with pytest.raises(StorageError):
            kv.get_many([], [past])
    finally:
        server.stop()


def test_entries_are_written_without_fsync_and_a_stale_one_is_refetched(tmp_path, monkeypatch):
    # two fsyncs an entry held the writer to the disk's flush rate, and a first epoch's entries past the
    # write queue's bound were dropped; a crash can now leave an entry short or with stale bytes, which its
    # checksum catches (read as absent, removed)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    cache = DiskCache(str(tmp_path / "cache"), 1 << 20)
    assert cache.write("entry", b"z" * 4000) and synced == []
    path = cache.path("entry")
    with open(path, "r+b") as f:  # what a crash before the data reached the disk may leave
        f.seek(-2000, os.SEEK_END)
        f.write(b"\0" * 2000)
    assert cache.get("entry") is None and not path.exists() and cache.corrupt == 1
    assert cache.write("entry", b"z" * 4000) and bytes(cache.get("entry")) == b"z" * 4000


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_corrupt_entry_is_fetched_again(remote, data, tmp_path, damage, read_files):
    # hits read in Python (open_array outside a pipeline) or by the engine's read_files (a pipeline's)
    uri, options, _ = remote
    folder = tmp_path / "cache"
    cache = disk_cache(str(folder), 64 << 20)  # the process's one for the folder: the stores below use it
    stores = Stores(cache=stoker.Config(cache_dir=str(folder), cache_bytes=64 << 20).cache, read_files=read_files)
    _check(_read_all(uri, options, stores), data)
    assert cache.flush(30)
    entries = [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names if n != ".index"]
    entries = [path for path in entries if os.path.getsize(path)]  # not the markers: empty files, never read
    assert entries
    for path in entries:
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(os.path.getsize(path) - 3)
            else:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
    fresh = Stores(cache=stoker.Config(cache_dir=str(folder), cache_bytes=64 << 20).cache, read_files=read_files)
    corrupt = cache.corrupt
    _check(_read_all(uri, options, fresh), data)
    assert cache.corrupt > corrupt


def test_markers_are_empty_files_and_still_say_which_keys_need_a_head(data, tmp_path):
    # a key read once gets an empty marker file (no block on disk, where a full entry took 4 KiB for ~80
    # bytes): a later wrapper HEADs exactly the keys with entries and serves them from disk, while a cold
    # folder makes no HEAD at all
    server = RangeServer(data)
    try:
        options = {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
        arr = stoker.open_array(f"{server.url}/plain", options, stores=Stores())
        want = zarr_values(data, "plain")
        for box in BOXES:
            np.testing.assert_array_equal(arr.read(box), want[box])
        assert arr.kv.counters.revalidations == 0  # cold: nothing kept, nothing to revalidate
        assert arr.kv.cache.flush(30)
        files = [os.path.join(d, n) for d, _, names in os.walk(tmp_path / "cache") for n in names if n != ".index"]
        markers = [f for f in files if os.path.getsize(f) == 0]
        chunks = (SHAPE[0] // 16) * (SHAPE[1] // 16)
        # a marker each, and the folder's; an entry each, and the array's zarr.json (kept too)
        assert len(markers) >= chunks and len(files) - len(markers) == chunks + 1
        assert all(os.lstat(f).st_blocks == 0 for f in markers)
        again = stoker.open_array(f"{server.url}/plain", options, stores=Stores())
        asked = server.requests
        for box in BOXES:
            np.testing.assert_array_equal(again.read(box), want[box])
        # a HEAD a kept key (and its zarr.json's, at the open: served from disk, no GET)
        assert again.kv.counters.revalidations - 1 == chunks == server.requests - asked
        assert again.kv.counters.miss_bytes == 0 and again.kv.counters.hit_bytes > 0
    finally:
        server.stop()


def test_revalidations_of_many_prefetches_are_in_flight_together(data, tmp_path):
    # each start_get_many's HEADs go out on the store's event loop, no thread waiting for them: twelve
    # calls' requests are open at once, not three rounds of the 4 reader threads (the server holds each
    # until twelve were open together, 10 s at most: seen however loaded the machine is)
    server = RangeServer(data)
    try:
        stores = Stores(cache=stoker.Config(cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20).cache)
        arr = stoker.open_array(f"{server.url}/plain", FAST, stores=stores)
        _check({"plain": [arr.read(box) for box in BOXES]}, data)
        kv = arr.kv
        assert kv.cache.flush(30)
        kv.forget()
        tree = read_tree(data)
        keys = sorted(k for k in tree if k.startswith("plain/c/"))
        assert len(keys) == 12
        server.peak_in_flight = 0
        server.hold_until_in_flight(len(keys), timeout_s=10.0, under="/plain/c/")
        missed = kv.counters.miss_bytes
        futures = [kv.start_get_many([key], []) for key in keys]
        done, _ = concurrent.futures.wait(futures, timeout=60)
        assert len(done) == len(keys)
        assert [bytes(kv.result_of(f)[0][0]) for f in futures] == [tree[k] for k in keys]
        assert server.peak_in_flight >= len(keys), server.peak_in_flight
        assert kv.counters.miss_bytes == missed and kv.counters.revalidations >= len(keys)  # HEADs, no body
    finally:
        server.stop()


@pytest.mark.skipif(native.read_files is None, reason="no compiled engine")
def test_the_engines_file_reads_serve_entries_whole_or_not_at_all(tmp_path):
    # what DiskCache.get_many relies on: whole regular files, never a link, a FIFO (without hanging), a
    # folder or a file past the bound; read-only views; none touched (not judged as entries: see below)
    (tmp_path / "entry").write_bytes(b"x" * 5000)
    (tmp_path / "small").write_bytes(b"abc")
    (tmp_path / "big").write_bytes(b"y" * 6000)
    os.symlink(tmp_path / "entry", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    os.utime(tmp_path / "entry", (1_000_000, 1_000_000))
    names = ["entry", "missing", "link", "fifo", "folder", "big", "small"] * 20  # past one group of 64
    got = native.read_files([str(tmp_path / n) for n in names], 5500)
    assert len(got) == len(names)
    for name, view in zip(names, got):
        if name == "entry":
            assert bytes(view) == b"x" * 5000 and view.readonly
        elif name == "small":
            assert bytes(view) == b"abc"
        else:
            assert view is None, name
    assert os.stat(tmp_path / "entry").st_mtime == 1_000_000


@pytest.mark.skipif(native.read_files is None, reason="no compiled engine")
def test_the_engines_file_reads_touch_only_entries_judged_sound(tmp_path):
    # Before: read_files touched every file it read (the LRU clock) and DiskCache.get_many judged the bytes
    # after, so a corrupt entry, or another ident's (a hash collision), was touched as a use it was not. Now
    # judged there (header, ident, crc32c, as the engine judges the entries it reads): a sound one's payload,
    # touched; False for one that is not, untouched; None for no file.
    good, ident = DiskCache._check, b"s3://bkt|a/c/0|0:-1|e1"
    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    assert cache.write(ident.decode(), b"p" * 3000) and cache.write("empty", b"")
    sound = bytes(cache.path(ident.decode()).read_bytes())
    flipped = bytearray(sound)
    flipped[-1] ^= 0xFF
    files = {"sound": (sound, ident), "empty": (cache.path("empty").read_bytes(), b"empty"),
             "flipped": (bytes(flipped), ident), "short": (sound[:-1], ident), "header": (sound[:20], ident),
             "other ident": (sound, b"s3://bkt|a/c/1|0:-1|e1"), "not an entry": (b"q" * 100, ident)}
    for name, (raw, _) in files.items():
        (tmp_path / name).write_bytes(raw)
        os.utime(tmp_path / name, (1_000_000, 1_000_000))
    names = list(files) * 10  # past one group of 64
    got = native.read_files([str(tmp_path / n) for n in names] + [str(tmp_path / "missing")], 1 << 20,
                            [files[n][1] for n in names] + [ident])
    assert got[-1] is None
    for name, view in zip(names, got):
        if name in ("sound", "empty"):
            assert view.readonly and bytes(view) == bytes(good(files[name][0], files[name][1].decode())), name
        else:
            assert view is False, name
    touched = {name for name in files if os.stat(tmp_path / name).st_mtime > 1_000_000}
    assert touched == {"sound", "empty"}
    with pytest.raises(ValueError):
        native.read_files([str(tmp_path / "sound")], 1 << 20, [])  # an ident a path
    with pytest.raises(ValueError):
        native.read_files([str(tmp_path / "sound")], 1 << 20, ["not bytes"])


def test_a_hit_touches_its_entry_at_most_once_a_minute(tmp_path, read_files):
    # as the engine's own entry reads (csrc/entries.c): a hit within a minute of the entry's last use writes
    # nothing (a futimens per hit made every hit's inode dirty); an older one, or one dated in the future
    # (another host's clock), is touched: the LRU clock
    cache = DiskCache(str(tmp_path / "cache"), 1 << 20)
    for name in ("recent", "old", "future"):
        assert cache.write(name, name.encode() * 100)
    now = time.time()
    for name, when in (("recent", now - 30), ("old", now - 120), ("future", now + 3600)):
        os.utime(cache.path(name), (when, when))
    got = cache.get_many(["recent", "old", "future"], read_files)
    assert [bytes(v) for v in got] == [b"recent" * 100, b"old" * 100, b"future" * 100]
    assert os.stat(cache.path("recent")).st_mtime == pytest.approx(now - 30, abs=1e-3)
    assert abs(os.stat(cache.path("old")).st_mtime - now) < 60
    assert abs(os.stat(cache.path("future")).st_mtime - now) < 60


def test_pythons_file_read_touches_an_entry_only_once_it_is_found_good(tmp_path):
    # read_file touches after the caller's checks (DiskCache._check's header, ident and checksum): a corrupt
    # entry or another ident's is no use of the entry
    path = tmp_path / "entry"
    path.write_bytes(b"x" * 5000)
    os.utime(path, (1_000_000, 1_000_000))
    assert diskcache.read_file(str(path), 1 << 20, lambda raw: False) == b"x" * 5000
    assert os.stat(path).st_mtime == 1_000_000
    assert diskcache.read_file(str(path), 1 << 20, lambda raw: True) == b"x" * 5000
    assert os.stat(path).st_mtime > 1_000_000 + 1e8


def test_a_prefetch_through_the_cache_never_waits_on_the_callers_thread(data, tmp_path):
    # start_get_many reads hits and revalidates on the cache's reader threads: a coordinator starting a
    # prefetch is not held for a HEAD request (here held by the server until the call returned), nor for
    # the disk
    server = RangeServer(data)
    try:
        folder = str(tmp_path / "cache")
        stores = Stores(cache=stoker.Config(cache_dir=folder, cache_bytes=64 << 20).cache)
        arr = stoker.open_array(f"{server.url}/plain", FAST, stores=stores)
        _check({"plain": [arr.read(box) for box in BOXES]}, data)
        kv = arr.kv
        assert kv.cache.flush(30)
        kv.forget()  # the next read revalidates every key (a HEAD each)
        keys = sorted(k for k in read_tree(data) if k.startswith("plain/c/"))
        # every HEAD held until more than all of them were open at once (never: until let go below, 20 s
        # at most), so a call that waited for one returns only after 20 s, its future done
        server.hold_until_in_flight(len(keys) + 1, timeout_s=20.0, under="/plain/c/")
        hits = kv.counters.hit_bytes
        future = kv.start_get_many(keys, [])
        assert not future.done()  # returned while the HEADs were held
        server.hold_until_in_flight(None)
        values, _ = kv.result_of(concurrent.futures.wait([future], timeout=30).done.pop())
        assert [bytes(v) for v in values] == [read_tree(data)[k] for k in keys]
        assert kv.counters.hit_bytes - hits == sum(len(read_tree(data)[k]) for k in keys)  # all from disk
    finally:
        server.stop()


def _disk_cache_warnings(uri: str, options: dict, data: str) -> list[str]:
    """Read everything twice through a cache set by ``options`` (each read equal to zarr-python's), flushing
    after each; the disk cache's warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _check(_read_all(uri, options), data)
            _store_of(uri, options).cache.flush(30)
    return [str(w.message) for w in caught if "disk cache" in str(w.message)]


def test_a_too_small_bound_reads_uncached_with_one_warning(remote, data, tmp_path):
    uri, options, _ = remote
    mine = _disk_cache_warnings(uri, {**options, "cache_dir": str(tmp_path / "tiny"), "cache_bytes": 64}, data)
    assert len(mine) == 1 and "cache_bytes" in mine[0], mine


@pytest.mark.parametrize("cache_bytes", [16 << 10, 20 << 10])
def test_a_bound_the_folders_own_blocks_fill_reads_uncached_with_one_warning(tmp_path, cache_bytes):
    # Before: an entry that fit cache_bytes alone (put's check) but not beside the folder's own blocks (its
    # folder, .index, a subfolder) was refused at every batch, a loss each, and nothing said why
    cache = DiskCache(str(tmp_path / "cache"), cache_bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(20):
            cache.put(f"mem://bkt|a/c/{i}|0:-1|e1", b"x" * 100)
            cache.mark(f"mem://bkt\na/c/{i}\nkept")
            assert cache.flush(30)
    mine = [str(w.message) for w in caught if "disk cache" in str(w.message)]
    assert len(mine) == 1 and "cache_bytes" in mine[0], mine
    assert cache.get("mem://bkt|a/c/0|0:-1|e1") is None and cache.allocated() <= cache_bytes


def test_an_unwritable_folder_reads_uncached_with_one_warning(remote, data, tmp_path):
    uri, options, _ = remote
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")  # a folder under a regular file cannot be made, whoever we are
    mine = _disk_cache_warnings(uri, {**options, "cache_dir": str(blocker / "cache"), "cache_bytes": 64 << 20}, data)
    assert len(mine) == 1 and "uncached" in mine[0], mine


def test_local_arrays_never_use_the_cache(data, tmp_path):
    cfg = stoker.Config(cache_dir=str(tmp_path / "cache"), batch_size=1, dtype="native", pop_timeout_s=60)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(os.path.join(data, "plain"), [(0, 8), (0, 8)])])
        b = p.pop()
        b.release()
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("knobs, knob", [({"cache_bytes": -1}, "cache_bytes"), ({"cache_bytes": 1.5}, "cache_bytes"),
                                         ({"cache_staleness_s": 0}, "cache_staleness_s"),
                                         ({"cache_dir": 3}, "cache_dir")])
def test_cache_knobs_are_validated(knobs, knob):
    with pytest.raises(InvalidArgument, match=knob) as info:
        stoker.Config(**knobs)
    assert info.value.context["knob"] == knob


def test_the_default_folder_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "env"))
    assert stoker.Config().cache.folder == str(tmp_path / "env")
    assert stoker.Config(cache_bytes=0).cache.enabled is False
    monkeypatch.delenv("STOKER_CACHE_DIR")
    assert stoker.Config().cache.enabled is False


def test_missing_chunks_cost_one_request_a_read_as_without_a_cache(tmp_path):
    root = tmp_path / "holes"
    arr = zarr.create_array(str(root / "a"), shape=(32, 32), chunks=(16, 16), dtype="int32", fill_value=9,
                            compressors=ZstdCodec(level=1))
    arr[:16] = np.arange(16 * 32, dtype="int32").reshape(16, 32)  # the chunks of rows 16.. are never written
    want = zarr.open_array(str(root / "a"), mode="r")[...]
    server = RangeServer(str(root))
    try:
        options = {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}
        a = stoker.open_array(f"{server.url}/a", options, stores=Stores())
        np.testing.assert_array_equal(a.read((slice(0, 32), slice(0, 32))), want)
        assert a.kv.cache.flush(30)
        asked = server.requests
        np.testing.assert_array_equal(a.read((slice(0, 32), slice(0, 32))), want)
        assert server.requests - asked == 2  # a GET of each missing chunk (found missing), no HEAD again
    finally:
        server.stop()


def test_a_cold_cache_costs_the_requests_of_an_uncached_read(data, tmp_path):
    server = RangeServer(data)
    try:
        counts = []
        for options in (dict(FAST), {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 64 << 20}):
            asked = server.requests
            _check(_read_all(server.url, options, Stores()), data)
            counts.append(server.requests - asked)
        # no HEAD for keys the cache never kept: never more requests than without it (fewer where a chunk
        # two boxes share was written to the cache before the second box asked for it)
        assert 0 < counts[1] <= counts[0], counts
    finally:
        server.stop()


def test_samplers_take_the_cache_keys_among_storage_options(data, tmp_path):
    server = RangeServer(data)
    try:
        options = {server.url + "/": {**FAST, "cache_dir": str(tmp_path / "cache"), "cache_bytes": 1 << 20}}
        src = stoker.RandomCrops([f"{server.url}/plain"], (8, 8), seed=0, samples_per_epoch=4,
                                 storage_options=options)
        assert src.shapes == [SHAPE]
    finally:
        server.stop()


_FILLER = textwrap.dedent("""
    import sys, numpy as np, stoker
    from stoker.storage.diskcache import disk_cache
    url, folder = sys.argv[1], sys.argv[2]
    options = {"cache_dir": folder, "cache_bytes": 64 << 20, "timeout_s": 5.0, "retries": 2}
    for path in ("plain", "sharded"):
        stoker.open_array(f"{url}/{path}", options).read((slice(0, 64), slice(0, 48)))
    assert disk_cache(folder, 64 << 20).flush(30)
""")


def test_the_cache_survives_a_restart(data, tmp_path):
    server = RangeServer(data)
    try:
        folder = str(tmp_path / "cache")
        subprocess.run([sys.executable, "-c", _FILLER, server.url, folder], check=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        options = {**FAST, "cache_dir": folder, "cache_bytes": 64 << 20}
        stores = Stores()
        _check(_read_all(server.url, options, stores), data)
        for path in ARRAYS:  # this process fetched no chunk: every byte came from the other one's entries
            kv = stores.get(locate(f"{server.url}/{path}"), options)[0]
            assert kv.counters.hit_bytes > 0 and kv.counters.miss_bytes == 0, kv.counters
    finally:
        server.stop()


def test_a_corrupt_entry_read_through_get_many_is_a_loss(tmp_path, read_files):
    # Before: an entry judged unsound was removed without a loss, so memos of entries on disk (the decoder's,
    # emptied when `losses` moves) kept its path until the engine missed it. Now removing it is a loss.
    cache = DiskCache(str(tmp_path / "cache"), 1 << 20)
    assert cache.write("bad", b"z" * 4000) and cache.write("good", b"g" * 10) and cache.write("empty", b"")
    with open(cache.path("bad"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"y")
    losses = cache.losses
    got = cache.get_many(["good", "empty", "missing"], read_files)
    assert [None if v is None else bytes(v) for v in got] == [b"g" * 10, b"", None]  # an empty payload is a hit
    assert cache.losses == losses and cache.hits == 2 and cache.misses == 1  # nothing removed: no loss
    got = cache.get_many(["bad", "good"], read_files)
    assert got[0] is None and bytes(got[1]) == b"g" * 10 and not cache.path("bad").exists()
    assert cache.corrupt == 1 and cache.losses == losses + 1


def test_the_writer_thread_leaves_when_idle_and_the_next_put_starts_another(tmp_path, monkeypatch):
    """Regression: the folder's writer thread, started by the first put, lived for the rest of the process,
    waking every second, after every pipeline using the cache had closed (a process that read through a cache
    once kept its thread for good). It leaves after WRITER_IDLE_S without work; a later put starts another,
    and what is put before and after is written and read back."""
    import threading

    def writers():
        return [t for t in threading.enumerate() if t.name == "stoker-diskcache"]

    monkeypatch.setattr(diskcache, "WRITER_IDLE_S", 0.3)
    before = set(writers())  # (other tests' caches in this process)
    cache = DiskCache(str(tmp_path / "c"), 1 << 20)
    cache.put("first", b"a" * 100)
    assert cache.flush(10)
    [mine] = set(writers()) - before
    mine.join(10)
    assert not mine.is_alive()
    cache.put("second", b"b" * 100)
    assert cache.flush(10)
    assert bytes(cache.get("first")) == b"a" * 100 and bytes(cache.get("second")) == b"b" * 100
    [again] = set(writers()) - before - {mine}
    again.join(10)
    assert not again.is_alive()


def test_a_writer_thread_the_system_refuses_drops_the_entry_with_one_warning(tmp_path, monkeypatch):
    """Regression: where a put found the idle writer gone and the system gave no new thread (none left, the
    interpreter shutting down), ``Thread.start``'s RuntimeError escaped ``put`` into the read, and the thread
    never started stayed the cache's writer: every entry queued after was never written. The entry is taken
    back (read uncached, settled as a loss), one warning says why, and the next put starts a writer again."""
    import threading

    monkeypatch.setattr(diskcache, "WRITER_IDLE_S", 0.05)
    cache = DiskCache(str(tmp_path / "c"), 1 << 20)
    cache.put("a", b"a" * 100)
    assert cache.flush(10)
    deadline = time.monotonic() + 10
    while cache._thread is not None and time.monotonic() < deadline:  # the idle writer leaves
        time.sleep(0.01)
    assert cache._thread is None
    start = threading.Thread.start

    def refused(self):
        if self.name == "stoker-diskcache":
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", refused)
    losses = cache.losses
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.put("b", b"b" * 100)  # no error
        cache.put("b2", b"c" * 100)
    assert [str(w.message).count("no writer thread could be started") for w in caught] == [1]
    assert not cache.queued("b") and not cache.queued("b2") and cache.flush(1)
    assert cache.losses == losses + 2 and cache.settled == cache.tickets
    monkeypatch.setattr(threading.Thread, "start", start)
    cache.put("c", b"d" * 100)
    assert cache.flush(10) and bytes(cache.get("c")) == b"d" * 100 and cache.get("b") is None
