"""The GPU-decode executor (``Config.decode_on="gpu"``): chunks cross PCIe encoded, the device decodes,
casts and places them.

In waves that fit the staging, on two threads: a reader does steps 1-2 and hands each staged wave on (at most
two wait: there are two staging buffers), a submitter queues steps 3-4 in order on three CUDA streams
(:mod:`.streams`: copy, decode, place, ordered by events), so wave N+1 is read while the device copies it,
decodes wave N and places wave N-1. A wave is not cut at a
batch's end: it goes on with the chunks of the next batch submitted already (never waiting for one), so one
decode takes the chunks of several lookahead batches, each batch's part parsed, placed and failed on its own:

1. plan as the CPU executor does (:func:`~.tables.plan_tables`: each chunk's file, offset, length and copies),
   and order the chunks the device decodes for reading (:func:`.staging.plan_reads`: numpy, once);
2. read the stored bytes of the group's chunks end to end into a pinned staging buffer
   (:class:`.staging.Stager`: one positional read per coalesced run of a shard's inner chunks, one per
   chunk file, all of a batch's part in one call into ``csrc/staging.c`` where the engine is built; one
   ``get_many`` per store), and parse them into one :class:`~stoker.engine.gpu.frames.Layout`
   (:mod:`.layout`: blosc1 frames, walked in C, and plain zstd chunks, a fixed number of steps per group);
3. the copy stream copies the staging to the device in one transfer, and the stream decoder
   (:class:`~stoker.engine.gpu.nvcomp.DeviceDecoder`, on the decode stream) decodes every stream into the
   device scratch;
4. on the place stream, the copies of each batch's chunks are gathered from the scratch, cast and scattered
   into its slot: by
   :mod:`.fused`'s Triton kernels where triton runs (a CUDA device), else by :mod:`.place`'s torch index
   operations (:attr:`GpuDecodeExecutor.placement`).

The decoded sizes of a wave (reading them waits for its decode) are checked once the next wave's decode
and placement are queued, or once nothing waits to be queued, always before a batch it holds is finished (a
damaged stream fails only the batch holding it): that wait is the only one the host makes for the device
in steady state (a batch whose 16-bit rounding or CF decoding is checked, :mod:`~stoker.engine.rounding`, is
finished once its event is done, looked at between waves and waited for only when nothing is left to queue:
:meth:`GpuDecodeExecutor._finish_ready`), and it has a limit (nvCOMP's check waits for the decode to start, which its stream's waits
may hold back behind the consumer's stream, until the close, then :data:`.nvcomp.CHECK_WAIT_S` for it to
finish, then fails the wave's batches with DeviceError; the close ends it, through the decoder's
``cancelled``). A staging buffer is read into
again only once the copy stream is past its copy (its event), a device copy written again only once the
decode that read it is done, a scratch once the placement that read it is (:class:`.streams.WaveStreams`).
``close()`` waits a second at most for the threads, which end at their next step (the reader's compiled
reads at their next read: ``shutdown`` cancels the round), then :data:`.streams.CLOSE_WAIT_S` at most for
the streams (a stream still busy then is warned of, and the buffers it may write are kept, never freed under
it); a pipeline's executors share these waits (:class:`.streams.CloseWait`: one deadline and one warning for
all its fields).

Chunks the device does not decode are decoded on the CPU (:mod:`.fallback`), cast there into the batch
dtype and staged as raw streams of a group, so they cross to the device and are placed by the same
operations: arrays with other codecs, filters, another byte order or axis order, a cast the device would
round differently (:func:`.sources.device_casts`), and frames the parser refuses or whose streams the
device cannot take. Each array's first such chunk is noted once (a ``RuntimeWarning`` naming the array and
why). A frame that fails to parse or to decode on the device is decoded again on the CPU, so a corrupt
chunk fails the batch with the same :class:`~stoker.errors.DecodeError` (naming the array and the chunk
key) as on the CPU path. Chunks with nothing stored are filled on the device with the fill value, cast on
the host by the CPU path's rules.

Arrays' CF attributes (``Config.cf``) are decoded on the stream once the batch is placed, its fills and its
padding filled, and before ``Config.transform`` (:class:`~stoker.engine.cpu.cf.RowDecode`, as the CPU and
CUDA executors do); a 16-bit output is then made in the float32 work buffer, rounded once after, when the
first batch reads such an array (:attr:`GpuDecodeExecutor.cf_work`).

Memory: ``host_buffer_bytes`` holds two pinned staging buffers (one is read into while the device decodes
the other) and the CPU decode of one chunk; ``device_buffer_bytes`` holds the batch slots (and the float32
work buffer of a transformed or CF-decoded 16-bit batch) plus, per wave on the device at once (two, so the
decode of one overlaps the copy of the next and the placement of the one before; one where two would more
than halve the group), the device copy of one staging buffer and the decoded scratch of a group, and once
more a group's decoded bytes (the gathered values of the placement, done in pieces that fit).
Groups hold up to 64 MiB of decoded chunks, fewer where the budgets are short; :meth:`prepare` refuses
budgets that cannot hold one chunk of the first batch's arrays (:class:`~stoker.errors.BudgetExceeded`,
naming the knob).

The stream decoder is pluggable (anything with :class:`~stoker.engine.gpu.nvcomp.DeviceDecoder`'s ``stream``,
``max_stream_bytes``, ``temp_bytes`` and ``decode_staged(staged, layout, data=, out=, deferred=, temp=,
copied=)``, made for the decode stream): ``copied=True`` says ``data`` holds the staged bytes already (the copy
stream's copy), so ``staged`` is not read. Its ``cancelled`` attribute is set to a callable that turns
true at the close: a deferred check waiting for the device then stops (nvCOMP's raise ShutdownError). A decoder whose ``decode_staged`` takes no ``copied`` (the interface
before the copy stream) is called without it and reads ``staged`` itself on the decode stream: no copy is
made for it, and each staging buffer is held until its decode is done. On CUDA the decoder is nvCOMP's;
:meth:`GpuDecodeExecutor.on_host` builds the same executor on CPU tensors with
:class:`~stoker.engine.gpu.reference.HostDecoder`, which is how it is tested without a GPU; so are the streams
(``streams``: :class:`.streams.HostStreams` there, or a recorder of the waits and records in the tests).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import queue
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from ...runtime import gil
from ...runtime.faults import serve
from ...runtime.workers import start_thread
from ...errors import (BudgetExceeded, DeviceError, InternalError, InvalidArgument, MissingDependency, ShutdownError,
                       pipeline_closed)
from . import frames
from ...transforms import apply as apply_transform
from . import fallback as gpu_fallback, place as gpu_place
from ..allocate import allocate
from ..buffers import SlotRing, pinned_footprint
from ..executor import Delivery, Job, SlotsDelivery, Target
from .layout import layout_of
from .ops import upload
from ..planning.padding import fill_padding
from ..cpu.cf import RowDecode, plan_decoder
from ..rounding import RoundingProbe, needs_probe
from .sources import CPU, Described, Source, aligned, device_casts
from .staging import Group, Pending, Stager, plan_reads
from . import streams as streams_mod
from .streams import CudaStreams, HostStreams, WaveStreams
from ..planning.tables import TablePlan, plan_tables
from ..cuda.transfer import EVENT_TYPES

if TYPE_CHECKING:
    from ...config import Config
    from ...reader.array import ArrayReader
    from ...sampling.sample import Sample
    from ...storage import LocalStore
    from ..stats import StatsRecorder

__all__ = ["GROUP_BYTES", "GpuDecodeExecutor", "device_casts"]

#: decoded bytes of one group at most (more only for a single larger chunk)
GROUP_BYTES = 64 << 20
#: threads that read a group's chunks into the staging (at most; no more than the compute threads)
READ_THREADS = 4
_HALF = (torch.bfloat16, torch.float16)
#: the longest pause between looks at a batch's event before its rounding's check is read, while the submitter
#: has nothing to queue (the batch waits that long at most after its work is done)
ROUNDING_PAUSE_S = 0.001
_COUNTS = ("bytes_read", "bytes_decoded", "chunks_decoded", "bytes_to_device")


class GpuDecodeExecutor(SlotsDelivery):
    """Batches decoded on the device (see the module docstring and :class:`~.executor.Executor`).

    ``decoder(stream)`` makes the stream decoder for the decode stream; ``None``: nvCOMP's on ``device`` (a CUDA
    device). ``streams``: the streams' backend (:mod:`.streams`; ``None``: CUDA's, or none on CPU tensors).
    """

    staging = "pinned staging buffers for the encoded chunks (2)"
    applies_cf = True  # decodes arrays' CF attributes (Config.cf) on the stream, in _end
    shares_close_wait = True  # close(wait): the pipeline's one wait for all its executors (Pipeline.close)

    def __init__(self, cfg: Config, device: torch.device, stats: StatsRecorder, store: LocalStore,
                 decoder: Callable[[Any], Any] | None = None, placement: str | None = None,
                 streams: HostStreams | None = None) -> None:
        self.cfg = cfg
        self.placement = _placement(placement, device)
        self._placer = _placer(self.placement)
        self.device = device
        self.stats = stats
        self.store = store
        self.n_slots = cfg.lookahead_batches + 1
        self.slots: SlotRing | None = None
        self.host_slots: SlotRing | None = None  # the staging ring (what pipeline.host_slot_bytes counts)
        self.budget = None  # no transient budget: the CPU decode of one chunk at a time is counted in prepare
        self._make_decoder = decoder
        self.cf_work = False  # the first batch reads arrays with CF attributes: decoded in the float32 work buffer
        self._decoder = None
        self._takes_copied = True  # the stream decoder reads the device copy made on the copy stream (prepare)
        self._on_gpu = device.type == "cuda"
        self.stream = None  # the place stream: batches are written there and delivered from there
        self._backend = streams if streams is not None else CudaStreams(device) if self._on_gpu else HostStreams()
        self._lanes: WaveStreams | None = None
        self._work: torch.Tensor | None = None
        self._temp: torch.Tensor | None = None
        self._enc_cap = self._dec_cap = self._transient = 0
        self._sources = Described(on_new=self._described)
        self._notices = gpu_fallback.Notices()
        # the chunks are read on a few of the compute threads: more contend for the GIL with the submitter
        # (H200, scenario 8: 16 threads gave 831 samples/s where one gave 1,256)
        self._stager = Stager(store, stats, min(cfg.compute_threads, READ_THREADS))
        self._queue: queue.Queue = queue.Queue()  # batches submitted, for the reader
        self._wave: _Wave | None = None  # the reader's open wave (room left: the next batch queued fills it)
        self._ending: list = []  # the reader's: ends of batches whose last chunks are in the open wave
        self._last: tuple | None = None  # the submitter's: (deferred checks, members) of the last wave decoded
        self._finishing: list = []  # the submitter's: batches ended, finished once the last wave is checked
        # the submitter's, after that: batches whose rounding checks wait for their event, and the ones behind
        # them, finished in order as their events are done (_finish_ready), never waited for while there is
        # work to queue
        self._rounding: deque[_Batch] = deque()
        #: the last waves handed to the submitter: (batches, staged bytes, decoded bytes) each
        self.waves: deque[tuple[int, int, int]] = deque(maxlen=256)
        # waves, batch starts and ends, for the submitter: unbounded, as the two staging buffers bound the waves
        # and the slots the batches (a bound here would hold the reader back behind two ends, not a wave ahead)
        self._staged: queue.Queue = queue.Queue()
        self._closing = False
        # a fault of the reader's or the submitter's loop (a bug escaping its own handling, InternalError): the
        # jobs submitted and not yet finished fail with it, and so does every later one (submit), so pop
        # raises it rather than wait for batches nobody makes (see _faulted). _jobs: those submitted and still
        # held (by the pipeline, or the threads): held weakly, as a job's ``out`` is a view of its slot, which
        # a reference of ours would keep looking in use (SlotRing)
        self._fault: BaseException | None = None
        self._jobs: weakref.WeakSet[Job] = weakref.WeakSet()
        self._jobs_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        #: the streams that had not finished their work when close() stopped waiting (their buffers kept)
        self.stuck: list[str] = []
        #: slot rings of others that these streams read (the hybrid's host part): kept with ours (_keep)
        self.keep_with: list[SlotRing] = []
        #: a weak reference to the executor this one is a part of (the hybrid), named for it in close's warning
        self.part_of: Callable[[], Any] | None = None
        self._landing: list | None = None  # the submitter's: the buffers of the batch a before hook lands in
        self._reader: threading.Thread | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def on_host(cls, cfg, stats, store, max_stream_bytes: int = 1 << 24,
                placement: str | None = None, streams: HostStreams | None = None) -> "GpuDecodeExecutor":
        """The same executor on CPU tensors, decoding with :class:`~stoker.engine.gpu.reference.HostDecoder` (its
        tests); ``placement="fused"`` places with the Triton kernels (under ``TRITON_INTERPRET=1``);
        ``streams``: a backend of :mod:`.streams` (the tests' recorder of waits and records)."""
        from .reference import HostDecoder

        return cls(cfg, torch.device("cpu"), stats, store, decoder=lambda stream: HostDecoder(max_stream_bytes),
                   placement=placement, streams=streams)

    # -- memory -----------------------------------------------------------------------------------

    def work_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """float32 for a 16-bit float batch that is transformed or CF-decoded (:attr:`cf_work`; one rounding,
        after both), else ``dtype``."""
        if (self.cfg.transform is not None or self.cf_work) and self.cfg.output_dtype in _HALF:
            return torch.float32
        return dtype

    @property
    def half_next(self) -> bool:
        """Whether batches are made in the float32 work buffer and rounded into float16 next, untransformed:
        float64 arrays' values and fill values then go in as their one rounding's float32
        (:attr:`~stoker.engine.executor.Job.half_next`; their chunks are cast on the CPU, see
        :func:`~.sources.device_casts`), as the packed arrays' CF decoding makes them."""
        return (self._work is not None and self._work.dtype == torch.float32 and self.cfg.transform is None
                and self.dtype == torch.float16)

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

    def _check(self, shape: tuple[int, ...], dtype: torch.dtype, enc_cap: int, dec_cap: int, transient: int,
               temp: int = 0) -> None:
        cfg = self.cfg
        slot_bytes, slots = self._device_need(shape, dtype)
        device_need = slots + enc_cap + 2 * dec_cap + temp
        if device_need > cfg.device_buffer_bytes:
            raise BudgetExceeded(
                f"Config.device_buffer_bytes={cfg.device_buffer_bytes:,} cannot hold this pipeline on {self.device} "
                f"decoding on the GPU (decode_on={cfg.decode_on!r}): {self.n_slots} batch slots (lookahead_batches + 1) x {slot_bytes:,} B"
                f"{' plus the float32 work buffer for the transform or CF decoding' if slots > self.n_slots * slot_bytes else ''}, "
                f"plus {enc_cap + 2 * dec_cap + temp:,} B of decode scratch for one chunk (its stored bytes, twice its "
                f"decoded bytes and nvCOMP's {temp:,} B); needs {device_need:,} B. Raise device_buffer_bytes, or lower batch_size, "
                "lookahead_batches or the sample shape.",
                knob="device_buffer_bytes", needed=device_need)
        host_need = self._host_need(enc_cap) + transient
        if host_need > cfg.host_buffer_bytes:
            raise BudgetExceeded(
                f"Config.host_buffer_bytes={cfg.host_buffer_bytes:,} cannot hold this pipeline decoding on the GPU "
                f"(decode_on={cfg.decode_on!r}): "
                f"two staging buffers of {enc_cap:,} B (one chunk's stored bytes"
                f"{', pinned in powers of two' if self._on_gpu else ''}) plus {transient:,} B to decode one chunk "
                f"on the CPU; needs {host_need:,} B. Raise host_buffer_bytes.",
                knob="host_buffer_bytes", needed=host_need)

    def prepare(self, sample_shape: tuple[int, ...], readers: list[ArrayReader], dtype: torch.dtype) -> None:
        """Slots, staging, scratch and the worker, once: at the first batch, whose arrays size the buffers."""
        if self.slots is not None:
            return
        from ...reader.coords import coding

        self.cf_work = self.cfg.cf and any(coding(r) is not None for r in readers)
        work = self.work_dtype(dtype)
        sources = [self._source(r, work) for r in readers]
        enc = max(s.stored for s in sources)
        dec = max(s.nbytes for s in sources)
        # the CPU decode of one chunk: its stored bytes, what the codec returns, the cast chunk
        transient = max(r.metadata.codec.max_stored_nbytes + r.metadata.codec.nbytes + s.nbytes
                        for r, s in zip(readers, sources))
        make = self._make_decoder
        if make is None:
            from .nvcomp import DeviceDecoder

            def make(stream):
                return DeviceDecoder(self.device, stream)
        with self._on_device():
            lanes = self._lanes = WaveStreams(self._backend)
        self.stream = lanes.place_stream
        self._decoder = make(lanes.decode_stream)
        self._decoder.cancelled = lambda: self._closing  # (its checks' waits for the device end at the close)
        self._takes_copied = _takes_copied(self._decoder)

        # nvCOMP's scratch for a group of k chunks of the arrays the device decodes, as streams of at most the
        # decoder's largest (a group whose streams need more is decoded in parts that fit: DeviceDecoder).
        # Without such arrays in the first batch, none: the first one met later has it made (_grow_temp).
        on_device = [s.nbytes for s in sources if s.how != CPU]
        stream = min(max(on_device, default=0), self._decoder.max_stream_bytes)

        def temp(k: int) -> int:
            return self._temp_bytes(k, stream)

        self._check(sample_shape, dtype, enc, dec, transient, temp(1))  # one chunk per group at least
        _, slots = self._device_need(sample_shape, dtype)

        def fits(k: int, depth: int) -> bool:  # depth waves' device copies and scratches, the placement's values
            return (slots + k * (depth * (enc + dec) + dec) + temp(k) <= self.cfg.device_buffer_bytes
                    and self._host_need(k * enc) + transient <= self.cfg.host_buffer_bytes)

        def group(depth: int) -> int:
            k = max(1, GROUP_BYTES // max(dec, 1))
            while k > 1 and not fits(k, depth):
                k = max(1, k * 3 // 4)
            return k

        # two waves on the device (a decode overlaps the next copy and the placement before) unless that
        # more than halves the group (short budgets: fewer, larger nvCOMP calls do more)
        k, depth = group(1), 1
        if fits(group(2), 2) and 2 * group(2) >= k:
            k, depth = group(2), 2
        self._enc_cap, self._dec_cap, self._transient = k * enc, k * dec, transient
        self._group_chunks = k
        batch_shape = (self.cfg.batch_size, *sample_shape)
        on = self._backend.on
        with self._on_device():
            # each allocated on the stream that writes it (reused in its order), marked used by the one that
            # reads it (WaveStreams.buffers)
            with self._on_stream():
                self.slots = SlotRing(self.n_slots, batch_shape, dtype, device=self.device)
                self._work = (allocate(batch_shape, work, self.device, what="the work buffer of the transform")
                              if work != dtype else None)
            with on(lanes.copy_stream):
                data = [allocate(self._enc_cap, torch.uint8, self.device, what="the encoded chunks of a group")
                        for _ in range(depth)]
            with on(lanes.decode_stream):
                scratch = [allocate(self._dec_cap, torch.uint8, self.device, what="the decoded chunks of a group")
                           for _ in range(depth)]
                self._temp = allocate(temp(k), torch.uint8, self.device, what="nvCOMP's scratch")
            lanes.buffers(data, scratch)
            self.host_slots = SlotRing(2, (self._enc_cap,), torch.uint8, pin=self._on_gpu)
        # a bug escaping either loop fails the batches in flight and every later one (_faulted), not a hang
        self._reader = threading.Thread(target=serve, args=(self._read_loop, self._faulted), name="stoker-gpu-read",
                                        daemon=True)
        self._thread = threading.Thread(target=serve, args=(self._run, self._faulted), name="stoker-gpu-decode",
                                        daemon=True)
        # the reader first: the submitter ends once its queue is empty and the reader is not alive, which a
        # reader not started yet is not either (started second, a start 0.1 s late on a loaded machine ended
        # the submitter, and every batch waited for pop_timeout_s); the reader's hand-overs never wait for
        # the submitter (its queue is unbounded)
        start_thread(self._reader, "n_compute_threads")
        start_thread(self._thread, "n_compute_threads")

    def _temp_bytes(self, k: int, stream: int) -> int:
        """nvCOMP's scratch for ``k`` streams of ``stream`` decoded bytes each."""
        with self._on_device():  # nvCOMP sizes its scratch for the current device: the pipeline's
            return self._decoder.temp_bytes(k, stream, k * stream) if stream else 0

    def _grow_temp(self, src: Source) -> None:
        """The first array decoded on the device after a first batch without one: nvCOMP's scratch for a
        group of its chunks, or for as many as the rest of ``device_buffer_bytes`` holds (its groups are then
        decoded in parts that fit). Called by the reader before it stages any of its chunks, so the submitter
        uses the new scratch from that array's first group on."""
        stream = min(src.nbytes, self._decoder.max_stream_bytes)
        room = self.cfg.device_buffer_bytes - self.device_nbytes()
        k = self._group_chunks
        while k > 1 and self._temp_bytes(k, stream) > room:
            k = max(1, k * 3 // 4)
        need = self._temp_bytes(k, stream)
        if 0 < need <= room:
            with self._on_device(), self._backend.on(self._lanes.decode_stream):  # nvCOMP's: the decode's
                self._temp = allocate(need, torch.uint8, self.device, what="nvCOMP's scratch")

    def _on_device(self):
        return torch.cuda.device(self.device) if self._on_gpu else contextlib.nullcontext()

    def _on_stream(self):
        return self._backend.on(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _event(self):
        """An event on the place stream (None without streams)."""
        return self._backend.record(self.stream)

    @property
    def backend(self) -> HostStreams:
        """The streams' backend (:mod:`.streams`: CUDA's, the host stand-in's, or the tests' recorder)."""
        return self._backend

    def land(self, batch: torch.Tensor, host: torch.Tensor, host_id: Any) -> Any:
        """From a ``before`` hook (this executor's thread): queue the copy of the host buffer ``host`` (named
        ``host_id`` to the streams' backend) into ``batch`` on the place stream (:meth:`.streams.WaveStreams.land`),
        where the batch's chunks are then placed over it; returns the event after which ``host`` may be written
        again (None on CPU tensors).

        >>> done = executor.land(batch, host_slot, ("host", 0))   # doctest: +SKIP
        """
        assert self._lanes is not None and self._landing is not None, "land() is for a before hook"
        return self._lanes.land(batch, host, host_id, self._landing)

    def device_nbytes(self) -> int:
        """Device memory held: batch slots, the work buffer, the staging's copies and the decode scratches."""
        if self.slots is None or self._lanes is None:
            return 0
        held = [self._work, self._temp, *self._lanes.data, *self._lanes.scratch]
        return self.slots.nbytes + sum(t.numel() * t.element_size() for t in held if t is not None)

    @property
    def wave_bytes(self) -> tuple[int, int]:
        """The most staged (encoded) and decoded bytes one wave holds, as :meth:`prepare` sized them within the
        budgets (0 before it)."""
        return self._enc_cap, self._dec_cap

    @property
    def wave_depth(self) -> int:
        """Waves on the device at once (each its device copy and scratch; :mod:`.streams`): 2, or 1 where two
        would more than halve the group; 0 before :meth:`prepare`."""
        return self._lanes.depth if self._lanes is not None else 0

    def peak_bytes(self) -> int:
        """Host memory: the staging buffers and the CPU decode of one chunk."""
        return self.host_slots.nbytes + self._transient if self.host_slots is not None else 0

    # -- sources ----------------------------------------------------------------------------------

    def _source(self, reader, work: torch.dtype) -> Source:
        return self._sources.get(reader, work, self.half_next)  # (host only)

    def forget(self, readers: list[ArrayReader]) -> None:
        """Drop the descriptions of ``readers``, arrays the pipeline forgot, so their stores can be closed."""
        self._sources.forget(readers)

    def _described(self, src: Source) -> None:
        """An array described for the first time: the first one decoded on the device after a first batch
        without one has nvCOMP's scratch made."""
        if src.how != CPU and self._temp is not None and not self._temp.numel():
            self._grow_temp(src)

    # -- batches ----------------------------------------------------------------------------------

    def plan(self, batch_id: int, samples: Sequence[Sample], open_reader: Callable[[str], ArrayReader]) -> TablePlan:
        return plan_tables(batch_id, samples, open_reader)

    def acquire(self, plan: TablePlan, closed: Callable[[], bool]) -> Target:
        slot = None
        while slot is None:
            slot = self.slots.acquire(closed)  # (woken by shutdown)
        return Target(slot.tensor[:plan.rows], slot, None)

    def submit(self, plan: TablePlan, target: Target) -> Job:
        job = Job(plan, target.out, _units(plan, target), then=target.then)
        if _units(plan, target):
            with self._jobs_lock:
                fault = self._fault
                if fault is None:
                    self._jobs.add(job)
                    self._queue.put((job, target))
            if fault is not None:  # a thread of ours failed past its handling: nothing would make it
                job.abandon(fault)
        return job  # (a batch of no chunks and no padding is complete: there is nothing to place)

    def _faulted(self, fault: InternalError) -> None:
        """The reader's or the submitter's loop raised past its own handling (a bug, ``fault``; its thread ends):
        every job submitted and not finished fails with it, and so does every later one (:meth:`submit`), so
        the consumer's next pop raises it at once instead of waiting ``pop_timeout_s`` for batches nobody
        makes; the other thread is stopped as at the close (:meth:`shutdown`, whose route fails what is still
        queued with this fault). A ShutdownError escaping at the close is the close's own: it stays one."""
        error: BaseException = fault
        if self._closing and isinstance(fault.__cause__, ShutdownError):
            error = fault.__cause__
        with self._jobs_lock:
            if self._fault is None:
                self._fault = error
            error = self._fault  # (the first thread's fault, should both fail)
            jobs = list(self._jobs)
            self._jobs.clear()
        for job in jobs:
            job.abandon(error)  # (one finished already, or failed, is left as it is)
        self.shutdown()

    def deliver(self, target: Target, rows: int) -> Delivery:
        slots, slot = self.slots, target.slot
        return slot.tensor[:rows], lambda waits: slots.release(slot, stream_waits=waits), target.event, self.stream

    def drop(self, target: Target) -> None:
        if target.slot is not None:
            self.slots.release(target.slot)

    def threads(self) -> list[threading.Thread]:
        """The reader, the decode thread and the read pool's threads started so far."""
        return [t for t in (self._reader, self._thread) if t is not None] + self._stager.pool.started()

    def shutdown(self) -> None:
        """Stop: the reader's round of compiled reads ends at its next read (the batch it stages fails with
        pipeline_closed, nothing placed from its unread staging), the threads at their next step."""
        self._closing = True
        self._stager.cancel()
        self._queue.put(None)
        for ring in (self.slots, self.host_slots):  # a wait for a slot or a staging buffer sees the close
            if ring is not None:
                ring.wake()

    def close(self, wait: streams_mod.CloseWait | None = None) -> None:
        """Wait for the worker threads, then for the work queued on the streams, so no buffer is freed under
        it, both bounded by ``wait`` (:class:`.streams.CloseWait`: a pipeline's one for all its executors; None:
        this close's own, :data:`.streams.THREADS_WAIT_S` for the threads, :data:`.streams.CLOSE_WAIT_S` for the
        streams). A stream still busy then (a hung device) is named in ``wait``'s one warning (given here
        without a ``wait``), and the buffers it may write are kept (:meth:`_keep`)."""
        own = wait is None
        wait = streams_mod.CloseWait() if wait is None else wait
        self._stager.close(wait.threads_left())
        for thread in (self._reader, self._thread):
            # (ident None: never started, its start failed: a join would raise over the start's error)
            if thread is not None and thread.ident is not None and thread is not threading.current_thread():
                thread.join(wait.threads_left())
        if self._lanes is not None and not self.stuck:
            with self._on_device():
                try:
                    self.stuck = self._lanes.synchronize(wait.deadline)
                except Exception:  # noqa: BLE001 - recording its events failed (a device fault): all stuck
                    self._lanes.closed, self.stuck = None, ["copy", "decode", "place"]
            if self.stuck:
                self._keep(wait)
        if own:
            wait.warn(stacklevel=2)

    def _keep(self, wait: streams_mod.CloseWait) -> None:
        """A stream did not finish by the close: every buffer one of them may still write or read (batch slots,
        the work buffer, device copies, scratches, nvCOMP's scratch and the decoder's statuses, the pinned
        staging, the rings of :attr:`keep_with`) is kept referenced until that work is done (for the process's
        life on a hung device) rather than freed under it, and no slot of those rings is handed to another ring (:meth:`.SlotRing.keep`); ``wait``
        is told which streams and how much."""
        lanes = self._lanes
        assert lanes is not None
        device = [t for t in (self._work, self._temp, *lanes.data, *lanes.scratch) if t is not None]
        rings = [r for r in (self.slots, self.host_slots, *self.keep_with) if r is not None]
        for ring in rings:
            ring.keep()
        streams_mod.keep([*device, *rings, self._decoder], until=lanes.closed)
        on_device = sum(t.numel() * t.element_size() for t in device) + (self.slots.nbytes if self.slots else 0)
        pinned = sum(r.nbytes for r in rings if r is not self.slots)
        whole = self.part_of() if self.part_of is not None else None
        wait.stuck(whole or self, self.stuck, on_device, pinned)

    # -- the reader: batches staged group by group ------------------------------------------------

    def _hand(self, msg) -> None:
        """Queue ``msg`` for the submitter (the queue is unbounded: the staging ring bounds the waves, the slots
        the batches; a put never waits, but if it could and the submitter is gone, a wave's staging is given back)."""
        while True:
            try:
                self._staged.put(msg, timeout=0.1)
                return
            except queue.Full:
                if not self._thread.is_alive():  # nothing will take it: give its staging back
                    if msg is not None and msg[0] == "wave":
                        self.host_slots.release(msg[2].staging)
                    return

    def _hand_wave(self) -> None:
        """Hand the open wave on (or give its staging back when no batch's chunks were parsed into it), then
        the ends of the batches whose last chunks it holds."""
        wave, self._wave = self._wave, None
        if wave is not None:
            if wave.members:
                self.waves.append((len(wave.members), wave.group.pos, wave.group.end))
                self._hand(("wave", None, wave))
            else:
                self.host_slots.release(wave.staging)
        ending, self._ending = self._ending, []
        for end in ending:
            self._hand(end)

    def _read_loop(self) -> None:
        gil.enroll()
        try:
            while True:
                try:  # an open wave takes a batch queued already, never waits for one: it is handed instead
                    item = (self._queue.get_nowait() if self._wave is not None
                            else gil.released(self._queue.get, timeout=0.1))
                except queue.Empty:
                    if self._wave is not None:
                        self._hand_wave()
                    elif self._closing:
                        return
                    continue
                if item is None or self._closing:
                    self._hand_wave()
                    while item is not None:  # fail what is queued: nothing will make it
                        item[0].finish(item[0].plan.n_chunks, self._fault or pipeline_closed())
                        try:
                            item = self._queue.get_nowait()
                        except queue.Empty:
                            item = None
                    return
                b = _Batch(*item, self)
                if b.target.before is not None:  # its start may wait (the hybrid's host part): the chunks and
                    self._hand_wave()             # ends of the batches before it go first, not behind that wait
                self._hand(("start", b, None))
                counts = dict.fromkeys(_COUNTS, 0)
                try:
                    fills, error = self._stage(b, counts), None
                except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop, in order
                    fills, error = None, exc
                end = ("end", b, (fills, counts, error))
                if self._wave is not None:  # after the wave holding its last chunks (and earlier batches' ends)
                    self._ending.append(end)
                else:
                    self._hand(end)
                self.stats.charge_thread()
                del b, item, end
        finally:
            self._hand(None)

    def _stage(self, b: "_Batch", counts: dict) -> np.ndarray:
        """Read batch ``b`` into waves: staging buffers filled with its chunks after those of the batches before
        it still open there, each batch's part parsed, a wave handed to the submitter once full (or once the
        batch has more chunks than it holds); the last one is left open for the next batch queued. Returns
        the chunks to fill."""
        plan, dtype = b.plan, b.dest.dtype
        sources = b.sources = [self._source(r, dtype) for r in plan.sources]
        stored = plan.chunk_file >= 0
        for s, (reader, src) in enumerate(zip(plan.sources, sources)):
            if src.why is not None and np.any((plan.chunk_source == s) & stored):
                self._notices.note(reader.uri, src.why)
        fills = [np.flatnonzero(~stored)]
        on_cpu = np.array([s.how == CPU for s in sources], bool)[plan.chunk_source]
        cpu = deque(np.flatnonzero(stored & on_cpu).tolist())  # decoded on the CPU one at a time
        reads = plan_reads(plan, sources)
        pending: deque[Pending] = deque()  # chunks staged from a buffer, waiting for room in a group
        files: dict = {}
        i = 0
        while (i < len(reads) or cpu or pending) and b.error is None:  # (the submitter failed: stop)
            if self._closing:
                raise pipeline_closed()
            if self._wave is None:
                self._wave = _Wave(self._acquire_staging())
            wave = self._wave
            group = wave.group
            try:
                buf = wave.staging.tensor.numpy()
                before, rows, pos = (i, len(cpu)), group.rows, group.pos
                while True:  # what waits first; then CPU chunks, each decoded once there is room for the last
                    if not pending and cpu:
                        c = cpu.popleft()
                        item = self._cpu_chunk(plan, sources, c, dtype, files, counts)
                        if item is None:
                            fills.append(np.array([c], np.int64))
                            continue
                        pending.append(item)
                    if not pending or not group.fits(pending[0], self._enc_cap, self._dec_cap):
                        break
                    group.stage(pending.popleft(), buf)
                if not pending and i < len(reads):  # then the chunks the device decodes, as many as fit
                    e = reads.take(i, self._enc_cap - group.pos, self._dec_cap - group.end)
                    if e > i:
                        missing, again = self._stager.read(plan, sources, reads, i, e, buf, group, files, counts)
                        fills.append(np.array(missing, np.int64))
                        pending.extend(again)
                        i = e
                if group.rows == rows:  # nothing of this batch was staged here
                    if not rows and before == (i, len(cpu)):  # nothing fits an empty group
                        if pending:
                            self._too_large(plan, pending[0].cid, len(pending[0].data))
                        self._too_large(plan, int(reads.order[i]), int(reads.enc[i + 1] - reads.enc[i] - reads.gap[i]))
                    parsed = None
                else:
                    parsed = self._parse(plan, dtype, group, buf, pending, counts, rows)
                del buf  # no view of a staging buffer outlives its hand-over
            except BaseException:
                if not wave.members:  # read into here only: the device never saw it
                    self._wave = None
                    self.host_slots.release(wave.staging)
                raise  # (else the wave is handed for the batches before, this one's rows left out)
            if parsed is not None:
                wave.members.append(_Member(b, group.pos - pos, *parsed))
            if (i < len(reads) or cpu or pending or group.pos >= self._enc_cap or group.end >= self._dec_cap
                    or self._work is not None):
                # full, or this batch has more to stage; or every batch is placed into the one float32 work
                # buffer (a transformed or CF-decoded 16-bit batch): the next one's chunks wait for this one's end
                self._hand_wave()
        return np.sort(np.concatenate(fills))

    def _parse(self, plan: TablePlan, dtype: torch.dtype, group: Group, buf: np.ndarray, pending: deque,
               counts: dict, first: int = 0):
        """The rows of ``group`` from ``first`` on (in ``buf``) as one Layout: ``(layout, held, cid, how, at, size,
        out, nbytes)``, or None when no chunk is left for the device. Frames the device does not take are
        decoded on the CPU into ``pending`` (staged with a later group)."""
        cid, how, at, size, out = (column[first:] for column in group.table())
        nbytes = np.array([plan.sources[int(s)].metadata.codec.nbytes for s in plan.chunk_source[cid]], np.int64)
        nbytes = np.where(how == CPU, size, nbytes)
        limit = self._decoder.max_stream_bytes
        layout, held, cpu = layout_of(buf[:group.pos], how, at, size, out, nbytes, limit)
        for k in cpu.tolist():  # refused by the parser, or streams the device cannot take: the CPU decodes them
            c = int(cid[k])
            raw = gpu_fallback.cpu_decode(plan, c, bytes(buf[at[k]:at[k] + size[k]]), dtype, self.stats, counts,
                                          self.half_next)
            pending.append(Pending(c, CPU, raw, aligned(len(raw))))
            self._notices.note(plan.sources[int(plan.chunk_source[c])].uri,
                               "frames the device does not decode (other compressors inside blosc, streams over "
                               f"{limit:,} B, or frames the parser refuses)")
        if not len(held):
            return None
        return layout, held, cid, how, at, size, out, nbytes

    # -- the submitter: waves decoded and placed on the stream, in order ---------------------------

    def _run(self) -> None:
        gil.enroll()
        try:
            self._submit_loop()
        finally:  # batches ended but not finished: their wave checked now (its decode waited for), then their
            if self._finishing or self._rounding:  # events (each to its limit, or the close)
                with self._on_device(), self._on_stream():
                    if self._finishing:
                        self._check_wave()
                    self._finish_ready(wait=True)

    def _submit_loop(self) -> None:
        while True:
            if self._rounding:  # the batches whose events are done, in order: no wait
                with self._on_device(), self._on_stream():
                    self._finish_ready()
            try:  # with batches waiting for their wave's check, nothing waits: that check runs when idle; with
                # batches waiting for their events, a pause at a time
                msg = (self._staged.get_nowait() if self._finishing
                       else gil.released(self._staged.get, timeout=ROUNDING_PAUSE_S if self._rounding else 0.1))
            except queue.Empty:
                if self._finishing:  # nothing to queue after it: the wave's decode is waited for now
                    with self._on_device(), self._on_stream():
                        self._check_wave()
                    continue
                if self._rounding:  # nothing to queue: the first one's event is waited for, to its limit
                    self._rounding[0].wait_from_now()
                    continue
                if not self._reader.is_alive() and self._staged.empty():
                    return
                continue
            if msg is None:  # the reader's last word
                return
            kind, b, data = msg
            with self._on_device(), self._on_stream():
                if kind == "wave":
                    if self._closing or all(m.b.error is not None for m in data.members):
                        self.host_slots.release(data.staging)  # skipped: the stream never read its staging
                        continue
                    self._flush(data)  # (gives the staging back, once; each batch's error its own)
                elif kind == "start":
                    if b.target.before is not None and self._finishing:  # before its wait (the hybrid's host
                        self._check_wave()  # part): the batches whose wave was queued last are finished first
                        # (those waiting for their events then finish during that wait: idle())
                    try:
                        self._begin(b)
                    except BaseException as exc:  # noqa: BLE001
                        b.error = exc
                else:
                    fills, counts, b.reader_error = data
                    if b.error is None and b.reader_error is None:
                        try:
                            self._end(b, fills)
                        except BaseException as exc:  # noqa: BLE001 - unless its wave's check finds damage
                            b.end_error = exc
                    for k, v in counts.items():
                        b.counts[k] += v
                    if self._checks_pending(b):  # finished once its wave is checked: when the next wave is
                        self._finishing.append(b)  # queued, or when there is nothing to queue (a failed one too)
                    else:
                        self._finish(b)
            del msg, b, data

    def _finish(self, b: "_Batch") -> None:
        """The batch's job finished, now or, when its rounding checks wait for its event (or a batch before it
        waits), once that is done (:meth:`_finish_ready`): the jobs finish in this order."""
        self._rounding.append(b)
        self._finish_ready()

    def _finish_ready(self, wait: bool = False) -> None:
        """Finish the batches waiting in :attr:`_rounding`, in order, as far as each one's checks can be read now
        (its event done, or nothing to read) or its wait is past its limit (:meth:`_Batch.wait_from_now`);
        ``wait``: each waited for (to its limit, or the close)."""
        while self._rounding:
            b = self._rounding[0]
            if not (wait or self._readable(b) or b.wait_until is not None and time.monotonic() >= b.wait_until):
                return
            self._rounding.popleft()
            self._complete(b)

    def idle(self) -> float:
        """For a wait on the submitter's thread (the hybrid's ``before`` hook, for its host part): the batches
        whose events are done are finished, the first waiting one's limit runs from now; returns the pause to
        wait before calling again (short while one waits for its event)."""
        if not self._rounding:
            return 0.1
        self._rounding[0].wait_from_now()
        with self._on_device(), self._on_stream():
            self._finish_ready()
        return ROUNDING_PAUSE_S if self._rounding else 0.1

    def _readable(self, b: "_Batch") -> bool:
        """Whether ``b``'s job can be finished without a wait: no rounding check to read (or an error before
        it), its event done, or the close (which fails it)."""
        if not b.checks or self._closing or b.error or b.end_error or b.reader_error:
            return True
        try:
            return bool(self._backend.done(b.target.event))
        except Exception:  # noqa: BLE001 - a device fault: the look again in _rounded, the batch's error
            return True

    def _complete(self, b: "_Batch") -> None:
        """The batch's job finished: its chunks in place and its end queued, or its first error (a damaged
        chunk's before the transform's, which saw the damage)."""
        error = b.error or b.end_error or b.reader_error
        if error is None and b.checks:
            error = self._rounded(b)
        b.job.finish(_units(b.plan, b.target), error, **b.counts)
        self.stats.charge_thread()

    def _rounded(self, b: "_Batch") -> BaseException | None:
        """The DtypeMismatch of a value of ``b``'s work buffer that its 16-bit rounding made inf, or that its CF
        decoding made inf in float32 (None: none; ``b.checks``), read once the batch's event is done: it is
        queued right after the batch's last chunks, whose wave's check waited for their decode already, so this
        is their placement, the CF decoding and the transform. The submitter looks at that event between the
        waves it queues, and waits for it only when it has nothing to queue (:meth:`_finish_ready`): at most
        :data:`.nvcomp.CHECK_WAIT_S` from its first such wait (then a DeviceError, as for a wave's check), or
        until the close."""
        from .nvcomp import CHECK_WAIT_S

        checks, b.checks = b.checks, []
        deadline = b.wait_until if b.wait_until is not None else time.monotonic() + CHECK_WAIT_S
        try:  # (the close ends the wait: the consumer is gone)
            streams_mod.poll([b.target.event], lambda e: self._closing or self._backend.done(e),
                             deadline, max_pause=ROUNDING_PAUSE_S, what="the batch's rounding")
            if not self._backend.done(b.target.event):
                return pipeline_closed() if self._closing else DeviceError(
                    f"batch {b.plan.batch_id}: its last steps (placement, CF decoding, transform) did not finish on "
                    f"{self.device} within {CHECK_WAIT_S:g} s (a hung device: restart the process)")
        except DeviceError as exc:  # a device fault: this batch's error
            return exc
        except RuntimeError as exc:
            return streams_mod.device_failed("the batch's rounding", exc)
        return next((e for e in (c.error(b.plan) for c in checks) if e is not None), None)

    def _begin(self, b: "_Batch") -> None:
        """The stream waits for what the slot's previous batch asked its next writer to wait for."""
        slot = b.target.slot
        for wait in slot.stream_waits:  # (through the backend: the tests' recorder sees the consumer's waits)
            if isinstance(wait, EVENT_TYPES):
                self._backend.wait(self.stream, wait)
            else:
                self._backend.wait_stream(self.stream, wait)
        slot.stream_waits = []
        if b.target.before is not None:  # (the hybrid's host part: lands on the stream before any chunk)
            self._landing = b.writes  # (what land() writes)
            try:
                b.target.before(b.batch)
            finally:
                self._landing = None

    def _end(self, b: "_Batch", fills: np.ndarray) -> None:
        """Fills, padding, CF decoding, transform, the 16-bit rounding and the event queued. The batch's job is
        finished once the wave holding its last chunks is checked (:meth:`_check_wave`): when the next wave is
        queued, so the device has work meanwhile, or at once when nothing is waiting to be queued."""
        if self._closing:
            raise pipeline_closed()
        t0 = time.perf_counter()
        self._backend.access(self.stream, writes=b.writes)  # (the tests' recorder: the batch written here)
        self._placer.fill(b.plan, b.sources, b.dest, fills)
        if b.plan.pads:  # boxes past their arrays: on the stream, after every chunk is placed
            fill_padding(b.plan.pads, b.plan.sources, b.dest, upload, cf=b.decode is not None,
                         half_next=self.half_next)
        self.stats.stage("assemble", time.perf_counter() - t0)
        if b.decode is not None or self.cfg.transform is not None:
            t0 = time.perf_counter()
            if b.decode is not None:  # CF attributes: on the stream, in the work dtype, before the transform
                b.decode(b.batch)
            if self.cfg.transform is not None:
                apply_transform(self.cfg.transform, b.batch, b.plan.keys)
            self.stats.stage("transform", time.perf_counter() - t0)
        if self._work is not None:
            out, work = b.target.slot.tensor[:b.plan.rows], self._work[:b.plan.rows]
            out.copy_(work)  # the one rounding to 16 bits, checked once its event is done (_finish), unless
            # no value can be past the output: without a transform, the stored values CF-decoded (bounded)
            if needs_probe(b.plan, self.cfg, out.dtype):
                b.checks.append(RoundingProbe(out, work, b.plan.channels))
        if b.decode is not None and b.decode.probes:  # (its float64 results' rounding, read at _finish too)
            b.checks.insert(0, b.decode)
        b.target.event = self._event()

    def _checks_pending(self, b: "_Batch") -> bool:
        """True while the checks of the last wave, which holds chunks of ``b``, have not run."""
        return self._last is not None and any(m.b is b for m in self._last[1])

    def _check_wave(self) -> None:
        """The deferred checks of the last wave (decoded sizes and statuses: they wait for its decode). A
        damaged stream fails the batch holding it with the CPU path's error, its chunks fetched again (their
        staging is reused); the other batches of the wave keep their chunks (each stream decodes into its own
        bytes), unless no chunk of the wave is damaged on the CPU either: then the device failed, and every
        batch of the wave fails with DeviceError naming its chunks."""
        last, self._last = self._last, None
        try:
            if last is not None:
                self._run_checks(*last)
        finally:  # the batches that waited for it (their errors, if any, set above)
            finishing, self._finishing = self._finishing, []
            for b in finishing:
                self._finish(b)

    def _run_checks(self, checks: list, members: list) -> None:
        try:
            for i, check in enumerate(checks):
                try:
                    check()
                except frames.FrameError:
                    raise
                except BaseException:  # the device failed (or the close came): the wave's other checks run
                    for rest in checks[i + 1:]:  # too, failing at once, so each keeps what its decode may write
                        with contextlib.suppress(BaseException):
                            rest()
                    raise
        except frames.FrameError as exc:
            healthy, damaged = [], False
            for m in members:
                if m.b.error is not None:
                    continue
                plan = m.b.plan
                try:
                    gpu_fallback.decode_fetched(plan, m.checked, lambda c, plan=plan: self._stager.path(plan, c, {}),
                                                exc)
                except DeviceError as error:  # every chunk of this batch decodes on the CPU
                    healthy.append((m, error))
                except BaseException as error:  # noqa: BLE001 - this batch's error, delivered at pop
                    m.b.error, damaged = error, True
            if not damaged:
                for m, error in healthy:
                    m.b.error = error
        except BaseException as exc:  # noqa: BLE001 - the device failed the whole wave
            for m in members:
                if m.b.error is None:
                    m.b.error = exc

    def _too_large(self, plan: TablePlan, cid: int, size: int) -> None:
        """BudgetExceeded: chunk ``cid`` (``size`` B in the staging) does not fit an empty group."""
        reader = plan.sources[int(plan.chunk_source[cid])]
        raise BudgetExceeded(f"{reader.uri}: chunk {plan.key(cid)!r} takes {size:,} B, more than the "
                             f"{self._enc_cap:,} B of staging (or its decoded bytes more than the {self._dec_cap:,} B "
                             "of decode scratch); raise host_buffer_bytes", knob="host_buffer_bytes", needed=size)

    def _acquire_staging(self):
        slot = None
        # free once the copy that last read it is done: the ring polls its event. The only wait for the device
        # without a deadline of its own: it ends at close (the ring checks _closing every 0.1 s); on a hung
        # device the consumer's pop ends first, with the DeviceError of a wave's check (nvcomp.CHECK_WAIT_S)
        # or at pop_timeout_s
        while slot is None:
            slot = self.host_slots.acquire(lambda: self._closing, timeout=0.1)
        self._lanes.staged(slot.index)
        return slot

    def _cpu_chunk(self, plan: TablePlan, sources: list[Source], cid: int, dtype: torch.dtype, files: dict,
                   counts: dict) -> Pending | None:
        """Chunk ``cid`` of an array the device does not decode, fetched as every chunk the staging cannot read
        is (:meth:`.staging.Stager.fetch`, which counts it) and decoded on the CPU (None: nothing stored, the
        fill value)."""
        _, fetched = self._stager.fetch(plan, sources, [cid], files, counts)
        if not fetched:
            return None
        raw = gpu_fallback.cpu_decode(plan, cid, fetched[0].data, dtype, self.stats, counts, self.half_next)
        return Pending(cid, CPU, raw, aligned(len(raw)))

    def _flush(self, wave: "_Wave") -> None:
        """Copy a wave to the device, decode it in one call and place each batch's chunks, each on its stream
        (:class:`.streams.WaveStreams`: nothing here waits for the device); the checks of the wave before run
        once this one is queued (the wait for them no longer holds the device's next work back). A wave
        the decode refuses outright fails each of its batches: with the CPU path's error for its damaged chunk,
        else DeviceError (nothing was decoded)."""
        members, staging, lanes = wave.members, wave.staging, self._lanes
        t0 = time.perf_counter()
        checks: list = []
        layout = (members[0].layout if len(members) == 1 else
                  frames.batch([m.layout for m in members], [0] * len(members), [0] * len(members)))
        k, copied = lanes.next(), None
        # a decoder without ``copied`` (the interface before the copy stream) copies the staging itself
        copy = {"copied": True} if self._takes_copied else {}

        def decode(data: torch.Tensor, out: torch.Tensor) -> None:
            self._decoder.decode_staged(staging.tensor, layout, data=data, out=out, deferred=checks, temp=self._temp,
                                        **copy)

        try:
            if copy:
                copied = lanes.copy(k, staging.tensor, layout.in_nbytes, staging.index)
                done = lanes.decode(k, copied, decode)
            else:
                done = lanes.decode(k, None, decode, staging.index)
        except (frames.FrameError, frames.UnsupportedFrame) as exc:
            for m in members:
                if m.b.error is None:
                    try:
                        gpu_fallback.decode_again(m.b.plan, staging.tensor.numpy(), m.cid[m.device],
                                                  m.at[m.device], m.size[m.device], exc)
                    except BaseException as error:  # noqa: BLE001 - this batch's error, delivered at pop
                        m.b.error = error
            return
        except BaseException as exc:  # noqa: BLE001 - nvCOMP refused the wave (DeviceError): its batches fail
            for m in members:
                if m.b.error is None:
                    m.b.error = exc
            return
        finally:  # read into again once the copy stream is past its copy (the decode reads the device's copy),
            # or, where the decoder reads the staging itself, once the decode stream is past it (raised or not)
            self.host_slots.release(staging, ready_after=copied if copy else lanes.decoded(k))
        t1 = time.perf_counter()

        def place(scratch: torch.Tensor) -> None:
            for m in members:
                b = m.b
                if b.error is None:
                    self._backend.access(self.stream, writes=b.writes)  # (the tests' recorder: its slot written)
                    elements = [b.dest.dtype if h == CPU else b.sources[int(s)].element
                                for h, s in zip(m.how[m.held].tolist(),
                                                b.plan.chunk_source[m.cid[m.held]].tolist())]
                    try:
                        self._placer.place(b.plan, b.sources, b.dest, scratch, m.cid[m.held], m.out[m.held],
                                           elements)
                    except BaseException as exc:  # noqa: BLE001 - this batch's error, delivered at pop
                        b.error = exc

        lanes.place(k, done, place)
        decoded = chunks = stored = 0
        for m in members:
            b = m.b
            on_device = m.held[m.how[m.held] != CPU]
            n = int(m.nbytes[on_device].sum())
            decoded, chunks, stored = decoded + n, chunks + len(on_device), stored + int(m.size[on_device].sum())
            b.counts["bytes_to_device"] += m.staged
            b.counts["bytes_decoded"] += n
            b.counts["chunks_decoded"] += len(on_device)
        self._check_wave()
        self._last = (checks, members)
        self.stats.chunk(t1 - t0, time.perf_counter() - t1, stored, decoded, count=chunks)


def _placement(asked: str | None, device: torch.device) -> str:
    """``"fused"`` (:mod:`.fused`'s Triton kernels) or ``"torch"`` (:mod:`.place`'s index operations): as
    ``asked``, else fused on a CUDA device where triton imports (CUDA builds of torch ship it), torch ops
    elsewhere (the host stand-in: Triton runs CPU tensors only in its interpreter, which the tests ask for)."""
    if asked not in (None, "fused", "torch"):
        raise InvalidArgument(f"GpuDecodeExecutor(placement={asked!r}): 'fused', 'torch' or None")
    if asked == "torch" or (asked is None and device.type != "cuda"):
        return "torch"
    from . import fused

    if fused.available(device):
        return "fused"
    if asked == "fused":
        raise MissingDependency(f"GpuDecodeExecutor(placement='fused') on {device}: needs triton, and on CPU tensors TRITON_INTERPRET=1 "
                          "set before stoker.engine.gpu.fused is first imported", package="triton")
    return "torch"


def _placer(placement: str):
    """The module whose ``place`` and ``fill`` the executor calls (looked up per call: tests wrap them)."""
    if placement == "fused":
        from . import fused

        return fused
    return gpu_place


def _takes_copied(decoder: Any) -> bool:
    """Whether ``decoder.decode_staged`` takes ``copied`` (it decodes the device copy the copy stream made); a
    decoder written before the copy stream does not, and reads the staging itself."""
    try:
        params = inspect.signature(decoder.decode_staged).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the safe way, which needs none
        return False
    return any(p.name == "copied" or p.kind is p.VAR_KEYWORD for p in params)


def _units(plan: TablePlan, target: Target) -> int:
    """What a batch's job counts down: its chunks, or one for a batch of padded crops that reads none (the
    padding is still to be filled on the stream) or with a ``before`` hook (the hybrid's host part lands)."""
    return plan.n_chunks or (1 if plan.pads or target.before is not None else 0)


class _Batch:
    """One batch between the reader and the submitter: its job, slot, tables, and what the submitter has
    done (its error and counts)."""

    def __init__(self, job: Job, target: Target, ex: GpuDecodeExecutor) -> None:
        self.job, self.target, self.plan = job, target, job.plan
        rows = self.plan.rows
        self.batch = ex._work[:rows] if ex._work is not None else target.slot.tensor[:rows]
        self.dest = self.batch.flatten(0, 1) if self.plan.channels is not None else self.batch  # rows b * C + c
        self.sources: list[Source] = []
        # None: no row has CF attributes; rounded to odd in the work buffer for an untransformed f16 output
        self.decode: RowDecode | None = plan_decoder(self.plan, ex.cfg.cf,
                                                     target.slot.tensor.dtype if ex.cfg.transform is None else None)
        self.error: BaseException | None = None  # a decode, placement or check error (the submitter's)
        self.end_error: BaseException | None = None  # an error of its fills, CF decoding or transform
        self.reader_error: BaseException | None = None  # the reader's (a read, the plan's sources...)
        # the checks of its roundings (CF decoding's from float64, the work buffer's to 16 bits: _end), each with
        # .error(plan), read once its event is done (_finish)
        self.checks: list[Any] = []
        self.wait_until: float | None = None  # when the submitter's wait for its event ends (its first + limit)
        self.counts = dict.fromkeys(_COUNTS, 0)
        #: the buffers written to make it, as the streams' backend names them: its slot (and the work buffer)
        self.writes = [("slot", target.slot.index)] + ([("work", None)] if ex._work is not None else [])


    def wait_from_now(self) -> None:
        """The submitter waits for this batch's event from now on (it has nothing to queue), to
        :data:`.nvcomp.CHECK_WAIT_S` from its first such wait."""
        from .nvcomp import CHECK_WAIT_S

        if self.wait_until is None:
            self.wait_until = time.monotonic() + CHECK_WAIT_S


class _Wave:
    """A staging buffer being filled: the chunks of one or more batches (:class:`_Member`, one per batch, in
    order), decoded in one call."""

    def __init__(self, staging) -> None:
        self.staging = staging
        self.group = Group()
        self.members: list[_Member] = []


class _Member:
    """One batch's chunks in a wave: ``staged`` bytes of it, parsed as ``layout`` (``held``: the rows it holds,
    of ``cid``, ``how``, ``at``, ``size``, ``out``, ``nbytes``; offsets are the wave's)."""

    def __init__(self, b: "_Batch", staged: int, layout, held, cid, how, at, size, out, nbytes) -> None:
        self.b, self.staged, self.layout, self.held = b, staged, layout, held
        self.cid, self.how, self.at, self.size, self.out, self.nbytes = cid, how, at, size, out, nbytes
        dev = held[how[held] != CPU]
        self.device = dev if len(dev) else held  # decoded again on the CPU when the device refuses the wave
        self.checked = cid[self.device]  # fetched and decoded again when a deferred check fails
