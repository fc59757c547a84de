"""Boxes, the chunk grid and chunk keys: parsing, bounds, which chunks a box touches, keys as zarr writes them."""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding, V2ChunkKeyEncoding

import stoker
from stoker.zarr.box import box_shape, check_in_bounds, parse_box
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


@pytest.mark.parametrize("box", [[(True, 3)], [(0, True)], [(False, 2), (0, 2)], [slice(False, 2)],
                                 [(np.True_, 2)]])
def test_booleans_are_not_coordinates(box):
    """True is an int to Python; as a box coordinate it is a mistake (a mask, a flag), not 1."""
    with pytest.raises(stoker.InvalidArgument, match="must be an integer, got"):
        stoker.Sample("/data/a.zarr", box)


def test_a_box_that_is_not_one_names_what_a_box_is(tmp_path):
    """read(None) said "box has 1 axes": None, Ellipsis or a float is no box of any rank."""
    uri = str(tmp_path / "a.zarr")
    zarr.create_array(uri, shape=(4, 6), chunks=(2, 3), dtype="u1")[:] = 1
    reader = stoker.open_array(uri)
    for box in (None, Ellipsis, 2.5):
        with pytest.raises(stoker.InvalidArgument, match=r"a box is one \(start, stop\) pair or slice per axis") as e:
            reader.read(box)
        assert not isinstance(e.value, stoker.RankMismatch)
        assert "the whole array is [(0, 4), (0, 6)]" in str(e.value) and uri in str(e.value)
    with pytest.raises(stoker.InvalidArgument, match="a box is one"):
        stoker.Sample(uri, None)
    assert reader.read(np.s_[0:2, 0:3]).sum() == 6  # boxes still read


def test_plain_pairs_parse_as_the_general_path_does():
    """Boxes of (start, stop) int pairs take parse_box's fast path; slices take the general one: the same box,
    and the same refusals (a bool, a float, a negative start without pad, stop before start, a pair of 3)."""
    import random

    from stoker.errors import InvalidArgument
    from stoker.zarr.box import parse_box

    rng = random.Random(0)
    for _ in range(500):
        rank = rng.randint(1, 4)
        neg = rng.random() < 0.5
        pairs = []
        for _ in range(rank):
            a = rng.randint(-5 if neg else 0, 20)
            pairs.append((a, a + rng.randint(0, 9)))
        general = parse_box(tuple(slice(a, b) for a, b in pairs), allow_negative=neg)
        for spelled in (pairs, tuple(pairs), [list(p) for p in pairs]):
            assert parse_box(spelled, allow_negative=neg) == general
    for bad in ([(True, 3)], [(0, 2.0)], [(-1, 3)], [(3, 2)], [(0, 1, 2)], [(0, 2), 5]):
        with pytest.raises(InvalidArgument):  # the fast path leaves them to the general one, which refuses
            parse_box(bad)
    assert parse_box([(-1, 3)], allow_negative=True) == ((-1, 3),)
