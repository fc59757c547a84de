"""Write-behind for a TileWriter: finished regions written by a few threads while the caller goes on.

zarr-python's write of a region (encode, compress, store) dominates a whole-volume inference on a CPU;
doing it on the consumer's thread puts it one after another with the reads and the model. A
:class:`BackgroundWriter` runs the writes on a :class:`~stoker.runtime.workers.DaemonPool` of ``threads``
threads (numcodecs and numpy release the GIL; a write stuck in the storage cannot keep the process alive)
and bounds them in bytes: :meth:`submit` blocks, with a timeout, while the regions queued or being written
would hold more than ``max_bytes`` with the new one (``nbytes``: all a region's write holds; one region
is always let through, whatever its size).

A failed write is kept and raised, as it was raised (a :class:`~stoker.errors.StorageError` from the
writer), at the next :meth:`submit` or at :meth:`close`; the threads write nothing after it. Each task
does its own bookkeeping after its write succeeded (the completion record's mark), so a region is never
marked unless written.

>>> bw = BackgroundWriter("/out/pred.zarr", threads=2, max_bytes=64 << 20, timeout_s=300)
>>> bw.submit("region (0, 0, 0)", 1 << 20, lambda: write_region((0, 0, 0)))
>>> bw.close()   # waits for the writes; raises the first error
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..errors import StorageError
from ..runtime.waits import wait_until
from ..runtime.workers import DaemonPool


class BackgroundWriter:
    """Runs write tasks on ``threads`` threads, at most ``max_bytes`` of them in flight (see the module
    docstring); ``uri`` names the array in errors."""

    def __init__(self, uri: str, threads: int, max_bytes: int, timeout_s: float) -> None:
        self.uri, self.max_bytes, self.timeout_s = uri, int(max_bytes), float(timeout_s)
        self._cv = threading.Condition()
        self._in_flight = 0  # bytes of the tasks queued or running
        self._running = 0  # tasks queued or running
        self._error: BaseException | None = None
        self._pool = DaemonPool(int(threads), "stoker-tilewriter", knob="write_threads", owner="TileWriter")

    @property
    def in_flight_bytes(self) -> int:
        """Bytes held by regions queued or being written."""
        with self._cv:
            return self._in_flight

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def check(self) -> None:
        """Raise the error of a task that failed, if one did."""
        with self._cv:
            self._raise_error()

    def _wait(self, ready: Callable[[], bool], what: str, deadline: float | None = None) -> None:
        def timed_out() -> StorageError:
            return StorageError(f"{self.uri}: {what} did not finish within write_timeout_s={self.timeout_s:g} s "
                                f"({self._running} regions, {self._in_flight} bytes still being written); "
                                "check the storage, or raise write_timeout_s", uri=self.uri, key=None,
                                status=None, attempts=None)

        wait_until(self._cv, ready, time.monotonic() + self.timeout_s if deadline is None else deadline, timed_out)

    def submit(self, what: str, nbytes: int, task: Callable[[], None]) -> None:
        """Queue ``task`` (the write of ``what``, holding ``nbytes``), after waiting for room; raises the
        error of an earlier task."""
        with self._cv:
            self._raise_error()
            self._wait(lambda: self._error is not None or self._running == 0
                       or self._in_flight + nbytes <= self.max_bytes, f"room to queue {what}")
            self._raise_error()
            self._in_flight += int(nbytes)
            self._running += 1
        try:
            self._pool.submit(self._run, int(nbytes), task)  # ThreadStartError when no thread at all starts
        except BaseException:
            with self._cv:
                self._in_flight -= int(nbytes)
                self._running -= 1
                self._cv.notify_all()
            raise

    def _run(self, nbytes: int, task: Callable[[], None]) -> None:
        try:
            with self._cv:
                skip = self._error is not None  # after a failure nothing more is written
            if not skip:
                task()
        except BaseException as exc:  # kept for the caller's thread, which raises it
            with self._cv:
                if self._error is None:
                    self._error = exc
        finally:
            with self._cv:
                self._in_flight -= nbytes
                self._running -= 1
                self._cv.notify_all()

    def drain(self, deadline: float | None = None) -> None:
        """Wait (until ``deadline``, a ``time.monotonic()``; by default ``timeout_s`` from now) for every queued
        task; raise the first error."""
        with self._cv:
            self._wait(lambda: self._running == 0, "the writes of the regions queued", deadline)
            self._raise_error()

    def close(self, deadline: float | None = None) -> None:
        """:meth:`drain`, then stop the threads (also when the drain raised); every wait ends by ``deadline``
        (by default ``timeout_s`` from now)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        try:
            self.drain(deadline)
        finally:
            self._shutdown(deadline)

    def stop(self) -> None:
        """Let the threads end once the queued tasks ran, without waiting for them (a writer dropped
        without ``close()``: its threads do not outlive it)."""
        self._pool.shutdown(drain=True)

    def _shutdown(self, deadline: float) -> None:
        self.stop()
        with self._cv:
            stuck = self._running > 0  # a drain timed out: a write hangs
        if stuck:
            deadline = time.monotonic()
        for t in self._pool.threads:  # a thread stuck in a write is a daemon: it cannot keep the process alive
            t.join(max(0.0, deadline - time.monotonic()))


__all__ = ["BackgroundWriter"]
