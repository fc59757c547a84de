"""``Batch``: what ``Pipeline.pop()`` returns; a DLPack exporter that gives its slot back on release.

>>> with pipeline.pop() as batch:
...     x = torch.from_dlpack(batch)        # zero-copy view, (rows, *sample_shape)
...     batch.samples[0], batch.info.shape
...     batch.keys[0]                       # (epoch, index) of sample 0: what keyed transforms drew from

On a CUDA pipeline the import is stream-fenced: ``torch.from_dlpack`` names the
consumer's current stream, and that stream waits on the batch's ready event (no
host synchronisation). ``batch.release(event=...)`` hands the slot back once that
event (or the work queued so far on that stream) is done.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..sampling.sample import Sample


def _plain_keys(n: int) -> np.ndarray:
    """Keys ``(0, i)`` for a batch made without them."""
    keys = np.stack([np.zeros(n, np.int64), np.arange(n, dtype=np.int64)], axis=1)
    keys.setflags(write=False)
    return keys


@dataclass(frozen=True)
class BatchInfo:
    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ready_stream: Any  # the CUDA stream that produced the batch; None on CPU
    batch_id: int
    ready_event: Any = None  # the CUDA event after which the batch is complete; None on CPU


class Batch:
    """One batch of crops. Export it with ``torch.from_dlpack(batch)`` (or ``numpy.from_dlpack`` on CPU).

    The slot behind it is reused only after :meth:`release` (or leaving the
    ``with`` block) **and** once no tensor viewing it is alive, so holding
    ``x = torch.from_dlpack(batch)`` past release is safe; it just keeps the slot.
    Call ``x.clone()`` to keep data without holding a slot.

    Consumers that bypass DLPack on a CUDA batch (raw ``info.data_ptr``) must make
    their stream wait on ``info.ready_event`` (or ``info.ready_stream``) first.

    On CUDA, what "safe" covers: a plain ``release()`` fences the slot's next copy on
    the streams that used the batch through stoker (current at ``pop``, named to
    ``__dlpack__``, current at ``release``); work on a tensor of it queued on another
    stream is not seen. ``release(event=e)`` fences on ``e`` alone: work queued on the
    batch after ``e`` is not covered.

    ``keys`` is an int64 numpy array ``(B, 2)``, read-only: each sample's ``(epoch, index)``, the key keyed
    transforms drew its augmentation from (see :mod:`stoker.transforms.keys`).
    """

    def __init__(self, view: torch.Tensor, samples: tuple[Sample, ...], batch_id: int,
                 on_release: Callable[[list | None], None], ready_event: Any = None, ready_stream: Any = None,
                 keys: np.ndarray | None = None) -> None:
        self._view: torch.Tensor | None = view
        self.samples = samples
        self.keys = keys if keys is not None else _plain_keys(len(samples))
        self.info = BatchInfo(
            data_ptr=view.data_ptr(), shape=tuple(view.shape), dtype=view.dtype, device=view.device,
            ready_stream=ready_stream, batch_id=batch_id, ready_event=ready_event,
        )
        self._on_release: Callable[[list | None], None] | None = on_release
        # release() may race with itself (a consumer thread, __del__, a data-loader thread): exactly one
        # caller may hand the slot back, or a slot reused meanwhile would be freed under its next batch
        self._release_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        # CUDA streams that imported or may use the batch: a plain release() fences the slot's reuse on them
        self._consumers: list = [torch.cuda.current_stream(view.device)] if view.is_cuda else []

    def _tensor(self) -> torch.Tensor:
        if self._view is None:
            raise RuntimeError(f"batch {self.info.batch_id} was released; export it before release()")
        return self._view

    def __dlpack__(self, *args: Any, stream: Any = None, **kwargs: Any):
        t = self._tensor()
        if not t.is_cuda:
            return t.__dlpack__(*args, **kwargs) if stream is None else t.__dlpack__(*args, stream=stream, **kwargs)
        from .cuda.transfer import consumer_stream

        consumer = consumer_stream(stream, t.device)
        if consumer is not None:
            consumer.wait_event(self.info.ready_event)  # the consumer's kernels wait; the host does not
            t.record_stream(consumer)  # if the slot's memory is ever freed, not before this stream's work
            self._consumers.append(consumer)
        with torch.cuda.device(t.device):  # torch exports only from its current device
            return t.__dlpack__(*args, stream=-1, **kwargs)  # fenced above: torch must not sync again

    def __dlpack_device__(self):
        return self._tensor().__dlpack_device__()

    def release(self, event: Any = None) -> None:
        """Give the slot back (idempotent). Views obtained earlier stay valid.

        On CUDA, ``event`` says when the consumer's work on the batch is done: a ``torch.cuda.Event`` or
        ``torch.Event`` already recorded after that work (one not yet recorded fences nothing), or a stream
        to record one on now. The slot is overwritten only after it, with no host sync. Without it, the slot's next copy waits for everything
        queued on the streams that used the batch. A wrong ``event`` raises TypeError and keeps the batch.
        """
        with self._release_lock:  # the GIL alone makes no promise here (free-threaded builds have none)
            callback, self._on_release = self._on_release, None
        if callback is None:
            return
        view = self._view
        waits = None
        if view is not None and view.is_cuda:
            from .cuda.transfer import release_waits

            try:
                waits = release_waits(event, self._consumers + [torch.cuda.current_stream(view.device)])
            except BaseException:
                with self._release_lock:
                    self._on_release = callback  # a wrong event gives nothing back: a corrected release still can
                raise
        self._view = None
        callback(waits)

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __len__(self) -> int:
        return self.info.shape[0]

    def __repr__(self) -> str:
        return f"Batch(id={self.info.batch_id}, shape={self.info.shape}, dtype={self.info.dtype}, device={self.info.device})"
