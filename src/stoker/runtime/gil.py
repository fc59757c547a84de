"""GIL-held time of the threads stoker starts, read from their own CPU clocks.

CPython has no counter of the time a thread holds the GIL, but a Python thread
spends its CPU time in one of two ways: running Python (or C called from it) with
the GIL held, or inside a call that released it (a numcodecs decode, ``os.preadv``,
a numpy copy, the compiled reader). Waiting for the GIL or a lock costs no CPU. So
for each thread stoker starts (:func:`enroll`):

    GIL-held time = the thread's CPU time - the CPU time of its :func:`released` calls

Every call a pipeline thread makes into code that releases the GIL goes through
:func:`released`, which times it on the thread's CPU clock. :func:`held_since_last`
returns what the thread held since its previous call; :class:`~stoker.engine.stats.StatsRecorder`
calls it whenever a pipeline thread reports work, so nothing else in the hot path
pays for the measure. Threads that are not enrolled (the consumer's, the user's) are
never measured: their calls through :func:`released` cost one attribute lookup.

Blocking waits are released calls too (:func:`wait`): a ``Condition.wait`` drops the
GIL while it sleeps, yet on a busy virtual machine a thread's CPU clock runs 27-80 us
per wake-up (the futex calls, the scheduler, taking the GIL back), none of it under
the GIL. Counted as held, those wake-ups were a fifth of the coordinator's "GIL" on
scenario 5 (see docs/performance.md).

What the measure cannot see: GIL time while the OS has the holder descheduled (its
CPU clock stops, the GIL stays held); the waits other threads spend for the GIL (they
show as lost throughput, not as CPU); C inside a released call that runs before the
GIL is dropped or after it is taken back (argument and result conversion, and the few
microseconds of Python bookkeeping inside ``Condition.wait``), which counts as
released; and GIL-free work not declared here (file opens, small numpy or torch
calls, a contended ``with lock:``), which counts as held. See docs/performance.md.

>>> enroll()                                   # first thing on a thread stoker starts
>>> out = released(numcodecs_zstd.decompress, frame)
>>> held_since_last()                          # ns of CPU outside released calls since enroll
"""

from __future__ import annotations

import threading
import time

_clock = time.thread_time_ns  # this thread's CPU time (user + system), in ns
# per enrolled thread: ``mark`` (CPU ns at the last charge), ``free`` (released ns since), ``inside``
# (in a released call: a nested one is part of it, not counted twice)
_local = threading.local()


def enroll() -> None:
    """Measure the calling thread from now on (the pools' workers and the pipeline's coordinator call it)."""
    _local.mark = _clock()
    _local.free = 0
    _local.inside = False


def enrolled() -> bool:
    """True on a thread that called :func:`enroll`."""
    return getattr(_local, "mark", None) is not None


def released(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a call that releases the GIL: on an enrolled thread its CPU time is
    counted as released, not held."""
    if getattr(_local, "mark", None) is None or _local.inside:
        return fn(*args, **kwargs)
    _local.inside = True
    t0 = _clock()
    try:
        return fn(*args, **kwargs)
    finally:
        _local.free += _clock() - t0
        _local.inside = False


def wait(cond, timeout: float | None = None) -> bool:
    """``cond.wait(timeout)`` (a ``threading.Condition`` the caller holds), counted as released: the
    wait drops the GIL while it sleeps, and its wake-up's CPU is the kernel's and the GIL hand-over's.

    >>> with cond:
    ...     gil.wait(cond, 0.1)
    """
    return released(cond.wait, timeout)


def held_since_last() -> int:
    """Nanoseconds of CPU the calling thread spent holding the GIL since its previous call (or
    :func:`enroll`): its CPU time less its :func:`released` calls. 0 on a thread that is not enrolled."""
    mark = getattr(_local, "mark", None)
    if mark is None:
        return 0
    now = _clock()
    held = now - mark - _local.free
    _local.mark = now
    _local.free = 0
    return held if held > 0 else 0


def carry(ns: int) -> None:
    """Give back ``ns`` that :func:`held_since_last` returned to a caller who does not charge them: the
    thread's next report counts them again (nothing on a thread that is not enrolled)."""
    if getattr(_local, "mark", None) is not None:
        _local.mark -= ns
