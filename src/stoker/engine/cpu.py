"""The CPU executor: I/O threads read encoded bytes, compute threads decode and assemble.

Contract with the pipeline: :meth:`CpuExecutor.submit` takes a plan and the batch
tensor to fill and returns a :class:`Job` whose ``done`` event is set when every
chunk is in place or the first error happened (``job.error``).

Per file read, the I/O task reserves everything the read will need (encoded
bytes plus decode scratch) from the transient budget in one step, so work that
holds memory never waits for more memory.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import DecodeError
from ..storage import LocalStore
from ..zarr.codecs import blosc_header
from .buffers import Cancelled, TransientBudget
from .cast import copy_cast, fill_value_as
from .plan import BatchPlan, ChunkTask, FileRead
from .stats import StatsRecorder


class Job:
    """One batch in flight."""

    def __init__(self, plan: BatchPlan, out: torch.Tensor, n_chunks: int) -> None:
        self.plan = plan
        self.out = out
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._remaining = n_chunks
        self._lock = threading.Lock()
        if n_chunks == 0:
            self.done.set()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def finish(self, n: int = 1, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._remaining -= n
            if self._remaining <= 0 or self.error is not None:
                self.done.set()


class _Lease:
    """A reservation shared by the chunks of one file read; returned when the last one is done."""

    __slots__ = ("budget", "nbytes", "users", "lock")

    def __init__(self, budget: TransientBudget, nbytes: int, users: int) -> None:
        self.budget, self.nbytes, self.users, self.lock = budget, nbytes, users, threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.budget.release(self.nbytes)


class CpuExecutor:
    """Thread pools plus the transient budget; one per pipeline."""

    def __init__(self, n_io: int, n_compute: int, budget: TransientBudget, stats: StatsRecorder,
                 store: LocalStore) -> None:
        self.budget = budget
        self.stats = stats
        self.store = store
        self._io = ThreadPoolExecutor(n_io, thread_name_prefix="stoker-io")
        self._compute = ThreadPoolExecutor(n_compute, thread_name_prefix="stoker-compute")
        self._closing = False

    def cancelled(self) -> bool:
        return self._closing

    def shutdown(self) -> None:
        """Cancel queued work; running tasks stop at their next check."""
        self._closing = True
        self._io.shutdown(wait=False, cancel_futures=True)
        self._compute.shutdown(wait=False, cancel_futures=True)

    # -- submission -------------------------------------------------------------------------

    def submit(self, plan: BatchPlan, out: torch.Tensor) -> Job:
        job = Job(plan, out, len(plan.chunks))
        fills = {}
        for cid in plan.fill_chunks:
            task = plan.chunks[cid]
            if task.source not in fills:
                fills[task.source] = fill_value_as(plan.sources[task.source].metadata.fill_value, out.dtype)
            self._compute.submit(self._guard, job, 1, self._fill, job, task, fills[task.source])
        for fr in plan.file_reads:
            self._io.submit(self._guard, job, len(fr.chunk_ids), self._read, job, fr)
        return job

    def _guard(self, job: Job, n: int, fn, *args) -> None:
        """Run a task; on any failure (or after the job failed) count its chunks as finished."""
        if job.failed or self._closing:
            job.finish(n)
            return
        try:
            fn(*args)
        except Cancelled:
            job.finish(n)
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer at pop
            job.finish(n, exc)

    # -- tasks ------------------------------------------------------------------------------

    def _fill(self, job: Job, task: ChunkTask, fill: torch.Tensor) -> None:
        t0 = time.perf_counter()
        for c in task.copies:
            job.out[c.row][c.box_sel].fill_(fill)
        self.stats.stage("assemble", time.perf_counter() - t0)
        job.finish()

    def _read(self, job: Job, fr: FileRead) -> None:
        plan = job.plan
        chunks = [plan.chunks[c] for c in fr.chunk_ids]
        scratch = sum(plan.sources[c.source].metadata.codec.nbytes for c in chunks)
        if fr.whole_file:
            encoded_size = self.store.size(fr.path)
            if encoded_size is None:  # an absent chunk file is the fill value
                fill = fill_value_as(plan.sources[chunks[0].source].metadata.fill_value, job.out.dtype)
                self._fill(job, chunks[0], fill)
                return
        else:
            encoded_size = sum(r.length for r in fr.reads)
        lease = _Lease(self.budget, encoded_size + scratch, len(chunks))
        self.budget.reserve(lease.nbytes, self.cancelled)
        try:
            t0 = time.perf_counter()
            pieces: dict[int, memoryview] = {}
            if fr.whole_file:
                data = self.store.read(fr.path)
                if data is None:
                    raise DecodeError(f"{fr.path} vanished while the batch was being read", key=chunks[0].key)
                pieces[fr.chunk_ids[0]] = memoryview(data)
                nread = len(data)
            else:
                nread = 0
                for read in fr.reads:
                    buf = self.store.read_range(fr.path, read.offset, read.length)
                    if buf is None or len(buf) != read.length:
                        raise DecodeError(
                            f"{plan.sources[chunks[0].source].uri}: shard {fr.path!r} is shorter than its index "
                            f"claims (wanted [{read.offset}, {read.offset + read.length}))",
                            key=chunks[0].key,
                        )
                    nread += len(buf)
                    view = memoryview(buf)
                    for i, sl in read.slices():
                        pieces[fr.chunk_ids[i]] = view[sl]
            self.stats.stage("io", time.perf_counter() - t0, bytes_out=nread)
            self.stats.add(bytes_read=nread)
        except BaseException:
            self.budget.release(lease.nbytes)
            raise
        for cid in fr.chunk_ids:
            self._compute.submit(self._guard_decode, job, plan.chunks[cid], pieces[cid], lease)

    def _guard_decode(self, job: Job, task: ChunkTask, encoded: memoryview, lease: _Lease) -> None:
        try:
            self._guard(job, 1, self._decode, job, task, encoded)
        finally:
            lease.done()

    def _decode(self, job: Job, task: ChunkTask, encoded: memoryview) -> None:
        reader = job.plan.sources[task.source]
        codec = reader.metadata.codec
        t0 = time.perf_counter()
        scratch = None
        if codec.partial:
            scratch = self.budget.take_scratch(codec.nbytes)
            chunk = scratch.view(codec.dtype).reshape(codec.shape)
            codec.decode_range_into(encoded, chunk, task.byte_start, task.byte_stop, task.key)
            decoded = _blosc_decoded_bytes(encoded, task.byte_start, task.byte_stop, codec.nbytes)
        else:
            chunk = codec.decode(encoded, task.key)
            decoded = codec.nbytes
        t1 = time.perf_counter()
        self.stats.stage("decode", t1 - t0, bytes_in=len(encoded), bytes_out=decoded)
        try:
            for c in task.copies:
                copy_cast(job.out[c.row][c.box_sel], chunk[c.chunk_sel])
        finally:
            if scratch is not None:
                self.budget.give_scratch(scratch)
        self.stats.stage("assemble", time.perf_counter() - t1)
        self.stats.add(chunks_decoded=1, bytes_decoded=decoded)
        job.finish()


def _blosc_decoded_bytes(encoded: memoryview, start: int, stop: int, nbytes: int) -> int:
    """Bytes blosc really decompressed for a range: whole blocks around it."""
    try:
        _, blocksize, _ = blosc_header(encoded)
    except ValueError:
        return nbytes
    if not blocksize:
        return nbytes
    lo = start // blocksize * blocksize
    hi = min(-(-stop // blocksize) * blocksize, nbytes)
    return hi - lo
