"""``Pipeline``: samples in, equally shaped batches out, in push order, inside a fixed memory budget.

>>> cfg = stoker.Config(batch_size=8, dtype="f32", host_buffer_bytes=256 << 20)
>>> with stoker.Pipeline(cfg) as p:
...     p.push(samples)                      # any iterable of Sample, also an infinite generator
...     for step in range(100):
...         with p.pop() as batch:
...             x = torch.from_dlpack(batch)  # (8, *sample_shape), zero-copy

One coordinator thread pulls samples lazily (only when a batch slot and
lookahead room are free), plans each batch and hands it to the executor. The
consumer's ``pop`` takes batches in push order. Errors are sticky: once ``pop``
raised one, every later ``pop`` and ``push`` raises it again.

On a CUDA device (``Config(device=local_rank)``, or ``None`` with CUDA available)
each batch is assembled in pinned host memory in its source dtype, copied on a
side stream and cast on the GPU (:mod:`stoker.engine.transfer`); ``from_dlpack``
makes the consumer's stream wait for it, and ``release(event=...)`` says when the
consumer is done with it.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch

from .. import gil
from ..array import DEFAULT_INDEX_CACHE_BYTES, ArrayReader, index_size, open_array
from ..cache import SizedLRU
from ..config import Config
from ..errors import (
    BudgetExceeded, DtypeMismatch, InvalidArgument, PoolStarved, RankMismatch, ShutdownError, StokerError,
)
from ..sample import Sample
from ..storage import LocalStore
from .batch import Batch
from . import device as devices
from .buffers import SlotRing, TransientBudget, pinned_footprint, size_class
from .cast import batch_dtype
from .cpu import CpuExecutor, Job, reads_one_by_one
from .plan import plan_batch
from .stats import Stats, StatsRecorder

_MAX_OPEN_ARRAYS = 16384


class _Entry:
    """A batch in flight: a running job, or an error to deliver in its place."""

    __slots__ = ("job", "slot", "host_slot", "event", "error", "batch_id", "rows", "source_ids")

    def __init__(self, batch_id: int, rows: int, job: Job | None = None, slot=None,
                 error: BaseException | None = None) -> None:
        self.batch_id, self.rows, self.job, self.slot, self.error = batch_id, rows, job, slot, error
        self.host_slot = None  # CUDA path: the pinned staging slot (``slot`` is then on the device)
        self.event = None  # CUDA path: recorded after the batch's copy and cast
        self.source_ids: list[int] = []

    def ready(self, timeout: float) -> bool:
        return self.job is None or self.job.done.wait(timeout)


class Pipeline:
    """Turns a stream of :class:`~stoker.Sample` into batches. One per rank; see the module docstring."""

    def __init__(self, cfg: Config) -> None:
        if not isinstance(cfg, Config):
            raise InvalidArgument(f"Pipeline needs a stoker.Config, got {type(cfg).__name__}")
        self.cfg = cfg
        self.device = devices.resolve(cfg.device)
        self._cuda = self.device.type == "cuda"
        self._n_slots = cfg.lookahead_batches + 1  # batch slots the consumer sees (on the device for CUDA)
        # CUDA: host slots only stage batches being assembled; each is free again once its copy is done
        self._n_host_slots = cfg.lookahead_batches if self._cuda else self._n_slots
        if cfg.sample_shape is not None and cfg.output_dtype is not None:
            self._check_budget(cfg.sample_shape, cfg.output_dtype, transient=0)
        self._stats = StatsRecorder()
        self._store = LocalStore()
        self._index_cache = SizedLRU(DEFAULT_INDEX_CACHE_BYTES, index_size)
        self._readers: SizedLRU = SizedLRU(_MAX_OPEN_ARRAYS, lambda _: 1)
        self._slots: SlotRing | None = None  # what batches are delivered from (device slots for CUDA)
        self._host_slots: SlotRing | None = None  # where batches are assembled (the same ring on CPU)
        self._transfer = None  # CudaTransfer on the CUDA path
        self._budget: TransientBudget | None = None
        self._executor: CpuExecutor | None = None
        self._cond = threading.Condition()
        # (iterator, counted, source id): sized pushes are counted in `pending` at push, generators as pulled
        self._sources: collections.deque[tuple[Iterator[Any], bool, int]] = collections.deque()
        self._staged: list[tuple[Sample, int]] = []  # pulled, not yet in a batch, with their source id
        self._source_ids = itertools.count()
        self._resumable: dict[int, Any] = {}  # source id -> iterator that can report state_after(n)
        self._popped: collections.Counter[int] = collections.Counter()  # source id -> samples popped
        self._batches_popped = 0
        self._inflight: collections.deque[_Entry] = collections.deque()
        self._error: BaseException | None = None
        self._closed = False
        self._flush = False
        self._launching = False  # samples taken from the sources but not yet in _inflight
        self._pending = 0
        self._shape: tuple[int, ...] | None = cfg.sample_shape
        # One read group (a shard's coalesced inner chunks plus their decode scratch) reserves at most this.
        self._group_limit = min(8 << 20, cfg.host_buffer_bytes // 16)
        self._batch_ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._pop_lock = threading.Lock()  # pop is single-consumer: concurrent pops take turns

    # -- budget -----------------------------------------------------------------------------

    def _check_budget(self, shape: tuple[int, ...], dtype: torch.dtype, transient: int) -> None:
        """BudgetExceeded unless the host slots plus ``transient`` fit host_buffer_bytes (and, on CUDA,
        the device slots plus staging fit device_buffer_bytes), with a breakdown of the need."""
        slot_bytes = self.cfg.batch_size * math.prod(shape) * dtype.itemsize
        n = self._n_host_slots
        host_slot = pinned_footprint(slot_bytes) if self._cuda else slot_bytes
        need = n * host_slot + transient
        if need > self.cfg.host_buffer_bytes:
            what = ("pinned staging slots (lookahead_batches)" if self._cuda else "batch slots (lookahead_batches + 1)")
            pinned = (f", each pinned as {host_slot:,} B (torch rounds pinned memory up to a power of two)"
                      if host_slot != slot_bytes else "")
            raise BudgetExceeded(
                f"Config.host_buffer_bytes={self.cfg.host_buffer_bytes:,} cannot hold this pipeline: "
                f"{n} {what} x {self.cfg.batch_size} samples x {shape} x {dtype.itemsize} B{pinned} = "
                f"{n * host_slot:,} B, "
                f"plus at least {transient:,} B for reading and decoding one file's chunks; needs {need:,} B. Raise "
                f"host_buffer_bytes to at least {need:,}, or lower batch_size, lookahead_batches or the sample shape.",
                knob="host_buffer_bytes", needed=need,
            )
        if self._cuda:
            device_need = self._n_slots * slot_bytes + _stage_bytes(slot_bytes, self.cfg.output_dtype)
            if device_need > self.cfg.device_buffer_bytes:
                raise BudgetExceeded(
                    f"Config.device_buffer_bytes={self.cfg.device_buffer_bytes:,} cannot hold this pipeline on "
                    f"{self.device}: {self._n_slots} batch slots (lookahead_batches + 1) x {slot_bytes:,} B plus "
                    f"{device_need - self._n_slots * slot_bytes:,} B of staging for the cast on the device; needs "
                    f"{device_need:,} B. Raise device_buffer_bytes, or lower batch_size, lookahead_batches or the "
                    "sample shape.",
                    knob="device_buffer_bytes", needed=device_need,
                )

    # -- push -------------------------------------------------------------------------------

    def push(self, samples: Sample | Iterable[Sample]) -> None:
        """Queue samples: one Sample, a sequence (checked now), a sharded source (pulled lazily, its
        position tracked for :meth:`state_dict`) or any iterable (pulled lazily, checked then)."""
        with self._cond:
            self._raise_if_unusable()
        if isinstance(samples, Sample):
            samples = [samples]
        if not isinstance(samples, Iterable):
            raise InvalidArgument(f"push takes a Sample or an iterable of Samples, got {type(samples).__name__}")
        it = iter(samples)
        if hasattr(it, "state_after"):  # a resumable source (ShardedSource): pulled lazily, position tracked
            with self._cond:
                sid = next(self._source_ids)
                self._resumable[sid] = it
                self._sources.append((it, False, sid))
                self._cond.notify_all()
        elif isinstance(samples, Sized) and not isinstance(samples, Iterator):
            items = list(it)
            shape = self._shape
            for s in items:
                shape = self._validate(s, shape)
            with self._cond:
                self._shape = self._shape or shape
                self._sources.append((iter(items), True, next(self._source_ids)))
                self._pending += len(items)
                self._cond.notify_all()
        else:
            with self._cond:
                self._sources.append((it, False, next(self._source_ids)))
                self._cond.notify_all()
        self._start()

    def _validate(self, s: Any, shape: tuple[int, ...] | None) -> tuple[int, ...]:
        if not isinstance(s, Sample):
            raise InvalidArgument(f"expected stoker.Sample, got {type(s).__name__}: {s!r}")
        if shape is None:
            return s.shape
        if len(s.shape) != len(shape):
            raise RankMismatch(f"{s} has {len(s.shape)} axes, the batch's samples have {len(shape)} {shape}",
                               uri=s.uri)
        if s.shape != shape:
            raise InvalidArgument(f"{s} has shape {s.shape}; every sample of this pipeline must be {shape} "
                                  "(set Config.sample_shape, or make all boxes the same size)", uri=s.uri)
        return shape

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ShutdownError("the pipeline is closed")

    def _start(self) -> None:
        with self._cond:
            if self._thread is None and not self._closed:
                # The thread holds only a weak reference, so a pipeline nobody closed can still be
                # collected (its __del__ closes it) instead of living on through its own thread.
                self._thread = threading.Thread(target=_coordinate, args=(weakref.ref(self),),
                                                name="stoker-coordinator", daemon=True)
                self._thread.start()

    @property
    def pending(self) -> int:
        """Pushed samples not yet in a popped batch (generators count as far as they have been pulled)."""
        with self._cond:
            return self._pending

    # -- coordinator ------------------------------------------------------------------------

    def _cycle(self) -> bool:
        """One round of the coordinator: wait (at most 0.1 s) for room, then launch one batch.

        Returns False when the pipeline is closed.
        """
        with self._cond:
            if not self._closed and (
                len(self._inflight) >= self.cfg.lookahead_batches
                or (not self._sources and not (self._flush and self._staged))
            ):
                self._cond.wait(0.1)
                return not self._closed
            if self._closed:
                return False
        samples, error = self._pull()
        if samples:
            self._launch(samples)
        if error is not None:
            with self._cond:
                self._inflight.append(_Entry(next(self._batch_ids), 0, error=error))
                self._sources.clear()
        with self._cond:
            self._launching = False
            self._cond.notify_all()
        return True

    def _crashed(self, exc: BaseException) -> None:
        """A bug in the coordinator must reach the consumer, not vanish with the thread."""
        with self._cond:
            if self._error is None and not self._closed:
                self._inflight.append(_Entry(-1, 0, error=exc))
            self._cond.notify_all()

    def _pull(self) -> tuple[list[Sample], BaseException | None]:
        """Up to batch_size samples (a short batch only when flushing), or an error from the source."""
        want = self.cfg.batch_size
        while len(self._staged) < want:
            with self._cond:
                if self._closed or not self._sources:
                    break
                source, counted, sid = self._sources[0]
            try:
                sample = next(source)  # user code: outside the lock
            except StopIteration:
                with self._cond:
                    if self._sources and self._sources[0][0] is source:
                        self._sources.popleft()
                continue
            except BaseException as exc:  # noqa: BLE001
                return self._take_before_error(), exc if isinstance(exc, StokerError) else _wrap_source_error(exc)
            try:
                shape = self._validate(sample, self._shape)
            except StokerError as exc:
                return self._take_before_error(), exc
            with self._cond:
                self._shape = self._shape or shape
                if not counted:
                    self._pending += 1
            self._staged.append((sample, sid))
        with self._cond:
            if len(self._staged) >= want or (self._flush and not self._sources):
                self._flush = False
                batch = self._take()
                self._launching = bool(batch)
                return batch, None
        return [], None

    def _take_before_error(self) -> list[Sample]:
        """Samples staged before a source error: a short batch only when drop_last is off."""
        with self._cond:
            self._launching = True
            batch = self._take()
            if self.cfg.drop_last and len(batch) < self.cfg.batch_size:
                self._pending = max(0, self._pending - len(batch))
                return []
            return batch

    def _take(self) -> list[Sample]:
        batch, self._staged = self._staged[: self.cfg.batch_size], self._staged[self.cfg.batch_size :]
        return batch

    def _open(self, uri: str) -> ArrayReader:
        return self._readers.get_or_load(uri, lambda: open_array(uri, store=self._store, index_cache=self._index_cache))

    def _launch(self, staged: list[tuple[Sample, int]]) -> None:
        samples = [s for s, _ in staged]
        source_ids = [sid for _, sid in staged]
        batch_id = next(self._batch_ids)
        t0 = time.perf_counter()
        if self._closed:
            return
        try:
            # The arrays' metadata settles the dtype and the budget before planning: a crop too large for
            # host_buffer_bytes is refused before its plan (chunk lists of its whole volume) is built.
            readers = list({s.uri: self._open(s.uri) for s in samples}.values())
            dtype = self._batch_dtype(readers)
            self._ensure_buffers(samples[0].shape, readers, dtype)
            plan = plan_batch(batch_id, samples, self._open, max_group=self._group_limit, sizing=size_class,
                              one_by_one=reads_one_by_one)
        except BaseException as exc:  # noqa: BLE001 - delivered at pop, in order
            with self._cond:
                self._inflight.append(_Entry(batch_id, len(samples), error=exc))
                self._cond.notify_all()
            return
        self._stats.stage("plan", time.perf_counter() - t0)
        entry = _Entry(batch_id, plan.rows)
        entry.source_ids = source_ids
        if self._cuda:
            entry.slot = self._acquire(self._slots)
            entry.host_slot = self._acquire(self._host_slots)
            stage = devices.staging_dtype(self.cfg.output_dtype, {r.dtype for r in plan.sources}) or dtype
            host = entry.host_slot.view(stage, (plan.rows, *plan.sample_shape))
            entry.job = self._executor.submit(plan, host, then=lambda job: self._to_device(entry, job))
        else:
            entry.slot = entry.host_slot = self._acquire(self._slots)
            entry.job = self._executor.submit(plan, entry.slot.tensor[: plan.rows])
        with self._cond:
            self._inflight.append(entry)
            self._cond.notify_all()

    def _batch_dtype(self, readers: list[ArrayReader]) -> torch.dtype:
        dtypes = {batch_dtype(self.cfg.output_dtype, r.dtype, r.uri) for r in readers}
        if self._slots is not None:
            dtypes.add(self._slots.dtype)
        if len(dtypes) > 1:
            raise DtypeMismatch(
                f"dtype='native' needs one source dtype per pipeline, found {sorted(map(str, dtypes))} "
                f"(arrays {[r.uri for r in readers]}); pick dtype='f32', 'bf16' or 'f16' to mix sources"
            )
        return dtypes.pop()

    def _ensure_buffers(self, sample_shape: tuple[int, ...], readers: list[ArrayReader], dtype: torch.dtype) -> None:
        if self._slots is not None:
            return
        # The largest single reservation: one read group, or one chunk's encoded bytes (at most its
        # decoded size plus codec overhead for what we read) and its decode scratch.
        chunk = max(size_class(r.metadata.codec.nbytes) for r in readers)
        transient = max(self._group_limit, 2 * chunk + size_class(1))
        self._check_budget(sample_shape, dtype, transient)
        batch_shape = (self.cfg.batch_size, *sample_shape)
        if self._cuda:
            from .transfer import CudaTransfer

            slot_bytes = math.prod(batch_shape) * dtype.itemsize
            # byte slots: each batch is assembled in its own staging dtype (see device.staging_dtype)
            with torch.cuda.device(self.device):  # pinning needs a CUDA context: this GPU's, not GPU 0's
                self._host_slots = SlotRing(self._n_host_slots, (slot_bytes,), torch.uint8, pin=True)
            self._transfer = CudaTransfer(self.device, self._n_slots, batch_shape, dtype,
                                          _stage_bytes(slot_bytes, self.cfg.output_dtype))
            self._slots = self._transfer.slots
        else:
            self._slots = self._host_slots = SlotRing(self._n_slots, batch_shape, dtype)
        self._budget = TransientBudget(self.cfg.host_buffer_bytes - self._host_slots.nbytes)
        self._executor = CpuExecutor(self.cfg.n_io_threads, self.cfg.compute_threads, self._budget,
                                     self._stats, self._store)

    def _acquire(self, ring: SlotRing):
        slot = None
        while slot is None:
            slot = ring.acquire(lambda: self._closed, timeout=0.1)
        return slot

    def _to_device(self, entry: _Entry, job: Job) -> None:
        """The job's completion hook on the CUDA path: enqueue copy and cast, free the host slot behind them."""
        t0 = time.perf_counter()
        host = job.out
        entry.event = self._transfer.issue(host, entry.slot)
        job.out = job.out_np = None  # no view may keep the staging slot from its next batch
        self._host_slots.release(entry.host_slot, ready_after=entry.event)
        self._stats.stage("transfer", time.perf_counter() - t0, bytes_in=host.numel() * host.element_size())

    # -- pop --------------------------------------------------------------------------------

    def pop(self, timeout: float | None = None) -> Batch:
        """The next batch, in push order. Raises the pipeline's (sticky) error, or PoolStarved on timeout.

        One consumer at a time: concurrent calls are serialised.
        """
        limit = self.cfg.pop_timeout_s if timeout is None else timeout
        with self._pop_lock:
            return self._pop(limit, _deadline(limit))

    def _pop(self, limit: float | None, deadline: float | None) -> Batch:
        t0 = time.perf_counter()
        while True:
            with self._cond:
                self._raise_if_unusable()
                if not self._inflight and not self._sources and self._staged and not self.cfg.drop_last:
                    self._flush = True
                    self._cond.notify_all()
                head = self._inflight[0] if self._inflight else None
            if head is not None and head.ready(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))):
                break
            if head is None:
                with self._cond:
                    self._cond.wait(0.01)
            if deadline is not None and time.monotonic() >= deadline:
                raise PoolStarved(self._starved_message(limit))
        with self._cond:
            self._raise_if_unusable()  # closed while we waited: the batch may be incomplete
            self._inflight.popleft()
            self._cond.notify_all()
        error = head.error or (head.job.error if head.job else None)
        if error is not None:
            if head.slot is not None:
                self._slots.release(head.slot)
            if head.host_slot is not None and head.host_slot is not head.slot:
                self._host_slots.release(head.host_slot)
            with self._cond:
                self._error = error
            raise error
        rows = head.rows
        view = head.slot.tensor[:rows]
        samples = head.job.plan.samples
        plan = head.job.plan
        with self._cond:
            self._pending = max(0, self._pending - rows)
            self._popped.update(head.source_ids)
            self._batches_popped += 1
        wait = time.perf_counter() - t0
        self._stats.stage("pop_wait", wait)
        self._stats.add(
            batches_emitted=1, samples=rows, chunks_needed=plan.chunks_needed,
            chunk_dedup_hits=plan.chunks_needed - len(plan.chunks),
            bytes_delivered=view.numel() * view.element_size(), bytes_needed=plan.bytes_needed,
            **head.job.counts,
        )
        slots = self._slots
        slot = head.slot
        return Batch(view, samples, head.batch_id, lambda waits: slots.release(slot, stream_waits=waits),
                     ready_event=head.event, ready_stream=self._transfer.stream if self._transfer else None)

    def _starved_message(self, limit: float) -> str:
        with self._cond:
            held = self._slots.held() if self._slots is not None else 0
            if self._slots is not None and held >= self._n_slots:
                return (
                    f"no batch within pop_timeout_s={limit}: the consumer holds all {self._n_slots} batch slots. "
                    "Release batches (use `with p.pop() as batch:`), drop tensors made from old batches, or "
                    "keep data with `.clone()`."
                )
            if not self._sources and not self._inflight:
                staged = len(self._staged)
                extra = (f" {staged} samples wait for a full batch of {self.cfg.batch_size}; push more or set "
                         "Config(drop_last=False).") if staged else ""
                return f"no batch within pop_timeout_s={limit}: no samples are pending; push more.{extra}"
            if not self._inflight and not self._launching:
                return (f"no batch within pop_timeout_s={limit}: the pushed samples have not filled a batch yet "
                        f"({len(self._staged)} of {self.cfg.batch_size} pulled so far); the pushed iterable "
                        "yields samples slower than the timeout (make it faster, or raise pop_timeout_s)")
            return (f"no batch within pop_timeout_s={limit}: {len(self._inflight)} batches in flight; storage or "
                    "decoding is slower than the timeout (raise pop_timeout_s or check p.stats())")

    def batches(self, n: int) -> Iterator[Batch]:
        """Yield ``n`` batches (each released when the next is requested)."""
        for _ in range(n):
            batch = self.pop()
            try:
                yield batch
            finally:
                batch.release()

    def __iter__(self) -> Iterator[Batch]:
        """Yield batches until the pushed samples are used up (a final short batch only with drop_last=False).

        Each wait for the next batch is bounded by ``pop_timeout_s``, as :meth:`pop` is.
        """
        limit = self.cfg.pop_timeout_s
        while True:
            deadline = _deadline(limit)
            with self._pop_lock:
                if not self._wait_for_work(limit, deadline):
                    return
                batch = self._pop(limit, deadline)
            try:
                yield batch
            finally:
                batch.release()

    def _wait_for_work(self, limit: float | None, deadline: float | None) -> bool:
        """True once a batch is in flight; False when nothing more can come from what was pushed.
        PoolStarved past ``deadline`` (the coordinator may be waiting for a slot the consumer holds)."""
        with self._cond:
            while True:
                self._raise_if_unusable()
                if self._inflight:
                    return True
                if not self._sources and not self._launching and not self._flush:
                    if self._staged and not self.cfg.drop_last:
                        self._flush = True
                        self._cond.notify_all()
                    else:
                        return False
                if deadline is not None and time.monotonic() >= deadline:
                    break
                self._cond.wait(0.05)
        raise PoolStarved(self._starved_message(limit))

    # -- resumption -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The position of every resumable pushed source as of the last **popped** batch.

        Batches prepared ahead (the lookahead) do not count, so a checkpoint written
        after training step k resumes with batch k + 1 exactly::

            state = p.state_dict()                       # {"sources": [...], "batches": k}
            source.load_state_dict(state["sources"][0])  # later, possibly on another world size
        """
        with self._cond:
            return {
                "sources": [it.state_after(self._popped[sid]) for sid, it in self._resumable.items()],
                "batches": self._batches_popped,
            }

    # -- stats and lifetime -----------------------------------------------------------------

    def stats(self) -> Stats:
        slots = self._host_slots.nbytes if self._host_slots is not None else 0
        peak = self._budget.peak if self._budget is not None else 0
        return self._stats.snapshot(peak_host_bytes=slots + peak)

    def stats_reset(self) -> None:
        self._stats.reset()

    def close(self) -> None:
        """Cancel in-flight work and stop threads; returns within about a second. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._executor is not None:
            self._executor.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)  # a user generator blocked in next() cannot be interrupted
        if self._transfer is not None:
            self._transfer.close()
        self._store.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def _coordinate(ref: "weakref.ReferenceType[Pipeline]") -> None:
    """The coordinator thread: run cycles while the pipeline is alive and open."""
    gil.enroll()  # its GIL time is the pipeline's (charged at each batch's "plan" report)
    while True:
        pipeline = ref()
        if pipeline is None:
            return
        try:
            if not pipeline._cycle():
                return
        except BaseException as exc:  # noqa: BLE001
            pipeline._crashed(exc)
            return
        del pipeline  # hold no strong reference while idle


def _deadline(limit: float | None) -> float | None:
    """When a wait of ``limit`` seconds (None: unbounded) that starts now ends, on the monotonic clock."""
    return None if limit is None else time.monotonic() + limit


def _stage_bytes(slot_bytes: int, output: torch.dtype | None) -> int:
    """Device staging for the cast on the GPU: a batch in a dtype narrower than the output (at most half)."""
    if output is None or output.itemsize < 2:
        return 0
    return slot_bytes // 2


def _wrap_source_error(exc: BaseException) -> StokerError:
    err = InvalidArgument(f"the pushed sample iterable raised {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
