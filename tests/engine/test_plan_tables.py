"""The planner (engine/planning/tables.py) against a reference made of the reader's parts (the grid's reference,
zarr/grid.py, crop by crop, and ArrayReader.locate chunk by chunk): on random batches of random crops over arrays
with edge chunks, shards (missing ones, empty inner chunks, index at either end), duplicates across samples and
several arrays per batch, it must plan the same chunks, copies, spans and locations, and raise the same errors;
its compiled grid (csrc/grid.c, csrc/tables.c) must give the numpy reference's pieces on random boxes and
chunkings; and its Python work must not grow with the number of chunks."""

from __future__ import annotations

import ctypes
import os
import sys
from array import array

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import BytesCodec, ShardingCodec, ZstdCodec

import stoker
from stoker.engine.cpu import native
from stoker.engine.planning import tables
from stoker.engine.planning.tables import batch_shape, plan_tables
from stoker.engine.planning.tasks import ChunkTask, Copy
from stoker.sampling.sample import parts
from stoker.zarr.box import check_in_bounds
from stoker.zarr.grid import axis_pieces, box_pieces, c_order_span, c_strides, chunk_intersections

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True, params=["compiled", "compiled-grid", "numpy"])
def grid(request, monkeypatch):
    """Which planner crosses the crops with the grid and finds where sharded chunks are stored: C (csrc/tables.c
    plan_crops, where the extension is built), C's grid alone with the boxes checked in numpy (csrc/grid.c
    plan_grid: plan_tables' way when plan_crops and check_in_bounds disagree), or numpy."""
    if request.param == "numpy":
        for name in ("plan_crops", "plan_grid", "shard_positions", "gather_entries"):
            monkeypatch.setattr(native, name, None)
    elif request.param == "compiled-grid":
        monkeypatch.setattr(native, "plan_crops", None)
    if request.param != "numpy" and native.plan_grid is None:
        pytest.skip("stoker._native is not available")
    return request.param


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    """Arrays of rank 3 with odd shapes: every edge chunk partial; sharded ones with missing shards and
    empty inner chunks."""
    root = tmp_path_factory.mktemp("tables")
    rng = np.random.default_rng(0)
    made = {}
    plain = zarr.create_array(str(root / "plain.zarr"), shape=(23, 31, 17), chunks=(5, 7, 4), dtype="uint16",
                              compressors=ZstdCodec(level=1))
    plain[:20] = rng.integers(0, 1000, (20, 31, 17))  # the last plane of chunks is never written: missing files
    made["plain"] = str(root / "plain.zarr")
    v2 = zarr.create_array(str(root / "v2.zarr"), shape=(19, 26, 21), chunks=(6, 6, 6), dtype="int32",
                           zarr_format=2, fill_value=-3)
    v2[...] = rng.integers(-50, 50, (19, 26, 21))
    made["v2"] = str(root / "v2.zarr")
    for where in ("end", "start"):
        path = str(root / f"sharded-{where}.zarr")
        z = zarr.create_array(path, shape=(22, 26, 18), chunks=(10, 12, 8), dtype="float32", fill_value=0.5,
                              compressors=None, filters=None,
                              serializer=ShardingCodec(chunk_shape=(5, 4, 4), index_location=where,
                                                       codecs=[BytesCodec(), ZstdCodec(level=1)]))
        z[:10] = rng.standard_normal((10, 26, 18)).astype("float32")  # shards beyond plane 10: missing
        z[:5, :4, :4] = 0.5  # an inner chunk of nothing but the fill value: an empty entry
        made[f"sharded-{where}"] = path
    # other shards and inner chunks (each array's own geometry), and an index at the end again
    path = str(root / "sharded-other.zarr")
    z = zarr.create_array(path, shape=(21, 25, 19), chunks=(6, 5, 9), dtype="uint16", fill_value=2,
                          compressors=None, filters=None,
                          serializer=ShardingCodec(chunk_shape=(3, 5, 3), codecs=[BytesCodec(), ZstdCodec(level=1)]))
    z[...] = rng.integers(0, 1000, (21, 25, 19))
    made["sharded-other"] = path
    return made


class _Reference:
    """The batch plan the reader's own parts make, one Python step per crop and chunk: the crops' chunks from
    :func:`~stoker.zarr.grid.chunk_intersections` (the grid's reference), numbered in order of first use, every
    copy, each chunk's C-order byte span (these arrays' layout), located by :meth:`ArrayReader.locate` in chunk
    order. Raises the first crop's error in the batch's order (opening, bounds, rank), then the first chunk's."""

    def __init__(self, samples, opener):
        self.shape, _ = batch_shape(samples)
        self.sources, opened, found = [], {}, {}
        self.chunks_needed = self.bytes_needed = 0
        for row, (uri, aabb) in enumerate(parts(samples)):
            if uri not in opened:
                opened[uri] = len(self.sources)
                self.sources.append(opener(uri))
            sid, reader = opened[uri], self.sources[opened[uri]]
            check_in_bounds(aabb, reader.shape, uri)
            self.bytes_needed += int(np.prod(self.shape)) * reader.dtype.itemsize
            for piece in chunk_intersections(aabb, reader.chunks):
                self.chunks_needed += 1
                task = found.setdefault((sid, piece.index), ChunkTask(sid, piece.index, ""))
                task.copies.append(Copy.of(row, piece.chunk_sel, piece.box_sel))
        self.chunks = list(found.values())
        for task in self.chunks:
            reader = self.sources[task.source]
            task.byte_start, task.byte_stop = c_order_span(reader.chunks, reader.dtype.itemsize,
                                                           [c.chunk_sel for c in task.copies])
            loc = reader.locate(task.index)
            task.key, task.path, task.offset, task.length, task.ident = loc


def _compare(samples, opener, cold=()):
    """The reference against plan_tables on the same readers; ``cold``: the arrays (by name) whose shard indexes
    are dropped before plan_tables plans, so it reads them itself (the reference cached them all)."""
    ref = _Reference(samples, opener)
    for reader in ref.sources:
        if reader.uri in cold:
            reader._index_cache.clear()
    got = plan_tables(0, samples, opener)
    assert (got.chunks_needed, got.bytes_needed, got.n_chunks) == (ref.chunks_needed, ref.bytes_needed, len(ref.chunks))
    assert [r.uri for r in got.sources] == [r.uri for r in ref.sources]
    for i, want in enumerate(ref.chunks):
        task = got.chunks[i]
        assert (task.source, task.index, task.key) == (want.source, want.index, want.key)
        assert (task.path, task.offset, task.length, task.ident) == (want.path, want.offset, want.length, want.ident)
        assert (task.byte_start, task.byte_stop) == (want.byte_start, want.byte_stop)
        assert [(c.row, c.chunk_start, c.box_start, c.extent) for c in task.copies] == \
            [(c.row, c.chunk_start, c.box_start, c.extent) for c in want.copies]
        # each copy's first element in the chunk (C order: these arrays' layout)
        lo = int(got.first_copy[i])
        offsets = got.copy_src_offset[lo:lo + int(got.n_copies[i])].tolist()
        strides = c_strides(tuple(got.sources[want.source].chunks))
        assert offsets == [sum(a * k for a, k in zip(c.chunk_start, strides)) for c in want.copies]
    return ref, got


@st.composite
def batches(draw, names):
    shapes = {"plain": (23, 31, 17), "v2": (19, 26, 21), "sharded-end": (22, 26, 18), "sharded-start": (22, 26, 18),
              "sharded-other": (21, 25, 19)}
    crop = tuple(draw(st.integers(1, 17)) for _ in range(3))
    picks = draw(st.lists(st.sampled_from(names), min_size=1, max_size=6))
    out = []
    for name in picks:
        corner = [draw(st.integers(0, s - c)) for s, c in zip(shapes[name], crop)]
        out.append((name, [(a, a + c) for a, c in zip(corner, crop)]))
    if draw(st.booleans()):
        out.append(out[0])  # the same crop twice: the same chunks, more copies
    return out


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_flat_plan_matches_the_reference(arrays, data):
    batch = data.draw(batches(sorted(arrays)))
    opener_cache = {}
    opener = lambda uri: opener_cache.setdefault(uri, stoker.open_array(uri))  # noqa: E731
    cold = data.draw(st.sets(st.sampled_from(sorted(arrays))))  # their indexes read by plan_tables
    _compare([stoker.Sample(arrays[name], box) for name, box in batch], opener, {arrays[name] for name in cold})


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_copy_rows_are_each_chunks_copies_in_order(arrays, data):
    """TablePlan.copy_rows (what the GPU placement and the hybrid's split take a subset of chunks' copies by):
    for any chunks, in any order, each one's copies (TablePlan.copies) chunk after chunk."""
    opener_cache = {}
    opener = lambda uri: opener_cache.setdefault(uri, stoker.open_array(uri))  # noqa: E731
    plan = plan_tables(0, [stoker.Sample(arrays[name], box) for name, box in data.draw(batches(sorted(arrays)))],
                       opener)
    ids = np.array(data.draw(st.lists(st.integers(0, plan.n_chunks - 1), unique=True)), np.int64)
    rows = plan.copy_rows(ids)
    assert rows.dtype == np.int64 and len(rows) == int(plan.n_copies[ids].sum())
    got = [(int(plan.copy_row[r]), tuple(plan.copy_chunk_start[r].tolist()), tuple(plan.copy_box_start[r].tolist()),
            tuple(plan.copy_extent[r].tolist())) for r in rows.tolist()]
    assert got == [(c.row, c.chunk_start, c.box_start, c.extent) for i in ids.tolist() for c in plan.copies(i)]


def test_flat_plan_fills_and_locates_like_the_reader(arrays):
    """A crop over a missing shard, an empty inner chunk and a missing chunk file, in one batch."""
    opener_cache = {}
    opener = lambda uri: opener_cache.setdefault(uri, stoker.open_array(uri))  # noqa: E731
    samples = [stoker.Sample(arrays["sharded-end"], [(0, 12), (0, 6), (0, 6)]),  # empty entry, then shard 0 and 1
               stoker.Sample(arrays["sharded-end"], [(10, 22), (0, 6), (0, 6)]),  # missing shards
               stoker.Sample(arrays["plain"], [(11, 23), (0, 6), (0, 6)])]  # missing chunk files: still files
    ref, got = _compare(samples, opener)
    fills = [i for i, c in enumerate(ref.chunks) if c.fill]
    assert fills and (got.chunk_file[fills] == -1).all()
    assert (got.chunk_file[[i for i in range(got.n_chunks) if i not in fills]] >= 0).all()


def test_sharded_arrays_of_other_geometries_in_one_batch(arrays):
    """Each sharded array's shards found with its own shard and inner chunk shapes, whichever comes last."""
    opener_cache = {}
    opener = lambda uri: opener_cache.setdefault(uri, stoker.open_array(uri))  # noqa: E731
    for names in (("sharded-other", "sharded-end"), ("sharded-end", "sharded-other")):
        samples = [stoker.Sample(arrays[name], [(2, 19), (3, 24), (1, 18)]) for name in names]
        for cold in ((), names[:1], names):  # indexes cached, then read by plan_tables for one array, then both
            ref, got = _compare(samples, opener, {arrays[name] for name in cold})
            assert len(got.files) > 4


def test_flat_plan_raises_what_the_reference_raises(arrays, tmp_path):
    opener = stoker.open_array
    plain = arrays["plain"]
    flat2d = str(tmp_path / "flat.zarr")  # two axes: a three-axis box is a rank mismatch
    zarr.create_array(flat2d, shape=(8, 8), chunks=(4, 4), dtype="uint16")[...] = 1
    for samples, error in [
        ([stoker.Sample(plain, [(0, 4), (0, 4), (15, 18)])], stoker.OutOfBounds),
        ([stoker.Sample(str(tmp_path / "none.zarr"), [(0, 4), (0, 4), (0, 4)])], stoker.NotFound),
        # bounds past int64 (which no planner's table holds), after a crop in bounds
        ([stoker.Sample(plain, [(0, 4), (0, 4), (0, 1)]), stoker.Sample(plain, [(0, 4), (0, 4), (2**64, 2**64 + 1)])],
         stoker.OutOfBounds),
        ([stoker.Sample(plain, [(0, 4), (0, 4), (0, 4)]), stoker.Sample(plain, [(0, 4), (0, 4), (0, 5)])],
         stoker.InvalidArgument),
        # the first crop at fault decides, whichever check finds it: bounds before a later missing array...
        ([stoker.Sample(plain, [(0, 4), (0, 4), (15, 18)]),
          stoker.Sample(str(tmp_path / "none.zarr"), [(0, 4), (0, 4), (0, 3)])], stoker.OutOfBounds),
        # ...a later crop out of bounds after one in bounds, and a rank mismatch after an out-of-bounds crop
        ([stoker.Sample(plain, [(0, 4), (0, 4), (0, 3)]), stoker.Sample(plain, [(20, 24), (0, 4), (0, 3)])],
         stoker.OutOfBounds),
        ([stoker.Sample(plain, [(0, 4), (0, 4), (15, 18)]), stoker.Sample(flat2d, [(0, 4), (0, 4), (0, 3)])],
         stoker.OutOfBounds),
        ([stoker.Sample(flat2d, [(0, 4), (0, 4), (0, 3)]), stoker.Sample(plain, [(0, 4), (0, 4), (15, 18)])],
         stoker.RankMismatch),
    ]:
        with pytest.raises(error) as ref:
            _Reference(samples, opener)
        with pytest.raises(error) as got:
            plan_tables(0, samples, opener)
        assert str(got.value) == str(ref.value)


def test_flat_plan_raises_for_the_first_damaged_shard_in_chunk_order(tmp_path):
    """Two damaged shards in one batch: the error is the one the reference meets first, whichever shard the
    flat planner looks up first."""
    path = str(tmp_path / "s.zarr")
    z = zarr.create_array(path, shape=(8, 16), chunks=(8, 8), shards=(8, 8), dtype="uint16",
                          compressors=ZstdCodec(level=1))
    z[...] = np.arange(128, dtype="uint16").reshape(8, 16)
    shard0, shard1 = (os.path.join(path, "c", "0", str(i)) for i in (0, 1))
    open(shard0, "wb").write(b"short")  # its index cannot be read
    raw = bytearray(open(shard1, "rb").read())
    raw[-5] ^= 0xFF  # its index fails its checksum
    open(shard1, "wb").write(bytes(raw))
    for boxes, key in [([[(0, 8), (0, 8)], [(0, 8), (8, 16)]], "c/0/0"), ([[(0, 8), (8, 16)], [(0, 8), (0, 8)]], "c/0/1")]:
        samples = [stoker.Sample(path, box) for box in boxes]
        with pytest.raises(stoker.DecodeError) as ref:
            _Reference(samples, stoker.open_array)
        with pytest.raises(stoker.DecodeError) as got:
            plan_tables(0, samples, stoker.open_array)
        assert str(got.value) == str(ref.value) and repr(key) in str(got.value)


def test_shard_indexes_gathered_a_table_at_a_time_match(arrays, monkeypatch, grid):
    """Shards whose indexes are too large to join are gathered one table at a time (numpy, without the
    extension): the same plan."""
    if grid != "numpy":
        pytest.skip("the compiled gather takes any size of table")
    monkeypatch.setattr(tables, "_JOIN_ROWS", 1)
    opener_cache = {}
    opener = lambda uri: opener_cache.setdefault(uri, stoker.open_array(uri))  # noqa: E731
    for name in ("sharded-end", "sharded-start"):
        samples = [stoker.Sample(arrays[name], [(0, 17), (3, 26), (1, 17)]),  # every shard, missing ones too
                   stoker.Sample(arrays[name], [(4, 21), (0, 23), (0, 16)]),
                   stoker.Sample(arrays["plain"], [(0, 17), (0, 23), (0, 16)])]
        ref, got = _compare(samples, opener)
        assert len({c.path for c in ref.chunks if c.offset is not None}) > 1


def test_a_shard_grid_past_int64_is_planned_by_its_coordinates(tmp_path):
    """Shards are numbered in C order over the grid to key them once per reader; a grid of more shards than
    an int64 counts is planned by coordinates instead, to the same plan."""
    path = str(tmp_path / "huge.zarr")
    z = zarr.create_array(path, shape=(2**40, 2**40), chunks=(4, 4), shards=(8, 8), dtype="uint16",
                          compressors=ZstdCodec(level=1), fill_value=7)
    z[2**39: 2**39 + 16, 5: 21] = np.arange(256, dtype="uint16").reshape(16, 16)
    reader = stoker.open_array(path)
    opener = lambda uri: reader  # noqa: E731
    samples = [stoker.Sample(path, [(2**39 + 2, 2**39 + 14), (3, 15)]),
               stoker.Sample(path, [(2**40 - 12, 2**40), (2**40 - 12, 2**40)])]  # no shard: the fill value
    ref, got = _compare(samples, opener)
    assert sum(c.offset is not None for c in ref.chunks) == 12 and sum(c.fill for c in ref.chunks) == 4 + 9
    from stoker.engine.planning.tables import _shard_geometry
    assert _shard_geometry(reader)[2] is None


def test_shard_keys_are_made_once_and_bounded(arrays, monkeypatch):
    """ArrayReader.shard_keys: the key of each shard number (C order over the shard grid), kept for the process
    up to a bound past which it starts afresh, each reader's apart from another's."""
    from stoker.reader import array
    reader, other = stoker.open_array(arrays["sharded-end"]), stoker.open_array(arrays["sharded-other"])
    grid = reader.shard_grid
    assert grid == (3, 3, 3) and other.shard_grid == (4, 5, 3)
    every = list(range(27))
    assert reader.shard_keys(every) == [reader.metadata.chunk_key(tuple(int(v) for v in np.unravel_index(n, grid)))
                                        for n in every]
    assert reader.shard_keys([26, 0]) == ["c/2/2/2", "c/0/0/0"]
    assert other.shard_keys([26, 0]) == ["c/1/3/2", "c/0/0/0"]
    assert array._SHARD_KEYS[(reader._token, 26)] == "c/2/2/2"
    monkeypatch.setattr(array, "_MAX_KEPT_KEYS", 4)
    assert other.shard_keys([1, 40]) == ["c/0/0/1", "c/2/3/1"]  # new keys, over the bound: started afresh
    assert set(array._SHARD_KEYS) == {(other._token, 1), (other._token, 40)}
    assert reader.shard_keys([5]) == ["c/0/1/2"]
    assert set(array._SHARD_KEYS) == {(other._token, 1), (other._token, 40), (reader._token, 5)}


def test_an_entry_past_its_codec_bound_and_a_truncated_shard_in_either_order(tmp_path):
    """An index entry longer than its codec can store (refused before it is read) and a truncated shard in
    one batch: plan_tables raises the reference's error, the first chunk's in chunk order, with the index
    cached or read by plan_tables itself."""
    path = str(tmp_path / "g.zarr")
    z = zarr.create_array(path, shape=(16, 16), chunks=(8, 8), dtype="uint16", compressors=None, filters=None,
                          serializer=ShardingCodec(chunk_shape=(4, 4), index_location="start",
                                                   index_codecs=[BytesCodec()],
                                                   codecs=[BytesCodec(), ZstdCodec(level=1)]))
    z[...] = np.arange(256, dtype="uint16").reshape(16, 16)
    limit = stoker.open_array(path).metadata.codec.max_stored_nbytes
    shard = os.path.join(path, "c", "0", "1")
    raw = bytearray(open(shard, "rb").read())
    index = np.frombuffer(bytes(raw[:4 * 16]), "<u8").reshape(4, 2).copy()
    index[3, 1] = limit + 1  # inner chunk 3: longer than any zstd frame of 32 bytes, inside the file
    raw[:4 * 16] = index.astype("<u8").tobytes()
    open(shard, "wb").write(bytes(raw) + bytes(limit + 10))
    open(os.path.join(path, "c", "1", "0"), "wb").write(b"short")
    too_big, truncated = [(4, 8), (12, 16)], [(8, 12), (0, 4)]
    for boxes, error in [((too_big, truncated), stoker.DecodeError), ((truncated, too_big), stoker.DecodeError)]:
        for cold in (False, True):
            samples = [stoker.Sample(path, box) for box in boxes]
            reader = stoker.open_array(path)
            with pytest.raises(error) as ref:
                _Reference(samples, lambda uri: reader)
            if cold:
                reader._index_cache.clear()
            with pytest.raises(error) as got:
                plan_tables(0, samples, lambda uri: reader)
            assert str(got.value) == str(ref.value)
            assert ("c/0/1[3]" if boxes[0] is too_big else "'c/1/0'") in str(got.value)


def _python_calls(fn) -> int:
    """Python function calls (and calls into C functions) made while ``fn`` runs."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("sharded", [False, True], ids=["chunk-files", "one-shard"])
def test_flat_planning_work_does_not_grow_with_chunks(tmp_path, sharded):
    """One crop over 8 chunks and one over 1,000 (the same array, the same shard): the flat planner makes the
    same number of Python calls for both; the reference, a step per chunk, makes more for the larger one."""
    path = str(tmp_path / "a.zarr")
    kw = dict(shards=(40, 40, 40)) if sharded else {}
    zarr.create_array(path, shape=(40, 40, 40), chunks=(4, 4, 4), dtype="uint8", **kw)[...] = 1
    reader = stoker.open_array(path)
    opener = lambda uri: reader  # noqa: E731
    small = [stoker.Sample(path, [(0, 8), (0, 8), (0, 8)])]  # 8 chunks
    large = [stoker.Sample(path, [(0, 40), (0, 40), (0, 40)])]  # 1,000 chunks
    plan_tables(0, small, opener)  # warm: the shard index is read and cached, functions are compiled
    assert plan_tables(0, large, opener).n_chunks == 1000
    calls = [_python_calls(lambda s=s: plan_tables(0, s, opener)) for s in (small, large)]
    assert calls[0] == calls[1]
    reference = [_python_calls(lambda s=s: _Reference(s, opener)) for s in (small, large)]
    assert reference[1] > 10 * reference[0]  # what the flat planner is for


# -- the grid: compiled against the numpy reference ------------------------------------------------------------


@st.composite
def grids(draw):
    """A batch's crops over random arrays: 1-4 axes, 1-3 arrays of their own chunk shape, element strides (C
    order or permuted) and item size, crops anywhere (or, on one axis, near int64's end in chunks of 2**56 to
    2**57 elements, where a chunk's end passes int64); ``(starts, sids, extent, chunk_shapes, strides,
    itemsizes, array shapes)``."""
    ndim = draw(st.integers(1, 4))
    n_arrays = draw(st.integers(1, 3))
    far = draw(st.none() | st.integers(0, ndim - 1))  # the axis near int64's end, if any
    chunk_shapes = np.array([[draw(st.integers(2**56, 2**57) if a == far else st.integers(1, 9)) for a in range(ndim)]
                             for _ in range(n_arrays)], np.int64)
    strides = []
    for cs in chunk_shapes.tolist():
        order = draw(st.permutations(range(ndim)))
        stored = c_strides(tuple(cs[o] for o in order))
        # (with a far axis, strides of 1: the elements a copy spans must stay countable, as the C planner asks)
        strides.append([1] * ndim if far is not None else [stored[order.index(a)] for a in range(ndim)])
    itemsizes = np.array([draw(st.sampled_from([1, 2, 4, 8])) for _ in range(n_arrays)], np.int64)
    extent = np.array([draw(st.integers(1, 20)) for _ in range(ndim)], np.int64)
    n_crops = draw(st.integers(0, 6))
    sids = np.array([draw(st.integers(0, n_arrays - 1)) for _ in range(n_crops)], np.int64)
    starts = np.array([[draw(st.integers(2**63 - 2**57, 2**63 - 21) if a == far else st.integers(0, 40))
                        for a in range(ndim)] for _ in range(n_crops)], np.int64).reshape(n_crops, ndim)
    if n_crops and draw(st.booleans()):
        starts[-1], sids[-1] = starts[0], sids[0]  # a crop again: its chunks again, more copies
    shapes = np.full((n_arrays, ndim), 2**63 - 1, np.int64)  # every crop inside its array
    return starts, sids, extent, chunk_shapes, np.array(strides, np.int64), itemsizes, shapes


def _rows(chunk_shapes, strides, itemsizes, shapes) -> array:
    """The arrays' rows as plan_crops takes them (csrc/stoker_native.h: A_*), from numbers."""
    ndim = chunk_shapes.shape[1]
    rows = np.zeros((len(itemsizes), native.ARRAY_ROW_COLS(ndim)), np.int64)
    rows[:, native.A_ITEMSIZE] = itemsizes
    rows[:, native.A_CHUNK_SHAPE:native.A_CHUNK_SHAPE + ndim] = chunk_shapes
    rows[:, native.A_STRIDES(ndim):native.A_STRIDES(ndim) + ndim] = strides
    rows[:, native.A_SHAPE(ndim):native.A_SHAPE(ndim) + ndim] = shapes
    return array("q", rows.tobytes())


def _pieces_of(columns) -> list[tuple]:
    """A grid's copies as ``(crop, array, chunk index, start in the chunk, start in the crop, extent)``, sorted."""
    row, c_start, b_start, c_extent, _, chunk_source, chunk_index, first_copy, n_copies = columns[:9]
    chunk_of = np.repeat(np.arange(len(chunk_source)), n_copies)
    return sorted(zip(row.tolist(), chunk_source[chunk_of].tolist(), map(tuple, chunk_index[chunk_of].tolist()),
                      map(tuple, c_start.tolist()), map(tuple, b_start.tolist()), map(tuple, c_extent.tolist())))


@settings(max_examples=int(os.environ.get("STOKER_FUZZ_EXAMPLES", 200)), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(batch=grids())
def test_compiled_grid_gives_the_reference_pieces(batch, grid):
    """csrc/grid.c (plan_grid) and csrc/tables.c (plan_crops, the boxes checked first) against the grid's numpy
    reference (zarr/grid.py box_pieces): every crop's pieces, once each; and every column of the plan (chunks
    numbered in order of first use, copies grouped by chunk in batch order, offsets, decoded spans) the same
    as the numpy planner's, built on that reference."""
    if grid != "numpy":
        pytest.skip("the compiled grid against numpy: once")
    if native_module() is None:
        pytest.skip("stoker._native is not available")
    starts, sids, extent, chunk_shapes, strides, itemsizes, shapes = batch
    ref = box_pieces(starts, starts + extent, chunk_shapes[sids])
    want = sorted(zip(ref.box.tolist(), sids[ref.box].tolist(), map(tuple, ref.index.tolist()),
                      map(tuple, ref.chunk_start.tolist()), map(tuple, ref.box_start.tolist()),
                      map(tuple, ref.extent.tolist())))
    assert all(int(np.prod(e)) > 0 for *_, e in want) and len(want) == len(set(want))
    numpy_columns = tables._grid_numpy(starts, sids, extent, chunk_shapes, strides, itemsizes)
    assert _pieces_of(numpy_columns) == want
    compiled = native_module()
    got = tables._grid_columns(*compiled.plan_grid(starts, sids, extent, chunk_shapes, strides, itemsizes),
                               len(extent))
    planned = [got]
    if len(sids):  # (plan_tables plans no crop without it)
        boxes = array("q", np.stack([starts, starts + extent], axis=2).tobytes())
        copies, chunks, outside, bytes_needed, _ = compiled.plan_crops(
            boxes, array("q", sids.tobytes()), array("q", extent.tobytes()),
            _rows(chunk_shapes, strides, itemsizes, shapes))
        assert outside == -1 and bytes_needed == int(np.prod(extent)) * int(itemsizes[sids].sum())
        planned.append(tables._grid_columns(copies, chunks, len(extent)))
    for columns in planned:
        assert _pieces_of(columns) == want
        for column, expected in zip(columns, numpy_columns):
            assert column.tolist() == expected.tolist()


def native_module():
    """stoker._native, whatever the fixture patched out of engine/cpu/native.py, or None where it is not built."""
    try:
        from stoker import _native
    except ImportError:
        return None
    return _native


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(starts=st.lists(st.integers(0, 2**62), min_size=0, max_size=5), data=st.data())
def test_axis_pieces_cover_each_range_once_in_order(starts, data, grid):
    """The reference itself, per axis: a range's pieces are its chunks in order, each inside its chunk,
    together exactly the range; an empty range has none (also near int64's end, where a chunk's end would
    pass it)."""
    if grid != "numpy":
        pytest.skip("pure numpy: once")
    stops = [s + data.draw(st.integers(0, 30)) for s in starts]
    chunk = data.draw(st.sampled_from([1, 3, 7, 2**61 + 1]))
    p = axis_pieces(np.array(starts, np.int64), np.array(stops, np.int64), chunk)
    for i, (start, stop) in enumerate(zip(starts, stops)):
        mine = p.valid[i]
        index, at, to, extent = (v[i][mine].tolist() for v in (p.index, p.chunk_start, p.box_start, p.extent))
        assert index == list(range(start // chunk, (stop - 1) // chunk + 1)) if stop > start else index == []
        assert all(0 <= a and e >= 1 and a + e <= chunk for a, e in zip(at, extent))
        assert [k * chunk + a for k, a in zip(index, at)] == [start + b for b in to]  # where each piece is
        assert to == [sum(extent[:j]) for j in range(len(extent))] and sum(extent) == stop - start


@pytest.mark.parametrize("written", [True, False])
def test_zero_dimensional_arrays_are_planned_as_tables(tmp_path, written, grid):
    """A 0-d array is one chunk with an empty grid index (the compiled grid takes 1 to 32 axes: numpy plans
    it): one copy per crop, read from its one chunk file, as the reader's reference plans it."""
    paths = [str(tmp_path / f"{name}.zarr") for name in ("a", "b")]
    for path in paths:
        z = zarr.create_array(path, shape=(), chunks=(), dtype="int32", fill_value=-7)
        if written:
            z[()] = 42
    opener_cache = {}
    opener = lambda uri: opener_cache.setdefault(uri, stoker.open_array(uri))  # noqa: E731
    samples = [stoker.Sample(paths[0], []), stoker.Sample(paths[1], []), stoker.Sample(paths[0], [])]
    ref, got = _compare(samples, opener)
    assert got.n_chunks == 2 and got.chunk_index.shape == (2, 0) and got.copy_row.tolist() == [0, 2, 1]
    fills, reads = got.python_reads()
    assert not fills and [(fr.path, fr.chunk_ids) for fr in reads] == [(os.path.join(paths[0], "c"), (0,)),
                                                                     (os.path.join(paths[1], "c"), (1,))]
    assert plan_tables(0, [], opener).n_chunks == 0  # (no sample: nothing planned)


@pytest.mark.skipif(native.copy_rows is None, reason="the compiled engine is not built")
def test_copy_rows_refuses_strides_that_overlap_the_copies():
    """copy_rows places each copy by the batch's strides; strides under what the copies span (row 1 where row 0's
    elements are, or a crop's rows over each other) put copies onto each other's elements, inside the batch,
    where the engine's check of the batch's bounds cannot see it: refused. The batch's own strides are taken."""
    out = np.zeros((2, 4, 4), np.float32)  # two crops of 4 x 4, copied whole by one copy each
    src, row = np.zeros(2, np.int64), np.array([0, 1], np.int64)
    box, extent = np.zeros((2, 2), np.int64), np.full((2, 2), 4, np.int64)
    row_stride, *strides = (s // out.itemsize for s in out.strides)
    made = np.frombuffer(native.copy_rows(src, row, box, extent, row_stride, array("q", strides)), np.int64)
    assert made.reshape(2, -1)[:, native.CP_DST_OFFSET].tolist() == [0, 16]
    for bad_row_stride, bad_strides in ((8, strides), (15, strides), (row_stride, [2, 1]), (row_stride, [4, 0])):
        with pytest.raises(ValueError, match="overlap"):
            native.copy_rows(src, row, box, extent, bad_row_stride, array("q", bad_strides))
    # one row: its stride places nothing (numpy and torch may give a length-1 axis any stride)
    assert native.copy_rows(src[:1], row[:1], box[:1], extent[:1], 0, array("q", strides))


def _ctypes_copy(a: np.ndarray):
    """A ctypes array holding ``a`` (int64): its buffer gives no strides (NULL, as the buffer protocol lets a
    C-contiguous exporter give them), whatever a consumer asks for."""
    t = ctypes.c_int64
    for n in reversed(a.shape):
        t = t * int(n)
    made = t()
    ctypes.memmove(made, np.ascontiguousarray(a, np.int64).ctypes.data, a.size * 8)
    assert memoryview(made).c_contiguous and np.ctypeslib.as_array(made).tolist() == a.tolist()
    return made


@pytest.mark.skipif(native.copy_rows is None, reason="the compiled engine is not built")
def test_plan_rows_take_buffers_that_give_no_strides():
    """copy_rows and chunk_rows read their strided int64 arguments through the buffer's strides: a ctypes array
    exports none (NULL) and was read through that NULL pointer (a segfault). They are read as C-contiguous,
    and give what the same numpy arrays give."""
    out = np.zeros((2, 4, 4), np.float32)
    src, row = np.zeros(2, np.int64), np.array([0, 1], np.int64)
    box, extent = np.zeros((2, 2), np.int64), np.full((2, 2), 4, np.int64)
    row_stride, *strides = (s // out.itemsize for s in out.strides)
    want = native.copy_rows(src, row, box, extent, row_stride, np.array(strides, np.int64))
    got = native.copy_rows(*(_ctypes_copy(a) for a in (src, row, box, extent)), row_stride,
                           _ctypes_copy(np.array(strides, np.int64)))
    assert got == want
    rng = np.random.default_rng(7)
    info = rng.integers(0, 2**40, (2, native.N_INFO_COLS), dtype=np.int64)
    plan = rng.integers(0, 2**40, (3, native.N_PLAN_COLS), dtype=np.int64)
    plan[:, native.P_SOURCE] = [0, 1, 0]
    plan[:, native.P_FILE] = [0, -1, 1]
    cols = [np.ascontiguousarray(plan[:, k]) for k in range(native.N_PLAN_COLS)]
    eids = np.array([2, 0], np.int64)
    want = native.chunk_rows(info, *cols, eids, False)
    assert native.chunk_rows(_ctypes_copy(info), *(_ctypes_copy(c) for c in cols), _ctypes_copy(eids), False) == want


@pytest.mark.skipif(native.copy_rows is None, reason="the compiled engine is not built")
def test_chunk_rows_refuses_plan_columns_whose_rows_share_memory():
    """chunk_rows read its plan columns as views and, without eids, copied n rows of each: eight
    np.broadcast_to columns of 2**24 rows (8 bytes each) made a 1.5 GiB result, and a 3-row broadcast was
    taken silently, where copy_rows refuses such columns. Columns whose rows share memory are refused alike."""
    info = np.zeros((1, native.N_INFO_COLS), np.int64)
    for n in (3, 2**24):
        cols = [np.broadcast_to(np.int64(0), (n,)) for _ in range(native.N_PLAN_COLS)]
        with pytest.raises(ValueError, match="share memory"):
            native.chunk_rows(info, *cols, None, False)
    window = np.lib.stride_tricks.sliding_window_view(np.zeros(4, np.int64), 2)[:, 0]  # strided, apart: taken
    cols = [np.zeros(3, np.int64)] * (native.N_PLAN_COLS - 1) + [window]
    assert len(native.chunk_rows(info, *cols, None, False)) == 3 * native.N_CHUNK_COLS * 8


@pytest.mark.skipif(native.copy_rows is None, reason="the compiled engine is not built")
def test_a_stride_of_the_most_negative_value_is_refused_without_overflow():
    """copy_rows' columns: a stride of -2**63 on an axis of two rows was negated as a signed number (undefined
    behaviour); its magnitude is taken unsigned, and it is refused. The normal build (-fwrapv) refused it either
    way: the negation itself is caught by .ci/asan's UndefinedBehaviorSanitizer, which runs this file."""
    src = np.zeros(4, np.int64)
    col = np.lib.stride_tricks.as_strided(src, shape=(2,), strides=(-2**63,))
    row, box, ext = np.zeros(2, np.int64), np.zeros((2, 1), np.int64), np.ones((2, 1), np.int64)
    with pytest.raises(ValueError, match="share memory"):
        native.copy_rows(col, row, box, ext, 8, np.array([1], np.int64))
