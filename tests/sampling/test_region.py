"""RandomCrops(region=...): anchors restricted by index ranges and by coordinate labels, checked against
xarray's .sel on the dataset xarray wrote."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr

import stoker
from stoker.errors import InvalidArgument

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")


@pytest.fixture(scope="module", params=[2, 3])
def era(request, tmp_path_factory):
    """6-hourly (time, lat, lon) variables from 2000-02-20 to 2000-06-09, latitude descending."""
    path = str(tmp_path_factory.mktemp("region") / f"era{request.param}.zarr")
    t = pd.date_range("2000-02-20", "2000-06-09 18:00", freq="6h")
    lat = np.linspace(90, -90, 7)
    a = np.zeros((len(t), 7, 4), "float32")
    xr.Dataset({"t2m": (("time", "lat", "lon"), a), "u10": (("time", "lat", "lon"), a)},
               coords={"time": t, "lat": lat, "lon": np.arange(4.0)}).to_zarr(path, zarr_format=request.param, consolidated=request.param == 2)
    return path


def starts(src, axis: int) -> set[int]:
    return {s.aabb[axis][0] for s in src}


def test_time_region_by_label_is_xarray_sel(era):
    ds = xr.open_zarr(era)
    arrays = [[os.path.join(era, "t2m"), os.path.join(era, "u10")]]
    src = stoker.RandomCrops(arrays, (2, 7, 4), seed=1, samples_per_epoch=4000,
                             region={"time": ("2000-03-01", "2000-05-31")})
    picked = ds.time.sel(time=slice("2000-03-01", "2000-05-31")).values
    index = {int(i) for i in np.flatnonzero(np.isin(ds.time.values, picked))}
    assert max(index) == len(ds.time) - 1 - 9 * 4  # 2000-05-31T18:00 is in (the whole last day), June is not
    assert starts(src, 0) == index  # every anchor in the range is drawn, no other
    # the same samples as the index range, and a new fingerprint (not the unrestricted source's)
    by_index = stoker.RandomCrops(arrays, (2, 7, 4), seed=1, samples_per_epoch=4000,
                                  region={0: (min(index), max(index) + 1)})
    assert [s.aabb for s in by_index] == [s.aabb for s in src]
    assert src.fingerprint != stoker.RandomCrops(arrays, (2, 7, 4), seed=1, samples_per_epoch=4000).fingerprint


def test_box_may_reach_past_the_range_end_but_not_the_array(era):
    ds = xr.open_zarr(era)
    n = len(ds.time)
    src = stoker.RandomCrops([os.path.join(era, "t2m")], (8, 7, 4), seed=0, samples_per_epoch=2000,
                             region={"time": ("2000-06-07", "2000-06-09")})
    first = int(np.flatnonzero(ds.time.values >= np.datetime64("2000-06-07"))[0])
    assert starts(src, 0) == set(range(first, n - 8 + 1))  # the range's starts that leave room for 8 steps
    assert n - 8 < n - 4 == int(np.flatnonzero(ds.time.values >= np.datetime64("2000-06-09"))[0])


def test_descending_latitude_and_index_axes(era):
    src = stoker.RandomCrops([os.path.join(era, "t2m")], (1, 2, 1), seed=0, samples_per_epoch=3000,
                             region={"lat": (60, -30), -1: (1, 3)})
    want = xr.open_zarr(era).lat.sel(lat=slice(60, -30)).values
    lat = xr.open_zarr(era).lat.values
    assert starts(src, 1) == {int(i) for i in np.flatnonzero(np.isin(lat, want)) if i <= 5}
    assert starts(src, 2) == {1, 2}


def test_an_array_the_region_misses_is_not_drawn(tmp_path):
    uris = []
    for year, start in ((2000, "2000-01-01"), (2001, "2001-01-01")):
        path = str(tmp_path / f"y{year}.zarr")
        t = pd.date_range(start, periods=30, freq="D")
        xr.Dataset({"v": (("time", "x"), np.zeros((30, 3), "f4"))}, coords={"time": t}).to_zarr(path, zarr_format=3, consolidated=False)
        uris.append(os.path.join(path, "v"))
    src = stoker.RandomCrops(uris, (1, 3), samples_per_epoch=500, region={"time": ("2001-01-05", "2001-01-10")})
    assert {s.uri for s in src} == {uris[1]}
    assert starts(src, 0) == set(range(4, 10))
    with pytest.raises(InvalidArgument, match="leaves no box"):
        stoker.RandomCrops(uris, (1, 3), weights=[1, 1], region={"time": ("2001-01-05", "2001-01-10")})
    with pytest.raises(InvalidArgument, match="leaves no box"):
        stoker.RandomCrops(uris, (1, 3), region={"time": ("1999-01-01", "1999-02-01")})


def test_region_errors_are_typed_and_name_the_fix(tmp_path, era):
    t2m = os.path.join(era, "t2m")
    with pytest.raises(InvalidArgument, match="dimensions are \\['time', 'lat', 'lon'\\].*axis number"):
        stoker.RandomCrops([t2m], (1, 1, 1), region={"level": (0, 1)})
    with pytest.raises(InvalidArgument, match="not a date"):
        stoker.RandomCrops([t2m], (1, 1, 1), region={"time": (3, 5)})
    with pytest.raises(InvalidArgument, match="outside the array's 3 axes"):
        stoker.RandomCrops([t2m], (1, 1, 1), region={3: (0, 1)})
    with pytest.raises(InvalidArgument, match="no coordinate array 'lon'"):
        z = zarr.create_array(str(tmp_path / "g" / "v"), shape=(4, 4), chunks=(4, 4), dtype="f4",
                              dimension_names=["time", "lon"])
        z[...] = 0
        stoker.RandomCrops([str(tmp_path / "g" / "v")], (1, 1), region={"lon": (0, 1)})
    zarr.create_array(str(tmp_path / "g" / "time"), shape=(4,), chunks=(4,), dtype="f4")[...] = [0, 2, 1, 3]
    with pytest.raises(InvalidArgument, match="'time' is not sorted"):
        stoker.RandomCrops([str(tmp_path / "g" / "v")], (1, 1), region={"time": (0, 1)})


def test_region_and_cf_over_s3(era, tmp_path):
    """Dimension names, coordinates and CF attributes of arrays in an object store (moto's S3 server), read
    through the store with the array's storage options: the same anchors as the local copy, and batches
    equal to xarray's decoding."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    import torch
    from store_fixtures import BUCKET, MotoS3, read_tree

    path = str(tmp_path / "packed.zarr")
    ds = xr.open_zarr(era, consolidated=era.endswith("2.zarr")).load().drop_encoding()
    ds["t2m"] = ds.t2m + np.linspace(-5, 5, ds.t2m.size, dtype="f4").reshape(ds.t2m.shape)
    ds.t2m.encoding = {"dtype": "int16", "scale_factor": 0.001, "add_offset": 1.0, "_FillValue": -32767}
    ds.to_zarr(path, zarr_format=3, consolidated=False)
    s3 = MotoS3(read_tree(path), "region")
    try:
        options = {"timeout_s": 5.0, "connect_timeout_s": 2.0, "retries": 2, **s3.options}
        uri = f"s3://{BUCKET}/region/t2m"
        kw = dict(samples_per_epoch=300, seed=4, region={"time": ("2000-03-01", "2000-03-10"), "lat": (60, 0)})
        remote = stoker.RandomCrops([uri], (2, 2, 4), storage_options={f"s3://{BUCKET}/region": options}, **kw)
        local = stoker.RandomCrops([os.path.join(path, "t2m")], (2, 2, 4), **kw)
        assert [s.aabb for s in remote] == [s.aabb for s in local]
        ref = xr.open_zarr(path, consolidated=False).t2m.values
        cfg = stoker.Config(batch_size=4, dtype="f32", host_buffer_bytes=64 << 20, device="cpu",
                            storage_options={f"s3://{BUCKET}/region": options}, pop_timeout_s=20.0)
        samples = [remote.sample(0, i) for i in range(8)]
        with stoker.Pipeline(cfg) as pipe:
            pipe.push(samples)
            got = [(s, torch.from_dlpack(b)[i].clone()) for b in pipe.batches(2) for i, s in enumerate(b.samples)]
        for s, x in got:
            want = ref[tuple(slice(a, b) for a, b in s.aabb)].astype(np.float32)
            np.testing.assert_array_equal(x.numpy(), want)
    finally:
        s3.stop()


class _NoLeap(__import__("datetime").datetime):
    """Stands in for a cftime date (cftime is not installed here): built as stoker builds cftime labels,
    ``type(coord[0])(y, mo, d, h, mi, s, calendar=...)``, ordered and shifted by timedeltas as cftime's are."""

    def __new__(cls, *args, calendar="noleap"):
        self = super().__new__(cls, *args)
        self.calendar = calendar
        return self


def test_a_date_label_on_a_cftime_coordinate_covers_its_whole_period():
    """On cftime dates (a model's noleap calendar) an upper label ``"2000-01-03"`` covers that whole day, as
    xarray's partial dates on a CFTimeIndex (and stoker's on datetime64) do: it took 00:00 alone, leaving the
    day's other 6-hourly steps out of the region."""
    from datetime import timedelta

    from stoker.sampling.region import label_range

    t0 = _NoLeap(2000, 1, 1)
    coord = np.array([t0 + timedelta(hours=6 * i) for i in range(20)], dtype=object)  # 2000-01-01 .. 01-05 18:00
    assert label_range(coord, "2000-01-02", "2000-01-03", "u", "time") == (4, 12)  # 01-02 00:00 .. 01-03 18:00
    assert label_range(coord, "2000-01-02 06:00", "2000-01-03 12:00", "u", "time") == (5, 11)  # to 12:00, included
    assert label_range(coord, "2000-01-02", "2000-01-03 12:00:00.5", "u", "time") == (4, 11)  # an instant
    back = coord[::-1].copy()  # descending: the first label is the later one
    assert label_range(back, "2000-01-03", "2000-01-02", "u", "time") == (8, 16)


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_string_coordinate_beside_does_not_block_a_region_on_time(tmp_path, fmt):
    """A station axis labelled by strings (stoker reads no string arrays) is no reason to refuse a region on
    time: the anchors are xarray's .sel on time; a region on the strings themselves is a typed error that
    names them, not "no coordinate array"."""
    path = str(tmp_path / f"st{fmt}.zarr")
    t = pd.date_range("2000-01-01", periods=12, freq="D")
    ds = xr.Dataset({"v": (("time", "station"), np.zeros((12, 3), "float32"))},
                    coords={"time": t, "station": ["north", "mid", "south"]})
    ds.to_zarr(path, zarr_format=fmt, consolidated=False)
    src = stoker.RandomCrops([os.path.join(path, "v")], (1, 3), seed=0, samples_per_epoch=500,
                             region={"time": ("2000-01-04", "2000-01-07")})
    picked = ds.time.sel(time=slice("2000-01-04", "2000-01-07")).values
    assert starts(src, 0) == {int(i) for i in np.flatnonzero(np.isin(ds.time.values, picked))}
    with pytest.raises(stoker.errors.UnsupportedFormat, match="station"):
        stoker.RandomCrops([os.path.join(path, "v")], (1, 1), seed=0, samples_per_epoch=10,
                           region={"station": ("mid", "south")})


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_lead_time_region_is_xarray_sel_on_timedeltas(tmp_path, fmt):
    """A forecast's lead times (ECMWF's ``step``) are timedeltas that xarray writes as hours with a
    ``dtype: timedelta64`` attribute and decodes back; a region of timedelta labels is xarray's .sel on them,
    whatever their unit (720 minutes is 12 hours, never 720 of the stored hours)."""
    path = str(tmp_path / f"fc{fmt}.zarr")
    step = pd.to_timedelta(np.arange(0, 96, 6), unit="h")
    ds = xr.Dataset({"v": (("step", "x"), np.zeros((len(step), 2), "float32"))}, coords={"step": step})
    ds.to_zarr(path, zarr_format=fmt, consolidated=False)
    ref = xr.open_zarr(path, consolidated=False)
    assert ref.step.dtype.kind == "m"
    for first, last in [(np.timedelta64(720, "m"), np.timedelta64(1, "D")),
                        (pd.Timedelta("6h"), pd.Timedelta("2D")), (np.timedelta64(0, "s"), np.timedelta64(5, "h"))]:
        src = stoker.RandomCrops([os.path.join(path, "v")], (1, 2), seed=0, samples_per_epoch=800,
                                 region={"step": (first, last)})
        picked = ref.step.sel(step=slice(first, last)).values
        assert starts(src, 0) == {int(i) for i in np.flatnonzero(np.isin(ref.step.values, picked))}, (first, last)
    with pytest.raises(InvalidArgument, match="time span"):  # plain numbers are no lead times
        stoker.RandomCrops([os.path.join(path, "v")], (1, 2), seed=0, samples_per_epoch=10, region={"step": (6, 24)})


def test_labels_given_in_the_reverse_of_the_coordinates_order_say_so(era):
    """region={"time": ("2000-05-31", "2000-03-01")} (the dates swapped) and a latitude range given south to
    north on a descending coordinate selected nothing, as xarray's sel does, and the error said "the region
    leaves no anchor ... widen the region"; an InvalidArgument now says the labels are reversed and
    which order the coordinate takes. A range between two labels (none in it) keeps the old message."""
    t2m = os.path.join(era, "t2m")
    with pytest.raises(InvalidArgument,
                       match=r"'time'.*'2000-05-31'.*after.*ascending.*\('2000-03-01', '2000-05-31'\)"):
        stoker.RandomCrops([t2m], (1, 1, 1), region={"time": ("2000-05-31", "2000-03-01")})
    with pytest.raises(InvalidArgument, match=r"'lat'.*descending.*\(60, -30\)"):
        stoker.RandomCrops([t2m], (1, 1, 1), region={"lat": (-30, 60)})
    with pytest.raises(InvalidArgument, match="widen the region"):
        stoker.RandomCrops([t2m], (1, 1, 1), region={"lat": (50, 40)})  # between 60 and 30: no label
