"""The Python decode path: read, decode (numcodecs) and copy-cast chunks on a pool of Python threads.

It makes whole batches where the compiled engine is not built (or ``STOKER_NATIVE=0``), and the chunks the
engine leaves to it: codecs and layouts it does not do, frames it declines, shards rewritten since their
index was read. Its work comes from the batch's :class:`~stoker.engine.planning.tables.TablePlan`
(:meth:`~stoker.engine.planning.tables.TablePlan.python_reads`: a read per chunk file, a shard's inner chunks
coalesced). A file's share (a chunk file, or a shard's coalesced ranges) is read and decoded by one compute
task; I/O threads take only the reads that must wait for memory.

Per file read, the task reserves everything the read will need (encoded bytes plus decode scratch) from
the transient budget in one step, so work that holds memory never waits for more memory.

Arrays in a store whose keys are not local files (object stores, zip archives) are fetched here, for both paths
(:meth:`PythonDecoder.fetch`): a batch's chunks of one store by one call per group
(:func:`~stoker.storage.store.get_many`: whole chunk values, and inner chunks' ranges, which the store merges
per object within its gap and size cap), with at most ``Config.requests_in_flight`` requests of the
pipeline's stores at once (their shared semaphore). A fetch reserves what it holds (:class:`Fetch`); its
finished buffers go to the compiled engine in one call (:mod:`.decode_native`), or each fetched chunk is
decoded on the compute pool here. An I/O thread only waits for the budget and starts an object store's
fetch; no thread waits for the network, so the budget, not the I/O threads, bounds the fetches in flight.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...errors import DecodeError, InternalError, ShutdownError, StorageError, pipeline_closed
from ...reader.array import raise_read_error
from ...storage import ByteRange, FileChanged, LocalStore, Store
from ...storage.store import get_many, stamp
from ...runtime.faults import Fault
from ...runtime.workers import DaemonPool
from ...zarr.codecs import blosc
from . import native
from .cf import rounds_once
from ..buffers import Cancelled, Reservation, TransientBudget, size_class
from ..cast import check_fill, copy_cast, fill_value_as, range_error, unfit_range
from ..executor import Job
from ..planning.tasks import ChunkTask, FileRead
from ..stats import StatsRecorder


class _NoRoom(Exception):
    """Internal: the budget is short and this compute thread must not wait for it."""


@dataclass
class Fetch:
    """One call to a store: the whole values of ``keys`` and the ranges ``requests``, for the chunks ``cids``
    (one per key, then one per request, in that order). ``cost``: what it reserves of the transient budget
    from before the call until its chunks are done: its buffers (a whole value: the most its codec stores;
    ranges: the spans the store fetches, the gaps it coalesces included, see :func:`span_bytes`) and, on
    the Python path, each chunk's decode scratch."""

    kv: Any
    keys: list[str]
    requests: list[ByteRange]
    cids: Sequence[int]
    cost: int
    # ask the store (one that ``reports_versions``) for the version of every object read; once fetched:
    # ``(value_versions, part_versions)`` (see ObjectStore.get_many)
    versions: bool = False
    got_versions: tuple | None = None
    # parts that are the stored blocks of a blosc frame, by part number: ``(lo, FrameTable, key)``
    # (see stoker.engine.cpu.frame_spans)
    spans: dict | None = None
    # the parts that are inner chunks of shards, located by a cached index: each checked against the generation
    # its index was read at (see PythonDecoder.check_generations); their "gone or shorter" comes in their place
    inner: Sequence[int] = ()
    # a fetch of inner chunks located again after their shard changed: changed again is an error
    retried: bool = False


def fetches_within(items: Sequence, fetch_of: Callable[[Sequence], "Fetch"], limit: int) -> list["Fetch"]:
    """``fetch_of(part)`` for consecutive parts of ``items``, in order, each holding at most ``limit`` bytes:
    what a fetch holds counts the gaps its store coalesces between ranges, which the chunks' own lengths
    leave out, so a part over the limit is halved (a lone item is fetched whatever it holds)."""
    out, todo = [], [items]
    while todo:
        part = todo.pop()
        fetch = fetch_of(part)
        if fetch.cost <= limit or len(part) == 1:
            out.append(fetch)
        else:
            half = len(part) // 2
            todo += [part[half:], part[:half]]  # the first half next: the order kept
    return out


def span_bytes(kv: Store, objects: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> int:
    """The bytes ``kv`` holds once it fetched these ranges (``objects[i]`` numbers range i's key): ranges of
    one key at most the store's ``max_gap`` apart are fetched as one read, the gap between them included
    (:func:`~stoker.storage.ranges.coalesce`; a store whose ``max_gap`` is 0 merges none). An upper bound: the
    store also caps a read's length, which splits reads and leaves the gaps between them unread (a range
    overlapping earlier ones is counted again: a split there fetches its bytes twice).

    >>> span_bytes(store_with_gap_64, np.array([0, 0]), np.array([0, 120]), np.array([100, 80]))
    200
    """
    n = len(offsets)
    if n == 0:
        return 0
    gap = kv.max_gap
    order = np.lexsort((offsets, objects))
    obj, start = objects[order], offsets[order]
    end = start + lengths[order]
    first = np.ones(n, bool)
    first[1:] = obj[1:] != obj[:-1]
    # the furthest end so far within each key: one running maximum over the ends lifted by the key's rank
    rank = np.cumsum(first) - 1
    lift = int(end.max()) + 1
    if int(rank[-1]) * lift < 2**62:
        reach = np.maximum.accumulate(end + rank * lift) - rank * lift
    else:  # keys far apart in size: one running maximum per key
        reach = np.concatenate([np.maximum.accumulate(part) for part in np.split(end, np.flatnonzero(first)[1:])])
    new = first.copy()
    new[1:] |= start[1:] - reach[:-1] > gap
    heads = np.flatnonzero(new)
    # a range overlapping those before it may start a read of its own (a read's length cap splits there),
    # and then its bytes are fetched twice
    overlaps = np.zeros(n, bool)
    overlaps[1:] = ~first[1:] & (start[1:] < reach[:-1])
    return int((np.maximum.reduceat(end, heads) - start[heads]).sum() + (end - start)[overlaps].sum())


def _release(res: Reservation, users: int) -> None:
    """Release ``res`` on behalf of all its ``users``."""
    for _ in range(users):
        res.done()


#: A batch's reads go to the compute pool in groups of at least this many: each group costs a task, and
#: tasks of one or two reads cost more than they spread (docs/performance.md, "Tuning constants").
MIN_READS_PER_GROUP = 4


def _task_fault(fault: Fault, error: InternalError, args: tuple) -> None:
    """A pool's task raised past its own handling (a bug, ``error``): recorded in ``fault``, and the batch it
    worked for (every task's first argument is its job) fails with it, rather than wait for chunks the task
    will never count."""
    fault.record(error)
    if args and isinstance(args[0], Job):
        args[0].abandon(error)


class PythonDecoder:
    """Thread pools plus the transient budget. The pools' threads are daemon threads
    (:class:`~stoker.runtime.workers.DaemonPool`): one stuck in a read of a hung mount cannot keep the process alive."""

    def __init__(self, n_io: int, n_compute: int, budget: TransientBudget, stats: StatsRecorder,
                 store: LocalStore, max_group: int = 8 << 20, max_gap: int = 64 << 10) -> None:
        self.budget = budget
        self.stats = stats
        self.store = store
        # a shard's inner chunks read together reserve at most max_group (a lone chunk excepted); ranges at
        # most max_gap apart are read as one
        self.max_group, self.max_gap = max_group, max_gap
        # an exception escaping a task of its pools (a bug: tasks report their errors through their job): its
        # batch fails with it, and so does every later task's (see guard) and every later batch
        # (NativeDecoder.submit). The pools hold only the record, not this decoder.
        self.fault = Fault()
        on_fault = functools.partial(_task_fault, self.fault)
        self._io = DaemonPool(n_io, "stoker-io", knob="n_io_threads", on_fault=on_fault)
        self._compute = DaemonPool(n_compute, "stoker-compute", knob="n_compute_threads", on_fault=on_fault)
        self._n_compute = n_compute
        self._closing = False

    def cancelled(self) -> bool:
        return self._closing

    def threads(self) -> list[threading.Thread]:
        """The pools' threads started so far."""
        return self._io.threads + self._compute.threads

    def shutdown(self) -> None:
        """Cancel queued work; running tasks stop at their next check. Queued tasks still run, and end at once
        (every one checks ``_closing`` first) finishing their chunks with a ShutdownError and giving their
        reservations back: dropped, a fetch handed over just before, say, left its batch unfinished."""
        self._closing = True
        self._io.shutdown(drain=True)
        self._compute.shutdown(drain=True)

    # -- submission -------------------------------------------------------------------------

    def submit_chunks(self, job: Job, ids: np.ndarray | None) -> None:
        """Make the chunks ``ids`` of ``job.plan`` (ascending; None: all of them): their fills, then their
        reads (:meth:`~stoker.engine.planning.tables.TablePlan.python_reads`, each group reserving at most
        ``max_group``)."""
        fills, reads = job.plan.python_reads(ids, self.max_gap, self.max_group, size_class)
        if fills:
            self.submit_fills(job, fills)
        if reads:
            self.submit_reads(job, reads)

    def submit_fills(self, job: Job, chunk_ids: Sequence[int]) -> None:
        """Fill the copies of chunks with nothing stored (each its array's fill value)."""
        plan, fills = job.plan, {}
        for cid in chunk_ids:
            task = plan.chunks[cid]
            if task.source not in fills:
                fills[task.source] = fill_value_as(plan.sources[task.source].metadata.fill_value, job.out.dtype,
                                                   rounds_once(plan.sources[task.source], job.half_next))
            self.run(self.guard, job, 1, self._fill, job, task, fills[task.source])

    def submit_reads(self, job: Job, reads: list[FileRead]) -> None:
        """Read, decode and place ``reads`` on the compute pool.

        A file's share (a chunk file, or a shard's coalesced ranges) is read and decoded by a compute
        thread: a local read is a page-cache copy that releases the GIL, and handing each chunk from an
        I/O thread to a compute thread costs more GIL time than the overlap gains. Reads go to the pool
        in a few groups (two per thread, for balance): a task per chunk file costs GIL time too. I/O
        threads take the reads that find the budget short (see read_file). Groups hold a few reads each, also
        with many threads, unless that leaves fewer groups than half the threads: with two batches in
        flight (lookahead), every thread still has a group.
        """
        stored = [fr for fr in reads if not self._kv(job, fr).is_local]
        if stored:
            self._submit_fetches(job, stored)
            reads = [fr for fr in reads if self._kv(job, fr).is_local]
            if not reads:
                return
        n_groups = min(len(reads), 2 * self._n_compute,
                       max(-(-self._n_compute // 2), len(reads) // MIN_READS_PER_GROUP))
        for g in range(n_groups):
            self.run(self._read_group, job, reads[g::n_groups])

    @staticmethod
    def _kv(job: Job, fr: FileRead) -> Store:
        """The store ``fr``'s array is read through (one that ``is_local``: its files are read here by path)."""
        plan = job.plan
        return plan.sources[plan.chunks[fr.chunk_ids[0]].source].kv

    def _submit_fetches(self, job: Job, reads: list[FileRead]) -> None:
        """Fetch ``reads`` (of arrays in stores) and decode their chunks here: per store, in groups of at most a
        quarter of the budget (one group at least one read), each group one call to the store (:meth:`fetch`)."""
        plan = job.plan
        limit = max(1, self.budget.capacity // 4)
        by_store: dict[int, tuple[object, list[list[FileRead]], list[int]]] = {}
        for fr in reads:
            kv = self._kv(job, fr)
            _, groups, costs = by_store.setdefault(id(kv), (kv, [], []))
            tasks = [plan.chunks[c] for c in fr.chunk_ids]
            codec = plan.sources[tasks[0].source].metadata.codec
            encoded = codec.max_stored_nbytes if fr.whole_file else sum(t.length for t in tasks)
            cost = encoded + len(tasks) * size_class(codec.nbytes)
            if groups and costs[-1] + cost <= limit:
                groups[-1].append(fr)
                costs[-1] += cost
            else:
                groups.append([fr])
                costs.append(cost)
        for kv, groups, _ in by_store.values():
            for group in groups:
                for fetch in fetches_within(group, lambda part: self._fetch_of(plan, kv, part), limit):
                    self.fetch(job, fetch, self._decode_fetched, users=len(fetch.cids))

    @staticmethod
    def _fetch_of(plan, kv, group: list[FileRead]) -> "Fetch":
        """One fetch of ``group``'s reads and what it holds: whole values at the most their codecs store, the
        spans the store fetches for the ranges (gaps included), and the decode scratch of every chunk."""
        whole = [fr for fr in group if fr.whole_file]
        ranged = [(cid, plan.chunks[cid]) for fr in group if not fr.whole_file for cid in fr.chunk_ids]
        tasks = [plan.chunks[fr.chunk_ids[0]] for fr in whole] + [t for _, t in ranged]
        stored = sum(plan.sources[plan.chunks[fr.chunk_ids[0]].source].metadata.codec.max_stored_nbytes
                     for fr in whole)
        paths = {t.path: k for k, (_, t) in enumerate(ranged)}
        spans = span_bytes(kv, np.array([paths[t.path] for _, t in ranged], np.int64),
                           np.array([t.offset for _, t in ranged], np.int64),
                           np.array([t.length for _, t in ranged], np.int64))
        scratch = sum(size_class(plan.sources[t.source].metadata.codec.nbytes) for t in tasks)
        return Fetch(kv, [fr.path for fr in whole], [ByteRange(t.path, t.offset, t.length) for _, t in ranged],
                     [fr.chunk_ids[0] for fr in whole] + [c for c, _ in ranged], stored + spans + scratch,
                     versions=bool(ranged), inner=range(len(ranged)))

    def fetch(self, job: Job, fetch: "Fetch", then: Callable, users: int = 1) -> None:
        """Fetch ``fetch`` on the I/O pool (see :meth:`_fetch`), then ``then(job, fetch, values, parts, res)`` on the
        compute pool: the values (None: a missing key) and parts it got, and the reservation of ``fetch.cost``
        bytes, which ``then`` owns (``users`` calls of ``res.done()`` release it). Its chunks are counted
        finished here when the fetch fails, the job failed meanwhile or the pipeline closed."""
        n = len(fetch.cids)
        try:
            self._io.submit(self.guard, job, n, self._fetch, job, fetch, then, users)
        except ShutdownError:
            job.finish(n, pipeline_closed())

    def _fetch(self, job: Job, fetch: "Fetch", then: Callable, users: int) -> None:
        """Fetch ``fetch`` from its store in one call (whole values and inner chunks' ranges).

        The I/O thread waits for the budget, then only starts the fetch of a store that can run it without
        a waiting thread (an object store's ``start_get_many``): its completion hands the result to the
        compute pool (:meth:`_hand_over`). So the fetches in flight are bounded by the budget, not by the
        I/O threads."""
        kv = fetch.kv
        res = Reservation(self.budget, users=users)
        try:
            res.reserve(fetch.cost, self.cancelled)
            t0 = time.perf_counter()
            # a span's or an inner chunk's "gone or shorter" comes as its part: the chunk is read whole, or
            # located again in its shard's index read anew, then (once: read anew, it is the error it is)
            lenient = sorted(set(fetch.spans or ()) | set(() if fetch.retried else fetch.inner))
            if kv.starts_reads:
                future = kv.start_get_many(fetch.keys, fetch.requests, versions=True, lenient=lenient) \
                    if fetch.versions else kv.start_get_many(fetch.keys, fetch.requests)
                future.add_done_callback(
                    lambda f: self._hand_over(job, fetch, then, users, res, t0, lambda: kv.result_of(f)))
                return
            try:
                got = get_many(kv, fetch.keys, fetch.requests, versions=fetch.versions, lenient=lenient)
            except StorageError as exc:  # a range past a shard's end: that array's DecodeError
                raise_read_error(job.plan.sources, exc)
        except BaseException:
            _release(res, users)
            raise
        self._fetched(job, fetch, then, users, res, t0, lambda: got)

    def _hand_over(self, job: Job, fetch: "Fetch", then: Callable, users: int, res: Reservation, t0: float,
                   result: Callable) -> None:
        """A started fetch finished: pass it to the compute pool (:meth:`_fetch_done`), nothing more. This runs
        on the event-loop thread every object store of the process shares, so it must neither decode nor
        finish the batch: finishing runs the user's transform and the device copy, which would stall every
        store's requests (and deadlock on a transform that reads a store)."""
        try:
            self._compute.submit(self._fetch_done, job, fetch, then, users, res, t0, result)
        except ShutdownError:  # the pool was shut down (close): nothing will decode these chunks
            _release(res, users)
            job.finish(len(fetch.cids), pipeline_closed())

    def _fetch_done(self, job: Job, fetch: "Fetch", then: Callable, users: int, res: Reservation, t0: float,
                    result: Callable) -> None:
        """A started fetch finished (run on the compute pool): :meth:`_fetched`, its failure the batch's."""
        n = len(fetch.cids)
        try:
            self._fetched(job, fetch, then, users, res, t0, result)
        except Cancelled:
            job.finish(n, pipeline_closed())
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop
            job.finish(n, exc)

    def _fetched(self, job: Job, fetch: "Fetch", then: Callable, users: int, res: Reservation, t0: float,
                 result: Callable) -> None:
        """Hand the buffers of a finished fetch (``result()``: its values and parts) to ``then``."""
        try:
            if self._closing:
                raise Cancelled()
            if job.failed or self.fault.error is not None:  # nothing to decode: as guard does
                _release(res, users)
                job.finish(len(fetch.cids), None if job.failed else self.fault.error)
                return
            try:
                got = result()
            except StorageError as exc:  # a range past a shard's end: that array's DecodeError
                raise_read_error(job.plan.sources, exc)
            values, parts = got[0], got[1]
            if len(got) > 2:  # the objects' versions, asked for
                fetch.got_versions = (got[2], got[3])
            nread = sum(len(v) for v in values if v is not None) + \
                sum(len(p) for p in parts if not isinstance(p, BaseException))
            self.stats.stage("io", time.perf_counter() - t0, bytes_out=nread)
            job.count(bytes_read=nread)
            stale = self.check_generations(job, fetch, parts)
            if stale:
                fetch, values, parts = self._without_stale(job, fetch, values, parts, stale, res, users)
        except BaseException:
            _release(res, users)
            raise
        if fetch is not None:
            then(job, fetch, values, parts, res)

    def check_generations(self, job: Job, fetch: "Fetch", parts: list) -> list[int]:
        """The numbers of ``fetch``'s inner chunk parts that must not be decoded as located: their range came
        from another generation of the shard than the index that located it, or their shard is now gone or
        shorter (the error in place). Of a fetch already ``retried``, the first such chunk's
        :meth:`~stoker.reader.array.ArrayReader.shard_changed` is raised instead: its shard changed again
        after its index was read anew."""
        if not fetch.inner or fetch.got_versions is None:
            return []
        plan, versions, first = job.plan, fetch.got_versions[1], len(fetch.keys)
        cids = [fetch.cids[first + j] for j in fetch.inner]
        if not fetch.retried:  # the stamp is the shard's identity field 3 in the plan: no task made per chunk
            want = plan.files[plan.chunk_file[np.asarray(cids, np.int64)], native.F_MTIME].tolist()
        else:  # relocated tasks hold their new identity
            want = [plan.chunks[c].ident[3] if plan.chunks[c].ident else 0 for c in cids]
        stamps: dict = {}  # a stamp per version read (the parts of one shard share theirs)
        stale = []
        for j, cid, expected in zip(fetch.inner, cids, want):
            version = versions[j]
            if not isinstance(parts[j], BaseException):  # (gone or shorter: stale whatever its generation)
                if not expected or version is None:
                    continue  # the store cannot tell this shard's generations apart
                got = stamps.get(version)
                if got is None:
                    got = stamps[version] = stamp(version)
                if got == expected:
                    continue
            if fetch.retried:
                task = plan.chunks[cid]
                raise plan.sources[task.source].shard_changed(task.key)
            stale.append(j)
        return stale

    def _without_stale(self, job: Job, fetch: "Fetch", values: list, parts: list, stale: list[int],
                       res: Reservation, users: int) -> tuple:
        """``fetch`` less its ``stale`` inner chunks, which are located again in their shards' indexes read anew
        (:meth:`~stoker.reader.array.ArrayReader.relocate`) and fetched once more, decoded on this path (the
        fill value where the new shard holds none). Returns ``(fetch, values, parts)`` left for its ``then``
        (fetch None: nothing left; ``res`` released then). ``res`` has a user per chunk (this path's
        decodes) or one for all (the engine's): the stale chunks' users are released here."""
        plan, first = job.plan, len(fetch.keys)
        tasks = [(fetch.cids[first + j], plan.chunks[fetch.cids[first + j]]) for j in stale]
        for _, task in tasks:  # all located before any is handed on: a failure here fails the fetch once
            loc = plan.sources[task.source].relocate(task.index, task.ident)
            task.path, task.offset, task.length, task.ident = loc.path, loc.offset, loc.length, loc.ident
        gone = set(stale)
        keep = [j for j in range(len(parts)) if j not in gone]
        if not values and not keep:
            _release(res, users)
            rest = None
        else:
            if users == len(fetch.cids):  # a user per chunk
                for _ in stale:
                    res.done()
            renumber = {j: n for n, j in enumerate(keep)}
            versions = fetch.got_versions
            cids = list(fetch.cids[:first]) + [fetch.cids[first + j] for j in keep]
            rest = Fetch(fetch.kv, fetch.keys, [fetch.requests[j] for j in keep],
                         np.asarray(cids, np.int64) if isinstance(fetch.cids, np.ndarray) else cids, fetch.cost,
                         fetch.versions, versions and (versions[0], [versions[1][j] for j in keep]),
                         {renumber[j]: span for j, span in fetch.spans.items()} if fetch.spans else None,
                         [renumber[j] for j in fetch.inner if j in renumber], fetch.retried)
            parts = [parts[j] for j in keep]
        again = []
        for cid, task in tasks:
            if task.path is None:  # empty in the new shard, or the shard is gone
                self.guard(job, 1, self._fill, job, task,
                           fill_value_as(plan.sources[task.source].metadata.fill_value, job.out.dtype,
                                         rounds_once(plan.sources[task.source], job.half_next)))
            else:
                again.append((cid, task))

        def fetch_of(part: Sequence) -> Fetch:
            cost = sum(t.length + size_class(plan.sources[t.source].metadata.codec.nbytes) for _, t in part)
            return Fetch(fetch.kv, [], [ByteRange(t.path, t.offset, t.length) for _, t in part],
                         [c for c, _ in part], cost, versions=True, inner=range(len(part)), retried=True)

        for again_fetch in fetches_within(again, fetch_of, max(1, self.budget.capacity // 4)) if again else ():
            self.fetch(job, again_fetch, self._decode_fetched, users=len(again_fetch.cids))
        return rest, values, parts

    def _decode_fetched(self, job: Job, fetch: "Fetch", values: list, parts: list, res: Reservation) -> None:
        """Decode every chunk of a finished fetch on the compute pool (one task each); a missing whole value is
        the fill value. ``res`` has a user per chunk."""
        plan = job.plan
        items = list(zip(fetch.cids, values + parts))
        for i, (cid, data) in enumerate(items):
            task = plan.chunks[cid]
            if data is None:  # a missing chunk is the fill value
                res.done()
                self.guard(job, 1, self._fill, job, task,
                           fill_value_as(plan.sources[task.source].metadata.fill_value, job.out.dtype,
                                         rounds_once(plan.sources[task.source], job.half_next)))
                continue
            try:
                self._compute.submit(self._guard_decode, job, task, memoryview(data), res, None, True)
            except ShutdownError:  # the pool was shut down (close): account for every chunk not queued
                for _ in items[i:]:
                    res.done()
                job.finish(len(items) - i, pipeline_closed())
                return

    def decode_bytes(self, job: Job, fetched: tuple[int, Any], on_compute: bool = False) -> None:
        """Decode a chunk from the bytes fetched for it (``(chunk number, bytes)``: one the engine left to this
        path) and place it. What it holds (those bytes, past their fetch, and its decode scratch) is reserved
        here: a compute thread that finds the budget short passes the chunk to an I/O thread, which waits."""
        cid, data = fetched
        task = job.plan.chunks[cid]
        res = Reservation(self.budget, users=1)
        held = memoryview(data).nbytes + size_class(job.plan.sources[task.source].metadata.codec.nbytes)
        try:
            self._reserve(res, held, on_compute)
        except _NoRoom:
            try:
                self._io.submit(self.guard, job, 1, self.decode_bytes, job, fetched, False)
            except ShutdownError:  # the pool was shut down (close)
                raise Cancelled() from None
            return
        self._guard_decode(job, task, memoryview(data), res, None, True)

    def run(self, fn: Callable, job: Job, *args) -> None:
        """``fn(job, *args)`` on the compute pool; once the pool is shut down, its chunks fail with ShutdownError
        (``fn`` is a group of reads, or a guarded task whose chunk count is ``args[0]``)."""
        try:
            self._compute.submit(fn, job, *args)
        except ShutdownError:
            n = sum(len(fr.chunk_ids) for fr in args[0]) if fn == self._read_group else args[0]
            job.finish(n, pipeline_closed())

    def _read_group(self, job: Job, reads: list[FileRead]) -> None:
        for fr in reads:
            self.guard(job, len(fr.chunk_ids), self.read_file, job, fr, True)

    def guard(self, job: Job, n: int, fn, *args) -> None:
        """Run a task; on any failure (or after the job failed) count its chunks as finished.

        Work skipped because the pipeline is closing finishes with a ShutdownError,
        so a half-filled batch can never be mistaken for a complete one.
        """
        if job.failed:
            job.finish(n)
            return
        if self._closing:
            job.finish(n, pipeline_closed())
            return
        if self.fault.error is not None:  # a task of the pools failed past its own handling: nothing is trusted
            job.finish(n, self.fault.error)
            return
        try:
            fn(*args)
        except Cancelled:
            job.finish(n, pipeline_closed())
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop
            job.finish(n, exc)

    # -- tasks ------------------------------------------------------------------------------

    def _fill(self, job: Job, task: ChunkTask, fill: torch.Tensor) -> None:
        check_fill(job.plan.sources[task.source], job.out.dtype, task.key)  # else ``fill`` wrapped around
        t0 = time.perf_counter()
        for c in task.copies:
            job.out[c.dst].fill_(fill)
        self.stats.stage("assemble", time.perf_counter() - t0)
        job.finish()

    def read_file(self, job: Job, fr: FileRead, on_compute: bool = False, retried: bool = False) -> None:
        """Read one file's share into a pooled buffer, then decode its chunks: right here, one after the
        other, when running on a compute thread, else by handing each chunk to the compute pool.

        The reservation covers the encoded buffer and every chunk's decode scratch, taken in one step.
        A compute thread never waits for memory (the decodes queued behind it may be what frees it):
        when the budget is short it passes the read to an I/O thread, which can wait.

        Inner chunks are read only from the shard file their index was read from; when it changed, they
        are located again in its new index (:meth:`relocate`), once (``retried``).
        """
        plan = job.plan
        chunks = [plan.chunks[c] for c in fr.chunk_ids]
        scratch = sum(size_class(plan.sources[c.source].metadata.codec.nbytes) for c in chunks)
        res = Reservation(self.budget, users=len(chunks))
        t0 = time.perf_counter()
        try:
            pieces: dict[int, memoryview] = {}
            read_end = None  # a chunk file read in part (some blosc blocks): where the bytes read end
            if fr.whole_file:
                task = chunks[0]
                f = self.store.open_file(fr.path)
                if f is None:  # an absent chunk file is the fill value
                    fill = fill_value_as(plan.sources[task.source].metadata.fill_value, job.out.dtype,
                                         rounds_once(plan.sources[task.source], job.half_next))
                    res.done()
                    self._fill(job, task, fill)
                    return
                with f:
                    plan.sources[task.source].metadata.codec.check_stored_size(f.size, task.key)
                    self._reserve(res, size_class(f.size) + scratch, on_compute)
                    view = memoryview(res.take(f.size, keep=True))[: f.size]
                    nread, read_end = self._read_chunk_file(f, view, plan.sources[task.source], task)
                pieces[fr.chunk_ids[0]] = view
            else:
                total = sum(r.length for r in fr.reads)
                self._reserve(res, sum(size_class(r.length) for r in fr.reads) + scratch, on_compute)
                nread = 0
                for read in fr.reads:
                    if self._closing:
                        raise Cancelled()
                    buf = res.take(read.length, keep=True)
                    view = memoryview(buf)[: read.length]
                    got = self.store.read_range_into(fr.path, read.offset, view, chunks[0].ident)
                    if got != read.length:
                        raise DecodeError(
                            f"{plan.sources[chunks[0].source].uri}: shard {fr.path!r} is shorter than its index "
                            f"claims (wanted [{read.offset}, {read.offset + read.length}), total {total})",
                            key=chunks[0].key,
                        )
                    nread += got
                    for i, sl in read.slices():
                        pieces[fr.chunk_ids[i]] = view[sl]
            self.stats.stage("io", time.perf_counter() - t0, bytes_out=nread)
            job.count(bytes_read=nread)
        except _NoRoom:  # nothing was reserved
            self._handoff(job, fr, retried)
            return
        except BaseException as exc:
            for _ in chunks:
                res.done()
            if not isinstance(exc, FileChanged):
                raise
            if retried:
                raise plan.sources[chunks[0].source].shard_changed(chunks[0].key) from None
            self.relocate(job, fr, on_compute)
            return
        if on_compute:
            for cid, task in zip(fr.chunk_ids, chunks):
                self._guard_decode(job, task, pieces[cid], res, read_end)
            return
        for i, cid in enumerate(fr.chunk_ids):
            try:
                self._compute.submit(self._guard_decode, job, plan.chunks[cid], pieces[cid], res, read_end)
            except ShutdownError:  # the pool was shut down (close): account for every chunk not queued
                for _ in fr.chunk_ids[i:]:
                    res.done()
                job.finish(len(fr.chunk_ids) - i, pipeline_closed())
                return

    def relocate(self, job: Job, fr: FileRead, on_compute: bool) -> None:
        """Read ``fr``'s inner chunks again from where the shard's index, read anew, says they are now:
        the shard file changed since the index the plan used was read."""
        plan = job.plan
        tasks = [plan.chunks[c] for c in fr.chunk_ids]
        reader = plan.sources[tasks[0].source]
        for task in tasks:  # all located before any is read: a failure here fails every chunk of fr once
            loc = reader.relocate(task.index, task.ident)
            task.path, task.offset, task.length, task.ident = loc.path, loc.offset, loc.length, loc.ident
        for cid, task in zip(fr.chunk_ids, tasks):
            if task.path is None:  # empty in the new shard, or the shard is gone
                self.guard(job, 1, self._fill, job, task,
                           fill_value_as(reader.metadata.fill_value, job.out.dtype, rounds_once(reader, job.half_next)))
            else:
                self.guard(job, 1, self.read_file, job, FileRead.inner_chunk(task.path, cid, task.offset, task.length),
                           on_compute, True)

    def _reserve(self, res: Reservation, nbytes: int, on_compute: bool) -> None:
        """Reserve ``nbytes``: an I/O thread waits for them; a compute thread raises _NoRoom instead."""
        if not on_compute:
            res.reserve(nbytes, self.cancelled)
        elif not res.try_reserve(nbytes):
            raise _NoRoom()

    def _handoff(self, job: Job, fr: FileRead, retried: bool = False) -> None:
        try:
            self._io.submit(self.guard, job, len(fr.chunk_ids), self.read_file, job, fr, False, retried)
        except ShutdownError:  # the pool was shut down (close)
            raise Cancelled() from None

    def _read_chunk_file(self, f, view: memoryview, reader, task: ChunkTask) -> tuple[int, int | None]:
        """Read a chunk file into ``view``: only header, block table and needed blocks when decoding partially.
        Returns the bytes read and, for a partial read, the offset where they end (None: the whole file).

        ``view`` is a pooled buffer that may hold bytes of an earlier chunk, so every
        short read is an error: stale bytes must never be decoded as this chunk (and a partial decode
        is told where the bytes read end).
        """
        def read(lo: int, hi: int) -> int:
            got = f.read_into(view[lo:hi], lo)
            if got != hi - lo:
                raise DecodeError(f"{reader.uri}: chunk {task.key!r} changed while it was read", uri=reader.uri,
                                  key=task.key)
            return got

        codec = reader.metadata.codec
        if not codec.partial or f.size <= blosc.HEADER_SIZE:
            return read(0, f.size), None
        try:
            nread = read(0, blosc.HEADER_SIZE)
            header = view[: blosc.HEADER_SIZE]
            if not blosc.partial_ok(header, codec.nbytes, task.byte_start, task.byte_stop):
                return nread + read(blosc.HEADER_SIZE, f.size), None  # decoded (or rejected) in full
            table = min(blosc.table_size(header), f.size)
            nread += read(blosc.HEADER_SIZE, table)
            lo, hi = blosc.stored_range(view[:table], task.byte_start, task.byte_stop)
        except blosc.PartialDecodeError as exc:
            raise DecodeError(f"{reader.uri}: chunk {task.key!r} is not a valid blosc frame ({exc})",
                              uri=reader.uri, key=task.key) from None
        return nread + read(max(lo, table), hi), hi

    @staticmethod
    def _cast_copies(job: Job, task: ChunkTask, chunk) -> None:
        """Cast every copy of ``task`` from its decoded ``chunk`` into the batch (the Python path's cast); a value
        a copy reads that does not fit an integer batch fails the chunk (as the engine's ST_RANGE does)."""
        out = job.out if job.out_np is None else job.out_np
        half = rounds_once(job.plan.sources[task.source], job.half_next)
        for c in task.copies:
            src = chunk[c.chunk_sel]
            span = unfit_range(src, job.out.dtype)
            if span is not None:
                reader = job.plan.sources[task.source]
                raise range_error(reader.uri, task.key, reader.metadata.codec.dtype, job.out.dtype, span)
            copy_cast(out[c.dst], src, half)

    def _guard_decode(self, job: Job, task: ChunkTask, encoded: memoryview, res: Reservation,
                      read_end: int | None = None, check: bool = False) -> None:
        try:
            self.guard(job, 1, self._decode, job, task, encoded, res, read_end, check)
        finally:
            res.done()

    def _decode(self, job: Job, task: ChunkTask, encoded: memoryview, res: Reservation,
                read_end: int | None = None, check: bool = False) -> None:
        reader = job.plan.sources[task.source]
        codec = reader.metadata.codec
        if check:  # a whole value fetched from a store: its size is known only now
            codec.check_stored_size(len(encoded), task.key)
        t0 = time.perf_counter()
        scratch = None
        if codec.partial:
            scratch = res.take(codec.nbytes)
            chunk = scratch[: codec.nbytes].view(codec.dtype).reshape(codec.shape)
            decoded = codec.decode_range_into(encoded, chunk, task.byte_start, task.byte_stop, task.key, read_end)
        else:
            chunk = codec.decode(encoded, task.key)  # allocates; its size is inside the reservation
            decoded = codec.nbytes
        t1 = time.perf_counter()
        try:
            self._cast_copies(job, task, chunk)
        finally:
            if scratch is not None:
                res.give(scratch)
        self.stats.chunk(t1 - t0, time.perf_counter() - t1, len(encoded), decoded)
        job.finish(bytes_decoded=decoded, chunks_decoded=1)

