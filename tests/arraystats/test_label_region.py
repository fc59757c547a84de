"""compute_stats(region={dim: (first, last)}): statistics over a label range of a dataset xarray wrote, equal
to numpy's over xarray's ``.sel`` of the same labels; the cache keys the resolved index range."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import stoker
from stoker.errors import InvalidArgument, OutOfBounds

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=[2, 3])
def era(request, tmp_path_factory):
    """6-hourly (time, lat, lon) float32 from 2000-02-20 to 2000-06-09, latitude descending, chunks time=4."""
    path = str(tmp_path_factory.mktemp("stats_region") / f"era{request.param}.zarr")
    t = pd.date_range("2000-02-20", "2000-06-09 18:00", freq="6h")
    lat = np.linspace(90, -90, 7)
    rng = np.random.default_rng(request.param)
    a = rng.normal(10, 3, (len(t), 7, 5)).astype("float32")
    xr.Dataset({"t2m": (("time", "lat", "lon"), a), "u10": (("time", "lat", "lon"), a * 2 + 1)},
               coords={"time": t, "lat": lat, "lon": np.arange(5.0)}).to_zarr(
        path, zarr_format=request.param, consolidated=request.param == 2, encoding={"t2m": {"chunks": (4, 7, 5)}})
    return path


def _numpy(values: np.ndarray) -> tuple[float, float, float, float, int]:
    v = values.astype(np.float64).ravel()
    return v.mean(), v.std(), v.min(), v.max(), v.size


def test_a_date_range_is_xarray_s_sel(era):
    ds = xr.open_zarr(era)
    st = stoker.compute_stats(os.path.join(era, "t2m"), region={"time": ("2000-03-01", "2000-05-31")}, cache=False)
    want = ds.t2m.sel(time=slice("2000-03-01", "2000-05-31")).values
    assert want.shape[0] == (31 + 30 + 31) * 4  # the last day is included whole
    mean, std, lo, hi, n = _numpy(want)
    assert int(st.count) == n
    assert st.mean.item() == pytest.approx(mean, rel=1e-12) and st.std.item() == pytest.approx(std, rel=1e-9)
    assert st.min.item() == lo and st.max.item() == hi


def test_labels_and_indices_mix_and_descending_coordinates(era):
    ds = xr.open_zarr(era)
    t2m, u10 = os.path.join(era, "t2m"), os.path.join(era, "u10")
    region = {"time": ("2000-04", "2000-04"), "lat": (60, -30), -1: (1, 4)}  # April; lat 60 down to -30
    got = stoker.compute_stats({"vars": [t2m, u10]}, region=region, cache=False)["vars"]
    sel = ds.sel(time="2000-04", lat=slice(60, -30)).isel(lon=slice(1, 4))
    assert sel.sizes["time"] == 30 * 4 and sel.sizes["lat"] == 4
    for c, name in enumerate(["t2m", "u10"]):
        mean, std, lo, hi, n = _numpy(sel[name].values)
        assert got.mean[c].item() == pytest.approx(mean, rel=1e-12)
        assert got.std[c].item() == pytest.approx(std, rel=1e-9)
        assert got.min[c].item() == lo and got.max[c].item() == hi and int(got.count) == n
    # the same index ranges give the same statistics, bit for bit
    first = int(np.flatnonzero(ds.time.values >= np.datetime64("2000-04-01"))[0])
    lat0 = int(np.flatnonzero(ds.lat.values <= 60)[0])
    by_index = stoker.compute_stats({"vars": [t2m, u10]}, region={0: (first, first + 120), 1: (lat0, lat0 + 4),
                                                                  2: (1, 4)}, cache=False)["vars"]
    assert torch.equal(by_index.mean, got.mean) and torch.equal(by_index.std, got.std)


def test_cached_by_the_resolved_range(era, tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    uri = os.path.join(era, "t2m")
    labels = stoker.compute_stats(uri, region={"time": ("2000-03-01", "2000-03-31")})
    other = stoker.compute_stats(uri, region={"time": ("2000-03-01", "2000-04-30")})
    assert int(other.count) == int(labels.count) * 61 // 31 and not torch.equal(labels.mean, other.mean)
    again = stoker.compute_stats(uri, region={"time": ("2000-03-01", "2000-03-31")})
    assert torch.equal(again.mean, labels.mean) and int(again.count) == int(labels.count)


def test_label_region_errors_name_the_fix(era, tmp_path):
    uri = os.path.join(era, "t2m")
    with pytest.raises(OutOfBounds, match=r"region\['time'\].*holds no label"):
        stoker.compute_stats(uri, region={"time": ("1999-01-01", "1999-12-31")}, cache=False)
    with pytest.raises(InvalidArgument, match="dimension 'level'.*give the region by axis number"):
        stoker.compute_stats(uri, region={"level": (0, 3)}, cache=False)
    with pytest.raises(InvalidArgument, match="not a date"):
        stoker.compute_stats(uri, region={"time": (3, 9)}, cache=False)
