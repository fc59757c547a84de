"""A child forked at a chosen moment for the tests (tests/engine/test_buffers.py, tests/inference/test_buffers.py,
tests/gpu/test_gpu_native_reads.py): :func:`held_by_another_thread` holds a lock on a thread of its own (a
pool's, at the moment of the fork), :func:`fork_child` runs a check in the child, whose exit status is its
verdict, and :func:`verdict` waits for it, bounded: a child stuck on a lock inherited held is killed and said
to have hung."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from typing import Callable, Iterator


@contextlib.contextmanager
def held_by_another_thread(lock, wait_s: float = 10.0) -> Iterator[None]:
    """``lock`` held by another thread while the block runs (at most ``wait_s``), let go after it."""
    inside, leave = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            inside.set()
            leave.wait(wait_s)

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    assert inside.wait(5), "the holder thread never took the lock"
    try:
        yield
    finally:
        leave.set()
        t.join(5)


def fork_child(child: Callable[[], bool]) -> int:
    """Fork; the child runs ``child()`` and exits 0 when it returns True, 2 when False, 3 when it raised
    (nothing raised out of it). The child's pid, in the parent."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process (Python 3.12+)
        pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = 0 if child() else 2
        finally:
            os._exit(code)
    return pid


def verdict(pid: int, wait_s: float = 10.0) -> str:
    """Wait for the child ``pid`` at most ``wait_s`` (then kill it): ``"exit N"``, or ``"hung"``."""
    deadline = time.monotonic() + wait_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return "hung"
    return f"exit {os.waitstatus_to_exitcode(done[1])}"
