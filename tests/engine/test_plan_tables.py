"""The flat planner (engine/planning/tables.py) against the reference planner (plan_batch): on random batches of random
crops over arrays with edge chunks, shards (missing ones, empty inner chunks, index at either end), duplicates
across samples and several arrays per batch, both must plan the same chunks, copies, spans and locations, and
raise the same errors; and the flat planner's Python work must not grow with the number of chunks."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import BytesCodec, ShardingCodec, ZstdCodec

import stoker
from stoker.engine.cpu import native
from stoker.engine.planning.plan import plan_batch
from stoker.engine.planning.tables import plan_tables
from stoker.zarr.grid import c_strides

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


def _compare(samples, opener, cold=()):
    """plan_batch against plan_tables on the same readers; ``cold``: the arrays (by name) whose shard indexes
    are dropped before plan_tables plans, so it reads them itself (plan_batch cached them all)."""
    ref = plan_batch(0, samples, opener)
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
def test_flat_plan_matches_plan_batch(arrays, data):
    batch = data.draw(batches(sorted(arrays)))
    opener_cache = {}
    opener = lambda uri: opener_cache.setdefault(uri, stoker.open_array(uri))  # noqa: E731
    cold = data.draw(st.sets(st.sampled_from(sorted(arrays))))  # their indexes read by plan_tables
    _compare([stoker.Sample(arrays[name], box) for name, box in batch], opener, {arrays[name] for name in cold})


def test_flat_plan_fills_and_locates_like_plan_batch(arrays):
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


def test_flat_plan_raises_what_plan_batch_raises(arrays, tmp_path):
    opener = stoker.open_array
    plain = arrays["plain"]
    flat2d = str(tmp_path / "flat.zarr")  # two axes: a three-axis box is a rank mismatch
    zarr.create_array(flat2d, shape=(8, 8), chunks=(4, 4), dtype="uint16")[...] = 1
    for samples, error in [
        ([stoker.Sample(plain, [(0, 4), (0, 4), (15, 18)])], stoker.OutOfBounds),
        ([stoker.Sample(str(tmp_path / "none.zarr"), [(0, 4), (0, 4), (0, 4)])], stoker.NotFound),
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
            plan_batch(0, samples, opener)
        with pytest.raises(error) as got:
            plan_tables(0, samples, opener)
        assert str(got.value) == str(ref.value)


def test_flat_plan_raises_for_the_first_damaged_shard_in_chunk_order(tmp_path):
    """Two damaged shards in one batch: the error is the one plan_batch meets first, whichever shard the
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
            plan_batch(0, samples, stoker.open_array)
        with pytest.raises(stoker.DecodeError) as got:
            plan_tables(0, samples, stoker.open_array)
        assert str(got.value) == str(ref.value) and repr(key) in str(got.value)


def test_shard_indexes_gathered_a_table_at_a_time_match(arrays, monkeypatch, grid):
    """Shards whose indexes are too large to join are gathered one table at a time (numpy, without the
    extension): the same plan."""
    from stoker.engine.planning import tables
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
    one batch: plan_tables raises plan_batch's error, the first chunk's in chunk order, with the index
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
                plan_batch(0, samples, lambda uri: reader)
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
    same number of Python calls for both; plan_batch makes more for the larger one."""
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
    reference = [_python_calls(lambda s=s: plan_batch(0, s, opener)) for s in (small, large)]
    assert reference[1] > 10 * reference[0]  # what the flat planner is for
