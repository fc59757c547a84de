"""``ordered_map``: ``fn`` over items on a few daemon threads, results in the items' order, memory bounded.

    >>> with contextlib.closing(ordered_map(read_moments, boxes, threads=4, timeout_s=600, what=uri)) as out:
    ...     for m in out:            # boxes[0]'s result first, whichever thread finished first
    ...         acc = acc.merge(m)

At most ``2 * threads`` items are in flight or waiting to be taken, so memory holds that many results (and
``threads`` reads) whatever the number of items. Reads and decodes release the GIL, so the threads read in
parallel. Each result is waited for at most ``timeout_s`` (a read stuck on a hung mount is a
:class:`~stoker.errors.StorageError` naming the item, never a hang), with one thread or one item too: they
run on the pool as well. An error of ``fn`` is raised in its place. The threads are
:class:`~stoker.runtime.workers.DaemonPool`'s: never joined at exit.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generator, Sequence

from ..errors import StorageError
from ..runtime.workers import DaemonPool


def ordered_map(fn: Callable[[Any], Any], items: Sequence[Any], threads: int, timeout_s: float,
                what: str) -> Generator[Any, None, None]:
    """``fn(item)`` for every item, yielded in order (see the module docstring); ``what`` names the work."""
    if not items:
        return
    # Even one thread, or one item, reads on the pool: on the calling thread no wait could be bounded.
    threads = max(1, min(threads, len(items)))
    cv = threading.Condition()
    done: dict[int, tuple[bool, Any]] = {}

    def run(i: int) -> None:
        try:
            out = (True, fn(items[i]))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised in the item's place
            out = (False, exc)
        with cv:
            done[i] = out
            cv.notify_all()

    pool = DaemonPool(threads, "stoker-stats", knob="threads", owner="compute_stats")
    window = 2 * threads
    # inf (no limit) or a huge number: the longest wait the platform takes (centuries), not an OverflowError
    wait_s = min(timeout_s, threading.TIMEOUT_MAX)
    submitted = 0
    try:
        for i in range(len(items)):
            while submitted < len(items) and submitted < i + window:
                pool.submit(run, submitted)
                submitted += 1
            with cv:
                if not cv.wait_for(lambda: i in done, timeout=wait_s):
                    raise StorageError(f"{what}: reading {items[i]} took more than {timeout_s:g} s (a hung mount or "
                                       "store?); raise timeout_s if the storage is that slow", timeout_s=timeout_s)
                ok, out = done.pop(i)
            if not ok:
                raise out
            yield out
            del out
    finally:
        pool.shutdown()  # queued items are dropped; running ones finish on their own


__all__ = ["ordered_map"]
