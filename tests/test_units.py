"""Unit tests of the pure (or nearly pure) pieces: boxes, chunk grid, chunk keys, range
coalescing, the sized LRU, the local store and fill values."""

from __future__ import annotations

import itertools
import math
import os
import random
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding, V2ChunkKeyEncoding

import stoker
from stoker.box import box_shape, check_in_bounds, parse_box
from stoker.cache import SizedLRU
from stoker.storage import LocalStore
from stoker.storage.ranges import Read, coalesce
from stoker.zarr.dtypes import parse_fill_value
from stoker.zarr.grid import ChunkKeyEncoding, chunk_intersections, chunks_touched, grid_shape

pytestmark = pytest.mark.timeout(60)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# =============================================================================================
# parse_box


def test_parse_box_pairs_and_slices():
    assert parse_box([(0, 4), (2, 6)]) == ((0, 4), (2, 6))
    assert parse_box(((0, 4), [2, 6])) == ((0, 4), (2, 6))
    assert parse_box([slice(0, 4), slice(2, 6)]) == ((0, 4), (2, 6))
    assert parse_box(np.s_[0:4, 2:6]) == ((0, 4), (2, 6))
    assert parse_box(np.s_[0:4, 2:6:1]) == ((0, 4), (2, 6))
    assert parse_box([slice(0, 4), (2, 6)]) == ((0, 4), (2, 6))
    assert parse_box(np.array([[0, 4], [2, 6]])) == ((0, 4), (2, 6))
    assert parse_box(slice(1, 3)) == ((1, 3),)  # a lone slice is a 1-d box
    assert parse_box([]) == ()
    assert parse_box([(3, 3)]) == ((3, 3),)  # empty extent is fine


def test_parse_box_returns_plain_ints():
    box = parse_box([(np.int64(1), np.uint8(5)), slice(np.int32(0), np.int16(2))])
    assert box == ((1, 5), (0, 2))
    assert all(type(v) is int for pair in box for v in pair)
    box = parse_box(np.s_[:, 2:], shape=(np.int64(7), np.int64(9)))
    assert box == ((0, 7), (2, 9))
    assert all(type(v) is int for pair in box for v in pair)


def test_parse_box_open_ends():
    shape = (10, 20, 30)
    assert parse_box(np.s_[:, 5:, :7], shape=shape) == ((0, 10), (5, 20), (0, 7))
    assert parse_box((slice(None), (1, 2), slice(None, None)), shape=shape) == ((0, 10), (1, 2), (0, 30))
    # Without the shape, an open stop cannot be resolved; an open start can (it is 0).
    with pytest.raises(stoker.InvalidArgument, match="axis 1"):
        parse_box(np.s_[0:3, 5:])
    assert parse_box(np.s_[:3, :5]) == ((0, 3), (0, 5))


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)).map(sorted), min_size=0, max_size=5),
       st.data())
@FAST
def test_parse_box_forms_normalise_equal(pairs, data):
    pairs = [tuple(p) for p in pairs]
    shape = tuple(stop + data.draw(st.integers(0, 3)) for _, stop in pairs)
    forms = [
        pairs,
        tuple(pairs),
        [list(p) for p in pairs],
        tuple(slice(a, b) for a, b in pairs),
        [slice(a, b) if i % 2 else (a, b) for i, (a, b) in enumerate(pairs)],
    ]
    expected = tuple(pairs)
    for form in forms:
        assert parse_box(form) == expected
        assert parse_box(form, shape=shape) == expected
    # Open ends resolve against the shape.
    open_form = tuple(slice(None if a == 0 else a, None if b == s else b) for (a, b), s in zip(pairs, shape))
    assert parse_box(open_form, shape=shape) == expected
    assert box_shape(expected) == tuple(b - a for a, b in pairs)


def test_parse_box_rejects():
    with pytest.raises(stoker.RankMismatch):
        parse_box([(0, 1)], shape=(4, 4))
    with pytest.raises(stoker.OutOfBounds) as info:
        parse_box([(0, 1), (0, 5)], shape=(4, 4))
    assert info.value.axis == 1
    for bad, axis in [([(-1, 2)], 0), ([(3, 2)], 0), ([(0, 1), 5], 1), ([slice(0, 4, 2)], 0),
                      ([(0, 1), (0, 1, 2)], 1), ([(0.0, 1)], 0), ([(0, 1), "ab"], 1)]:
        with pytest.raises(stoker.InvalidArgument, match=f"axis {axis}"):
            parse_box(bad)


def test_check_in_bounds():
    check_in_bounds(((0, 4), (4, 4)), (4, 4))
    with pytest.raises(stoker.OutOfBounds) as info:
        check_in_bounds(((0, 4), (0, 5)), (4, 4), uri="/x.zarr")
    assert info.value.axis == 1 and "/x.zarr" in str(info.value)
    with pytest.raises(stoker.RankMismatch):
        check_in_bounds(((0, 4),), (4, 4))


# =============================================================================================
# chunk grid


def brute_force_touched(box, chunk_shape):
    """Every chunk index whose extent overlaps the box, by testing each chunk of the grid."""
    if any(stop <= start for start, stop in box):
        return []
    ranges = [range(0, stop // c + 1) for (start, stop), c in zip(box, chunk_shape)]
    out = []
    for idx in itertools.product(*ranges):
        if all(i * c < stop and (i + 1) * c > start for i, c, (start, stop) in zip(idx, chunk_shape, box)):
            out.append(idx)
    return out  # itertools.product is C order


@st.composite
def grids(draw):
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(0, 13)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    box = []
    for s in shape:
        a = draw(st.integers(0, s))
        b = draw(st.integers(a, s))
        box.append((a, b))
    return shape, chunks, tuple(box)


@given(grids(), st.integers(0, 2**32 - 1))
@FAST
def test_chunk_intersections_assemble_crop(grid, seed):
    shape, chunks, box = grid
    array = np.random.default_rng(seed).integers(0, 1 << 30, size=shape)
    pieces = list(chunk_intersections(box, chunks))
    assert [p.index for p in pieces] == brute_force_touched(box, chunks)
    assert chunks_touched(box, chunks) == len(pieces)
    crop = np.full(box_shape(box), -1, dtype=array.dtype)
    covered = np.zeros(box_shape(box), dtype=int)
    for p in pieces:
        origin = tuple(i * c for i, c in zip(p.index, chunks))
        chunk = array[tuple(slice(o, o + c) for o, c in zip(origin, chunks))]  # edge chunks are short
        for sel, extent in zip(p.chunk_sel, chunk.shape):
            assert 0 <= sel.start < sel.stop <= extent and sel.step is None
        crop[p.box_sel] = chunk[p.chunk_sel]
        covered[p.box_sel] += 1
    np.testing.assert_array_equal(crop, array[tuple(slice(a, b) for a, b in box)])
    assert (covered == 1).all()  # every element comes from exactly one chunk


def test_chunk_intersections_examples():
    pieces = list(chunk_intersections(((2, 6), (0, 3)), (4, 4)))
    assert [p.index for p in pieces] == [(0, 0), (1, 0)]
    assert pieces[0].chunk_sel == (slice(2, 4), slice(0, 3)) and pieces[0].box_sel == (slice(0, 2), slice(0, 3))
    assert pieces[1].chunk_sel == (slice(0, 2), slice(0, 3)) and pieces[1].box_sel == (slice(2, 4), slice(0, 3))
    # 0-d: one chunk with an empty index
    assert [p.index for p in chunk_intersections((), ())] == [()]
    assert chunks_touched((), ()) == 1
    # empty boxes touch nothing
    assert list(chunk_intersections(((3, 3), (0, 8)), (4, 4))) == []
    assert chunks_touched(((3, 3), (0, 8)), (4, 4)) == 0
    assert grid_shape((10, 8, 0), (4, 4, 3)) == (3, 2, 0)


@given(grids())
@FAST
def test_chunks_touched_matches_enumeration(grid):
    shape, chunks, box = grid
    assert chunks_touched(box, chunks) == len(list(chunk_intersections(box, chunks)))
    assert chunks_touched(box, chunks) <= math.prod(grid_shape(shape, chunks))


# =============================================================================================
# chunk keys


@pytest.mark.parametrize("index", [(), (0,), (3,), (1, 2), (0, 10, 200), (7, 0, 0, 1)])
def test_chunk_key_encoding_matches_zarr(index):
    for sep in ("/", "."):
        v3 = ChunkKeyEncoding(prefix="c", separator=sep)
        v2 = ChunkKeyEncoding(prefix="", separator=sep)
        assert v3.key(index) == DefaultChunkKeyEncoding(separator=sep).encode_chunk_key(index)
        assert v2.key(index) == V2ChunkKeyEncoding(separator=sep).encode_chunk_key(index)


def test_chunk_key_encoding_literals():
    assert ChunkKeyEncoding("c", "/").key((1, 2, 3)) == "c/1/2/3"
    assert ChunkKeyEncoding("c", ".").key((1, 2)) == "c.1.2"
    assert ChunkKeyEncoding("c", "/").key(()) == "c"
    assert ChunkKeyEncoding("", ".").key((1, 2, 3)) == "1.2.3"
    assert ChunkKeyEncoding("", "/").key((1, 2)) == "1/2"
    assert ChunkKeyEncoding("", ".").key(()) == "0"
    assert ChunkKeyEncoding("", "/").key(()) == "0"


@pytest.mark.parametrize("fmt,expected_key", [(2, "0"), (3, "c")])
def test_zero_d_array_key_on_disk(tmp_path, fmt, expected_key):
    uri = str(tmp_path / "scalar.zarr")
    arr = zarr.create_array(uri, shape=(), dtype="i4", zarr_format=fmt, fill_value=0)
    arr[...] = 42
    assert os.path.isfile(os.path.join(uri, expected_key))
    reader = stoker.open_array(uri)
    assert reader.metadata.chunk_key(()) == expected_key
    out = reader.read(())
    assert out.shape == () and out[()] == 42


# =============================================================================================
# coalesce

range_lists = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 700)), max_size=40)


def check_coalesced(ranges, reads, max_gap, max_length):
    served = sorted(i for r in reads for i, _, _ in r.parts)
    assert served == list(range(len(ranges)))  # each request served exactly once
    assert [r.offset for r in reads] == sorted(r.offset for r in reads)
    for r in reads:
        assert r.parts
        for i, off, n in r.parts:
            assert (off, n) == tuple(ranges[i])
            assert r.offset <= off and off + n <= r.offset + r.length
        starts = [off for _, off, _ in r.parts]
        assert starts == sorted(starts) and r.offset == starts[0]
        assert r.offset + r.length == max(off + n for _, off, n in r.parts)  # no wasted tail
        if len(r.parts) > 1:
            assert r.length <= max_length
        # No hole wider than max_gap inside a read.
        end = r.offset
        for _, off, n in r.parts:
            assert off - end <= max_gap
            end = max(end, off + n)
    # Greedy: the next read starts where merging was not allowed.
    for a, b in zip(reads, reads[1:]):
        _, off, n = b.parts[0]
        a_end = a.offset + a.length
        assert off - a_end > max_gap or max(a_end, off + n) - a.offset > max_length


@given(range_lists, st.integers(0, 300), st.integers(1, 3000), st.integers(0, 2**32 - 1))
@settings(max_examples=300, deadline=None)
def test_coalesce_properties(ranges, max_gap, max_length, seed):
    reads = coalesce(ranges, max_gap=max_gap, max_length=max_length)
    check_coalesced(ranges, reads, max_gap, max_length)
    # Slices map back to the right bytes of the file.
    blob = np.random.default_rng(seed).integers(0, 256, size=6000, dtype=np.uint8).tobytes()
    got = [None] * len(ranges)
    for r in reads:
        buf = blob[r.offset:r.offset + r.length]
        for i, sl in r.slices():
            got[i] = buf[sl]
    assert got == [blob[off:off + n] for off, n in ranges]


def test_coalesce_examples():
    assert coalesce([]) == []
    assert coalesce([(0, 100), (120, 80)], max_gap=64) == [Read(0, 200, ((0, 0, 100), (1, 120, 80)))]
    assert coalesce([(0, 100), (120, 80)], max_gap=19) == [Read(0, 100, ((0, 0, 100),)),
                                                           Read(120, 80, ((1, 120, 80),))]
    assert len(coalesce([(0, 100), (120, 80)], max_gap=20)) == 1  # a gap of exactly max_gap merges
    # adjacent ranges merge even with max_gap=0; request order is kept in the parts
    assert coalesce([(10, 5), (0, 10)], max_gap=0) == [Read(0, 15, ((1, 0, 10), (0, 10, 5)))]
    # duplicates and overlaps are served from one read
    reads = coalesce([(5, 10), (5, 10), (8, 2), (0, 20)], max_gap=0)
    assert len(reads) == 1 and (reads[0].offset, reads[0].length) == (0, 20)
    assert sorted(i for i, _ in reads[0].slices()) == [0, 1, 2, 3]
    # max_length splits merges, but a single long range is never cut
    reads = coalesce([(0, 50), (50, 50), (100, 50)], max_gap=10, max_length=100)
    assert [(r.offset, r.length) for r in reads] == [(0, 100), (100, 50)]
    assert coalesce([(0, 500)], max_length=100) == [Read(0, 500, ((0, 0, 500),))]


# =============================================================================================
# SizedLRU


class ModelLRU:
    """Reference model of SizedLRU's contract."""

    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self.items = OrderedDict()
        self.hits = self.misses = 0

    def get_or_load(self, key, load, size):
        if key in self.items:
            self.items.move_to_end(key)
            self.hits += 1
            return self.items[key][0]
        self.misses += 1
        value = load()
        if size <= self.max_bytes:
            self.items[key] = (value, size)
            while sum(s for _, s in self.items.values()) > self.max_bytes:
                self.items.popitem(last=False)
        return value


@given(st.integers(0, 100), st.lists(st.tuples(st.integers(0, 12), st.integers(0, 60)), max_size=80))
@settings(max_examples=200, deadline=None)
def test_sized_lru_matches_model(max_bytes, ops):
    sizes = {}
    cache = SizedLRU(max_bytes, sizeof=lambda v: sizes[v])
    model = ModelLRU(max_bytes)
    for key, size in ops:
        sizes.setdefault(f"v{key}", size)
        size = sizes[f"v{key}"]
        loads = []
        missed_before = model.misses
        value = cache.get_or_load(key, lambda: loads.append(key) or f"v{key}")
        expected = model.get_or_load(key, lambda: f"v{key}", size)
        assert value == expected == f"v{key}"
        assert cache.nbytes <= max_bytes
        assert (cache.hits, cache.misses) == (model.hits, model.misses)
        assert len(loads) == model.misses - missed_before  # loaded exactly on a miss
        assert list(cache._items) == list(model.items)  # same contents in the same LRU order
        assert cache.nbytes == sum(s for _, s in model.items.values())
        assert len(cache) == len(model.items)


def test_sized_lru_order_and_counters():
    loads = []

    def loader(k):
        return lambda: loads.append(k) or k * 10

    cache = SizedLRU(max_bytes=30, sizeof=lambda v: 10)
    assert [cache.get_or_load(k, loader(k)) for k in (1, 2, 3)] == [10, 20, 30]
    assert (cache.hits, cache.misses, len(cache), cache.nbytes) == (0, 3, 3, 30)
    assert cache.get_or_load(1, loader(1)) == 10  # hit: 1 becomes most recent
    assert cache.hits == 1 and loads == [1, 2, 3]
    cache.get_or_load(4, loader(4))  # evicts 2, the least recently used
    assert cache.nbytes == 30 and len(cache) == 3
    cache.get_or_load(1, loader(1))
    cache.get_or_load(3, loader(3))
    assert loads == [1, 2, 3, 4]
    cache.get_or_load(2, loader(2))  # 2 was evicted: reloaded
    assert loads == [1, 2, 3, 4, 2]
    assert (cache.hits, cache.misses) == (3, 5)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_sized_lru_oversized_values_are_returned_not_kept():
    cache = SizedLRU(max_bytes=100, sizeof=len)
    small = cache.get_or_load("s", lambda: b"x" * 60)
    big = cache.get_or_load("b", lambda: b"y" * 101)
    assert big == b"y" * 101 and len(cache) == 1 and cache.nbytes == 60
    assert cache.get_or_load("s", lambda: b"other") == small
    # None values are cacheable (a missing shard is remembered as None)
    calls = []
    none_cache = SizedLRU(max_bytes=100, sizeof=lambda v: 64)
    for _ in range(3):
        assert none_cache.get_or_load("k", lambda: calls.append(1)) is None
    assert len(calls) == 1
    assert (none_cache.hits, none_cache.misses) == (2, 1)


def test_sized_lru_threads():
    cache = SizedLRU(max_bytes=1000, sizeof=lambda v: v[1])
    rng = random.Random(7)
    keys = [rng.randrange(60) for _ in range(4000)]

    def work(part):
        for k in part:
            value = cache.get_or_load(k, lambda k=k: (k, 10 + k % 50))
            assert value == (k, 10 + k % 50)
            assert cache.nbytes <= 1000

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, [keys[i::8] for i in range(8)]))
    assert cache.hits + cache.misses == len(keys)
    assert cache.nbytes == sum(size for _, size in cache._items.values()) <= 1000


# =============================================================================================
# LocalStore


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


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
    baseline = _open_fds()
    store = LocalStore(max_open_files=8)
    for path in paths:
        assert store.read_range(path, 0, 1 << 20) == files[path]
        assert _open_fds() - baseline <= 8
    assert store.counters.files_opened == 60
    for path in paths[-8:]:  # the 8 most recent are still open
        store.read_range(path, 0, 1)
    assert store.counters.files_opened == 60
    store.read_range(paths[0], 0, 1)  # long evicted: reopened
    assert store.counters.files_opened == 61
    assert _open_fds() - baseline <= 8
    store.close()
    assert _open_fds() == baseline


@needs_proc
@pytest.mark.parametrize("n_files,max_open,slow", [(300, 16, False), (300, 16, True), (24, 3, True)])
def test_local_store_concurrent_reads_with_eviction(tmp_path, monkeypatch, n_files, max_open, slow):
    """8 threads, many files, few descriptors: handles are evicted while other threads read them.

    With ``slow``, every read first sleeps briefly (releasing the GIL) so reads overlap far more
    often and a handle is regularly evicted, and even reopened, while a read through it is in flight.
    """
    files = _write_many(str(tmp_path), n_files, seed=1)
    paths = list(files)
    baseline = _open_fds()
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
            # cached ones, plus per thread at most: one evicted but in use, one just opened (not yet
            # cached), one listing /proc/self/fd right here
            if _open_fds() - baseline > max_open + 3 * 8:
                errors.append(("too many descriptors", _open_fds() - baseline))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert errors == []
    assert len(store._handles) <= max_open
    store.close()
    assert _open_fds() == baseline, "descriptors leaked"


@needs_proc
def test_local_store_evicted_while_in_use_then_reopened_does_not_leak(tmp_path, monkeypatch):
    """A handle evicted while a read is in flight, and reopened meanwhile, is closed by its last user."""
    files = _write_many(str(tmp_path), 2, seed=2)
    (p1, d1), (p2, d2) = files.items()
    baseline = _open_fds()
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
    assert _open_fds() == baseline, "the evicted descriptor was never closed"


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


# =============================================================================================
# fill values


def _bits(a: np.ndarray) -> int:
    return int(a.view(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("batch", ["float32", "bfloat16", "float16", "int16"])
def test_fill_value_as_gives_a_scalar_of_every_batch_dtype(batch):
    """Regression: a bfloat16 batch once failed on every absent chunk (the fill became shape (1,))."""
    import torch

    from stoker.engine.cast import fill_value_as

    fill = fill_value_as(parse_fill_value(-5, np.dtype("int16"), "i", 3), getattr(torch, batch))
    assert fill.shape == () and fill.dtype == getattr(torch, batch) and fill.item() == -5


@pytest.mark.parametrize("dtype", ["f2", "f4", "f8", ">f4", "<f8"])
@pytest.mark.parametrize("fmt", [2, 3])
def test_fill_value_special_floats(dtype, fmt):
    dt = np.dtype(dtype)
    nan = parse_fill_value("NaN", dt, "u", fmt)
    assert nan.shape == () and nan.dtype == dt.newbyteorder("=") and np.isnan(nan)
    assert parse_fill_value("Infinity", dt, "u", fmt)[()] == np.inf
    assert parse_fill_value("-Infinity", dt, "u", fmt)[()] == -np.inf
    assert parse_fill_value(1.5, dt, "u", fmt)[()] == 1.5
    assert parse_fill_value(-2, dt, "u", fmt)[()] == -2.0


@pytest.mark.parametrize("hexval,dtype,value", [
    ("0x7fc00000", "f4", None),       # canonical quiet NaN
    ("0x7fc00001", "f4", None),       # NaN with a payload: bits survive
    ("0x3f800000", "f4", 1.0),
    ("0x80000000", "f4", -0.0),
    ("0xff800000", "f4", -np.inf),
    ("0x7ff8000000000000", "f8", None),
    ("0x4000000000000000", "f8", 2.0),
    ("0x3c00", "f2", 1.0),
    ("0x7e00", "f2", None),
])
def test_fill_value_v3_hex_bit_patterns(hexval, dtype, value):
    got = parse_fill_value(hexval, np.dtype(dtype), "u", 3)
    assert got.dtype == np.dtype(dtype)
    assert _bits(got) == int(hexval, 16)
    if value is None:
        assert np.isnan(got)
    else:
        assert got[()] == value and np.signbit(got) == np.signbit(value)


@pytest.mark.parametrize("dtype", ["u1", "i2", "<u4", ">i8", "f4", "f8", "c8", "c16", "?"])
@pytest.mark.parametrize("fmt", [2, 3])
def test_fill_value_null_is_zero(dtype, fmt):
    got = parse_fill_value(None, np.dtype(dtype), "u", fmt)
    assert got.shape == () and got.dtype == np.dtype(dtype).newbyteorder("=")
    assert got[()] == 0 and not np.signbit(got.real)


def test_fill_value_bool_int_complex():
    assert parse_fill_value(True, np.dtype("?"), "u", 3)[()] is np.True_
    assert parse_fill_value(False, np.dtype("?"), "u", 2)[()] is np.False_
    assert parse_fill_value(2**64 - 1, np.dtype("u8"), "u", 3)[()] == 2**64 - 1
    assert parse_fill_value(-(2**63), np.dtype(">i8"), "u", 2)[()] == -(2**63)
    assert parse_fill_value(3.0, np.dtype("i4"), "u", 3)[()] == 3
    assert parse_fill_value([1.0, 2.0], np.dtype("c8"), "u", 3)[()] == 1 + 2j
    assert parse_fill_value([1.5, -0.25], np.dtype("c16"), "u", 2)[()] == 1.5 - 0.25j
    special = parse_fill_value(["NaN", "-Infinity"], np.dtype("c16"), "u", 3)[()]
    assert np.isnan(special.real) and special.imag == -np.inf
    hexed = parse_fill_value(["0x3f800000", "0x40000000"], np.dtype("c8"), "u", 3)
    assert hexed[()] == 1 + 2j and hexed.dtype == np.dtype("c8")
    # v2 may store integer fill values as base64 bytes
    assert parse_fill_value("AQAAAA==", np.dtype("<i4"), "u", 2)[()] == 1


@pytest.mark.parametrize("value,dtype", [("hello", "f4"), (1.5, "i4"), (300, "u1"), (-1, "u2"),
                                         ("nan", "f8"), ([1.0], "c8"), (["a", 0.0], "c16")])
def test_fill_value_rejects(value, dtype):
    with pytest.raises(stoker.MetadataError, match="/arr.zarr"):
        parse_fill_value(value, np.dtype(dtype), "/arr.zarr", 3)


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf, -0.0, 1.25])
@pytest.mark.parametrize("fmt", [2, 3])
def test_fill_value_round_trip_through_zarr(tmp_path, fill, fmt):
    """zarr writes the fill value; stoker's parse of it reads back bit-identical fill chunks."""
    uri = str(tmp_path / "f.zarr")
    zarr.create_array(uri, shape=(4,), chunks=(2,), dtype="f4", zarr_format=fmt, fill_value=fill)
    got = stoker.open_array(uri).read([(0, 4)])
    want = zarr.open_array(uri)[...]
    assert got.view("u4").tolist() == want.view("u4").tolist()
    assert _bits(np.array(fill, dtype="f4")) == int(got.view("u4")[0])


def test_locate_names_the_file_and_range_of_every_chunk_kind(tmp_path):
    """ArrayReader.locate: a plain chunk is a whole file (present or not); an inner chunk of a shard is
    the byte range its shard's index gives, whose bytes decode to zarr's chunk; an empty inner chunk and
    a missing shard have no file."""
    plain = zarr.create_array(str(tmp_path / "plain.zarr"), shape=(4, 4), chunks=(2, 2), dtype="uint16", fill_value=0)
    plain[:2, :2] = 7
    arr = stoker.open_array(tmp_path / "plain.zarr")
    loc = arr.locate((0, 0))
    assert (loc.key, loc.offset, loc.length) == ("c/0/0", None, None)
    assert loc.path == os.path.join(str(tmp_path / "plain.zarr"), "c", "0", "0") and os.path.exists(loc.path)
    assert arr.locate((1, 1)).path is not None and not os.path.exists(arr.locate((1, 1)).path)  # found when read

    sharded = zarr.create_array(str(tmp_path / "sharded.zarr"), shape=(8, 8), chunks=(2, 2), shards=(4, 4),
                                dtype="uint16", fill_value=0)
    data = np.arange(16, dtype="uint16").reshape(4, 4) + 1
    sharded[:4, :2] = data[:, :2]  # shard (0, 0): inner chunks (0, 0) and (1, 0) stored, the others empty
    arr = stoker.open_array(tmp_path / "sharded.zarr")
    loc = arr.locate((1, 0))
    assert loc.key == "c/0/0[2]" and loc.path == os.path.join(str(tmp_path / "sharded.zarr"), "c", "0", "0")
    raw = open(loc.path, "rb").read()[loc.offset:loc.offset + loc.length]
    np.testing.assert_array_equal(arr.metadata.codec.decode(raw, loc.key), sharded[2:4, 0:2])
    st = os.stat(loc.path)  # the identity of the shard file the index was read from
    assert loc.ident == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    assert arr.locate((0, 1)) == ("c/0/0[1]", None, None, None, None)  # empty inner chunk
    assert arr.locate((3, 3)) == ("c/1/1[3]", None, None, None, None)  # missing shard


def test_pinned_footprint_is_torchs_power_of_two_rounding():
    from stoker.engine.buffers import pinned_footprint

    assert [pinned_footprint(n) for n in (0, 1, 3, 4096, 4097)] == [0, 1, 4, 4096, 8192]
    assert pinned_footprint(40 << 20) == 64 << 20 and pinned_footprint(64 << 20) == 64 << 20


def test_dead_writers_siblings_are_removed_and_nothing_else(tmp_path):
    import subprocess
    import sys

    from stoker import fsutil

    final = tmp_path / "knn"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    mine = fsutil.sibling_path(final, "tmp")  # this process: alive
    dead = tmp_path / f".knn.old-{fsutil.HOST}-{proc.pid}-0123abcd"
    other_host_fresh = tmp_path / ".knn.tmp-elsewhere-1-0123abcd"
    other_host_stale = tmp_path / ".knn.tmp-elsewhere-2-0123abcd"
    other_name = tmp_path / f".knn2.tmp-{fsutil.HOST}-{proc.pid}-0123abcd"
    unrelated = tmp_path / ".knn.tmp-notes"
    for d in (mine, dead, other_host_fresh, other_host_stale, other_name, unrelated):
        d.mkdir()
    old = time.time() - fsutil.STALE_AFTER_S - 60
    os.utime(other_host_stale, (old, old))
    assert mine.name.startswith(f".knn.tmp-{fsutil.HOST}-{os.getpid()}-")
    assert sorted(fsutil.remove_dead_siblings(final)) == sorted([dead, other_host_stale])
    assert all(d.exists() for d in (mine, other_host_fresh, other_name, unrelated))
    assert fsutil.is_temp_path(fsutil.sibling_path(tmp_path / "step-000000001.pt", "tmp"))
    assert fsutil.is_temp_path(tmp_path / ".step-000000001.pt.tmp-999")  # as older versions named them
    assert not fsutil.is_temp_path(tmp_path / "step-000000001.pt")
    assert not fsutil.is_temp_path(dead)  # an old directory moved aside
