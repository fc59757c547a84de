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

import itertools
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from ..box import Box


@dataclass(frozen=True)
class ChunkKeyEncoding:
    """How a chunk's grid index becomes a store key (``c/0/1`` or ``0.1``)."""

    prefix: str  # "c" for v3 default encoding, "" otherwise
    separator: str  # "/" or "."

    def key(self, index: Sequence[int]) -> str:
        if self.prefix:
            return self.separator.join((self.prefix, *map(str, index)))
        return self.separator.join(map(str, index)) if index else "0"


@dataclass(frozen=True)
class ChunkIntersection:
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
        yield ChunkIntersection(
            index=tuple(p[0] for p in combo),
            chunk_sel=tuple(p[1] for p in combo),
            box_sel=tuple(p[2] for p in combo),
        )


def c_order_span(shape: Sequence[int], itemsize: int, sels: Iterable[tuple[slice, ...]]) -> tuple[int, int]:
    """``(start, stop)``: the smallest C-order byte range of an array of ``shape`` covering every selection."""
    strides = [itemsize] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    sels = list(sels)
    start = min(sum(s.start * st for s, st in zip(sel, strides)) for sel in sels)
    stop = max(sum((s.stop - 1) * st for s, st in zip(sel, strides)) for sel in sels) + itemsize
    return start, stop


def grid_shape(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """Number of chunks along each axis (edge chunks count whole)."""
    return tuple(-(-s // c) for s, c in zip(shape, chunk_shape))


def chunks_touched(box: Box, chunk_shape: Sequence[int]) -> int:
    """How many chunks a box touches, without enumerating them."""
    n = 1
    for (start, stop), c in zip(box, chunk_shape):
        n *= 0 if stop <= start else (stop - 1) // c - start // c + 1
    return n
