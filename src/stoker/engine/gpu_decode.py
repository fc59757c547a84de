"""The GPU-decode executor (``Config.decode_on="gpu"``): chunks cross PCIe encoded, the device decodes,
casts and places them.

Per batch, on one worker thread, in groups that fit the staging (all on the pipeline's CUDA stream):

1. plan as the CPU executor does (:func:`~.tables.plan_tables`: each chunk's file, offset, length and copies);
2. read the stored bytes of the group's chunks end to end into a pinned staging buffer (``os.preadv``, the
   GIL released), and parse them into one :class:`~stoker.gpu.frames.Layout` (blosc1 frames and plain zstd
   chunks, a fixed number of numpy steps per group);
3. the stream decoder (:class:`~stoker.gpu.nvcomp.DeviceDecoder`) copies the staging to the device in one
   transfer and decodes every stream into the device scratch;
4. the copies of the group's chunks are expanded into runs of contiguous elements (numpy, no Python step per
   chunk or copy), and gathered from the scratch, cast and scattered into the batch with one
   ``index_select`` / ``index_copy_`` per run length and source dtype.

Chunks the device does not decode are decoded on the CPU by the array's own codec (numcodecs), cast there
into the batch dtype, and staged as raw streams of the same group, so they cross to the device and are
placed by the same operations: arrays with other codecs, filters, another byte order or axis order, a cast
the device would round differently (:func:`device_casts`), and frames the parser refuses or whose streams
the device cannot take. Each array's first such chunk is noted once (a ``RuntimeWarning`` naming the array
and why). A frame that fails to parse or to decode on the device is decoded again on the CPU, so a corrupt
chunk fails the batch with the same :class:`~stoker.errors.DecodeError` (naming the array and the chunk
key) as on the CPU path. Chunks with nothing stored are filled on the device with the fill value, cast on
the host by the CPU path's rules.

Memory: ``host_buffer_bytes`` holds two pinned staging buffers (one is read into while the device decodes
the other) and the CPU decode of one chunk; ``device_buffer_bytes`` holds the batch slots (and the float32
work buffer of a transformed 16-bit batch) plus the device copy of one staging buffer and twice the decoded
bytes of a group (the decoded scratch, and the gathered values of the placement, done in pieces that fit).
Groups hold up to 64 MiB of decoded chunks, fewer where the budgets are short; :meth:`prepare` refuses
budgets that cannot hold one chunk of the first batch's arrays (:class:`~stoker.errors.BudgetExceeded`,
naming the knob).

The stream decoder is pluggable (anything with :class:`~stoker.gpu.nvcomp.DeviceDecoder`'s ``stream``,
``max_stream_bytes`` and ``decode_staged``): on CUDA it is nvCOMP's; :meth:`GpuDecodeExecutor.on_host`
builds the same executor on CPU tensors with :class:`~stoker.gpu.reference.HostDecoder`, which is how it
is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..runtime import gil
from ..errors import BudgetExceeded, DecodeError, ShutdownError
from ..gpu import frames
from ..storage import FileChanged
from ..storage.store import ByteRange, get_many
from ..transforms import apply as apply_transform
from ..zarr.grid import c_strides
from .buffers import SlotRing, pinned_footprint
from .cast import copy_cast, fill_value_as, numpy_view, torch_dtype_of
from .executor import Job, Target
from .transfer import EVENT_TYPES
from .tables import F_IDENT, F_SOURCE, TablePlan, plan_tables

#: decoded bytes of one group at most (more only for a single larger chunk)
GROUP_BYTES = 64 << 20
_ALIGN = 64  # each chunk's decoded bytes start at a multiple of this in the scratch (any dtype's view)
_HALF = (torch.bfloat16, torch.float16)
_ZSTD, _BLOSC, _CPU = 1, 2, 3  # how a source's chunks are decoded


def device_casts(source: np.dtype, out: torch.dtype) -> bool:
    """True when the device's cast of ``source`` elements into ``out`` gives the CPU path's bits: no cast,
    or integer and bool sources of at most 2 bytes into a float (exact in float32, so the one rounding is
    the same; the rule :func:`~.device.staging_dtype` follows). Other sources into another dtype are cast on
    the CPU: torch's conversions on the device are not numpy's for every value (NaN payloads and signalling
    NaNs, float64 into float16 through float32)."""
    try:
        if torch_dtype_of(source) == out:
            return True
    except TypeError:
        return False
    return source.kind in "biu" and source.itemsize <= 2 and out.is_floating_point


_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _carrier(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of ``dtype``'s width: what elements are moved as (index_copy_ has no uint16 kernels)."""
    return _CARRIERS[dtype.itemsize]


def _cast(values: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """``values`` in ``out`` by the CPU path's rules (:mod:`.cast`: bfloat16 through float32)."""
    if values.dtype == out:
        return values
    if out == torch.bfloat16 and values.dtype != torch.float32:
        values = values.to(torch.float32)
    return values.to(out)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """``0..counts[i]-1`` for each ``i``, end to end."""
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)


@dataclass
class _Source:
    """How the chunks of one array are decoded and placed, for one batch dtype."""

    how: int  # _ZSTD, _BLOSC (on the device) or _CPU
    why: str | None  # why its chunks are decoded on the CPU
    element: torch.dtype  # dtype of its decoded chunks in the scratch (the source's, or the batch's when cast on the CPU)
    nbytes: int  # bytes of one decoded chunk in the scratch
    stored: int  # the most bytes one stored chunk takes in the staging
    strides: np.ndarray  # C strides of the chunk, in elements (how it lies in the scratch)
    fill: torch.Tensor  # the fill value in the batch dtype (a 0-d tensor on the device)


@dataclass
class _Entry:
    """One chunk of a group: where its bytes are in the staging and go in the scratch."""

    cid: int
    how: int
    at: int  # offset in the staging
    size: int  # bytes there
    out: int  # offset in the scratch


class _Group:
    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.pos = 0  # staging bytes used
        self.out = 0  # scratch bytes used


def _stream_of(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else None


class GpuDecodeExecutor:
    """Batches decoded on the device (see the module docstring and :class:`~.executor.Executor`).

    ``decoder(stream)`` makes the stream decoder; ``None``: nvCOMP's on ``device`` (a CUDA device).
    """

    staging = "pinned staging buffers for the encoded chunks (2)"

    def __init__(self, cfg, device: torch.device, stats, store,
                 decoder: Callable[[Any], Any] | None = None) -> None:
        self.cfg = cfg
        self.device = device
        self.stats = stats
        self.store = store
        self.n_slots = cfg.lookahead_batches + 1
        self.slots: SlotRing | None = None
        self.host_slots: SlotRing | None = None  # the staging ring (what the pipeline's _host_slots shows)
        self.budget = None  # no transient budget: the CPU decode of one chunk at a time is counted in prepare
        self._make_decoder = decoder
        self._decoder = None
        self._on_gpu = device.type == "cuda"
        self.stream = None
        self._work: torch.Tensor | None = None
        self._data: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._enc_cap = self._dec_cap = self._transient = 0
        self._sources: dict[tuple, tuple[Any, _Source]] = {}
        self._noted: set[tuple[str, str]] = set()
        self._queue: queue.Queue = queue.Queue()
        self._closing = False
        self._thread: threading.Thread | None = None

    @classmethod
    def on_host(cls, cfg, stats, store, max_stream_bytes: int = 1 << 24) -> "GpuDecodeExecutor":
        """The same executor on CPU tensors, decoding with :class:`~stoker.gpu.reference.HostDecoder` (its tests)."""
        from ..gpu.reference import HostDecoder

        return cls(cfg, torch.device("cpu"), stats, store, decoder=lambda stream: HostDecoder(max_stream_bytes))

    # -- memory -----------------------------------------------------------------------------------

    def work_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """float32 for a transformed 16-bit float batch (one rounding, after the transform), else ``dtype``."""
        if self.cfg.transform is not None and self.cfg.output_dtype in _HALF:
            return torch.float32
        return dtype

    def _device_need(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
        elements = self.cfg.batch_size * math.prod(shape)
        slot_bytes = elements * dtype.itemsize
        work = self.work_dtype(dtype)
        return slot_bytes, self.n_slots * slot_bytes + (elements * work.itemsize if work != dtype else 0)

    def _host_need(self, enc_cap: int) -> int:
        return 2 * (pinned_footprint(enc_cap) if self._on_gpu else enc_cap)

    def check_budget(self, shape: tuple[int, ...], dtype: torch.dtype, transient: int) -> None:
        """BudgetExceeded unless the batch slots (and the work buffer) fit device_buffer_bytes and ``transient``
        host bytes fit host_buffer_bytes (the staging and scratch are checked in :meth:`prepare`)."""
        self._check(shape, dtype, 0, 0, transient)

    def _check(self, shape: tuple[int, ...], dtype: torch.dtype, enc_cap: int, dec_cap: int, transient: int) -> None:
        cfg = self.cfg
        slot_bytes, slots = self._device_need(shape, dtype)
        device_need = slots + enc_cap + 2 * dec_cap
        if device_need > cfg.device_buffer_bytes:
            raise BudgetExceeded(
                f"Config.device_buffer_bytes={cfg.device_buffer_bytes:,} cannot hold this pipeline on {self.device} "
                f"with decode_on='gpu': {self.n_slots} batch slots (lookahead_batches + 1) x {slot_bytes:,} B"
                f"{' plus the float32 work buffer for the transform' if slots > self.n_slots * slot_bytes else ''}, "
                f"plus {enc_cap + 2 * dec_cap:,} B of decode scratch for one chunk (its stored bytes, and twice its "
                f"decoded bytes); needs {device_need:,} B. Raise device_buffer_bytes, or lower batch_size, "
                "lookahead_batches or the sample shape.",
                knob="device_buffer_bytes", needed=device_need)
        host_need = self._host_need(enc_cap) + transient
        if host_need > cfg.host_buffer_bytes:
            raise BudgetExceeded(
                f"Config.host_buffer_bytes={cfg.host_buffer_bytes:,} cannot hold this pipeline with decode_on='gpu': "
                f"two staging buffers of {enc_cap:,} B (one chunk's stored bytes"
                f"{', pinned in powers of two' if self._on_gpu else ''}) plus {transient:,} B to decode one chunk "
                f"on the CPU; needs {host_need:,} B. Raise host_buffer_bytes.",
                knob="host_buffer_bytes", needed=host_need)

    def prepare(self, sample_shape: tuple[int, ...], readers: list, dtype: torch.dtype) -> None:
        """Slots, staging, scratch and the worker, once: at the first batch, whose arrays size the buffers."""
        if self.slots is not None:
            return
        work = self.work_dtype(dtype)
        sources = [self._source(r, work) for r in readers]
        enc = max(s.stored for s in sources)
        dec = max(s.nbytes for s in sources)
        # the CPU decode of one chunk: its stored bytes, what the codec returns, the cast chunk
        transient = max(r.metadata.codec.max_stored_nbytes + r.metadata.codec.nbytes + s.nbytes
                        for r, s in zip(readers, sources))
        self._check(sample_shape, dtype, enc, dec, transient)  # one chunk per group at least
        _, slots = self._device_need(sample_shape, dtype)
        k = max(1, GROUP_BYTES // max(dec, 1))
        while k > 1 and (slots + k * (enc + 2 * dec) > self.cfg.device_buffer_bytes
                         or self._host_need(k * enc) + transient > self.cfg.host_buffer_bytes):
            k = max(1, k * 3 // 4)
        self._enc_cap, self._dec_cap, self._transient = k * enc, k * dec, transient
        batch_shape = (self.cfg.batch_size, *sample_shape)
        with self._on_device():
            self.stream = _stream_of(self.device)
            with self._on_stream():  # allocated on the stream that writes them: reused in its order
                self.slots = SlotRing(self.n_slots, batch_shape, dtype, device=self.device)
                self._work = torch.empty(batch_shape, dtype=work, device=self.device) if work != dtype else None
                self._data = torch.empty(self._enc_cap, dtype=torch.uint8, device=self.device)
                self._scratch = torch.empty(self._dec_cap, dtype=torch.uint8, device=self.device)
            self.host_slots = SlotRing(2, (self._enc_cap,), torch.uint8, pin=self._on_gpu)
        make = self._make_decoder
        if make is None:
            from ..gpu.nvcomp import DeviceDecoder

            def make(stream):
                return DeviceDecoder(self.device, stream)
        self._decoder = make(self.stream)
        self._thread = threading.Thread(target=self._run, name="stoker-gpu-decode", daemon=True)
        self._thread.start()

    def _on_device(self):
        return torch.cuda.device(self.device) if self._on_gpu else contextlib.nullcontext()

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _event(self):
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def device_nbytes(self) -> int:
        """Device memory held: batch slots, the work buffer, the staging's copy and the decode scratch."""
        if self.slots is None:
            return 0
        return self.slots.nbytes + sum(t.numel() * t.element_size() for t in (self._work, self._data, self._scratch)
                                       if t is not None)

    @property
    def dtype(self) -> torch.dtype | None:
        return self.slots.dtype if self.slots is not None else None

    def held(self) -> int:
        return self.slots.held() if self.slots is not None else 0

    def peak_bytes(self) -> int:
        """Host memory: the staging buffers and the CPU decode of one chunk."""
        return self.host_slots.nbytes + self._transient if self.host_slots is not None else 0

    # -- sources ----------------------------------------------------------------------------------

    def _source(self, reader, work: torch.dtype) -> _Source:
        key = (id(reader), work)
        held = self._sources.get(key)
        if held is not None and held[0] is reader:
            return held[1]
        codec = reader.metadata.codec
        how, why = _CPU, None
        if not codec.plain:
            why = "filters, another byte order or axis order"
        elif not (codec.lone_zstd or codec.lone_blosc):
            why = f"codecs {' -> '.join(codec.names) or 'none'} (the device decodes zstd and blosc with lz4 or zstd)"
        elif not device_casts(codec.dtype, work):
            why = f"its {codec.dtype} is cast to {work} on the CPU (the device's rounding of it may differ)"
        else:
            how = _ZSTD if codec.lone_zstd else _BLOSC
        element = torch_dtype_of(codec.dtype) if how != _CPU else work
        nbytes = math.prod(codec.shape) * element.itemsize
        aligned = -(-nbytes // _ALIGN) * _ALIGN
        with self._on_device():
            fill = fill_value_as(reader.metadata.fill_value, work).to(self.device)
        src = _Source(how, why, element, aligned, codec.max_stored_nbytes if how != _CPU else nbytes,
                      np.array(c_strides(tuple(codec.shape)), np.int64), fill)
        if len(self._sources) > 4096:
            self._sources.clear()
        self._sources[key] = (reader, src)
        return src

    def _note(self, uri: str, why: str) -> None:
        if (uri, why) not in self._noted:
            self._noted.add((uri, why))
            warnings.warn(f"stoker decode_on='gpu': chunks of {uri} are decoded on the CPU: {why}", RuntimeWarning,
                          stacklevel=2)

    # -- batches ----------------------------------------------------------------------------------

    def plan(self, batch_id: int, samples: Sequence, open_reader: Callable) -> TablePlan:
        return plan_tables(batch_id, samples, open_reader)

    def acquire(self, plan: Any, closed: Callable[[], bool]) -> Target:
        slot = None
        while slot is None:
            slot = self.slots.acquire(closed, timeout=0.1)
        return Target(slot.tensor[:plan.rows], slot, None)

    def submit(self, plan: TablePlan, target: Target) -> Job:
        job = Job(plan, target.out, plan.n_chunks)
        if plan.n_chunks:
            self._queue.put((job, target))
        return job  # (a batch of no chunks is complete: there is nothing to place)

    def deliver(self, target: Target, rows: int) -> tuple[torch.Tensor, Callable, Any, Any]:
        slots, slot = self.slots, target.slot
        return slot.tensor[:rows], lambda waits: slots.release(slot, stream_waits=waits), target.event, self.stream

    def drop(self, target: Target) -> None:
        if target.slot is not None:
            self.slots.release(target.slot)

    def shutdown(self) -> None:
        self._closing = True
        self._queue.put(None)

    def close(self) -> None:
        """Wait for the work queued on the stream, so no buffer is freed under it."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)
        if self.stream is not None:
            self.stream.synchronize()

    # -- the worker -------------------------------------------------------------------------------

    def _run(self) -> None:
        gil.enroll()
        while True:
            item = self._queue.get()
            if item is None or self._closing:
                while item is not None:  # fail what is queued: nothing will make it
                    item[0].finish(item[0].plan.n_chunks, ShutdownError("the pipeline was closed while this "
                                                                        "batch was being made"))
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        item = None
                return
            job, target = item
            counts = dict.fromkeys(("bytes_read", "bytes_decoded", "chunks_decoded", "bytes_to_device"), 0)
            try:
                self._make(job, target, counts)
                error = None
            except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop
                error = exc
            job.finish(job.plan.n_chunks, error, **counts)
            self.stats.charge_thread()
            del job, target, item

    def _make(self, job: Job, target: Target, counts: dict) -> None:
        """Make one batch into its slot: every group read, decoded and placed, then fills, transform and event."""
        plan: TablePlan = job.plan
        slot = target.slot
        rows = plan.rows
        batch = self._work[:rows] if self._work is not None else slot.tensor[:rows]
        dest = batch.flatten(0, 1) if plan.channels is not None else batch  # copy rows are b * C + c
        try:
            target.event = self._make_into(plan, slot, batch, dest, counts)
        finally:  # staging still held (a failed batch) goes back once the stream is past it
            for held in self.host_slots.slots:
                if held.busy:
                    self.host_slots.release(held, ready_after=self._event())

    def _make_into(self, plan: TablePlan, slot, batch: torch.Tensor, dest: torch.Tensor, counts: dict):
        """What :meth:`_make` does; returns the event after the batch (None on the CPU)."""
        rows = plan.rows
        with self._on_device(), self._on_stream():
            for wait in slot.stream_waits:  # what the slot's previous batch asked its next writer to wait for
                if isinstance(wait, EVENT_TYPES):
                    self.stream.wait_event(wait)
                else:
                    self.stream.wait_stream(wait)
            slot.stream_waits = []
            sources = [self._source(r, dest.dtype) for r in plan.sources]
            for s, (reader, src) in enumerate(zip(plan.sources, sources)):
                if src.why is not None and np.any((plan.chunk_source == s) & (plan.chunk_file >= 0)):
                    self._note(reader.uri, src.why)
            fills = list(np.flatnonzero(plan.chunk_file < 0).tolist())
            group, staging = _Group(), None
            files: dict[int, tuple[str, Any]] = {}
            late: list[tuple[int, np.ndarray]] = []  # CPU-decoded chunks waiting for room in a group
            for cid in np.flatnonzero(plan.chunk_file >= 0).tolist():
                if self._closing:
                    raise ShutdownError("the pipeline was closed while this batch was being made")
                src = sources[int(plan.chunk_source[cid])]
                if staging is None:
                    staging = self._acquire_staging()
                if src.how == _CPU:
                    data = self._fetch(plan, cid, files, counts)
                    if data is None:
                        fills.append(cid)
                        continue
                    late.append((cid, self._cpu_decode(plan, cid, data, dest.dtype, counts)))
                    group, staging = self._stage_late(plan, sources, dest, group, staging, late, counts)
                    continue
                if not self._fits(group, src.stored, src.nbytes):
                    group, staging = self._flush(plan, sources, dest, group, staging, late, counts)
                got = self._read_into(plan, cid, files, staging, group.pos, self._enc_cap - group.pos, counts)
                if got is None:
                    fills.append(cid)
                    continue
                group.entries.append(_Entry(cid, src.how, group.pos, got, group.out))
                group.pos += got
                group.out += src.nbytes
            while group.entries or late:
                group, staging = self._flush(plan, sources, dest, group, staging, late, counts)
            self._fill(plan, sources, dest, np.array(sorted(fills), np.int64))
            if self.cfg.transform is not None:
                t0 = time.perf_counter()
                apply_transform(self.cfg.transform, batch)
                self.stats.stage("transform", time.perf_counter() - t0)
            if self._work is not None:
                slot.tensor[:rows].copy_(self._work[:rows])  # the one rounding to the 16-bit output
            return self._event()

    def _acquire_staging(self):
        slot = None
        while slot is None:
            slot = self.host_slots.acquire(lambda: self._closing, timeout=0.1)
        return slot

    def _fits(self, group: _Group, stored: int, nbytes: int) -> bool:
        return group.pos + stored <= self._enc_cap and group.out + nbytes <= self._dec_cap

    # -- reading ----------------------------------------------------------------------------------

    def _file(self, plan: TablePlan, cid: int, files: dict) -> tuple[str, Any]:
        """``(path, identity or None)`` of chunk ``cid``'s file, once per file and batch."""
        f = int(plan.chunk_file[cid])
        held = files.get(f)
        if held is None:
            reader = plan.sources[int(plan.files[f, F_SOURCE])]
            ident = None
            if int(plan.chunk_offset[cid]) >= 0:
                row = plan.files[f]
                ident = tuple(int(v) for v in row[F_IDENT:F_IDENT + 2].view(np.uint64)) + \
                    tuple(int(v) for v in row[F_IDENT + 2:F_IDENT + 5])
            held = files[f] = (reader.file_path(plan.file_key(f)), ident)
        return held

    def _read_into(self, plan: TablePlan, cid: int, files: dict, staging, at: int, room: int,
                   counts: dict) -> int | None:
        """Read chunk ``cid``'s stored bytes into the staging at ``at`` (at most ``room``); their size, or None
        when nothing is stored (the fill value). Local files are read in place (the GIL released); arrays in
        stores and shards rewritten since their index was read go through the reader."""
        reader = plan.sources[int(plan.chunk_source[cid])]
        codec = reader.metadata.codec
        buf = staging.tensor.numpy()
        t0 = time.perf_counter()
        got = None
        if reader.kv is None:
            path, ident = self._file(plan, cid, files)
            offset = int(plan.chunk_offset[cid])
            if offset < 0:
                f = self.store.open_file(path)
                if f is None:
                    return None
                with f:
                    codec.check_stored_size(f.size, plan.key(cid))
                    if f.size > room:
                        raise BudgetExceeded(f"{reader.uri}: chunk {plan.key(cid)!r} is stored in {f.size:,} B, more "
                                             f"than the {room:,} B of staging", knob="host_buffer_bytes", needed=f.size)
                    got = f.read_into(memoryview(buf)[at:at + f.size], 0)
                    if got != f.size:
                        raise DecodeError(f"{reader.uri}: chunk {plan.key(cid)!r} changed while it was read",
                                          uri=reader.uri, key=plan.key(cid))
            else:
                length = int(plan.chunk_length[cid])
                try:
                    got = self.store.read_range_into(path, offset, memoryview(buf)[at:at + length], ident)
                except FileChanged:
                    got = None  # read again through the reader, which reads the shard's new index
                else:
                    if got != length:
                        raise DecodeError(f"{reader.uri}: the shard holding inner chunk {plan.key(cid)!r} changed or "
                                          "vanished while it was read", uri=reader.uri, key=plan.key(cid))
        if got is None:
            data = self._fetch(plan, cid, files, None)
            if data is None:
                return None
            got = len(data)
            if got > room:
                raise BudgetExceeded(f"{reader.uri}: chunk {plan.key(cid)!r} is stored in {got:,} B, more than the "
                                     f"{room:,} B of staging", knob="host_buffer_bytes", needed=got)
            buf[at:at + got] = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        self.stats.stage("io", time.perf_counter() - t0, bytes_out=got)
        counts["bytes_read"] += got
        return got

    def _fetch(self, plan: TablePlan, cid: int, files: dict, counts: dict | None):
        """Chunk ``cid``'s stored bytes through its reader (a new buffer), or None (the fill value)."""
        reader = plan.sources[int(plan.chunk_source[cid])]
        t0 = time.perf_counter()
        if reader.kv is not None and int(plan.chunk_offset[cid]) >= 0:
            path, _ = self._file(plan, cid, files)
            data = get_many(reader.kv, [], [ByteRange(path, int(plan.chunk_offset[cid]),
                                                      int(plan.chunk_length[cid]))])[1][0]
        else:
            _, data = reader.encoded_chunk(tuple(int(v) for v in plan.chunk_index[cid]))
        if data is not None and counts is not None:
            self.stats.stage("io", time.perf_counter() - t0, bytes_out=len(data))
            counts["bytes_read"] += len(data)
        return data

    def _cpu_decode(self, plan: TablePlan, cid: int, data: Any, dtype: torch.dtype, counts: dict) -> np.ndarray:
        """Chunk ``cid`` decoded by its codec on the CPU and cast into ``dtype`` (the CPU path's rules), as
        bytes in C order."""
        reader = plan.sources[int(plan.chunk_source[cid])]
        codec = reader.metadata.codec
        key = plan.key(cid)
        codec.check_stored_size(len(data), key)
        t0 = time.perf_counter()
        chunk = codec.decode(data, key)
        out = torch.empty(codec.shape, dtype=dtype)
        view = numpy_view(out)
        copy_cast(view if view is not None else out, chunk)
        self.stats.chunk(time.perf_counter() - t0, 0.0, len(data), codec.nbytes)
        counts["bytes_decoded"] += codec.nbytes
        counts["chunks_decoded"] += 1
        return out.view(-1).view(torch.uint8).numpy()

    # -- groups -----------------------------------------------------------------------------------

    def _stage_late(self, plan, sources, dest, group: _Group, staging, late: list, counts: dict):
        """Put the CPU-decoded chunks of ``late`` into the group as raw streams, flushing it when full."""
        while late:
            cid, data = late[0]
            size = len(data)
            aligned = -(-size // _ALIGN) * _ALIGN
            if not self._fits(group, size, aligned):
                if not group.entries:
                    raise BudgetExceeded(f"chunk {plan.key(cid)!r} of {plan.sources[int(plan.chunk_source[cid])].uri} "
                                         f"takes {size:,} B cast, more than the {self._enc_cap:,} B of staging",
                                         knob="host_buffer_bytes", needed=size)
                group, staging = self._flush(plan, sources, dest, group, staging, [], counts)
                continue
            staging.tensor.numpy()[group.pos:group.pos + size] = data
            group.entries.append(_Entry(cid, _CPU, group.pos, size, group.out))
            group.pos += size
            group.out += aligned
            late.pop(0)
        return group, staging

    def _flush(self, plan: TablePlan, sources: list[_Source], dest: torch.Tensor, group: _Group, staging,
               late: list, counts: dict):
        """Decode and place ``group``; returns an empty group and the staging to fill next. Chunks the device
        does not take are decoded on the CPU into ``late`` (placed with a later group)."""
        if not group.entries:
            return self._stage_late(plan, sources, dest, group, staging, late, counts)
        entries = group.entries
        buf = staging.tensor.numpy()
        layout, placed, cpu = self._parse(plan, buf[:group.pos], entries)
        for i in cpu:  # refused by the parser, or streams the device cannot take: the CPU decodes them
            e = entries[i]
            late.append((e.cid, self._cpu_decode(plan, e.cid, bytes(buf[e.at:e.at + e.size]), dest.dtype, counts)))
            reader = plan.sources[int(plan.chunk_source[e.cid])]
            self._note(reader.uri, "frames the device does not decode (other compressors inside blosc, streams over "
                                   f"{self._decoder.max_stream_bytes:,} B, or frames the parser refuses)")
        t0 = time.perf_counter()
        if placed:
            try:
                self._decoder.decode_staged(staging.tensor, layout, data=self._data, out=self._scratch)
            except (frames.FrameError, frames.UnsupportedFrame) as exc:
                self._decode_again(plan, buf, [entries[i] for i in placed], exc)
                raise
            t1 = time.perf_counter()
            self._place(plan, sources, dest, [entries[i] for i in placed])
            on_device = [entries[i] for i in placed if entries[i].how != _CPU]
            decoded = sum(self._decoded(plan, e) for e in on_device)
            self.stats.chunk(t1 - t0, time.perf_counter() - t1, sum(e.size for e in on_device), decoded,
                             count=len(on_device))
            counts["bytes_to_device"] += int(layout.in_nbytes)
            counts["bytes_decoded"] += decoded
            counts["chunks_decoded"] += len(on_device)
        # the staging goes back once the stream is past its copy; the next group is read into the other one
        self.host_slots.release(staging, ready_after=self._event())
        staging = self._acquire_staging()
        return self._stage_late(plan, sources, dest, _Group(), staging, late, counts)

    def _parse(self, plan: TablePlan, buf: np.ndarray, entries: list[_Entry]):
        """The group's layout over the staging (blosc frames, zstd frames and raw CPU-decoded chunks, each
        chunk's output at its offset in the scratch), the entries it holds and the entries for the CPU."""
        def sub(kind: int) -> np.ndarray:
            return np.array([i for i, e in enumerate(entries) if e.how == kind], np.int64)

        def table(ids: np.ndarray, src_sizes: bool):
            at = np.array([entries[i].at for i in ids], np.int64)
            size = np.array([entries[i].size for i in ids], np.int64)
            out = np.array([entries[i].out for i in ids], np.int64)
            nbytes = np.array([self._decoded(plan, entries[i]) for i in ids], np.int64) if src_sizes else size
            return at, size, nbytes, out

        cpu: list[int] = []
        parts, held = [], []
        for kind, parse in ((_BLOSC, frames.parse_blosc_batch), (_ZSTD, frames.parse_zstd_batch)):
            ids = sub(kind)
            if not len(ids):
                continue
            at, size, nbytes, out = table(ids, True)
            layout, faults = parse(buf, at, size, nbytes, out)
            bad = set(faults) | set(self._too_big(layout).tolist())
            if bad:  # parsed again without them: the layout holds only chunks the device decodes
                cpu += [int(ids[j]) for j in sorted(bad)]
                keep = np.array([j for j in range(len(ids)) if j not in bad], np.int64)
                ids = ids[keep]
                if not len(ids):
                    continue
                layout, _ = parse(buf, at[keep], size[keep], nbytes[keep], out[keep])
            parts.append(layout)
            held += ids.tolist()
        raw = sub(_CPU)
        if len(raw):
            at, size, _, out = table(raw, False)
            parts.append(frames.raw_layout(len(buf), at, size, out))
            held += raw.tolist()
        if not parts:
            return None, [], sorted(cpu)
        layout = frames.batch(parts, in_bases=[0] * len(parts), out_bases=[0] * len(parts))
        return layout, held, sorted(cpu)

    def _decoded(self, plan: TablePlan, e: _Entry) -> int:
        return plan.sources[int(plan.chunk_source[e.cid])].metadata.codec.nbytes

    def _too_big(self, layout: frames.Layout) -> np.ndarray:
        """Chunks of ``layout`` with a stream the device does not decompress (another compressor, or too large)."""
        limit = self._decoder.max_stream_bytes
        bad = ~layout.raw & ((layout.codec == frames.UNSUPPORTED) | (layout.dsize > limit))
        return np.unique(layout.chunk[bad])

    def _decode_again(self, plan: TablePlan, buf: np.ndarray, entries: list[_Entry], exc: BaseException) -> None:
        """The device failed on a group: decode its chunks on the CPU, in order, so the batch fails with the
        CPU path's error for the first bad chunk (raised from here)."""
        for e in entries:
            if e.how == _CPU:
                continue
            reader = plan.sources[int(plan.chunk_source[e.cid])]
            reader.metadata.codec.decode(bytes(buf[e.at:e.at + e.size]), plan.key(e.cid))
        reader = plan.sources[int(plan.chunk_source[entries[0].cid])]
        raise reader.metadata.codec.decode_error(plan.key(entries[0].cid), exc)  # none failed here: name the first

    # -- placing ----------------------------------------------------------------------------------

    def _runs(self, plan: TablePlan, sources: list[_Source], dest: torch.Tensor, cids: np.ndarray,
              element_base: np.ndarray):
        """Every copy of chunks ``cids`` as runs of contiguous elements: ``(src, dst, length)`` per run, ``src``
        in elements of the chunks' dtype from the start of the scratch (chunk ``cids[i]`` at
        ``element_base[i]``), ``dst`` in elements of the flat batch."""
        n = plan.n_copies[cids]
        rows = np.repeat(plan.first_copy[cids], n) + _ranges(n)
        strides = np.stack([sources[int(s)].strides for s in plan.chunk_source[cids]]) if len(cids) else \
            np.zeros((0, plan.ndim), np.int64)
        owner = np.repeat(np.arange(len(cids)), n)
        src = element_base[owner] + (plan.copy_chunk_start[rows] * strides[owner]).sum(axis=1)
        row_stride, *dst_strides = dest.stride()
        dst_strides = np.array(dst_strides, np.int64)
        dst = plan.copy_row[rows] * row_stride + plan.copy_box_start[rows] @ dst_strides
        extent = plan.copy_extent[rows]
        if plan.ndim == 0:
            return src, dst, np.ones(len(rows), np.int64)
        outer = extent[:, :-1]
        count = outer.prod(axis=1)
        run_of = np.repeat(np.arange(len(rows)), count)
        k = _ranges(count)
        s, d = src[run_of].copy(), dst[run_of].copy()
        for a in range(outer.shape[1] - 1, -1, -1):  # the run's index along each outer axis, innermost first
            size = outer[run_of, a]
            idx = k % size
            k //= size
            s += idx * strides[owner[run_of], a]
            d += idx * dst_strides[a]
        return s, d, extent[run_of, -1]

    def _place(self, plan: TablePlan, sources: list[_Source], dest: torch.Tensor, entries: list[_Entry]) -> None:
        """Gather the copies of ``entries`` from the scratch, cast, and scatter them into ``dest``, in pieces
        whose gathered and cast values and indices take at most the scratch's size."""
        cids = np.array([e.cid for e in entries], np.int64)
        outs = np.array([e.out for e in entries], np.int64)
        # chunks decoded on the CPU were cast there into the batch dtype
        elements = [dest.dtype if e.how == _CPU else sources[int(plan.chunk_source[e.cid])].element for e in entries]
        flat = dest.view(-1).view(_carrier(dest.dtype))
        for element in set(elements):
            mine = np.array([e == element for e in elements])
            view = self._scratch.view(_carrier(element))  # its size is a multiple of _ALIGN
            src, dst, length = self._runs(plan, sources, dest, cids[mine], outs[mine] // element.itemsize)
            per = element.itemsize + (dest.dtype.itemsize if dest.dtype != element else 0)
            for size in np.unique(length).tolist():
                sel = np.flatnonzero(length == size)
                step = max(1, self._dec_cap // (size * per + 16))
                for lo in range(0, len(sel), step):
                    part = sel[lo:lo + step]
                    take = torch.as_tensor(src[part], device=self.device)
                    put = torch.as_tensor(dst[part], device=self.device)
                    values = view.unfold(0, size, 1).index_select(0, take)
                    if element != dest.dtype:
                        values = _cast(values.view(element), dest.dtype)
                    flat.unfold(0, size, 1).index_copy_(0, put, values.view(flat.dtype))

    def _fill(self, plan: TablePlan, sources: list[_Source], dest: torch.Tensor, cids: np.ndarray) -> None:
        """Every copy of the chunks ``cids`` (nothing stored) filled with its array's fill value."""
        if not len(cids):
            return
        t0 = time.perf_counter()
        flat = dest.view(-1).view(_carrier(dest.dtype))
        by_source = plan.chunk_source[cids]
        for s in np.unique(by_source).tolist():
            mine = cids[by_source == s]
            _, dst, length = self._runs(plan, sources, dest, mine, np.zeros(len(mine), np.int64))
            for size in np.unique(length).tolist():
                put = torch.as_tensor(dst[length == size], device=self.device)
                flat.unfold(0, size, 1).index_fill_(0, put, sources[s].fill.view(flat.dtype))
        self.stats.stage("assemble", time.perf_counter() - t0)
