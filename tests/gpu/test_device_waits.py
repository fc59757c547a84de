"""Every wait for the device has a limit (engine/gpu/streams.py ``poll``), without a GPU: a device that never
finishes its work (events whose ``query()`` never turns true, and whose ``synchronize()``, a wait without a
limit, fails the test) holds neither the CUDA transfer's close nor the nvCOMP decode's check.

- the CUDA transfer executor (``decode_on="cpu"`` on a GPU) runs here on CPU tensors with a host stand-in of
  its stream: its close stops waiting at the pipeline's one close deadline, warns once naming the transfer
  stream, and keeps every buffer its copies may use (device slots, staging and work buffers, pinned host
  slots), none handed back;
- the nvCOMP decode's check (a fake nvCOMP call whose event never completes) raises DeviceError at its
  shortened limit, keeps what the decode may still write, and the checks queued behind it fail at once.
"""

from __future__ import annotations

import time
import warnings

import numcodecs
import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine import buffers
from stoker.engine.cuda.transfer import CudaExecutor
from stoker.engine.gpu import nvcomp, streams as gpu_streams
from stoker.engine.gpu.capi import Queued
from stoker.engine.gpu.frames import ZSTD, parse_zstd
from stoker.engine.gpu.streams import HostStreams, poll
from stoker.engine.pipeline import facade as pipelines
from batch_oracle import random_crops

pytestmark = pytest.mark.timeout(120)

SHAPE, CHUNKS = (16, 64, 64), (8, 32, 32)


class Hung(HostStreams):
    """The host stand-in with events: each done once recorded, until :meth:`hang`; from then on none is ever
    done (a hung device). ``recorded``: the events made so far."""

    def __init__(self) -> None:
        self.hung = False
        self.recorded: list[HungEvent] = []

    def hang(self) -> None:
        self.hung = True

    def record(self, stream):
        self.recorded.append(HungEvent(self))
        return self.recorded[-1]


class HungEvent:
    def __init__(self, owner) -> None:
        self.owner = owner
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return not self.owner.hung

    def synchronize(self) -> None:
        raise AssertionError("a wait for the device without a limit")


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("waits") / "a.zarr")
    z = zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="uint16", compressors=ZstdCodec(level=3))
    z[:] = np.random.default_rng(3).integers(0, 4000, size=SHAPE).astype("uint16")
    return uri


def _cfg(**kw):
    base = dict(batch_size=2, dtype="bf16", device="cpu", n_compute_threads=1, n_io_threads=1,
                lookahead_batches=2, host_buffer_bytes=8 << 20, device_buffer_bytes=8 << 20, pop_timeout_s=30.0,
                decode_on="cpu")
    return stoker.Config(**{**base, **kw})


def test_poll_returns_what_is_not_done_by_the_deadline_and_looks_at_least_once():
    backend = Hung()
    events = [backend.record(None) for _ in range(3)]
    assert poll(events, HostStreams().done, time.monotonic() + 5.0) == []
    backend.hang()
    assert poll(events, HostStreams().done, time.monotonic() + 0.05) == events
    before = [e.queries for e in events]
    assert poll(events, HostStreams().done, time.monotonic() - 1.0) == events  # (a deadline passed: one look)
    assert [e.queries for e in events] == [q + 1 for q in before]


def _cuda_on_host(monkeypatch, backend):
    """Pipelines make the CUDA transfer executor, on CPU tensors, its stream's events from ``backend``."""
    made = []

    def factory(cfg, device, stats, store):
        made.append(CudaExecutor(cfg, torch.device("cpu"), stats, store, streams=backend))
        return made[-1]

    monkeypatch.setattr(pipelines, "make_executor", factory)
    return made


def test_the_cuda_transfer_on_host_makes_the_cpu_path_s_batches_and_closes_quietly(volume, monkeypatch):
    samples = random_crops(volume, SHAPE, (8, 24, 40), 6, 5)
    with stoker.Pipeline(_cfg()) as p:
        p.push(samples)
        want = [torch.from_dlpack(b).clone() for b in p]
    backend = Hung()
    made = _cuda_on_host(monkeypatch, backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stoker.Pipeline(_cfg()) as p:
            p.push(samples)
            got = [torch.from_dlpack(b).clone() for b in p]
    assert made and made[0].transfer is not None and not made[0].transfer.stuck
    assert len(got) == len(want) == 3 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert not [w for w in caught if "did not finish" in str(w.message)]
    assert len(backend.recorded) >= 2 * 3 + 1  # each batch's copy and end, and the close's


def test_close_on_a_hung_device_stops_at_the_deadline_warns_once_and_keeps_the_transfer_s_buffers(
        volume, monkeypatch):
    """Batches made, then the device hangs: Pipeline.close() waits for the transfer stream until the one close
    deadline (CLOSE_WAIT_S, shortened), warns once naming the stream, and keeps every buffer a queued copy may
    still read or write (device slots, the staging of the cast, the work buffer, the host slots) referenced,
    no slot handed to the spare slots; a second close neither waits nor warns again."""
    monkeypatch.setattr(gpu_streams, "CLOSE_WAIT_S", 0.2)
    spare = buffers.SpareSlots(buffers.SPARE_SLOT_BYTES)  # (the closed rings' slots go here, or not at all)
    monkeypatch.setattr(buffers, "SPARE_SLOTS", spare)
    backend = Hung()
    made = _cuda_on_host(monkeypatch, backend)
    # a transform on a 16-bit output: the float32 work buffer and the staging of the cast both exist
    p = stoker.Pipeline(_cfg(transform=lambda x: x.mul_(2)))
    p.push(random_crops(volume, SHAPE, (8, 24, 40), 4, 6))
    assert len([torch.from_dlpack(b).clone() for b in p]) == 2
    ex = made[0]
    transfer = ex.transfer
    assert transfer._stage is not None and transfer._work is not None
    before = len(gpu_streams.kept())
    backend.hang()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p.close()
        p.close()
        ex.close()  # (its own close again: the stream was given up on already)
    stuck = [w for w in caught if issubclass(w.category, RuntimeWarning) and "did not finish" in str(w.message)]
    assert len(stuck) == 1, [str(w.message) for w in caught]
    message = str(stuck[0].message)
    assert "the transfer stream(s) of CudaExecutor on cpu" in message and "within 0.2 s" in message, message
    assert "restart the process to free them" in message
    assert transfer.stuck
    closes = [e for e in backend.recorded if e.queries]
    assert closes and all(e.queries >= 2 for e in closes[-1:])  # polled, not waited for without a limit
    kept = {id(x) for x in gpu_streams.kept()[before:]}
    assert all(id(x) in kept for x in (transfer.slots, transfer._stage, transfer._work, ex.host_slots))
    for ring in (transfer.slots, ex.host_slots):
        assert ring.kept and ring.slots and all(slot.tensor is not None for slot in ring.slots)
    assert spare.held_bytes == 0
    with pytest.raises(stoker.ShutdownError):  # no copy is queued after the close's event
        transfer.issue(ex.host_slots.slots[0].tensor[:0], transfer.slots.slots[0])


def test_a_transfer_that_finishes_in_time_keeps_nothing(volume, monkeypatch):
    """The normal close: the stream's event is done, nothing is kept, the plain host slots go to the spare
    slots (the host stand-in's), no warning."""
    spare = buffers.SpareSlots(buffers.SPARE_SLOT_BYTES)
    monkeypatch.setattr(buffers, "SPARE_SLOTS", spare)
    made = _cuda_on_host(monkeypatch, Hung())
    before = len(gpu_streams.kept())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stoker.Pipeline(_cfg()) as p:
            p.push(random_crops(volume, SHAPE, (8, 24, 40), 2, 7))
            assert len([torch.from_dlpack(b).clone() for b in p]) == 1
    assert not [w for w in caught if "did not finish" in str(w.message)]
    assert not made[0].transfer.stuck and len(gpu_streams.kept()) == before
    assert not made[0].host_slots.kept and spare.held_bytes > 0


# -- the nvCOMP decode's check ------------------------------------------------------------------------------

class _NeverDone:
    """nvCOMP's batched call, faked (nothing real runs without a GPU): it queues nothing, and the event of its
    decode never completes."""

    def __init__(self, backend: Hung) -> None:
        self.backend = backend
        self.queued: list[Queued] = []

    def temp_bytes(self, n, max_bytes, total_bytes):
        return 64

    def decompress(self, src, csize, dst, dsize, temp, stream):
        n = len(src)
        self.queued.append(Queued(torch.from_numpy(np.array(dsize, np.int64)), torch.zeros(n, dtype=torch.int32),
                                  self.backend.record(stream)))  # (what a good decode reports)
        return self.queued[-1]


def _host_decoder(backend: Hung):
    """nvCOMP's DeviceDecoder without its CUDA set-up (its constructor needs a device): on CPU tensors, its
    batched calls the fake above."""
    decoder = object.__new__(nvcomp.DeviceDecoder)
    decoder.device, decoder.stream = torch.device("cpu"), None
    decoder._codecs = {ZSTD: _NeverDone(backend)}
    return decoder


def test_a_decode_check_on_a_hung_device_raises_device_error_at_its_limit(monkeypatch):
    monkeypatch.setattr(nvcomp, "CHECK_WAIT_S", 0.1)
    backend = Hung()
    decoder = _host_decoder(backend)
    data = np.arange(5000, dtype=np.uint16).tobytes()
    layout = parse_zstd(numcodecs.Zstd(level=3).encode(data), len(data))
    staged, out = torch.zeros(layout.in_nbytes, dtype=torch.uint8), torch.zeros(layout.out_nbytes, dtype=torch.uint8)
    rows = np.flatnonzero(~layout.raw)
    temp = torch.zeros(64, dtype=torch.uint8)

    check = decoder._decompress(ZSTD, staged, out, layout, rows, temp)
    check()  # the device keeps up: the check passes
    before = len(gpu_streams.kept())
    backend.hang()
    first = decoder._decompress(ZSTD, staged, out, layout, rows, temp)
    behind = decoder._decompress(ZSTD, staged, out, layout, rows, temp)
    with pytest.raises(stoker.DeviceError, match=r"zstd streams of chunks \[0\] on cpu did not finish within 0.1 s"
                                                 r".*Config\(decode_on='cpu'\)"):
        first()
    event = decoder._codecs[ZSTD].queued[1].event
    assert event.queries >= 2  # polled until the limit, never synchronized
    kept = {id(x) for x in gpu_streams.kept()[before:]}
    assert all(id(x) in kept for x in (decoder._codecs[ZSTD].queued[1], staged, out, temp))
    monkeypatch.setattr(nvcomp, "CHECK_WAIT_S", 1000.0)  # (the one behind it fails at once: no second limit)
    with pytest.raises(stoker.DeviceError, match="queued behind one that has not finished"):
        behind()
    backend.hung = False  # the device finishes after all: the checks pass again
    decoder._decompress(ZSTD, staged, out, layout, rows, temp)()
