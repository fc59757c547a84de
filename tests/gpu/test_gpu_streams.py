"""The GPU-decode executor's copy, decode and place streams (engine/gpu/streams.py), without a GPU: a recorder
backend takes every wait, record and access the executor makes and works out what happens before what (each
stream in order, waits on events, the host once it has seen an event done, a stream after what the host did
before queueing on it). Every access to a buffer (the pinned staging, the device copies, the scratches) must
come after the accesses before it that it conflicts with; the executor run end to end on CPU tensors over
several waves makes none that does not, and delivers the CPU path's batches. The recorder is itself held to
find the race each missing wait would leave.

The recorder is :class:`CudaStreams` with torch's CUDA calls replaced by records (streams are named lanes,
``record_stream`` is logged), so what the executor asks of the CUDA backend is what the tests see: the batch
slots' writes (placement, fills, the hybrid's landing) and the batch's event, the consumer's stream (it waits
for that event, reads the slot, and the slot's next writer waits for it), and each buffer's ``record_stream``."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import types
import warnings

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.gpu.reference import HostDecoder
from stoker.engine import buffers
from stoker.engine.gpu import streams as gpu_streams
from stoker.engine.gpu.streams import CudaStreams, WaveStreams
from stoker.engine.hybrid.executor import HybridExecutor
from stoker.engine.hybrid.split import Shares
from stoker.engine.pipeline import facade as pipelines
from batch_oracle import random_crops
from hung_device import Hung, the_stuck_warning

pytestmark = pytest.mark.timeout(120)

SHAPE, CHUNKS = (32, 64, 64), (8, 16, 16)  # 64 chunks of 2,048 uint16


class Event:
    """A recorded event: what had happened on its stream (and before, through waits) when it was recorded."""

    def __init__(self, recorder: "Recorder", id: int, before: frozenset) -> None:
        self.recorder, self.id, self.before = recorder, id, before

    def query(self) -> bool:  # the host has seen it done (SlotRing polls a staging buffer's event)
        self.recorder.host_saw(self)
        return True

    def synchronize(self) -> None:
        self.recorder.host_saw(self)


class Lane(str):
    """A recorder's stream: its role (``"copy"``...), and the recorder (for ``record_stream``)."""

    recorder: "Recorder"


@pytest.fixture(autouse=True)
def _record_stream_logged(monkeypatch):
    """``Tensor.record_stream(lane)`` is logged by the lane's recorder (torch's own for real streams)."""
    real = torch.Tensor.record_stream

    def record_stream(tensor, stream):
        if isinstance(stream, Lane):
            stream.recorder.used.append((tensor.data_ptr(), tensor.numel() * tensor.element_size(), str(stream)))
        else:
            real(tensor, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)


class Recorder(CudaStreams):
    """The CUDA streams' backend on CPU tensors (each step runs when called) that records the order it was asked
    for: ``log`` holds ``("wait", stream, event id)`` (a stream's wait for another stream's work too),
    ``("record", stream, event id)`` and ``("op", stream, op id, reads, writes)``; ``races`` every access not
    ordered after an earlier conflicting one (a write after any access, a read after a write) of the same
    buffer, and every access declared on a stream other than the one its thread is on; ``used`` each
    ``record_stream`` that :meth:`CudaStreams.used_by` made: ``(data_ptr, nbytes, stream)``."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.lock = threading.Lock()
        self.log: list[tuple] = []
        self.races: list[str] = []
        self.known: dict[str, set] = {"host": set()}  # per lane: the ops that happened before its next one
        self.accesses: dict[tuple, list] = {}  # buffer -> [(op id, wrote, what)]
        self.ids = itertools.count(1)
        self.used: list[tuple] = []
        self.local = threading.local()  # each thread's streams entered (on), innermost last

    def stream(self, role: str) -> Lane:
        lane = Lane(role)
        lane.recorder = self
        self.known[lane] = set()
        return lane

    @contextlib.contextmanager
    def on(self, stream):
        entered = self.local.__dict__.setdefault("entered", [])
        entered.append(stream)
        try:
            yield
        finally:
            entered.pop()

    def current(self) -> str:
        """The stream this thread queues on (what torch.cuda.current_stream would be): ``"host"`` outside any."""
        entered = self.local.__dict__.get("entered")
        return entered[-1] if entered else "host"

    def _sync_host(self, stream: str) -> None:  # what the host did before queueing on a stream comes first
        self.known[stream] |= self.known["host"]

    def record(self, stream):
        with self.lock:
            self._sync_host(stream)
            event = Event(self, next(self.ids), frozenset(self.known[stream]))
            self.log.append(("record", stream, event.id))
            return event

    def wait(self, stream, event) -> None:
        if event is None:
            return
        with self.lock:
            self.log.append(("wait", stream, event.id))
            self.known[stream] |= event.before

    def wait_stream(self, stream, other) -> None:
        with self.lock:
            self.log.append(("wait_stream", stream, other))
            self.known[stream] |= self.known[other]

    def host_saw(self, event: Event) -> None:
        with self.lock:
            self.known["host"] |= event.before
            self.log.append(("saw", None, event.id))

    def access(self, stream, reads=(), writes=()) -> None:
        lane = stream or "host"
        with self.lock:
            if lane != "host":
                self._sync_host(lane)
            op = next(self.ids)
            before = self.known[lane]
            what = f"op {op} on {lane}"
            if lane != "host" and self.current() != lane:
                self.races.append(f"{what}: queued while on {self.current()}")
            for buf, wrote in [(r, False) for r in reads] + [(w, True) for w in writes]:
                for prev, prev_wrote, prev_what in self.accesses.get(buf, []):
                    if (wrote or prev_wrote) and prev not in before:
                        self.races.append(f"{buf}: {what} ({'write' if wrote else 'read'}) not after "
                                          f"{prev_what} ({'write' if prev_wrote else 'read'})")
                self.accesses.setdefault(buf, []).append((op, wrote, what))
            before.add(op)
            self.log.append(("op", lane, op, tuple(reads), tuple(writes)))

    def steps(self, stream: str, touching: str | None = None) -> list[tuple[list[int], tuple, int | None]]:
        """Each op on ``stream`` (that accesses a buffer named ``touching``, if given): (the events it waited for
        since the op before, the op, the event recorded next on the stream)."""
        out, waits = [], []
        for entry in self.log:
            if entry[1] != stream:
                continue
            if entry[0] == "wait":
                waits.append(entry[2])
            elif entry[0] == "op":
                if touching is None or any(buf[0] == touching for buf in entry[3] + entry[4]):
                    out.append([waits, entry, None])
                    waits = []
            elif out and out[-1][2] is None:
                out[-1][2] = entry[2]
        return [tuple(step) for step in out]


# -- the ordering itself, driven step by step --------------------------------------------------------------

class Dropping(Recorder):
    """A recorder that loses the waits of one stream (what removing a wait from WaveStreams would do)."""

    def __init__(self, stream: str) -> None:
        super().__init__()
        self.dropped = stream

    def wait(self, stream, event) -> None:
        if stream != self.dropped:
            super().wait(stream, event)


def _drive(backend: Recorder, waves: int = 5, host_waits: bool = True) -> None:
    """Five waves through WaveStreams as the executor sends them: two staging buffers, each written by the host
    once the copy that last read it is seen done (unless ``host_waits`` is False)."""
    lanes = WaveStreams(backend)
    lanes.buffers([torch.zeros(64, dtype=torch.uint8) for _ in range(2)],
                  [torch.zeros(64, dtype=torch.uint8) for _ in range(2)])
    staging = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    ready: list = [None, None]
    for n in range(waves):
        s = n % 2
        if host_waits and ready[s] is not None:
            ready[s].query()
        lanes.staged(s)
        staging[s].fill_(n)
        k = lanes.next()
        ready[s] = lanes.copy(k, staging[s], 64, s)
        decoded = lanes.decode(k, ready[s], lambda data, out: out.copy_(data))
        lanes.place(k, decoded, lambda scratch: None)


def test_each_step_waits_for_the_steps_that_last_used_its_buffers():
    rec = Recorder()
    _drive(rec)
    assert not rec.races, rec.races
    copies, decodes, places = rec.steps("copy"), rec.steps("decode"), rec.steps("place")
    assert len(copies) == len(decodes) == len(places) == 5
    for n in range(5):
        copied, decoded, placed = copies[n][2], decodes[n][2], places[n][2]
        # the copy waits for the decode that last read its device copy (two waves back), nothing else
        assert copies[n][0] == ([decodes[n - 2][2]] if n >= 2 else [])
        # the decode for its copy and the placement that last read its scratch
        assert decodes[n][0] == [copied] + ([places[n - 2][2]] if n >= 2 else [])
        assert places[n][0] == [decoded]
        assert None not in (copied, decoded, placed)
    # wave n + 1's copy waits for nothing of wave n: it overlaps wave n's decode and wave n - 1's placement
    assert decodes[0][2] not in copies[1][0] and places[0][2] not in copies[1][0]


@pytest.mark.parametrize("stream, buffer", [("copy", ("data", 0)), ("decode", ("data", 0)),
                                            ("decode", ("scratch", 0)), ("place", ("scratch", 0))])
def test_the_recorder_finds_the_race_a_missing_wait_leaves(stream, buffer):
    rec = Dropping(stream)
    _drive(rec)
    assert any(r.startswith(f"{buffer}:") for r in rec.races), rec.races


def test_the_recorder_finds_a_staging_buffer_written_before_its_copy_is_seen_done():
    rec = Recorder()
    _drive(rec, host_waits=False)
    assert any(r.startswith("('staging', 0): op") and "on host (write)" in r for r in rec.races), rec.races


# -- the executor, end to end on CPU tensors ---------------------------------------------------------------

@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    uri = str(root / "a.zarr")
    z = zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="uint16", fill_value=0,
                          compressors=ZstdCodec(level=3))
    rng = np.random.default_rng(1)
    z[:] = ((np.add.outer(np.arange(SHAPE[0]), np.arange(SHAPE[1]))[..., None] + np.arange(SHAPE[2])) % 3000
            + rng.integers(0, 50, size=SHAPE)).astype("uint16")
    return uri


def _cfg(**kw):
    # a device budget of a few dozen chunks a wave beside the slots: each batch spans waves
    base = dict(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1, n_io_threads=1, lookahead_batches=3,
                host_buffer_bytes=1 << 20, device_buffer_bytes=1 << 20, pop_timeout_s=30.0)
    return stoker.Config(**{**base, **kw})


def _batches(cfg, samples):
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        return [torch.from_dlpack(b).clone() for b in p]


@pytest.fixture(params=["no GPU", "a GPU seen"])
def torch_sees(request, monkeypatch):
    """Whether torch sees a CUDA device. Faked (as StreamContext finds one: a current device index and its
    stream) for "a GPU seen": the executor must queue on the recorder's streams through the backend only, as
    it does on a GPU box, where torch.cuda.stream of a recorder's lane fails."""
    if request.param == "a GPU seen":
        monkeypatch.setattr(torch.cuda, "_get_device_index", lambda *args, **kw: 0)
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda device=None: types.SimpleNamespace(device=torch.device("cuda", 0)))
    return request.param


def _consumed(rec: Recorder, ex: GpuDecodeExecutor) -> None:
    """The consumer as a stream of ``rec``: it waits for each delivered batch's event, reads its slot, and
    gives the slot back asking its next writer to wait for the consumer's stream (as a CUDA consumer's
    release does)."""
    consumer, deliver = rec.stream("consumer"), ex.deliver

    def delivered(target, rows):
        view, release, event, stream = deliver(target, rows)
        with rec.on(consumer):
            rec.wait(consumer, event)
            rec.access(consumer, reads=[("slot", target.slot.index)])
        return view, lambda waits: release([consumer, *(waits or [])]), event, stream

    ex.deliver = delivered


def _recorded(cfg, samples, monkeypatch, rec: Recorder, fraction: float | None = None, decoder=HostDecoder):
    """The batches the GPU-decode executor (or with ``fraction``, the hybrid one) makes on ``rec``'s streams,
    its consumer modelled (:func:`_consumed`), and the GPU-decode executor."""
    made = []

    def factory(cfg, device, stats, store):
        if fraction is None:
            ex = gpu = GpuDecodeExecutor(cfg, torch.device("cpu"), stats, store, decoder=lambda s: decoder(),
                                         streams=rec)
        else:
            ex = HybridExecutor.on_host(cfg, stats, store, decoder=lambda s: decoder(), shares=Shares(fraction),
                                        streams=rec)
            gpu = ex.gpu
        _consumed(rec, gpu)
        made.append(gpu)
        return ex

    monkeypatch.setattr(pipelines, "make_executor", factory)
    return _batches(cfg, samples), made[0]


def _hold_to_the_graph(rec: Recorder, ex: GpuDecodeExecutor, batches: int) -> None:
    """What every recorded run must show, beyond ``rec.races`` being empty: each device copy marked used by the
    decode stream and each scratch by the place stream (``record_stream``); every write of a batch slot on
    the place stream; the consumer waiting for each batch on an event of the place stream; and each slot's
    next writer waiting for the consumer."""
    assert not rec.races, rec.races[:5]
    enc, dec = ex.wave_bytes
    depth = ex.wave_depth
    assert sorted((n, s) for _, n, s in rec.used) == sorted([(enc, "decode")] * depth + [(dec, "place")] * depth)
    assert len({ptr for ptr, _, _ in rec.used}) == 2 * depth
    ops = [e for e in rec.log if e[0] == "op"]
    slot_writes = [e[1] for e in ops if any(w[0] == "slot" for w in e[4])]
    assert slot_writes and set(slot_writes) == {"place"}, set(slot_writes)
    recorded_on = {e[2]: e[1] for e in rec.log if e[0] == "record"}
    ready = [recorded_on[e[2]] for e in rec.log if e[0] == "wait" and e[1] == "consumer"]
    assert len(ready) == batches and set(ready) == {"place"}, ready
    assert len([e for e in ops if e[1] == "consumer"]) == batches
    waited = [e for e in rec.log if e[0] == "wait_stream" and e[1] == "place" and e[2] == "consumer"]
    assert len(waited) >= batches - ex.n_slots > 0


def test_the_executor_s_waves_on_three_streams_touch_no_buffer_out_of_order(volume, monkeypatch, torch_sees):
    samples = random_crops(volume, SHAPE, (12, 24, 24), 24, 7)
    want = _batches(_cfg(), samples)  # the CPU executor (Config(device="cpu") picks it)
    rec = Recorder()
    got, ex = _recorded(_cfg(), samples, monkeypatch, rec)
    assert len(got) == len(want) == 6 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert ex.wave_depth == 2 and len(ex.waves) >= 6, (ex.wave_depth, list(ex.waves))
    _hold_to_the_graph(rec, ex, 6)
    copies, decodes, places = rec.steps("copy"), rec.steps("decode"), rec.steps("place", "scratch")
    assert len(copies) == len(decodes) == len(places) == len(ex.waves)
    for n in range(2, len(copies)):  # the same graph as WaveStreams' own: the executor adds no wait of its own
        assert copies[n][0] == [decodes[n - 2][2]]
        assert decodes[n][0] == [copies[n][2], places[n - 2][2]]
        assert places[n][0] == [decodes[n][2]]
    # every staging buffer the reader wrote again, it wrote after seeing the copy that last read it done
    staged = [e for e in rec.log if e[0] == "op" and e[1] == "host"]
    assert len(staged) >= len(ex.waves) and len({e[4] for e in staged}) == 2


def test_a_device_budget_for_one_wave_on_the_device_orders_each_step_after_the_wave_before(tmp_path, monkeypatch,
                                                                                           torch_sees):
    """Chunks of 256 KiB that do not compress: 1 MiB of device budget holds one wave's device copy and scratch,
    not two, so one wave is on the device at a time (wave_depth 1) and each copy waits for the decode before,
    each decode for the placement before; the batches are still the CPU path's."""
    uri = str(tmp_path / "r.zarr")
    shape, chunks = (64, 64, 64), (32, 64, 64)
    zarr.create_array(uri, shape=shape, chunks=chunks, dtype="uint16", fill_value=0,
                      compressors=ZstdCodec(level=1))[:] = np.random.default_rng(3).integers(0, 65535, size=shape,
                                                                                             dtype="uint16")
    samples = random_crops(uri, shape, (8, 8, 8), 6, 3) + [stoker.Sample(uri, [(28, 36), (0, 8), (0, 8)])]
    cfg = _cfg(batch_size=1, lookahead_batches=1, host_buffer_bytes=4 << 20, device_buffer_bytes=1 << 20)
    want = _batches(cfg, samples)
    rec = Recorder()
    got, ex = _recorded(cfg, samples, monkeypatch, rec)
    assert len(got) == len(want) == 7 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert ex.wave_depth == 1, ex.wave_depth
    _hold_to_the_graph(rec, ex, 7)
    copies, decodes, places = rec.steps("copy"), rec.steps("decode"), rec.steps("place", "scratch")
    assert len(copies) == len(ex.waves) >= 7
    for n in range(1, len(copies)):
        assert copies[n][0] == [decodes[n - 1][2]]
        assert decodes[n][0] == [copies[n][2], places[n - 1][2]]


def _landings(rec: Recorder) -> list[tuple]:
    """The hybrid's landings (ops reading a host slot): (stream, op id, host slot, buffers written, the event
    recorded next on that stream: the landing's)."""
    out = []
    for n, e in enumerate(rec.log):
        if e[0] == "op" and any(r[0] == "host" for r in e[3]):
            event = next((x[2] for x in rec.log[n + 1:] if x[0] == "record" and x[1] == e[1]), None)
            out.append((e[1], e[2], next(r[1] for r in e[3] if r[0] == "host"), e[4], event))
    return out


def _hybrid_cfg():
    # one host slot (lookahead_batches): each batch's host part reuses the slot the last one landed from
    return _cfg(lookahead_batches=1, n_compute_threads=2)


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_the_hybrid_s_host_part_lands_on_the_place_stream_after_the_slot_s_consumer(volume, monkeypatch, fraction):
    """The hybrid's GPU part on the recorder: its ``before`` hook queues the host part's copy into the batch
    through the streams' backend (WaveStreams.land), on the place stream, after the consumer of the slot's last
    batch and before every chunk the GPU part places there and the batch's event (the recorder finds no write
    of the slot out of that order); the CPU engine writes the host slot again only once the host has seen the
    landing's event; with no chunk on the GPU (0.0) too."""
    samples = random_crops(volume, SHAPE, (12, 24, 24), 24, 7)
    want = _batches(_cfg(), samples)
    rec = Recorder()
    got, ex = _recorded(_hybrid_cfg(), samples, monkeypatch, rec, fraction)
    assert len(got) == len(want) == 6 and all(torch.equal(g, w) for g, w in zip(got, want))
    landings = _landings(rec)
    assert len(landings) == 6 and {lane for lane, *_ in landings} == {"place"}, landings
    assert all(writes and all(w[0] == "slot" for w in writes) for *_, writes, _ in landings), landings
    _hold_to_the_graph(rec, ex, 6)  # (no race: each slot write of a batch after its landing, on the place stream)
    for _, op, _, writes, _ in landings:  # the batch's chunks placed and its end queued after its landing
        after = [e for e in rec.log if e[0] == "op" and e[1] == "place" and e[2] > op and
                 any(w in e[4] for w in writes)]
        assert after, (op, writes)
    host_writes = [e for e in rec.log if e[0] == "op" and e[1] == "host" and any(w[0] == "host" for w in e[4])]
    assert len(host_writes) == 6
    saw = {e[2] for e in rec.log if e[0] == "saw"}
    assert sum(event in saw for *_, event in landings) >= 5  # the one host slot written again after each landing
    assert (len(ex.waves) > 0) == (fraction > 0), list(ex.waves)


def test_the_recorder_finds_a_host_slot_written_before_its_landing_is_seen_done(volume, monkeypatch):
    """The host slot given back with no event (as if the landing's were lost): the CPU engine writes it again
    before the host has seen the copy that reads it done, and the recorder says so."""
    samples = random_crops(volume, SHAPE, (12, 24, 24), 24, 7)
    release = HybridExecutor._release_host
    monkeypatch.setattr(HybridExecutor, "_release_host", lambda self, slot, ready=None: release(self, slot))
    rec = Recorder()
    _recorded(_hybrid_cfg(), samples, monkeypatch, rec, 0.0)
    assert any(r.startswith("('host', 0): op") and "on host (write) not after" in r and "on place (read)" in r
               for r in rec.races), rec.races


def test_the_recorder_finds_a_batch_finished_before_a_landing_on_another_stream(volume, monkeypatch):
    """The landing queued on the copy stream, which the place stream does not wait for: the batch's end (its
    fills and event, on the place stream) is not after the landing's write of the slot, and the recorder says
    so: the place stream's wait for the landing is the stream order the recorder checks."""
    samples = random_crops(volume, SHAPE, (12, 24, 24), 24, 7)

    def elsewhere(self, batch, host, host_id, writes):
        b, s = self.backend, self.copy_stream
        with b.on(s):
            b.access(s, reads=[("host", host_id)], writes=writes)
            batch.copy_(host)
            return b.record(s)

    monkeypatch.setattr(WaveStreams, "land", elsewhere)
    rec = Recorder()
    _recorded(_hybrid_cfg(), samples, monkeypatch, rec, 0.0)
    assert any(r.startswith("('slot',") and "on place (write) not after" in r and "on copy (write)" in r
               for r in rec.races), rec.races


class _Legacy(HostDecoder):
    """A stream decoder written to the interface before the copy stream: ``decode_staged`` takes no ``copied``
    and reads the staging itself."""

    def decode_staged(self, staged, layout, data=None, out=None, deferred=None, temp=None):
        return super().decode_staged(staged, layout, data=data, out=out, deferred=deferred, temp=temp)


def test_a_decoder_without_copied_reads_the_staging_held_until_its_decode(volume, monkeypatch):
    """No copy is made for it: its decode reads the staging buffer, which the reader writes again only once
    it has seen that decode done; the batches are the CPU path's."""
    samples = random_crops(volume, SHAPE, (12, 24, 24), 24, 7)
    want = _batches(_cfg(), samples)
    rec = Recorder()
    got, ex = _recorded(_cfg(), samples, monkeypatch, rec, decoder=_Legacy)
    assert len(got) == len(want) == 6 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert not rec.races, rec.races[:5]
    decodes = rec.steps("decode")
    assert rec.steps("copy") == [] and len(decodes) == len(ex.waves) >= 6
    assert all(step[1][3][0][0] == "staging" for step in decodes)


def test_the_recorder_finds_the_staging_written_before_a_decoder_without_copied_read_it(volume, monkeypatch):
    """Given back after the copy's event (none: no copy was made), as before the fix, the staging is written
    again before the decode that reads it is seen done: the recorder says so."""
    samples = random_crops(volume, SHAPE, (12, 24, 24), 24, 7)
    monkeypatch.setattr(WaveStreams, "decoded", lambda self, k: None)
    rec = Recorder()
    _recorded(_cfg(), samples, monkeypatch, rec, decoder=_Legacy)
    assert any(r.startswith("('staging',") and "on host (write)" in r for r in rec.races), rec.races


# -- a device that never finishes: close() waits a bounded time and keeps what the streams may write -------

def test_wave_streams_wait_a_bounded_time_and_name_the_streams_not_done():
    backend = Hung()
    lanes = WaveStreams(backend)
    assert lanes.synchronize(time.monotonic() + 0.05) == []
    backend.hang()
    assert lanes.synchronize(time.monotonic() + 0.05) == ["copy", "decode", "place"]


@pytest.mark.parametrize("where", ["gpu", "hybrid"])
def test_close_on_a_hung_device_warns_once_and_keeps_what_its_streams_may_write(volume, monkeypatch, where):
    """Every batch made, then the device hangs (no event is ever done): close() stops waiting for the streams
    after CLOSE_WAIT_S, warns once naming them, ends the threads, and keeps every buffer a stream may still
    write or read (slots, device copies, scratches, the decoder, the pinned staging; the hybrid's host slots)
    referenced rather than freed, each ring holding its slots (none handed to the spare slots, though the
    hybrid's host slots are plain memory here); a second close warns no more."""
    monkeypatch.setattr(gpu_streams, "CLOSE_WAIT_S", 0.2)
    spare = buffers.SpareSlots(buffers.SPARE_SLOT_BYTES)  # (the closed rings' slots go here, or not at all)
    monkeypatch.setattr(buffers, "SPARE_SLOTS", spare)
    backend, made = Hung(), []

    def factory(cfg, device, stats, store):
        if where == "gpu":
            made.append(GpuDecodeExecutor(cfg, torch.device("cpu"), stats, store, decoder=lambda s: HostDecoder(),
                                          streams=backend))
        else:
            made.append(HybridExecutor.on_host(cfg, stats, store, shares=Shares(0.5), streams=backend))
        return made[-1]

    monkeypatch.setattr(pipelines, "make_executor", factory)
    samples = random_crops(volume, SHAPE, (12, 24, 24), 8, 7)
    p = stoker.Pipeline(_cfg())
    p.push(samples)
    got = [torch.from_dlpack(b).clone() for b in p]
    assert len(got) == 2
    before = len(gpu_streams.kept())
    backend.hang()
    message = the_stuck_warning(p.close, p.close, made[0].close)
    assert "copy, decode, place stream(s)" in message and "kept" in message
    assert "restart the process to free them" in message  # what to do about it
    ex = made[0].gpu if where == "hybrid" else made[0]
    assert ex.stuck == ["copy", "decode", "place"]
    kept = {id(x) for x in gpu_streams.kept()[before:]}
    must = [*ex._lanes.data, *ex._lanes.scratch, ex.slots, ex.host_slots, ex._decoder]
    if where == "hybrid":
        must.append(made[0].cpu.host_slots)
    assert all(id(x) in kept for x in must)
    # the slots themselves stay in their rings (the hybrid's host slots are plain memory here: its CPU part's
    # close would hand them to the spare slots, for the next ring to take under the landing's copy)
    for ring in {id(r): r for r in must if isinstance(r, buffers.SlotRing)}.values():
        assert ring.slots and all(slot.tensor is not None for slot in ring.slots)
    assert spare.held_bytes == 0
    for thread in ex.threads():
        thread.join(10.0)
        assert not thread.is_alive()


def test_a_hung_device_holds_a_pipeline_of_fields_close_one_wait_for_all_its_executors(volume, monkeypatch):
    """Samples of 4 fields (an executor each, beside the pipeline's own), the device hung after the batches:
    Pipeline.close() waits for the streams of all of them until one deadline, CLOSE_WAIT_S after the first
    began (not CLOSE_WAIT_S each, one after another), and gives one warning naming every field's streams. The
    time the waits asked to sleep, all executors together, is at most one CLOSE_WAIT_S."""
    monkeypatch.setattr(gpu_streams, "CLOSE_WAIT_S", 0.2)
    backend, made, deadlines, slept = Hung(), [], [], []

    def factory(cfg, device, stats, store):
        made.append(GpuDecodeExecutor(cfg, torch.device("cpu"), stats, store, decoder=lambda s: HostDecoder(),
                                      streams=backend))
        return made[-1]

    real_sync = WaveStreams.synchronize

    def synchronize(self, deadline=None):
        deadlines.append(deadline)
        return real_sync(self, deadline)

    def sleep(seconds):
        slept.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(pipelines, "make_executor", factory)
    monkeypatch.setattr(WaveStreams, "synchronize", synchronize)
    monkeypatch.setattr(gpu_streams, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    fields = [f"f{k}" for k in range(4)]
    p = stoker.Pipeline(_cfg(batch_size=1, host_buffer_bytes=32 << 20, device_buffer_bytes=32 << 20))
    p.push([stoker.Sample({name: (volume, [(0, 8), (0, 16), (0, 16)]) for name in fields})])
    batch = p.pop()
    assert sorted(batch.keys()) == fields
    backend.hang()
    message = the_stuck_warning(p.close)
    lanes = made[1:]  # (made[0]: the pipeline's own, which made no batch: no streams to wait for)
    assert len(lanes) == 4 and all(ex.stuck == ["copy", "decode", "place"] for ex in lanes)
    assert len(deadlines) == 4 and None not in deadlines and len(set(deadlines)) == 1, deadlines
    assert 0 < sum(slept) <= 0.2, (len(slept), sum(slept))
    assert all(f"copy, decode, place stream(s) of GpuDecodeExecutor on cpu (field '{name}')" in message
               for name in fields), message


# -- on a GPU (marked cuda: run by benchmarks/gpu_checks.sh on a lent one) ----------------------------------

GPU_SHAPE, GPU_CHUNKS, GPU_CROP = (64, 256, 256), (16, 64, 64), (24, 96, 96)  # chunks of 128 KiB decoded


@pytest.fixture(scope="module")
def big_volume(tmp_path_factory):
    """Compressible uint16 (a gradient and noise, zstd) and blosc lz4 with shuffle: 256 chunks each."""
    from zarr.codecs import BloscCodec

    root = tmp_path_factory.mktemp("streams-gpu")
    rng = np.random.default_rng(2)
    data = ((np.add.outer(np.arange(GPU_SHAPE[0]), np.arange(GPU_SHAPE[1]))[..., None] + np.arange(GPU_SHAPE[2]))
            % 4000 + rng.integers(0, 40, size=GPU_SHAPE)).astype("uint16")
    uris = []
    for name, comp in (("zstd", ZstdCodec(level=3)), ("lz4", BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"))):
        uri = str(root / f"{name}.zarr")
        zarr.create_array(uri, shape=GPU_SHAPE, chunks=GPU_CHUNKS, dtype="uint16", fill_value=0,
                          compressors=comp)[:] = data
        uris.append(uri)
    return uris


def _gpu_samples(uris, n=12):
    return [s for i, u in enumerate(uris) for s in random_crops(u, GPU_SHAPE, GPU_CROP, n, 11 + i)]


def _gpu_cfg(where, dtype):
    # 24 MiB: the slots and waves of about a dozen chunks, so the 6 batches take many waves
    return stoker.Config(batch_size=4, dtype=dtype, device=torch.cuda.current_device(), decode_on=where,
                         host_buffer_bytes=64 << 20, device_buffer_bytes=24 << 20, lookahead_batches=3)


def _on_gpu(samples, where, dtype, factory=None, monkeypatch=None):
    if factory is not None:
        monkeypatch.setattr(pipelines, "make_executor", factory)
    try:
        with stoker.Pipeline(_gpu_cfg(where, dtype)) as p:
            p.push(samples)
            return [torch.from_dlpack(b).cpu() for b in p]
    finally:
        if factory is not None:
            monkeypatch.undo()


def _needs_nvcomp():
    pytest.importorskip("nvidia.libnvcomp", reason="nvCOMP is not installed (pip install 'stoker[gpu]')")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_on_a_gpu_waves_on_three_streams_give_the_cpu_path_s_batches(big_volume, dtype, monkeypatch):
    """Many waves, two on the device at once, copy, decode and place each on its own CUDA stream: bit for bit
    the CPU decode's batches."""
    _needs_nvcomp()
    from test_gpu_executor import _same

    samples = _gpu_samples(big_volume)
    made, streams = [], []

    def factory(cfg, device, stats, store):
        streams.append(_Streams(device))
        made.append(GpuDecodeExecutor(cfg, device, stats, store, streams=streams[-1]))
        return made[-1]

    want = _on_gpu(samples, "cpu", dtype)
    got = _on_gpu(samples, "gpu", dtype, factory, monkeypatch)
    ex, lanes = made[0], streams[0].made
    assert ex.wave_depth == 2 and len(ex.waves) >= 6, (ex.wave_depth, list(ex.waves))
    assert len({s.cuda_stream for s in lanes.values()}) == 3 and ex.stream is lanes["place"]
    assert len(got) == len(want) == 6 and all(_same(g, w) for g, w in zip(got, want))


class _Streams(CudaStreams):
    """torch's CUDA streams, kept by role (the test's view of what the executor made)."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.made: dict[str, torch.cuda.Stream] = {}

    def stream(self, role):
        self.made[role] = super().stream(role)
        return self.made[role]


class _Polled:
    """A copy's event whose host polls are counted (``pending``: those that found the copy not done)."""

    def __init__(self, event, backend: "_Slowed") -> None:
        self.event, self.backend = event, backend

    def query(self) -> bool:
        done = self.event.query()
        self.backend.pending += not done
        return done

    def synchronize(self) -> None:
        self.event.synchronize()

    def wait(self, stream) -> None:  # (Stream.wait_event(e) calls e.wait(stream): the decode waits for the copy)
        self.event.wait(stream)


class _Slowed(_Streams):
    """CUDA streams one of which (``role``) sleeps on the device before each wave's step there
    (``torch.cuda._sleep``, about 10 ms on an H200): a slow copy has the reader want a staging buffer again long
    before the copy that reads it has run; a slow decode or placement leaves the steps after it, and the
    consumer, only their events to keep them from reading what it has not written yet."""

    def __init__(self, device, role: str = "copy") -> None:
        super().__init__(device)
        self.role = role
        self.slowed = self.pending = 0

    def access(self, stream, reads=(), writes=()):
        # (called on the stream, before the step: the wave's step reads a buffer, the batch's slot writes do not)
        if stream is not None and stream is self.made[self.role] and reads:
            torch.cuda._sleep(20_000_000)
            self.slowed += 1

    def record(self, stream):
        event = super().record(stream)
        return _Polled(event, self) if stream is self.made["copy"] else event


@pytest.mark.cuda
def test_on_a_gpu_a_staging_buffer_is_not_written_before_its_slow_copy_has_read_it(big_volume, monkeypatch):
    """Each copy held back ~10 ms on the device: the reader finds its next staging buffer's copy pending (it
    waits for the copy's event, polled), and every batch is still the CPU path's: no wave was read into a
    staging buffer the device had not copied yet."""
    _needs_nvcomp()
    from test_gpu_executor import _same

    samples = _gpu_samples(big_volume)
    made = []

    def factory(cfg, device, stats, store):
        made.append(_Slowed(device, "copy"))
        return GpuDecodeExecutor(cfg, device, stats, store, streams=made[-1])

    want = _on_gpu(samples, "cpu", "bf16")
    got = _on_gpu(samples, "gpu", "bf16", factory, monkeypatch)
    backend = made[0]
    assert backend.slowed >= 6 and backend.pending > 0, (backend.slowed, backend.pending)
    assert len(got) == len(want) == 6 and all(_same(g, w) for g, w in zip(got, want))


@pytest.mark.cuda
@pytest.mark.parametrize("role", ["decode", "place"])
def test_on_a_gpu_a_slow_decode_or_placement_is_waited_for_by_events_alone(big_volume, monkeypatch, role):
    """Each decode (or each placement) held back ~10 ms on the device: the placement reads a scratch only
    after its decode, the next copy into a device copy (decode into a scratch) waits for the decode
    (placement) that read it, and the consumer reads a batch only after its event, recorded on the place
    stream after its last write; every batch is the CPU path's."""
    _needs_nvcomp()
    from test_gpu_executor import _same

    samples = _gpu_samples(big_volume)
    made = []

    def factory(cfg, device, stats, store):
        made.append(_Slowed(device, role))
        return GpuDecodeExecutor(cfg, device, stats, store, streams=made[-1])

    want = _on_gpu(samples, "cpu", "bf16")
    got = _on_gpu(samples, "gpu", "bf16", factory, monkeypatch)
    assert made[0].slowed >= 6, made[0].slowed
    assert len(got) == len(want) == 6 and all(_same(g, w) for g, w in zip(got, want))


@pytest.mark.cuda
def test_on_a_gpu_hybrid_batches_land_on_the_place_stream_under_a_slow_placement(big_volume, monkeypatch):
    """The hybrid with its GPU part's placements held back ~10 ms each: the host part's copy into the batch
    (queued by the ``before`` hook on the place stream) neither overwrites a slot its consumer still reads nor
    lands under the chunks placed after it; every batch is the CPU path's."""
    _needs_nvcomp()
    from stoker.engine.hybrid import executor as hybrids
    from test_gpu_executor import _same

    samples = _gpu_samples(big_volume)
    made = []

    def gpu_part(cfg, device, stats, store, **kw):  # the hybrid's GPU part, on slowed streams
        made.append(_Slowed(device, "place"))
        return GpuDecodeExecutor(cfg, device, stats, store, streams=made[-1], **kw)

    want = _on_gpu(samples, "cpu", "bf16")
    monkeypatch.setattr(hybrids, "GpuDecodeExecutor", gpu_part)
    got = _on_gpu(samples, "hybrid", "bf16")
    assert made and made[0].slowed > 0, made
    assert len(got) == len(want) == 6 and all(_same(g, w) for g, w in zip(got, want))


@pytest.mark.cuda
def test_on_a_gpu_close_while_a_stream_is_busy_waits_a_bounded_time_and_keeps_its_buffers(big_volume, monkeypatch):
    """The place stream kept busy for about 2 s (``torch.cuda._sleep``) after the last batch: close() stops
    waiting after CLOSE_WAIT_S (0.2 s), warns once naming the place stream, and keeps the executor's device
    buffers referenced rather than free them under that work; the device finishes afterwards."""
    _needs_nvcomp()
    monkeypatch.setattr(gpu_streams, "CLOSE_WAIT_S", 0.2)
    made = []

    def factory(cfg, device, stats, store):
        made.append(GpuDecodeExecutor(cfg, device, stats, store))
        return made[-1]

    monkeypatch.setattr(pipelines, "make_executor", factory)
    before = len(gpu_streams.kept())
    p = stoker.Pipeline(_gpu_cfg("gpu", "bf16"))
    try:
        p.push(_gpu_samples(big_volume, 2))
        assert len([torch.from_dlpack(b).cpu() for b in p]) == 1
        ex = made[0]
        with torch.cuda.device(ex.device), torch.cuda.stream(ex.stream):
            torch.cuda._sleep(4_000_000_000)  # (about 2 s on an H200)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p.close()
        stuck = [w for w in caught if "did not finish" in str(w.message)]
        assert len(stuck) == 1 and ex.stuck == ["place"], [str(w.message) for w in caught]
        kept = {id(x) for x in gpu_streams.kept()[before:]}
        assert all(id(x) in kept for x in [*ex._lanes.data, *ex._lanes.scratch, ex.slots, ex.host_slots])
    finally:
        p.close()
        torch.cuda.synchronize()
