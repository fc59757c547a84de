"""Test data of the CF-decoding tests (tests/engine/test_cf.py, tests/gpu/test_gpu_cf.py): a small dataset
written by xarray in either Zarr format, the boxes read from it, xarray's values as the oracle, and the checks
both decode paths pass."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import stoker

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


def check_batches_equal_xarray(cfg: stoker.Config, path: str) -> tuple[list, stoker.Stats]:
    """Pipelines of ``cfg`` make batches equal to xarray's decoded values: samples of each variable alone, then
    samples whose channels are variables of different codings (each row decoded as its own array says).
    Returns the rows of the first (``(sample, tensor)`` each, some NaN) and that pipeline's stats."""
    import xarray as xr

    ref = xr.open_zarr(path, consolidated=False)
    uris = {v: os.path.join(path, v) for v in VARS}
    crops = boxes(8)
    singles = [stoker.Sample(uris[v], box) for box in crops for v in VARS]
    with stoker.Pipeline(cfg) as pipe:
        pipe.push(singles)
        rows = [(s, torch.from_dlpack(b)[i].clone()) for b in pipe.batches(len(singles) // cfg.batch_size)
                for i, s in enumerate(b.samples)]
        stats = pipe.stats()
    assert len(rows) == len(singles)
    for s, x in rows:
        assert_same(x, want(ref, os.path.basename(s.uri), s.aabb))
    assert any(torch.isnan(x).any() for _, x in rows)
    channels = [stoker.Sample([uris["t2m"], uris["p"], uris["q"]], box) for box in crops]
    with stoker.Pipeline(cfg) as pipe:
        pipe.push(channels)
        for b in pipe.batches(len(channels) // cfg.batch_size):
            x = torch.from_dlpack(b)
            for i, s in enumerate(b.samples):
                for c, v in enumerate(("t2m", "p", "q")):
                    assert_same(x[i, c], want(ref, v, s.aabb))
    return rows, stats


def check_decoded_before_the_transform(cfg: stoker.Config, path: str) -> None:
    """A batch of ``p`` from a pipeline of ``cfg`` (f16, transform ``FillNaN(0.0)``) is xarray's values with
    NaN replaced: the transform saw the decoded values (the fill already NaN)."""
    import xarray as xr

    ref = xr.open_zarr(path, consolidated=False)
    samples = [stoker.Sample(os.path.join(path, "p"), box) for box in boxes(cfg.batch_size)]
    with stoker.Pipeline(cfg) as pipe:
        pipe.push(samples)
        x = torch.from_dlpack(pipe.pop())
    for i, s in enumerate(samples):
        filled = np.nan_to_num(want(ref, "p", s.aabb).astype(np.float32), nan=0.0)
        assert torch.equal(x[i], torch.from_numpy(filled).half())


def check_cf_arrays_after_a_first_batch_without_are_refused(cfg: stoker.Config, path: str, root) -> None:
    """A pipeline of ``cfg`` (bf16) whose first batch reads a plain float32 array (written under ``root``)
    sized its work for that: the next batch, of ``p`` (CF attributes), is refused (DtypeMismatch), never
    decoded in bf16 (its offset cancelling what the rounding kept)."""
    import zarr

    plain = zarr.create_array(str(root / "plain"), shape=SHAPE, chunks=(4, 8, 8), dtype="f4")
    plain[...] = 1.0
    box = boxes(1)[0]
    n = cfg.batch_size
    samples = [stoker.Sample(str(root / "plain"), box)] * n + [stoker.Sample(os.path.join(path, "p"), box)] * n
    with stoker.Pipeline(cfg) as pipe:
        pipe.push(samples)
        assert torch.equal(torch.from_dlpack(pipe.pop()), torch.ones(n, *[b - a for a, b in box], dtype=torch.bfloat16))
        with pytest.raises(stoker.DtypeMismatch, match="/p: its CF attributes.*first batch.*cf=False"):
            pipe.pop()


def check_plain_rows_after_cf_rows_are_rounded(cfg: stoker.Config, path: str, root) -> None:
    """A pipeline of ``cfg`` (bf16) whose first batch reads ``p`` (CF attributes) makes every batch in float32
    work: a later batch of a plain float32 array (written under ``root``) is rounded into its slot too."""
    import zarr

    plain = zarr.create_array(str(root / "plain"), shape=SHAPE, chunks=(4, 8, 8), dtype="f4")
    values = np.random.default_rng(2).normal(0, 100, SHAPE).astype("f4")
    plain[...] = values
    crops = boxes(cfg.batch_size)
    samples = [stoker.Sample(os.path.join(path, "p"), box) for box in crops]
    samples += [stoker.Sample(str(root / "plain"), box) for box in crops]
    with stoker.Pipeline(cfg) as pipe:
        pipe.push(samples)
        pipe.pop().release()
        x = torch.from_dlpack(pipe.pop())
        for i, box in enumerate(crops):
            assert torch.equal(x[i], torch.from_numpy(values[tuple(slice(a, b) for a, b in box)]).to(torch.bfloat16))
