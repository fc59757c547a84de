"""``Sample``: one crop request, an array URI (or several) and an axis-aligned box.

>>> s = stoker.Sample("/data/volume.zarr", numpy.s_[0:32, 100:228, 0:128])
>>> s.aabb, s.shape
(((0, 32), (100, 228), (0, 128)), (32, 128, 128))
>>> s == stoker.Sample("/data/volume.zarr", [(0, 32), (100, 228), (0, 128)])
True

A list of URIs reads the same box from each array and stacks the crops on a new leading channel axis:

>>> m = stoker.Sample(["/data/t2m.zarr", "/data/u10.zarr", "/data/v10.zarr"], [(0, 24), (0, 64), (0, 64)])
>>> m.channels, m.shape                      # a batch of these is (B, 3, 24, 64, 64)
(3, (3, 24, 64, 64))
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from ..zarr.box import Box, box_shape, parse_box
from ..errors import InvalidArgument


def _uri(uri: Any) -> str:
    if not isinstance(uri, (str, os.PathLike)):
        raise InvalidArgument(f"Sample uri must be a string or path, got {type(uri).__name__}: {uri!r}")
    return os.fspath(uri)


class Sample:
    """Array URI(s) and a half-open box; normalised, immutable, hashable.

    ``uri`` is one array (the sample has the box's shape) or a non-empty list of arrays (channels: the
    sample has shape ``(len(uris), *box)``; each array is read at the same box, and arrays of different
    dtypes are cast to the batch's dtype). ``aabb`` is ``(start, stop)`` pairs or slices with explicit ends.
    Bare integers and steps other than 1 are rejected (a crop keeps every axis).

    ``uris`` is always the tuple of arrays; ``uri`` is the first of them; ``channels`` is ``None`` for a
    single-array sample (no channel axis) and ``len(uris)`` otherwise (also for a list of one).
    """

    __slots__ = ("uri", "uris", "channels", "aabb", "crop_shape", "_hash")
    uri: str
    uris: tuple[str, ...]
    channels: int | None
    aabb: Box
    crop_shape: tuple[int, ...]  # the shape of the box (what is read from each array); planners ask it often
    _hash: int

    def __init__(self, uri: str | os.PathLike | Sequence[str | os.PathLike], aabb: Any) -> None:
        if isinstance(uri, (list, tuple)):
            uris = tuple(_uri(u) for u in uri)
            if not uris:
                raise InvalidArgument("Sample needs at least one array uri; got an empty list")
            channels: int | None = len(uris)
        else:
            uris, channels = (_uri(uri),), None
        box = parse_box(aabb)
        if any(stop == start for start, stop in box):
            raise InvalidArgument(f"Sample box {box} is empty on some axis; every extent must be >= 1")
        object.__setattr__(self, "uri", uris[0])
        object.__setattr__(self, "uris", uris)
        object.__setattr__(self, "channels", channels)
        object.__setattr__(self, "aabb", box)
        object.__setattr__(self, "crop_shape", box_shape(box))
        object.__setattr__(self, "_hash", hash((uris, channels, box)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Sample is immutable")

    @property
    def shape(self) -> tuple[int, ...]:
        """The sample's shape in a batch: the box's shape, with the channel axis first when it has one."""
        crop = self.crop_shape
        return crop if self.channels is None else (self.channels, *crop)

    @property
    def box(self) -> Box:
        return self.aabb

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Sample) and self.uris == other.uris and self.channels == other.channels
                and self.aabb == other.aabb)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Sample({given_uri(self)!r}, {list(self.aabb)})"

    def __reduce__(self):
        return (Sample, (given_uri(self), self.aabb))


def given_uri(sample: Sample) -> str | list[str]:
    """The ``uri`` argument that makes ``sample``: its one URI, or the list of a sample with channels (its
    repr, its pickle, and its part of a sampler's fingerprint).

    >>> given_uri(Sample(["/data/a.zarr"], [(0, 4)]))
    ['/data/a.zarr']
    """
    return sample.uri if sample.channels is None else list(sample.uris)


def parts(samples: Sequence[Sample]) -> list[tuple[str, Box]]:
    """The crops a batch of ``samples`` reads, one per (sample, channel), in the order of the batch's rows
    with its channel axis folded into them: crop ``b * C + c`` is channel ``c`` of sample ``b``."""
    return [(uri, s.aabb) for s in samples for uri in s.uris]


def arrays_read(s: Sample) -> str:
    """How many arrays ``s`` reads, in words (for error messages)."""
    return "one array (no channel axis)" if s.channels is None else f"{s.channels} arrays (channels)"
