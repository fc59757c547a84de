"""CF conventions as xarray applies them to Zarr arrays: packed values, fill values, encoded times.

Pure: attributes in, rules and numbers out (the reads are :mod:`stoker.reader.coords`'s).

- :func:`coding_of`: what an array's attributes ask to be applied to its values: ``scale_factor``,
  ``add_offset``, ``_FillValue`` and ``missing_value`` (values equal to one become NaN). Where xarray takes
  the fill value from (its zarr backend's rules): v2, the ``.zarray`` ``fill_value`` of an array xarray wrote
  (it carries ``_ARRAY_DIMENSIONS``), else the ``_FillValue`` attribute; v3, the ``_FillValue`` attribute
  (floats as base64 of a little-endian float64, as xarray writes them). A NaN fill changes nothing and is
  left out, so a float array whose only fill is NaN has no coding; so is a fill no stored value can equal
  (xarray compares in float64: a float32 array's 0.1, a uint8's -1).
- :func:`decode_times`: CF-encoded times (``units: "days since 2000-01-01"``, ``calendar``) as xarray decodes
  them: ``standard``, ``gregorian`` (dates from 1582-10-15) and ``proleptic_gregorian`` to
  ``datetime64[ns]``; other calendars through cftime when it is installed, else
  :class:`~stoker.errors.UnsupportedFormat` naming the calendar.

>>> c = coding_of({"scale_factor": 0.01, "add_offset": 50.0, "_FillValue": -32767}, np.dtype("int16"), 3)
>>> c.decode(np.array([0, 100, -32767], np.int16))
array([50., 51., nan], dtype=float32)
"""

from __future__ import annotations

import base64
import datetime
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import MetadataError, UnsupportedFormat
from .dtypes import parse_fill_value
from .fields import show

#: The attributes that change an array's values when CF decoding is on (Config.cf).
CF_ATTRIBUTES = ("scale_factor", "add_offset", "_FillValue", "missing_value")
#: Calendars decoded to numpy datetime64 (xarray's "standard" calendars).
NUMPY_CALENDARS = ("standard", "gregorian", "proleptic_gregorian")
_UNITS_NS = {"nanoseconds": 1, "microseconds": 1_000, "milliseconds": 1_000_000, "seconds": 10**9,
             "minutes": 60 * 10**9, "hours": 3600 * 10**9, "days": 86400 * 10**9}
_DATE = re.compile(r"^\s*(-?\d{1,4})-(\d{1,2})-(\d{1,2})(?:[ T](\d{1,2}):(\d{1,2})(?::(\d{1,2})(\.\d+)?)?)?"
                   r"\s*(Z|UTC|[+-]\d{1,2}(?::?\d{2})?)?\s*$")
_GREGORIAN_START = (1582, 10, 15)  # the mixed calendars are Julian before it (not a datetime64[ns]: out of range)


@dataclass(frozen=True)
class CFCoding:
    """What decoding does to an array's values: values equal to one of ``fills`` (compared in the values'
    dtype, as numpy compares them with a Python number; an integer array's fills are ints, exact past 2**53,
    as xarray keeps a ``_FillValue`` of 2**64 - 1) become NaN, the rest are multiplied by ``scale`` and
    shifted by ``offset`` (``None``: not given) in ``arithmetic``, as xarray does with the attributes of a
    Zarr array, then rounded to the output dtype. ``arithmetic`` is float64 (JSON numbers are float64, and
    xarray decodes packed values in their type) but for a float variable whose fill attributes are all NaN:
    xarray's mask step then leaves it in its own dtype, and its scale step computes in that dtype, each step
    rounded (``float32``, ``float16``)."""

    scale: float | None
    offset: float | None
    fills: tuple[float | int, ...]
    arithmetic: str = "float64"

    def decode(self, values: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
        """``values`` decoded, as a new array of the float ``dtype``."""
        values = np.asarray(values)
        work = np.dtype(self.arithmetic)
        out = values.astype(work)
        if self.scale is not None:
            out *= work.type(self.scale)
        if self.offset is not None:
            out += work.type(self.offset)
        if self.fills:
            # in the values' own dtype: an integer array's fills are ints it holds (coding_of), exact past 2**53,
            # where a float64 of 2**64 - 1 cast back is no uint64
            fills = np.asarray(self.fills, dtype=values.dtype if values.dtype.kind in "iu" else np.float64)
            with np.errstate(invalid="ignore", over="ignore"):
                out[np.isin(values, fills.astype(values.dtype))] = np.nan
        return out.astype(dtype)

    def describe(self) -> str:
        """One line for messages and ``stoker inspect``."""
        parts = [f"scale_factor={self.scale!r}"] if self.scale is not None else []
        parts += [f"add_offset={self.offset!r}"] if self.offset is not None else []
        parts += [f"missing={list(self.fills)!r}"] if self.fills else []
        return ", ".join(parts)


def _number(value: Any, name: str, uri: str) -> float:
    if isinstance(value, list) and len(value) == 1:  # netCDF writers store attributes as 1-element arrays
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MetadataError(f"{uri}: attribute {name} {show(value)} is not a number", uri=uri, attribute=name)
    return float(value)


def _fill_attribute(value: Any, dtype: np.dtype, uri: str, name: str) -> list[float | int]:
    """A ``_FillValue`` or ``missing_value`` attribute as numbers (xarray's FillValueCoder for floats in v3:
    base64 of a little-endian float64; NaN spelled as a string); a JSON integer for an integer array as an int
    (exact: 2**64 - 1, uint64's "no id", is no float64)."""
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if isinstance(item, str) and item in ("NaN", "Infinity", "-Infinity"):
            out.append(float(item.replace("Infinity", "inf")))
        elif isinstance(item, str) and dtype.kind == "f":
            try:
                raw = base64.standard_b64decode(item)
                out.append(struct.unpack("<d", raw)[0] if len(raw) == 8 else
                           float(np.frombuffer(raw, dtype=dtype.newbyteorder("<"))[0]))
            except (ValueError, struct.error, IndexError):
                raise MetadataError(f"{uri}: attribute {name} {show(item)} is neither a number nor base64 of a "
                                    "float", uri=uri, attribute=name) from None
        elif dtype.kind in "iu" and isinstance(item, int) and not isinstance(item, bool):
            out.append(item)
        else:
            out.append(_number(item, name, uri))
    return out


#: the attributes :func:`coding_of` reads (beside a v2 array's ``_ARRAY_DIMENSIONS`` with its stored fill value)
_CF_KEYS = frozenset(CF_ATTRIBUTES) | {"_Unsigned"}


def coding_of(attrs: dict, dtype: np.dtype, zarr_format: int, zarr_fill: Any = None, uri: str = "") -> CFCoding | None:
    """The CF coding ``attrs`` (an array's attributes) ask for, or None when decoding changes nothing.
    ``zarr_fill`` is a v2 array's ``.zarray`` ``fill_value`` as stored (JSON), which xarray takes for
    ``_FillValue`` in the arrays it writes (those with ``_ARRAY_DIMENSIONS``). ``_Unsigned`` (signed integers
    stored for unsigned values, which xarray reinterprets) is not decoded: UnsupportedFormat, never the signed
    values read as if decoded."""
    if not _CF_KEYS.intersection(attrs) and not (zarr_format == 2 and "_ARRAY_DIMENSIONS" in attrs
                                                 and zarr_fill is not None):
        # no attribute of CF's (most arrays): nothing to decode, told before any dtype is looked at (an open of
        # each array new to a pipeline asks, under the GIL, on the thread that plans its batches)
        return None
    unsigned = attrs.get("_Unsigned")
    if unsigned is not None and str(unsigned).lower() in ("true", "false") and \
            (np.dtype(dtype).kind == "i") == (str(unsigned).lower() == "true"):
        raise UnsupportedFormat(
            f"{uri}: its _Unsigned={show(unsigned)} attribute asks for its {np.dtype(dtype)} values to be read as "
            "the other signedness, which stoker does not decode yet; read the stored values with Config(cf=False) "
            "(and reinterpret them), or store the array in its real dtype", uri=uri)
    scale = _number(attrs["scale_factor"], "scale_factor", uri) if attrs.get("scale_factor") is not None else None
    offset = _number(attrs["add_offset"], "add_offset", uri) if attrs.get("add_offset") is not None else None
    fills: list[float | int] = []
    if zarr_format == 2 and "_ARRAY_DIMENSIONS" in attrs and zarr_fill is not None:
        stored = parse_fill_value(zarr_fill, dtype, uri, 2)[()]
        fills.append(int(stored) if np.dtype(dtype).kind in "iu" else float(stored.real))
    elif attrs.get("_FillValue") is not None:
        fills += _fill_attribute(attrs["_FillValue"], dtype, uri, "_FillValue")
    if attrs.get("missing_value") is not None:
        fills += _fill_attribute(attrs["missing_value"], dtype, uri, "missing_value")
    kept = tuple(dict.fromkeys(f for f in fills if f == f))  # a NaN fill is NaN already: nothing to mask
    # xarray masks no NaN fill, and then scales a float variable in its own dtype (see CFCoding)
    own = np.dtype(dtype).kind == "f" and fills and not kept and np.dtype(dtype).itemsize < 8
    masked = tuple(f for f in kept if _can_equal(f, np.dtype(dtype), uri))
    if scale is None and offset is None and not masked:
        return None
    return CFCoding(scale, offset, masked, np.dtype(dtype).name if own else "float64")


def check_integer_fill(fill: float | int, dtype: np.dtype, uri: str) -> None:
    """MetadataError for a ``fill`` of an array of integer ``dtype`` that is not an integer (see
    :func:`_can_equal`; :func:`coding_of` leaves NaN fills out before)."""
    if not isinstance(fill, int) and not fill.is_integer():
        raise MetadataError(f"{uri}: its fill value {fill!r} (_FillValue or missing_value) is not an integer, "
                            f"but the array holds {dtype}; store the integer that marks missing values",
                            uri=uri, attribute="_FillValue")


def _can_equal(fill: float | int, dtype: np.dtype, uri: str) -> bool:
    """Whether a stored value of ``dtype`` can equal ``fill`` (a float64) as xarray compares them (in float64):
    a float32 array's ``_FillValue: 0.1`` never does (its values near it are 0.10000000149...), nor a uint8's
    -1; compared in float32 instead, 0.1 would mask them. A fractional fill of an integer array is refused:
    xarray masks its truncation in Zarr format 3 and nothing in format 2, and stoker does not guess."""
    if dtype.kind == "f":
        with np.errstate(over="ignore"):
            return float(dtype.type(fill)) == fill
    if dtype.kind in "iu":
        check_integer_fill(fill, dtype, uri)
        info = np.iinfo(dtype)
        return info.min <= fill <= info.max
    return True


def date_period(text: str) -> datetime.timedelta | None:
    """How long the period a CF date string names lasts, at the precision it is written in: a day for
    ``2000-01-01``, a minute for ``2000-01-01 06:00``, a second for ``... 06:00:00``; None for a fractional
    second (an instant) or a string that is no such date.

    >>> date_period("2000-01-31"), date_period("2000-01-31 06:30")
    (datetime.timedelta(days=1), datetime.timedelta(seconds=60))
    """
    m = _DATE.match(text)
    if m is None or m.group(7):
        return None
    return datetime.timedelta(days=1) if m.group(4) is None else \
        datetime.timedelta(minutes=1) if m.group(6) is None else datetime.timedelta(seconds=1)


def parse_date(text: str, uri: str = "", what: str = "date") -> tuple[tuple[int, ...], int]:
    """``(year, month, day, hour, minute, second, nanosecond)`` and the UTC offset in minutes of a CF date
    (``2000-01-01``, ``2000-1-1 06:00:00``, ``2000-01-01T00:00:00Z``, ``... +01:00``)."""
    m = _DATE.match(text)
    if m is None:
        raise MetadataError(f"{uri}: {what} {show(text)} is not a date like 2000-01-01 or 2000-01-01 00:00:00",
                            uri=uri)
    y, mo, d, h, mi, s, frac, tz = m.groups()
    ns = int(round(float(frac) * 1e9)) if frac else 0
    offset = 0
    if tz and tz not in ("Z", "UTC"):
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        hours, minutes = (digits[:-2], digits[-2:]) if len(digits) > 2 else (digits, "0")
        offset = sign * (int(hours) * 60 + int(minutes))
    return (int(y), int(mo), int(d), int(h or 0), int(mi or 0), int(s or 0), ns), offset


def _units(units: Any, uri: str) -> tuple[str, str]:
    if not isinstance(units, str) or " since " not in units:
        raise MetadataError(f"{uri}: units {show(units)} are not CF time units like 'days since 2000-01-01'",
                            uri=uri)
    step, ref = units.split(" since ", 1)
    step = step.strip().lower()
    step = step if step.endswith("s") else step + "s"
    return step, ref.strip()


def is_time_units(units: Any) -> bool:
    """Whether ``units`` are CF time units (``<unit> since <date>``) that xarray decodes as times."""
    if not isinstance(units, str) or " since " not in units:
        return False
    return units.split(" since ", 1)[0].strip().lower().rstrip("s") + "s" in _UNITS_NS


def _nat_sentinel(values: np.ndarray) -> np.ndarray:
    """Where integer ``values`` hold the int64 minimum: numpy's NaT, which xarray writes for a missing date or
    time span (without a ``_FillValue``) and reads back as NaT."""
    if values.dtype != np.int64:
        return np.zeros(values.shape, bool)
    return values == np.iinfo(np.int64).min


def timedelta_dtype(attrs: dict) -> np.dtype | None:
    """The ``timedelta64`` dtype xarray decodes a variable to (time spans such as a forecast's lead times):
    the one its ``dtype`` attribute names, beside ``units`` that are a time unit alone (``"hours"``), as
    xarray writes them; None for any other variable (xarray decodes no units alone, without that attribute)."""
    kind, units = attrs.get("dtype"), attrs.get("units")
    if not isinstance(kind, str) or not kind.startswith("timedelta64") or not isinstance(units, str) or \
            " since " in units:
        return None
    try:
        dtype = np.dtype(kind)
    except TypeError:
        return None
    return dtype if dtype.kind == "m" else None


def decode_timedeltas(values: np.ndarray, units: str, dtype: np.dtype, uri: str = "") -> np.ndarray:
    """CF-encoded time spans (``units``: ``"hours"``, ``"days"``...) as xarray decodes them, in ``dtype``
    (:func:`timedelta_dtype`; NaN: NaT).

    >>> decode_timedeltas(np.array([0, 6]), "hours", np.dtype("timedelta64[s]"))
    array([    0, 21600], dtype='timedelta64[s]')
    """
    step = units.strip().lower()
    step = step if step.endswith("s") else step + "s"
    if step not in _UNITS_NS:
        raise UnsupportedFormat(f"{uri}: time span units {units!r}: stoker decodes {', '.join(_UNITS_NS)}",
                                uri=uri, units=units)
    unit, values = _UNITS_NS[step], np.asarray(values)
    if values.dtype.kind in "iu":
        out = (values.astype(np.int64) * unit).astype("timedelta64[ns]")
        out[_nat_sentinel(values)] = np.timedelta64("NaT")
    else:
        bad = ~np.isfinite(values)
        out = np.round(np.where(bad, 0, values).astype(np.float64) * unit).astype(np.int64).astype("timedelta64[ns]")
        out[bad] = np.timedelta64("NaT")
    return out.astype(dtype)


def decode_times(values: np.ndarray, units: str, calendar: Any = None, uri: str = "") -> np.ndarray:
    """CF-encoded times as xarray decodes them: ``datetime64[ns]`` for the standard calendars (NaN: NaT),
    else cftime dates where cftime is installed (UnsupportedFormat naming the calendar otherwise).

    >>> decode_times(np.array([0, 59]), "days since 2000-01-01")
    array(['2000-01-01T00:00:00.000000000', '2000-02-29T00:00:00.000000000'], dtype='datetime64[ns]')
    """
    step, ref = _units(units, uri)
    if step not in _UNITS_NS:
        raise UnsupportedFormat(f"{uri}: time units {units!r}: stoker decodes {', '.join(_UNITS_NS)} since a date",
                                uri=uri, units=units)
    cal = "standard" if calendar is None else str(calendar).lower()
    (y, mo, d, h, mi, s, ns), tz = parse_date(ref, uri, f"the reference date of units {units!r}")
    values = np.asarray(values)
    if cal in NUMPY_CALENDARS:
        if cal != "proleptic_gregorian" and (y, mo, d) < _GREGORIAN_START:
            return _cftime(values, units, cal, uri)  # the mixed Julian/Gregorian calendar: cftime's, as xarray
        try:
            start = (np.datetime64(f"{y:04d}-{mo:02d}-{d:02d}", "ns") + np.timedelta64(h * 3600 + mi * 60 + s, "s")
                     + np.timedelta64(ns, "ns") - np.timedelta64(tz, "m"))
        except ValueError:
            raise MetadataError(f"{uri}: the reference date {ref!r} of units {units!r} is not a date", uri=uri) \
                from None
        unit = _UNITS_NS[step]
        if values.dtype.kind in "iu":
            bad = _nat_sentinel(values)  # xarray's missing date: multiplied out it wraps to a real one
            offsets = np.where(bad, 0, values).astype(np.int64) * unit
        else:
            bad = ~np.isfinite(values)
            offsets = np.round(np.where(bad, 0, values).astype(np.float64) * unit).astype(np.int64)
        out = start + offsets.astype("timedelta64[ns]")
        out[bad] = np.datetime64("NaT")
        return out
    return _cftime(values, units, cal, uri)


def _cftime(values: np.ndarray, units: str, calendar: str, uri: str) -> np.ndarray:
    try:
        import cftime
    except ImportError:
        raise UnsupportedFormat(
            f"{uri}: times in the {calendar!r} calendar (units {units!r}) are not numpy dates; xarray decodes them "
            "with cftime: pip install cftime, or give the region by index (region={axis: (start, stop)})",
            uri=uri, calendar=calendar) from None
    return np.asarray(cftime.num2date(values, units, calendar=calendar))
