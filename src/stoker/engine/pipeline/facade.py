"""``Pipeline``: samples in, equally shaped batches out, in push order, inside a fixed memory budget.

>>> cfg = stoker.Config(batch_size=8, dtype="f32", host_buffer_bytes=256 << 20)
>>> with stoker.Pipeline(cfg) as p:
...     p.push(samples)                      # any iterable of Sample, also an infinite generator
...     for step in range(100):
...         with p.pop() as batch:
...             x = torch.from_dlpack(batch)  # (8, *sample_shape), zero-copy

Samples of named fields (``Sample({"raw": ..., "labels": ...})``) give a :class:`~stoker.FieldBatch` per pop,
field name to that field's batch, each field made by an executor of its own (:mod:`.lanes`).

This module is the public face; the work is split by job: :mod:`.intake` keeps what
was pushed and pulls it lazily, :mod:`.coordinator` runs the thread that plans each
batch (while at most ``lookahead_batches + 1`` are in flight; it then waits for a free
batch slot) and hands it to the executor (:mod:`.executor`: slots and decoding, on
the CPU or staged for a GPU). The consumer's ``pop`` takes batches in push order. Errors are sticky: once ``pop``
raised one, every later ``pop`` and ``push`` raises it again.

A pop hands its batch over as one step: an interrupt (Ctrl-C in ``pop``) leaves the batch for the next pop,
and :meth:`Pipeline.state_dict` counts only batches the consumer received (see :meth:`Pipeline._hand_over`).
A pipeline belongs to the process that made it: in a process forked from it (whose threads are not there)
every call raises :class:`~stoker.ForkedPipeline`, and ``close()`` drops it without touching its threads or
locks. One still open when the interpreter exits is closed first (:mod:`stoker.runtime.lifetime`).

On a CUDA device (``Config(device=local_rank)``, or ``None`` with CUDA available)
each batch is assembled in pinned host memory in its source dtype, copied on a
side stream and cast on the GPU (:mod:`stoker.engine.cuda.transfer`); ``from_dlpack``
makes the consumer's stream wait for it, and ``release(event=...)`` says when the
consumer is done with it.

Locks, outermost first (written once, here and in ``docs/architecture.md``, "Locks and their order"; each lock
names its rank where it is made). A thread holding a lock takes only locks of a higher rank:

1. ``Pipeline._pop_lock``: one consumer at a time, held across a whole pop (the wait for the batch, the
   settle of an engine job, :class:`~stoker.engine.executor.Job`, and the hand-over).
2. ``Pipeline._cond``: the intake and the batches in flight, shared by :class:`.Intake` and
   :class:`.Coordinator` (re-entrant). Under it: stats, the slots (``held``), a resumable source's
   ``state_after``, and ``close`` closing the stores, whose cancelled reads' callbacks run there (rank 4:
   store, budget, pool and job locks).
3. ``CudaTransfer._lock``: a copy against ``close``; held around the copy, the user's transform and the
   host slot's release (rank 4: ``SlotRing._cond``).
4. Every other lock of the engine, storage and runtime (jobs, ``Done``, slot rings, the transient budget
   and its reservations, the native decoder's condition, stats, batches, thread pools, frame buffers, stores,
   caches, the lifetime registry): a leaf, held only around its own fields; it takes no other lock and
   calls no code that could (callbacks, hooks and ``Event.set`` run after it is released).
5. The compiled engine's mutexes (``csrc/``): taken with the GIL released, they never call back into Python.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ...reader.array import ArrayReader
from ...config import Config
from ...errors import ForkedPipeline, InvalidArgument, PoolStarved, ShutdownError, StokerError, as_value
from ...runtime import lifetime
from ...sampling.sample import Sample
from ...storage import LocalStore
from ...device import resolve as devices
from ..batch import Batch
from ..batch import FieldBatch
from .coordinator import Coordinator
from ..choose import make_executor
from ..cpu.executor import CpuExecutor
from ..gpu.streams import CloseWait
from .intake import Intake
from .lanes import Lanes, transform_fields
from ..stats import FIELD_COUNTERS, Stats, StatsRecorder

if TYPE_CHECKING:
    import torch

    from ..executor import Executor


def _made(cfg: Config, device: torch.device, stats: StatsRecorder, store: LocalStore,
          read_ahead: int = 0) -> Executor:
    """The executor of ``cfg`` (``make_executor``), told how far a grid's epoch may be read ahead: an executor
    that reads further (the CPU's ``read_ahead``, granted at its prepare within host_buffer_bytes) takes it,
    another makes ``lookahead_batches`` ahead."""
    executor = make_executor(cfg, device, stats, store)  # looked up now: tests swap it
    # the plain CPU executor's alone: its subclasses' slot counts are other memory (the CUDA path's are device
    # slots, bounded by device_buffer_bytes; the hybrid host part's are pinned), which its grant does not check
    if read_ahead > cfg.lookahead_batches and type(executor) is CpuExecutor and device.type == "cpu":
        executor.read_ahead = read_ahead  # type: ignore[attr-defined]
    return executor


class Pipeline:
    """Turns a stream of :class:`~stoker.Sample` into batches. One per rank; see the module docstring.

    ``read_ahead`` (keyword): batches to make ahead beyond ``cfg.lookahead_batches`` where host memory allows
    (on the CPU; :class:`~stoker.CropDataset` asks for it over a grid's epoch), never fewer than cfg's.
    """

    def __init__(self, cfg: Config, *, read_ahead: int = 0) -> None:
        self._pid = os.getpid()  # the process whose threads serve it (see _check_process)
        if not isinstance(cfg, Config):
            raise InvalidArgument(f"Pipeline needs a stoker.Config, got {type(cfg).__name__}")
        self.cfg = cfg
        self.device = devices.resolve(cfg.device)
        self._stats = StatsRecorder()
        self._store = LocalStore()
        # the slots and the work on them: in host memory, or staged for a GPU (no thread starts before the
        # first batch)
        self._executor = _made(cfg, self.device, self._stats, self._store, read_ahead)
        if cfg.sample_shape is not None and cfg.output_dtype is not None:
            self._executor.check_budget(cfg.sample_shape, cfg.output_dtype, transient=0)
        # lock rank 2 (see the module docstring): guards the intake, the batches in flight and the flags below
        self._cond = threading.Condition()
        self._intake = Intake(cfg, self._cond)
        # samples of named fields: one executor per field (made at the first such batch; see .lanes), made as
        # this one is (a partial, not a closure over self: the coordinator's thread must not keep the pipeline)
        lanes = Lanes(cfg, functools.partial(_made, device=self.device, stats=self._stats, store=self._store,
                                             read_ahead=read_ahead),
                      on_device=self.device.type == "cuda")
        self._coordinator = Coordinator(cfg, self._intake, self._executor, self._stats, self._store, lanes)
        self._error: BaseException | None = None
        self._error_tb: Any = None  # the sticky error's traceback as it came (each re-raise starts from it)
        self._closed = False  # refuses every call from here (set first by close)
        # close's progress: under way, done, and the executors (ids) it stopped and closed so far, so a close an
        # interrupt cut short is finished by the next (see close)
        self._closing = self._close_done = False
        self._stopped: set[int] = set()
        self._shut: set[int] = set()
        self._pop_lock = threading.Lock()  # lock rank 1, the outermost: pop is single-consumer, pops take turns
        # a hand-over under way, or one an interrupt cut short: (its entry, what was received before it, the
        # consumer's thread); see _hand_over
        self._handing: tuple[Any, Any, int] | None = None
        lifetime.track(self, _threads_of, _parked)  # closed at interpreter exit if still open

    # -- what the executor and the coordinator hold (tests and the bench look at them) ------------

    @property
    def _host_slots(self):
        return self._executor.host_slots

    @property
    def _budget(self):
        return self._executor.budget

    @property
    def _thread(self) -> threading.Thread | None:
        threads = self._coordinator.threads()
        return threads[0] if threads else None

    def _executors(self) -> list:
        """Every executor: the one of batches of one box, and those of the fields' lanes (see .lanes)."""
        return [self._executor, *self._coordinator.lanes.executors()]

    def _open(self, uri: str) -> ArrayReader:
        return self._coordinator.open(uri)

    # -- push -------------------------------------------------------------------------------

    def push(self, samples: Sample | Iterable[Sample]) -> None:
        """Queue samples: one Sample, a sequence (checked now), a sharded source (pulled lazily, its
        position tracked for :meth:`state_dict`) or any iterable (pulled lazily, checked then).

        A local array opened by an earlier push and rewritten since (its layout or its decoding changed: shape,
        chunks, dtype, codecs, fill value, a CF attribute such as ``scale_factor``) is opened anew where no batch
        is in flight and the earlier pushes are used up; otherwise the push is an ``InvalidArgument`` (pop every
        batch of the earlier pushes first, or make a new Pipeline). Another attribute written, or a metadata
        file merely touched, is no rewrite: the push goes on.

        >>> p.push([stoker.Sample("a.zarr", ((0, 8), (0, 8)))])
        """
        self._check_process()
        with self._cond:
            self._raise_if_unusable()
        for executor in self._executors():  # a new push reads its files again (csrc/pool.c "Reused")
            if isinstance(executor, CpuExecutor):
                executor.pushed()
        # arrays rewritten since they were opened are looked at (refused while batches of them are in flight),
        # and after drop_used_up the shards found missing too
        self._coordinator.pushed()
        self._intake.push(samples)
        self._coordinator.start()

    def _check_process(self) -> None:
        """ForkedPipeline in a process forked from the one that made this pipeline: its threads are not there,
        and its locks may be held for ever by a thread that was inside them at the fork. Checked before any
        lock is taken."""
        if os.getpid() != self._pid:
            raise ForkedPipeline(
                f"this Pipeline was made in process {self._pid} and is used in process {os.getpid()}, forked from "
                "it: its threads do not run here. Make a new Pipeline in this process (in a DataLoader worker: "
                "in the dataset's __iter__ or in worker_init_fn); close() works here and frees nothing of the "
                "parent's")

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            # from the traceback it came with: a re-raise would otherwise add this call's frames to it, every
            # pop (a loop that catches and pops again grew it without end), each holding its locals
            raise self._error.with_traceback(self._error_tb)
        if self._closed:
            raise ShutdownError("the pipeline is closed")

    @property
    def pending(self) -> int:
        """Pushed samples not yet in a popped batch (generators count as far as they have been pulled)."""
        self._check_process()
        with self._cond:
            self._undo_hand_over()
            return self._intake.pending

    # -- pop --------------------------------------------------------------------------------

    def pop(self, timeout: float | None = None) -> Batch | FieldBatch:
        """The next batch, in push order (a :class:`~stoker.FieldBatch` for samples of named fields). Raises the
        pipeline's (sticky) error, or PoolStarved on timeout.

        One consumer at a time: concurrent calls are serialised. An interrupt (Ctrl-C) inside it leaves the
        batch for the next call.
        """
        self._check_process()
        limit = self.cfg.pop_timeout_s if timeout is None else timeout
        with self._pop_lock:
            batch, handed = self._pop(limit, _deadline(limit))
        handed[0] = True; self._handing = None; return batch  # noqa: E702 - the hand-over's end: see _hand_over

    def _pop(self, limit: float | None, deadline: float | None) -> tuple[Any, list[bool]]:
        t0 = time.perf_counter()
        coordinator = self._coordinator
        collector = _Collector(self._consumer_holds_all)
        while True:
            with self._cond:
                self._raise_if_unusable()
                self._undo_hand_over()
                head = coordinator.head()
                self._intake.flush_if_drained(head is not None)
            if head is not None and head.ready(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))):
                break
            if head is None:
                with self._cond:
                    self._cond.wait(0.01)
                collector.waited()
            if deadline is not None and time.monotonic() >= deadline:
                raise self._starved(limit)
        if head.parts is not None and self.cfg.transform is not None and head.transformed is not True:
            self._transform_fields(head)
        error = head.failure()
        if error is not None:
            with self._cond:
                self._raise_if_unusable()  # closed while we waited: say so rather than what the close caused
                self._error, self._error_tb = error, error.__traceback__  # first: sticky, whatever interrupts
                coordinator.take_head(head)
                self._cond.notify_all()
            head.drop(self._executor)
            del head, collector  # (the traceback keeps this frame: not the failed batch's entry with it)
            raise error
        return self._hand_over(head, t0)

    def _transform_fields(self, head: Any) -> None:
        """Run the transform on a finished batch of fields (first in flight), once, on this (the consumer's)
        thread, before it is handed over; its error becomes the batch's. An interrupt inside it leaves the
        fields part transformed: that batch is then lost (an error for pop) rather than transformed twice."""
        if head.transformed == "running":
            head.error = head.error or StokerError(
                f"batch {head.batch_id} was interrupted while its transform ran on its fields, and is lost; close "
                "the pipeline and start another to go on")
            return
        if head.failure() is not None:
            return
        head.transformed = "running"
        t0 = time.perf_counter()
        try:
            head.ready_after = transform_fields(self.cfg.transform, head.parts, head.rows,
                                              head.parts[0].job.plan.keys)
        except Exception as exc:  # noqa: BLE001 - the batch's error, delivered by this pop
            head.error = as_value(exc)
        head.transformed = True
        self._stats.stage("transform", time.perf_counter() - t0)

    def _hand_over(self, head: Any, t0: float) -> tuple[Batch | FieldBatch, list[bool]]:
        """The finished batch ``head`` (first in flight), taken off the batches in flight and counted as popped,
        and ``handed``: the public caller (``pop``, ``batches``, ``__iter__``) ends the hand-over with
        ``handed[0] = True; self._handing = None`` and returns or yields the batch, in one line with no call.

        A KeyboardInterrupt (or any exception a signal handler raises) lands in the consumer's thread where
        CPython checks for one: entering a function, and after each call, a return from ``_pop`` or a lock's
        release among them. The batch is made first, changing nothing, with its release off until it is
        handed over: an interrupt there leaves ``head`` first in flight for the next pop (the batch made is
        garbage, and gives no slot back). Then, under the condition, ``_handing`` notes the hand-over and what
        was received before it, ``head`` leaves the batches in flight and the intake counts it in one store:
        an interrupt from there to the caller's last line is undone by this thread's next call
        (:meth:`_undo_hand_over`). That line arms the release, clears the note and hands the batch over with
        no point where an interrupt can land. The promise is one consumer thread's (interrupts land on the
        main thread); another thread's pop meanwhile neither undoes this one nor is undone.
        (Stats count an undone batch again when it is popped again. Not covered: an interrupt inside CPython's
        own ``Condition.__enter__`` just after it took the lock, which leaks the lock whatever the caller does.)"""
        if head.parts is not None:
            return self._hand_over_fields(head, t0)
        rows, plan = head.rows, head.job.plan
        view, release, event, stream = self._executor.deliver(head.target, rows)
        handed = [False]
        batch = Batch(view, plan.samples, head.batch_id, _once_handed(release, handed), ready_event=event,
                      ready_stream=stream, keys=plan.keys)
        counts = dict(batches_emitted=1, samples=rows, chunks_needed=plan.chunks_needed,
                      bytes_delivered=view.numel() * view.element_size(), bytes_needed=plan.bytes_needed,
                      **head.job.counts)
        counts["chunk_dedup_hits"] += plan.chunks_needed - plan.n_chunks  # and those shared by batches in flight
        del view, release
        self._popped(head, t0, rows, counts)
        return batch, handed

    def _hand_over_fields(self, head: Any, t0: float) -> tuple[FieldBatch, list[bool]]:
        """:meth:`_hand_over` for a batch of samples of named fields: a Batch per field, each of its lane's
        slot, all armed by the one ``handed`` flag, in a :class:`~stoker.FieldBatch`; counted once, every
        field's bytes and chunks in its counts."""
        rows, handed = head.rows, [False]
        ready_event, ready_stream = head.ready_after
        batches = {}
        counts = dict(batches_emitted=1, samples=rows, chunks_needed=0, chunk_dedup_hits=0, bytes_delivered=0,
                      bytes_needed=0)
        fields: dict[str, dict[str, int]] = {}  # each field's own (Stats.fields): its lane's chunks alone
        for part in head.parts:
            plan = part.job.plan
            view, release, event, stream = part.executor.deliver(part.target, rows)
            batches[part.name] = Batch(view, plan.samples, head.batch_id, _once_handed(release, handed),
                                       ready_event=event if ready_event is None else ready_event,
                                       ready_stream=stream if ready_stream is None else ready_stream,
                                       keys=plan.keys)
            own = dict(chunks_needed=plan.chunks_needed, bytes_delivered=view.numel() * view.element_size(),
                       bytes_needed=plan.bytes_needed, **part.job.counts)
            own["chunk_dedup_hits"] += plan.chunks_needed - plan.n_chunks
            for name, value in own.items():
                counts[name] = counts.get(name, 0) + value
            fields[part.name] = {k: own[k] for k in FIELD_COUNTERS}
            del view, release
        batch = FieldBatch(batches, head.samples, head.batch_id, sample_keys=head.parts[0].job.plan.keys)
        self._popped(head, t0, rows, counts, fields)
        return batch, handed

    def _popped(self, head: Any, t0: float, rows: int, counts: dict, fields: dict | None = None) -> None:
        """The hand-over's one step under the condition (see :meth:`_hand_over`): ``head`` leaves the batches in
        flight and is counted as received, with ``_handing`` noting it for an interrupt to undo."""
        intake = self._intake
        with self._cond:
            self._raise_if_unusable()  # closed while we waited: the batch may be incomplete
            # from here an interrupt is undone by this thread's next call
            self._handing = (head, intake.received_now(), threading.get_ident())
            self._coordinator.take_head(head)
            intake.popped(head.source_ids, rows)
            self._stats.stage("pop_wait", time.perf_counter() - t0)
            self._stats.add(fields, **counts)
            self._cond.notify_all()

    def _undo_hand_over(self) -> None:
        """Under the condition: put back the batch of a hand-over an interrupt cut short, as if it had not
        begun: first in flight again, and not received. Every step may be done twice (an interrupt here
        leaves the rest to the next call)."""
        if self._handing is None or self._handing[2] != threading.get_ident():
            return
        head, received, _ = self._handing
        self._coordinator.put_back(head)
        self._intake.put_back(received)
        self._handing = None

    def _starved(self, limit: float) -> PoolStarved:
        """The PoolStarved error of a ``pop`` that waited ``limit`` seconds: its ``consumer_holds_all`` says
        whether the consumer holds every slot (CropDataset adds what a DataLoader does to that)."""
        with self._cond:
            n_slots = self._executor.n_slots
            if self._consumer_holds_all():
                return PoolStarved(
                    f"no batch within pop_timeout_s={limit}: the consumer holds all {n_slots} batch slots. "
                    "Release batches (use `with p.pop() as batch:`), drop tensors made from old batches, or "
                    "keep data with `.clone()`.", consumer_holds_all=True)
        return PoolStarved(self._starved_message(limit), consumer_holds_all=False)

    def _starved_message(self, limit: float) -> str:
        with self._cond:
            in_flight = self._coordinator.in_flight()
            why = self._intake.starved_reason(in_flight > 0)
            if why is not None:
                return f"no batch within pop_timeout_s={limit}: {why}"
            return (f"no batch within pop_timeout_s={limit}: {in_flight} batches in flight; storage or "
                    "decoding is slower than the timeout (raise pop_timeout_s or check p.stats())")

    def _consumer_holds_all(self) -> bool:
        """Whether the consumer holds every batch slot of an executor (a lane's, for fields), released or not:
        no batch can be made until a view of one dies. Slots of batches still in flight are not the consumer's:
        with all of them in flight (slow or hung storage) it holds none and has nothing to release."""
        with self._cond:
            coordinator = self._coordinator
            return any(e.dtype is not None and e.held() - coordinator.slots_in_flight(e) >= e.n_slots
                       for e in self._executors())

    def batches(self, n: int) -> Iterator[Batch | FieldBatch]:
        """Yield ``n`` batches (each released when the next is requested)."""
        limit = self.cfg.pop_timeout_s
        for _ in range(n):
            self._check_process()
            with self._pop_lock:
                batch, handed = self._pop(limit, _deadline(limit))
            handed[0] = True; self._handing = None  # noqa: E702 - the hand-over's end: see _hand_over
            try:
                yield batch
            finally:
                batch.release()

    def __iter__(self) -> Iterator[Batch | FieldBatch]:
        """Yield batches until the pushed samples are used up (a final short batch only with drop_last=False,
        or always for a source whose epochs are delivered whole: a TileGrid's).

        Each wait for the next batch is bounded by ``pop_timeout_s``, as :meth:`pop` is.
        """
        limit = self.cfg.pop_timeout_s
        while True:
            self._check_process()
            deadline = _deadline(limit)
            with self._pop_lock:
                if not self._wait_for_work(limit, deadline):
                    return
                batch, handed = self._pop(limit, deadline)
            handed[0] = True; self._handing = None  # noqa: E702 - the hand-over's end: see _hand_over
            try:
                yield batch
            finally:
                batch.release()

    def _wait_for_work(self, limit: float | None, deadline: float | None) -> bool:
        """True once a batch is in flight; False when nothing more can come from what was pushed.
        PoolStarved past ``deadline`` (the coordinator may be waiting for a slot the consumer holds)."""
        intake, coordinator = self._intake, self._coordinator
        collector = _Collector(self._consumer_holds_all)
        while True:
            with self._cond:
                self._raise_if_unusable()
                self._undo_hand_over()
                if coordinator.head() is not None:
                    return True
                if not intake.more_to_come():
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    break
                self._cond.wait(0.05)
            collector.waited()
        raise self._starved(limit)

    # -- resumption -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The position of every resumable pushed source as of the last **popped** batch.

        Batches prepared ahead (the lookahead) do not count, so a checkpoint written
        after training step k resumes with batch k + 1 exactly::

            state = p.state_dict()                       # {"sources": [...], "batches": k}
            source.load_state_dict(state["sources"][0])  # later, possibly on another world size

        ``"sources"`` holds one position per resumable push, in push order: a loop that pushes its source
        again each epoch (``set_epoch`` then ``push``) resumes from the last, ``state["sources"][-1]``.
        """
        self._check_process()
        with self._cond:
            self._undo_hand_over()
            return self._intake.state_dict()

    def drop_used_up(self) -> int:
        """Forget the pushes so far once they are used up (the pipeline's iteration ended): the samples pulled
        from them that do not fill a batch (``drop_last=True`` drops them at the end), which would otherwise
        open the next push's first batch, and their positions: ``state_dict()["sources"]`` then lists only
        pushes made after this call. Local arrays rewritten before the next push (their metadata files changed
        since they were opened) are opened anew by its batches, and shards found not stored are looked for
        again, as a new pipeline would (a pipeline pushed again without this call keeps the shards it found
        missing; an array rewritten meanwhile is opened anew by any push made with no batch in flight, and
        refused by one made with batches in flight). For a
        loop that keeps one pipeline across epochs and wants each epoch's batches to be its own, as
        :class:`~stoker.CropDataset` with ``persistent=True`` does. Returns the samples dropped;
        ``InvalidArgument`` while a push still has samples to give or a batch is in flight.

        >>> for batch in p: ...                     # epoch 0 of a source of 30 samples, batches of 8
        >>> p.drop_used_up()                        # 6: fewer than a batch, not mixed into epoch 1
        >>> source.set_epoch(1); p.push(source)
        """
        self._check_process()
        with self._pop_lock, self._cond:
            self._raise_if_unusable()
            self._undo_hand_over()
            busy = self._coordinator.in_flight()
            if busy or not self._intake.drained():
                raise InvalidArgument(
                    f"drop_used_up() while {f'{busy} batches are in flight' if busy else 'a push has samples to give'}"
                    ": call it once the pipeline's iteration has ended (every batch popped)")
            self._coordinator.used_up()  # the next push opens anew the local arrays rewritten meanwhile
            return self._intake.drop_used_up()

    # -- stats and lifetime -----------------------------------------------------------------

    def stats(self) -> Stats:
        self._check_process()
        return self._stats.snapshot(peak_host_bytes=sum(e.peak_bytes() for e in self._executors()))

    def stats_reset(self) -> None:
        self._check_process()
        self._stats.reset()

    def close(self) -> None:
        """Cancel in-flight work and stop threads. Idempotent.

        Returns in milliseconds when the threads end at their next step and the device keeps up. The waits
        are bounded: a second for the coordinator's thread; then, for all the executors together (one
        :class:`~stoker.engine.gpu.streams.CloseWait`, whatever the number of fields), a second for the GPU
        decode's threads and, once the first executor waits for its device streams,
        :data:`~stoker.engine.gpu.streams.CLOSE_WAIT_S` (2 s) for the streams of all of them: about 4 s at
        most on a hung device (or a consumer stream still busy), which one warning names (the buffers its
        streams may use are kept until their work is done, not freed under it); one executor's error still
        closes the others and the store, then is raised; the CUDA copies of a pipeline decoding on the CPU (``decode_on="cpu"`` on a GPU) are waited
        for until the same deadline. The CPU engine's threads are waited for a quarter of a second at its
        shutdown.

        In a process forked from the one that made the pipeline it only drops it (see :meth:`_forget`).

        An interrupt (Ctrl-C) in the wait for the coordinator still closes the executors and the store before
        it is raised, and a close an interrupt cut short anywhere is finished by the next ``close()`` (yours,
        ``__del__``'s or the exit hook's), not taken for done."""
        if os.getpid() != self._pid:
            self._forget()
            return
        with self._cond:
            if self._close_done or self._closing:  # done, or under way on another thread
                return
            self._closed = self._closing = True
            try:
                self._coordinator.close()
            except BaseException:
                self._closing = False  # the next close does it again
                raise
        try:
            self._close_rest()
        finally:
            self._closing = False  # (a plain store: no lock an interrupt could leave taken)

    def _close_rest(self) -> None:
        """:meth:`close` after the coordinator was told to stop: each step is done once, those an interrupt cut
        short again at the next close. Sets ``_close_done`` once every executor and the store are closed."""
        for executor in self._executors():
            if id(executor) not in self._stopped:
                executor.shutdown()
                self._stopped.add(id(executor))
        try:
            self._coordinator.join(1.0)
        finally:  # an interrupt in the wait: the executors and the store still close, then it is raised
            # one wait for the threads and device streams of every executor, and one warning for those not
            # done: a hung device holds the close CLOSE_WAIT_S once, not once per field
            wait = CloseWait({id(lane.executor): f"field {lane.name!r}" for lane in self._coordinator.lanes})
            errors, cut = [], False
            try:
                for executor in self._executors():
                    if id(executor) in self._shut:
                        continue
                    try:  # (one executor's error closes the others still, then the store, then it is raised)
                        if id(executor) not in self._stopped:  # a field's lane made by a launch under way
                            executor.shutdown()
                            self._stopped.add(id(executor))
                        if getattr(executor, "shares_close_wait", False):  # the GPU decode's and the hybrid's
                            executor.close(wait)
                        else:
                            executor.close()
                        self._shut.add(id(executor))
                    except Exception as exc:  # noqa: BLE001 - raised below, once the rest is closed
                        errors.append(exc)
                        self._shut.add(id(executor))  # failed, not cut short: not closed again
                    except BaseException as exc:  # noqa: BLE001 - an interrupt: the next close does it again
                        errors.append(exc)
                        cut = True
            finally:
                try:
                    self._store.close()
                finally:
                    wait.warn()
            self._close_done = not cut
            if errors:
                raise errors[0]

    def _forget(self) -> None:
        """Close in a process forked from the pipeline's: its threads are the parent's and do not run here,
        and a lock one of them held at the fork is held for ever here, so nothing is stopped, joined or
        locked. The executor and coordinator are dropped; the compiled engine's objects made in the parent
        leave its memory as it is (csrc/pool.c, "Fork"), and so do its thread pools (DaemonPool)."""
        self._closed = True
        self._executor = self._coordinator = None  # type: ignore[assignment]

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


#: how long a consumer waits for a batch while it holds every slot, released or not, before Python's garbage
#: collector is run (a view may be held by a reference cycle alone), then twice as long after each collection
COLLECT_AFTER_S = 0.25


class _Collector:
    """Runs a garbage collection for a consumer kept waiting because it holds every batch slot.

    A released slot is reused once no tensor views it; a view may be held by garbage alone (a reference
    cycle: an exception kept with its traceback, whose frames hold a batch), which only Python's collector
    frees, and a process that only waits does not run it. The consumer, blocked in ``pop``, is then the one
    to run it: after :data:`COLLECT_AFTER_S` of such a wait, then after twice as long each time. Nothing
    runs while batches flow, or while the wait is for storage or decoding."""

    def __init__(self, consumer_holds_all: Any) -> None:
        self.consumer_holds_all = consumer_holds_all  # Pipeline._consumer_holds_all
        self.since = time.monotonic()
        self.after = COLLECT_AFTER_S

    def waited(self) -> None:
        now = time.monotonic()
        if now - self.since < self.after:
            return
        if self.consumer_holds_all():
            gc.collect()
            self.after *= 2
        self.since = time.monotonic()


def _once_handed(release: Any, handed: list[bool]) -> Any:
    """A batch's release that gives its slot back only once ``handed[0]``: a batch made by a pop that was
    interrupted before handing it over must not free the slot its entry, still in flight, is delivered from."""
    def give_back(waits: Any) -> None:
        if handed[0]:
            release(waits)
    return give_back


def _threads_of(p: Pipeline) -> list[threading.Thread]:
    """The threads a pipeline started (the exit hook waits for them after closing it)."""
    if p._coordinator is None:
        return []
    return [t for e in p._executors() for t in e.threads()] + p._coordinator.threads()


def _parked(p: Pipeline) -> list[threading.Thread]:
    """After a close: the coordinator's thread if it is still inside the user's sample source (``next()`` of a
    pushed iterable), where the close's second of waiting left it: a source that blocks (a queue whose producer
    died) may never return, and once it does the thread ends at its next look (the pipeline is closed)."""
    if p._coordinator is None or not p._intake.in_source:
        return []
    return p._coordinator.threads()


def _deadline(limit: float | None) -> float | None:
    """When a wait of ``limit`` seconds (None: unbounded) that starts now ends, on the monotonic clock."""
    return None if limit is None else time.monotonic() + limit


def host_slot_bytes(pipeline: Pipeline) -> int:
    """Bytes of ``pipeline``'s host batch slots (pinned staging on a GPU; every field's for samples of named
    fields; 0 before its first batch): what
    ``stoker bench`` reports as a CUDA pipeline's pinned memory.

    >>> with stoker.Pipeline(cfg) as p:
    ...     p.push(samples); p.pop().release()
    ...     host_slot_bytes(p)
    """
    rings = [e.host_slots for e in pipeline._executors()]  # samples of fields: every lane's
    return sum(ring.nbytes for ring in rings if ring is not None)
