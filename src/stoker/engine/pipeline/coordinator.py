"""A pipeline's coordinator thread: pulls samples when there is room, plans and launches one batch at a time.

There is room when at most ``lookahead_batches + 1`` batches (one per slot) are in flight and the intake has
samples (the batch planned then waits for a free slot, see :meth:`Coordinator._cycle`); a launch opens the batch's arrays
(cached per pipeline), settles its dtype and the executor's buffers from their metadata (so a crop too large
for ``host_buffer_bytes`` is refused before its plan is built), plans it, waits for a slot and submits it (batches of remote arrays are planned further ahead, their chunks
prefetched while they wait: :mod:`.prefetch`). Batches are in flight in push order; a batch that could not be planned,
or a source's error, rides in its place as an error for ``pop`` to raise.

The thread holds the coordinator, never the pipeline, so a pipeline nobody closed can still be collected
(its ``__del__`` closes it).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from ...runtime import gil
from ...runtime.workers import DaemonPool, start_thread, when_all_done
from ...reader.array import (DEFAULT_INDEX_CACHE_BYTES, ArrayReader, index_size, open_array, open_local,
                             read_metadata)
from ...reader.coords import check_channel_dimensions, coding
from ...reader.metacache import stat_document
from ...reader.ome import is_label_level
from ...storage.cache import SizedLRU
from ...config import Config
from ...errors import BudgetExceeded, DtypeMismatch, InvalidArgument, NotYetSupported, ShutdownError, StokerError
from ...sampling.sample import Sample, parts
from ...storage import LocalStore
from ...storage.local import identity
from ...storage.locate import Stores, locate, options_for
from ...storage.uri import REMOTE_SCHEMES
from ...zarr.box import check_in_bounds
from ...zarr.metadata import ArrayMetadata
from ..cast import HALF_EXACT_UP_TO, batch_dtype
from ..cpu import native
from ..cpu.cf import check_output, packed
from ..executor import Executor, Job, Target
from .intake import Intake, Staged
from .lanes import Lanes, Part, in_field
from .prefetch import Ahead, Revalidated, indexes_ahead, revalidate_ahead
from ..stats import StatsRecorder

_MAX_OPEN_ARRAYS = 16384
# readers evicted from the open arrays told to the executors together (each tells scans their kept descriptions)
_FORGET_EVICTED_AT = 64
# remote arrays opened together (threads waiting on their metadata): the batches pulled at once, eight of eight
# samples each of an array of its own, in one round trip (sixteen made a stream of new arrays at 100 ms a request
# wait 24 ms a batch for its opens: scenario 6, 94-106 samples/s against 120-135 with 64); per I/O thread
# (Config.n_io_threads), so that the knob the thread-start error names sets their count: 64 at the default 4
_OPENS_PER_IO_THREAD = 16
_CONFIG = object()  # _batch_dtype's default: the Config's output dtype
_PULL_AHEAD = 8  # batches of remote arrays pulled at once: their arrays not open yet are opened together
_SLOT_POLL_S = 0.01  # how often a coordinator waiting for prefetch room or a slot looks for a free slot
# the longest a coordinator with nothing to do sleeps: a bound, not a poll (a push, a pop and the close notify
# the condition); waking every 0.1 s to look cost an idle pipeline 1.5 ms of CPU a second
_IDLE_WAIT_S = 1.0


class Entry:
    """A batch in flight: a running job, or an error to deliver in its place. A batch of samples of named
    fields has no job of its own but ``parts``, one job and target per field (:mod:`.lanes`), and its
    ``samples``; ``transformed``: None, "running" or True (its transform, run at pop, see
    :func:`~.lanes.transform_fields`), and ``ready_after``: the (event, stream) after that transform."""

    __slots__ = ("job", "target", "error", "batch_id", "rows", "source_ids", "parts", "samples", "transformed",
                 "ready_after")

    def __init__(self, batch_id: int, rows: int, job: Job | None = None, target: Target | None = None,
                 error: BaseException | None = None) -> None:
        self.batch_id, self.rows, self.job, self.target, self.error = batch_id, rows, job, target, error
        self.source_ids: list[int] = []
        self.parts: list[Part] | None = None
        self.samples: tuple[Sample, ...] = ()
        self.transformed: str | bool | None = None
        self.ready_after: tuple = (None, None)

    def ready(self, timeout: float) -> bool:
        if self.parts is None:
            return self.job is None or self.job.wait(timeout)
        # every field's job done, or one failed (the batch fails with it: the others need not finish)
        deadline = time.monotonic() + timeout
        for part in self.parts:
            if not part.job.wait(max(0.0, deadline - time.monotonic())):
                return any(p.job.failed for p in self.parts)
        return True

    def failure(self) -> BaseException | None:
        """The error to deliver for this batch, once ready: its own, its job's, or the first failed field's
        (named; the other fields' jobs are then stopped, so none writes into a slot given back)."""
        if self.error is not None or self.parts is None:
            return self.error or (self.job.error if self.job else None)
        failed = next((p for p in self.parts if p.job.error is not None), None)
        if failed is None:
            return None
        self.error = in_field(failed.job.error, failed.name)
        for p in self.parts:
            if not p.job.done.is_set():  # a field still being made, or completing (abandon leaves that one be)
                p.job.abandon(ShutdownError(f"the batch's field {failed.name!r} failed: field {p.name!r} was "
                                            "stopped", field=p.name))
        return self.error

    def drop(self, executor: Executor) -> None:
        """Give back the slots of a failed batch (``executor``'s, or each field's lane's)."""
        if self.parts is None:
            if self.target is not None:
                executor.drop(self.target)
            return
        for p in self.parts:
            p.executor.drop(p.target)


class Coordinator:
    """The batches in flight (in push order) and the thread that launches them. The pipeline asks about them
    under its condition through methods (:meth:`head`, :meth:`take_head`, :meth:`put_back`...)."""

    def __init__(self, cfg: Config, intake: Intake, executor: Executor, stats: StatsRecorder,
                 store: LocalStore, lanes: Lanes) -> None:
        self.cfg = cfg
        self._open_at_once = _OPENS_PER_IO_THREAD * cfg.n_io_threads  # the opener threads, at most
        self.lanes = lanes  # samples of named fields: one executor per field, made at the first such batch
        self.intake = intake
        self.cond = intake.cond
        self.executor = executor
        self.stats = stats
        self.store = store
        self.inflight: collections.deque[Entry] = collections.deque()
        self.closed = False
        self.thread: threading.Thread | None = None
        self._batch_ids = itertools.count()
        self._index_cache = SizedLRU(DEFAULT_INDEX_CACHE_BYTES, index_size)
        self._readers: SizedLRU = SizedLRU(_MAX_OPEN_ARRAYS, lambda _: 1, evicted=self._evicted)
        self._dropped: list[ArrayReader] = []  # readers evicted, not told to the executors yet (see _evicted)
        self._dropped_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._channels_checked: set[tuple[str, ...]] = set()  # groups of channels whose dimensions agree
        self._used_up = False  # the pushes so far were used up (Pipeline.drop_used_up): the next push checks them
        self._dtypes: dict = {}  # the batch dtype of each source dtype (numpy's), as batch_dtype settles it
        # batches planned, waiting for a slot, their remote chunks prefetched meanwhile (see .prefetch)
        self.ahead = Ahead(cfg, self._wake)
        self._pulled: collections.deque[tuple[list[Staged], BaseException | None]] = collections.deque()
        # remote stores of this pipeline's arrays, closed with it; their requests capped together
        self.stores = Stores(cfg.requests_in_flight, cache=cfg.cache, prefetch=self.ahead.buffer,
                             read_files=native.read_files)
        self._openers: DaemonPool | None = None  # the threads remote arrays are opened on (see _start_opens)
        self._opening: dict[str, concurrent.futures.Future] = {}  # uri -> its open in flight there
        self._opening_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)

    def _wake(self) -> None:
        """Requests of the prefetch buffer ended (on the stores' event loop): a coordinator waiting for room
        to plan may go on. Never blocks that loop, and so takes the condition (rank 2) out of order safely: if
        it is busy, the waiter's timeout (``_SLOT_POLL_S``) wakes it."""
        if self.cond.acquire(blocking=False):
            try:
                self.cond.notify_all()
            finally:
                self.cond.release()

    def _lookahead(self) -> int:
        """Batches made ahead: cfg's, or more where an executor reads further (CpuExecutor.lookahead, raised
        at its prepare for a grid's epoch; the most of a pipeline's lanes)."""
        executors = [self.executor, *self.lanes.executors()]
        return max(getattr(e, "lookahead", self.cfg.lookahead_batches) for e in executors)

    def _slot_free(self) -> bool:
        """Whether a batch slot is free now (none is while every one is in flight or held by the consumer)."""
        return self.executor.held() < self.executor.n_slots

    def open(self, uri: str) -> ArrayReader:
        """The array at ``uri``, opened once per pipeline (metadata and shard indexes cached)."""
        return self._readers.get_or_load(uri, lambda: self._load(uri))

    def _evicted(self, readers: list[ArrayReader]) -> None:
        """Readers the open arrays' bound evicted (on the thread that opened another): the executors are told,
        :data:`_FORGET_EVICTED_AT` at a time, and the rest at :meth:`forget_rewritten`. Untold, their
        descriptions kept each reader, and through it its store: once the zip archive it was read from was
        replaced, the old archive's open file for as long as the pipeline lived."""
        with self._dropped_lock:
            self._dropped.extend(readers)
            if len(self._dropped) < _FORGET_EVICTED_AT:
                return
            told, self._dropped = self._dropped, []
        self._tell_forgotten(told)

    def _tell_forgotten(self, readers: list[ArrayReader]) -> None:
        """The executors forget what they keep of ``readers``, arrays the pipeline forgot."""
        for executor in [self.executor, *self.lanes.executors()]:
            executor.forget(readers)

    def _load(self, uri: str) -> ArrayReader:
        options = options_for(self.cfg.storage_options, uri)
        local = metadata_stats(uri)  # before the read: a rewrite during the open is told at the next look
        if local is None:
            reader = open_array(uri, options, store=self.store, index_cache=self._index_cache, stores=self.stores)
            metas = None
        else:  # read by the stats just taken: each metadata file stat'ed once an open
            path, stats = local
            reader = open_local(path, uri, self.store, self._index_cache, stats[:2])
            metas = _identities(stats)
        if self.cfg.cf:  # its attributes read with its metadata (consolidated, or on _open_all's threads)
            coding(reader, self.stores, options)
        if metas is not None:  # kept with the reader: evicted with it (see forget_rewritten)
            reader.derived["metadata_files"] = metas
            # the metadata files found, each path with its identity: what each push looks at (_rewritten), a
            # stat per file, no locate per array. A rewrite with zarr-python replaces or deletes them
            folder = path if path.endswith(os.sep) else path + os.sep
            reader.derived["metadata_found"] = tuple((folder + name, ident) for name, ident in
                                                     zip(_METADATA_FILES, metas) if ident is not None)
        return reader

    def forget_rewritten(self) -> int:
        """Forget the local arrays opened whose metadata files changed since (an array rewritten, zarr-python's
        ``overwrite`` with another chunk shape, codec or dtype): the next batch opens them anew, as a new pipeline
        would, instead of reading the new files by the old layout (silently wrong crops). At the first push after
        :meth:`used_up` (a new epoch of a pipeline kept for it): a few ``stat`` per array opened. Returns
        how many were forgotten. The arrays of a zip archive changed since it was opened (a new archive renamed
        over it) are forgotten with its store: kept, they read the old archive's bytes through its open file.
        Arrays in object stores are not looked at: their objects' bytes are revalidated by their stores
        (cache_staleness_s), but a layout changed there needs a new pipeline."""
        with self._dropped_lock:  # those evicted since they were last told: one may read a replaced archive
            forgotten, self._dropped = self._dropped, []
        n_evicted = len(forgotten)
        replaced = self.stores.forget_changed_archives()  # their next open reads the new archive's directory
        for uri, reader in self._readers.items():
            metas = reader.derived.get("metadata_files")
            if (metas is not None and metadata_identity(uri) != metas) or any(reader.kv is k for k in replaced):
                self._readers.discard(uri)
                forgotten.append(reader)
        if len(forgotten) > n_evicted:  # a rewritten array may name its dimensions anew
            self._channels_checked.clear()
        if forgotten:  # and the executors forget what they keep of them: kept, their descriptions held the
            # readers and through them a replaced archive's store, whose file stayed open as long as the pipeline
            self._tell_forgotten(forgotten)
        return len(forgotten) - n_evicted

    def _open_all(self, uris: list[str]) -> list[ArrayReader]:
        """The arrays at ``uris``. Those in remote stores not open yet are opened at once, on the pipeline's
        opener threads (:meth:`_start_opens`): their metadata requests overlap instead of adding up, one
        round trip each, as a batch of arrays seen for the first time would; an open in flight already (the
        batches pulled ahead: :meth:`_next_pull`) is waited for, not made again. A failed open is not tried
        again (that would wait out its retries twice): the first failure, in ``uris`` order, is raised."""
        # those open already (every one, in most batches) found under one lock, not one look-up each
        cached = self._readers.get_many(uris)
        if all(r is not None for r in cached):
            return cached
        missing = [u for u in uris if "://" in u and u.split("://", 1)[0].lower() in REMOTE_SCHEMES
                   and u not in self._readers]
        with self._opening_lock:
            alone = len(missing) == 1 and missing[0] not in self._opening  # opened on this thread, below
        flights = [] if alone or not missing else self._start_opens(missing)
        self._wait_opens([f for _, f in flights])
        errors = {u: f.result() for u, f in flights if f.result() is not None}
        out = []
        for u, r in zip(uris, cached):
            if u in errors:
                raise errors[u]
            out.append(self.open(u) if r is None else r)
        return out

    def _start_opens(self, uris: list[str]) -> list[tuple[str, concurrent.futures.Future]]:
        """The opens of the remote arrays among ``uris`` started on the opener threads (at most ``_open_at_once``,
        kept while in use, as a thread started per open costs more than an open from the disk cache; one idle
        for 30 s leaves), each ``(uri, future)``; an open in flight already is shared. A future's result is the open's error, or None. Where more wait
        than there are threads, the disk cache listings (which revalidate their zarr.json too) of those that
        wait are asked first, on an opener thread (:meth:`_list_ahead`), so the opens overlap; the
        coordinator, which goes on planning, asks none itself, nor do the first opens wait for them."""
        flights, new = [], []
        with self._opening_lock:
            # those open already (every one, in most calls: tens of arrays each) found under one lock, not one each
            for u, open_now in zip(uris, self._readers.holds(uris)):
                if open_now or "://" not in u or u.split("://", 1)[0].lower() not in REMOTE_SCHEMES:
                    continue  # local files: opened by the batch that reads them (no round trip to overlap)
                f = self._opening.get(u)
                if f is None:
                    f = self._opening[u] = concurrent.futures.Future()
                    new.append((u, f))
                flights.append((u, f))
        waiting = [u for u, _ in new[self._open_at_once - 1:]]  # past the threads left once one lists them
        jobs = ([(self._list_ahead, waiting)] if len(new) > self._open_at_once else []) + \
            [(self._try_open, u, f) for u, f in new]
        for fn, *args in jobs:
            try:
                self._opener_pool().submit(fn, *args)
            except BaseException as exc:  # noqa: BLE001 - no thread given, or closed: the open's error
                if fn == self._try_open:
                    self._opened(*args, exc)
        return flights

    def _opener_pool(self) -> DaemonPool:
        """The opener threads' pool, made at first use (by the coordinator, or an opener thread: see
        :meth:`_aside`); ShutdownError once the pipeline is closed."""
        with self._opening_lock:
            if self.closed:
                raise ShutdownError("the pipeline is closed")
            if self._openers is None:
                self._openers = DaemonPool(self._open_at_once, "stoker-open", knob="n_io_threads")
            return self._openers

    def _aside(self, fn) -> None:
        """Run ``fn()`` on an opener thread (a read ahead of shard indexes); ShutdownError once closed."""
        self._opener_pool().submit(fn)

    def _list_ahead(self, uris: list[str]) -> None:
        """The disk cache listings of ``uris`` asked, without waiting (:meth:`Stores.opening
        <stoker.storage.locate.Stores.opening>`): arrays whose opens wait for an opener thread."""
        for u in uris:
            self.stores.opening(u, options_for(self.cfg.storage_options, u))

    def _try_open(self, uri: str, done: concurrent.futures.Future) -> None:
        error = None
        try:
            self.open(uri)
        except BaseException as exc:  # noqa: BLE001 - raised, in order, by _open_all
            error = exc
        finally:
            self._opened(uri, done, error)

    def _opened(self, uri: str, done: concurrent.futures.Future, error: BaseException | None) -> None:
        with self._opening_lock:
            if self._opening.get(uri) is done:
                del self._opening[uri]  # a failed open is made again by the next batch that needs it
        done.set_result(error)
        self._wake()  # a coordinator waiting for a slot or this open (see _cycle) may plan now

    def _opens_pending(self) -> bool:
        """Whether the next batch pulled reads a remote array whose open is in flight on the opener threads
        (its launch would wait for it: :meth:`_open_all`)."""
        if not self._pulled:
            return False
        uris = {u for s, _, _ in self._pulled[0][0] for u in s.uris}
        with self._opening_lock:
            return any(not f.done() for f in (self._opening.get(u) for u in uris) if f is not None)

    def _opens_started(self, staged: list[Staged]) -> bool:
        """Whether a remote array of ``staged`` is being opened on the opener threads, its open started here
        if it was not yet."""
        flights = self._start_opens(list({u: None for s, _, _ in staged for u in s.uris}))
        return any(not f.done() for _, f in flights)

    def _wait_opens(self, futures: list[concurrent.futures.Future]) -> None:
        """Wait for the opens ``futures`` (each bounded: every store request has its own time limit); a
        pipeline closed meanwhile raises ShutdownError (its opener threads are stopped)."""
        pending = set(futures)
        while pending:
            pending = concurrent.futures.wait(pending, timeout=_SLOT_POLL_S * 10)[1]
            if pending and self.closed:
                raise ShutdownError("the pipeline was closed while its arrays were being opened")

    def head(self) -> Entry | None:
        """Under the condition: the first batch in flight (the next to pop), or None."""
        return self.inflight[0] if self.inflight else None

    def in_flight(self) -> int:
        """Under the condition: how many batches are in flight (errors riding in place of one included)."""
        return len(self.inflight)

    def slots_in_flight(self, executor: Executor) -> int:
        """Under the condition: the slots of ``executor`` that batches in flight hold (a batch of one box its
        target, one of fields its part in that field's lane): taken by the pipeline, not by the consumer, whose
        slots are the rest of ``executor.held()``."""
        n = 0
        for entry in self.inflight:
            if entry.parts is not None:
                n += sum(1 for part in entry.parts if part.executor is executor and part.target is not None)
            elif entry.target is not None and executor is self.executor:
                n += 1
        return n

    def take_head(self, head: Entry) -> None:
        """Under the condition: ``head`` leaves the batches in flight, if it is still the first (so it may be
        asked twice)."""
        if self.inflight and self.inflight[0] is head:
            self.inflight.popleft()

    def put_back(self, head: Entry) -> None:
        """Under the condition: ``head``, taken by :meth:`take_head`, is first in flight again (if not already)."""
        if not self.inflight or self.inflight[0] is not head:
            self.inflight.appendleft(head)

    def pushed(self) -> None:
        """A new push (before its samples are queued). After :meth:`used_up` (a new epoch of a pipeline kept for
        it, CropDataset(persistent=True)): the shards found not stored so far (their index cached as missing,
        the fill value) are looked for again, so a shard written since is read, as a new pipeline would (a
        kept pipeline read the fill value for ever), and the local arrays rewritten since are forgotten
        (:meth:`forget_rewritten`). Shards read before are checked against their file's identity at each read
        already. Not at every push: a loop that pushes a batch's samples at a time would ask its store again
        about every missing shard of a sparse array each batch (over an object store, a request each).

        At every other push, the local arrays open are looked at (:meth:`_rewritten`, a ``stat`` per metadata
        file): one rewritten since its open is forgotten (opened anew) when no batch is in flight and the
        earlier pushes are used up, and the push is an InvalidArgument otherwise (batches of the old layout
        in flight: never two layouts in one run, never the new files read by the old one)."""
        if self._used_up:
            self._used_up = False
            self._index_cache.forget_nones()
            self.forget_rewritten()
            return
        rewritten = self._rewritten()
        if not rewritten:
            return
        with self.cond:
            busy = self.in_flight()
            drained = self.intake.drained()
        if busy or not drained:
            # batches made (or to be made) by the old layout's reader: forgetting it now mixes two layouts in one
            # run, keeping it reads the new files by the old layout (silently wrong crops)
            shown = ", ".join(rewritten[:3]) + (f" and {len(rewritten) - 3} more" if len(rewritten) > 3 else "")
            raise InvalidArgument(
                f"push: {shown} was rewritten (its metadata files changed) since this pipeline opened it, while "
                f"{f'{busy} batches are in flight' if busy else 'an earlier push still has samples to give'} that "
                "read it by its old layout. Pop every batch of the earlier pushes first (the next push then opens "
                "the array anew), or make a new Pipeline")
        self.forget_rewritten()

    def _rewritten(self) -> list[str]:
        """The local arrays open whose metadata files found at the open changed since (replaced, rewritten or
        deleted: zarr-python's overwrite): a ``stat`` per file, one for an array of Zarr v3 (1,000 open arrays
        cost a few milliseconds per push). :meth:`forget_rewritten` looks at the files not found too."""
        changed = []
        for uri, reader in self._readers.items():
            for path, ident in reader.derived.get("metadata_found", ()):
                try:
                    st = os.stat(path)
                except (OSError, ValueError):
                    st = None
                if st is None or identity(st) != ident:
                    if not _renewed_alike(uri, reader, self.store):
                        changed.append(uri)
                    break
        return changed

    def used_up(self) -> None:
        """The pushes so far are used up (:meth:`Pipeline.drop_used_up`, between two epochs of a pipeline kept
        for the next): the next push looks for arrays rewritten meanwhile (:meth:`forget_rewritten`)."""
        self._used_up = True

    def threads(self) -> list[threading.Thread]:
        """The coordinator's thread, once started."""
        return [] if self.thread is None else [self.thread]

    def start(self) -> None:
        with self.cond:
            if self.thread is None and not self.closed:
                thread = threading.Thread(target=self._run, name="stoker-coordinator", daemon=True)
                start_thread(thread, "n_compute_threads")  # none given: a later push tries again
                self.thread = thread

    def close(self) -> None:
        """Stop launching (under the condition); the thread ends at its next check."""
        self.closed = True
        self.cond.notify_all()
        self.stores.close()  # cancels requests in flight: their batches fail with ShutdownError
        if self._openers is not None:
            self._openers.shutdown(drain=True)  # opens queued run (and fail at once): their waiters see it
        if self.ahead.buffer is not None:
            self.ahead.buffer.close()  # what was prefetched and not used is dropped

    def join(self, timeout: float) -> None:
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=timeout)  # a user generator blocked in next() cannot be interrupted

    def _run(self) -> None:
        gil.enroll()  # its GIL time is the pipeline's (charged at each batch's "plan" report)
        try:
            # its CPU time, a round at a time (Stats.coordinator_seconds): one clock read a round
            self.stats.watch_coordinator(threading.get_native_id())
            last = time.thread_time_ns()
            going = True
            while going:
                going = self._cycle()
                now = time.thread_time_ns()
                self.stats.coordinator(now - last)
                last = now
        except BaseException as exc:  # noqa: BLE001 - a bug here must reach the consumer, not vanish
            with self.cond:
                if not self.closed:
                    self.inflight.append(Entry(-1, 0, error=exc))
                self.cond.notify_all()

    def _cycle(self) -> bool:
        """One round: wait for room (woken by a pop, a push or the close; at most :data:`_IDLE_WAIT_S`), then
        launch one batch. False once closed.

        There is room while at most ``lookahead_batches + 1`` batches, one per slot, are in flight: the next
        one is planned while they are, and its launch then waits in ``acquire`` for the slot the consumer
        gives back. So a slot is written again as soon as it is released, planning (the coordinator's
        Python, under the GIL) overlaps the batches being made instead of sitting between a release and the
        next launch, and the coordinator wakes once per batch (at that release), not also at each pop. At
        most one batch is planned beyond the slots (more while the prefetch buffer has room for their remote
        chunks: :mod:`.prefetch`), and a batch that failed to plan rides in flight in its place, so a source
        of bad samples is not drained ahead of the consumer."""
        with self.cond:
            if self.closed:
                return False
            # batches planned ahead (see .prefetch): plan one more while the prefetch buffer has room,
            # else submit the oldest (waiting for its slot)
            work = self.intake.has_work() or bool(self._pulled)
            submit = bool(self.ahead.queue) and not (work and self.ahead.more())
            # the next batch to plan would wait for its arrays' opens (a round trip each, on the opener
            # threads): the oldest batch planned takes a slot meanwhile, rather than wait behind them for a
            # slot the consumer gave back
            held = not submit and bool(self.ahead.queue) and self._opens_pending()
            if (held or (submit and work and self.ahead.blocked())) and not self._slot_free():
                # planning waits for room in the prefetch buffer or for an open, the oldest batch for a slot:
                # wait for whichever comes first (a request's or an open's end wakes us, a slot's release is
                # polled), rather than in acquire, where planning could not go on when the other came first
                gil.wait(self.cond, _SLOT_POLL_S)
                return not self.closed
            submit = submit or held
            if not submit and (not work or
                               (not self.ahead.queue and len(self.inflight) > self._lookahead() + 1)):
                gil.wait(self.cond, _IDLE_WAIT_S)
                return not self.closed
        if submit:
            self._submit(*self.ahead.queue.popleft())
        else:
            staged, error = self._next_pull()
            if staged and error is None and self.ahead.queue and self._opens_started(staged):
                # pulled just now (nothing was pulled ahead: a push of a batch at a time) and its arrays are
                # being opened: put back, so the batches planned before it take the slots the consumer gives
                # back meanwhile (see above) rather than wait behind its opens in _launch
                self._pulled.appendleft((staged, error))
            else:
                if staged:
                    self._launch(staged)
                if error is not None:  # (the sources were dropped when it was pulled: _next_pull)
                    self.ahead.failed(Entry(next(self._batch_ids), 0, error=error))
        with self.cond:
            self.intake.launched(still_waiting=bool(self.ahead.queue) or bool(self._pulled))
            self.cond.notify_all()
        return True

    def _next_pull(self) -> tuple[list[Staged], BaseException | None]:
        """The next batch's samples, or a source's error (:meth:`Intake.pull`). While batches read remote
        arrays with prefetch on, up to ``_PULL_AHEAD`` batches are pulled at once (stopping at an error or
        when the sources run dry) and their remote arrays not open yet opened together, so a stream of
        batches over arrays seen for the first time pays one metadata round trip per few batches, not per
        batch. An array that failed to open is left to its batch's launch, which opens it again and raises
        the error in its place. Once a source raised, nothing more is pulled from any source pushed before
        (they are dropped then), nor anything at all until the batches pulled before the error are launched
        and the error is handed on."""
        if len(self._pulled) <= _PULL_AHEAD // 2 and all(error is None for _, error in self._pulled):
            # refilled while one is left (not only when none is), so that the objects of the batches after
            # the next are revalidated while the next is made
            n = _PULL_AHEAD if self.ahead.remote else 1
            more: list = []
            while len(self._pulled) < n:
                if self._pulled:
                    with self.cond:
                        if not self.intake.has_work():
                            break
                staged, error = self.intake.pull(lambda: self.closed)
                if staged or error is not None:
                    self._pulled.append((staged, error))
                    more.append(staged)
                if error is not None:  # the source raised: it and every source queued behind it are dropped
                    self.intake.drop_sources()
                if error is not None or not staged:
                    break
            if len(self._pulled) > 1:
                # their arrays not open yet opened on the opener threads, not waited for here (the coordinator
                # goes on making the batches before); an error is raised at the launch of the batch that
                # reads it. Then the objects of the batches just pulled: their generations asked, batch by
                # batch, so that their reads wait for no revalidation
                flights = self._start_opens(list({u: None for staged, _ in self._pulled for s, _, _ in staged
                                                  for u in s.uris}))
                # and their shard indexes read, batch by batch, on the opener threads: a batch's planning then
                # waits for no round trip of its own after the batches before it were planned
                pulled = [[s for s, _, _ in staged] for staged in more]
                revalidate_when_open(flights, pulled, self._readers.get_many, self.ahead.revalidated, self._aside)
        return self._pulled.popleft() if self._pulled else ([], None)

    def _launch(self, staged: list[Staged]) -> None:
        samples = [s for s, _, _ in staged]
        source_ids = [sid for _, sid, _ in staged]
        keys = np.array([key for _, _, key in staged], dtype=np.int64).reshape(len(staged), 2)
        keys.setflags(write=False)  # shared by the transform and Batch.keys
        batch_id = next(self._batch_ids)
        t0 = (time.perf_counter(), time.thread_time())
        if self.closed:
            return
        if samples[0].fields is not None:
            self._launch_fields(batch_id, samples, source_ids, t0, keys)
            return
        try:
            # The arrays' metadata settles the dtype and the budget before planning: a crop too large for
            # host_buffer_bytes is refused before its plan (chunk lists of its whole volume) is built.
            uris = list({uri: None for s in samples for uri in s.uris})
            readers = self._open_all(uris)
            self._check_channels(samples, dict(zip(uris, readers)))
            dtype = self._batch_dtype(readers)
            try:
                self.executor.prepare(samples[0].shape, readers, dtype)
            except BudgetExceeded:  # a box past its array (a huge one, say) is what to say first
                shapes = {uri: r.shape for uri, r in zip(uris, readers)}
                for uri, aabb in parts([s for s in samples if s.pad is None]):  # padded boxes may reach past
                    check_in_bounds(aabb, shapes[uri], uri)
                raise
            self._check_cf(readers, dtype)
            known = dict(zip(uris, readers))  # the planner asks for each again: no second cache look-up
            plan = self.executor.plan(batch_id, samples, lambda u: known[u] if u in known else self.open(u))
        except BaseException as exc:  # noqa: BLE001 - delivered at pop, in order
            self.ahead.failed(Entry(batch_id, len(samples), error=exc))
            return
        plan.keys = keys  # where the transform runs (the executor's completion hook) and Batch.keys find them
        self._planned(t0)
        entry = Entry(batch_id, plan.rows)
        entry.source_ids = source_ids
        # its samples' pushes, and the pushes so far: the freshness marks of what it prefetches and shares
        self.ahead.planned(plan, entry, waits=len(self.inflight) + len(self.ahead.queue) >= self.executor.n_slots,
                           pushed=max(source_ids) + 1, mark=self.intake.pushes)

    def _submit(self, plan, entry: Entry, seq: int) -> None:
        """Put the oldest batch planned in flight: wait for a slot and submit it (an error: in its place)."""
        if plan is not None:
            entry.target = self.executor.acquire(plan, lambda: self.closed)
            self.ahead.submitted(seq, self.executor.n_slots)
            self.ahead.fresh(max(entry.source_ids) + 1)  # before its fetches start
            entry.job = self.executor.submit(plan, entry.target)
        with self.cond:
            self.inflight.append(entry)
            self.cond.notify_all()
        # a frame can outlive its call (the callers' frames of an exception's traceback kept in a cycle):
        # this one must not keep the batch's target, a view of its slot, alive once the batch is popped
        del entry

    def _planned(self, t0: tuple[float, float]) -> None:
        """Report a batch planned since ``t0`` (``(perf_counter, thread_time)``): ``plan``, the coordinator's
        CPU time planning it; ``plan_wait``, the rest of that wall time: waits for its arrays' opens and shard
        indexes from their stores (round trips, at 100 ms a request the most of it), for a core and the GIL."""
        cpu = time.thread_time() - t0[1]
        self.stats.stage("plan", cpu)
        self.stats.stage("plan_wait", max(0.0, time.perf_counter() - t0[0] - cpu))

    def _launch_fields(self, batch_id: int, samples: list[Sample], source_ids: list[int], t0: tuple[float, float],
                       keys: np.ndarray) -> None:
        """Launch a batch of samples of named fields: each field's plain samples planned, given a slot and
        submitted in that field's lane (made at the first such batch); an error names its field."""
        lanes = self.lanes
        plans = []
        try:
            uris = list({uri: None for s in samples for uri in s.uris})
            known = dict(zip(uris, self._open_all(uris)))

            def opened(u: str) -> ArrayReader:
                return known[u] if u in known else self.open(u)

            names = lanes.names or samples[0].names
            assert names is not None
            per_field = {name: [s.fields[name] for s in samples] for name in names}  # type: ignore[index]
            readers = {name: [known[u] for u in dict.fromkeys(u for f in fs for u in f.uris)]
                       for name, fs in per_field.items()}
            if not lanes.ready:
                dtypes = {}
                for name in names:
                    try:
                        dtypes[name] = self._batch_dtype(readers[name], lanes.requested(name, names))
                    except StokerError as exc:
                        raise in_field(exc, name) from None
                lanes.setup(samples[0], dtypes)
            for lane in lanes:
                fs, rs = per_field[lane.name], readers[lane.name]
                try:
                    self._check_channels(fs, known)
                    dtype = self._batch_dtype(rs, lane.cfg.output_dtype, lane.executor, (lane.name,))
                    try:
                        lane.executor.prepare(lane.shape, rs, dtype)
                    except BudgetExceeded as exc:  # a box past its array is what to say first, as for one box
                        shapes = {r.uri: r.shape for r in rs}
                        for uri, aabb in parts(fs):
                            check_in_bounds(aabb, shapes[uri], uri)
                        raise lanes.budget_error(lane, exc) from None
                    self._check_cf(rs, dtype, lane.executor)
                    plans.append(lane.executor.plan(batch_id, fs, opened))
                    plans[-1].keys = keys  # each field's Batch.keys; the transform gets them with the dict
                except StokerError as exc:
                    raise in_field(exc, lane.name) from None
        except BaseException as exc:  # noqa: BLE001 - delivered at pop, in order
            with self.cond:
                self.inflight.append(Entry(batch_id, len(samples), error=exc))
                self.cond.notify_all()
            return
        self._planned(t0)
        entry = Entry(batch_id, plans[0].rows)
        entry.source_ids, entry.samples = source_ids, tuple(samples)
        held: list[Part] = []
        try:  # every field's slot, in the fields' order (every batch takes them so: no two wait on each other)
            for lane, plan in zip(lanes, plans):
                held.append(Part(lane.name, lane.executor, None, lane.executor.acquire(plan, lambda: self.closed)))
        except BaseException:
            for part in held:
                part.executor.drop(part.target)
            raise
        self.ahead.fresh(max(source_ids) + 1)  # nothing prefetched before its samples' pushes serves it
        for part, plan in zip(held, plans):
            part.job = part.executor.submit(plan, part.target)
        entry.parts = held
        with self.cond:
            self.inflight.append(entry)
            self.cond.notify_all()
        del entry, held, part  # no frame keeps a view of a slot (see _launch)

    def _check_channels(self, samples: list[Sample], known: dict[str, ArrayReader]) -> None:
        """Each group of arrays read as channels names its dimensions in one order (see
        :func:`~stoker.reader.coords.check_channel_dimensions`); a group is looked at once per pipeline."""
        for s in samples:
            group = s.uris  # (a tuple: hashable as it is)
            if len(group) > 1 and group not in self._channels_checked:
                check_channel_dimensions([known[u] for u in group], self.stores, self.cfg.storage_options)
                self._channels_checked.add(group)

    def _check_cf(self, readers: list[ArrayReader], dtype: torch.dtype, executor: Executor | None = None) -> None:
        """Arrays with CF attributes (Config.cf): decoded by the executor (the pipeline's, or a field's lane's)
        into a float batch, never ignored."""
        if not self.cfg.cf:
            return
        executor = executor or self.executor
        if not getattr(executor, "applies_cf", False):
            coded = [r.uri for r in readers if coding(r) is not None]
            if coded:
                raise NotYetSupported(
                    f"{coded[0]}: its CF attributes (scale_factor, add_offset, _FillValue, missing_value) are not "
                    f"decoded by this executor ({type(executor).__name__}) yet; decode on the CPU "
                    "(Config(decode_on='cpu')), or read the stored values with Config(cf=False)", knob="cf")
            return
        check_output(readers, dtype, executor.work_dtype(dtype), True, getattr(executor, "exact_cf", False))

    def _batch_dtype(self, readers: list[ArrayReader], requested: Any = _CONFIG, executor: Executor | None = None,
                     key: tuple = ()) -> torch.dtype:
        """The dtype of a batch of ``readers``' arrays for the ``requested`` output (default: the Config's),
        the same as ``executor``'s batches so far; ``key`` keeps a field's settled dtypes apart."""
        if requested is _CONFIG:
            requested = self.cfg.output_dtype
        executor = executor or self.executor
        dtypes = set()
        memo = ("batch_dtype", *key, requested)  # each reader's answer kept on it: one look-up a batch
        for r in readers:
            got = r.derived.get(memo)
            if got is None:
                # a packed CF array's values are floats computed from the stored ones: no label-id rule for it
                floats = self.cfg.cf and packed(r)
                # an OME-Zarr label image's 16-bit ids into a 16-bit float batch: looked up once per array (only
                # such arrays, and only those under a labels/ folder, read anything for it)
                ids = requested in HALF_EXACT_UP_TO and r.dtype.kind in "iu" and r.dtype.itemsize == 2 and \
                    not floats and not self.cfg.lossy_casts and \
                    is_label_level(r.uri, options_for(self.cfg.storage_options, r.uri), self.stores)
                got = self._dtypes.get((*key, requested, r.dtype, floats, ids))
                if got is None:  # once per source dtype; a refused one raises every time
                    got = self._dtypes[(*key, requested, r.dtype, floats, ids)] = batch_dtype(
                        requested, r.dtype, r.uri, self.cfg.lossy_casts or floats, ids)
                r.derived[memo] = got  # (a reader is one pipeline's: its Config and _dtypes are this one's)
            dtypes.add(got)
        if executor.dtype is not None:
            dtypes.add(executor.dtype)
        if len(dtypes) > 1:
            coded = [r.uri for r in readers if self.cfg.cf and coding(r) is not None]
            advice = "'i64' (or 'i32') for integer ids, which keeps them exact, 'f32' for floats and 8- or 16-bit " \
                "integers" if not coded else f"dtype='f32' (or 'bf16', 'f16'): {coded[0]} has CF attributes, " \
                "whose decoded values are floats"  # an integer output refuses those in turn
            raise DtypeMismatch(
                f"dtype='native' needs one source dtype per pipeline, found {sorted(map(str, dtypes))} "
                f"(arrays {[r.uri for r in readers]}); to mix sources pick an output all of them fit: {advice}"
            )
        return dtypes.pop()


#: the files of a local array's metadata (v3, v2 and its attributes: CF's scale_factor lives there)
_METADATA_FILES = ("zarr.json", ".zarray", ".zattrs")


def metadata_stats(uri: str) -> tuple[str, tuple] | None:
    """``(path, stats)`` of a local array: its directory and the stats of its metadata files (None for a file
    not there), or None for an array not in a local directory (an object store, a zip archive)."""
    loc = locate(uri)
    if not loc.is_local or loc.path is None:
        return None
    # the folder joined once, by concatenation: os.path.join per file cost as much as its stat (an open of an
    # array new to the pipeline, under the GIL: a batch of many small arrays makes several)
    folder = loc.path if loc.path.endswith(os.sep) else loc.path + os.sep
    return loc.path, tuple(stat_document(folder + name) for name in _METADATA_FILES)


#: The attributes that decide how an array's values are decoded (stoker.zarr.cf's coding_of, CF times and time
#: spans) or its axes named (v2's dimension names): one changed is a rewrite, any other attribute is not.
_DECODING_ATTRIBUTES = ("scale_factor", "add_offset", "_FillValue", "missing_value", "_Unsigned", "units",
                        "calendar", "dtype", "_ARRAY_DIMENSIONS")


def _renewed_alike(uri: str, reader: ArrayReader, store: LocalStore) -> bool:
    """Whether the local array ``reader`` reads, its metadata files' identities changed since its open, still
    has the layout and decoding it was opened with (an attribute written, ``attrs["epoch"] = 1``, or a file
    touched): then its new identities are recorded and it is read on, neither reopened nor a rewrite. Its
    metadata is parsed again and compared with the reader's (shape, chunks, shards, dtype, codecs, fill value,
    order, separator, dimension names), and the attributes CF decoding uses (:data:`_DECODING_ATTRIBUTES`)
    with those the reader read, where it read them (not yet: its later read reads these)."""
    local = metadata_stats(uri)  # first: a change after these stats is told at the next look
    if local is None:
        return False
    folder = local[0] if local[0].endswith(os.sep) else local[0] + os.sep
    metas = _identities(local[1])
    found = tuple((folder + name, ident) for name, ident in zip(_METADATA_FILES, metas) if ident is not None)
    if [p for p, _ in found] != [p for p, _ in reader.derived.get("metadata_found", ())]:
        return False  # a metadata file appeared or went: a rewrite
    held = reader.derived.get("documents")
    old_attrs = held[0] if isinstance(held, tuple) else None
    try:
        if not _same_metadata(read_metadata(local[0], store, uri=uri, stats=local[1][:2]), reader.metadata):
            return False
        if old_attrs is not None:
            if reader.zarr_format == 3:
                attrs = _json_file(folder + "zarr.json").get("attributes") or {}
            else:
                attrs = _json_file(folder + ".zattrs") if metas[2] is not None else {}
            if not isinstance(attrs, dict) or not all(_same_attribute(attrs.get(k), old_attrs.get(k))
                                                      for k in _DECODING_ATTRIBUTES):
                return False
    except (OSError, ValueError, AttributeError, StokerError):
        return False
    reader.derived["metadata_files"] = metas
    reader.derived["metadata_found"] = found
    return True


def _same_metadata(new: ArrayMetadata, old: ArrayMetadata) -> bool:
    """``new == old``, their fill values compared by their bytes: a NaN fill value (xarray's) equals itself."""
    a, b = new.fill_value, old.fill_value
    if a.dtype != b.dtype or a.tobytes() != b.tobytes():
        return False
    return dataclasses.replace(new, fill_value=b) == old


def _same_attribute(new: Any, old: Any) -> bool:
    """``new == old`` for attribute values parsed from JSON, a NaN equal to a NaN (``missing_value: NaN``, as
    xarray writes it; also inside a list): otherwise an unrelated attribute update was refused as a rewrite."""
    if isinstance(new, float) and isinstance(old, float) and new != new and old != old:
        return True
    if isinstance(new, list) and isinstance(old, list):
        return len(new) == len(old) and all(_same_attribute(a, b) for a, b in zip(new, old))
    if isinstance(new, dict) and isinstance(old, dict):
        return new.keys() == old.keys() and all(_same_attribute(new[k], old[k]) for k in new)
    return bool(new == old)


def _json_file(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


def _identities(stats: tuple) -> tuple:
    return tuple(None if st is None else identity(st) for st in stats)


def metadata_identity(uri: str) -> tuple | None:
    """The identities of a local array's metadata files (None for a file not there), or None for an array not
    in a local directory (an object store, a zip archive)."""
    local = metadata_stats(uri)
    return None if local is None else _identities(local[1])


def revalidate_when_open(flights: list[tuple[str, concurrent.futures.Future]], pulled: list[list[Sample]],
                         readers_of, asked: Revalidated | None = None, run=None) -> None:
    """Each batch of ``pulled`` (its samples) revalidated ahead (:func:`revalidate_ahead`) once the opens among
    ``flights`` (``(uri, future)``) of its own arrays are done, never waiting; with ``run`` (a thread to run a
    function on), its shard indexes read ahead then too (:func:`indexes_ahead`). Not once every open of every
    batch pulled is: eight batches pulled together open tens of arrays, a few at a time, and the first
    batches' HEADs then waited for the last open, while their reads came first and asked them themselves,
    one call a batch's read. ``readers_of(uris)``: the open arrays, None for one not open, looked up together
    once a batch for both (one hold of the open arrays' lock, not one a sample for each); ``asked``: what to
    skip (see :class:`.prefetch.Revalidated`)."""
    by_uri = dict(flights)
    for samples in pulled:
        uris = list({u: None for s in samples for u in s.uris})
        opens = {id(f): f for f in (by_uri.get(u) for u in uris) if f is not None}
        when_all_done(list(opens.values()), lambda samples=samples, uris=uris: _ahead(samples, uris, readers_of,
                                                                                     asked, run), _dropped)


def _ahead(samples: list[Sample], uris: list[str], readers_of, asked: Revalidated | None, run) -> None:
    """A pulled batch's objects revalidated, and with ``run`` its shard indexes read, ahead (see
    :func:`revalidate_when_open`)."""
    known = dict(zip(uris, readers_of(uris)))
    try:
        revalidate_ahead(samples, known.get, asked)
    finally:  # (the indexes read even where revalidating raised, a store closed: as when they were apart)
        if run is not None:
            indexes_ahead(samples, known.get, run)


def _dropped(exc: BaseException) -> None:
    """What revalidating, or reading shard indexes, ahead raised: dropped (a closed store: the batches' own
    reads say what is wrong)."""
    if not isinstance(exc, Exception):
        raise exc
