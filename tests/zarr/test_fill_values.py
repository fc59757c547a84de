"""Fill values of every dtype, v2 and v3, as zarr-python reads them."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import zarr

import stoker
from stoker.zarr.dtypes import parse_fill_value

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# fill values


def _bits(a: np.ndarray) -> int:
    return int(a.view(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("batch", ["float32", "bfloat16", "float16", "int16"])
def test_fill_value_as_gives_a_scalar_of_every_batch_dtype(batch):
    """Regression: a bfloat16 batch once failed on every absent chunk (the fill became shape (1,))."""
    import torch

    from stoker.engine.cast import fill_value_as

    fill = fill_value_as(parse_fill_value(-5, np.dtype("int16"), "i", 3), getattr(torch, batch))
    assert fill.shape == () and fill.dtype == getattr(torch, batch) and fill.item() == -5


@pytest.mark.parametrize("dtype", ["f2", "f4", "f8", ">f4", "<f8"])
@pytest.mark.parametrize("fmt", [2, 3])
def test_fill_value_special_floats(dtype, fmt):
    dt = np.dtype(dtype)
    nan = parse_fill_value("NaN", dt, "u", fmt)
    assert nan.shape == () and nan.dtype == dt.newbyteorder("=") and np.isnan(nan)
    assert parse_fill_value("Infinity", dt, "u", fmt)[()] == np.inf
    assert parse_fill_value("-Infinity", dt, "u", fmt)[()] == -np.inf
    assert parse_fill_value(1.5, dt, "u", fmt)[()] == 1.5
    assert parse_fill_value(-2, dt, "u", fmt)[()] == -2.0


@pytest.mark.parametrize("hexval,dtype,value", [
    ("0x7fc00000", "f4", None),       # canonical quiet NaN
    ("0x7fc00001", "f4", None),       # NaN with a payload: bits survive
    ("0x3f800000", "f4", 1.0),
    ("0x80000000", "f4", -0.0),
    ("0xff800000", "f4", -np.inf),
    ("0x7ff8000000000000", "f8", None),
    ("0x4000000000000000", "f8", 2.0),
    ("0x3c00", "f2", 1.0),
    ("0x7e00", "f2", None),
])
def test_fill_value_v3_hex_bit_patterns(hexval, dtype, value):
    got = parse_fill_value(hexval, np.dtype(dtype), "u", 3)
    assert got.dtype == np.dtype(dtype)
    assert _bits(got) == int(hexval, 16)
    if value is None:
        assert np.isnan(got)
    else:
        assert got[()] == value and np.signbit(got) == np.signbit(value)


@pytest.mark.parametrize("dtype", ["u1", "i2", "<u4", ">i8", "f4", "f8", "c8", "c16", "?"])
@pytest.mark.parametrize("fmt", [2, 3])
def test_fill_value_null_is_zero(dtype, fmt):
    got = parse_fill_value(None, np.dtype(dtype), "u", fmt)
    assert got.shape == () and got.dtype == np.dtype(dtype).newbyteorder("=")
    assert got[()] == 0 and not np.signbit(got.real)


def test_fill_value_bool_int_complex():
    assert parse_fill_value(True, np.dtype("?"), "u", 3)[()] is np.True_
    assert parse_fill_value(False, np.dtype("?"), "u", 2)[()] is np.False_
    assert parse_fill_value(2**64 - 1, np.dtype("u8"), "u", 3)[()] == 2**64 - 1
    assert parse_fill_value(-(2**63), np.dtype(">i8"), "u", 2)[()] == -(2**63)
    assert parse_fill_value(3.0, np.dtype("i4"), "u", 3)[()] == 3
    assert parse_fill_value([1.0, 2.0], np.dtype("c8"), "u", 3)[()] == 1 + 2j
    assert parse_fill_value([1.5, -0.25], np.dtype("c16"), "u", 2)[()] == 1.5 - 0.25j
    special = parse_fill_value(["NaN", "-Infinity"], np.dtype("c16"), "u", 3)[()]
    assert np.isnan(special.real) and special.imag == -np.inf
    hexed = parse_fill_value(["0x3f800000", "0x40000000"], np.dtype("c8"), "u", 3)
    assert hexed[()] == 1 + 2j and hexed.dtype == np.dtype("c8")
    # v2 may store integer fill values as base64 bytes
    assert parse_fill_value("AQAAAA==", np.dtype("<i4"), "u", 2)[()] == 1


@pytest.mark.parametrize("value,dtype", [("hello", "f4"), (1.5, "i4"), (300, "u1"), (-1, "u2"),
                                         ("nan", "f8"), ([1.0], "c8"), (["a", 0.0], "c16"),
                                         # hex of another width than the dtype's (zarr-python reads "0x7c00"
                                         # for a float32 as float16's inf), or not hex at all
                                         ("0x7c00", "f4"), ("0x3f80000000", "f4"), ("0x3f800000", "f8"),
                                         ("0x3c00", "c8"), ("0x7c_0", "f2"), ("0x7cg0", "f2"), ("0x", "f2")])
def test_fill_value_rejects(value, dtype):
    with pytest.raises(stoker.MetadataError, match="/arr.zarr"):
        parse_fill_value(value if dtype[0] != "c" or not isinstance(value, str) else [value, value],
                         np.dtype(dtype), "/arr.zarr", 3)


@pytest.mark.parametrize("dtype", [">i2", "<i2", ">u4", "<i8", "|i1"])
def test_v2_base64_integer_fill_values_are_bytes_in_the_array_s_byte_order(dtype):
    """A base64 fill value is one value's bytes as the array stores them (its dtype's byte order, as numpy's
    tobytes writes them); read back in the native order."""
    value = -300 if np.dtype(dtype).kind == "i" and np.dtype(dtype).itemsize > 1 else 100
    encoded = base64.standard_b64encode(np.array(value, dtype=dtype).tobytes()).decode()
    fill = parse_fill_value(encoded, np.dtype(dtype), "u", 2)
    assert fill[()] == value and fill.dtype == np.dtype(dtype).newbyteorder("=")


@pytest.mark.parametrize("value", ["AQAAAAIAAAA=", "AQA=", ""])  # two int32s, two bytes, none
def test_v2_base64_integer_fill_values_of_another_width_are_refused(value):
    """v2 integer fill values as base64 must hold one value's bytes: never the first of several."""
    with pytest.raises(stoker.MetadataError, match="/arr.zarr"):
        parse_fill_value(value, np.dtype("<i4"), "/arr.zarr", 2)


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf, -0.0, 1.25])
@pytest.mark.parametrize("fmt", [2, 3])
def test_fill_value_round_trip_through_zarr(tmp_path, fill, fmt):
    """zarr writes the fill value; stoker's parse of it reads back bit-identical fill chunks."""
    uri = str(tmp_path / "f.zarr")
    zarr.create_array(uri, shape=(4,), chunks=(2,), dtype="f4", zarr_format=fmt, fill_value=fill)
    got = stoker.open_array(uri).read([(0, 4)])
    want = zarr.open_array(uri)[...]
    assert got.view("u4").tolist() == want.view("u4").tolist()
    assert _bits(np.array(fill, dtype="f4")) == int(got.view("u4")[0])
