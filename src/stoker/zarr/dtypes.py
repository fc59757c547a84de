"""Zarr data types and fill values, for both format versions.

Only fixed-size numeric types are read (bool, signed and unsigned integers,
float16/32/64, complex64/128). Anything else raises
:class:`~stoker.errors.UnsupportedFormat` naming the type and the array.
"""

from __future__ import annotations

import base64
import math
import struct
import warnings
from typing import Any

import numpy as np

from ..errors import MetadataError, UnsupportedFormat
from .fields import show, string, wrong

# Zarr v3 core data type names -> numpy kinds (endianness comes from the `bytes` codec).
V3_DTYPES = {
    "bool": "?",
    "int8": "i1", "int16": "i2", "int32": "i4", "int64": "i8",
    "uint8": "u1", "uint16": "u2", "uint32": "u4", "uint64": "u8",
    "float16": "f2", "float32": "f4", "float64": "f8",
    "complex64": "c8", "complex128": "c16",
}

_SUPPORTED_KINDS = set("biufc")
_LARGEST = {"f": 8, "c": 16}  # bytes of float64 and complex128, the widest IEEE types Zarr names


def parse_v2_dtype(spec: Any, uri: str) -> np.dtype:
    """Parse a ``.zarray`` dtype (e.g. ``"<u2"``, ``">f4"``, ``"|b1"``); keeps the stored byte order."""
    if isinstance(spec, list):
        raise UnsupportedFormat(
            f"{uri}: structured dtype {show(spec)} is not supported; stoker reads numeric arrays only",
            uri=uri, dtype=spec,
        )
    string(spec, "dtype", uri)
    try:
        with warnings.catch_warnings():  # numpy warns about deprecated aliases ('a5') before refusing them here
            warnings.simplefilter("ignore", DeprecationWarning)
            dt = np.dtype(spec)
    except (TypeError, ValueError):
        raise UnsupportedFormat(f"{uri}: unknown dtype {show(spec)}", uri=uri, dtype=spec) from None
    if dt.kind not in _SUPPORTED_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise UnsupportedFormat(
            f"{uri}: dtype {show(spec)} is not supported; stoker reads bool, integer, float and complex arrays",
            uri=uri, dtype=spec,
        )
    refuse_long_double(dt, f"dtype {show(spec)}", uri)
    return dt


def refuse_long_double(dt: np.dtype, what: str, uri: str) -> None:
    """UnsupportedFormat for numpy's ``f16``/``c32``, the C long double: x87's 80 bits padded to 16 bytes on
    x86-64, IEEE quad on aarch64, so stored bytes of it mean other values on other machines (zarr-python 3 and
    tensorstore refuse the type). ``what`` names where the type was given (an array's dtype, a codec's)."""
    if dt.kind in "fc" and dt.itemsize > _LARGEST[dt.kind]:
        raise UnsupportedFormat(
            f"{uri}: {what} is numpy's extended precision (long double), whose bytes differ between machines; "
            "stoker reads float16/32/64 and complex64/128: convert the array to one of those",
            uri=uri, dtype=str(dt),
        )


def parse_v3_dtype(spec: Any, uri: str) -> np.dtype:
    """Parse a ``zarr.json`` ``data_type`` into a native-order numpy dtype."""
    if isinstance(spec, str) and spec in V3_DTYPES:
        return np.dtype(V3_DTYPES[spec])
    if not isinstance(spec, (str, dict)):  # a name, or an extension's {"name", "configuration"}
        raise wrong("data_type", spec, "a data type name", uri)
    raise UnsupportedFormat(
        f"{uri}: data_type {show(spec)} is not supported; stoker reads {', '.join(V3_DTYPES)}",
        uri=uri, dtype=spec,
    )


_SPECIAL_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _float_from(value: Any, dtype: np.dtype, uri: str) -> float:
    if isinstance(value, str):
        if value in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[value]
        if value.startswith("0x"):  # v3: the IEEE bit pattern, big-endian hex, two digits a byte
            digits = value[2:]
            if len(digits) != 2 * dtype.itemsize or not set(digits) <= _HEX_DIGITS:
                # (zarr-python reads "0x7c00" for a float32 as float16's inf, the bits say a subnormal: no guess)
                raise MetadataError(f"{uri}: fill_value {show(value)} is not the {dtype.itemsize}-byte bit pattern of "
                                    f"a {dtype} ('0x' and {2 * dtype.itemsize} hex digits, e.g. "
                                    f"{'0x' + '7fc00000'.ljust(2 * dtype.itemsize, '0')[:2 * dtype.itemsize]!r})",
                                    uri=uri)
            raw = bytes.fromhex(digits)
            return np.frombuffer(raw, dtype=dtype.newbyteorder(">"))[0]
        raise MetadataError(f"{uri}: fill_value {show(value)} is not a number", uri=uri)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


def _bool_fill(value: Any, uri: str, zarr_format: int) -> bool:
    """JSON true/false; zarr-python 2 also wrote 0 and 1 for bool arrays. Anything else is refused: Python's
    truthiness would read the string ``"false"`` as True."""
    if isinstance(value, bool):
        return value
    if zarr_format == 2 and isinstance(value, int) and value in (0, 1):
        return bool(value)
    allowed = "true, false, 0 or 1" if zarr_format == 2 else "true or false"
    raise MetadataError(f"{uri}: fill_value {show(value)} of a bool array must be {allowed}", uri=uri)


def parse_fill_value(value: Any, dtype: np.dtype, uri: str, zarr_format: int) -> np.ndarray:
    """Return the fill value as a 0-d array of ``dtype`` (native byte order).

    ``null`` (v2) means "no fill value": zarr-python then reads missing chunks
    as zeros, and so does stoker, so both readers agree.
    """
    native = dtype.newbyteorder("=")
    if value is None:
        return np.zeros((), dtype=native)
    if native.kind == "b":
        return np.array(_bool_fill(value, uri, zarr_format), dtype=native)
    if isinstance(value, bool):
        raise MetadataError(f"{uri}: fill_value {value!r} is a boolean, but the array holds {native}", uri=uri)
    try:
        if native.kind in "iu":
            if isinstance(value, str) and zarr_format == 2:  # v2 may store base64 bytes
                raw = base64.standard_b64decode(value)
                if len(raw) != dtype.itemsize:  # (one value's bytes: never the first of several, or a guess)
                    raise ValueError(f"base64 of {len(raw)} bytes, not the {dtype.itemsize} of one value")
                return np.frombuffer(raw, dtype=dtype).reshape(()).astype(native)
            if isinstance(value, float) and not value.is_integer():
                raise MetadataError(f"{uri}: fill_value {value!r} is not an integer", uri=uri)
            if not isinstance(value, (int, float)):
                raise TypeError(f"expected a number, got {type(value).__name__}")
            return np.array(int(value), dtype=native)
        if native.kind == "f":
            return np.array(_float_from(value, native, uri), dtype=native)
        if native.kind == "c":
            if isinstance(value, (list, tuple)) and len(value) == 2:
                part = np.dtype(f"f{native.itemsize // 2}")
                re, im = (_float_from(v, part, uri) for v in value)
                return np.array(complex(re, im), dtype=native)
            if not isinstance(value, (int, float)):
                raise TypeError(f"expected [real, imaginary] or a number, got {type(value).__name__}")
            return np.array(complex(value), dtype=native)
    except (ValueError, TypeError, OverflowError, struct.error) as exc:
        raise MetadataError(
            f"{uri}: fill_value {show(value)} cannot be represented as {native}: {str(exc)[:200]}", uri=uri
        ) from None
    raise UnsupportedFormat(f"{uri}: no fill value rule for dtype {dtype}", uri=uri)
