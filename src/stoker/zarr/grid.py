"""Chunk geometry: which chunks a box touches, and where each overlaps the box.

All of it is pure arithmetic on shapes, shared by the reference reader and the
batch planner::

    >>> [c.index for c in chunk_intersections(((2, 6), (0, 3)), chunk_shape=(4, 4))]
    [(0, 0), (1, 0)]

Each :class:`ChunkIntersection` holds the chunk's grid index, the selection
inside the chunk (``chunk_sel``) and the matching selection inside the box
(``box_sel``), so ``crop[box_sel] = chunk[chunk_sel]`` assembles a crop.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from .box import Box


@dataclass(frozen=True)
class ChunkKeyEncoding:
    """How a chunk's grid index becomes a store key (``c/0/1`` or ``0.1``)."""

    prefix: str  # "c" for v3 default encoding, "" otherwise
    separator: str  # "/" or "."

    def key(self, index: Sequence[int]) -> str:
        if self.prefix:
            return self.separator.join((self.prefix, *map(str, index)))
        return self.separator.join(map(str, index)) if index else "0"


class ChunkIntersection(NamedTuple):  # a tuple: made per chunk per crop, so cheap to build matters
    index: tuple[int, ...]
    chunk_sel: tuple[slice, ...]
    box_sel: tuple[slice, ...]


class AxisPieces(NamedTuple):
    """The pieces ``n`` ranges of one axis split into (see :func:`axis_pieces`): ``(n, k)`` arrays, ``k`` the
    most pieces any range has; ``valid[i, j]`` says whether range ``i`` has a piece ``j``."""

    valid: np.ndarray
    index: np.ndarray  # the chunk's index along the axis
    chunk_start: np.ndarray  # where the piece starts in the chunk
    box_start: np.ndarray  # where it starts in the range
    extent: np.ndarray


def _count(start, stop, chunk):
    """How many chunks ``[start, stop)`` touches along an axis cut every ``chunk`` elements (none when empty):
    on Python ints or numpy arrays alike."""
    return ((stop - 1) // chunk - start // chunk + 1) * (stop > start)


def _piece(start, stop, chunk, k, maximum, minimum):
    """``(chunk index, start in the chunk, start in the range, extent)`` of the ``k``-th piece of ``[start,
    stop)``: the grid's arithmetic, written once for Python ints (``max``, ``min``) and numpy arrays
    (``np.maximum``, ``np.minimum``). The extent is computed without the chunk's end (``index * chunk +
    chunk``), which may pass int64 at a grid's edge."""
    index = start // chunk + k
    lo = maximum(start, index * chunk)
    chunk_start = lo - index * chunk
    return index, chunk_start, lo - start, minimum(stop - lo, chunk - chunk_start)


def axis_pieces(start: np.ndarray, stop: np.ndarray, chunk: np.ndarray | int) -> AxisPieces:
    """The pieces ``[start, stop)`` splits into along an axis cut every ``chunk`` elements, for ``n`` ranges at
    once (int64 arrays of ``n``; ``chunk`` one per range or one for all), in order along the axis. The chunk
    grid's one reference: the reader's geometry (:func:`chunk_intersections`, one box on Python ints) and the
    planner's numpy grid are built on it, and the compiled grid (csrc/grid.c) is tested against it.

    >>> p = axis_pieces(np.array([2, 5]), np.array([9, 7]), 4)
    >>> p.index[p.valid].tolist(), p.chunk_start[p.valid].tolist(), p.extent[p.valid].tolist()
    ([0, 1, 2, 1], [2, 0, 0, 1], [2, 4, 1, 2])
    """
    start, stop = np.asarray(start, np.int64), np.asarray(stop, np.int64)
    chunk = np.broadcast_to(np.asarray(chunk, np.int64), start.shape)
    count = _count(start, stop, chunk)
    k = np.arange(int(count.max()) if count.size else 0)
    index, chunk_start, box_start, extent = _piece(start[:, None], stop[:, None], chunk[:, None], k, np.maximum,
                                                   np.minimum)
    return AxisPieces(k < count[:, None], index, chunk_start, box_start, extent)


class BoxPieces(NamedTuple):
    """Every piece of ``n`` boxes (see :func:`box_pieces`), one row each: the box it is of, and per axis its
    chunk's grid index, its start in the chunk and in the box, and its extent (``(m, ndim)`` arrays)."""

    box: np.ndarray
    index: np.ndarray
    chunk_start: np.ndarray
    box_start: np.ndarray
    extent: np.ndarray


def box_pieces(starts: np.ndarray, stops: np.ndarray, chunk_shapes: np.ndarray) -> BoxPieces:
    """The pieces ``n`` boxes (``starts``, ``stops``: ``(n, ndim)``; ``chunk_shapes``: ``(n, ndim)`` or one
    ``(ndim,)`` for all) split into over their chunk grids: box after box, each box's in C order of chunk
    index (its chunks' every combination of the :func:`axis_pieces` of its axes). A box of a 0-d array
    (``ndim`` 0) is one piece with an empty index.

    >>> p = box_pieces(np.array([[2, 0]]), np.array([[6, 3]]), np.array([4, 4]))
    >>> p.index.tolist(), p.chunk_start.tolist(), p.box_start.tolist(), p.extent.tolist()
    ([[0, 0], [1, 0]], [[2, 0], [0, 0]], [[0, 0], [2, 0]], [[2, 3], [2, 3]])
    """
    starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    n, ndim = starts.shape
    chunk_shapes = np.broadcast_to(np.asarray(chunk_shapes, np.int64), (n, ndim))
    per_axis = [axis_pieces(starts[:, a], stops[:, a], chunk_shapes[:, a]) for a in range(ndim)]
    # box i's piece (j0, j1, ...) exists where each axis has its piece: the axes crossed by broadcasting
    valid = np.ones((n, *(p.valid.shape[1] for p in per_axis)), bool)
    for a, p in enumerate(per_axis):
        valid &= p.valid.reshape(n, *(p.valid.shape[1] if b == a else 1 for b in range(ndim)))
    box, *ks = np.nonzero(valid)
    columns = [np.empty((len(box), ndim), np.int64) for _ in range(4)]
    for a, p in enumerate(per_axis):
        for column, values in zip(columns, (p.index, p.chunk_start, p.box_start, p.extent)):
            column[:, a] = values[box, ks[a]]
    return BoxPieces(box, *columns)


def chunk_intersections(box: Box, chunk_shape: Sequence[int]) -> Iterator[ChunkIntersection]:
    """Every chunk the box touches (C order of chunk indices) with the overlap selections: the pieces
    :func:`box_pieces` gives one box, on Python ints (numpy's calls would cost ten times the arithmetic for the
    few pieces of one box)."""
    per_axis = []
    for (start, stop), chunk in zip(box, chunk_shape):
        pieces = []
        for k in range(_count(start, stop, chunk)):
            index, at, to, extent = _piece(start, stop, chunk, k, max, min)
            pieces.append((index, slice(at, at + extent), slice(to, to + extent)))
        per_axis.append(pieces)
    for combo in itertools.product(*per_axis):
        index, chunk_sel, box_sel = zip(*combo) if combo else ((), (), ())  # () for a 0-d array
        yield ChunkIntersection(index, chunk_sel, box_sel)


def c_order_span(shape: Sequence[int], itemsize: int, sels: Iterable[tuple[slice, ...]]) -> tuple[int, int]:
    """``(start, stop)``: the smallest C-order byte range of an array of ``shape`` covering every selection."""
    strides = c_strides(tuple(shape), itemsize)
    start = stop = None
    for sel in sels:
        first = last = 0
        for s, st in zip(sel, strides):
            first += s.start * st
            last += (s.stop - 1) * st
        start = first if start is None or first < start else start
        stop = last if stop is None or last > stop else stop
    if start is None:
        raise ValueError("c_order_span needs at least one selection")
    return start, stop + itemsize


@functools.lru_cache(maxsize=1024)
def c_strides(shape: tuple[int, ...], itemsize: int = 1) -> tuple[int, ...]:
    """Strides of a C-ordered array of ``shape``: in bytes for items of ``itemsize`` bytes (default 1: in elements)."""
    strides = [itemsize] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    return tuple(strides)


def grid_shape(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """Number of chunks along each axis (edge chunks count whole)."""
    return tuple(-(-s // c) for s, c in zip(shape, chunk_shape))


def chunks_touched(box: Box, chunk_shape: Sequence[int]) -> int:
    """How many chunks a box touches, without enumerating them."""
    n = 1
    for (start, stop), c in zip(box, chunk_shape):
        n *= 0 if stop <= start else (stop - 1) // c - start // c + 1
    return n
