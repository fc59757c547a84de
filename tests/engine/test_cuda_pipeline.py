"""The pipeline on a CUDA device: same bits as the CPU path, stream-fenced hand-off, slot reuse after events.

Every test here needs an NVIDIA GPU and is skipped where torch sees none.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec

import stoker
from test_pipeline import _random_samples  # tests/ is on sys.path (pytest's prepend mode)

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda") / "v.zarr"
    rng = np.random.default_rng(0)
    data = rng.integers(0, 60000, size=(32, 96, 96), endpoint=True).astype(np.uint16)
    z = zarr.create_array(str(path), shape=data.shape, chunks=(8, 32, 32), dtype="uint16",
                          compressors=BloscCodec(cname="lz4", shuffle="shuffle"))
    z[:] = data
    return str(path), data


def _cfg(device, **kw):
    base = dict(batch_size=4, dtype="f32", host_buffer_bytes=64 << 20, device_buffer_bytes=64 << 20,
                n_io_threads=2, n_compute_threads=2, pop_timeout_s=30.0, device=device,
                decode_on="cpu")  # this file is the CPU-decode CUDA path ("auto" on 2 threads: the GPU decode)
    base.update(kw)
    return stoker.Config(**base)


@pytest.fixture(autouse=True)
def _bound():
    torch.cuda.set_device(0)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16", "native"])
def test_cuda_batches_equal_cpu_batches_bit_for_bit(volume, dtype):
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 40, 24), 24)
    with stoker.Pipeline(_cfg("cpu", dtype=dtype)) as p:
        p.push(samples)
        expected = [torch.from_dlpack(b).clone() for b in p]
    got = []
    with stoker.Pipeline(_cfg(0, dtype=dtype)) as p:
        assert p.device == torch.device("cuda", 0)
        p.push(samples)
        for b in p:
            assert b.info.device == torch.device("cuda", 0) and b.info.ready_event is not None
            got.append(torch.from_dlpack(b).cpu())
        assert p._host_slots.slots[0].tensor.is_pinned()
        transfer = p.stats().stages["transfer"]
    assert len(got) == len(expected) == 6
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
    # uint16 crossed PCIe as uint16: half the bytes of float32, cast on the device
    crop_bytes = 4 * 8 * 40 * 24
    assert transfer.bytes_in == 6 * crop_bytes * 2


def test_device_none_binds_to_the_current_device(volume):
    uri, data = volume
    with stoker.Pipeline(_cfg(None)) as p:
        assert p.device == torch.device("cuda", torch.cuda.current_device())


def test_from_dlpack_fences_a_side_consumer_stream(volume):
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 40, 24), 40, seed=5)
    consumer = torch.cuda.Stream()
    with stoker.Pipeline(_cfg(0)) as p, torch.cuda.stream(consumer):
        p.push(samples)
        for b in p:
            x = torch.from_dlpack(b)  # consumer waits on the batch's event
            total = x.double().sum()  # runs on `consumer`
            want = sum(float(data[tuple(slice(a, c) for a, c in s.aabb)].astype(np.float64).sum()) for s in b.samples)
            assert total.item() == want


def test_release_with_event_defers_slot_reuse_until_the_event(volume):
    """The consumer's slow kernel reads the batch after release(); the slot must not be refilled first."""
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 40, 24), 60, seed=7)
    consumer = torch.cuda.Stream()
    with stoker.Pipeline(_cfg(0, lookahead_batches=1)) as p:
        p.push(samples)
        first = p.pop()
        expected = torch.from_dlpack(first).clone()
        with torch.cuda.stream(consumer):
            x = torch.from_dlpack(first)
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the read below
            late = x.clone()
            done = consumer.record_event()
        del x
        first.release(event=done)
        for _ in range(4):  # cycles both slots: the first is reused after `done`
            with p.pop():
                pass
        consumer.synchronize()
        assert torch.equal(late, expected)


def test_plain_release_waits_for_work_queued_after_release(volume):
    """Default release(): the consumer keeps the tensor, releases, then queues more work on its stream."""
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 40, 24), 60, seed=8)
    with stoker.Pipeline(_cfg(0, lookahead_batches=1)) as p:
        p.push(samples)
        with p.pop() as first:
            x = torch.from_dlpack(first)
            expected = x.clone()
        torch.cuda._sleep(200_000_000)
        late = x.clone()  # queued after release, on the current stream
        del x
        for _ in range(4):
            with p.pop():
                pass
        torch.cuda.synchronize()
        assert torch.equal(late, expected)


def test_mismatched_device_raises_naming_both():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.set_device(0)
    with pytest.raises(stoker.InvalidArgument, match="cuda:1.*cuda:0"):
        stoker.Pipeline(_cfg(1))


def test_device_budget_exceeded_at_construction():
    with pytest.raises(stoker.BudgetExceeded) as info:
        stoker.Pipeline(_cfg(0, sample_shape=(32, 128, 128), batch_size=8, device_buffer_bytes=8 << 20))
    assert info.value.knob == "device_buffer_bytes"


def test_close_with_held_cuda_batches_is_prompt(volume):
    uri, data = volume

    def endless():
        while True:
            yield from _random_samples(uri, data.shape, (8, 40, 24), 16)

    p = stoker.Pipeline(_cfg(0))
    p.push(endless())
    held = [p.pop(), p.pop()]
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 2.0
    assert torch.from_dlpack(held[0]).is_cuda  # still readable after close


def test_release_with_a_wrong_event_raises_and_keeps_the_slot(volume):
    """A bad release(event=...) gives nothing back, so a later release() still returns the slot."""
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 40, 24), 4 * 8)
    with stoker.Pipeline(_cfg(0, lookahead_batches=1, pop_timeout_s=5.0)) as p:
        p.push(samples)
        for _ in range(8):  # more batches than slots: each slot must come back
            b = p.pop()
            with pytest.raises(TypeError, match="release\\(event=...\\) takes"):
                b.release(event="done")
            b.release(event=torch.cuda.current_stream())


def test_release_accepts_the_generic_torch_stream_and_event(volume):
    uri, data = volume
    samples = _random_samples(uri, data.shape, (8, 40, 24), 4 * 6)
    with stoker.Pipeline(_cfg(0, lookahead_batches=1, pop_timeout_s=5.0)) as p:
        p.push(samples)
        for i in range(6):
            b = p.pop()
            x = torch.from_dlpack(b)
            (x * 2).sum()
            generic = torch.Stream(device="cuda:0")
            b.release(event=generic if i % 2 else generic.record_event())


def test_pinned_staging_is_charged_at_the_size_torch_pins(volume):
    """torch rounds pinned allocations up to a power of two; the budget counts the rounded bytes."""
    uri, data = volume
    shape = (8, 96, 96)
    slot = 4 * 8 * 96 * 96 * 4  # f32 host slot: 1,179,648 B, pinned as 2,097,152 B
    fits_unrounded = 3 << 20  # > 2 slots as asked, < 2 slots as pinned
    with pytest.raises(stoker.BudgetExceeded, match="power of two") as info:
        stoker.Pipeline(_cfg(0, sample_shape=shape, lookahead_batches=2, host_buffer_bytes=fits_unrounded))
    assert info.value.knob == "host_buffer_bytes"
    with stoker.Pipeline(_cfg(0, sample_shape=shape, lookahead_batches=2, host_buffer_bytes=16 << 20)) as p:
        p.push(_random_samples(uri, data.shape, shape, 4))
        with p.pop():
            pass
        assert p._host_slots.nbytes == 2 * (2 << 20) > 2 * slot
