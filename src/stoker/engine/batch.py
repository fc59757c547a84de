"""``Batch``: what ``Pipeline.pop()`` returns; a DLPack exporter that gives its slot back on release.

>>> with pipeline.pop() as batch:
...     x = torch.from_dlpack(batch)        # zero-copy view, (rows, *sample_shape)
...     batch.samples[0], batch.info.shape
...     batch.keys[0]                       # (epoch, index) of sample 0: what keyed transforms drew from

On a CUDA pipeline the import is stream-fenced: ``torch.from_dlpack`` names the
consumer's current stream, and that stream waits on the batch's ready event (no
host synchronisation). ``batch.release(event=...)`` hands the slot back once that
event (or the work queued so far on that stream) is done.

``FieldBatch``: what ``Pipeline.pop()`` returns for samples of named fields; a read-only mapping from field
name to that field's :class:`~stoker.Batch`.

>>> with pipeline.pop() as batch:                                   # samples {"raw": ..., "labels": ...}
...     x = {k: torch.from_dlpack(v) for k, v in batch.items()}     # (B, *raw shape), (B, *labels shape)
...     batch.rows, batch.samples[0]["labels"]

Each field's batch is a :class:`~stoker.Batch` of its own slot (a pipeline of fields has one set of slots per
field, see docs/architecture.md, "Lanes"), with ``__dlpack__``, ``info`` and ``samples`` (that field's plain
samples). ``len(batch)`` is the number of fields, as for any mapping; the number of samples is
``batch.rows`` (also ``batch.batch_size``). Releasing the FieldBatch (``release()``, or leaving ``with``)
releases every field's slot; each is reused only once no tensor views it, as for a Batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..errors import BatchReleased
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
            raise BatchReleased(
                f"batch {self.info.batch_id} was released (by release(), the end of its `with` block, or the "
                "pipeline's iteration, which releases each batch when the next is asked for), so its slot may hold "
                "another batch now; export it (torch.from_dlpack) before then, and .clone() what you keep")
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


class FieldBatch(Mapping):
    """One batch of samples of named fields: field name -> :class:`~stoker.Batch`, in the fields' order (see
    the module docstring). ``samples``: the batch's samples of fields, in order; ``rows``: how many."""

    def __init__(self, batches: dict[str, Batch], samples: tuple[Sample, ...], batch_id: int,
                 sample_keys: np.ndarray | None = None) -> None:
        self._batches = dict(batches)
        self.samples = samples
        self.batch_id = batch_id
        #: each sample's (epoch, index), int64 (B, 2): what keyed transforms drew from (each field's
        #: :attr:`Batch.keys`; not ``keys``, which is the mapping's field names)
        self.sample_keys = sample_keys if sample_keys is not None else next(iter(self._batches.values())).keys

    def __getitem__(self, name: str) -> Batch:
        return self._batches[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._batches)

    def __len__(self) -> int:
        """The number of fields (a mapping's length); the number of samples is :attr:`rows`."""
        return len(self._batches)

    @property
    def rows(self) -> int:
        """The samples in this batch (each field's leading axis)."""
        return len(self.samples)

    batch_size = rows

    def release(self, event: Any = None) -> None:
        """Give every field's slot back (idempotent); ``event`` as for :meth:`Batch.release`. Views obtained
        earlier stay valid (each keeps its slot until it dies)."""
        for batch in self._batches.values():
            batch.release(event)

    def __enter__(self) -> "FieldBatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        inner = ", ".join(f"{name!r}: {tuple(b.info.shape)} {b.info.dtype}" for name, b in self._batches.items())
        return f"FieldBatch(id={self.batch_id}, rows={self.rows}, {{{inner}}})"


def to_tensors(batch: Batch | FieldBatch) -> torch.Tensor | dict[str, torch.Tensor]:
    """``torch.from_dlpack`` of a batch: its tensor, or for a :class:`FieldBatch` a dict of each field's.

    >>> to_tensors(pipeline.pop())     # {"raw": tensor (B, 96, 96, 96), "labels": tensor (B, 56, 56, 56)}
    """
    if isinstance(batch, FieldBatch):
        return {name: torch.from_dlpack(b) for name, b in batch.items()}
    return torch.from_dlpack(batch)
