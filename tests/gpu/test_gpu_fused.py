"""The fused gather-cast-scatter kernel (stoker.engine.gpu.fused, a Triton prototype) against the torch-op
placement it would replace (stoker.engine.gpu.place): the GPU-decode executor run end to end on CPU tensors
(gpu.reference.HostDecoder) with one placement and then the other, batches held bit for bit to each other and
to zarr-python's crops. Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1); without
``triton`` (CPU builds of torch do not ship it) the tests are skipped."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

pytest.importorskip("triton")
if not torch.cuda.is_available():  # before the kernel is made: triton.jit reads it then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import stoker  # noqa: E402
from stoker.engine.gpu import fused  # noqa: E402
from stoker.engine.gpu import place as gpu_place  # noqa: E402
from stoker.engine.gpu.executor import GpuDecodeExecutor  # noqa: E402
from stoker.engine.pipeline import facade as pipelines  # noqa: E402

from batch_oracle import bits as _bits, expected as _expected  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def on_host(monkeypatch):
    """Pipelines built in the test decode with the GPU-decode executor on CPU tensors."""
    monkeypatch.setattr(pipelines, "make_executor",
                        lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store))


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    """Arrays whose chunks the device decodes (zstd; blosc with byte and bit shuffle), one it casts on the
    CPU (int32), edge chunks, and chunks never written (the fill value)."""
    root = tmp_path_factory.mktemp("fused")
    shape, chunks = (20, 37, 29), (8, 16, 16)
    specs = {"zstd-u16": ("uint16", ZstdCodec(level=3)),
             "shuffle-i16": ("int16", BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")),
             "bitshuffle-f32": ("float32", BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")),
             "lz4-u8": ("uint8", BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle")),
             "zstd-i32": ("int32", ZstdCodec(level=1))}
    made = {}
    for i, (name, (dtype, codec)) in enumerate(specs.items()):
        z = zarr.create_array(str(root / f"{name}.zarr"), shape=shape, chunks=chunks, dtype=dtype, fill_value=7,
                              compressors=codec)
        rng = np.random.default_rng(i)
        if dtype == "float32":
            data = rng.normal(0, 300, size=shape).astype(dtype)
            data.reshape(-1)[::97] = np.nan
        else:
            data = rng.integers(0, min(np.iinfo(dtype).max, 60000), size=shape).astype(dtype)
        z[8:] = data[8:]  # the first row of chunks is never written: filled with 7
        data[:8] = 7
        made[name] = (str(root / f"{name}.zarr"), data)
    return made


def _batches(uri, shape, dtype):
    rng = np.random.default_rng(3)
    crop = (9, 20, 17)
    samples = [stoker.Sample(uri, [(a, a + c) for a, c in zip([int(rng.integers(0, s - c + 1))
                                                               for s, c in zip(shape, crop)], crop)])
               for _ in range(6)]
    cfg = stoker.Config(batch_size=3, dtype=dtype, device="cpu", n_compute_threads=1, n_io_threads=1,
                        host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20)
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        return samples, [torch.from_dlpack(b).clone() for b in p]


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16", "native"])
@pytest.mark.parametrize("name", ["zstd-u16", "shuffle-i16", "bitshuffle-f32", "lz4-u8", "zstd-i32"])
def test_fused_kernel_places_what_the_torch_ops_place(arrays, on_host, monkeypatch, name, dtype):
    uri, data = arrays[name]
    _, reference = _batches(uri, data.shape, dtype)
    launches = []
    real = fused.place
    monkeypatch.setattr(gpu_place, "place", lambda *a: launches.append(a[-1]) or real(*a))
    samples, batches = _batches(uri, data.shape, dtype)
    assert launches, "the executor never placed through the fused kernel"
    for ref, got, at in zip(reference, batches, range(0, len(samples), 3)):
        same = _bits(ref) == _bits(got)
        if got.dtype in (torch.bfloat16, torch.float16, torch.float32):  # NaN bits may differ between casts
            same |= torch.isnan(ref) & torch.isnan(got)
        assert bool(same.all()), (name, dtype)
        for row, s in enumerate(samples[at:at + 3]):
            want = _expected(data, s, dtype)
            assert torch.equal(torch.nan_to_num(got[row].float(), 12345.0), torch.nan_to_num(want.float(), 12345.0))
