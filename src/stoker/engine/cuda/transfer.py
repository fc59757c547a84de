"""The CUDA leg of a batch: pinned host staging -> device slot, on a side stream, cast on the device.

The CPU executor assembles a batch in page-locked host memory in the *staging* dtype
(:func:`~stoker.engine.cast.staging_dtype`: uint16 crops stay uint16, half the bytes
of float32). When its last chunk is in place, :meth:`CudaTransfer.issue` enqueues on a
dedicated non-blocking stream:

1. waits for whatever the device slot's previous batch asked for (the consumer's
   release event, or the consumer streams that used it): no host synchronisation;
2. the host-to-device copy (into a device staging buffer when a cast follows);
3. the cast into the device slot, in the output dtype; with ``Config.transform`` and a
   16-bit float output, into a float32 device *work* buffer instead, where the transform
   runs, then one cast into the device slot (:meth:`~.cpu.CpuExecutor.work_dtype`), checked
   (:class:`~stoker.engine.rounding.RoundingProbe`: a finite value it makes inf fails the batch with the CPU
   path's DtypeMismatch, read by the compute thread once the batch's event is done);
4. an event, which the consumer's stream waits on when it imports the batch through DLPack.

The host slot goes back to its ring fenced by an event recorded right after the copy, so it
is refilled only after the copy has read it (also when the transform then fails). One device
staging buffer and one work buffer suffice: every copy, cast and transform runs on the one
stream, in order.

Closing refuses new copies and waits for the queued ones (milliseconds) a bounded time, as the GPU decode
does (:mod:`stoker.engine.gpu.streams`): for an :meth:`~CudaTransfer.issue` under way (its transform may wait
for the device) and for an event recorded on the stream, polled, until the pipeline's one close deadline
(:class:`~stoker.engine.gpu.streams.CloseWait`). A stream still busy then (a hung device, or a consumer stream
the copies wait for still running a long step) is named in the close's one warning, and every buffer its
copies may still read or write (the device slots, the staging and work buffers, the pinned host slots) is
kept referenced until that event is done (:func:`~stoker.engine.gpu.streams.keep`), never freed under them.

The stream and its events come from a backend of :mod:`stoker.engine.gpu.streams` (``streams``: CUDA's on a
GPU, :class:`~stoker.engine.gpu.streams.HostStreams` on CPU tensors, which is how the executor is tested
without one).

:class:`CudaExecutor` is the pipeline's executor on a GPU (the contract of
:mod:`.executor`): the CPU executor's decoders fill ``lookahead_batches`` pinned byte slots,
and its delivery slots are ``lookahead_batches + 1`` device slots.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...errors import BudgetExceeded, DeviceError, pipeline_closed
from ...transforms import apply as apply_transform
from ..allocate import allocate
from ..cast import staging_dtype
from ..buffers import Slot, SlotRing, pinned_footprint
from ..cpu.cf import RowDecode, plan_decoder
from ..cpu.executor import CpuExecutor, half_next, take_slot
from ..executor import Delivery, Job, Target
from ..gpu import streams as streams_mod
from ..gpu.streams import CudaStreams, HostStreams
from ..rounding import RoundingProbe, needs_probe

if TYPE_CHECKING:
    from ...config import Config
    from ...storage import LocalStore
    from ..planning.tables import TablePlan
    from ..stats import StatsRecorder


# What release(event=...) accepts: torch's CUDA classes and the device-generic ones (torch.cuda.Stream is a
# torch.Stream on CUDA builds; a generic torch.Event waits on any torch.Stream). torch.Event came in 2.4.
EVENT_TYPES = tuple(c for c in (torch.cuda.Event, getattr(torch, "Event", None)) if c is not None)
_STREAMS = tuple(c for c in (torch.cuda.Stream, getattr(torch, "Stream", None)) if c is not None)


class CudaTransfer:
    """Side stream, device batch slots and the device staging buffer of one pipeline. ``streams``: the stream's
    backend (None: CUDA's on a CUDA ``device``, none on CPU tensors)."""

    def __init__(self, device: torch.device, n_slots: int, batch_shape: tuple[int, ...], dtype: torch.dtype,
                 stage_bytes: int, work: torch.dtype | None = None, streams: HostStreams | None = None) -> None:
        self.device = device
        # lock rank 3 (engine/pipeline/facade.py): issue() against close(): no copy is queued after close's event
        self._lock = threading.Lock()
        self._closed = False
        #: True once a close stopped waiting for the stream's work (a hung device): its buffers are kept
        self.stuck = False
        #: when a stuck close's work is done (an event of the stream; None: never known), for streams.keep
        self.closed: Any = None
        self._backend = streams if streams is not None else (
            CudaStreams(device) if device.type == "cuda" else HostStreams())
        with self._on_device():
            self.stream = self._backend.stream("transfer")
            # Allocated on the side stream, which writes them: freed memory is then reused in its order.
            with self._backend.on(self.stream):
                self.slots = SlotRing(n_slots, batch_shape, dtype, device=device)
                self._stage = (allocate(stage_bytes, torch.uint8, device, what="the device staging of the cast")
                               if stage_bytes else None)
                self._work = (allocate(batch_shape, work, device, what="the device work buffer of the transform")
                              if work is not None and work != dtype else None)

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @property
    def nbytes(self) -> int:
        """Device memory held: batch slots plus the staging and work buffers."""
        work = self._work.numel() * self._work.element_size() if self._work is not None else 0
        return self.slots.nbytes + (self._stage.numel() if self._stage is not None else 0) + work

    def issue(self, host: torch.Tensor, slot: Slot, transform: Callable | None = None,
              copied: Callable[[torch.cuda.Event], None] | None = None,
              keys: Any = None, channels: int | None = None,
              rounded: Callable[[RoundingProbe], None] | None = None) -> tuple[torch.cuda.Event, float]:
        """Enqueue ``host`` (pinned, ``(rows, *sample_shape)``) into ``slot``, then ``transform`` on it (on the
        side stream, after the cast: in the work buffer when there is one, cast into ``slot`` after it;
        ``keys``, the samples' keys, for a transform that takes them).
        ``copied(event)`` runs once the copy is queued: ``host`` may be refilled after that event. ``rounded(probe)``
        gets the check of the rounding from the work buffer (:class:`~stoker.engine.rounding.RoundingProbe`, of
        ``channels`` per sample; read it after the event), when there is one. Returns the event after all of it,
        and the seconds the transform took to enqueue."""
        rows = host.shape[0]
        out = slot.tensor[:rows]
        dest = self._work[:rows] if self._work is not None else out
        transform_s = 0.0
        b = self._backend
        with self._lock, self._on_device(), b.on(self.stream):
            if self._closed:
                raise pipeline_closed()
            for wait in slot.stream_waits:
                if isinstance(wait, EVENT_TYPES):
                    b.wait(self.stream, wait)
                else:  # a consumer stream: wait for all it has queued so far, the work on this slot included
                    b.wait_stream(self.stream, wait)
            slot.stream_waits = []
            if host.dtype == dest.dtype:
                dest.copy_(host, non_blocking=True)
            else:
                nbytes = host.numel() * host.element_size()
                if self._stage is None or nbytes > self._stage.numel():
                    raise RuntimeError(f"internal: device staging holds {0 if self._stage is None else self._stage.numel()} "
                                       f"B, the batch needs {nbytes} B")
                stage = self._stage[:nbytes].view(host.dtype).view(host.shape)
                stage.copy_(host, non_blocking=True)
                dest.copy_(stage)  # the cast, on the device
            if copied is not None:
                copied(b.record(self.stream))
            if transform is not None:
                t0 = time.perf_counter()
                apply_transform(transform, dest, keys)
                transform_s = time.perf_counter() - t0
            if dest is not out:
                out.copy_(dest)  # the one rounding to the 16-bit output, after the transform
                if rounded is not None:
                    rounded(RoundingProbe(out, dest, channels))
            event = b.record(self.stream)
        return event, transform_s

    def close(self, deadline: float | None = None) -> bool:
        """Refuse new copies and wait for the queued ones (milliseconds), so no buffer is freed under a copy,
        until ``deadline`` (``time.monotonic()``; None: :data:`~stoker.engine.gpu.streams.CLOSE_WAIT_S` from
        now) at most, the wait for an :meth:`issue` under way (its transform may wait for the device) included.
        Returns True once the stream is past them; False when it was not by the deadline (a hung device, or
        the consumer's stream, which the copies wait for, still busy; also at every later close), or a look at
        it raised (a device fault): then the device slots, staging and work buffers are kept referenced
        (:func:`~stoker.engine.gpu.streams.keep`) until :attr:`closed` is done (None: for the process's life),
        never freed under the copies, and the caller keeps the host buffers they read as long."""
        if self.stuck:
            return False
        if deadline is None:
            deadline = time.monotonic() + streams_mod.CLOSE_WAIT_S
        # first, outside the lock: an issue() that takes the lock after this queues nothing; one that holds it
        # now (its transform may wait for a hung device) is waited for until the deadline, not for ever
        self._closed = True
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return self._stuck(None)  # (no event after that issue's work: nothing tells when it ends)
        try:
            with self._on_device():
                done = self._backend.record(self.stream)  # (under the lock: no copy is queued after it)
        finally:
            self._lock.release()
        try:
            with self._on_device():
                if not streams_mod.poll([done], self._backend.done, deadline, what="the transfer stream's copies"):
                    return True
        except DeviceError:
            done = None
        return self._stuck(done)

    def _stuck(self, closed) -> bool:
        """The stream was not past its work by the close: its buffers kept until ``closed`` is done."""
        self.stuck, self.closed = True, closed
        self.slots.keep()
        streams_mod.keep([t for t in (self.slots, self._stage, self._work) if t is not None], until=closed)
        return False


def consumer_stream(stream: int | None, device: torch.device):
    """The CUDA stream a DLPack consumer named (the protocol's integer), or None for -1 (no fence wanted)."""
    if stream == -1:
        return None
    if stream is None or stream == (0 if torch.version.hip else 1):  # the legacy default stream (ROCm: 0)
        return torch.cuda.default_stream(device)
    if stream in (0, 1, 2):
        raise BufferError(f"DLPack stream {stream} is not supported here (0 and 1 are reserved, 2 is the "
                          "per-thread default stream); pass the consumer stream's handle")
    return torch.cuda.ExternalStream(stream, device=device)


def release_waits(event_or_stream, consumers: list) -> list:
    """What the slot's next writer must wait for: the given event (or an event recorded now on the given
    stream), else every consumer stream that saw the batch."""
    if event_or_stream is None:
        return list(consumers)
    if isinstance(event_or_stream, EVENT_TYPES):
        return [event_or_stream]
    if isinstance(event_or_stream, _STREAMS):  # torch.accelerator.current_stream() gives a torch.Stream
        return [event_or_stream.record_event()]
    raise TypeError(f"release(event=...) takes a torch.cuda.Event, torch.Event, torch.cuda.Stream or torch.Stream, "
                    f"got {type(event_or_stream).__name__}")



def stage_bytes(slot_bytes: int, output: torch.dtype | None) -> int:
    """Device staging for the cast on the GPU: a batch in a dtype narrower than the output (at most half).
    ``slot_bytes`` and ``output`` are the work dtype's when batches are transformed in float32."""
    if output is None or output.itemsize < 2:
        return 0
    return slot_bytes // 2


def device_bytes(n_slots: int, elements: int, dtype: torch.dtype, cast: torch.dtype | None) -> tuple[int, int]:
    """``(slot bytes, device memory in all)``: ``n_slots`` batch slots of ``elements`` in ``dtype``, the
    staging for the cast on the device into ``cast`` (None: no cast, dtype='native') and, when that is a work
    dtype other than ``dtype`` (a transformed 16-bit batch), the work buffer."""
    slot_bytes = elements * dtype.itemsize
    work = cast if cast is not None else dtype
    work_bytes = elements * work.itemsize
    return slot_bytes, (n_slots * slot_bytes + stage_bytes(work_bytes, cast)
                        + (work_bytes if work != dtype else 0))


class CudaExecutor(CpuExecutor):
    """Batches on a GPU: the CPU executor's decoders fill pinned host *byte* slots, each batch viewed in its
    staging dtype (:func:`~.cast.staging_dtype`: the source dtype when it is a narrower integer type, else
    the output dtype); the job's completion hook (on the thread that finished the batch) hands it to
    :class:`CudaTransfer`, and the device slot is what the consumer gets, ready after its event.

    ``streams``: the transfer stream's backend (:mod:`stoker.engine.gpu.streams`; None: CUDA's). On a CPU
    ``device`` (its tests) the slots are plain memory and there is no stream."""

    staging = "pinned staging slots (lookahead_batches)"
    exact_cf = False  # CF decoding runs on the device, after its cast: no float64 work (cf.check_output refuses)
    shares_close_wait = True  # close(wait): the pipeline's one wait for all its executors (Pipeline.close)

    def __init__(self, cfg: Config, device: torch.device, stats: StatsRecorder, store: LocalStore,
                 streams: HostStreams | None = None) -> None:
        super().__init__(cfg, stats, store)
        self.device = device
        self.transfer: CudaTransfer | None = None
        self._streams = streams

    @property
    def n_host_slots(self) -> int:
        # host slots only stage batches being assembled; each is free again once its copy is done
        return self.cfg.lookahead_batches

    def host_rings(self, dtype: torch.dtype) -> list[tuple[int, torch.dtype, str]]:
        # one ring of pinned byte slots, sized for the work dtype (each batch is viewed in its staging dtype)
        return [(self.n_host_slots, self.work_dtype(dtype), self.staging)]

    def host_slot_bytes(self, slot_bytes: int) -> int:
        return pinned_footprint(slot_bytes) if self.device.type == "cuda" else slot_bytes

    def check_budget(self, shape: tuple[int, ...], dtype: torch.dtype, transient: int) -> None:
        """The host part (pinned staging plus ``transient``), then the device slots plus staging (and the
        float32 work buffer of a transformed 16-bit batch) against device_buffer_bytes."""
        super().check_budget(shape, dtype, transient)
        elements = self.cfg.batch_size * math.prod(shape)
        slot_bytes, device_need = device_bytes(self.n_slots, elements, dtype, self._cast_dtype(dtype))
        if device_need > self.cfg.device_buffer_bytes:
            raise BudgetExceeded(
                f"Config.device_buffer_bytes={self.cfg.device_buffer_bytes:,} cannot hold this pipeline on "
                f"{self.device}: {self.n_slots} batch slots (lookahead_batches + 1) x {slot_bytes:,} B plus "
                f"{device_need - self.n_slots * slot_bytes:,} B of staging for the cast (and float32 work for "
                f"the transform) on the device; needs "
                f"{device_need:,} B. Raise device_buffer_bytes, or lower batch_size, lookahead_batches or the "
                "sample shape.",
                knob="device_buffer_bytes", needed=device_need,
            )

    def _cast_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """What the device casts a batch of ``dtype`` into after the copy: the work dtype, or None for
        dtype='native' (no cast)."""
        return self.work_dtype(dtype) if self.cfg.output_dtype is not None else None

    def _make_slots(self, batch_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        work = self.work_dtype(dtype)
        work_bytes = math.prod(batch_shape) * work.itemsize
        # byte slots: each batch is assembled in its own staging dtype (see cast.staging_dtype)
        on_gpu = self.device.type == "cuda"
        # pinning needs a CUDA context: this GPU's, not GPU 0's
        with torch.cuda.device(self.device) if on_gpu else contextlib.nullcontext():
            self.host_slots = SlotRing(self.n_host_slots, (work_bytes,), torch.uint8, pin=on_gpu)
        self.transfer = CudaTransfer(self.device, self.n_slots, batch_shape, dtype,
                                     stage_bytes(work_bytes, self._cast_dtype(dtype)), work=work,
                                     streams=self._streams)
        self.slots = self.transfer.slots

    def acquire(self, plan: TablePlan, closed: Callable[[], bool]) -> Target:
        slot = take_slot(self.slots, closed)
        host_slot = take_slot(self.host_slots, closed)
        stage = staging_dtype(self._cast_dtype(self.slots.dtype), {r.dtype for r in plan.sources}) \
            or self.slots.dtype
        return Target(host_slot.view(stage, (plan.rows, *plan.row_shape)), slot, host_slot)

    def submit(self, plan: TablePlan, target: Target) -> Job:
        # CF attributes, decoded on the device after the cast; rounded to odd for an untransformed f16 output
        into = self.slots.dtype if self.cfg.transform is None else None
        decode = plan_decoder(plan, self.cfg.cf, into)
        transform = self.cfg.transform if decode is None else decode.then(self.cfg.transform)
        # float64 arrays staged in float32 for an f16 output: placed as their one rounding's float32 (half_next)
        return self.decoders.submit(plan, target.out, then=lambda job: self._to_device(target, job, transform, decode),
                                    half_next=half_next(target.out, into))

    def _to_device(self, target: Target, job: Job, transform: Callable | None = None,
                   decode: RowDecode | None = None) -> None:
        """The job's completion hook: enqueue copy, cast, CF decoding and transform, free the host slot behind
        the copy."""
        t0 = time.perf_counter()
        host = target.out  # (rows, *row_shape); job.out may be its (rows * C, *box) view
        nbytes = host.numel() * host.element_size()

        def release_host(read: torch.cuda.Event) -> None:  # also when the transform then fails
            job.out = job.out_np = target.out = None  # no view may keep the staging slot from its next batch
            self.host_slots.release(target.host_slot, ready_after=read)
            target.host_slot = None

        probes: list[RoundingProbe] = []
        # the rounding from the work buffer is checked unless no value can be past the output: without a
        # transform, the stored values CF-decoded (bounded), so this thread need not wait for the batch's event
        bounded = not needs_probe(job.plan, self.cfg, self.slots.dtype)
        target.event, transform_s = self.transfer.issue(host, target.slot, transform, copied=release_host,
                                                        keys=job.plan.keys, channels=job.plan.channels,
                                                        rounded=None if bounded else probes.append)
        if transform is not None:
            self.stats.stage("transform", transform_s)  # enqueueing it: the kernels run on the side stream
        self.stats.stage("transfer", time.perf_counter() - t0 - transform_s, bytes_in=nbytes)
        job.count(bytes_to_device=nbytes)
        checks: list[Any] = ([decode] if decode is not None and decode.probes else []) + probes
        if checks:
            self._check_rounding(target, job, checks)

    def _check_rounding(self, target: Target, job: Job, checks: list[Any]) -> None:
        """The DtypeMismatch of a value that the rounding from the work buffer made inf, or the CF decoding's from
        float64 (``checks``, each with ``.error(plan)``), raised (the job's error) once the batch's event is done:
        this compute thread waits for the copy, the decoding, the transform and the rounding of its batch (only
        a transformed 16-bit batch, or an array whose decoded values' bound passes the output, has such checks:
        :func:`~stoker.engine.rounding.fits`), until the close or
        :data:`~stoker.engine.gpu.nvcomp.CHECK_WAIT_S` (then a DeviceError)."""
        from ..gpu.nvcomp import CHECK_WAIT_S

        transfer = self.transfer
        done = transfer._backend.done
        streams_mod.poll([target.event], lambda e: transfer._closed or done(e), time.monotonic() + CHECK_WAIT_S,
                         max_pause=0.001, what="the batch's rounding")  # (a batch waits 1 ms at most after)
        if not done(target.event):
            if transfer._closed:
                raise pipeline_closed()
            raise DeviceError(f"batch {job.plan.batch_id}: its copy, CF decoding and transform did not finish "
                              f"on {self.device} within {CHECK_WAIT_S:g} s (a hung device: restart the process)")
        for check in checks:
            error = check.error(job.plan)
            if error is not None:
                raise error

    def deliver(self, target: Target, rows: int) -> Delivery:
        view, release, _, _ = super().deliver(target, rows)
        return view, release, target.event, self.transfer.stream

    def close(self, wait: streams_mod.CloseWait | None = None) -> None:
        """Refuse new copies and wait for the queued ones, so no buffer is freed under a copy, until ``wait``'s
        deadline (:class:`~stoker.engine.gpu.streams.CloseWait`: a pipeline's one for all its executors; None:
        this close's own, :data:`~stoker.engine.gpu.streams.CLOSE_WAIT_S`). A stream still busy then (a hung
        device) is named in ``wait``'s one warning (given here without a ``wait``), and every buffer its copies
        may use is kept: the transfer's (:meth:`CudaTransfer.close`) and the pinned host slots they read."""
        own = wait is None
        wait = streams_mod.CloseWait() if wait is None else wait
        transfer = self.transfer
        if transfer is not None and not transfer.stuck:
            try:
                closed = transfer.close(wait.deadline)
            except Exception:  # noqa: BLE001 - recording the close's event failed (a device fault): stuck
                closed = transfer._stuck(None)
            if not closed:
                assert self.host_slots is not None
                self.host_slots.keep()
                streams_mod.keep([self.host_slots], until=transfer.closed)
                wait.stuck(self, ["transfer"], transfer.nbytes, self.host_slots.nbytes)
        super().close()  # (plain host slots to the spare ones, unless kept: the host stand-in's)
        if own:
            wait.warn(stacklevel=2)
