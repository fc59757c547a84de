"""The CUDA leg of a batch: pinned host staging -> device slot, on a side stream, cast on the device.

The CPU executor assembles a batch in page-locked host memory in the *staging* dtype
(:func:`~stoker.engine.device.staging_dtype`: uint16 crops stay uint16, half the bytes
of float32). When its last chunk is in place, :meth:`CudaTransfer.issue` enqueues on a
dedicated non-blocking stream:

1. waits for whatever the device slot's previous batch asked for (the consumer's
   release event, or the consumer streams that used it): no host synchronisation;
2. the host-to-device copy (into a device staging buffer when a cast follows);
3. the cast into the device slot, in the output dtype;
4. an event, which the consumer's stream waits on when it imports the batch through DLPack.

The host slot goes back to its ring fenced by that event, so it is refilled only after the
copy has read it. One device staging buffer suffices: every copy and cast runs on the one
stream, in order.

:class:`CudaExecutor` is the pipeline's executor on a GPU (the contract of
:mod:`.executor`): the CPU executor's decoders fill ``lookahead_batches`` pinned byte slots,
and its delivery slots are ``lookahead_batches + 1`` device slots.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import torch

from ..errors import BudgetExceeded, ShutdownError
from ..transforms import apply as apply_transform
from . import device as devices
from .buffers import Slot, SlotRing, pinned_footprint
from .cpu import CpuExecutor
from .executor import Job, Target


# What release(event=...) accepts: torch's CUDA classes and the device-generic ones (torch.cuda.Stream is a
# torch.Stream on CUDA builds; a generic torch.Event waits on any torch.Stream). torch.Event came in 2.4.
_EVENTS = tuple(c for c in (torch.cuda.Event, getattr(torch, "Event", None)) if c is not None)
_STREAMS = tuple(c for c in (torch.cuda.Stream, getattr(torch, "Stream", None)) if c is not None)


class CudaTransfer:
    """Side stream, device batch slots and the device staging buffer of one pipeline."""

    def __init__(self, device: torch.device, n_slots: int, batch_shape: tuple[int, ...], dtype: torch.dtype,
                 stage_bytes: int) -> None:
        self.device = device
        self._lock = threading.Lock()  # issue() against close(): no copy is queued after close synchronised
        self._closed = False
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            # Allocated on the side stream, which writes them: freed memory is then reused in its order.
            with torch.cuda.stream(self.stream):
                self.slots = SlotRing(n_slots, batch_shape, dtype, device=device)
                self._stage = torch.empty(stage_bytes, dtype=torch.uint8, device=device) if stage_bytes else None

    @property
    def nbytes(self) -> int:
        """Device memory held: batch slots plus the staging buffer."""
        return self.slots.nbytes + (self._stage.numel() if self._stage is not None else 0)

    def issue(self, host: torch.Tensor, slot: Slot, transform: Callable | None = None) -> torch.cuda.Event:
        """Enqueue ``host`` (pinned, ``(rows, *sample_shape)``) into ``slot``, then ``transform`` on it (on the
        side stream, after the cast); returns the event after both."""
        out = slot.tensor[: host.shape[0]]
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if self._closed:
                raise ShutdownError("the pipeline was closed while this batch was being made")
            for wait in slot.stream_waits:
                if isinstance(wait, _EVENTS):
                    self.stream.wait_event(wait)
                else:  # a consumer stream: wait for all it has queued so far, the work on this slot included
                    self.stream.wait_stream(wait)
            slot.stream_waits = []
            if host.dtype == out.dtype:
                out.copy_(host, non_blocking=True)
            else:
                nbytes = host.numel() * host.element_size()
                if self._stage is None or nbytes > self._stage.numel():
                    raise RuntimeError(f"internal: device staging holds {0 if self._stage is None else self._stage.numel()} "
                                       f"B, the batch needs {nbytes} B")
                stage = self._stage[:nbytes].view(host.dtype).view(host.shape)
                stage.copy_(host, non_blocking=True)
                out.copy_(stage)  # the cast, on the device
            if transform is not None:
                apply_transform(transform, out)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def close(self) -> None:
        """Refuse new copies and wait for queued ones (milliseconds), so no buffer is freed under a copy."""
        with self._lock:
            self._closed = True
        self.stream.synchronize()


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
    if isinstance(event_or_stream, _EVENTS):
        return [event_or_stream]
    if isinstance(event_or_stream, _STREAMS):  # torch.accelerator.current_stream() gives a torch.Stream
        return [event_or_stream.record_event()]
    raise TypeError(f"release(event=...) takes a torch.cuda.Event, torch.Event, torch.cuda.Stream or torch.Stream, "
                    f"got {type(event_or_stream).__name__}")



def stage_bytes(slot_bytes: int, output: torch.dtype | None) -> int:
    """Device staging for the cast on the GPU: a batch in a dtype narrower than the output (at most half)."""
    if output is None or output.itemsize < 2:
        return 0
    return slot_bytes // 2


class CudaExecutor(CpuExecutor):
    """Batches on a GPU: the CPU executor's decoders fill pinned host *byte* slots, each batch viewed in its
    staging dtype (:func:`~.device.staging_dtype`: the source dtype when it is a narrower integer type, else
    the output dtype); the job's completion hook (on the thread that finished the batch) hands it to
    :class:`CudaTransfer`, and the device slot is what the consumer gets, ready after its event."""

    staging = "pinned staging slots (lookahead_batches)"

    def __init__(self, cfg, device: torch.device, stats, store) -> None:
        super().__init__(cfg, stats, store)
        self.device = device
        self.transfer: CudaTransfer | None = None

    @property
    def n_host_slots(self) -> int:
        # host slots only stage batches being assembled; each is free again once its copy is done
        return self.cfg.lookahead_batches

    def host_slot_bytes(self, slot_bytes: int) -> int:
        return pinned_footprint(slot_bytes)

    def check_budget(self, shape: tuple[int, ...], dtype: torch.dtype, transient: int) -> None:
        """The host part (pinned staging plus ``transient``), then the device slots plus staging against
        device_buffer_bytes."""
        super().check_budget(shape, dtype, transient)
        slot_bytes = self.cfg.batch_size * math.prod(shape) * dtype.itemsize
        device_need = self.n_slots * slot_bytes + stage_bytes(slot_bytes, self.cfg.output_dtype)
        if device_need > self.cfg.device_buffer_bytes:
            raise BudgetExceeded(
                f"Config.device_buffer_bytes={self.cfg.device_buffer_bytes:,} cannot hold this pipeline on "
                f"{self.device}: {self.n_slots} batch slots (lookahead_batches + 1) x {slot_bytes:,} B plus "
                f"{device_need - self.n_slots * slot_bytes:,} B of staging for the cast on the device; needs "
                f"{device_need:,} B. Raise device_buffer_bytes, or lower batch_size, lookahead_batches or the "
                "sample shape.",
                knob="device_buffer_bytes", needed=device_need,
            )

    def _make_slots(self, batch_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        slot_bytes = math.prod(batch_shape) * dtype.itemsize
        # byte slots: each batch is assembled in its own staging dtype (see device.staging_dtype)
        with torch.cuda.device(self.device):  # pinning needs a CUDA context: this GPU's, not GPU 0's
            self.host_slots = SlotRing(self.n_host_slots, (slot_bytes,), torch.uint8, pin=True)
        self.transfer = CudaTransfer(self.device, self.n_slots, batch_shape, dtype,
                                     stage_bytes(slot_bytes, self.cfg.output_dtype))
        self.slots = self.transfer.slots

    def acquire(self, plan: Any, closed: Callable[[], bool]) -> Target:
        slot = self._acquire(self.slots, closed)
        host_slot = self._acquire(self.host_slots, closed)
        stage = devices.staging_dtype(self.cfg.output_dtype, {r.dtype for r in plan.sources}) or self.slots.dtype
        return Target(host_slot.view(stage, (plan.rows, *plan.row_shape)), slot, host_slot)

    def submit(self, plan: Any, target: Target) -> Job:
        return self.decoders.submit(plan, target.out, then=lambda job: self._to_device(target, job))

    def _to_device(self, target: Target, job: Job) -> None:
        """The job's completion hook: enqueue copy and cast, free the host slot behind them."""
        t0 = time.perf_counter()
        host = target.out  # (rows, *row_shape); job.out may be its (rows * C, *box) view
        target.event = self.transfer.issue(host, target.slot, self.cfg.transform)
        job.out = job.out_np = target.out = None  # no view may keep the staging slot from its next batch
        self.host_slots.release(target.host_slot, ready_after=target.event)
        target.host_slot = None
        self.stats.stage("transfer", time.perf_counter() - t0, bytes_in=host.numel() * host.element_size())

    def deliver(self, target: Target, rows: int) -> tuple[torch.Tensor, Callable, Any, Any]:
        view, release, _, _ = super().deliver(target, rows)
        return view, release, target.event, self.transfer.stream

    def close(self) -> None:
        """Refuse new copies and wait for queued ones, so no buffer is freed under a copy."""
        if self.transfer is not None:
            self.transfer.close()
