"""Ending an event loop's obstore requests before the interpreter finalises (the exit hooks' shared part).

An obstore request is a Rust future on a tokio thread that takes the GIL when it ends, to hand its result to
the asyncio loop that awaits it (``call_soon_threadsafe``). One that ends once the interpreter has begun to
finalise aborts the process: "Fatal Python error: Aborted", exit code 134 (obstore 0.12.1,
PyO3/pyo3-async-runtimes#40). An exit hook therefore cancels what the loop still has pending
(:func:`cancel_pending`: a cancelled request ends at once) and then sleeps :data:`GRACE_S`, the GIL
released, so that the tokio threads take and leave the GIL while the interpreter still runs.

>>> loopexit.cancel_pending(loop, 2.0)   # from another thread than the loop's: the count cancelled
"""

from __future__ import annotations

import asyncio

#: the pause, GIL released, after the cancelled requests ended: time for tokio threads to leave the GIL they
#: took to hand a result to the loop (a request that ended just before the exit has its task done while its
#: thread still holds the GIL, or is about to take it back to release it)
GRACE_S = 0.1

#: the most an exit hook waits for the requests it cancelled to end (and objectstore's, for the loop's thread)
EXIT_WAIT_S = 2.0


async def _cancel_all(wait_s: float) -> int:
    me = asyncio.current_task()
    pending = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=wait_s)
    return len(pending)


def cancel_pending(loop: asyncio.AbstractEventLoop, wait_s: float) -> int:
    """Cancel every task ``loop`` (running on another thread) still has and wait up to ``wait_s`` for them to
    end: the count cancelled; 0 where the loop is closed or not running. Never raises."""
    if loop.is_closed() or not loop.is_running():
        return 0
    try:
        return int(asyncio.run_coroutine_threadsafe(_cancel_all(wait_s), loop).result(wait_s + 1.0))
    except Exception:  # noqa: BLE001 - at exit: a loop stopping under us has nothing left to wait for
        return 0
