"""``Mask``: draw only anchors whose named field's box covers enough of a mask's nonzero voxels.

>>> mask = stoker.Mask("/data/foreground.zarr", min_fraction=0.25, field="labels", scale=4)   # 4x coarser
>>> src = stoker.RandomCrops({"raw": raw, "labels": labels}, seed=0, mask=mask)

**What qualifies, exactly.** The coverage of an anchor is the number of nonzero mask voxels (a missing value
counts as zero: NaN, or a stored value the array's CF attributes ``_FillValue`` or ``missing_value`` name, as
xarray masks them) inside the named field's box, over the box's volume, both counted in mask voxels (the
part of a box past the mask's end counts as zero). With a mask, anchors lie on multiples of the mask's scale
as well as of the fields' (their least common multiple, per axis), and the masked field's offset and extent
(shape times scale) must be multiples of the mask's scale: so its box covers whole mask voxels, and the
coverage is an exact count, with no fractional overlap. The positions between (finer than one mask voxel) are
not drawn: a finer mask (a smaller ``scale``) gives finer positions. An anchor qualifies iff ``count / volume
>= min_fraction``.

**How, in bounded memory.** The mask is read with stoker's reader in slabs along its first axis (about
:data:`SLAB_VOXELS` voxels each). Each plane's box sums at every anchor's position are differences of its
cumulative sums; along the first axis a running sum of those planes is kept, and a box's count is the
running sum at its end less the one at its start, so only the planes of the boxes open at once are held.
What is kept is the sorted flat indices of the qualifying anchors in the volume's anchor lattice (4 bytes
each below 2**32 anchors): memory grows with the anchors that qualify and one plane of the mask, never
with the full-resolution volume. Anchors are then drawn uniformly among those indices.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..checks import integer, integers
from ..errors import InvalidArgument

if TYPE_CHECKING:
    from ..reader.array import ArrayReader

#: mask voxels read per slab (at least one plane)
SLAB_VOXELS = 1 << 20


class Mask:
    """Draw only anchors whose field ``field``'s box covers at least ``min_fraction`` of nonzero voxels of the
    mask array at ``uri`` (read at its own resolution: ``scale`` reference voxels per mask voxel, by default
    from its OME-Zarr metadata, else 1). See the module docstring for what qualifies exactly.

    >>> stoker.Mask("/data/labels.ome.zarr/2", min_fraction=0.25, field="labels")
    Mask('/data/labels.ome.zarr/2', min_fraction=0.25, field='labels')
    """

    def __init__(self, uri: str | os.PathLike, min_fraction: float = 0.25, field: str = "labels",
                 scale: int | Sequence[int] | None = None) -> None:
        if not isinstance(uri, (str, os.PathLike)):
            raise InvalidArgument(f"Mask uri must be an array URI, got {uri!r}")
        self.uri = os.fspath(uri)
        self.min_fraction = float(min_fraction)
        if not 0 < self.min_fraction <= 1:
            raise InvalidArgument(f"Mask min_fraction must be in (0, 1], got {min_fraction!r}", knob="min_fraction")
        if not isinstance(field, str) or not field:
            raise InvalidArgument(f"Mask field must name a field of the sampler, got {field!r}", knob="field")
        self.field = field
        if isinstance(scale, bool) or not (scale is None or isinstance(scale, (numbers.Integral, list, tuple))):
            raise InvalidArgument(f"Mask scale must be an int >= 1 or one per axis, got {scale!r}", knob="scale")
        self.scale: int | tuple[int, ...] | None = None
        if isinstance(scale, numbers.Integral):  # numpy's integers too
            self.scale = integer("Mask scale (reference voxels per mask voxel)", scale, 1, knob="scale")
        elif scale is not None:  # one per axis: a fraction is refused, not truncated into another scale
            self.scale = integers("Mask scale (reference voxels per mask voxel)", scale, 1, knob="scale")

    def plain(self) -> dict:
        """The mask as JSON data (part of a sampler's identity)."""
        scale = list(self.scale) if isinstance(self.scale, tuple) else self.scale
        return {"uri": self.uri, "min_fraction": self.min_fraction, "field": self.field, "scale": scale}

    def __repr__(self) -> str:
        scale = "" if self.scale is None else f", scale={self.scale}"
        return f"Mask({self.uri!r}, min_fraction={self.min_fraction}, field={self.field!r}{scale})"


def check_alignment(mask: Mask, name: str, field: Any, field_scale: Sequence[int], mask_scale: Sequence[int],
                    who: str) -> None:
    """InvalidArgument, saying what to change, unless field ``name``'s offset and extent (in reference
    voxels) are multiples of the mask's scale (so its boxes cover whole mask voxels)."""
    for axis, (o, c, s, m) in enumerate(zip(field.offset, field.shape, field_scale, mask_scale)):
        if o % m or (c * s) % m:
            raise InvalidArgument(
                f"{who}: mask {mask.uri} has scale {m} on axis {axis}, and field {name!r}'s box (offset {o}, extent "
                f"{c * s} reference voxels) does not cover whole mask voxels there; make its offset and its shape "
                f"times scale multiples of {m}, or pass a mask of a finer scale", uri=mask.uri, field=name, axis=axis)


def covering_anchors(volume: Any, mask: Mask, mask_scale: Sequence[int],
                     reader: "ArrayReader") -> tuple[np.ndarray, float]:
    """``(sorted flat indices of the qualifying anchors in the lattice of ``volume`` (a
    :class:`~stoker.sampling.field.Volume`), best coverage found)``."""
    name = mask.field
    f, scale = volume.fields[name], volume.scales[name]
    ndim = len(volume.counts)
    if reader.ndim != ndim:
        raise InvalidArgument(f"mask {mask.uri} has {reader.ndim} axes, field {name!r} {ndim}; a mask is an array of "
                              "the volume's axes", uri=mask.uri)
    width = [c * s // m for c, s, m in zip(f.shape, scale, mask_scale)]
    cells = math.prod(width)
    shape = reader.shape
    first = [((volume.first[d] + np.arange(volume.counts[d], dtype=np.int64)) * volume.step[d] + f.offset[d])
             // mask_scale[d] for d in range(ndim)]  # each anchor's box start, in mask voxels (exact: aligned)
    # a box past the mask's end counts the part outside as zero: clipped, its sum covers what is inside
    starts = [np.clip(b, 0, shape[d]) for d, b in enumerate(first)]
    ends = [np.clip(b + width[d], 0, shape[d]) for d, b in enumerate(first)]
    per_plane = math.prod(volume.counts[1:])
    dtype = np.uint32 if volume.n_anchors < 2**32 else np.int64
    found: list[np.ndarray] = []
    best = 0
    running = np.zeros(volume.counts[1:], dtype=np.int64)
    opened: dict[int, np.ndarray] = {}  # first-axis anchor -> the running sum where its box starts
    k_start = k_end = 0
    n0 = volume.counts[0]

    def boundary(z: int) -> None:
        nonlocal k_start, k_end, best
        while k_start < n0 and starts[0][k_start] == z:
            opened[k_start] = running
            k_start += 1
        while k_end < n0 and ends[0][k_end] == z:
            count = running - opened.pop(k_end)
            best = max(best, int(count.max()))
            hits = np.flatnonzero(count / cells >= mask.min_fraction)
            if hits.size:
                found.append((k_end * per_plane + hits).astype(dtype))
            k_end += 1

    z_lo, z_hi = int(starts[0][0]), int(ends[0][-1])
    plane = math.prod(shape[1:])
    depth = max(1, SLAB_VOXELS // max(1, plane))
    # the sums are worked out a few planes at a time: their cumulative sums (int32 while a plane's count
    # fits) are the largest temporaries, a quarter of a slab at most
    step = max(1, depth // 4)
    total = np.int32 if plane < 2**31 else np.int64
    missing = _missing_values(reader)
    z = z_lo
    while z < z_hi:
        stop = min(z_hi, z + depth)
        slab = reader.read([(z, stop)] + [(0, s) for s in shape[1:]])
        for part in range(0, stop - z, step):
            sums = _box_sums(_foreground(slab[part:part + step], missing), starts, ends, total)
            for i in range(sums.shape[0]):
                boundary(z + part + i)
                running = running + sums[i]
        del slab
        z = stop
    boundary(z_hi)
    index = np.concatenate(found) if found else np.zeros(0, dtype=dtype)
    return index, best / cells


def _missing_values(reader: "ArrayReader") -> np.ndarray | None:
    """The stored values the mask's CF attributes mark missing (``_FillValue``, ``missing_value``: xarray reads
    them as NaN), in the mask's dtype; None where it has none (or a value its dtype cannot hold)."""
    from ..errors import UnsupportedFormat
    from ..reader.coords import coding

    try:
        code = coding(reader)
    except UnsupportedFormat:  # _Unsigned: the other signedness, which changes no value's being nonzero
        return _unsigned_missing(reader)  # but its fills still mark values missing
    if code is None or not code.fills:
        return None
    if reader.dtype.kind in "iu":  # ints it holds (coding_of masks no other): exact, 2**64 - 1 too
        return np.array([int(f) for f in code.fills], dtype=reader.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        fills = np.asarray(code.fills, dtype=np.float64)
        kept = fills[np.isfinite(fills)] if reader.dtype.kind == "b" else fills
        return kept.astype(reader.dtype) if kept.size else None  # compared as the CF decode compares them


def _unsigned_missing(reader: "ArrayReader") -> np.ndarray | None:
    """:func:`_missing_values` of a mask whose ``_Unsigned`` attribute reads its integers in the other signedness:
    xarray masks the values with a fill's bits (``_FillValue: -1`` of int8 read as uint8: 255), so each fill,
    given in either signedness, is taken modulo 2**bits into the mask's dtype."""
    from ..reader.coords import attributes, stored_fill
    from ..zarr.cf import check_integer_fill, coding_of

    attrs = {k: v for k, v in attributes(reader).items() if k != "_Unsigned"}
    code = coding_of(attrs, np.dtype(np.float64), reader.zarr_format, stored_fill(reader), reader.uri)
    bits = 8 * reader.dtype.itemsize
    fills = code.fills if code is not None else ()
    for f in fills:  # a fractional one refused, as the CF decode refuses it for an integer array
        check_integer_fill(f, reader.dtype, reader.uri)
    kept = [int(f) % (1 << bits) for f in fills if float(f).is_integer() and -(1 << (bits - 1)) <= f < (1 << bits)]
    return np.array(kept, dtype=np.uint64).astype(reader.dtype) if kept else None  # wraps: the same bits


def _foreground(values: np.ndarray, missing: np.ndarray | None = None) -> np.ndarray:
    """Which mask voxels count: nonzero, and not missing: not NaN (as xarray writes a float mask's missing
    values, and as its unwritten chunks read) nor one of ``missing`` (the stored values its CF attributes name)."""
    nonzero = values != 0
    if values.dtype.kind in "fc":
        nonzero &= ~np.isnan(values)
    if missing is not None:
        nonzero &= ~np.isin(values, missing)
    return nonzero


def _box_sums(nonzero: np.ndarray, starts: list[np.ndarray], ends: list[np.ndarray], total: Any) -> np.ndarray:
    """Per plane of ``nonzero`` (axis 0), the counts in every anchor's box over the other axes."""
    x: Any = nonzero
    for axis in range(1, nonzero.ndim):
        cum = np.cumsum(x, axis=axis, dtype=total)
        pad = [(0, 0)] * cum.ndim
        pad[axis] = (1, 0)
        cum = np.pad(cum, pad)  # cum[i]: the voxels before i
        x = np.take(cum, ends[axis], axis=axis) - np.take(cum, starts[axis], axis=axis)
    return np.asarray(x, dtype=np.int64)
