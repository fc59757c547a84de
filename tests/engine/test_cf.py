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
