"""A service thread's fault: an exception escaping the loop of one of stoker's own threads, made an error for
the consumer instead of a dead thread and a hang.

A thread that serves a pipeline (the native decoder's finisher...) runs its loop through :func:`serve`: an
exception that escapes it (a bug: the loop handles every error it expects, a batch's own as that batch's) is
made an :class:`~stoker.errors.InternalError` naming the thread, chained to the exception, and handed to
``on_fault``, which records it where the pipeline's work looks (its jobs then fail with it, and so does every
later one): ``pop`` raises it at once, as it raises any batch's error, rather than waiting ``pop_timeout_s``
for batches nobody will finish and blaming the consumer's slots.

>>> fault = []
>>> serve(lambda: 1 / 0, fault.append)  # on the service thread, as its target's body
>>> type(fault[0]).__name__, type(fault[0].__cause__).__name__
('InternalError', 'ZeroDivisionError')
"""

from __future__ import annotations

import inspect
import threading
import traceback
from types import FrameType
from typing import Callable

from ..errors import InternalError


#: what follows a service thread's fault, by default: its pipeline's work fails
PIPELINE_STOPS = "This pipeline can make no more batches: close it and start another"


def internal_error(thread: str, exc: BaseException, then: str = PIPELINE_STOPS) -> InternalError:
    """The typed error of ``exc`` escaping the loop of stoker's thread ``thread`` (chained to it); ``then``:
    what follows for the user."""
    err = InternalError(
        f"stoker's thread {thread!r} stopped on an internal error of stoker ({type(exc).__name__}: {exc}); "
        f"please report it (with this traceback) at the project's issue tracker. {then}", thread=thread)
    err.__cause__ = exc
    return err


def serve(loop: Callable[[], None], on_fault: Callable[[InternalError], None], then: str = PIPELINE_STOPS) -> None:
    """Run ``loop()`` (a service thread's main loop, on that thread); an exception escaping it goes to
    ``on_fault`` as an :class:`~stoker.errors.InternalError` naming the thread (``then``: what follows, in its
    message), as :func:`fail` hands it on."""
    try:
        loop()
    except BaseException as exc:  # noqa: BLE001 - a bug of ours: the consumer must hear of it, not hang
        fail(exc, on_fault, then)


def fail(exc: BaseException, on_fault: Callable[[InternalError], None], then: str = PIPELINE_STOPS) -> None:
    """``exc`` escaped a service thread's loop or task (called in the ``except`` that caught it, on that thread):
    ``on_fault`` gets it as an :class:`~stoker.errors.InternalError` naming the thread. The error is kept for
    the pipeline's life, so the frames its traceback names are cleared first (their locals, a task's job and the
    batch slot it views, are not kept with it; files and lines still print), and the catching frame is left
    out (it goes on running, or holds the loop). Should ``on_fault`` itself raise, both go to
    :func:`threading.excepthook`, as an exception escaping a thread does.

    >>> try:
    ...     1 / 0
    ... except ZeroDivisionError as exc:
    ...     fail(exc, print)  # doctest: +ELLIPSIS
    stoker's thread 'MainThread' stopped on an internal error of stoker (ZeroDivisionError: division by zero)...
    """
    fault = internal_error(threading.current_thread().name, exc, then)
    here = inspect.currentframe()  # (fail's own frame; its caller's is the catcher)
    _release_frames(exc, here.f_back if here is not None else None)
    del here
    try:
        on_fault(fault)
    except BaseException as again:  # noqa: BLE001 - the last resort: reported as a thread's error is
        again.__context__ = fault
        threading.excepthook(threading.ExceptHookArgs((type(again), again, again.__traceback__,
                                                       threading.current_thread())))


def _release_frames(exc: BaseException, catcher: FrameType | None) -> None:
    """Clear the locals of the frames in the tracebacks of ``exc`` and of the exceptions it is chained to
    (:func:`traceback.clear_frames`: one still running is left as it is), ``catcher``'s left out of them."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame is catcher:
        exc.__traceback__ = tb.tb_next
    seen: set[int] = set()
    chain: list[BaseException | None] = [exc]
    while chain:
        one = chain.pop()
        if one is None or id(one) in seen:
            continue
        seen.add(id(one))
        traceback.clear_frames(one.__traceback__)
        chain += (one.__cause__, one.__context__)


class Fault:
    """Where a group of service threads (a pool's) records its first fault, for the work they serve to look at:
    ``error`` is None until :meth:`record` is told of one. Holds nothing else, so a pool's threads, which hold
    it, keep nothing of their owner alive.

    >>> fault = Fault()
    >>> serve(lambda: 1 / 0, fault.record); fault.error.thread
    'MainThread'
    """

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: InternalError | None = None

    def record(self, error: InternalError) -> None:
        """Keep ``error`` unless one was kept already (the first is the one to report)."""
        if self.error is None:
            self.error = error
