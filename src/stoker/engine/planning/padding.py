"""Padded boxes (``Sample(..., pad=...)``): what the planner reads of a box past its array, and how the rest of
the batch slot is filled once the chunks are placed.

Per axis, every position of a padded box maps to a voxel of the array or to a constant (:func:`axis_map`,
numpy.pad's modes exactly: ``"edge"`` the nearest border voxel, ``"reflect"`` the mirror image without
repeating the border voxel, repeated for a box longer than the array, the border voxel itself for an axis
of length 1; ``"zero"`` and ``"fill"`` the constant). The voxels a crop's maps reach form one box, the *read
box* (never larger than the crop: consecutive positions map to consecutive or equal voxels), which the
planner reads like any crop, placed in the crop's slot where it lies in the box when it fits there (always
for ``"zero"`` and ``"fill"``), else against the slot's start or end. :func:`fill_padding` then rewrites the
slot axis by axis: positions mapped to the constant are filled, positions whose voxel was placed elsewhere
copy it (``index_select`` then ``index_copy_``: the values are gathered before any is written). The maps are
separable, so axis after axis gives ``array[map0(i0), map1(i1), ...]`` at every position.

>>> pc = pad_crop(0, 0, ((-2, 3),), (4,), "reflect")
>>> pc.read, pc.offset, [(f.dst.tolist(), f.src.tolist()) for f in pc.fixes]
(((0, 3),), (2,), [([0, 1], [4, 3])])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...errors import OutOfBounds
from ..cast import check_fill, fill_value_as

#: index operations move elements as integers of their width (torch has no index kernels for uint16-64)
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def axis_map(start: int, stop: int, n: int, mode: str) -> np.ndarray:
    """The array index each position ``start .. stop - 1`` of an axis of length ``n`` reads under ``mode``
    (-1: the constant of ``"zero"`` / ``"fill"``), as ``numpy.pad(numpy.arange(n), ..., mode)`` gives it.

    >>> axis_map(-3, 6, 4, "reflect").tolist(), axis_map(-2, 5, 4, "edge").tolist()
    ([3, 2, 1, 0, 1, 2, 3, 2, 1], [0, 0, 0, 1, 2, 3, 3])
    """
    i = np.arange(start, stop, dtype=np.int64)
    if mode == "edge":
        return np.clip(i, 0, n - 1)
    if mode == "reflect":
        if n == 1:  # numpy pads an axis of one voxel with that voxel
            return np.zeros_like(i)
        period = 2 * (n - 1)
        j = np.mod(i, period)
        return np.where(j < n, j, period - j)
    return np.where((i >= 0) & (i < n), i, -1)


@dataclass(frozen=True)
class AxisFix:
    """One step of :func:`fill_padding`: along ``axis`` of a crop's slot, positions ``dst`` take the values at
    positions ``src`` (None: the constant)."""

    axis: int
    dst: np.ndarray
    src: np.ndarray | None


@dataclass(frozen=True)
class PadCrop:
    """A padded crop of a batch: its batch ``row`` (``b * C + c``), its array (``source``, a row of the plan's
    sources: the fill value), ``mode``, the ``read`` box (in the array; empty on some axis: nothing read), where
    it lands in the slot (``offset`` per axis) and the ``fixes`` that fill the rest."""

    row: int
    source: int
    mode: str
    read: tuple[tuple[int, int], ...]
    offset: tuple[int, ...]
    fixes: tuple[AxisFix, ...]

    @property
    def empty(self) -> bool:
        """Nothing of the array is read (the box misses it on some axis: all of the crop is the constant)."""
        return any(b <= a for a, b in self.read)


def needs_padding(box: Sequence[tuple[int, int]], shape: Sequence[int]) -> bool:
    """Whether ``box`` reaches past an array of ``shape`` on some axis."""
    return any(a < 0 or b > n for (a, b), n in zip(box, shape))


def pad_crop(row: int, source: int, box: Sequence[tuple[int, int]], shape: Sequence[int], mode: str,
             uri: str = "") -> PadCrop:
    """What the planner reads for a crop ``box`` of an array of ``shape`` (at ``uri``) padded by ``mode``, where
    it lands, and the fixes after it (see the module docstring). OutOfBounds for ``"edge"`` or ``"reflect"``
    across an axis of length 0, which has no voxel to repeat (numpy.pad refuses it too)."""
    read, offset, fixes = [], [], []
    for axis, ((start, stop), n) in enumerate(zip(box, shape)):
        extent = stop - start
        if start >= 0 and stop <= n:  # inside on this axis: read and placed as an unpadded crop is
            read.append((start, stop))
            offset.append(0)
            continue
        if n == 0 and mode in ("edge", "reflect"):
            raise OutOfBounds(f"{uri}: box {tuple(box)} is padded with {mode!r} on axis {axis}, which has length 0 "
                              f"(shape {tuple(shape)}): there is no voxel to pad with; use pad='zero' or 'fill', or "
                              "leave the array out", uri=uri, box=tuple(box), axis=axis)
        m = axis_map(start, stop, n, mode)
        inside = m >= 0
        k = np.arange(extent, dtype=np.int64)
        if not inside.any():  # (zero and fill only) the box misses the array: the whole crop is the constant
            return PadCrop(row, source, mode, tuple(read) + ((0, 0),) * (len(box) - axis),
                           (0,) * len(box), (AxisFix(0, np.arange(box[0][1] - box[0][0], dtype=np.int64), None),))
        lo, hi = int(m[inside].min()), int(m[inside].max()) + 1
        at = min(max(lo - start, 0), extent - (hi - lo))  # where it lies when that fits (always for constants)
        read.append((lo, hi))
        offset.append(at)
        src = m - lo + at
        if mode in ("zero", "fill"):
            fixes.append(AxisFix(axis, k[~inside], None))
        else:
            moved = src != k
            fixes.append(AxisFix(axis, k[moved], src[moved]))
    return PadCrop(row, source, mode, tuple(read), tuple(offset), tuple(fixes))


def fill_padding(pads: Sequence[PadCrop], sources: Sequence[Any], out: torch.Tensor,
                 upload: Callable[[np.ndarray, torch.device], torch.Tensor] | None = None, cf: bool = False,
                 half_next: bool = False) -> None:
    """Fill what the padded crops ``pads`` (a plan's ``pads``) leave, in ``out`` (the batch, rows ``b * C + c``,
    on the host or a device; with every chunk in place): constants as the array's fill value (``"fill"``, cast
    by the decoders' rules into ``out``'s dtype; ``sources``: the plan's readers) or zeros, the rest copied
    within the crop's slot. ``upload`` moves index arrays to ``out``'s device (default: ``torch.as_tensor``).
    ``cf``: CF attributes are decoded after this, so ``"fill"`` of an array with a CF ``_FillValue`` (or
    ``missing_value``) is that stored value, decoded to NaN, whatever the Zarr ``fill_value`` (xarray writes
    a v3 array's as 0: decoded, a plausible ``add_offset``). ``half_next``: ``out`` is float32 rounded into
    float16 next (a float64 fill value goes in as :func:`~stoker.engine.cast.half_exact` says)."""
    from ..cpu.cf import rounds_once  # (here: cf's imports reach the samplers, which import this module)

    carrier = _CARRIERS.get(out.dtype.itemsize) if out.dtype != torch.bool else torch.uint8
    flat = out.view(carrier) if carrier is not None else out
    device = out.device
    send = upload or (lambda a, d: torch.as_tensor(a, device=d))
    fills: dict[int, int | float | complex | bool] = {}
    for pc in pads:
        view = flat[pc.row]
        for fix in pc.fixes:
            dst = send(fix.dst, device)
            if fix.src is not None:
                view.index_copy_(fix.axis, dst, view.index_select(fix.axis, send(fix.src, device)))
                continue
            value = fills.get(pc.source) if pc.mode == "fill" else 0
            if value is None:
                reader = sources[pc.source]
                missing = _cf_missing(reader) if cf else None
                if missing is not None:  # the decode makes it NaN (the output is a float: check_output)
                    fill = torch.tensor(missing, dtype=out.dtype)
                else:
                    check_fill(reader, out.dtype, "<padding: the array's fill value>")  # never a wrapped value
                    fill = fill_value_as(reader.metadata.fill_value, out.dtype, rounds_once(reader, half_next))
                value = fills[pc.source] = (fill.view(carrier) if carrier is not None else fill).item()
            view.index_fill_(fix.axis, dst, value)


def _cf_missing(reader: Any) -> float | None:
    """The stored value CF decoding turns into NaN for ``reader`` (its ``_FillValue`` or ``missing_value``),
    or None when it has none."""
    from ...reader.coords import coding

    code = coding(reader)
    return None if code is None or not code.fills else float(code.fills[0])
