"""Complex arrays on the GPU-decode executor (its CPU stand-in, ``GpuDecodeExecutor.on_host``): complex64
batches (``dtype='native'``) are zarr-python's values; complex128, whose 16-byte elements it cannot move, is
refused naming the array and the knob (NotYetSupported), never an internal KeyError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.pipeline import facade as pipelines

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:stoker's GPU decode:RuntimeWarning")]


@pytest.fixture(autouse=True)
def on_host(monkeypatch):
    monkeypatch.setattr(pipelines, "make_executor",
                        lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store))


def _cfg():
    return stoker.Config(batch_size=1, dtype="native", device="cpu", n_io_threads=1, n_compute_threads=1,
                         host_buffer_bytes=8 << 20, device_buffer_bytes=8 << 20, pop_timeout_s=20.0)


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_arrays_are_read_or_refused_by_name(tmp_path, fmt, dtype):
    uri = str(tmp_path / "c.zarr")
    data = (np.arange(20).reshape(4, 5) * (1 - 2j)).astype(dtype)
    z = zarr.create_array(uri, shape=(4, 5), chunks=(2, 2), dtype=dtype, zarr_format=fmt, fill_value=1 + 1j)
    z[:2] = data[:2]  # rows 2.. missing: the fill value
    with stoker.Pipeline(_cfg()) as p:
        p.push([stoker.Sample(uri, ((0, 4), (0, 5)))])
        if dtype == "complex128":
            with pytest.raises(stoker.NotYetSupported, match="decode_on='cpu'") as info:
                p.pop()
            assert info.value.uri == uri and info.value.knob == "decode_on"
            return
        got = torch.from_dlpack(p.pop())[0].clone()
    assert torch.equal(got, torch.from_numpy(z[:]))
