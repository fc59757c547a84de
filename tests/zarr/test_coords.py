"""Dimension names, coordinates and CF times (stoker.reader.coords, stoker.zarr.cf) against xarray's own
decoding of datasets xarray wrote, read locally, over HTTP and from a zip archive."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr

import stoker
from stoker.errors import MetadataError, UnsupportedFormat
from stoker.reader import coords
from stoker.zarr import cf

from store_fixtures import read_tree, write_zip

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")


def weather(n_time: int = 40, freq: str = "6h") -> "xr.Dataset":
    """Two variables on (time, lat, lon): t2m float32 with a -9999 fill, p packed into int16."""
    rng = np.random.default_rng(3)
    t = pd.date_range("2000-02-25", periods=n_time, freq=freq)
    lat = np.linspace(90, -90, 6)  # descending, as ERA5's
    lon = np.arange(8) * 45.0
    a = (rng.random((n_time, 6, 8)) * 100).astype("float32")
    a[0, 0, :3] = np.nan
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), a), "p": (("time", "lat", "lon"), a.copy())},
                    coords={"time": t, "lat": lat, "lon": lon})
    ds.p.encoding.update(dtype="int16", scale_factor=0.01, add_offset=50.0, _FillValue=-32767)
    ds.t2m.encoding.update(_FillValue=-9999.0)
    return ds


@pytest.fixture(params=[2, 3])
def dataset(request, tmp_path):
    path = str(tmp_path / f"w{request.param}.zarr")
    weather().to_zarr(path, zarr_format=request.param, consolidated=request.param == 2)
    return path


def test_dimension_names_and_coordinates_match_xarray(dataset):
    ref = xr.open_zarr(dataset, consolidated=False)
    arr = stoker.open_array(os.path.join(dataset, "t2m"))
    assert coords.dimension_names(arr) == ("time", "lat", "lon")
    got = coords.coordinates(arr)
    assert set(got) == {"time", "lat", "lon"}
    for name in got:
        np.testing.assert_array_equal(got[name], ref[name].values)
    assert got["time"].dtype == ref["time"].dtype  # datetime64[ns]
    assert coords.coordinates(arr) is got  # read once per reader
    assert coords.coordinate(arr, "lat") is got["lat"] and coords.attributes(arr) is coords.attributes(arr)


def test_what_is_read_per_reader_goes_with_it_and_another_reader_reads_its_own(dataset):
    """A rewrite between two opens is seen by the second reader: nothing is kept for the array, only per reader
    (and it is gone with its reader: a pipeline's forgotten arrays hold nothing alive)."""
    import gc
    import weakref

    arr = stoker.open_array(os.path.join(dataset, "t2m"))
    first = coords.coordinates(arr)
    gone = weakref.ref(arr)
    lat = zarr.open_array(os.path.join(dataset, "lat"), mode="r+")
    lat[:] = np.asarray(lat[:]) + 1.0
    again = stoker.open_array(os.path.join(dataset, "t2m"))
    np.testing.assert_array_equal(coords.coordinates(again)["lat"], first["lat"] + 1.0)
    del arr
    gc.collect()
    assert gone() is None


def test_codings_match_xarray_values(dataset):
    ref = xr.open_zarr(dataset, consolidated=False)
    for var in ("t2m", "p"):
        arr = stoker.open_array(os.path.join(dataset, var))
        raw = arr[...]
        code = coords.coding(arr)
        assert code is not None
        got = code.decode(raw)
        want = ref[var].values
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got, want.astype(np.float32))  # float64 arithmetic, one rounding
        assert np.isnan(got).sum() > 0
    assert coords.coding(stoker.open_array(os.path.join(dataset, "lat"))) is None  # only a NaN fill


def test_coordinates_over_http_and_in_a_zip(tmp_path):
    from range_server import RangeServer

    root = tmp_path / "srv"
    weather().to_zarr(str(root / "w.zarr"), zarr_format=3, consolidated=False)
    ref = xr.open_zarr(str(root / "w.zarr"), consolidated=False)
    server = RangeServer(str(root))
    try:
        arr = stoker.open_array(f"{server.url}/w.zarr/p")
        got = coords.coordinates(arr)
        np.testing.assert_array_equal(got["time"], ref.time.values)
        assert coords.coding(arr) == cf.CFCoding(0.01, 50.0, (-32767.0,))
    finally:
        server.shutdown()
    archive = tmp_path / "w.zip"
    write_zip(str(archive), read_tree(str(root / "w.zarr")))
    arr = stoker.open_array(f"{archive}/t2m")
    np.testing.assert_array_equal(coords.coordinates(arr)["lat"], ref.lat.values)


def test_a_remote_v2_arrays_zarray_is_requested_once(tmp_path):
    """An xarray-written v2 array (it names its dimensions) over HTTP, unconsolidated: its stored fill value,
    xarray's _FillValue, was read from a second request for ``.zarray``, the document its metadata had just
    been parsed from. The parsed document is kept with the metadata now: one ``.zarray`` request, and the
    same CF coding and fill as xarray's (and as the v2 array read from disk)."""
    from range_server import RangeServer

    root = tmp_path / "srv"
    weather().to_zarr(str(root / "w.zarr"), zarr_format=2, consolidated=False)
    ref = xr.open_zarr(str(root / "w.zarr"), consolidated=False)
    server = RangeServer(str(root))
    try:
        arr = stoker.open_array(f"{server.url}/w.zarr/p")
        assert coords.coding(arr) == coords.coding(stoker.open_array(str(root / "w.zarr" / "p")))
        assert coords.coding(arr) == cf.CFCoding(0.01, 50.0, (-32767.0,))
        assert coords.dimension_names(arr) == ref.p.dims
        assert server.paths.count("/w.zarr/p/.zarray") == 1, server.paths
    finally:
        server.shutdown()


def test_a_plain_zarr_array_has_no_coding_and_no_dimensions(tmp_path):
    """zarr-python's fill value of an array xarray did not write is no missing-value marker (xarray takes the
    v2 fill_value for _FillValue only in what it wrote)."""
    z = zarr.create_array(str(tmp_path / "a"), shape=(4, 4), chunks=(2, 2), dtype="uint16", zarr_format=2,
                          fill_value=0)
    z[...] = 0
    arr = stoker.open_array(str(tmp_path / "a"))
    assert coords.coding(arr) is None
    assert coords.dimension_names(arr) is None
    assert coords.coordinates(arr) == {}


def test_missing_coordinate_is_none(tmp_path):
    z = zarr.create_array(str(tmp_path / "g" / "v"), shape=(3, 2), chunks=(3, 2), dtype="f4",
                          dimension_names=["step", "x"])
    z[...] = 1
    zarr.create_array(str(tmp_path / "g" / "x"), shape=(5,), chunks=(5,), dtype="f4")[...] = 0  # wrong length
    got = coords.coordinates(stoker.open_array(str(tmp_path / "g" / "v")))
    assert got == {"step": None, "x": None}


@pytest.mark.parametrize("units,values", [
    ("days since 2000-01-01", np.array([0, 1, 59, 366], np.int64)),
    ("hours since 1990-1-1 06:00:00", np.array([0, 6, 12, 8760], np.int32)),
    ("seconds since 2000-01-01T00:00:00Z", np.array([0.5, 1.25, np.nan, 86400.0])),
    ("minutes since 2000-01-01 00:00:00+01:00", np.array([0, 30, 90], np.int64)),
    ("day since 1970-01-01", np.array([0.25, 10.5])),
])
@pytest.mark.parametrize("calendar", [None, "standard", "gregorian", "proleptic_gregorian"])
def test_times_decode_as_xarray_decodes_them(units, values, calendar):
    from xarray.coding.times import decode_cf_datetime

    want = decode_cf_datetime(values, units, calendar=calendar or "standard")
    got = cf.decode_times(values, units, calendar)
    np.testing.assert_array_equal(got, np.asarray(want, dtype="datetime64[ns]"))


def test_other_calendars_need_cftime():
    try:
        import cftime  # noqa: F401
    except ImportError:
        with pytest.raises(UnsupportedFormat, match="'noleap' calendar.*pip install cftime") as info:
            cf.decode_times(np.array([0, 1]), "days since 2000-01-01", "noleap", uri="/d/time")
        assert info.value.calendar == "noleap"
    else:
        got = cf.decode_times(np.array([0, 59]), "days since 2000-01-01", "noleap")
        assert (got[1].month, got[1].day) == (3, 1)


def test_bad_units_are_typed_errors():
    with pytest.raises(MetadataError, match="not CF time units"):
        cf.decode_times(np.array([0]), "days", None, uri="/d/time")
    with pytest.raises(UnsupportedFormat, match="weeks"):
        cf.decode_times(np.array([0]), "weeks since 2000-01-01", None, uri="/d/time")
    with pytest.raises(MetadataError, match="is not a date"):
        cf.decode_times(np.array([0]), "days since yesterday", None, uri="/d/time")


def test_coding_of_attribute_forms():
    i2, f4 = np.dtype("int16"), np.dtype("float32")
    # netCDF writers' one-element lists; missing_value beside _FillValue; both masked
    c = cf.coding_of({"scale_factor": [0.5], "_FillValue": [-1], "missing_value": [-2, -3]}, i2, 3)
    assert c == cf.CFCoding(0.5, None, (-1.0, -2.0, -3.0))
    np.testing.assert_array_equal(c.decode(np.array([4, -1, -2, -3], np.int16)), [2.0, np.nan, np.nan, np.nan])
    # v3 float fills as xarray writes them (base64 of a little-endian float64); a NaN fill does nothing
    import base64
    import struct

    b64 = base64.standard_b64encode(struct.pack("<d", -9999.0)).decode()
    assert cf.coding_of({"_FillValue": b64}, f4, 3) == cf.CFCoding(None, None, (-9999.0,))
    assert cf.coding_of({"_FillValue": "NaN"}, f4, 3) is None
    # v2: the .zarray fill value counts only for arrays xarray wrote
    assert cf.coding_of({"_ARRAY_DIMENSIONS": ["x"]}, i2, 2, zarr_fill=7) == cf.CFCoding(None, None, (7.0,))
    assert cf.coding_of({}, i2, 2, zarr_fill=7) is None
    assert cf.coding_of({"_ARRAY_DIMENSIONS": ["x"]}, i2, 2, zarr_fill=None) is None
    with pytest.raises(MetadataError, match="attribute scale_factor 'big' is not a number"):
        cf.coding_of({"scale_factor": "big"}, i2, 3, uri="/d/v")


def test_a_string_coordinate_is_none_among_all_and_an_error_on_its_own(tmp_path):
    """stoker reads no strings: among all coordinates a string one is None (the others as xarray reads them),
    asked for alone it says why (UnsupportedFormat)."""
    path = str(tmp_path / "st.zarr")
    t = pd.date_range("2000-01-01", periods=4, freq="D")
    xr.Dataset({"v": (("time", "station"), np.zeros((4, 2), "f4"))},
               coords={"time": t, "station": ["a", "b"]}).to_zarr(path, zarr_format=3, consolidated=False)
    arr = stoker.open_array(os.path.join(path, "v"))
    got = coords.coordinates(arr)
    assert set(got) == {"time", "station"} and got["station"] is None
    np.testing.assert_array_equal(got["time"], xr.open_zarr(path).time.values)
    np.testing.assert_array_equal(coords.coordinate(arr, "time"), got["time"])
    with pytest.raises(UnsupportedFormat, match="station"):
        coords.coordinate(arr, "station")
    assert coords.coordinate(arr, "depth") is None  # no such dimension


@pytest.mark.parametrize("fmt", [2, 3])
def test_time_span_coordinates_decode_as_xarray_decodes_them(tmp_path, fmt):
    """Lead times (xarray writes hours with a ``dtype: timedelta64`` attribute) are timedeltas, as xarray reads
    them, a missing one NaT; hours without that attribute stay numbers, as in xarray."""
    path = str(tmp_path / f"fc{fmt}.zarr")
    step = pd.to_timedelta([0, 1.5, np.nan, 90], unit="h")
    xr.Dataset({"v": (("step",), np.arange(4.0))}, coords={"step": step}).to_zarr(path, zarr_format=fmt,
                                                                                 consolidated=False)
    ref = xr.open_zarr(path, consolidated=False).step.values
    got = coords.coordinates(stoker.open_array(os.path.join(path, "v")))["step"]
    assert got.dtype == ref.dtype and got.dtype.kind == "m"
    np.testing.assert_array_equal(got, ref)  # NaT where xarray has NaT
    z = zarr.open_array(os.path.join(path, "step"), mode="r+")
    z.attrs.update({"dtype": None})  # units "hours" alone: xarray leaves the numbers as they are
    del z.attrs["dtype"]
    want = xr.open_zarr(path, consolidated=False).step.values
    assert want.dtype.kind != "m"
    np.testing.assert_array_equal(coords.coordinates(stoker.open_array(os.path.join(path, "v")))["step"], want)


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_missing_date_xarray_wrote_is_nat(tmp_path, fmt):
    """xarray writes a missing date (NaT) as the int64 minimum, without a _FillValue, and reads it back as NaT;
    multiplied out it wrapped around to a real date (2000-01-01 here), silently."""
    from xarray.coding.times import decode_cf_datetime

    path = str(tmp_path / f"t{fmt}.zarr")
    t = pd.to_datetime(["2000-01-01", None, "2000-01-03"])
    xr.Dataset({"v": (("time",), np.arange(3.0))}, coords={"time": t}).to_zarr(path, zarr_format=fmt,
                                                                              consolidated=False)
    ref = xr.open_zarr(path, consolidated=False).time.values
    assert np.isnat(ref[1])
    got = coords.coordinates(stoker.open_array(os.path.join(path, "v")))["time"]
    np.testing.assert_array_equal(got, ref)
    stored = np.array([0, np.iinfo(np.int64).min, 2], np.int64)
    np.testing.assert_array_equal(cf.decode_times(stored, "days since 2000-01-01"),
                                  np.asarray(decode_cf_datetime(stored, "days since 2000-01-01"), "datetime64[ns]"))
