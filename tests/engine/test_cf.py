"""CF attributes in the crop pipeline (Config.cf): batches equal xarray's decoded values, on both decode paths,
for datasets xarray wrote in both Zarr formats; cf=False reads the stored values; never silently ignored."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import zarr

import stoker
from cf_data import SHAPE, VARS, write_dataset  # noqa: F401 - shared with the other CF tests
from cf_data import assert_same as _assert_same, boxes as _boxes, want as _want
from cf_data import (check_batches_equal_xarray, check_cf_arrays_after_a_first_batch_without_are_refused,
                     check_decoded_before_the_transform, check_plain_rows_after_cf_rows_are_rounded)
from stoker.transforms import FillNaN

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(120)



def _cfg(**kw):
    base = dict(batch_size=4, dtype="f32", host_buffer_bytes=64 << 20, n_io_threads=2, n_compute_threads=2,
                pop_timeout_s=20.0, device="cpu")
    base.update(kw)
    return stoker.Config(**base)


@pytest.fixture(scope="module", params=[2, 3])
def dataset(request, tmp_path_factory):
    """The CF dataset of cf_data.write_dataset, in Zarr format 2 and 3."""
    return write_dataset(tmp_path_factory.mktemp("cf"), request.param)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_batches_equal_xarray_on_both_paths(dataset, decode_path, dtype):
    check_batches_equal_xarray(_cfg(dtype=dtype), dataset)


def test_cf_false_reads_the_stored_values(dataset, decode_path):
    raw = zarr.open_array(os.path.join(dataset, "p"), mode="r")[...]
    samples = [stoker.Sample(os.path.join(dataset, "p"), box) for box in _boxes(4)]
    with stoker.Pipeline(_cfg(cf=False)) as pipe:
        pipe.push(samples)
        x = torch.from_dlpack(pipe.pop())
    for i, s in enumerate(samples):
        assert torch.equal(x[i], torch.from_numpy(raw[tuple(slice(a, b) for a, b in s.aabb)].astype(np.float32)))
    assert (x == -32767).any()  # the fill, as stored
    with stoker.Pipeline(_cfg(cf=False, dtype="native")) as pipe:
        pipe.push(samples)
        assert torch.from_dlpack(pipe.pop()).dtype == torch.int16


def test_native_integer_output_is_refused(dataset):
    samples = [stoker.Sample(os.path.join(dataset, "p"), box) for box in _boxes(4)]
    with stoker.Pipeline(_cfg(dtype="native")) as pipe:
        pipe.push(samples)
        with pytest.raises(stoker.DtypeMismatch, match=r"/p: its CF attributes.*float dtype.*cf=False") as info:
            pipe.pop()
    assert info.value.knob == "cf"
    # a float array with a fill keeps its dtype, decoded
    ref = xr.open_zarr(dataset, consolidated=False)
    samples = [stoker.Sample(os.path.join(dataset, "t2m"), box) for box in _boxes(4)]
    with stoker.Pipeline(_cfg(dtype="native")) as pipe:
        pipe.push(samples)
        x = torch.from_dlpack(pipe.pop())
    assert x.dtype == torch.float32
    for i, s in enumerate(samples):
        _assert_same(x[i], _want(ref, "t2m", s.aabb))


def test_native_over_packed_channels_of_mixed_dtypes_advises_a_float_output(dataset):
    """dtype='native' over channels of int16-packed p, float32 t2m and float64 q listed the stored dtypes and
    advised "'i64' (or 'i32') for integer ids" first, which CF-packed arrays refuse in turn (their values are
    floats); the advice is a float dtype now."""
    uris = [os.path.join(dataset, v) for v in VARS]
    with stoker.Pipeline(_cfg(dtype="native")) as pipe:
        pipe.push([stoker.Sample(uris, box) for box in _boxes(4)])
        with pytest.raises(stoker.DtypeMismatch, match="one source dtype") as info:
            pipe.pop()
    assert "'i64'" not in str(info.value) and "dtype='f32'" in str(info.value) and "CF" in str(info.value)


def test_decoded_before_the_transform(dataset, decode_path):
    check_decoded_before_the_transform(_cfg(dtype="f16", transform=FillNaN(0.0)), dataset)


def test_the_plain_reader_reads_stored_values(dataset):
    """ArrayReader.read is the bit-exact reference, like zarr-python's: stored values; coords.coding decodes."""
    from stoker.reader.coords import coding

    arr = stoker.open_array(os.path.join(dataset, "p"))
    raw = arr[...]
    assert raw.dtype == np.int16
    np.testing.assert_array_equal(raw, zarr.open_array(os.path.join(dataset, "p"), mode="r")[...])
    want = xr.open_zarr(dataset, consolidated=False).p.values
    np.testing.assert_array_equal(coding(arr).decode(raw), want.astype(np.float32))


def test_config_cf_is_checked():
    with pytest.raises(stoker.InvalidArgument, match="Config.cf must be True"):
        stoker.Config(cf="yes")


def test_a_16_bit_output_without_float32_work_is_refused(dataset, tmp_path):
    """The work slots are sized at the first batch: CF arrays first met later in a bf16 pipeline would be
    decoded in bf16 (their offset cancelling what the rounding kept), so that batch is refused, not wrong."""
    check_cf_arrays_after_a_first_batch_without_are_refused(_cfg(dtype="bf16"), dataset, tmp_path)


def test_an_executor_that_does_not_decode_refuses(dataset, monkeypatch):
    """An executor without CF decoding (applies_cf false; none of the built-in ones) never ignores the
    attributes: NotYetSupported."""
    from stoker.engine.cpu.executor import CpuExecutor

    monkeypatch.setattr(CpuExecutor, "applies_cf", False)
    samples = [stoker.Sample(os.path.join(dataset, "t2m"), box) for box in _boxes(4)]
    with stoker.Pipeline(_cfg()) as pipe:
        pipe.push(samples)
        with pytest.raises(stoker.NotYetSupported, match="/t2m: its CF attributes.*cf=False"):
            pipe.pop()
    with stoker.Pipeline(_cfg(cf=False)) as pipe:
        pipe.push(samples)
        assert torch.from_dlpack(pipe.pop()).shape[0] == 4


@pytest.mark.cuda
@pytest.mark.parametrize("decode_on", ["cpu", "gpu", "hybrid"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cuda_batches_equal_xarray(dataset, dtype, decode_on):
    """On a GPU the decoding runs on the side stream after the device cast (int16 crosses PCIe as int16), or
    on the GPU-decode executor's stream after placing (tests/gpu/test_gpu_cf.py runs it on the host)."""
    if decode_on in ("gpu", "hybrid"):
        from stoker.engine.gpu import nvcomp

        if not nvcomp.available():
            pytest.skip("nvCOMP is not installed")
    ref = xr.open_zarr(dataset, consolidated=False)
    uris = [os.path.join(dataset, v) for v in ("t2m", "p", "q")]
    samples = [stoker.Sample(uris, box) for box in _boxes(8)]
    with stoker.Pipeline(_cfg(dtype=dtype, device="cuda", decode_on=decode_on,
                              device_buffer_bytes=64 << 20)) as pipe:
        pipe.push(samples)
        for b in pipe.batches(2):
            x = torch.from_dlpack(b).cpu()
            for i, s in enumerate(b.samples):
                for c, v in enumerate(("t2m", "p", "q")):
                    _assert_same(x[i, c], _want(ref, v, s.aabb))


def test_batches_without_cf_rows_still_leave_the_work_slot(dataset, tmp_path, decode_path):
    """A bf16 pipeline whose first batch reads CF arrays makes every batch in float32 work slots: a later
    batch of plain arrays is rounded into its delivered slot too."""
    check_plain_rows_after_cf_rows_are_rounded(_cfg(dtype="bf16"), dataset, tmp_path)


def test_unsigned_attribute_is_refused_not_read_signed(tmp_path):
    """``_Unsigned="true"`` on int8 (netCDF's unsigned bytes, which xarray reads as uint8): never the signed
    values as if decoded, a typed error; ``cf=False`` reads the stored values."""
    uri = str(tmp_path / "u.zarr")
    z = zarr.create_array(uri, shape=(4, 4), chunks=(4, 4), dtype="i1", fill_value=0,
                          attributes={"_Unsigned": "true", "_FillValue": -1})
    z[...] = np.full((4, 4), -56, "i1")  # 200 as uint8
    box = [(0, 4), (0, 4)]
    with stoker.Pipeline(_cfg(batch_size=1)) as p:
        p.push(stoker.Sample(uri, box))
        with pytest.raises(stoker.UnsupportedFormat, match="_Unsigned"):
            p.pop()
    with stoker.Pipeline(_cfg(batch_size=1, cf=False)) as p:
        p.push(stoker.Sample(uri, box))
        with p.pop() as batch:
            assert (torch.from_dlpack(batch).numpy() == -56).all()


@pytest.mark.parametrize("var", ["p", "t2m"])
def test_a_fill_pad_of_an_array_with_a_fill_value_attribute_is_nan(dataset, var):
    """``pad="fill"`` of a CF array is its ``_FillValue``, decoded: NaN, in both Zarr formats. xarray writes a
    v3 array's Zarr fill_value apart from the attribute (0 for the packed int16 ``p``), and that was used:
    decoded, 30.0 (the add_offset), a plausible value where nothing was read."""
    uri = os.path.join(dataset, var)
    ref = xr.open_zarr(dataset)
    box = [(-2, 3), (0, 8), (-1, 8)]
    with stoker.Pipeline(_cfg(batch_size=1)) as pipe:
        pipe.push([stoker.Sample(uri, box, pad="fill")])
        got = torch.from_dlpack(pipe.pop()).clone()[0]
    assert torch.isnan(got[:2]).all() and torch.isnan(got[:, :, 0]).all()  # before the array's start: missing
    inside = ref[var].isel(time=slice(0, 3), y=slice(0, 8), x=slice(0, 8)).values.astype(np.float32)
    _assert_same(got[2:, :, 1:], inside)


def _write_packed(root, dtype: str, scale=0.001, offset=-1073741.824, fill=-2147483647, zarr_format=3) -> str:
    """A variable packed into 32- or 64-bit integers (or float64) by xarray: stored values near 2**30 (past
    float32's exact integers), add_offset cancelling most of each, a _FillValue and a chunk never written.
    Returns the array's URI."""
    rng = np.random.default_rng(5)
    raw = rng.integers(2**30, 2**30 + 5000, (8, 12)).astype(dtype)
    raw[1, 2] = raw[6, 11] = fill
    raw[0, 0] = 2**30 + 4097  # one past float32's spacing there: its float32 rounding decodes to 0.0
    path = str(root / f"packed_{dtype}_{zarr_format}.zarr")
    ds = xr.Dataset({"v": (("y", "x"), raw)})
    ds["v"].attrs.update(scale_factor=scale, add_offset=offset)
    ds["v"].encoding.update(_FillValue=fill, chunks=(4, 5))
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, consolidated=False)
    return os.path.join(path, "v")


def _numpy_cast(values: np.ndarray, dtype: str) -> torch.Tensor:
    """xarray's float64 values in the output: NumPy's one rounding (bfloat16: through float32, its rule)."""
    if dtype == "bf16":
        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(values.astype(np.float16 if dtype == "f16" else np.float32))


@pytest.mark.parametrize("out", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("dtype", ["int32", "uint32", "int64", "float64"])
def test_packed_wide_values_equal_xarray_without_lossy_casts(tmp_path, decode_path, dtype, out):
    """A CF-packed int32 (or wider, or float64) variable into a float output is not refused by the label-id rule
    (its decoded values are floats), and the batch is xarray's float64 values rounded once: decoded from the
    stored values in float64 work slots, not from their float32 rounding (which put every value near 2**30
    up to 64 apart, and 0.064 off after the add_offset cancelled the rest). Crops cross chunk edges."""
    uri = _write_packed(tmp_path, dtype, fill=4294967295 if dtype == "uint32" else -2147483647)
    ref = xr.open_zarr(os.path.dirname(uri), consolidated=False)["v"].values
    assert ref.dtype == np.float64 and np.isnan(ref[1, 2])
    boxes = [((0, 6), (0, 8)), ((2, 8), (3, 11))]
    with stoker.Pipeline(_cfg(batch_size=2, dtype=out)) as pipe:
        pipe.push([stoker.Sample(uri, b) for b in boxes])
        x = torch.from_dlpack(pipe.pop()).clone()
    for i, box in enumerate(boxes):
        want = _numpy_cast(ref[tuple(slice(a, b) for a, b in box)], out)
        got = x[i]
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)]), (got, want)


def test_packed_int16_into_f16_is_rounded_once(tmp_path, decode_path):
    """An int16 variable packed by xarray into an f16 batch is xarray's float64 values rounded once, as NumPy
    casts them (the rule of "f16" outputs, and what the float64 work slots of wider packed arrays give): it
    was decoded into a float32 work slot (rounded to nearest) and rounded again into float16, so a value just
    past a float16 tie that float32 rounds onto the tie went to even, the wrong way: 281.125001 became 281.0,
    not 281.25 (here 30 of 80 values). Fills stay NaN."""
    stored = np.arange(40, dtype=np.int16).reshape(4, 10)
    stored[3, 9] = -32768
    path = str(tmp_path / "ties.zarr")
    ds = xr.Dataset({"v": (("y", "x"), stored)})
    ds["v"].attrs.update(scale_factor=1e-6, add_offset=281.125)
    ds["v"].encoding.update(_FillValue=-32768, chunks=(2, 10))
    ds.to_zarr(path, mode="w", zarr_format=3, consolidated=False)
    ref = xr.open_zarr(path, consolidated=False)["v"].values
    assert ref.dtype == np.float64 and ref[0, 1] == 281.125001
    with stoker.Pipeline(_cfg(batch_size=1, dtype="f16")) as pipe:
        pipe.push([stoker.Sample(os.path.join(path, "v"), ((0, 4), (0, 10)))])
        got = torch.from_dlpack(pipe.pop()).clone()[0]
    want = torch.from_numpy(ref.astype(np.float16))
    assert float(want[0, 1]) == 281.25
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got[3, 9]))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok]), (got, want)


def test_float16_roundings_of_float64_results_are_numpys():
    """Both ways a float32 work buffer takes float64 results for a float16 batch (the CPU's, NumPy's float16
    cast; a device's, rounding to odd, run here on the CPU) round into float16 as NumPy casts the float64
    values, once: values next to ties at every scale, float16's subnormals, its largest and past it, zeros,
    NaN and inf. Rounded to nearest twice, thousands of them were not. Past float16 the CPU's keeps the finite
    float32, which the check of the rounding after refuses (a DtypeMismatch, not an inf)."""
    from stoker.engine.cpu.cf import round_to_odd_, to_odd_

    rng = np.random.default_rng(0)
    ties = np.arange(-65504, 65504, 0.125)[::7]
    ties = ties + rng.integers(-3, 4, ties.size) * 1e-9
    scaled = rng.normal(0, 1, 200_000) * 10.0 ** rng.integers(-9, 5, 200_000)
    edges = [np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 65519.9, 65520.0, 7e4, 2.0 ** -25, 2.0 ** -25 * 1.0000001,
             -2.0 ** -25 * 1.0000001, 1e-50, -1e-50, 281.125001, 3.5e38]
    t = torch.from_numpy(np.concatenate([ties, scaled, edges]))
    with np.errstate(over="ignore"):
        want = t.numpy().astype(np.float16)
    assert (t.float().half().numpy() != want).sum() > 1000  # rounded to nearest twice
    for way in (round_to_odd_, to_odd_):
        v = t.float()
        way(v, t)
        got = v.half().numpy()
        ok = np.isinf(want) & np.isfinite(t.numpy())  # past float16: refused after, never written
        np.testing.assert_array_equal(got[~ok], want[~ok])
    v = t.float()
    round_to_odd_(v, t)
    assert float(v[-8]) == 7e4  # finite: the check of the rounding into float16 names it


def test_packed_wide_values_after_a_first_batch_without_are_refused(tmp_path, decode_path):
    """The work slots are sized at the first batch: a packed int32 array met later would be decoded from its
    float32 rounding, so that batch is a DtypeMismatch saying what to do, not wrong values. An executor that
    decodes after a float32 cast (the GPU decode, here on its host stand-in) refuses it the same way."""
    from stoker.engine.gpu.executor import GpuDecodeExecutor
    from stoker.engine.pipeline import facade

    uri = _write_packed(tmp_path, "int32")
    plain = str(tmp_path / "plain.zarr")
    zarr.create_array(plain, shape=(8, 12), chunks=(4, 5), dtype="f4", fill_value=0)[...] = 1.5
    box = ((0, 4), (0, 5))
    with stoker.Pipeline(_cfg(batch_size=1)) as pipe:
        pipe.push([stoker.Sample(plain, box), stoker.Sample(uri, box)])
        assert torch.equal(torch.from_dlpack(pipe.pop()), torch.full((1, 4, 5), 1.5))
        with pytest.raises(stoker.DtypeMismatch, match=r"float64 to its stored int32.*first batch.*cf=False"):
            pipe.pop()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(facade, "make_executor", lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store))
        with stoker.Pipeline(_cfg(batch_size=1, device_buffer_bytes=16 << 20)) as pipe:
            pipe.push([stoker.Sample(uri, box)])
            with pytest.raises(stoker.DtypeMismatch, match=r"float64 to its stored int32"):
                pipe.pop()


def test_decoded_values_past_a_16_bit_output_are_refused(tmp_path, decode_path):
    """int16 packed with scale_factor 10: xarray's values reach 327,670, past float16's largest (65,504); the
    "f16" batch that decodes them is a DtypeMismatch naming the array, never inf; "bf16" holds them."""
    path = str(tmp_path / "big.zarr")
    raw = np.arange(-48, 48, dtype=np.int16).reshape(8, 12) * 600
    ds = xr.Dataset({"v": (("y", "x"), raw)})
    ds["v"].attrs.update(scale_factor=10.0)
    ds.to_zarr(path, mode="w", zarr_format=3, consolidated=False)
    uri = os.path.join(path, "v")
    ref = xr.open_zarr(path, consolidated=False)["v"].values
    box = ((0, 8), (0, 12))
    with stoker.Pipeline(_cfg(batch_size=1, dtype="f16")) as pipe:
        pipe.push([stoker.Sample(uri, box)])
        with pytest.raises(stoker.DtypeMismatch, match=r"big.zarr/v.*f16's largest.*inf") as info:
            pipe.pop()
        assert info.value.uri == uri and info.value.key == "c/0/0"  # (its first value past f16: chunk 0, 0)
    with stoker.Pipeline(_cfg(batch_size=1, dtype="bf16")) as pipe:
        pipe.push([stoker.Sample(uri, box)])
        _assert_same(torch.from_dlpack(pipe.pop())[0], ref)


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_scaled_float_variables_are_decoded_in_their_own_dtype(tmp_path, decode_path, dtype, zarr_format):
    """A float variable with scale_factor and add_offset and xarray's default NaN _FillValue: xarray masks
    nothing and scales in the variable's own dtype, each step rounded; the batch is its values exactly (it
    was the float64 result rounded once: 1 ulp off for most values)."""
    rng = np.random.default_rng(3)
    raw = (rng.normal(0, 300, (8, 12))).astype(dtype)
    raw[2, 3] = np.nan
    path = str(tmp_path / f"s{zarr_format}.zarr")
    ds = xr.Dataset({"v": (("y", "x"), raw)})
    ds["v"].attrs.update(scale_factor=0.1, add_offset=273.15)
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, consolidated=False)
    ref = xr.open_zarr(path, consolidated=False)["v"].values
    assert ref.dtype == np.dtype(dtype)  # the oracle's own arithmetic: in the variable's dtype
    box = ((1, 7), (2, 10))
    for out in ("f32", "bf16"):
        with stoker.Pipeline(_cfg(batch_size=1, dtype=out)) as pipe:
            pipe.push([stoker.Sample(os.path.join(path, "v"), box)])
            _assert_same(torch.from_dlpack(pipe.pop())[0], ref[1:7, 2:10])


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_scaled_float_variables_with_a_fill_are_decoded_in_float64(tmp_path, decode_path, dtype, zarr_format):
    """The same float variable with a number as its _FillValue: xarray masks it and then scales in float64
    (its own dtype only follows a NaN fill); the batch is that float64 result rounded once, the fill NaN."""
    rng = np.random.default_rng(3)
    raw = (rng.normal(0, 300, (8, 12))).astype(dtype)
    raw[2, 3] = -9999
    path = str(tmp_path / f"s{zarr_format}.zarr")
    ds = xr.Dataset({"v": (("y", "x"), raw)})
    ds["v"].attrs.update(scale_factor=0.1, add_offset=273.15)
    ds["v"].encoding["_FillValue"] = -9999.0
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, consolidated=False)
    ref = xr.open_zarr(path, consolidated=False)["v"].values
    assert ref.dtype == np.float64 and np.isnan(ref[2, 3])  # the oracle's own arithmetic: float64
    box = ((1, 7), (2, 10))
    for out in ("f32", "bf16"):
        with stoker.Pipeline(_cfg(batch_size=1, dtype=out)) as pipe:
            pipe.push([stoker.Sample(os.path.join(path, "v"), box)])
            _assert_same(torch.from_dlpack(pipe.pop())[0], ref[1:7, 2:10])


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("dtype,fill", [("uint64", 2**64 - 1), ("int64", 2**63 - 1), ("int64", -2**63)])
def test_a_fill_at_a_64_bit_integer_extreme_is_masked_as_xarray_masks_it(tmp_path, decode_path, zarr_format, dtype,
                                                                         fill):
    """A 64-bit _FillValue at its dtype's extreme (2**64 - 1, the usual "no id" of uint64 label arrays) is no
    float64: kept as a float it read as 2**64, past the dtype, and was never masked (1.8e19 in the batch where
    xarray has NaN), and the numpy decoding cast it back to 0 (masking the ids 0)."""
    from stoker.reader.array import open_array
    from stoker.reader.coords import coding

    ids = np.array([[0, 1, fill, 7], [fill, 3, 0, 2]] * 2, dtype=dtype)
    ds = xr.Dataset({"ids": (("y", "x"), ids)})
    ds["ids"].encoding["_FillValue"] = np.dtype(dtype).type(fill)
    path = str(tmp_path / "d.zarr")
    ds.to_zarr(path, zarr_format=zarr_format, consolidated=False)
    want = xr.open_zarr(path, consolidated=False)["ids"].values  # float64, NaN at the fills
    assert np.isnan(want).sum() == 4 and not np.isnan(want[0, 0])
    with stoker.Pipeline(_cfg(batch_size=1, lossy_casts=True)) as pipe:
        pipe.push(stoker.Sample(os.path.join(path, "ids"), [(0, 4), (0, 4)]))
        with pipe.pop() as b:
            got = torch.from_dlpack(b).numpy()[0]
    np.testing.assert_array_equal(got, want.astype(np.float32))
    code = coding(open_array(os.path.join(path, "ids")))
    np.testing.assert_array_equal(code.decode(ids, np.float64), want)
