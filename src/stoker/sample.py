"""``Sample``: one crop request, an array URI and an axis-aligned box.

>>> s = stoker.Sample("/data/volume.zarr", numpy.s_[0:32, 100:228, 0:128])
>>> s.aabb
((0, 32), (100, 228), (0, 128))
>>> s == stoker.Sample("/data/volume.zarr", [(0, 32), (100, 228), (0, 128)])
True
"""

from __future__ import annotations

import os
from typing import Any

from .box import Box, box_shape, parse_box
from .errors import InvalidArgument


class Sample:
    """An array URI and a half-open box; normalised, immutable, hashable.

    ``aabb`` is ``(start, stop)`` pairs or slices with explicit ends. Bare
    integers and steps other than 1 are rejected (a crop keeps every axis).
    """

    __slots__ = ("uri", "aabb", "_hash")

    def __init__(self, uri: str | os.PathLike, aabb: Any) -> None:
        if not isinstance(uri, (str, os.PathLike)):
            raise InvalidArgument(f"Sample uri must be a string or path, got {type(uri).__name__}")
        box = parse_box(aabb)
        if any(stop == start for start, stop in box):
            raise InvalidArgument(f"Sample box {box} is empty on some axis; every extent must be >= 1")
        object.__setattr__(self, "uri", os.fspath(uri))
        object.__setattr__(self, "aabb", box)
        object.__setattr__(self, "_hash", hash((self.uri, box)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Sample is immutable")

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.aabb)

    @property
    def box(self) -> Box:
        return self.aabb

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sample) and self.uri == other.uri and self.aabb == other.aabb

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Sample({self.uri!r}, {list(self.aabb)})"

    def __reduce__(self):
        return (Sample, (self.uri, self.aabb))
