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


def _axis_pieces(start: int, stop: int, chunk: int) -> list[tuple[int, slice, slice]]:
    """Per axis: (chunk index, selection in the chunk, selection in the box)."""
    if stop <= start:
        return []
    pieces = []
    for ci in range(start // chunk, (stop - 1) // chunk + 1):
        lo = max(start, ci * chunk)
        hi = min(stop, (ci + 1) * chunk)
        pieces.append((ci, slice(lo - ci * chunk, hi - ci * chunk), slice(lo - start, hi - start)))
    return pieces


def chunk_intersections(box: Box, chunk_shape: Sequence[int]) -> Iterator[ChunkIntersection]:
    """Every chunk the box touches (C order of chunk indices) with the overlap selections."""
    chunk_shape = tuple(chunk_shape)
    per_axis = [_axis_pieces(start, stop, c) for (start, stop), c in zip(box, chunk_shape)]
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
