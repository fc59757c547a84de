"""The CPU executor: I/O threads read encoded bytes, compute threads decode and assemble.

Contract with the pipeline: :meth:`CpuExecutor.submit` takes a plan and the batch
tensor to fill and returns a :class:`Job` whose ``done`` event is set when every
chunk is in place or the first error happened (``job.error``).

Per file read, the I/O task reserves everything the read will need (encoded
bytes plus decode scratch) from the transient budget in one step, so work that
holds memory never waits for more memory.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from typing import Callable

import torch

from .. import native
from ..errors import DecodeError, ShutdownError, StorageError
from ..storage import FileChanged, LocalStore
from ..storage.local import not_regular
from ..workers import DaemonPool
from ..zarr import blosc_partial
from ..zarr.grid import c_strides
from .buffers import Cancelled, Reservation, TransientBudget, size_class
from .cast import copy_cast, fill_value_as, numpy_view, torch_dtype_of
from .plan import BatchPlan, ChunkTask, FileRead
from .stats import StatsRecorder


# Outputs of one call into the compiled reader stay under this many bytes: a call cannot be cancelled.
_NATIVE_CALL_BYTES = 8 << 20


class _NoRoom(Exception):
    """Internal: the budget is short and this compute thread must not wait for it."""


def _native_bytes(stored: int, nbytes: int, n: int) -> int:
    """What one compiled call with ``n`` output buffers of ``nbytes`` reserves: the encoded buffer (room for
    ``stored`` bytes, the codec's ``max_stored_nbytes``) and the outputs."""
    return size_class(stored) + n * size_class(nbytes)


def native_codec(codec) -> int | None:
    """The compiled reader's codec for whole chunk files of ``codec``, or None (the Python path reads them)."""
    if codec.lone_zstd and native.zstd:
        return native.ZSTD
    if codec.lone_blosc and native.blosc:
        return native.BLOSC
    return None


def _compiled_kind(codec) -> int | None:
    """The compiled reader's codec for chunks of ``codec`` in this process, or None: the extension is not
    loaded, the codec is not one it reads, or the chunk is empty (the Python path reads those)."""
    if native.decode_files is None or not codec.nbytes:
        return None
    return native_codec(codec)


def reads_one_by_one(reader) -> bool:
    """True when the compiled reader takes ``reader``'s chunks: then a shard's inner chunks are planned
    as a read each (``plan_batch(one_by_one=...)``), not coalesced only to be split again here."""
    return _compiled_kind(reader.metadata.codec) is not None


_BATCH_KINDS = {torch.float32: native.F32, torch.bfloat16: native.BF16}


#: A batch's reads go to the compute pool in groups of at least this many. Each group costs a task and
#: compiled calls of its own, and a call's decode buffer stays warm in cache from one chunk to the next:
#: 2 threads cutting scenario 1's ~58 reads per batch into 32 groups (what 16 threads did) ran at 0.90x
#: the speed of 4 groups, and scenario 6 at 0.76x; with groups of 4 or more, 0.98x and 0.92x.
MIN_READS_PER_GROUP = 4


#: Batches at least this large are written with streaming stores (whole cache lines straight to memory).
#: A batch that size outgrows the caches before anyone reads it, so ordinary stores only add a read of
#: every line (measured: scenario 4, 128 MB batches, +30% samples/s); smaller ones are better left cached
#: (scenario 6, 4 MB batches, was slower streamed).
STREAM_MIN_BYTES = 8 << 20


def batch_target(out: torch.Tensor) -> tuple[int, int, int, bool] | None:
    """``(address, bytes, kind, stream)`` of a batch the compiled reader can cast into, or None."""
    if out.device.type != "cpu" or out.dim() < 2 or not out.is_contiguous():
        return None
    nbytes = out.numel() * out.element_size()
    return out.data_ptr(), nbytes, _BATCH_KINDS.get(out.dtype, native.SAME), nbytes >= STREAM_MIN_BYTES


def copy_plan(task: ChunkTask, codec, out: torch.Tensor, kind: int,
              out_strides: tuple[int, ...] | None = None, contiguous: bool = False) -> array | None:
    """The compiled reader's plan for casting ``task``'s copies from its decoded chunk into ``out``
    (see ``csrc/place.c``), or None where the chunk's layout or dtype is left to :func:`copy_cast`:
    F order, transposes and foreign byte order, float16 and bool sources, float16 batches.
    ``out_strides`` is ``out.stride()``, passed in when one caller makes many plans; ``contiguous=True``
    vouches that ``out``'s rows are C-contiguous crops of the plan's sample shape, so the planner's
    offsets hold as they are (otherwise they are computed from the starts and the strides).

    >>> copy_plan(task, codec, batch, native.F32)  # array('q', [kind, ndim, ncopies, strides..., copies...])
    """
    src = native.SOURCE_KINDS.get(codec.dtype) if codec.plain else None
    if src is None or (kind == native.SAME and out.dtype != torch_dtype_of(codec.dtype)):
        return None
    chunk_strides = c_strides(codec.shape)
    row_stride, *dst_strides = out.stride() if out_strides is None else out_strides
    header = (src, len(chunk_strides), len(task.copies), *chunk_strides, *dst_strides)
    if contiguous and task.placement is not None:  # the planner listed the copies already
        plan = array("q", header)
        plan.extend(task.placement)
        return plan
    values = list(header)
    for c in task.copies:
        src_offset = sum(s * cs for s, cs in zip(c.chunk_start, chunk_strides))
        dst_offset = c.row * row_stride + sum(b * ds for b, ds in zip(c.box_start, dst_strides))
        values += (src_offset, dst_offset, *c.extent)
    return array("q", values)


class Job:
    """One batch in flight. ``then(job)``, if given, runs once every chunk is in place (on the thread that
    placed the last one) and before ``done`` is set; an exception from it becomes the job's error."""

    def __init__(self, plan: BatchPlan, out: torch.Tensor, n_chunks: int,
                 then: Callable[["Job"], None] | None = None) -> None:
        self.plan = plan
        self.out = out
        self.out_np = numpy_view(out)  # numpy indexing costs far less GIL time than torch's
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._remaining = n_chunks
        self._then = then
        self._completing = False
        self._lock = threading.Lock()
        # read/decode counters of this batch, added to Stats when it is popped, so every counter
        # describes the same delivered batches (work done ahead is not lost to stats_reset())
        self.counts = {"bytes_read": 0, "bytes_decoded": 0, "chunks_decoded": 0}
        if n_chunks == 0:
            self._complete()

    def count(self, **values: int) -> None:
        with self._lock:
            for name, value in values.items():
                self.counts[name] += value

    @property
    def failed(self) -> bool:
        return self.error is not None

    def finish(self, n: int = 1, error: BaseException | None = None, **counts: int) -> None:
        """``n`` chunks are in place (or failed with ``error``); ``counts`` are added as by :meth:`count`."""
        with self._lock:
            for name, value in counts.items():
                self.counts[name] += value
            if error is not None and self.error is None:
                self.error = error
            self._remaining -= n
            failed = self.error is not None
            last = not failed and self._remaining <= 0 and not self._completing
            self._completing = self._completing or last
        if failed:
            self._then = None  # the hook holds the pipeline: no cycle through a failed job
            self.done.set()
        elif last:
            self._complete()

    def _complete(self) -> None:
        then, self._then = self._then, None  # run once; drop it so the job holds no pipeline
        if then is not None:
            try:
                then(self)
            except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop
                self.error = exc
        self.done.set()


class CpuExecutor:
    """Thread pools plus the transient budget; one per pipeline. The pools' threads are daemon threads
    (:class:`~stoker.workers.DaemonPool`): one stuck in a read of a hung mount cannot keep the process alive."""

    def __init__(self, n_io: int, n_compute: int, budget: TransientBudget, stats: StatsRecorder,
                 store: LocalStore) -> None:
        self.budget = budget
        self.stats = stats
        self.store = store
        self._io = DaemonPool(n_io, "stoker-io")
        self._compute = DaemonPool(n_compute, "stoker-compute")
        self._n_compute = n_compute
        self._closing = False

    def cancelled(self) -> bool:
        return self._closing

    def shutdown(self) -> None:
        """Cancel queued work; running tasks stop at their next check."""
        self._closing = True
        self._io.shutdown()
        self._compute.shutdown()

    # -- submission -------------------------------------------------------------------------

    def submit(self, plan: BatchPlan, out: torch.Tensor, then: Callable[[Job], None] | None = None) -> Job:
        job = Job(plan, out, len(plan.chunks), then)
        fills = {}
        for cid in plan.fill_chunks:
            task = plan.chunks[cid]
            if task.source not in fills:
                fills[task.source] = fill_value_as(plan.sources[task.source].metadata.fill_value, out.dtype)
            self._compute.submit(self._guard, job, 1, self._fill, job, task, fills[task.source])
        # A file's share (a chunk file, or a shard's coalesced ranges) is read and decoded by a compute
        # thread: a local read is a page-cache copy that releases the GIL, and handing each chunk from an
        # I/O thread to a compute thread costs more GIL time than the overlap gains. Reads go to the pool
        # in a few groups (two per thread, for balance): a task per chunk file costs GIL time too. I/O
        # threads take the reads that find the budget short (see _read). Groups hold a few reads each, also
        # with many threads, unless that leaves fewer groups than half the threads: with two batches in
        # flight (lookahead), every thread still has a group.
        reads = plan.file_reads
        n_groups = min(len(reads), 2 * self._n_compute,
                       max(-(-self._n_compute // 2), len(reads) // MIN_READS_PER_GROUP))
        for g in range(n_groups):
            self._compute.submit(self._read_group, job, reads[g::n_groups])
        return job

    def _read_group(self, job: Job, reads: list[FileRead]) -> None:
        if native.decode_files is not None:
            try:
                groups, rest = self._native_groups(job.plan, reads)
            except BaseException as exc:  # noqa: BLE001 - nothing was started: every chunk fails with it
                job.finish(sum(len(fr.chunk_ids) for fr in reads), exc)
                return
            reads = self._read_native(job, groups, rest)
        for fr in reads:
            self._guard(job, len(fr.chunk_ids), self._read, job, fr, True)

    # -- the compiled path: zstd and blosc chunk files and inner chunks ---------------------------

    @staticmethod
    def _native_groups(plan: BatchPlan, reads: list[FileRead]) -> tuple[dict, list[FileRead]]:
        """The reads the compiled reader takes, by (codec, decoded chunk size, largest stored chunk), one chunk
        per read (a shard's inner chunks are split out); and the rest, for the Python path."""
        groups: dict[tuple[int, int, int], list[FileRead]] = {}
        rest = []
        for fr in reads:
            codec = plan.sources[plan.chunks[fr.chunk_ids[0]].source].metadata.codec
            kind = _compiled_kind(codec)
            if kind is None:
                rest.append(fr)
            else:
                groups.setdefault((kind, codec.nbytes, codec.max_stored_nbytes), []).extend(
                    [fr] if len(fr.chunk_ids) == 1 else
                    [FileRead.inner_chunk(fr.path, c, plan.chunks[c].offset, plan.chunks[c].length) for c in fr.chunk_ids])
        return groups, rest

    def _read_native(self, job: Job, groups: dict[tuple[int, int, int], list[FileRead]],
                     rest: list[FileRead]) -> list[FileRead]:
        """Read, decode and place the grouped zstd and blosc chunks (whole chunk files and inner chunks of
        shards) in compiled code that holds no GIL (``stoker/csrc``), a few chunks per call; returns
        ``rest`` plus the reads that must take the Python path after all.

        Chunks are grouped by codec and decoded chunk size only (the call needs nothing else), so crops
        over many arrays still make full calls. Chunks with a copy plan (see :func:`copy_plan`) are cast
        into the batch inside the call; the others are viewed through their own array's codec here.
        """
        for (kind, nbytes, stored), frs in groups.items():
            step = max(1, _NATIVE_CALL_BYTES // nbytes)
            for i in range(0, len(frs), step):
                part = frs[i:i + step]
                if _native_bytes(stored, nbytes, len(part)) > self.budget.capacity:
                    rest.extend(part)  # the Python path reserves by actual file size: it may fit
                else:
                    self._guard(job, len(part), self._native_call, job, part, kind, nbytes, stored)
        return rest

    def _native_call(self, job: Job, reads: list[FileRead], kind: int, nbytes: int, stored: int) -> None:
        """One compiled call over ``reads``, each one chunk: a whole file or an inner chunk of a shard, read into
        a buffer of ``stored`` bytes (a larger file is no chunk of these arrays: the Python path refuses it)."""
        plan = job.plan
        tasks = [plan.chunks[fr.chunk_ids[0]] for fr in reads]
        codecs = [plan.sources[t.source].metadata.codec for t in tasks]
        dst = batch_target(job.out)
        if dst is None:
            places = None
        else:
            strides = job.out.stride()
            # batch_target took only a contiguous batch: the planner's offsets hold when its rows are the plan's shape
            planned = tuple(job.out.shape[1:]) == plan.sample_shape
            places = [copy_plan(t, codec, job.out, dst[2], strides, planned) for t, codec in zip(tasks, codecs)]
        shared = places is not None and all(p is not None for p in places)  # every chunk is placed in the call
        res = Reservation(self.budget, users=1)
        if not res.try_reserve(_native_bytes(stored, nbytes, 1 if shared else len(reads))):
            self._handoff_each(job, reads)  # a compute thread never waits for memory (see _read)
            return
        try:
            scratch = res.take(stored, keep=True)[:stored]  # exactly: a larger file is TOO_BIG
            if shared:  # decoded and placed one after the other: one buffer, warm in cache for each chunk
                outs = [res.take(nbytes, keep=True)] * len(reads)
            else:
                outs = [res.take(nbytes, keep=True) for _ in reads]
            regions = []
            for fr, t, codec in zip(reads, tasks, codecs):
                span = (t.byte_start, t.byte_stop) if codec.plain else (0, nbytes)
                # an inner chunk is read only from the shard file its index was read from (else CHANGED)
                regions.append((-1, 0, *span) if fr.whole_file else (t.offset, t.length, *span, *(t.ident or ())))
            results = native.decode_files(kind, [fr.path for fr in reads], regions, scratch, outs, nbytes,
                                          places, dst)
            # chunks decoded and cast in the call are done: account for them together (two locks per call,
            # not per chunk); the others are placed, filled or read again one by one
            placed = [r for r in results if r[0] == native.OK and r[6]]
            if len(placed) < len(results):
                for fr, task, buf, result in zip(reads, tasks, outs, results):
                    if not (result[0] == native.OK and result[6]):
                        self._guard(job, 1, self._place_native, job, fr, task, buf, result)
            n = len(placed)
            if n:  # summed column by column in C (zip, sum): this runs holding the GIL, per call
                _, nread, decoded, read_ns, decode_ns, place_ns, _ = map(sum, zip(*placed))
                self.stats.chunk(decode_ns * 1e-9, place_ns * 1e-9, nread, decoded, read_s=read_ns * 1e-9, count=n)
                job.finish(n, bytes_read=nread, bytes_decoded=decoded, chunks_decoded=n)
        finally:
            res.done()

    def _place_native(self, job: Job, fr: FileRead, task: ChunkTask, buf, result: tuple) -> None:
        """A chunk the call did not cast into the batch: cast it here from ``buf``, or fill, or read it again."""
        status, nread, detail, read_ns, decode_ns = result[:5]
        reader = job.plan.sources[task.source]
        codec = reader.metadata.codec
        if status == native.OK:  # decoded, but no copy plan: layout or dtype left to copy_cast
            t0 = time.perf_counter()
            self._cast_copies(job, task, codec.decoded_view(buf, task.key))
            self.stats.chunk(decode_ns * 1e-9, time.perf_counter() - t0, nread, detail, read_s=read_ns * 1e-9)
            job.finish(bytes_read=nread, bytes_decoded=detail, chunks_decoded=1)
        elif status == native.MISSING and fr.whole_file:  # an absent chunk file is the fill value
            self._fill(job, task, fill_value_as(reader.metadata.fill_value, job.out.dtype))
        elif status == native.OS_ERROR and fr.whole_file:
            raise StorageError(f"cannot read {fr.path}: {os.strerror(detail)}", path=fr.path)
        elif status == native.NOT_REGULAR:
            raise not_regular(fr.path, detail)
        elif status == native.CHANGED:  # the shard is not the file its cached index was read from
            self._relocate(job, fr, True)
        elif status == native.TOO_BIG or native_codec(codec) == native.BLOSC or not fr.whole_file:
            # larger than any stored chunk of this codec (the Python path refuses it unread); blosc: any
            # frame the call declined or could not decode; any failure of an inner chunk of a shard. The
            # Python path reads it again and decides (and words the error) as it always does.
            self._read(job, fr, True)
        elif status == native.SHORT:
            raise DecodeError(f"{reader.uri}: chunk {task.key!r} changed while it was read", uri=reader.uri,
                              key=task.key)
        elif status == native.CODEC_ERROR:
            raise codec.decode_error(task.key, ValueError(native.zstd_error(detail)))
        else:  # native.SIZE
            codec.check_size(detail, task.key)
            raise DecodeError(f"{reader.uri}: chunk {task.key!r}: unknown reader status {status}",
                              uri=reader.uri, key=task.key)

    def _handoff_each(self, job: Job, reads: list[FileRead]) -> None:
        for fr in reads:
            try:
                self._handoff(job, fr)
            except Cancelled:
                job.finish(len(fr.chunk_ids), ShutdownError("the pipeline was closed while this batch was being made"))

    def _guard(self, job: Job, n: int, fn, *args) -> None:
        """Run a task; on any failure (or after the job failed) count its chunks as finished.

        Work skipped because the pipeline is closing finishes with a ShutdownError,
        so a half-filled batch can never be mistaken for a complete one.
        """
        if job.failed:
            job.finish(n)
            return
        if self._closing:
            job.finish(n, ShutdownError("the pipeline was closed while this batch was being made"))
            return
        try:
            fn(*args)
        except Cancelled:
            job.finish(n, ShutdownError("the pipeline was closed while this batch was being made"))
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop
            job.finish(n, exc)

    # -- tasks ------------------------------------------------------------------------------

    def _fill(self, job: Job, task: ChunkTask, fill: torch.Tensor) -> None:
        t0 = time.perf_counter()
        for c in task.copies:
            job.out[c.dst].fill_(fill)
        self.stats.stage("assemble", time.perf_counter() - t0)
        job.finish()

    def _read(self, job: Job, fr: FileRead, on_compute: bool = False, retried: bool = False) -> None:
        """Read one file's share into a pooled buffer, then decode its chunks: right here, one after the
        other, when running on a compute thread, else by handing each chunk to the compute pool.

        The reservation covers the encoded buffer and every chunk's decode scratch, taken in one step.
        A compute thread never waits for memory (the decodes queued behind it may be what frees it):
        when the budget is short it passes the read to an I/O thread, which can wait.

        Inner chunks are read only from the shard file their index was read from; when it changed, they
        are located again in its new index (:meth:`_relocate`), once (``retried``).
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
                    fill = fill_value_as(plan.sources[task.source].metadata.fill_value, job.out.dtype)
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
            self._relocate(job, fr, on_compute)
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
                job.finish(len(fr.chunk_ids) - i, ShutdownError("the pipeline was closed"))
                return

    def _relocate(self, job: Job, fr: FileRead, on_compute: bool) -> None:
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
                self._guard(job, 1, self._fill, job, task, fill_value_as(reader.metadata.fill_value, job.out.dtype))
            else:
                self._guard(job, 1, self._read, job, FileRead.inner_chunk(task.path, cid, task.offset, task.length),
                            on_compute, True)

    def _reserve(self, res: Reservation, nbytes: int, on_compute: bool) -> None:
        """Reserve ``nbytes``: an I/O thread waits for them; a compute thread raises _NoRoom instead."""
        if not on_compute:
            res.reserve(nbytes, self.cancelled)
        elif not res.try_reserve(nbytes):
            raise _NoRoom()

    def _handoff(self, job: Job, fr: FileRead, retried: bool = False) -> None:
        try:
            self._io.submit(self._guard, job, len(fr.chunk_ids), self._read, job, fr, False, retried)
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
        if not codec.partial or f.size <= blosc_partial.HEADER_SIZE:
            return read(0, f.size), None
        try:
            nread = read(0, blosc_partial.HEADER_SIZE)
            header = view[: blosc_partial.HEADER_SIZE]
            if not blosc_partial.partial_ok(header, codec.nbytes, task.byte_start, task.byte_stop):
                return nread + read(blosc_partial.HEADER_SIZE, f.size), None  # decoded (or rejected) in full
            table = min(blosc_partial.table_size(header), f.size)
            nread += read(blosc_partial.HEADER_SIZE, table)
            lo, hi = blosc_partial.stored_range(view[:table], task.byte_start, task.byte_stop)
        except blosc_partial.PartialDecodeError as exc:
            raise DecodeError(f"{reader.uri}: chunk {task.key!r} is not a valid blosc frame ({exc})",
                              uri=reader.uri, key=task.key) from None
        return nread + read(max(lo, table), hi), hi

    @staticmethod
    def _cast_copies(job: Job, task: ChunkTask, chunk) -> None:
        """Cast every copy of ``task`` from its decoded ``chunk`` into the batch (the Python path's cast)."""
        out = job.out if job.out_np is None else job.out_np
        for c in task.copies:
            copy_cast(out[c.dst], chunk[c.chunk_sel])

    def _guard_decode(self, job: Job, task: ChunkTask, encoded: memoryview, res: Reservation,
                      read_end: int | None = None) -> None:
        try:
            self._guard(job, 1, self._decode, job, task, encoded, res, read_end)
        finally:
            res.done()

    def _decode(self, job: Job, task: ChunkTask, encoded: memoryview, res: Reservation,
                read_end: int | None = None) -> None:
        reader = job.plan.sources[task.source]
        codec = reader.metadata.codec
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

