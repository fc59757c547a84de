"""The weighted mean of tile predictions where they overlap, in one pass over the voxels (``csrc/blend.c``).

numpy's blend of an overlap makes a float64 product, a sum and a sum of weights per voxel, each zeroed,
written and read again; the compiled ``blend_mean`` keeps a row's sums in scratch of the row's length and makes
each weight from the windows of the axes (:func:`~.blend.weights` is their outer product), with numpy's
operations in numpy's order, so the result is the same bit for bit (``tests/inference/test_weighted.py``). Float
outputs and float parts only; anything else (or no compiled engine) is left to the caller's numpy.

>>> out = np.empty((8, 8), np.float32)
>>> mean_into(out, [(a, (0, 0), (wy, wx)), (b, (0, 4), (wy, wx2))], lead=0)   # a: (8, 8); b: (8, 4)
True
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..engine.cpu import native

#: ``csrc/blend.c``'s ``blend_mean``, or None without the compiled engine (then :func:`mean_into` says False)
native_mean = native.blend_mean

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

#: the most axes ``blend_mean`` takes, the lanes axis included (``csrc/blend.c``'s ``BLEND_MAXD``): 7 spatial axes
MAX_AXES = 8

# a part: its values (lanes first, as the output), its start in the output on each spatial axis, and the window
# of each spatial axis over its extent (float64; its weights are their outer product)
Part = tuple[np.ndarray, Sequence[int], Sequence[np.ndarray]]


def lanes(x: np.ndarray, lead: int) -> np.ndarray | None:
    """``x`` (``lead`` channel axes, then the spatial ones) as a view with one lanes axis first, or None when
    that needs a copy (two or more channel axes)."""
    if lead == 0:
        return x[None]
    return x if lead == 1 else None


def mean_into(out: np.ndarray, parts: Sequence[Part], lead: int = 1) -> bool:
    """Blend ``parts`` (in the order they are to be summed) into ``out`` (``lead`` channel axes first, 0 or 1,
    the parts' as well): a voxel several parts cover gets ``sum(w * v) / sum(w)`` in float64, rounded once to
    ``out``'s dtype; one part, its value cast as ``astype``; none, untouched. False (``out`` untouched) where
    this is left to numpy: no compiled engine, more channel axes, more than ``MAX_AXES - 1`` spatial axes, or
    an output or a part that is not float32 or float64, or whose elements are not aligned (an offset into a
    buffer, a packed record's field: C reads them in place)."""
    view = lanes(out, lead)
    if native_mean is None or view is None or view.ndim > MAX_AXES or any(
            a.dtype not in FLOATS or not a.flags.aligned for a in (out, *(v for v, _, _ in parts))):
        return False
    native_mean(view, [(lanes(v, lead), tuple(int(o) for o in offsets), tuple(windows))
                       for v, offsets, windows in parts])
    return True


__all__ = ["FLOATS", "MAX_AXES", "Part", "lanes", "mean_into", "native_mean"]
