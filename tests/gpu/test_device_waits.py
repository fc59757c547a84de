"""Every wait for the device has a limit (engine/gpu/streams.py ``poll``), without a GPU: a device that never
finishes its work (events whose ``query()`` never turns true, and whose ``synchronize()``, a wait without a
limit, fails the test) holds neither the CUDA transfer's close nor the nvCOMP decode's check.

- the CUDA transfer executor (``decode_on="cpu"`` on a GPU) runs here on CPU tensors with a host stand-in of
  its stream: its close stops waiting at the pipeline's one close deadline, warns once naming the transfer
  stream, and keeps every buffer its copies may use (device slots, staging and work buffers, pinned host
  slots), none handed back;
- with a backend that models the streams' order (:class:`DepStreams`: an event is done once all its stream
  waited for before it is, the consumer's stream included), the transfer's close behind a busy consumer
  stream keeps its buffers only until the stream is past them, stops at the deadline it is given (not its
  own), and at it also when an issue() holds the lock through a transform that waits;
- the nvCOMP decode's check (a fake nvCOMP call whose kernel ends when the test says) waits for the decode
  to start without a limit (the consumer's stream may hold it longer than the limit: no error), raises
  DeviceError once a started decode passes its shortened limit, keeps what the decode may still write
  until it is done, the checks queued behind it fail at once, and the close ends its wait (the GPU
  executor gives its decoder the close: its threads have ended when the pipeline's close returns);
- a look at an event that raises (a device fault) is a DeviceError naming the work, and a close that sees
  one counts the stream stuck and still closes the store.
"""

from __future__ import annotations

import threading
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
from stoker.engine.cuda.transfer import CudaExecutor, CudaTransfer
from stoker.engine.gpu import nvcomp, streams as gpu_streams
from stoker.engine.gpu.capi import Queued
from stoker.engine.gpu.frames import ZSTD, parse_zstd
from stoker.engine.gpu.streams import HostStreams, poll
from stoker.engine.pipeline import facade as pipelines
from batch_oracle import random_crops
from hung_device import Hung, the_stuck_warning

pytestmark = pytest.mark.timeout(120)

SHAPE, CHUNKS = (16, 64, 64), (8, 32, 32)


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
    # (the executor's own close again last: the stream was given up on already)
    message = the_stuck_warning(p.close, p.close, ex.close)
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


# -- a backend that models the streams' order -------------------------------------------------------------

class Gate:
    """Device work that ends when the test says so: a kernel (``done`` never set: hung), or the consumer's
    stream (a training step, an NCCL barrier waiting for a rank that checkpoints)."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class Stream:
    def __init__(self) -> None:
        self.deps: list = []  # everything queued on it so far must end before later work


class DepStreams(HostStreams):
    """Streams as CUDA orders them: an event recorded on a stream is done once all the stream was made to
    wait for before it (other streams' events, other streams, the gates of its kernels) is done. ``failed``:
    from then on every look at an event raises, as torch's do after a device fault. ``synchronize()`` blocks
    until done (30 s at most, then fails the test: a wait nothing would end)."""

    def __init__(self) -> None:
        self.failed = False
        self.recorded: list[DepEvent] = []

    def stream(self, role=None):
        return Stream()

    def record(self, stream):
        self.recorded.append(DepEvent(self, list(stream.deps) if stream is not None else []))
        return self.recorded[-1]

    def wait(self, stream, event):
        if event is not None:
            stream.deps.append(event)

    def wait_stream(self, stream, other):
        stream.deps.append(other)


class DepEvent:
    def __init__(self, owner: DepStreams, deps: list) -> None:
        self.owner, self.deps, self.queries = owner, deps, 0

    def query(self) -> bool:
        self.queries += 1
        if self.owner.failed:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return all(d.query() for d in self.deps)

    def synchronize(self) -> None:
        deadline = time.monotonic() + 30.0
        while not self.query():
            if time.monotonic() > deadline:
                raise AssertionError("synchronize(): the work never ended")
            time.sleep(0.002)


def _eventually(predicate, within: float = 20.0) -> bool:
    """``predicate()`` turned true within ``within`` seconds (a bound, not a timing: the tests assert it)."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _holds(obj) -> bool:
    return any(x is obj for x in gpu_streams.kept())


@pytest.fixture
def reaped(monkeypatch):
    monkeypatch.setattr(gpu_streams, "REAP_PAUSE_S", 0.02)


# -- the CUDA transfer's close against the consumer's stream, an issue under way, a device fault ------------

def _transfer(backend, **kw):
    return CudaTransfer(torch.device("cpu"), 2, (2, 4), torch.float32, 0, streams=backend, **kw)


def test_a_close_behind_a_busy_consumer_stream_keeps_the_buffers_only_until_it_is_done(reaped):
    """The transfer stream waits for the consumer's release of a slot (its stream): a close while the
    consumer's step still runs stops at its deadline and keeps the buffers, then frees them once the stream
    is past its work; until then nothing is let go."""
    backend, consumer = DepStreams(), Gate()
    t = _transfer(backend)
    slot = t.slots.slots[0]
    slot.stream_waits = [consumer]
    t.issue(torch.ones(2, 4), slot)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert t.close(time.monotonic() + 0.05) is False
    assert t.stuck and _holds(t.slots) and t.slots.kept
    time.sleep(0.2)  # (ten looks of the reaper: the consumer still runs, so they are kept)
    assert _holds(t.slots)
    consumer.done = True
    assert _eventually(lambda: not _holds(t.slots))


def test_the_transfer_s_close_stops_at_the_pipeline_s_deadline_not_its_own(monkeypatch):
    """CudaTransfer.close(deadline) waits until the deadline given (the pipeline's one CloseWait), not
    CLOSE_WAIT_S of its own."""
    monkeypatch.setattr(gpu_streams, "CLOSE_WAIT_S", 600.0)
    backend, consumer = DepStreams(), Gate()
    t = _transfer(backend)
    slot = t.slots.slots[0]
    slot.stream_waits = [consumer]
    t.issue(torch.ones(2, 4), slot)
    result: list = []
    closing = threading.Thread(target=lambda: result.append(t.close(time.monotonic() + 0.1)), daemon=True)
    closing.start()
    closing.join(20.0)
    consumer.done = True
    assert not closing.is_alive() and result == [False] and t.stuck


def test_a_close_during_an_issue_whose_transform_waits_stops_at_its_deadline():
    """issue() holds the transfer's lock through the user's transform, which may wait for a hung device: the
    close sets _closed first, waits for the lock until its deadline only, and then counts the stream stuck
    (no event tells when that issue's copies end: its buffers are kept); the issue queues no copy after."""
    backend = Hung()
    t = _transfer(backend)
    inside, release = threading.Event(), threading.Event()

    def transform(x):
        inside.set()
        assert release.wait(30.0)
        return x

    issued: list = []

    def issue():
        try:
            issued.append(t.issue(torch.ones(2, 4), t.slots.slots[0], transform))
        except BaseException as exc:  # noqa: BLE001
            issued.append(exc)

    th = threading.Thread(target=issue, daemon=True)
    th.start()
    assert inside.wait(20.0)
    result: list = []
    closing = threading.Thread(target=lambda: result.append(t.close(time.monotonic() + 0.1)), daemon=True)
    closing.start()
    closing.join(20.0)
    alive = closing.is_alive()
    release.set()
    th.join(20.0)
    assert not alive and result == [False] and t.stuck and _holds(t.slots)
    with pytest.raises(stoker.ShutdownError):
        t.issue(torch.ones(2, 4), t.slots.slots[1])


def test_a_device_fault_seen_at_the_close_is_stuck_and_the_store_still_closes(volume, monkeypatch):
    """An event's query() that raises (torch on cudaErrorLaunchFailure) at the close: the transfer counts as
    stuck (its buffers kept, named in the one warning), and the pipeline closes the store all the same."""
    backend = DepStreams()
    made = _cuda_on_host(monkeypatch, backend)
    p = stoker.Pipeline(_cfg())
    p.push(random_crops(volume, SHAPE, (8, 24, 40), 4, 6))
    assert len([torch.from_dlpack(b).clone() for b in p]) == 2
    closed = []
    store_close = p._store.close
    monkeypatch.setattr(p._store, "close", lambda: (closed.append(1), store_close())[1])
    backend.failed = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p.close()
    stuck = [w for w in caught if "did not finish" in str(w.message)]
    assert closed == [1] and len(stuck) == 1 and "the transfer stream(s)" in str(stuck[0].message)
    assert made[0].transfer.stuck and made[0].transfer.closed is None and _holds(made[0].host_slots)


def test_pipeline_close_closes_the_others_the_store_and_warns_when_an_executor_s_close_raises(volume, monkeypatch):
    """Two fields (an executor each, beside the pipeline's own): the first field's close raises; the other
    field's executor is closed all the same, then the store, the one warning given, and the error raised."""
    made = _cuda_on_host(monkeypatch, Hung())
    p = stoker.Pipeline(_cfg(batch_size=1))
    p.push([stoker.Sample({name: (volume, [(0, 8), (0, 16), (0, 16)]) for name in ("a", "b")})])
    assert sorted(p.pop().keys()) == ["a", "b"]
    lanes = [ex for ex in made if ex.transfer is not None]
    assert len(lanes) == 2
    closed = []
    store_close = p._store.close
    monkeypatch.setattr(p._store, "close", lambda: (closed.append(1), store_close())[1])

    def broken(wait=None):
        raise RuntimeError("an executor's close failed")

    monkeypatch.setattr(lanes[0], "close", broken)
    warned = []
    monkeypatch.setattr(gpu_streams.CloseWait, "warn", lambda self, stacklevel=2: warned.append(1))
    with pytest.raises(RuntimeError, match="an executor's close failed"):
        p.close()
    assert lanes[1].transfer._closed and closed == [1] and warned == [1]


# -- the nvCOMP decode's check ------------------------------------------------------------------------------

class _Fake:
    """nvCOMP's batched call, faked (nothing real runs without a GPU): its kernel is a :class:`Gate` on the
    decoder's stream (``kernel``: done, or never), its event recorded after it."""

    def __init__(self, backend: DepStreams) -> None:
        self.backend = backend
        self.kernel = Gate(done=True)
        self.queued: list[Queued] = []

    def temp_bytes(self, n, max_bytes, total_bytes):
        return 64

    def decompress(self, src, csize, dst, dsize, temp, stream):
        n = len(src)
        stream.deps.append(self.kernel)
        self.queued.append(Queued(torch.from_numpy(np.array(dsize, np.int64)), torch.zeros(n, dtype=torch.int32),
                                  self.backend.record(stream)))  # (what a good decode reports)
        return self.queued[-1]


def _host_decoder(backend: DepStreams):
    """nvCOMP's DeviceDecoder without its CUDA set-up (its constructor needs a device): on CPU tensors, its
    stream and events ``backend``'s, its batched calls the fake above."""
    decoder = object.__new__(nvcomp.DeviceDecoder)
    decoder.device, decoder.stream = torch.device("cpu"), backend.stream()
    decoder._codecs = {ZSTD: _Fake(backend)}
    decoder._mark = lambda: backend.record(decoder.stream)
    return decoder


def _one_stream():
    data = np.arange(5000, dtype=np.uint16).tobytes()
    layout = parse_zstd(numcodecs.Zstd(level=3).encode(data), len(data))
    staged, out = torch.zeros(layout.in_nbytes, dtype=torch.uint8), torch.zeros(layout.out_nbytes, dtype=torch.uint8)
    return layout, staged, out, np.flatnonzero(~layout.raw), torch.zeros(64, dtype=torch.uint8)


def _in_thread(fn):
    """Run ``fn`` on a thread; returns (thread, outcome list: its result or exception)."""
    outcome: list = []

    def run():
        try:
            outcome.append(fn())
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, outcome


def test_a_decode_waiting_on_the_consumer_s_stream_longer_than_the_limit_does_not_fail(monkeypatch):
    """Decode k waits (through the placement of an earlier wave) for the consumer's release of a slot: its
    check waits for the decode to start without a limit, and the limit counts from the start only."""
    monkeypatch.setattr(nvcomp, "CHECK_WAIT_S", 0.2)
    backend, consumer = DepStreams(), Gate()
    decoder = _host_decoder(backend)
    layout, staged, out, rows, temp = _one_stream()
    decoder.stream.deps.append(consumer)  # (the stream's wait, queued before the decode)
    check = decoder._decompress(ZSTD, staged, out, layout, rows, temp)
    behind = decoder._decompress(ZSTD, staged, out, layout, rows, temp)
    th, outcome = _in_thread(check)
    time.sleep(1.0)  # five limits: the consumer's step, or a barrier of all ranks, still running
    consumer.done = True
    th.join(20.0)
    assert outcome == [None]
    behind()  # (not failed at once: no decode was late)


def test_a_hung_decode_fails_at_its_limit_keeps_its_writes_until_done_and_later_checks_fail_at_once(
        monkeypatch, reaped):
    monkeypatch.setattr(nvcomp, "CHECK_WAIT_S", 0.1)
    backend = DepStreams()
    decoder = _host_decoder(backend)
    fake = decoder._codecs[ZSTD]
    layout, staged, out, rows, temp = _one_stream()
    decoder._decompress(ZSTD, staged, out, layout, rows, temp)()  # the device keeps up: the check passes
    fake.kernel = Gate()  # the next kernel never ends
    first = decoder._decompress(ZSTD, staged, out, layout, rows, temp)
    behind = decoder._decompress(ZSTD, staged, out, layout, rows, temp)
    with pytest.raises(stoker.DeviceError, match=r"zstd streams of chunks \[0\] on cpu did not finish within 0.1 s"
                                                 r" of its start.*Config\(decode_on='cpu'\)"):
        first()
    assert all(_holds(x) for x in (fake.queued[1], staged, out, temp))
    monkeypatch.setattr(nvcomp, "CHECK_WAIT_S", 1000.0)  # (the one behind it fails at once: no second limit)
    with pytest.raises(stoker.DeviceError, match="queued behind one that has not finished"):
        behind()
    assert _holds(fake.queued[2])
    time.sleep(0.2)  # (ten looks of the reaper: the kernel still runs, so they are kept)
    assert _holds(fake.queued[1]) and _holds(out)
    fake.kernel.done = True  # the device finishes after all: the buffers are let go, the checks pass again
    assert _eventually(lambda: not _holds(fake.queued[1]) and not _holds(out))
    decoder._decompress(ZSTD, staged, out, layout, rows, temp)()


def test_a_check_waiting_for_a_hung_decode_stops_at_the_close(monkeypatch):
    monkeypatch.setattr(nvcomp, "CHECK_WAIT_S", 600.0)
    backend = DepStreams()
    decoder = _host_decoder(backend)
    closing = threading.Event()
    decoder.cancelled = closing.is_set
    decoder._codecs[ZSTD].kernel = Gate()
    layout, staged, out, rows, temp = _one_stream()
    check = decoder._decompress(ZSTD, staged, out, layout, rows, temp)
    th, outcome = _in_thread(check)
    time.sleep(0.2)
    closing.set()
    th.join(20.0)
    decoder._codecs[ZSTD].kernel.done = True
    assert len(outcome) == 1 and isinstance(outcome[0], stoker.ShutdownError)


def test_a_device_fault_seen_by_a_check_is_a_device_error_naming_the_decode():
    backend = DepStreams()
    decoder = _host_decoder(backend)
    layout, staged, out, rows, temp = _one_stream()
    backend.failed = True
    check = decoder._decompress(ZSTD, staged, out, layout, rows, temp)
    with pytest.raises(stoker.DeviceError, match=r"nvCOMP's decode of 1 zstd streams of chunks \[0\] on cpu "
                                                 r"failed on the device: CUDA error: unspecified launch failure"):
        check()
    assert _holds(out)  # (never known to be done: kept)


def test_a_device_fault_seen_by_a_close_s_poll_is_a_device_error():
    backend = DepStreams()
    event = backend.record(None)
    backend.failed = True
    with pytest.raises(stoker.DeviceError, match="the copies failed on the device"):
        poll([event], HostStreams().done, time.monotonic() + 1.0, what="the copies")


def test_the_gpu_executor_s_close_ends_a_check_waiting_for_the_device(volume, monkeypatch):
    """A wave's check waiting for a decode that never ends (the submitter's wait, also the one at its exit
    that finishes the batches left): the pipeline's close sets the decoder's ``cancelled``, the check stops,
    and the executor's threads have ended when close() returns."""
    from stoker.engine.gpu.executor import GpuDecodeExecutor
    from stoker.engine.gpu.reference import HostDecoder

    waiting, ended = threading.Event(), []

    class Hangs(HostDecoder):
        def decode_staged(self, staged, layout, *args, deferred=None, **kw):
            out = super().decode_staged(staged, layout, *args, deferred=deferred, **kw)

            def check():
                waiting.set()
                deadline = time.monotonic() + 30.0
                while not getattr(self, "cancelled", lambda: False)():
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.01)
                ended.append("closed")
                raise stoker.ShutdownError("closed")

            deferred.append(check)
            return out

    made = []

    def factory(cfg, device, stats, store):
        made.append(GpuDecodeExecutor(cfg, torch.device("cpu"), stats, store, decoder=lambda stream: Hangs()))
        return made[-1]

    monkeypatch.setattr(pipelines, "make_executor", factory)
    p = stoker.Pipeline(_cfg(dtype="f32", decode_on="gpu"))
    p.push(random_crops(volume, SHAPE, (8, 24, 40), 2, 6))
    assert waiting.wait(60.0)  # (a first wave took over 20 s on a host with six times the threads of its cores)
    p.close()
    lanes = [ex for ex in made if ex._thread is not None]
    assert ended == ["closed"] and lanes and not any(ex._thread.is_alive() for ex in lanes)
