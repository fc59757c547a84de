"""``Field``: what one named part of a sample reads, placed relative to the sample's anchor; ``Volume``: the
fields of one volume resolved against their arrays, with the anchors that keep every box inside.

>>> raw = stoker.Field("/data/raw.ome.zarr/0", (96, 96, 96))
>>> labels = stoker.Field("/data/labels.zarr", (56, 56, 56), offset=(20, 20, 20))     # centred in raw
>>> context = stoker.Field("/data/raw.ome.zarr/2", (48, 48, 48), offset=(-48, -48, -48))  # scale 4 (metadata)
>>> src = stoker.RandomCrops({"raw": raw, "labels": labels, "context": context}, seed=0)

Coordinates are reference voxels (level 0 of the image: scale 1). A sample has an anchor ``a`` there; a
field of scale ``s`` and offset ``o`` reads the box that starts at ``(a + o) / s`` in its arrays' own voxels
and has the field's ``shape``. Anchors lie on multiples of every field's scale (their least common multiple,
per axis) and offsets are multiples of their field's scale, so every box starts on a whole voxel: the
context above, at anchor 96, reads ``[(96 - 48) / 4, ... + 48) = [12, 60)`` of level 2, the 192 reference
voxels around the 96^3 raw crop.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from ..checks import integers
from ..errors import InvalidArgument, RankMismatch
from .sample import Sample


class Field:
    """What one named part of a sample reads: ``arrays`` (one URI, or a list read as channels) at a box of
    ``shape`` (the arrays' own voxels) placed ``offset`` reference voxels from the sample's anchor;
    ``scale`` (an int >= 1, or one per axis) is how many reference voxels one voxel of the arrays spans:
    by default that of the array's OME-Zarr level over level 0 (from the image's ``multiscales``), else 1.

    >>> stoker.Field("/data/labels.zarr", (56, 56, 56), offset=(20, 20, 20))
    Field('/data/labels.zarr', (56, 56, 56), offset=(20, 20, 20))
    >>> stoker.Field(["/data/t2m.zarr", "/data/u10.zarr"], (2, 64, 128)).channels
    2
    """

    def __init__(self, arrays: str | os.PathLike | Sequence[str | os.PathLike], shape: Sequence[int],
                 offset: Sequence[int] | None = None, scale: int | Sequence[int] | None = None) -> None:
        if isinstance(arrays, (str, os.PathLike)):
            self.arrays: str | list[str] = os.fspath(arrays)
        elif isinstance(arrays, (list, tuple)) and arrays and all(isinstance(a, (str, os.PathLike)) for a in arrays):
            self.arrays = [os.fspath(a) for a in arrays]
        else:
            raise InvalidArgument(f"Field arrays must be an array URI or a non-empty list of them, got {arrays!r}")
        self.shape = integers("Field shape", shape, None, knob="shape")
        if not self.shape or any(s < 1 for s in self.shape):
            raise InvalidArgument(f"Field shape {self.shape} must be non-empty with every extent >= 1")
        self.offset = (0,) * len(self.shape) if offset is None else \
            integers("Field offset", offset, None, knob="offset")
        if scale is None:
            self.scale: tuple[int, ...] | None = None
        elif isinstance(scale, numbers.Integral) and not isinstance(scale, bool):  # numpy's integers too
            self.scale = (int(scale),) * len(self.shape)
        else:
            self.scale = integers("Field scale", scale, None, knob="scale")
        for what, value in (("offset", self.offset), ("scale", self.scale)):
            if value is not None and len(value) != len(self.shape):
                raise InvalidArgument(f"Field {what} {value} has {len(value)} axes, its shape {self.shape} "
                                      f"{len(self.shape)}: give one value per axis", knob=what)
        if self.scale is not None and any(s < 1 for s in self.scale):
            raise InvalidArgument(f"Field scale {self.scale} must be >= 1 on every axis (reference voxels per voxel "
                                  "of the field's arrays)", knob="scale")

    @property
    def uris(self) -> list[str]:
        """The field's arrays, as a list."""
        return self.arrays if isinstance(self.arrays, list) else [self.arrays]

    @property
    def channels(self) -> int | None:
        """``len(arrays)`` when arrays is a list (a channel axis), else None."""
        return len(self.arrays) if isinstance(self.arrays, list) else None

    def plain(self) -> dict:
        """The field as JSON data (part of a sampler's identity)."""
        return {"arrays": self.arrays, "shape": list(self.shape), "offset": list(self.offset),
                "scale": None if self.scale is None else list(self.scale)}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Field) and self.plain() == other.plain()

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        extra = "" if not any(self.offset) else f", offset={self.offset}"
        extra += "" if self.scale is None else f", scale={self.scale}"
        return f"Field({self.arrays!r}, {self.shape}{extra})"


def check_fields(fields: Any, who: str) -> dict[str, Field]:
    """``fields`` as a ``{name: Field}`` dict (InvalidArgument naming what is wrong otherwise)."""
    if not isinstance(fields, Mapping) or not fields:
        raise InvalidArgument(f"{who}: a volume's fields are a non-empty dict {{name: stoker.Field(...)}}, got {fields!r}")
    for name, f in fields.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{who}: field names must be non-empty strings, got {name!r}")
        if not isinstance(f, Field):
            raise InvalidArgument(f"{who}: field {name!r} must be a stoker.Field, got {type(f).__name__}")
    ranks = {name: len(f.shape) for name, f in fields.items()}
    if len(set(ranks.values())) > 1:
        raise InvalidArgument(f"{who}: the fields of a volume share one anchor and need the same number of axes; "
                              f"got {ranks}")
    return dict(fields)


class Volume:
    """The fields of one volume resolved against their arrays: ``shapes`` (each field's arrays' shape),
    ``scales`` (each field's, from the field or the OME metadata), and the anchor lattice: anchors are
    ``(first + k) * step`` for ``0 <= k < counts`` per axis, where every field's box lies inside its arrays.

    ``align`` (per axis) adds a step anchors must also be multiples of (a mask's scale). ``bounds`` (per axis,
    half-open, reference voxels) restricts the anchors further (a region). ``pad`` (a mode of
    :data:`~stoker.sampling.sample.PAD_MODES`): on the padded axes (all, or those of ``pad_axes``) the first
    field bounds the anchors as a padded crop over arrays is bounded (its box inside its arrays, or covering an
    axis shorter than it whole); the other fields' boxes may reach past their arrays, filled while placing, but
    each shares at least one voxel with its arrays (``overlap``; a padded TileGrid, whose tiles follow the first
    field's, passes False). On the other axes every box lies inside its arrays, as without pad.
    """

    def __init__(self, fields: Mapping[str, Field], shapes: Mapping[str, tuple[int, ...]],
                 scales: Mapping[str, tuple[int, ...]], align: Sequence[int] | None = None, who: str = "RandomCrops",
                 bounds: Sequence[tuple[int, int]] | None = None, pad: str | None = None,
                 pad_axes: Sequence[int] | None = None, overlap: bool = True) -> None:
        self.pad = pad
        self.pad_axes = None if pad is None or pad_axes is None else tuple(pad_axes)
        self.bounds = None if bounds is None else [tuple(int(v) for v in b) for b in bounds]
        self.fields = dict(fields)
        self.names = tuple(fields)
        self.shapes = {n: tuple(shapes[n]) for n in self.names}
        self.scales = {n: tuple(scales[n]) for n in self.names}
        ndim = len(next(iter(fields.values())).shape)
        for name, f in self.fields.items():
            shape, scale = self.shapes[name], self.scales[name]
            if len(shape) != ndim or len(scale) != ndim:
                raise InvalidArgument(f"{who}: field {name!r} reads arrays of shape {shape} (scale {scale}) with a "
                                      f"box of {len(f.shape)} axes; give the field one extent per axis of its arrays",
                                      uri=f.uris[0])
            for axis, (o, s) in enumerate(zip(f.offset, scale)):
                if o % s:
                    low = o - o % s
                    raise InvalidArgument(
                        f"{who}: field {name!r} has offset {o} on axis {axis}, not a multiple of its scale {s}: its "
                        f"box starts at (anchor + offset) / scale, a whole voxel only then; use offset {low} or "
                        f"{low + s} there", knob="offset", field=name)
        steps = [self.scales[n] for n in self.names] + ([tuple(align)] if align is not None else [])
        self.step = tuple(math.lcm(*(s[d] for s in steps)) for d in range(ndim))
        #: the axes boxes may reach past their arrays on (all with pad, unless pad_axes names some; none without)
        self.padded = tuple(d for d in range(ndim) if pad is not None and (pad_axes is None or d in pad_axes))
        #: whether keeping every field overlapping its arrays (pad) left out anchors the first field allows
        self.narrowed = False
        self.first, self.counts = [], []
        for d in range(ndim):
            limits = self._limits(d, d in self.padded, overlap)
            lo, hi = max(lim[1] for lim in limits), min(lim[2] for lim in limits)
            k0, k1 = -(-lo // self.step[d]), hi // self.step[d]
            if k1 < k0:
                raise self._no_anchor(who, d, limits, d in self.padded, pad_axes is not None)
            if d in self.padded and overlap and len(limits) > 1:  # what the first field alone would allow
                own = limits[0]
                self.narrowed |= (k0, k1) != (-(-own[1] // self.step[d]), own[2] // self.step[d])
            if self.bounds is not None:  # a region: anchors in [start, stop) as well
                start, stop = self.bounds[d]
                k0, k1 = max(k0, -(-start // self.step[d])), min(k1, (stop - 1) // self.step[d])
                if k1 < k0:
                    raise InvalidArgument(
                        f"{who}: the region leaves no anchor on axis {d}: it allows anchors in [{start}, {stop}) "
                        f"(reference voxels), the fields' boxes fit at anchors in [{lo}, {hi}] on multiples of "
                        f"{self.step[d]}; widen the region", knob="region", axis=d)
            self.first.append(k0)
            self.counts.append(k1 - k0 + 1)

    def _limits(self, d: int, padded: bool, overlap: bool) -> list[tuple[str, int, int, str]]:
        """Each bounding field's anchors on axis ``d``, ``(name, low, high, how)`` (both included). Anchor ``a``
        puts field ``n``'s box at ``(a + o) / s``. Unpadded: every box inside its arrays. Padded: the first
        box inside, or covering an axis shorter than it (as a padded crop over arrays), and, with ``overlap``,
        every other box sharing at least one voxel with its arrays: a box wholly past them would hold
        nothing but the pad (a forecast target past the last time step, filled with that step)."""
        out = []
        for i, n in enumerate(self.names):
            f, s, a = self.fields[n], self.scales[n][d], self.shapes[n][d]
            o, c = f.offset[d], f.shape[d]
            if not padded:
                out.append((n, -o, s * (a - c) - o, "inside"))
            elif i == 0:
                ends = (-o, s * (a - c) - o)
                out.append((n, min(ends), max(ends), "inside" if c <= a else "covering"))
            elif overlap:
                out.append((n, s * (1 - c) - o, s * (a - 1) - o, "overlapping"))
        return out

    def _no_anchor(self, who: str, d: int, limits: list, padded: bool, chosen: bool) -> InvalidArgument:
        """The error of an axis ``d`` on which no anchor satisfies every field (``limits``: see :meth:`_limits`)."""
        below = max(limits, key=lambda lim: lim[1])
        above = min(limits, key=lambda lim: lim[2])
        name = above[0]
        if padded:
            fix = ("make the boxes smaller or their offsets closer: with pad a field's box may reach past its "
                   "arrays, but not lie wholly outside them (it would hold nothing but the pad)")
        elif self.pad is not None and chosen:
            fix = (f"make the boxes smaller or their offsets closer, or add axis {d} to pad_axes (boxes may then "
                   "extend past the arrays there, padded)")
        else:
            fix = "make the boxes smaller or their offsets closer" + \
                ("" if self.pad is not None else ", or pass pad= (boxes may then extend past the arrays, padded)")
        keeps = ("the first field's box inside its arrays (or covering them) and every other field's box "
                 "overlapping its arrays") if padded else "every field's box inside its arrays"
        # the volume's arrays by URI: in a source of several volumes the field names alone do not say which
        arrays = self.fields[name].arrays
        uri = arrays if isinstance(arrays, str) else arrays[0]
        where = uri if isinstance(arrays, str) or len(arrays) == 1 else f"{uri} and {len(arrays) - 1} more"
        return InvalidArgument(
            f"{who}: no anchor on axis {d} keeps {keeps} (anchors on multiples of {self.step[d]}): field "
            f"{below[0]!r} needs anchors >= {below[1]}, field {name!r} (arrays {where} of shape {self.shapes[name]}, "
            f"box {self.fields[name].shape}, scale {self.scales[name]}) <= {above[2]}; {fix}", field=name, axis=d,
            uri=uri)

    @property
    def n_anchors(self) -> int:
        """How many anchors the lattice has (a Python int: may exceed int64 for huge volumes)."""
        return math.prod(self.counts)

    def anchor(self, k: Sequence[int]) -> tuple[int, ...]:
        """The anchor at lattice index ``k`` (per axis, ``0 <= k < counts``)."""
        return tuple((f + int(i)) * st for f, i, st in zip(self.first, k, self.step))

    def box(self, name: str, anchor: Sequence[int]) -> list[tuple[int, int]]:
        """Field ``name``'s box (its arrays' voxels) at ``anchor``."""
        f, scale = self.fields[name], self.scales[name]
        starts = [(a + o) // s for a, o, s in zip(anchor, f.offset, scale)]
        return [(b, b + c) for b, c in zip(starts, f.shape)]

    def sample(self, anchor: Sequence[int]) -> Sample:
        """The sample of every field at ``anchor`` (padded with the volume's ``pad``)."""
        return Sample({n: (self.fields[n].arrays, self.box(n, anchor)) for n in self.names}, pad=self.pad,
                      pad_axes=self.pad_axes)


class MaskedVolume(NamedTuple):
    """A volume opened for a sampler: its lattice, and with a mask the sorted flat lattice indices of the
    anchors that qualify (None without a mask)."""

    volume: Volume
    qualifying: np.ndarray | None


def _check_mask_extent(mask: Any, mask_shape: tuple[int, ...], mask_scale: tuple[int, ...],
                       shape: tuple[int, ...], scale: tuple[int, ...], who: str) -> None:
    """InvalidArgument where the mask, at its scale, reaches past the masked field's arrays by a whole mask voxel
    or more: its scale is not the mask's (a full-resolution mask given a coarse mask's scale), so its voxels
    would be read at other positions than they mark, and anchors drawn by the wrong ones, without a word. A
    mask cut short of the arrays is taken (what lies past it counts as zero). A coarse array may have been rounded
    down (a level of 101 voxels at scale 2 has 50), so the volume can reach ``scale - 1`` reference voxels past
    it: a finer mask of the whole volume is taken."""
    if len(mask_shape) != len(shape):
        raise RankMismatch(f"{who}: mask {mask.uri} has {len(mask_shape)} axes (shape {mask_shape}); field "
                           f"{mask.field!r}'s arrays have {len(shape)}", uri=mask.uri)
    for axis, (m, s, n, k) in enumerate(zip(mask_shape, mask_scale, shape, scale)):
        extent = n * k  # the field's arrays, in reference voxels (the volume: up to k - 1 more)
        if (m - 1) * s >= extent + k - 1:
            raise InvalidArgument(
                f"{who}: mask {mask.uri} (shape {mask_shape}) at scale {s} on axis {axis} spans {m * s} reference "
                f"voxels, past the {extent} of field {mask.field!r}'s arrays: its scale is not the mask's (a mask of "
                f"this volume at scale {s} has {-(-extent // s)} voxels there); pass Mask(..., scale=) of the "
                "mask's own resolution", uri=mask.uri, knob="scale")


def open_volume(fields: Mapping[str, Field], mask: Any, storage_options: dict | None, stores: Any,
                who: str, region: dict | None = None, pad: str | None = None,
                pad_axes: Sequence[int] | None = None, overlap: bool = True) -> MaskedVolume:
    """Open ``fields``' arrays (shapes; scales from the OME metadata where not given) in ``stores``, and with
    ``mask`` (a :class:`~stoker.sampling.mask.Mask`) find the anchors it lets through; InvalidArgument naming
    the mask, the fraction and the best coverage found when none does. ``region``, ``pad``, ``pad_axes`` and
    ``overlap``: see :func:`region_bounds` and :class:`Volume`."""
    from ..reader.array import open_array
    from ..reader.coords import check_field_dimensions
    from ..reader.ome import level_scale
    from ..storage.locate import check_options_by_prefix, options_for
    from .mask import Mask, check_alignment, covering_anchors

    by_prefix = check_options_by_prefix(storage_options, "storage_options")
    shapes, scales = {}, {}
    firsts = []  # each field's first array: its channels are compared by the pipeline (check_channel_dimensions)
    for name, f in fields.items():
        opened = [open_array(uri, options_for(by_prefix, uri), stores=stores) for uri in f.uris]
        firsts.append((f"field {name!r}", opened[0]))
        found = [r.shape for r in opened]
        for uri, shape in zip(f.uris, found):
            if shape != found[0]:
                raise InvalidArgument(f"{uri}: shape {shape} differs from {f.uris[0]}'s {found[0]}; the arrays of "
                                      f"field {name!r} are read at the same box and must have one shape", uri=uri)
        shapes[name] = found[0]
        scales[name] = f.scale or level_scale(f.uris[0], options_for(by_prefix, f.uris[0]), stores) or \
            (1,) * len(found[0])
    bounds = None if region is None else region_bounds(fields, shapes, scales, region, by_prefix, stores)
    if mask is None:
        check_field_dimensions(firsts, who, stores, by_prefix)
        return MaskedVolume(Volume(fields, shapes, scales, who=who, bounds=bounds, pad=pad, pad_axes=pad_axes,
                                   overlap=overlap), None)
    if not isinstance(mask, Mask):
        raise InvalidArgument(f"{who}: mask must be a stoker.Mask, got {type(mask).__name__}", knob="mask")
    if mask.field not in fields:
        raise InvalidArgument(f"{who}: mask {mask.uri} names field {mask.field!r}, which is none of "
                              f"{list(fields)}; pass Mask(..., field=<one of them>)", knob="mask", uri=mask.uri)
    reader = open_array(mask.uri, options_for(by_prefix, mask.uri), stores=stores)
    check_field_dimensions(firsts + [(f"mask {mask.uri}", reader)], who, stores, by_prefix)
    ndim = len(fields[mask.field].shape)
    if reader.ndim != ndim:  # before the scale and alignment, which would blame the field's box on an axis
        raise RankMismatch(f"{who}: mask {mask.uri} has {reader.ndim} axes (shape {reader.shape}); field "
                           f"{mask.field!r}'s arrays have {ndim}: a mask is an array of the volume's axes",
                           uri=mask.uri)
    given = mask.scale
    mask_scale = (given,) * ndim if isinstance(given, int) else given or \
        level_scale(mask.uri, options_for(by_prefix, mask.uri), stores) or (1,) * ndim
    if len(mask_scale) != ndim:
        raise InvalidArgument(f"{who}: mask {mask.uri} has scale {mask_scale}, of {len(mask_scale)} axes; field "
                              f"{mask.field!r} has {ndim}", uri=mask.uri, knob="scale")
    check_alignment(mask, mask.field, fields[mask.field], scales[mask.field], mask_scale, who)
    _check_mask_extent(mask, reader.shape, mask_scale, shapes[mask.field], scales[mask.field], who)
    volume = Volume(fields, shapes, scales, align=mask_scale, who=who, bounds=bounds, pad=pad, pad_axes=pad_axes,
                    overlap=overlap)
    index, best = covering_anchors(volume, mask, mask_scale, reader)
    if not index.size:
        raise InvalidArgument(
            f"{who}: no anchor qualifies under mask {mask.uri}: field {mask.field!r}'s box covers at most "
            f"{best:.4g} of nonzero mask voxels anywhere, less than min_fraction={mask.min_fraction}; lower "
            "min_fraction, or check that the mask and its scale belong to this volume",
            uri=mask.uri, knob="min_fraction", min_fraction=mask.min_fraction, best=best)
    return MaskedVolume(volume, index)


def region_bounds(fields: Mapping[str, Field], shapes: Mapping[str, tuple[int, ...]],
                  scales: Mapping[str, tuple[int, ...]], region: dict, by_prefix: Any,
                  stores: Any) -> list[tuple[int, int]]:
    """The anchors (half-open, reference voxels, per axis) ``region`` allows: it is read on the first field's
    first array (axis numbers: index ranges; dimension names: labels of its coordinates, see
    :mod:`stoker.sampling.region`) and restricts where that field's box starts, ``[i0, i1)`` in its own
    voxels; with its scale ``s`` and offset ``o`` that is anchors in ``[i0 * s - o, i1 * s - o)``."""
    from ..reader.array import open_array
    from ..reader.coords import coordinate, dimension_names
    from ..storage.locate import options_for
    from .region import index_ranges

    if not isinstance(region, dict) or not region:
        raise InvalidArgument(f"region must be a non-empty dict of axis numbers or dimension names to ranges, got "
                              f"{region!r}", knob="region")
    name = next(iter(fields))
    f, scale = fields[name], scales[name]
    uri = f.uris[0]
    options = options_for(by_prefix, uri)
    ranges = index_ranges(region, uri, tuple(shapes[name]), lambda: open_array(uri, options, stores=stores),
                          lambda reader: dimension_names(reader, stores, options),
                          lambda reader, key: coordinate(reader, key, options, stores))
    return [(i0 * s - o, i1 * s - o) for (i0, i1), s, o in zip(ranges, scale, f.offset)]
