"""Where a sampler's anchors may lie: ``region={"time": ("2000-03-01", "2000-05-31"), 1: (10, 50)}``.

A region restricts the *anchor*, the index where a sample's box starts, per axis of the reference array
(an entry's first array): a box starts at an index inside the range, and may reach past the range's end
(a forecasting target at a later offset lies after its input's time; the anchor's time is what is
chosen). On top of that every box still lies inside its array.

- an axis number (``0``, or ``-3``) takes ``(start, stop)`` indices, half-open, as a slice (``None``: open);
- a dimension name (:func:`~stoker.reader.coords.dimension_names`) takes ``(first, last)`` labels of its
  coordinate array (:func:`~stoker.reader.coords.coordinate`), both included, as xarray's
  ``.sel(dim=slice(first, last))``: on ascending or descending coordinates (descending: ``first`` is the
  larger label, as in xarray); a date string on a time coordinate covers its whole period
  (``"2000-05-31"``: that day; ``"2000-05"``: that month), as pandas' partial dates do; a coordinate of time
  spans (a forecast's lead times) takes ``numpy.timedelta64`` or ``datetime.timedelta`` labels, in any unit.

>>> lo, count = anchor_ranges(["/data/era5.zarr/t2m"], [(1464, 181, 360)], (2, 181, 360),
...                           {"time": ("2000-03-01", "2000-05-31")})
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Sequence

import numpy as np

from ..errors import InvalidArgument, UnsupportedFormat


def _reference(entry: Any) -> str:
    return entry[0] if isinstance(entry, list) else entry


def _as_label(value: Any, coord: np.ndarray, what: str, uri: str, upper: bool) -> tuple[Any, bool]:
    """``value`` as a label comparable with ``coord``, and whether it is an exclusive bound (a date string's
    period ends before the next one starts)."""
    if coord.dtype.kind == "M":
        if isinstance(value, str):
            try:
                d = np.datetime64(value)
            except ValueError:
                raise InvalidArgument(f"{uri}: region {what} label {value!r} is not a date", uri=uri) from None
            unit = np.datetime_data(d.dtype)[0]
            return (d + np.timedelta64(1, unit), True) if upper else (d, False)
        if isinstance(value, (datetime.date, np.datetime64)) or hasattr(value, "to_datetime64"):
            return np.datetime64(value.to_datetime64() if hasattr(value, "to_datetime64") else value), False
        raise InvalidArgument(f"{uri}: region {what} label {value!r} is not a date; the coordinate holds dates",
                              uri=uri)
    if coord.dtype.kind == "m":
        if isinstance(value, (np.timedelta64, datetime.timedelta)):  # pandas' Timedelta is a datetime.timedelta
            return np.timedelta64(value.to_timedelta64() if hasattr(value, "to_timedelta64") else value), False
        raise InvalidArgument(f"{uri}: region {what} label {value!r} is not a time span (numpy.timedelta64 or "
                              "datetime.timedelta); the coordinate holds time spans", uri=uri)
    if coord.dtype.kind in "iuf":
        # numpy's timedelta64 is an integer type: its count, in whatever unit, is no label of numbers
        if isinstance(value, (bool, np.timedelta64)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise InvalidArgument(f"{uri}: region {what} label {value!r} is not a number; the coordinate holds "
                                  f"{coord.dtype} values", uri=uri)
        return value, False
    if coord.dtype == object and isinstance(value, str):  # cftime dates: parsed in their own calendar
        from ..zarr.cf import date_period, parse_date

        (y, mo, d, h, mi, s, _), _ = parse_date(value, uri, f"region {what} label")
        label = type(coord[0])(y, mo, d, h, mi, s, calendar=coord[0].calendar)
        period = date_period(value) if upper else None
        # an upper label covers its whole period (a day, a minute), as xarray's partial dates on a CFTimeIndex
        return (label + period, True) if period is not None else (label, False)
    return value, False


def label_range(coord: np.ndarray, first: Any, last: Any, uri: str, name: str) -> tuple[int, int]:
    """The half-open index range of the labels from ``first`` to ``last`` (both included) in ``coord``."""
    n = len(coord)
    try:
        with np.errstate(invalid="ignore"):
            steps = coord[1:] >= coord[:-1] if n > 1 else np.ones(0, bool)
            back = coord[1:] <= coord[:-1] if n > 1 else np.ones(0, bool)
    except TypeError:
        steps = back = np.zeros(1, bool)
    ascending, descending = bool(np.all(steps)), bool(np.all(back))
    if not ascending and not descending:
        raise InvalidArgument(
            f"{uri}: the coordinate {name!r} is not sorted (or holds NaN/NaT), so a label range has no index "
            f"range; give the region by index instead: region={{axis: (start, stop)}}", uri=uri, dimension=name)
    what = f"{name!r}"
    if ascending:
        start, stop = _label_span(coord, first, last, what, uri)
        if stop < start:  # labels of the coordinate lie between them, in the other order
            _reversed(first, last, "ascending", what, uri)
        return start, max(start, stop)
    # descending: labels from first down to last, as xarray's slice on such an index
    j0, j1 = _label_span(coord[::-1], last, first, what, uri)
    if j1 < j0:
        _reversed(first, last, "descending", what, uri)
    return n - max(j0, j1), n - j0


def _reversed(first: Any, last: Any, order: str, what: str, uri: str) -> None:
    """InvalidArgument for region labels given in the reverse of their coordinate's order: they select nothing
    (as xarray's ``sel`` would), which the sampler would report only as a region to widen."""
    raise InvalidArgument(f"{uri}: region {what} labels ({first!r}, {last!r}): {first!r} comes after {last!r} in the "
                          f"coordinate's {order} order, so they select nothing (as xarray's sel would); give them "
                          f"as ({last!r}, {first!r})", uri=uri)


def _label_span(ascending: np.ndarray, low_label: Any, high_label: Any, what: str, uri: str) -> tuple[int, int]:
    """``(first index >= low_label, end of the indices <= high_label)`` in the ascending coordinate values
    (a label that is a whole day or month covers it: ``_as_label``)."""
    low, _ = _as_label(low_label, ascending, what, uri, upper=False)
    high, high_excl = _as_label(high_label, ascending, what, uri, upper=True)
    try:
        return (int(np.searchsorted(ascending, low, side="left")),
                int(np.searchsorted(ascending, high, side="left" if high_excl else "right")))
    except TypeError:
        raise InvalidArgument(f"{uri}: region {what} labels {(low_label, high_label)!r} cannot be compared with "
                              f"the coordinate's {ascending.dtype} values", uri=uri) from None


def _pair(value: Any, key: Any, uri: str) -> tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidArgument(f"{uri}: region[{key!r}] must be a pair (start, stop) or (first, last label), got "
                              f"{value!r}", uri=uri)
    return value[0], value[1]


def index_ranges(region: dict, uri: str, shape: tuple[int, ...], reader_of: Any, names_of: Any,
                 coord_of: Any) -> list[tuple[int, int]]:
    """Per axis of an array of ``shape``, the half-open index range ``region`` allows (whole axes where it
    says nothing). ``reader_of()`` opens the array, ``names_of(reader)`` reads its dimension names and
    ``coord_of(reader, name)`` the coordinate of the dimension a region names
    (:func:`~stoker.reader.coords.coordinate`), asked only for dimension names."""
    ndim = len(shape)
    out = [(0, s) for s in shape]
    for key, value in region.items():
        first, last = _pair(value, key, uri)
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            axis = int(key)
            if not -ndim <= axis < ndim:
                raise InvalidArgument(f"{uri}: region axis {axis} is outside the array's {ndim} axes", uri=uri)
            axis %= ndim
            for v in (first, last):
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                    raise InvalidArgument(f"{uri}: region[{key}] takes integer indices (start, stop), got "
                                          f"{value!r}; labels go under the dimension's name", uri=uri)
            start, stop, _ = slice(first, last).indices(shape[axis])
        elif isinstance(key, str):
            reader = reader_of()
            names = names_of(reader)
            if not names or key not in names:
                raise InvalidArgument(
                    f"{uri}: region names the dimension {key!r}, but the array's dimensions are "
                    f"{list(names) if names else 'not named'} (v3 dimension_names, or xarray's _ARRAY_DIMENSIONS); "
                    "give the region by axis number: region={axis: (start, stop)}", uri=uri, dimension=key)
            axis = names.index(key)
            try:
                coord = coord_of(reader, key)
            except UnsupportedFormat as exc:
                raise UnsupportedFormat(
                    f"{uri}: region names the dimension {key!r}, whose coordinate array stoker cannot read as "
                    f"labels ({exc}); give the region by axis number: region={{{axis}: (start, stop)}}",
                    uri=uri, dimension=key) from exc
            if coord is None:
                raise InvalidArgument(
                    f"{uri}: region names the dimension {key!r}, but no coordinate array {key!r} of length "
                    f"{shape[axis]} lies beside the array in its group; give the region by axis number: "
                    f"region={{{axis}: (start, stop)}}", uri=uri, dimension=key)
            start, stop = label_range(coord, first, last, uri, key)
        else:
            raise InvalidArgument(f"{uri}: region keys are axis numbers or dimension names, got {key!r}", uri=uri)
        lo, hi = out[axis]
        out[axis] = (max(lo, start), max(max(lo, start), min(hi, stop)))
    return out


def anchor_ranges(entries: Sequence[Any], shapes: Sequence[tuple[int, ...]], sample_shape: Sequence[int],
                  region: dict, storage_options: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(first anchor, anchor count)`` per entry and axis, ``(n, ndim)`` int64 each: the box starts a
    sampler may draw in each entry's reference array under ``region`` (a count of 0: none)."""
    from ..reader.array import open_array
    from ..reader.coords import coordinate, dimension_names
    from ..storage.locate import Stores, check_options_by_prefix, options_for

    if not isinstance(region, dict) or not region:
        raise InvalidArgument(f"region must be a non-empty dict of axis numbers or dimension names to ranges, got "
                              f"{region!r}")
    by_prefix = check_options_by_prefix(storage_options, "storage_options")
    stores = Stores()
    los, counts = [], []
    try:
        for entry, shape in zip(entries, shapes):
            uri = os.fspath(_reference(entry))
            opened: list = []

            def reader_of(uri: str = uri, opened: list = opened) -> Any:
                if not opened:
                    opened.append(open_array(uri, options_for(by_prefix, uri), stores=stores))
                return opened[0]

            def coord_of(reader: Any, name: str, uri: str = uri) -> Any:  # beside it, opened with its options
                return coordinate(reader, name, options_for(by_prefix, uri), stores)

            def names_of(reader: Any, uri: str = uri) -> Any:
                return dimension_names(reader, stores, options_for(by_prefix, uri))

            ranges = index_ranges(region, uri, tuple(shape), reader_of, names_of, coord_of)
            lo = [start for start, _ in ranges]
            # a box starting at i fits when i + crop <= the axis' length
            hi = [min(stop, s - c + 1) for (_, stop), s, c in zip(ranges, shape, sample_shape)]
            los.append(lo)
            counts.append([max(0, h - lo_) for h, lo_ in zip(hi, lo)])
    finally:
        stores.close()
    return np.array(los, np.int64), np.array(counts, np.int64)
