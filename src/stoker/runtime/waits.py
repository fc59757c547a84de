"""A bounded wait on a Condition: until a predicate holds, or the caller's typed error once the deadline passed.

>>> import threading, time
>>> cv, queued = threading.Condition(), []
>>> with cv:   # the caller holds the Condition, as for Condition.wait
...     wait_until(cv, lambda: not queued, time.monotonic() + 30.0,
...                lambda: TimeoutError(f"{len(queued)} still queued after 30 s; raise the timeout"))

Unlike ``Condition.wait_for`` (which answers False), the timeout is the caller's error, made only when the wait
timed out: its message can say what is still pending, read under the lock.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

POLL_S = 0.5  # how often a wait looks at the clock again


def wait_until(cv: threading.Condition, ready: Callable[[], bool], deadline: float,
               timed_out: Callable[[], BaseException]) -> None:
    """Wait on ``cv`` (held by the caller) until ``ready()``; raise ``timed_out()`` where ``deadline`` (a
    ``time.monotonic()``) passes first."""
    while not ready():
        left = deadline - time.monotonic()
        if left <= 0:
            raise timed_out()
        cv.wait(min(left, POLL_S))


__all__ = ["wait_until", "POLL_S"]
