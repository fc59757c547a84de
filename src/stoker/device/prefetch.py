"""Prefetching batches onto a device: pinned on a background thread, copied on a side stream.

:class:`DevicePrefetcher` wraps any iterable of batches: it pins on a background
thread of the main process (never in forked DataLoader workers), copies with
``non_blocking=True`` on a side stream, and fences the consumer's stream on an
event. On a CPU device (``device="cpu"``, or ``None`` without CUDA) it passes batches through
unchanged; naming a CUDA device torch cannot see is an InvalidArgument.

>>> for batch in DevicePrefetcher(loader, device="cuda", depth=2):
...     loss = model(batch["x"])
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterable, Iterator

import torch

from ..checks import integer, seconds
from .pin import pin_object, tensors_in, to_device
from .resolve import as_device


def record_stream(obj: Any, stream: Any) -> None:
    """Tell the caching allocator the consumer's stream uses these tensors (no early reuse)."""
    for t in tensors_in(obj):
        if t.is_cuda:
            t.record_stream(stream)


_DONE = object()  # the end of a prefetcher's pass
_RESTART_WAIT_S = 60.0  # how long a new pass waits for the previous pass's producer to leave the source


class _Feed:
    """One pass of a prefetcher: its bounded queue, stop flag and producer thread."""

    def __init__(self, depth: int, poll: float) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.poll = poll
        self.thread: threading.Thread | None = None

    def get(self) -> Any:
        while True:
            try:
                return self.queue.get(timeout=self.poll)
            except queue.Empty:
                if self.thread is not None and not self.thread.is_alive() and self.queue.empty():
                    return _DONE

    def put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=self.poll)
                return True
            except queue.Full:
                continue
        return False

    def wait_stopped(self, timeout: float) -> None:
        """Wait for the producer to leave the source (it stops after its current ``next()``)."""
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise RuntimeError(f"DevicePrefetcher: the previous pass is still waiting on the source's next() "
                                   f"after {timeout:.0f} s; a new pass would read the source from a second thread")

    def close(self) -> None:
        self.stop.set()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)


class DevicePrefetcher:
    """Iterate batches already on ``device``, prepared ``depth`` ahead on a background thread.

    >>> for batch in DevicePrefetcher(loader, device="cuda:0"):
    ...     loss = model(batch["x"])         # consumption is fenced on the copy's event

    ``device=None`` is the current CUDA device when there is one, else the CPU; ``"cuda"``
    means the current CUDA device (``torch.cuda.set_device(local_rank)`` first). On a CPU
    device it is a transparent pass-through. Every iteration is a fresh pass over
    ``iterable``. Exceptions from the source reach the consumer; ``close()`` (or leaving
    the ``with`` block) stops the thread promptly.
    """

    def __init__(self, iterable: Iterable[Any], device: torch.device | str | int | None = None,
                 depth: int = 2, timeout_s: float = 0.1) -> None:
        self.device = as_device(device, "DevicePrefetcher(device=...)")
        self._source = iterable
        self._depth = integer("depth", depth, 1)
        self._poll = seconds("timeout_s", timeout_s, finite=True)
        self._feed: _Feed | None = None

    @property
    def passthrough(self) -> bool:
        return self.device.type != "cuda"

    def __iter__(self) -> Iterator[Any]:
        if self.passthrough:
            yield from self._source
            return
        if self._feed is not None:  # a pass still running ends before this one starts: one thread drives
            self._feed.close()      # the source at a time (a shared iterator must not be read twice over)
            self._feed.wait_stopped(_RESTART_WAIT_S)
        feed = self._feed = _Feed(self._depth, self._poll)
        feed.thread = threading.Thread(target=self._produce, args=(feed,), name="stoker-prefetch", daemon=True)
        feed.thread.start()
        try:
            while True:
                item = feed.get()
                if item is _DONE:
                    return
                kind, payload, event = item
                if kind == "error":
                    raise payload
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(event)  # fence: the consumer's kernels wait for the copy, the host does not
                record_stream(payload, stream)
                yield payload
        finally:
            feed.close()

    def _produce(self, feed: "_Feed") -> None:
        try:
            # A new thread starts on CUDA device 0: make the prefetch device current, so that nothing
            # this thread does (pinning, allocator state, a context) lands on GPU 0 on every rank.
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
            for batch in self._source:
                if feed.stop.is_set():
                    return
                pinned = pin_object(batch)  # CUDA is available here: pins, never warns
                with torch.cuda.stream(stream):
                    moved = to_device(pinned, self.device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                if not feed.put(("batch", moved, event)):
                    return
            feed.put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            feed.put(("error", exc, None))

    def close(self) -> None:
        """Stop the background thread (returns within about ``timeout_s``)."""
        if self._feed is not None:
            self._feed.close()

    def __enter__(self) -> "DevicePrefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
