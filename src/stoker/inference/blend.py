"""The arithmetic of blending tile predictions: windows, where a prediction lands, which regions it touches.

Pure numpy, no I/O. A tile's *output box* is its sample box less ``crop`` on every side that does not lie on
the array's border (no other tile covers a border margin, so it is kept):

>>> output_box([(0, 96), (40, 136)], crop=(20, 20), shape=(128, 256))
((0, 76), (60, 116))
"""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import numpy as np

BLENDS = ("none", "linear", "hann")

Box = tuple[tuple[int, int], ...]


def output_box(aabb: Sequence[Sequence[int]], crop: Sequence[int], shape: Sequence[int],
               padded: bool | Sequence[bool] = False) -> Box:
    """The part of a tile whose prediction is kept (see the module docstring). A ``padded`` tile (a sample
    with ``pad``, which may reach past the array) has its context beyond the border too: ``crop`` comes off
    every side, and what is left is clipped to the array. ``padded`` per axis: a grid padded on some axes
    only (``TileGrid(pad_axes=...)``), tiled on the others as without pad.

    >>> output_box([(-20, 76), (36, 132)], crop=(20, 20), shape=(128, 120), padded=True)
    ((0, 56), (56, 112))
    """
    each = [bool(padded)] * len(aabb) if isinstance(padded, bool) else list(padded)
    return tuple((max(a + c, 0), min(b - c, n)) if p else (a if a <= 0 else a + c, b if b >= n else b - c)
                 for (a, b), c, n, p in zip(aabb, crop, shape, each))


def window(blend: str, length: int) -> np.ndarray:
    """One axis of a blend's weights over a tile of ``length`` (float64, every weight > 0).

    ``linear``: a tent, 1 at the ends rising to the middle; ``hann``: a Hann window without its zero ends.
    """
    k = np.arange(length, dtype=np.float64)
    if blend == "linear":
        return np.minimum(k + 1, length - k)
    if blend == "hann":
        return 0.5 - 0.5 * np.cos(2 * np.pi * (k + 1) / (length + 1))
    return np.ones(length)


def weights(blend: str, tile: Sequence[int]) -> np.ndarray:
    """The weights of a whole tile: the outer product of the axes' windows."""
    return weights_over([window(blend, n) for n in tile])


def weights_over(windows: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """The weights over a box of a tile from each axis's window over it (``window(blend, n)[a:b]``): their
    outer product, each weight the same float64 products in the same order as :func:`weights` makes them, so
    ``weights_over([window(blend, n)[a:b] for ...]) == weights(blend, tile)[a:b, ...]`` bit for bit. Built
    only where numpy blends a part (the compiled blend makes each weight from the windows itself), so a writer
    never holds a whole tile's weights (a 256^3 tile: 128 MiB of float64); ``out``: where the last product
    goes (recycled memory of the box's shape), else a new array.

    >>> win = window("hann", 4)
    >>> bool((weights_over([win[1:3], win]) == weights("hann", (4, 4))[1:3]).all())
    True
    """
    w = np.ones((), dtype=np.float64)
    for k, win in enumerate(windows):
        w = np.multiply.outer(w, win, out=out if k == len(windows) - 1 else None)
    if out is not None and not windows:  # zero axes: the weight of a point is 1
        out[...] = w
        return out
    return w


def regions_of(box: Box, unit: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Indices of the write regions (a grid of ``unit``) that ``box`` touches."""
    ranges = [range(a // u, (b - 1) // u + 1) for (a, b), u in zip(box, unit)]
    return itertools.product(*ranges)


def region_box(index: Sequence[int], unit: Sequence[int], shape: Sequence[int]) -> Box:
    """The box of region ``index``, clipped to the array."""
    return tuple((i * u, min((i + 1) * u, n)) for i, u, n in zip(index, unit, shape))


def intersect(a: Box, b: Box) -> Box:
    return tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))


def subtract(box: Box, others: Sequence[Box]) -> list[Box]:
    """``box`` less every box of ``others``, as disjoint boxes (none empty).

    >>> subtract(((0, 4), (0, 4)), [((2, 6), (0, 4))])
    [((0, 2), (0, 4))]
    """
    pieces = [box]
    for o in others:
        left = []
        for p in pieces:
            if any(max(a, c) >= min(b, d) for (a, b), (c, d) in zip(p, o)):
                left.append(p)  # apart
                continue
            rest = list(p)
            for k, ((a, b), (c, d)) in enumerate(zip(p, o)):  # the slabs below and above o on each axis
                if a < c:
                    left.append(tuple(rest[:k]) + ((a, c),) + tuple(rest[k + 1:]))
                if d < b:
                    left.append(tuple(rest[:k]) + ((d, b),) + tuple(rest[k + 1:]))
                rest[k] = (max(a, c), min(b, d))
        pieces = left
    return pieces


def coverage(boxes: Sequence[Box]) -> tuple[list[tuple[int, Box]], list[Box]]:
    """The union of ``boxes`` as disjoint pieces: those covered by one box only (with that box's index),
    and those covered by two or more.

    A weighted blend of one prediction is that prediction, so only the second kind needs weights:

    >>> coverage([((0, 4), (0, 4)), ((2, 6), (0, 4))])
    ([(0, ((0, 2), (0, 4))), (1, ((4, 6), (0, 4)))], [((2, 4), (0, 4))])
    """
    once = [(i, piece) for i, b in enumerate(boxes)
            for piece in subtract(b, [o for j, o in enumerate(boxes) if j != i])]
    several: list[Box] = []
    for i, j in itertools.combinations(range(len(boxes)), 2):
        both = intersect(boxes[i], boxes[j])
        if all(a < b for a, b in both):
            several += subtract(both, several)
    return once, several


def holes(tiles: Sequence[tuple[int, int]], kept: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The voxels ``0 .. n - 1`` of one axis that some interval of ``tiles`` covers and none of ``kept`` does, as
    disjoint intervals in order: where tiles cropped to their kept boxes leave voxels no tile writes.

    >>> holes([(0, 6), (4, 10), (6, 12)], [(0, 4), (6, 8), (8, 12)], 12)
    [(4, 6)]
    """
    def union(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        merged: list[tuple[int, int]] = []
        for a, b in sorted((max(a, 0), min(b, n)) for a, b in intervals):
            if b <= a:
                continue
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged

    written = union(kept)
    return [piece[0] for t in union(tiles) for piece in subtract((t,), [(k,) for k in written])]


def local(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` as slices relative to ``origin``'s start."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))
