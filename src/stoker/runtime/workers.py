"""``DaemonPool``: a bounded pool of threads that can never keep the process alive.

concurrent.futures' ``ThreadPoolExecutor`` joins its threads when the interpreter exits, so
one task stuck in a system call (a read from a hung NFS or FUSE mount) keeps the process from
ever exiting. These threads are daemon threads that nothing joins: at exit a stuck one is
abandoned, and the process ends.

>>> pool = DaemonPool(4, "stoker-io", knob="n_io_threads")
>>> pool.submit(print, "hello")     # threads start as work arrives, up to 4
>>> pool.shutdown()                 # drops queued tasks and returns; running ones finish on their own

In a process forked from the pool's, where its threads do not exist, ``shutdown`` touches none of its locks.

Tasks return nothing: they report through objects of their own (a job, an event). An
exception that escapes a task (a bug: a task reports its own errors) goes to the pool's
``on_fault(error, args)`` as an :class:`~stoker.errors.InternalError` naming the thread
(:func:`~stoker.runtime.faults.internal_error`), with the task's arguments (whose job it fails),
or without one to :func:`threading.excepthook`, as one escaping a thread would; the thread goes
on with the next task.

A thread idle for :data:`IDLE_RETIRE_S` leaves (a pipeline's opener threads, dozens while it opens hundreds of
remote arrays, are not kept for the rest of a long run); the pool starts threads again as work comes.

:func:`start_thread` starts any thread of stoker's: a system that gives no more threads is a
:class:`~stoker.errors.ThreadStartError` naming the Config knob that sets how many are asked for.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
import threading
import weakref
from typing import Any, Callable, Collection

from . import gil
from .faults import fail
from ..errors import InternalError, ShutdownError, ThreadStartError

#: Seconds a pool thread waits for a task before it leaves (the pool starts another when work comes).
IDLE_RETIRE_S = 30.0


class _State:
    """What the pool shares with its threads (not the pool itself, so an unused pool can be collected)."""

    __slots__ = ("cv", "tasks", "closed", "idle", "live", "pid", "on_fault", "__weakref__")

    def __init__(self, on_fault: Callable[[InternalError, tuple], None] | None = None) -> None:
        self.cv = threading.Condition(threading.Lock())  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self.tasks: collections.deque[tuple[Callable[..., Any], tuple]] = collections.deque()
        self.closed = False
        self.idle = 0
        self.live = 0  # threads started and not left (idle ones included)
        self.pid = os.getpid()  # the process whose threads these are
        self.on_fault = on_fault  # told of an exception escaping a task (must not hold the pool)

    def close(self, drain: bool = False) -> None:
        if os.getpid() != self.pid:
            # a process forked from the pool's: none of its threads runs here, and the lock may have been
            # held by one of them at the fork, for ever here; nothing is left to stop
            self.closed = True
            return
        with self.cv:
            self.closed = True
            if not drain:
                self.tasks.clear()
            self.cv.notify_all()


def no_thread(name: str, knob: str, exc: BaseException, owner: str = "Config") -> ThreadStartError:
    """The typed error for a thread ``name`` the system did not give (``exc``, its own error); ``owner.knob``
    is the setting that asks for such threads."""
    err = ThreadStartError(
        f"the system gives no thread for {name} ({type(exc).__name__}: {exc}): the process is at its limit of "
        f"threads or processes (ulimit -u, a container's pids limit) or of memory for thread stacks. Lower "
        f"{owner}.{knob}, run fewer pipelines or ranks per machine, or raise the limit", knob=knob, thread=name)
    err.__cause__ = exc
    return err


def start_thread(thread: threading.Thread, knob: str, owner: str = "Config") -> None:
    """``thread.start()``; ThreadStartError naming ``knob`` (the thread count of ``owner`` to lower) when the
    system gives no thread (Python says so with a RuntimeError, "can't start new thread").

    >>> start_thread(threading.Thread(target=lambda: None, daemon=True), "n_compute_threads")
    """
    try:
        thread.start()
    except RuntimeError as exc:
        if "can't start new thread" not in str(exc):
            raise
        raise no_thread(thread.name, knob, exc, owner) from exc


class DaemonPool:
    """Runs ``fn(*args)`` on at most ``max_threads`` daemon threads named ``{name}_{i}``; ``knob`` is the
    setting of ``owner`` (a Config knob by default) that sets ``max_threads`` (named when the system gives no
    thread); ``on_fault(error, args)`` is told of an exception escaping a task (see the module docstring)."""

    def __init__(self, max_threads: int, name: str, knob: str = "n_compute_threads", owner: str = "Config",
                 on_fault: Callable[[InternalError, tuple], None] | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self.max_threads = max_threads
        self.name = name
        self.knob = knob
        self.owner = owner
        self._state = _State(on_fault)
        self._threads: list[threading.Thread] = []
        weakref.finalize(self, self._state.close)  # a pool dropped unclosed stops its idle threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``; :class:`~stoker.errors.ShutdownError` (a RuntimeError) after :meth:`shutdown`."""
        state = self._state
        with state.cv:
            if state.closed:
                raise ShutdownError(f"{self.name}: the pool was shut down")
            state.tasks.append((fn, args))
            # a thread more only when the idle ones cannot take every queued task
            start = state.idle < len(state.tasks) and state.live < self.max_threads
            if start:
                # those that left (idle) forgotten; not one another submit made and has yet to start (not
                # alive yet either: dropped, its name was given twice and its failed start not undone)
                self._threads = [t for t in self._threads if t.ident is None or t.is_alive()]
                taken = {t.name for t in self._threads}
                index = next(i for i in range(len(taken) + 1) if f"{self.name}_{i}" not in taken)
                thread = threading.Thread(target=_work, args=(state,), name=f"{self.name}_{index}", daemon=True)
                self._threads.append(thread)
                state.live += 1
            state.cv.notify()
        if start:
            try:
                start_thread(thread, self.knob, self.owner)
            except ThreadStartError:  # the system gives no more threads
                with state.cv:
                    self._threads.remove(thread)
                    state.live -= 1
                    if state.live:  # the running threads take the task in turn
                        return
                    state.tasks.remove((fn, args))
                raise

    def shutdown(self, drain: bool = False) -> None:
        """Refuse new tasks and stop the threads, without waiting; running tasks finish on their own. Queued
        tasks are dropped, or with ``drain`` run first (by whichever threads are free): for tasks that end
        at once once their owner is closing, and must still run to account for their work."""
        self._state.close(drain)

    @property
    def threads(self) -> list[threading.Thread]:
        """The threads started so far, less those that left idle before a thread was started since."""
        return list(self._threads)


def _work(state: _State) -> None:
    gil.enroll()  # a pool thread's GIL time is charged to the pipeline whose work it reports
    while True:
        with state.cv:
            while not state.tasks and not state.closed:
                state.idle += 1
                woke = gil.wait(state.cv, IDLE_RETIRE_S)
                state.idle -= 1
                if not woke and not state.tasks and not state.closed:
                    state.live -= 1  # idle that long: leaves (submit starts another when work comes)
                    return
            if not state.tasks:  # closed, and nothing left to drain
                state.live -= 1
                return
            fn, args = state.tasks.popleft()
        if state.on_fault is None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - reported as an exception escaping a thread is
                threading.excepthook(threading.ExceptHookArgs((type(exc), exc, exc.__traceback__,
                                                               threading.current_thread())))
        else:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - a bug: the task's work fails with it
                fail(exc, functools.partial(state.on_fault, args=args))  # (made on a raise alone: per task)
        del fn, args  # hold nothing of a finished task while idle


def when_all_done(futures: Collection[concurrent.futures.Future], then: Callable[[], None],
                  failed: Callable[[BaseException], None]) -> None:
    """``then()`` once every one of ``futures`` is done (on the thread that finished the last, or here if all
    are), or ``failed(error)`` if ``then`` raises: a future swallows its callbacks' errors, so whatever waits for
    ``then`` must hear of one. Never waits.

    >>> when_all_done([fetch, listing], lambda: print("both in"), lambda exc: print("then failed:", exc))
    """
    pending = [future for future in futures if not future.done()]
    left = [len(pending)]
    lock = threading.Lock()

    def run() -> None:
        try:
            then()
        except BaseException as exc:  # noqa: BLE001 - handed to failed (RecursionError, a bug, a closed store)
            failed(exc)

    def one(_f: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            run()

    if not pending:
        run()
    for future in pending:
        future.add_done_callback(one)
