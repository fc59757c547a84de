"""Fill attributes (``_FillValue``, ``missing_value``) that no stored value can equal, compared as xarray compares
them (in float64): a float32 array's ``_FillValue: 0.1`` masks nothing (its values near it are 0.10000000149...,
which a float32 comparison would have masked), nor does a uint8's -1 or 256; a fractional fill of an integer
array is refused (xarray masks its truncation in Zarr format 3 and nothing in format 2). xarray
(``mask_and_scale=True``) is the oracle of the values."""

from __future__ import annotations

import base64
import os
import struct

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.zarr.cf import coding_of

xr = pytest.importorskip("xarray")

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:variable .* has multiple fill values")]

CASES = {  # name: dtype, fill attributes, stored values
    "f4_fill": ("float32", {"_FillValue": 0.1}, [0.1, 0.2, 0.1, -9999.0]),
    "f4_missing": ("float32", {"missing_value": 0.1, "_FillValue": -9999.0}, [0.1, 0.2, 0.1, -9999.0]),
    "f2_fill": ("float16", {"_FillValue": -9999.0}, [-9999.0, 1.0, 2.0, 3.0]),  # float16 holds -10000 there
    "u1_neg": ("uint8", {"_FillValue": -1}, [0, 1, 255, 254]),
    "u1_big": ("uint8", {"missing_value": 256, "_FillValue": 254}, [0, 1, 255, 254]),
}


@pytest.fixture(scope="module", params=[2, 3])
def group(request, tmp_path_factory):
    """CASES as arrays of one group, in Zarr format ``param``, with xarray's dimension names."""
    fmt = request.param
    path = str(tmp_path_factory.mktemp("fills") / f"g{fmt}.zarr")
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    for name, (dtype, attrs, values) in CASES.items():
        dims = {"dimension_names": ["x"]} if fmt == 3 else {}
        z = g.create_array(name, shape=(4,), chunks=(2,), dtype=dtype, fill_value=None if fmt == 2 else 0, **dims)
        z[:] = np.array(values, dtype=dtype)
        attrs = dict(attrs)
        if fmt == 3 and dtype.startswith("float") and "_FillValue" in attrs:  # xarray's v3 float encoding
            attrs["_FillValue"] = base64.standard_b64encode(struct.pack("<d", attrs["_FillValue"])).decode()
        if fmt == 2:
            attrs["_ARRAY_DIMENSIONS"] = ["x"]
        z.attrs.update(attrs)
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_fills_no_value_can_equal_mask_nothing_as_in_xarray(group, decode_path, name):
    want = xr.open_zarr(group, consolidated=False, mask_and_scale=True)[name].values
    cfg = stoker.Config(batch_size=1, dtype="f32", host_buffer_bytes=8 << 20, n_io_threads=1, n_compute_threads=1,
                        pop_timeout_s=30.0, device="cpu")
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(os.path.join(group, name), ((0, 4),))])
        got = torch.from_dlpack(p.pop())[0].clone()
    assert torch.isnan(got).tolist() == np.isnan(want).tolist(), (got, want)
    assert torch.equal(got.nan_to_num(0.5), torch.from_numpy(want.astype(np.float32)).nan_to_num(0.5))


@pytest.mark.parametrize("fmt", [2, 3])
def test_missing_value_is_masked_beside_a_fill_value_as_in_xarray(tmp_path, decode_path, fmt):
    """Both attributes name values the array holds: xarray masks each of them (and scales the rest)."""
    path = str(tmp_path / f"both{fmt}.zarr")
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    z = g.create_array("v", shape=(6,), chunks=(3,), dtype="int16", fill_value=None if fmt == 2 else 0,
                       **({"dimension_names": ["x"]} if fmt == 3 else {}))
    z[:] = np.array([-9999, 1, -8888, 2, -9999, 3], dtype="int16")
    z.attrs.update({"_FillValue": -9999, "missing_value": -8888, "scale_factor": 0.5,
                    **({"_ARRAY_DIMENSIONS": ["x"]} if fmt == 2 else {})})
    want = xr.open_zarr(path, consolidated=False, mask_and_scale=True)["v"].values
    assert np.isnan(want).tolist() == [True, False, True, False, True, False]  # the oracle masks both
    cfg = stoker.Config(batch_size=1, dtype="f32", host_buffer_bytes=8 << 20, n_io_threads=1, n_compute_threads=1,
                        pop_timeout_s=30.0, device="cpu")
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(os.path.join(path, "v"), ((0, 6),))])
        got = torch.from_dlpack(p.pop())[0].clone()
    assert torch.isnan(got).tolist() == np.isnan(want).tolist(), (got, want)
    assert torch.equal(got.nan_to_num(0.5), torch.from_numpy(want.astype(np.float32)).nan_to_num(0.5))


def test_a_fractional_fill_of_an_integer_array_is_refused():
    with pytest.raises(stoker.MetadataError, match=r"a\.zarr.*2\.5.*not an integer"):
        coding_of({"_FillValue": 2.5}, np.dtype("int16"), 3, uri="a.zarr")
    with pytest.raises(stoker.MetadataError, match="not an integer"):
        coding_of({"missing_value": [1, 0.5], "scale_factor": 2.0}, np.dtype("uint8"), 2, uri="a.zarr")
    assert coding_of({"_FillValue": 3.0}, np.dtype("int16"), 3).fills == (3.0,)
    assert coding_of({"_FillValue": 0.1}, np.dtype("float32"), 3) is None  # nothing to mask, nothing to scale
    assert coding_of({"_FillValue": 0.1}, np.dtype("float64"), 3).fills == (0.1,)
