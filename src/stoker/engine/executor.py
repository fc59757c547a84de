"""The executor contract: what the pipeline asks of whatever makes its batches.

An executor plans a batch (``plan``), takes the plan and the tensor to fill (``submit``) and returns a
:class:`Job` that completes or fails; ``shutdown`` cancels what is in flight. The CPU executor
(:mod:`.cpu`: the compiled engine, or the Python path) and the CUDA executor (:mod:`.transfer`: a CPU
executor filling pinned staging, then a copy and cast on the GPU) both keep it, so the pipeline has no
branch for either.

>>> plan = executor.plan(batch_id, samples, open_reader)
>>> job = executor.submit(plan, executor.target(slot, plan))
>>> job.wait(1.0), job.error
(True, None)
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

import torch


class Job:
    """One batch in flight. ``then(job)``, if given, runs once every chunk is in place (on the thread that
    placed the last one) and before ``done`` is set; an exception from it becomes the job's error."""

    def __init__(self, plan: Any, out: torch.Tensor, n_chunks: int,
                 then: Callable[["Job"], None] | None = None) -> None:
        from .cast import numpy_view

        self.plan = plan
        self.out = out
        self.out_np = numpy_view(out)  # numpy indexing costs far less GIL time than torch's
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._remaining = n_chunks
        self._then = then
        self._completing = False
        self._lock = threading.Lock()
        self._cancel: list[Callable[[], None]] = []  # what cancel() stops (the engine's job)
        # read/decode counters of this batch, added to Stats when it is popped, so every counter
        # describes the same delivered batches (work done ahead is not lost to stats_reset())
        self.counts = {"bytes_read": 0, "bytes_decoded": 0, "chunks_decoded": 0}
        if n_chunks == 0:
            self._complete()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def cancel(self) -> None:
        """Stop writing into the batch: once this returns, the compiled engine writes no more of it (Python
        tasks stop at their next check, through the executor's shutdown)."""
        for stop in self._cancel:
            stop()

    def on_cancel(self, stop: Callable[[], None]) -> None:
        self._cancel.append(stop)

    def count(self, **values: int) -> None:
        with self._lock:
            for name, value in values.items():
                self.counts[name] += value

    @property
    def failed(self) -> bool:
        return self.error is not None

    def finish(self, n: int = 1, error: BaseException | None = None, **counts: int) -> None:
        """``n`` chunks are in place (or failed with ``error``); ``counts`` are added as by :meth:`count`."""
        with self._lock:
            for name, value in counts.items():
                self.counts[name] += value
            if error is not None and self.error is None:
                self.error = error
            self._remaining -= n
            failed = self.error is not None
            last = not failed and self._remaining <= 0 and not self._completing
            self._completing = self._completing or last
        if failed:
            self._then = None  # the hook holds the pipeline: no cycle through a failed job
            self.done.set()
        elif last:
            self._complete()

    def _complete(self) -> None:
        then, self._then = self._then, None  # run once; drop it so the job holds no pipeline
        if then is not None:
            try:
                then(self)
            except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop
                self.error = exc
        self.done.set()


class Executor(Protocol):
    """What the pipeline needs: plans, batch targets, jobs, shutdown, memory."""

    def plan(self, batch_id: int, samples: Sequence[Any], open_reader: Callable[[str], Any]) -> Any:
        """The batch's plan (raises the typed errors of opening arrays and of bad boxes)."""

    def submit(self, plan: Any, target: Any) -> Job:
        """Start making the batch into ``target`` (from :meth:`target`); the job completes or fails."""

    def shutdown(self) -> None:
        """Cancel work in flight; returns within about a second."""

    def peak_bytes(self) -> int:
        """The most host memory its buffers held at once (slots excluded)."""
