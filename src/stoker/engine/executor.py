"""The executor contract: what the pipeline asks of whatever makes its batches.

An executor owns the batch slots and the decode work. ``prepare`` makes its buffers (once, from the first
batch's arrays); ``plan`` plans a batch; ``acquire`` gives the :class:`Target` to make it in (waiting for a
free slot); ``submit`` starts it and returns a :class:`Job` that completes or fails (``cancel``);
``deliver`` hands out a finished batch's view and how to release it, ``drop`` gives back a failed one;
``shutdown`` cancels work in flight, ``close`` frees the rest, ``threads`` lists the threads it started (waited
for at interpreter exit, :mod:`stoker.runtime.lifetime`); ``check_budget``, ``held`` and ``peak_bytes`` answer
for memory. The CPU executor (:mod:`.cpu`: slots in host memory, filled by the compiled engine or
the Python path), the CUDA executor (:mod:`.transfer`: the same filling pinned staging, then a copy and
cast on the GPU) and the GPU-decode executor (:mod:`.gpu.executor`: chunks cross encoded and are decoded, cast
and placed on the device) all keep it, so the pipeline has no branch for any:
:func:`stoker.engine.choose.make_executor` picks one. This module imports none of them.

>>> executor = make_executor(cfg, device, stats, store)
>>> executor.prepare(sample_shape, readers, dtype)
>>> plan = executor.plan(batch_id, samples, open_reader)
>>> job = executor.submit(plan, executor.acquire(plan, closed))
>>> job.wait(1.0), job.error
(True, None)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np
import torch

from ..errors import StokerError
from ..runtime import gil
from .cast import numpy_view

if TYPE_CHECKING:  # for annotations only: the contract imports none of what implements it
    from ..reader.array import ArrayReader
    from ..sampling.sample import Sample
    from .buffers import Slot, SlotRing
    from .planning.tables import TablePlan


class _Unset:
    """The type of :data:`_UNSET`: a value not made yet."""


_UNSET = _Unset()

#: What :meth:`Executor.deliver` gives for a finished batch: its view, ``release(stream_waits)`` giving its slot
#: back (the streams its next writer waits for, or None), and the CUDA event and stream it is ready after
#: (None, None for a batch in host memory).
Delivery = tuple[torch.Tensor, Callable[[list | None], None], "torch.cuda.Event | None", "torch.cuda.Stream | None"]


class EngineJob(Protocol):
    """The compiled engine's job (``stoker._native.BatchJob``) as a :class:`Job` waits for it: ``wait(timeout)``
    True once it is done (in C, the GIL released)."""

    def wait(self, timeout: float | None = None, /) -> bool: ...

class Done:
    """Set once, waited on by any thread: ``threading.Event``'s ``set``, ``is_set`` and ``wait``. An Event
    builds a Condition (three caught AttributeErrors, a few microseconds of the coordinator's GIL per batch);
    this one builds it only for a thread that waits before it is set.

    >>> done = Done(); done.set(); done.wait(0.1)
    True
    """

    __slots__ = ("_flag", "_lock", "_event")

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._lock:
            self._flag = True
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        with self._lock:
            if self._flag:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


class Job:
    """One batch in flight. ``then(job)``, if given, runs once every chunk is in place (on the thread that
    placed the last one) and before ``done`` is set; an exception from it becomes the job's error.

    A job made by the compiled engine alone, with no ``then``, is settled by whoever waits for it
    (:meth:`settled_by`): its wait is the engine's, in C without the GIL, and the first waiter that sees the
    engine done reads the results (a few calls, once), instead of a thread of ours waking to do it and then
    waking the waiter."""

    def __init__(self, plan: TablePlan, out: torch.Tensor | None, n_chunks: int,
                 then: Callable[["Job"], None] | None = None) -> None:
        self.plan = plan
        self.out = out
        # made when first asked for: the engine's batches never need it
        self._out_np: np.ndarray | None | _Unset = _UNSET
        self.done = Done()
        self.error: BaseException | None = None
        self._remaining = n_chunks
        self._then = then
        self._completing = False
        self._lock = threading.Lock()
        self._cancel: list[Callable[[], None]] = []  # what cancel() stops (the engine's job)
        self._engine: EngineJob | None = None  # the engine's job, while nobody has settled this one from it
        self._settle: Callable[["Job", EngineJob], None] | None = None  # settle(job, engine job): see settled_by
        self._changed = False  # finish() was entered (an interrupted settle is not run again after it)
        self._handed = False  # a settle gave the job to another thread
        # read/decode counters of this batch, added to Stats when it is popped, so every counter
        # describes the same delivered batches (work done ahead is not lost to stats_reset())
        self.counts = {"bytes_read": 0, "bytes_decoded": 0, "chunks_decoded": 0, "bytes_to_device": 0}
        if n_chunks == 0:
            self._complete()

    @property
    def out_np(self) -> np.ndarray | None:
        """A numpy view of ``out`` (None where numpy lacks its dtype, or off the CPU): numpy indexing costs
        far less GIL time than torch's."""
        view = self._out_np
        if isinstance(view, _Unset):
            view = self._out_np = None if self.out is None else numpy_view(self.out)
        return view

    @out_np.setter
    def out_np(self, value: np.ndarray | None) -> None:
        self._out_np = value

    @property
    def has_hook(self) -> bool:
        """Whether a ``then`` hook runs when the chunks are in place (and has not run yet)."""
        return self._then is not None

    def settled_by(self, engine_job: EngineJob, settle: Callable[["Job", EngineJob], None]) -> None:
        """Leave ``settle(job, engine_job)`` to the first :meth:`wait` that finds ``engine_job`` done (its
        ``wait(timeout)`` releases the GIL); ``settle`` finishes the job (or hands chunks on)."""
        self._settle, self._engine = settle, engine_job

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        engine = self._engine
        if engine is not None:
            if not gil.released(engine.wait, timeout):
                return False
            settle = None
            try:
                with self._lock:  # the first waiter to see it done settles it; the others wait for that below
                    settle, self._settle, self._engine = self._settle, None, None
                if settle is not None:
                    settle(self, engine)
            except BaseException:
                if settle is not None:  # claimed: put back unless it had begun (see _interrupted)
                    self._interrupted(settle, engine)
                raise
            del engine, settle
        return self.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def handed_on(self) -> None:
        """Said by a settle that gave the job to another thread (which finishes it)."""
        self._handed = True

    def _interrupted(self, settle: Callable[["Job", EngineJob], None], engine: EngineJob) -> None:
        """After ``settle`` raised past its own error handling (a KeyboardInterrupt lands on the main thread,
        often the consumer's): if it had not begun to change the job, the next wait settles it again; if it
        was completing it (a settled job has no hook), it is complete; otherwise the batch is lost, as an
        error for pop, rather than waited for forever."""
        with self._lock:
            if self.done.is_set() or self._handed:
                return
            if not self._changed:
                self._settle, self._engine = settle, engine
                return
        if self._completing:
            self.done.set()
        else:
            self.finish(0, StokerError("this batch was interrupted while it was being handed over, and is lost; "
                                       "close the pipeline and start another to go on"))

    def cancel(self) -> None:
        """Stop writing into the batch: once this returns, the compiled engine writes no more of it (Python
        tasks of a failed job stop at their next check). A job cancels itself at its first failure."""
        with self._lock:
            stops, self._cancel = self._cancel, []
        for stop in stops:
            stop()

    def on_cancel(self, stop: Callable[[], None]) -> None:
        """``stop()`` runs at :meth:`cancel`, or now when the job has already failed."""
        with self._lock:
            if self.error is None:
                self._cancel.append(stop)
                return
        stop()

    def count(self, **values: int) -> None:
        with self._lock:
            for name, value in values.items():
                self.counts[name] += value

    @property
    def failed(self) -> bool:
        return self.error is not None

    def finish(self, n: int = 1, error: BaseException | None = None, **counts: int) -> None:
        """``n`` chunks are in place (or failed with ``error``); ``counts`` are added as by :meth:`count`."""
        self._changed = True
        with self._lock:
            for name, value in counts.items():
                self.counts[name] += value
            first_failure = error is not None and self.error is None
            if first_failure:
                self.error = error
            self._remaining -= n
            failed = self.error is not None
            last = not failed and self._remaining <= 0 and not self._completing
            self._completing = self._completing or last
        if failed:
            self._then = None  # the hook holds the pipeline: no cycle through a failed job
            if first_failure:  # the batch is lost: the engine stops writing it before anyone sees the error
                self.cancel()
            self.done.set()
        elif last:
            self._complete()

    def _complete(self) -> None:
        # nothing left to cancel: the engine's job (which holds a view of the batch, so its slot would look
        # in use) goes, before the hook gives the slot back
        self._cancel = []
        then, self._then = self._then, None  # run once; drop it so the job holds no pipeline
        if then is not None:
            try:
                then(self)
            except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop
                self.error = exc
        self.done.set()


@dataclass
class Target:
    """Where one batch is made: ``out`` (the tensor the decoders fill), the ``slot`` it is delivered from and
    the ``host_slot`` it is assembled in (the same slot on the CPU); ``event``: the CUDA event after its copy."""

    out: torch.Tensor | None
    slot: Slot | None
    host_slot: Slot | None
    event: torch.cuda.Event | None = None


class Executor(Protocol):
    """What the pipeline needs of whatever makes its batches (see the module docstring)."""

    n_slots: int
    host_slots: SlotRing | None  # the slots batches are assembled in, in host memory (None until prepare)

    def check_budget(self, shape: tuple[int, ...], dtype: torch.dtype, transient: int) -> None: ...

    def prepare(self, sample_shape: tuple[int, ...], readers: list[ArrayReader], dtype: torch.dtype) -> None: ...

    @property
    def dtype(self) -> torch.dtype | None: ...

    def plan(self, batch_id: int, samples: Sequence[Sample], open_reader: Callable[[str], ArrayReader]) -> TablePlan: ...

    def acquire(self, plan: TablePlan, closed: Callable[[], bool]) -> Target: ...

    def submit(self, plan: TablePlan, target: Target) -> Job: ...

    def deliver(self, target: Target, rows: int) -> Delivery: ...

    def drop(self, target: Target) -> None: ...

    def held(self) -> int: ...

    def peak_bytes(self) -> int: ...

    def shutdown(self) -> None: ...

    def close(self) -> None: ...

    def threads(self) -> list[threading.Thread]: ...
