"""What ``compute_stats`` of arrays is asked for: the entries (arrays, channel lists, fields) and the region.

    >>> parse_entries("/data/a.zarr")
    ('one', [Entry(key=None, uris=('/data/a.zarr',), channels=False)])
    >>> parse_entries({"raw": ["/d/r.zarr/0", "/d/g.zarr/0"], "labels": "/d/l.zarr"})[1][0].channels
    True
    >>> parse_region({0: (10, 20), -1: (None, 64)}, (100, 50, 128), "/data/a.zarr")
    ((10, 20), (0, 50), (0, 64))

An entry is one array (scalar statistics) or a list of arrays (one channel each, statistics of shape
``(C,)``, as a ``Sample([a, b], box)`` stacks them on the batch's axis 1). A field is any object with an
``arrays`` attribute (``stoker.Field``): its arrays are the entry; its shape, offset and scale say where crops
are read, not which values the arrays hold, so they play no part here.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Mapping, NamedTuple, Sequence

from ..errors import InvalidArgument, OutOfBounds


class Entry(NamedTuple):
    """One result: ``key`` (the name of a dict input, the position in a list, None for one array), its
    arrays' ``uris`` and whether it has channels (a list of arrays: statistics per array, shape ``(C,)``)."""

    key: Any
    uris: tuple[str, ...]
    channels: bool


def _uri(value: Any, where: str) -> str:
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    raise InvalidArgument(f"compute_stats: {where} must be an array URI (str or path), got {type(value).__name__}")


def _entry(key: Any, value: Any, where: str) -> Entry:
    if hasattr(value, "arrays") and not isinstance(value, (str, os.PathLike)):
        value = value.arrays  # a stoker.Field (or anything that names its arrays so)
    if isinstance(value, (str, os.PathLike)):
        return Entry(key, (_uri(value, where),), False)
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        uris = tuple(_uri(v, f"{where}[{i}]") for i, v in enumerate(value))
        if not uris:
            raise InvalidArgument(f"compute_stats: {where} is an empty list of arrays; name at least one")
        return Entry(key, uris, True)
    raise InvalidArgument(f"compute_stats: {where} must be an array URI, a list of them (channels) or a "
                          f"stoker.Field, got {type(value).__name__}")


def parse_entries(arrays_or_fields: Any) -> tuple[str, list[Entry]]:
    """``(kind, entries)``: kind ``"one"`` (one URI or one field: one result), ``"list"`` (a list: a list of
    results, each item a URI or a list of URIs) or ``"dict"`` (name -> URI, list of URIs or field)."""
    x = arrays_or_fields
    if isinstance(x, (str, os.PathLike)) or hasattr(x, "arrays"):
        return "one", [_entry(None, x, "the array")]
    if isinstance(x, Mapping):
        if not x:
            raise InvalidArgument("compute_stats: the dict of fields is empty")
        return "dict", [_entry(name, value, f"field {name!r}") for name, value in x.items()]
    if isinstance(x, Sequence) and not isinstance(x, (bytes, bytearray)):
        if not x:
            raise InvalidArgument("compute_stats: the list of arrays is empty")
        return "list", [_entry(i, value, f"entry {i}") for i, value in enumerate(x)]
    raise InvalidArgument(f"compute_stats takes an array URI, a list of them (a list inside it: channels), a "
                          f"dict of name -> URI(s) or stoker.Field, or a ZarrRecords; got {type(x).__name__}")


Box = tuple[tuple[int, int], ...]


def parse_region(region: Any, shape: Sequence[int], uri: str, reader: Any = None,
                 storage_options: dict | None = None) -> Box:
    """The index box ``region`` selects in an array of ``shape``: a dict axis -> ``(start, stop)`` (half-open;
    negative axes count from the end; ``None`` for an open end); axes it leaves out are whole. Ranges
    outside the array are an :class:`~stoker.errors.OutOfBounds` naming the array.

    A dimension name -> ``(first, last)`` takes labels of that dimension's coordinates, both included, as
    ``RandomCrops(region=...)`` does (:func:`stoker.sampling.region.index_ranges`: xarray's
    ``.sel(dim=slice(first, last))``, dates covering their whole period); it needs ``reader`` (the opened
    array, whose dimension names and coordinate arrays beside it are read with ``storage_options``)."""
    box = [(0, int(n)) for n in shape]
    if region is None:
        return tuple(box)
    if not isinstance(region, Mapping):
        raise InvalidArgument(f"compute_stats: region must be a dict axis -> (start, stop), got "
                              f"{type(region).__name__}", knob="region")
    for axis, bounds in region.items():
        if isinstance(axis, str):
            a, (start, stop) = _labels(axis, bounds, shape, uri, reader, storage_options)
            if not start < stop:
                raise OutOfBounds(f"compute_stats: region[{axis!r}] = {bounds!r} holds no label of {uri}'s "
                                  f"{axis!r} coordinate; choose labels inside its range", knob="region", uri=uri)
            box[a] = (start, stop)
            continue
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise InvalidArgument(f"compute_stats: region axes must be ints, got {axis!r}", knob="region")
        if not -len(shape) <= axis < len(shape):
            raise InvalidArgument(f"compute_stats: region axis {axis} does not exist in {uri} ({len(shape)} axes)",
                                  knob="region", uri=uri)
        a = axis % len(shape)
        try:
            start, stop = bounds
        except (TypeError, ValueError):
            raise InvalidArgument(f"compute_stats: region[{axis}] must be (start, stop), got {bounds!r}",
                                  knob="region") from None
        start = 0 if start is None else start
        stop = int(shape[a]) if stop is None else stop
        for v in (start, stop):  # numpy integers too (what pandas' and xarray's index lookups return)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise InvalidArgument(f"compute_stats: region[{axis}] bounds must be ints, got {bounds!r}",
                                      knob="region")
        start, stop = int(start), int(stop)  # plain ints: the box is part of the cache's JSON
        if not 0 <= start < stop <= shape[a]:
            raise OutOfBounds(f"compute_stats: region[{axis}] = ({start}, {stop}) is empty or outside axis {a} "
                              f"of {uri} (length {shape[a]}); need 0 <= start < stop <= {shape[a]}",
                              knob="region", uri=uri)
        box[a] = (start, stop)
    return tuple(box)


def _labels(name: str, bounds: Any, shape: Sequence[int], uri: str, reader: Any,
            storage_options: dict | None) -> tuple[int, tuple[int, int]]:
    """``(axis, (start, stop))``: the index range of dimension ``name``'s labels ``bounds`` in ``reader``'s array."""
    from ..reader.coords import coordinate, dimension_names
    from ..sampling.region import index_ranges

    if reader is None:
        raise InvalidArgument(f"compute_stats: region by dimension name ({name!r}) needs the opened array of {uri}",
                              knob="region", uri=uri)
    ranges = index_ranges({name: bounds}, uri, tuple(shape), lambda: reader,
                          lambda r: dimension_names(r, None, storage_options),
                          lambda r, key: coordinate(r, key, storage_options))
    axis = list(dimension_names(reader, None, storage_options) or ()).index(name)
    return axis, ranges[axis]


__all__ = ["Box", "Entry", "parse_entries", "parse_region"]
