"""Test data of the CF-decoding tests (tests/engine/test_cf.py, tests/gpu/test_gpu_cf.py): a small dataset
written by xarray in either Zarr format, the boxes read from it, and xarray's values as the oracle."""

from __future__ import annotations

import numpy as np
import torch

SHAPE = (12, 20, 24)
VARS = ("p", "t2m", "q")


def write_dataset(root, zarr_format: int) -> str:
    """p: int16 packed (scale_factor, add_offset, _FillValue); t2m: float32 with a _FillValue; q: float64 with
    missing_value; chunks smaller than the crops, so crops straddle chunks. Returns the store's path."""
    import pandas as pd
    import xarray as xr

    rng = np.random.default_rng(7)
    path = str(root / f"d{zarr_format}.zarr")
    a = (rng.random(SHAPE) * 100 - 20).astype("float32")
    a[rng.random(SHAPE) < 0.1] = np.nan
    q = rng.normal(0, 1, SHAPE)
    q[rng.random(SHAPE) < 0.1] = np.nan
    ds = xr.Dataset({"p": (("time", "y", "x"), a), "t2m": (("time", "y", "x"), a.copy()),
                     "q": (("time", "y", "x"), q)},
                    coords={"time": pd.date_range("2000-01-01", periods=SHAPE[0], freq="D")})
    enc = {"p": {"dtype": "int16", "scale_factor": 0.01, "add_offset": 30.0, "_FillValue": -32767,
                 "chunks": (4, 8, 8)},
           "t2m": {"_FillValue": -9999.0, "chunks": (4, 8, 8)},
           "q": {"missing_value": -1e30, "_FillValue": -1e30, "chunks": (4, 8, 8)}}
    ds.to_zarr(path, zarr_format=zarr_format, encoding=enc, consolidated=zarr_format == 2)
    return path


def boxes(n: int, crop=(3, 9, 10)):
    """``n`` seeded boxes of ``crop`` inside the dataset."""
    rng = np.random.default_rng(1)
    return [[(int(s), int(s) + c) for s, c in zip((rng.integers(0, d - c + 1) for d, c in zip(SHAPE, crop)), crop)]
            for _ in range(n)]


def want(ref, var, box) -> np.ndarray:
    """xarray's decoded values of ``var`` in ``box`` (``ref``: ``xr.open_zarr`` of the dataset)."""
    return ref[var].values[tuple(slice(a, b) for a, b in box)]


def assert_same(got: torch.Tensor, want: np.ndarray) -> None:
    """``got`` is xarray's values cast to float32, then to ``got``'s dtype (one rounding), NaN where they are."""
    g = got.float().numpy()
    w = torch.from_numpy(want.astype(np.float32)).to(got.dtype).float().numpy()
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    np.testing.assert_array_equal(g, w)  # NaNs compare equal here
