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

import enum
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
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
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


class JobState(enum.Enum):
    """Where a :class:`Job` is in its life (see :class:`Job` for the transitions and who makes each)."""

    RUNNING = "running"  # chunks are being placed; the thread that places the last one finishes the batch
    SETTLING = "settling"  # the engine's job, done, claimed by one waiter, which has not changed the job yet
    APPLYING = "applying"  # that waiter is applying the engine's results: an interrupt now loses the batch
    COMPLETING = "completing"  # every chunk is in place; its finisher runs the hook
    DONE = "done"  # complete (``done`` is set, or is being set by the finisher)
    FAILED = "failed"  # lost, with ``error`` (``done`` is set by the thread that failed it)


RUNNING, SETTLING, APPLYING, COMPLETING, DONE, FAILED = JobState  # read per chunk: module names, no lookup


class JobStateError(StokerError, RuntimeError):
    """A transition :class:`Job` refuses: a bug of the executor that asked for it (more chunks reported than
    the batch has, a job taken over twice...), never the user's; the message names the job's state."""


class Job:
    """One batch in flight, a small state machine (:class:`JobState`) whose every transition is one method
    under the job's lock, and whose batch one thread finishes (runs ``then``, sets ``done``):

    ======================  =================================  ==================================================
    from                    to                                 by (who then owns the batch)
    ======================  =================================  ==================================================
    RUNNING                 COMPLETING, then DONE or FAILED    :meth:`finish` of the last chunk: that thread runs
                                                               ``then(job)`` (its exception is the job's error)
    RUNNING                 SETTLING                           :meth:`wait`: the first waiter that finds the
                                                               engine's job done (see :meth:`settled_by`)
    SETTLING                APPLYING                           its settle entering :meth:`finish`
    SETTLING                RUNNING                            :meth:`take_over` by the thread the settle handed
                                                               the job to (which then owns it), or an interrupt
                                                               (:meth:`_interrupted`: the next waiter settles it
                                                               again, and the hand-off it made is stale)
    APPLYING                COMPLETING, FAILED                 :meth:`finish`, as from RUNNING (an interrupt:
                                                               FAILED, the batch lost)
    RUNNING, APPLYING       FAILED                             the first :meth:`finish` with an error: its thread
                                                               cancels the rest and sets ``done``; later chunks
                                                               are only counted
    RUNNING, SETTLING,      FAILED                             :meth:`abandon` (another field of the batch failed,
    APPLYING                                                   or a service thread's fault): its thread cancels
                                                               the rest and sets ``done``; a settle or a taker
                                                               then finds it FAILED (:meth:`take_over`: False)
    ======================  =================================  ==================================================

    DONE and FAILED are final; a :meth:`finish` after COMPLETING or DONE (more chunks than the batch has) and
    every other transition asked for are refused with :class:`JobStateError`. ``then(job)``, if given, runs
    once every chunk is in place (on the thread that placed the last one) and before ``done`` is set.

    A job made by the compiled engine alone, with no ``then``, is settled by whoever waits for it
    (:meth:`settled_by`): its wait is the engine's, in C without the GIL, and the first waiter that sees the
    engine done reads the results (a few calls, once), instead of a thread of ours waking to do it and then
    waking the waiter.

    >>> job = Job(plan, out, 2)
    >>> job.finish(); job.state, job.done.is_set()
    (<JobState.RUNNING: 'running'>, False)
    >>> job.finish(); job.state, job.done.is_set()
    (<JobState.DONE: 'done'>, True)
    """

    def __init__(self, plan: TablePlan, out: torch.Tensor | None, n_chunks: int,
                 then: Callable[["Job"], None] | None = None) -> None:
        self.plan = plan
        self.out = out
        # made when first asked for: the engine's batches never need it
        self._out_np: np.ndarray | None | _Unset = _UNSET
        # ``out`` is a float32 work slot rounded into float16 next, untransformed: float64 chunks and fill
        # values go in as cast.half_exact says (copy_cast's half_next), so the batch is rounded once
        self.half_next = False
        self.done = Done()
        self.error: BaseException | None = None
        self._state = RUNNING
        self._remaining = n_chunks
        self._then = then
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py): every transition
        self._cancel: list[Callable[[], None]] = []  # what cancel() stops (the engine's job)
        self._engine: EngineJob | None = None  # the engine's job, while RUNNING and unclaimed (see settled_by)
        self._settle: Callable[["Job", EngineJob], None] | None = None  # settle(job, engine job): see settled_by
        self._claims = 0  # how many waiters claimed it (RUNNING -> SETTLING): names each claim's hand-off
        # read/decode counters of this batch, added to Stats when it is popped, so every counter
        # describes the same delivered batches (work done ahead is not lost to stats_reset())
        # (chunk_dedup_hits here: chunks another batch in flight decoded for this one too, csrc/pool.c)
        self.counts = {"bytes_read": 0, "bytes_decoded": 0, "chunks_decoded": 0, "chunk_dedup_hits": 0,
                       "bytes_to_device": 0, "bytes_to_device_host": 0}
        if n_chunks == 0:
            self._state = COMPLETING
            self._complete()

    @property
    def state(self) -> JobState:
        """Where the job is now (see the class docstring)."""
        return self._state

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
        ``wait(timeout)`` releases the GIL); ``settle`` finishes the job (or hands it on, :meth:`take_over`).
        Only for a RUNNING job with no hook and no settle yet: the settle is then its only finisher."""
        with self._lock:
            if self._state is not RUNNING or self._engine is not None or self._then is not None:
                raise JobStateError(f"a {self._state.value} job (hook: {self._then is not None}, settle: "
                                    f"{self._engine is not None}) cannot be left to its waiter to settle")
            self._settle, self._engine = settle, engine_job

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        engine = self._engine
        if engine is not None:
            if not gil.released(engine.wait, timeout):
                return False
            settle = None
            try:
                # RUNNING -> SETTLING: the first waiter to see it done claims it; the others wait for it below.
                # Claimed in this frame, not a call, so an interrupt cannot come between the claim and `settle`.
                with self._lock:
                    if self._state is RUNNING and self._engine is not None:
                        settle, self._settle, self._engine, self._state = self._settle, None, None, SETTLING
                        self._claims += 1
                if settle is not None:
                    settle(self, engine)
            except BaseException:
                if settle is not None:  # claimed: put back unless it had begun (see _interrupted)
                    self._interrupted(settle, engine)
                raise
            del engine, settle
        return self.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    @property
    def claim(self) -> int:
        """The current claim (read by the settle, to hand the job on with: :meth:`take_over`)."""
        return self._claims

    def take_over(self, claim: int) -> bool:
        """SETTLING -> RUNNING: the thread a settle handed the job to, unchanged, with its ``claim``, takes it
        and owns it from then on (finishes it). False for a stale hand-off, which that thread drops: the
        settle was interrupted and the job put back for its waiters (then perhaps claimed again), or the job
        was abandoned (FAILED, finished already). So an interrupt anywhere in a settle that hands the job on
        neither loses the batch nor finishes it twice."""
        with self._lock:
            state = self._state
            if self._claims != claim or (state is RUNNING and self._engine is not None):
                return False  # claimed again since, or put back for the waiters
            if state is FAILED:  # abandoned while handed off (another field of its batch failed): finished
                return False
            if state is not SETTLING:
                raise JobStateError(f"a {state.value} job cannot be taken over: only a settling one, once, before "
                                    "its settle changed it")
            self._state = RUNNING
            return True

    def _interrupted(self, settle: Callable[["Job", EngineJob], None], engine: EngineJob) -> None:
        """After ``settle`` raised past its own error handling (a KeyboardInterrupt lands on the main thread,
        often the consumer's): SETTLING (it had not begun to change the job) goes back to RUNNING and the next
        wait settles it again (a hand-off it made is stale: :meth:`take_over`); COMPLETING, DONE and FAILED (a
        settled job has no hook) are finished here; a job taken over (RUNNING) is its new owner's; APPLYING
        (it was changing the job) fails: the batch is
        lost, as an error for pop, rather than waited for forever."""
        with self._lock:
            state = self._state
            if state is SETTLING:
                self._state, self._settle, self._engine = RUNNING, settle, engine
                return
            if state is COMPLETING:
                self._state = DONE
        if state is RUNNING:
            return
        if state is APPLYING:
            self.finish(0, StokerError("this batch was interrupted while it was being handed over, and is lost; "
                                       "close the pipeline and start another to go on"))
        else:
            self.done.set()

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
        """``n`` chunks are in place (or failed with ``error``); ``counts`` are added as by :meth:`count`.
        Called per chunk on the Python path: keep it short."""
        with self._lock:
            # SETTLING -> APPLYING, under the lock: an abandon (another field failed, a finisher's fault) may
            # fail the settling job at any moment, and a store after its check would undo that (DONE with an
            # error). First here, so an interrupt anywhere below counts as begun; one before it changed nothing.
            if self._state is SETTLING:
                self._state = APPLYING
            for name, value in counts.items():
                self.counts[name] += value
            self._remaining -= n
            state = self._state
            if state is FAILED:  # lost already: later chunks are only counted
                return
            if state is COMPLETING or state is DONE:
                raise JobStateError(f"a {state.value} job of {self.plan.n_chunks} chunks was told of {n} more "
                                    f"(error: {error!r}): a chunk was reported twice")
            if error is None:
                if self._remaining > 0:
                    return
                self._state = COMPLETING  # RUNNING or APPLYING -> COMPLETING: this thread finishes the batch
            else:
                self.error, self._state = error, FAILED  # RUNNING or APPLYING -> FAILED
        if error is None:
            self._complete()
            return
        self._then = None  # the hook holds the pipeline: no cycle through a failed job
        self.cancel()  # the batch is lost: the engine stops writing it before anyone sees the error
        self.done.set()

    def abandon(self, error: BaseException) -> bool:
        """Fail the job with ``error`` unless it is past placing its chunks (COMPLETING, DONE) or failed already:
        the other fields of a batch whose one field failed are stopped so (:meth:`finish` would take a late
        stop of a completing job for a chunk reported twice). True when this call failed it."""
        with self._lock:
            if self._state in (COMPLETING, DONE, FAILED):
                return False
            self.error, self._state = error, FAILED
        self._then = None
        self.cancel()
        self.done.set()
        return True

    def _complete(self) -> None:
        """COMPLETING -> DONE or FAILED, on the thread that made it COMPLETING: the hook, then ``done``."""
        # nothing left to cancel: the engine's job (which holds a view of the batch, so its slot would look
        # in use) goes, before the hook gives the slot back
        self._cancel = []
        then, self._then = self._then, None  # run once; drop it so the job holds no pipeline
        error = None
        if then is not None:
            try:
                then(self)
            except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop
                error = exc
        with self._lock:
            if error is not None:
                self.error = error
            self._state = DONE if error is None else FAILED
        self.done.set()


@dataclass
class Target:
    """Where one batch is made: ``out`` (the tensor the decoders fill), the ``slot`` it is delivered from and
    the ``host_slot`` it is assembled in (the same slot on the CPU); ``event``: the CUDA event after its copy.

    Two optional hooks, honoured by the GPU-decode executor (the hybrid executor, :mod:`.hybrid`, composes it
    so): ``before(batch)`` runs on the executor's thread (on its CUDA stream) before any chunk of the batch is
    written, with the tensor the batch is assembled in (it may queue writes the chunks then land over, or
    raise: the batch's error); ``then(job)`` runs once the batch is complete, before its job is done."""

    out: torch.Tensor | None
    slot: Slot | None
    host_slot: Slot | None
    event: torch.cuda.Event | None = None
    before: Callable[[torch.Tensor], None] | None = None
    then: Callable[["Job"], None] | None = None


class SlotsDelivery:
    """``dtype`` and ``held`` of an :class:`Executor` that hands its batches out of ``self.slots`` (None until
    ``prepare`` makes the ring), for executors to inherit."""

    slots: SlotRing | None

    @property
    def dtype(self) -> torch.dtype | None:
        """The batches' dtype once the slots exist."""
        return self.slots.dtype if self.slots is not None else None

    def held(self) -> int:
        """Slots a consumer still holds."""
        return self.slots.held() if self.slots is not None else 0


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

    def forget(self, readers: list[ArrayReader]) -> None: ...

    def peak_bytes(self) -> int: ...

    def shutdown(self) -> None: ...

    def close(self) -> None: ...

    def threads(self) -> list[threading.Thread]: ...
