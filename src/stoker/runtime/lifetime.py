"""Objects with threads of their own are closed before the interpreter finalises.

A pipeline (or a records loader's iteration) that a script leaves open, or that an iterator kept after a
``break`` still holds (as ``StatefulDataLoader`` keeps its dataset's), has daemon threads that may be inside
torch or the compiled extension when the interpreter finalises. Python then stops a daemon thread where it
is as soon as it wants the GIL: unwinding torch's C++ frames aborts the process ("terminate called without
an active exception", exit code 134), and a lock it held stays held, so a later ``close()`` waiting on it
hangs. :func:`track` keeps a weak reference to each such object (it never keeps one alive); an ``atexit``
hook, run before the interpreter finalises and while every thread still runs, closes those still open, then
waits for their threads to end, at most :data:`EXIT_WAIT_S` in all (a thread stuck in a system call, a hung
network mount, is left: it holds no lock of ours and runs no torch code until the call returns). A thread the
object names as parked once it is closed (``parked``: a pipeline's coordinator still inside the user's sample
source a second after the close told it to stop, a source that blocks for ever) is not waited for at all: it
runs none of stoker's code, and waiting for it only held the exit EXIT_WAIT_S.

>>> lifetime.track(pipeline, lambda p: p.threads_now())   # closed at exit, unless collected before
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any, Callable

#: the most the exit hook waits, in all, for the threads of the objects it closed
EXIT_WAIT_S = 10.0

_Threads = Callable[[Any], list[threading.Thread]]
_live: "weakref.WeakKeyDictionary[Any, tuple[_Threads, _Threads | None]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
_hooked = False


def track(obj: Any, threads_of: _Threads, parked: _Threads | None = None) -> None:
    """Close ``obj`` (its ``close()``) at interpreter exit if it is still alive then, and wait for the threads
    ``threads_of(obj)`` names (asked just before the close), less those ``parked(obj)`` names (asked just after
    it: threads in the user's code that may never return). Neither function may hold ``obj``."""
    global _hooked
    with _lock:
        _live[obj] = (threads_of, parked)
        if not _hooked:
            atexit.register(close_all)
            _hooked = True


def close_all(wait_s: float = EXIT_WAIT_S) -> None:
    """Close every tracked object still alive, then wait up to ``wait_s`` in all for their threads to end.
    The exit hook; errors of one close do not keep the others from closing."""
    with _lock:
        items = list(_live.items())
        _live.clear()
    threads: list[threading.Thread] = []
    for obj, (threads_of, parked) in items:
        mine: list[threading.Thread] = []
        try:
            mine = threads_of(obj)
        except Exception:  # noqa: BLE001 - an object half made: close it all the same
            pass
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - at exit: the other objects must still close
            pass
        try:
            left = parked(obj) if parked is not None else []
        except Exception:  # noqa: BLE001 - then every thread is waited for
            left = []
        threads += [t for t in mine if t not in left]
    del items
    deadline = time.monotonic() + wait_s
    me = threading.current_thread()
    for t in threads:
        if t is not None and t is not me and t.ident is not None:
            t.join(max(0.0, deadline - time.monotonic()))
