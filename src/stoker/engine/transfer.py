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
"""

from __future__ import annotations

import threading

import torch

from ..errors import ShutdownError
from .buffers import Slot, SlotRing


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

    def issue(self, host: torch.Tensor, slot: Slot) -> torch.cuda.Event:
        """Enqueue ``host`` (pinned, ``(rows, *sample_shape)``) into ``slot``; returns the event after the cast."""
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

