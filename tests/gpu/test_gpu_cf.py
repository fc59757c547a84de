"""CF attributes decoded by the GPU-decode executor (Config(decode_on="gpu")), run end to end on CPU tensors
(``GpuDecodeExecutor.on_host``, its stream decoder gpu.reference.HostDecoder): batches equal xarray's decoded
values (int16 packed with scale_factor/add_offset/_FillValue, float32 with a _FillValue, float64 with
missing_value), in float32 and bfloat16 (decoded in the float32 work buffer, rounded once), before the
transform, per channel and per field; and the CPU executor's batches bit for bit, padded boxes included."""

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
from stoker.engine import choose as executors
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.pipeline import facade as pipelines
from stoker.transforms import FillNaN

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

# q (float64) is cast on the CPU, with the executor's notice saying so
pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:stoker's GPU decode:RuntimeWarning")]



@pytest.fixture
def on_host(monkeypatch):
    """Pipelines built in the test decode with the GPU-decode executor on CPU tensors; yields those made."""
    made = []

    def factory(cfg, device, stats, store):
        made.append(GpuDecodeExecutor.on_host(cfg, stats, store))
        return made[-1]

    monkeypatch.setattr(pipelines, "make_executor", factory)
    return made


@pytest.fixture(scope="module", params=[2, 3])
def dataset(request, tmp_path_factory):
    """The CF dataset of cf_data.write_dataset, in Zarr format 2 and 3."""
    return write_dataset(tmp_path_factory.mktemp("cf"), request.param)


def _cfg(**kw):
    base = dict(batch_size=4, dtype="f32", host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20,
                n_io_threads=1, n_compute_threads=1, pop_timeout_s=20.0, device="cpu")
    return stoker.Config(**{**base, **kw})


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_batches_equal_xarray(dataset, on_host, dtype):
    rows, stats = check_batches_equal_xarray(_cfg(dtype=dtype), dataset)
    assert on_host and all(isinstance(ex, GpuDecodeExecutor) for ex in on_host)
    ex = on_host[0]
    assert ex.cf_work and ex.work_dtype(ex.dtype) == torch.float32  # bf16 too: decoded in float32, rounded once
    assert stats.bytes_to_device > 0  # the chunks crossed encoded and were decoded by the stream decoder
    assert all(x.dtype == {"f32": torch.float32, "bf16": torch.bfloat16}[dtype] for _, x in rows)


def test_decoded_before_the_transform(dataset, on_host):
    check_decoded_before_the_transform(_cfg(dtype="f16", transform=FillNaN(0.0)), dataset)
    assert on_host


def test_fields_are_decoded_each_in_its_lane(dataset, on_host):
    """Samples of named fields: each field's lane (a GPU-decode executor of its own) decodes its arrays."""
    ref = xr.open_zarr(dataset, consolidated=False)
    boxes = _boxes(4)
    samples = [stoker.Sample({"p": (os.path.join(dataset, "p"), box),
                              "t2m": (os.path.join(dataset, "t2m"), [(a, a + 1) for a, _ in box])})
               for box in boxes]
    with stoker.Pipeline(_cfg(dtype={"p": "bf16", "t2m": "f32"})) as pipe:
        pipe.push(samples)
        batch = pipe.pop()
        got = {k: torch.from_dlpack(v).clone() for k, v in batch.items()}
    assert len(on_host) == 3  # the pipeline's, then one per field
    for i, box in enumerate(boxes):
        _assert_same(got["p"][i], _want(ref, "p", box))
        _assert_same(got["t2m"][i], _want(ref, "t2m", [(a, a + 1) for a, _ in box]))


@pytest.mark.parametrize("pad", ["fill", "reflect"])
def test_padded_boxes_are_the_cpu_executor_s(dataset, on_host, pad):
    """The padding is filled before the decoding (a "fill" pad is the array's CF _FillValue, decoded: NaN),
    as on the CPU path."""
    boxes = [[(-2, 2), (15, 24), (-3, 7)], [(10, 14), (0, 9), (20, 30)]] * 2
    samples = [stoker.Sample(os.path.join(dataset, "p"), box, pad=pad) for box in boxes]
    with stoker.Pipeline(_cfg(dtype="bf16")) as pipe:
        pipe.push(samples)
        got = torch.from_dlpack(pipe.pop()).clone()
    assert on_host
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipelines, "make_executor", executors.make_executor)
        with stoker.Pipeline(_cfg(dtype="bf16")) as pipe:
            pipe.push(samples)
            want = torch.from_dlpack(pipe.pop()).clone()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert torch.isnan(got).any()
    if pad == "fill":  # what lies outside the array (time -2, -1) is its _FillValue, decoded: NaN
        assert torch.isnan(got[0, :2]).all()


def test_cf_false_reads_the_stored_values(dataset, on_host):
    raw = zarr.open_array(os.path.join(dataset, "p"), mode="r")[...]
    samples = [stoker.Sample(os.path.join(dataset, "p"), box) for box in _boxes(4)]
    with stoker.Pipeline(_cfg(cf=False, dtype="bf16")) as pipe:
        pipe.push(samples)
        x = torch.from_dlpack(pipe.pop())
    assert on_host and not on_host[0].cf_work
    for i, s in enumerate(samples):
        want = torch.from_numpy(raw[tuple(slice(a, b) for a, b in s.aabb)].astype(np.float32)).to(torch.bfloat16)
        assert torch.equal(x[i], want)


def test_a_16_bit_output_without_float32_work_is_refused(dataset, on_host, tmp_path):
    """The work buffer is sized at the first batch: a CF array first met later in a bf16 pipeline is refused,
    not decoded in bf16."""
    check_cf_arrays_after_a_first_batch_without_are_refused(_cfg(dtype="bf16"), dataset, tmp_path)
    assert on_host


def test_batches_without_cf_rows_are_rounded_from_the_work_buffer(dataset, on_host, tmp_path):
    """A bf16 pipeline whose first batch reads CF arrays makes every batch in the float32 work buffer: a later
    batch of plain arrays is rounded into its slot too."""
    check_plain_rows_after_cf_rows_are_rounded(_cfg(dtype="bf16"), dataset, tmp_path)
    assert on_host and on_host[0].cf_work
