"""Fill values (``_FillValue``, ``missing_value``) of arrays whose stored values float32 does not hold (float64,
int32, int64) are compared with the stored values as xarray compares them, not after a float32 rounding: a
float64 -9999.0000001 next to the fill -9999.0 stays a value, an int32 16777216 next to the fill 16777217 too
(float32 holds neither apart from its fill). The CPU executor decodes such arrays in float64 work slots when
the pipeline's first batch reads one, and refuses one that a later batch reads (DtypeMismatch naming it) rather
than masking real values. xarray (``mask_and_scale=True``) is the oracle."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import stoker

xr = pytest.importorskip("xarray")

pytestmark = pytest.mark.timeout(120)

N = 8
FILL_F64 = -9999.0
FILL_I = 16777217  # 2**24 + 1: float32 rounds it to 2**24
VALUES = {
    "f64": np.array([FILL_F64, FILL_F64 + 1e-7, -9999.0000001, 1.5, FILL_F64, 2.0, -9998.9999999, 0.0]),
    "i32": np.array([FILL_I, 2**24, FILL_I - 2, 5, FILL_I, 2**24 + 2, 7, 0], np.int32),
    "i64": np.array([FILL_I, 2**24, 3, FILL_I, 2**24 + 3, 9, 0, 1], np.int64),
    "miss": np.array([1.0, -1e30, -1e30 * (1 + 1e-12), 2.0, 3.0, -1e30, 4.0, 5.0]),
}
ENCODING = {"f64": {"_FillValue": FILL_F64}, "i32": {"_FillValue": FILL_I}, "i64": {"_FillValue": FILL_I},
            "miss": {"_FillValue": None, "missing_value": -1e30}}


@pytest.fixture(scope="module", params=[2, 3])
def dataset(request, tmp_path_factory):
    """Each variable of VALUES written by xarray with its fill attributes (Zarr format 2 and 3), and a plain
    float32 array."""
    path = str(tmp_path_factory.mktemp("wide") / f"d{request.param}.zarr")
    ds = xr.Dataset({k: (("x",), v) for k, v in VALUES.items()})
    ds["plain"] = (("x",), np.arange(N, dtype=np.float32))
    ds.to_zarr(path, zarr_format=request.param, encoding={**ENCODING, "plain": {"_FillValue": None}},
               consolidated=False)
    return path


def _cfg(**kw):
    base = dict(batch_size=1, dtype="f32", host_buffer_bytes=8 << 20, n_io_threads=1, n_compute_threads=1,
                pop_timeout_s=30.0, device="cpu", lossy_casts=True)
    return stoker.Config(**{**base, **kw})


def _read(cfg, uris):
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(u, ((0, N),)) for u in uris])
        return [torch.from_dlpack(b).clone()[0] for b in p]


@pytest.mark.parametrize("var", list(VALUES))
@pytest.mark.parametrize("out", ["f32", "bf16"])
def test_fills_of_wide_arrays_mask_what_xarray_masks(dataset, decode_path, var, out):
    want = xr.open_zarr(dataset, consolidated=False, mask_and_scale=True)[var].values
    (got,) = _read(_cfg(dtype=out), [os.path.join(dataset, var)])
    assert torch.isnan(got).tolist() == np.isnan(want).tolist(), (got, want)
    expect = torch.from_numpy(want.astype(np.float32)).to(got.dtype)
    assert torch.equal(got.nan_to_num(0.5), expect.nan_to_num(0.5))


def test_a_wide_array_with_fills_after_a_first_batch_without_is_refused(dataset):
    """The first batch reads a plain array (float32 work), a later one the float64 array with fills: refused
    naming it and the fix, never masked in float32."""
    with pytest.raises(stoker.DtypeMismatch) as info:
        _read(_cfg(), [os.path.join(dataset, "plain"), os.path.join(dataset, "f64")])
    msg = str(info.value)
    assert info.value.uri == os.path.join(dataset, "f64") and "first batch" in msg and "cf=False" in msg, msg
    got = _read(_cfg(), [os.path.join(dataset, "f64"), os.path.join(dataset, "plain")])
    assert got[1].tolist() == list(range(N))
