"""``Sample``: one crop request, an array URI (or several) and an axis-aligned box; or several named fields.

>>> s = stoker.Sample("/data/volume.zarr", numpy.s_[0:32, 100:228, 0:128])
>>> s.aabb, s.shape
(((0, 32), (100, 228), (0, 128)), (32, 128, 128))
>>> s == stoker.Sample("/data/volume.zarr", [(0, 32), (100, 228), (0, 128)])
True

A list of URIs reads the same box from each array and stacks the crops on a new leading channel axis:

>>> m = stoker.Sample(["/data/t2m.zarr", "/data/u10.zarr", "/data/v10.zarr"], [(0, 24), (0, 64), (0, 64)])
>>> m.channels, m.shape                      # a batch of these is (B, 3, 24, 64, 64)
(3, (3, 24, 64, 64))

A mapping makes a sample of named fields, each its own array(s) and box (in that array's own voxels), of
any shape; a batch of them is a mapping from field name to that field's batch:

>>> f = stoker.Sample({"raw": ("/data/raw.zarr", [(0, 96)] * 3), "labels": ("/data/labels.zarr", [(20, 76)] * 3)})
>>> f.names, f.shape
(('raw', 'labels'), {'raw': (96, 96, 96), 'labels': (56, 56, 56)})
>>> f["labels"]
Sample('/data/labels.zarr', [(20, 76), (20, 76), (20, 76)])

``pad`` lets a box reach past its array (negative starts, stops past the end): the part outside is filled
while placing, with zeros (``"zero"``), the array's fill value (``"fill"``), its mirror image across the
border (``"reflect"``, the border voxel not repeated: numpy's ``mode="reflect"``) or the border voxel
(``"edge"``). Without it such a box is an :class:`~stoker.errors.OutOfBounds` error. The constants are
stored values: for an array whose CF attributes are decoded (``Config(cf=True)``) they are decoded like the
data, so ``"zero"`` gives ``add_offset`` (NaN where 0 is the ``_FillValue``) and ``"fill"`` the decoded fill
value (NaN for a ``_FillValue``).

>>> stoker.Sample("/data/volume.zarr", [(-8, 24), (0, 32), (0, 32)], pad="reflect").pad
'reflect'
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from typing import Any, Sequence

from ..zarr.box import Box, box_shape, parse_box
from ..errors import InvalidArgument

#: the ways a box may reach past its array (see the module docstring)
PAD_MODES = ("zero", "fill", "reflect", "edge")


def _uri(uri: Any) -> str:
    if not isinstance(uri, (str, os.PathLike)):
        raise InvalidArgument(f"Sample uri must be a string or path, got {type(uri).__name__}: {uri!r}")
    return os.fspath(uri)


def check_pad(pad: Any, where: str = "Sample") -> str | None:
    """``pad`` if it is None or one of :data:`PAD_MODES`, else InvalidArgument naming ``where``."""
    if pad is None or (isinstance(pad, str) and pad in PAD_MODES):
        return pad
    raise InvalidArgument(f"{where} pad must be None or one of {list(PAD_MODES)}, got {pad!r}", knob="pad")


class Sample:
    """Array URI(s) and a half-open box, or named fields of them; normalised, immutable, hashable.

    ``uri`` is one array (the sample has the box's shape) or a non-empty list of arrays (channels: the
    sample has shape ``(len(uris), *box)``; each array is read at the same box, and arrays of different
    dtypes are cast to the batch's dtype). ``aabb`` is ``(start, stop)`` pairs or slices with explicit ends.
    Bare integers and steps other than 1 are rejected (a crop keeps every axis).

    ``uris`` is always the tuple of arrays; ``uri`` is the first of them; ``channels`` is ``None`` for a
    single-array sample (no channel axis) and ``len(uris)`` otherwise (also for a list of one).

    A mapping ``{name: (uri_or_uris, box)}`` (or ``{name: Sample}``) makes a sample of fields: ``fields`` is
    the mapping from name to each field's own sample (``None`` for a sample of one box), ``names`` their
    order, ``sample[name]`` one of them, ``uris`` every field's arrays; ``aabb``, ``crop_shape`` and
    ``channels`` are ``None`` (each field has its own) and ``shape`` maps names to shapes. ``pad`` (see the
    module docstring) applies to every field. ``pad_axes`` (axis numbers, with ``pad``) says which axes the box
    may be padded on, as the sampler that made it was told (``TileGrid(pad_axes=...)``); None: every axis. The
    read is the same either way (it is not part of equality); a ``TileWriter`` crops the other axes as
    unpadded.
    """

    __slots__ = ("uri", "uris", "channels", "aabb", "crop_shape", "fields", "pad", "pad_axes", "_hash")
    uri: str
    uris: tuple[str, ...]
    channels: int | None
    aabb: Box | None
    crop_shape: tuple[int, ...] | None  # the shape of the box (what is read from each array); planners ask it often
    fields: dict[str, "Sample"] | None
    pad: str | None
    pad_axes: tuple[int, ...] | None
    _hash: int

    def __init__(self, uri: str | os.PathLike | Sequence[str | os.PathLike] | Mapping[str, Any],
                 aabb: Any = None, pad: str | None = None, pad_axes: Sequence[int] | None = None) -> None:
        pad = check_pad(pad)
        if pad_axes is not None:
            if pad is None:
                raise InvalidArgument("Sample pad_axes names the axes the box may be padded on and needs pad=",
                                      knob="pad_axes")
            pad_axes = _axis_numbers(pad_axes)
        channels: int | None = None
        if type(uri) is str:  # the common case first: the ABC checks below cost microseconds a sample
            uris: tuple[str, ...] = (uri,)
        elif isinstance(uri, Mapping):
            self._init_fields(uri, aabb, pad, pad_axes)
            return
        elif isinstance(uri, (list, tuple)):
            uris = tuple(_uri(u) for u in uri)
            if not uris:
                raise InvalidArgument("Sample needs at least one array uri; got an empty list")
            channels = len(uris)
        else:
            uris = (_uri(uri),)
        box = parse_box(aabb, allow_negative=pad is not None)
        if any(stop == start for start, stop in box):
            raise InvalidArgument(f"Sample box {box} is empty on some axis; every extent must be >= 1")
        if pad_axes is not None:  # in range of the box, negative ones from the end, as the samplers keep them
            if not all(-len(box) <= a < len(box) for a in pad_axes):
                raise InvalidArgument(f"Sample pad_axes {pad_axes} must be axis numbers in [-{len(box)}, "
                                      f"{len(box)}) (the box has {len(box)} axes)", knob="pad_axes")
            pad_axes = tuple(sorted({a % len(box) for a in pad_axes}))
        set_ = object.__setattr__
        set_(self, "uri", uris[0])
        set_(self, "uris", uris)
        set_(self, "channels", channels)
        set_(self, "aabb", box)
        set_(self, "crop_shape", box_shape(box))
        set_(self, "fields", None)
        set_(self, "pad", pad)
        set_(self, "pad_axes", pad_axes)
        set_(self, "_hash", hash((uris, channels, box, pad)))

    def _init_fields(self, given: Mapping[str, Any], aabb: Any, pad: str | None,
                     pad_axes: tuple[int, ...] | None) -> None:
        if aabb is not None:
            raise InvalidArgument("a Sample of fields takes each field's box in its mapping "
                                  "({name: (uri, box)}), not a box of its own")
        if not given:
            raise InvalidArgument("a Sample of fields needs at least one field: {name: (uri, box)}")
        fields: dict[str, Sample] = {}
        for name, value in given.items():
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"Sample field names must be non-empty strings, got {name!r}")
            if isinstance(value, Sample):
                if value.fields is not None:
                    raise InvalidArgument(f"Sample field {name!r} is itself a Sample of fields; fields do not nest")
                if value.pad != pad or value.pad_axes != pad_axes:
                    value = Sample(given_uri(value), value.aabb, pad=pad, pad_axes=pad_axes)
            elif isinstance(value, (tuple, list)) and len(value) == 2:
                try:
                    value = Sample(value[0], value[1], pad=pad, pad_axes=pad_axes)
                except InvalidArgument as exc:
                    raise InvalidArgument(f"Sample field {name!r}: {exc}") from None
            else:
                raise InvalidArgument(f"Sample field {name!r} must be (uri_or_uris, box) or a Sample, got {value!r}")
            fields[name] = value
        uris = tuple(dict.fromkeys(u for f in fields.values() for u in f.uris))
        set_ = object.__setattr__
        set_(self, "uri", uris[0])
        set_(self, "uris", uris)
        set_(self, "channels", None)
        set_(self, "aabb", None)
        set_(self, "crop_shape", None)
        set_(self, "fields", fields)
        set_(self, "pad", pad)
        set_(self, "pad_axes", pad_axes)
        set_(self, "_hash", hash(tuple(fields.items())) ^ hash(pad))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Sample is immutable")

    @property
    def names(self) -> tuple[str, ...] | None:
        """The field names, in order (None for a sample of one box)."""
        return None if self.fields is None else tuple(self.fields)

    def __getitem__(self, name: str) -> "Sample":
        if self.fields is None:
            raise KeyError(f"{name!r}: this Sample has no fields (it is one box of {given_uri(self)!r})")
        return self.fields[name]

    @property
    def shape(self) -> Any:
        """The sample's shape in a batch: the box's shape, with the channel axis first when it has one; for a
        sample of fields, a dict of each field's shape."""
        if self.fields is not None:
            return {name: f.shape for name, f in self.fields.items()}
        crop = self.crop_shape
        assert crop is not None
        return crop if self.channels is None else (self.channels, *crop)

    @property
    def box(self) -> Box | None:
        return self.aabb

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample) or self.pad != other.pad:
            return False
        if self.fields is not None or other.fields is not None:
            return self.fields == other.fields and self.names == other.names
        return self.uris == other.uris and self.channels == other.channels and self.aabb == other.aabb

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        pad = "" if self.pad is None else f", pad={self.pad!r}"
        pad += "" if self.pad_axes is None else f", pad_axes={self.pad_axes!r}"
        if self.fields is not None:
            inner = ", ".join(f"{n!r}: ({given_uri(f)!r}, {list(f.aabb or ())})" for n, f in self.fields.items())
            return f"Sample({{{inner}}}{pad})"
        return f"Sample({given_uri(self)!r}, {list(self.aabb or ())}{pad})"

    def __reduce__(self):
        if self.fields is not None:
            return (Sample, ({n: (given_uri(f), f.aabb) for n, f in self.fields.items()}, None, self.pad,
                             self.pad_axes))
        return (Sample, (given_uri(self), self.aabb, self.pad, self.pad_axes))


def given_uri(sample: Sample) -> str | list[str]:
    """The ``uri`` argument that makes ``sample`` (of one box): its one URI, or the list of a sample with
    channels (its repr, its pickle, and its part of a sampler's fingerprint).

    >>> given_uri(Sample(["/data/a.zarr"], [(0, 4)]))
    ['/data/a.zarr']
    """
    return sample.uri if sample.channels is None else list(sample.uris)


def box_of(sample: Sample) -> Box:
    """The box of a sample of one box; InvalidArgument for a sample of fields (name the field: ``s["raw"]``).

    >>> box_of(Sample("/data/a.zarr", [(0, 4)]))
    ((0, 4),)
    """
    if sample.aabb is None:
        raise InvalidArgument(f"{sample!r} is a sample of fields {list(sample.names or ())}, which have a box "
                              "each: pick one (sample[name])")
    return sample.aabb


def parts(samples: Sequence[Sample]) -> list[tuple[str, Box]]:
    """The crops a batch of ``samples`` (of one box each) reads, one per (sample, channel), in the order of
    the batch's rows with its channel axis folded into them: crop ``b * C + c`` is channel ``c`` of sample
    ``b``."""
    out: list[tuple[str, Box]] = []
    for s in samples:
        box = box_of(s)
        out.extend((uri, box) for uri in s.uris)
    return out


def arrays_read(s: Sample) -> str:
    """How many arrays ``s`` reads, in words (for error messages)."""
    if s.fields is not None:
        return f"{len(s.fields)} fields ({', '.join(s.fields)})"
    return "one array (no channel axis)" if s.channels is None else f"{s.channels} arrays (channels)"


def _axis_numbers(pad_axes: Any) -> tuple[int, ...]:
    """``pad_axes`` as distinct sorted integers; InvalidArgument for anything but a collection of integers."""
    if isinstance(pad_axes, (str, bytes)) or not isinstance(pad_axes, (list, tuple, set, frozenset, range)):
        raise InvalidArgument(f"Sample pad_axes must be a tuple of axis numbers, got {pad_axes!r}", knob="pad_axes")
    if not all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in pad_axes):
        raise InvalidArgument(f"Sample pad_axes must be axis numbers (integers), got {pad_axes!r}", knob="pad_axes")
    return tuple(sorted({int(a) for a in pad_axes}))
