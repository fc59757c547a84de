"""Requests zarr-python left in flight on an object store end before the interpreter finalises.

zarr-python reads an array's metadata with ``asyncio.gather`` over ``zarr.json``, ``.zarray`` and ``.zattrs``
(and writes chunks concurrently): when one request fails, the call returns its error and the others stay in
flight on zarr's event loop thread. Through obstore each such request is a Rust future on a tokio thread, which
takes the GIL when it ends to hand its result to that loop. If it ends after the interpreter began to finalise
(an endpoint that never answers: the orphans time out milliseconds after the request that failed, as the script
exits), the process aborts at exit: "Fatal Python error: PyGILState_Release ... finalizing", or "Fatal Python
error: Aborted", exit code 134 (zarr 3.1.6, obstore 0.12.1; no stoker code runs then). :func:`hook` registers an
``atexit`` hook, run before zarr-python's own (which closes its loop) and before finalisation, that cancels what
zarr's loop still has pending and waits for it to end, at most :data:`EXIT_WAIT_S`, then :data:`GRACE_S` more,
the GIL released: a cancelled obstore request ends at once, its tokio thread taking and releasing the GIL while
the interpreter still runs.

>>> zarrloop.hook()   # once a zarr ObjectStore over obstore is made: idempotent
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any

from .loopexit import EXIT_WAIT_S, GRACE_S, cancel_pending

_lock = threading.Lock()  # a leaf: held only to register once
_hooked = False


def hook() -> None:
    """Register :func:`settle` to run at interpreter exit, once. Call it after zarr-python is imported, so that
    it runs before zarr's own exit hook (``atexit`` runs the last registered first)."""
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(settle)
            _hooked = True


def settle(wait_s: float = EXIT_WAIT_S) -> int:
    """Cancel the tasks zarr-python's event loop still runs and wait up to ``wait_s`` for them to end: the
    count cancelled (0 where zarr's loop never started or is gone). The exit hook; it never raises."""
    import sys

    sync: Any = sys.modules.get("zarr.core.sync")
    loop = None if sync is None else getattr(sync, "loop", [None])[0]
    if loop is None or loop.is_closed() or not loop.is_running():
        return 0
    count = cancel_pending(loop, wait_s)
    # Even with none pending (not skipped: a script's last TileWriter.close() just before the exit is that case):
    # a request's tokio thread hands its result with loop.call_soon_threadsafe, which leaves the GIL to write to
    # the loop's wake-up socket; the loop may finish the task meanwhile, and the thread then takes the GIL back
    # and releases it. Finalisation begun by then aborts the process in PyGILState_Release.
    time.sleep(GRACE_S)
    return count
