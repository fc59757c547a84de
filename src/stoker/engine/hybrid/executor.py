"""The hybrid executor (``Config.decode_on="hybrid"``): each batch's chunks shared between the CPU engine and
the GPU decode, in shares that make both finish together.

Two executors, composed through the executor contract (:mod:`stoker.engine.executor`), make each batch:

- the CPU part (:class:`~.host.HostPart`, the CPU executor's decoders): its chunks decoded, cast and placed
  by the compiled engine's threads into a host slot (pinned on a GPU), in the dtype the GPU part assembles
  the batch in, so the host part is the CPU path's bits;
- the GPU part (:class:`~stoker.engine.gpu.executor.GpuDecodeExecutor`, whose slots are the delivered
  ones): its chunks cross encoded and are decoded and placed on the device. Before it writes any chunk, its
  thread waits for the CPU part and queues the host part's copy into the batch on its stream (the
  :attr:`~stoker.engine.executor.Target.before` hook), so its own chunks land over that copy, never under
  it; then it fills its missing chunks, fills the padding, decodes CF attributes, runs the transform and
  records the batch's event, as it does alone.

The split (:mod:`.split`) is by unique chunk: each is placed by exactly one side. Chunks of arrays the device
does not decode go to the CPU part; the rest are cut by decoded bytes in the ratio of the two sides'
measured rates (:class:`~.split.Shares`: bytes per second of each side's own work, smoothed; the GPU
part's time excludes its wait for the host part), each side keeping at least
:data:`~.split.MIN_SHARE`. The GPU part runs every batch, even one it places no chunk of, since it
finishes it.

Errors: either part's first error fails the batch (the same typed errors as the CPU path: the GPU decode
decodes a chunk that fails on the device again on the CPU for its error), and stops the other part; a
failing part never leaves the other waiting (every wait is bounded and checks ``shutdown``).

Memory: ``host_buffer_bytes`` is split, a quarter (:data:`GPU_HOST_SHARE`) for the GPU part's staging and
the rest for the CPU part's slots and decode scratch; ``device_buffer_bytes`` is the GPU part's (the host
part is copied straight into its batch).

Without a GPU the same executor runs on CPU tensors (:meth:`HybridExecutor.on_host`: the GPU part's stream
decoder is :class:`~stoker.engine.gpu.reference.HostDecoder`), which is how it is tested here.

>>> ex = HybridExecutor(cfg, torch.device("cuda", 0), stats, store)
>>> ex.shares.gpu_fraction()
0.5
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from ...errors import BudgetExceeded, pipeline_closed
from ..executor import Delivery, Job, Target
from ..gpu.executor import GpuDecodeExecutor
from ..gpu.sources import CPU, Described
from ..planning.tables import TablePlan, plan_tables
from .host import HostPart
from .split import Shares, chunk_costs, split, subset

if TYPE_CHECKING:
    from ...config import Config
    from ...reader.array import ArrayReader
    from ...sampling.sample import Sample
    from ...storage import LocalStore
    from ..buffers import Slot, SlotRing
    from ..cpu.decode_native import SharedEngine
    from ..gpu.streams import CloseWait, HostStreams
    from ..stats import StatsRecorder

__all__ = ["GPU_HOST_SHARE", "HybridExecutor"]

#: the share of host_buffer_bytes the GPU part's staging gets (the CPU part's slots and scratch the rest)
GPU_HOST_SHARE = 0.25


def _gpu_part_config(cfg: Config) -> Config:
    """``cfg`` for the GPU part: its share of ``host_buffer_bytes`` (at least 1 MiB) for its staging."""
    return dataclasses.replace(cfg, host_buffer_bytes=max(1 << 20, int(cfg.host_buffer_bytes * GPU_HOST_SHARE)))


@dataclasses.dataclass
class _Target(Target):
    """A hybrid batch's target: the delivered slot's (``gpu``, the GPU part's) and the host part's."""

    gpu: Target | None = None
    host: Target | None = None
    parts: "_Parts | None" = None


class _Parts:
    """One batch's two parts: the CPU part's job and host slot, the timings the rates are measured from."""

    def __init__(self, job: Job, host: Target | None, submitted: float) -> None:
        self.job = job
        self.host = host
        self.cpu_job: Job | None = None
        self.gpu_job: Job | None = None
        self.cpu_bytes = self.gpu_bytes = 0
        self.submitted = submitted
        self.cpu_done = 0.0  # when the CPU part's last chunk was placed
        self.gpu_begun = 0.0  # when the GPU part's thread began the batch
        self.blocked = 0.0  # seconds the GPU part waited for the host part
        self.host_bytes = 0  # the host part's bytes copied to the device
        self.lock = threading.Lock()  # lock rank 4, a leaf: the host slot, given back once

    def take_host_slot(self) -> "Slot | None":
        """The host slot, once (None if given back already); no view of it is kept (a slot is reused only
        once no view of it is alive: the CPU part's job and target let go of theirs)."""
        with self.lock:
            host, self.host = self.host, None
        if host is None:
            return None
        host.out = None
        if self.cpu_job is not None:
            self.cpu_job.out = self.cpu_job.out_np = None
        return host.slot


def _fail_with(job: Job, part: Job) -> None:
    """A part's job stopped: its first error is the batch's (abandon is a no-op once the batch is complete or
    failed already)."""
    if part.error is not None:
        job.abandon(part.error)


class HybridExecutor:
    """Batches made by the CPU engine and the GPU decode together (see the module docstring and
    :class:`~stoker.engine.executor.Executor`). ``gpu`` and ``cpu`` replace the parts (the host stand-in,
    tests); ``shares`` their split."""

    applies_cf = True  # the GPU part decodes CF attributes on the whole batch
    shares_close_wait = True  # close(wait): the pipeline's one wait for all its executors (Pipeline.close)

    def __init__(self, cfg: Config, device: torch.device, stats: StatsRecorder, store: LocalStore,
                 gpu: GpuDecodeExecutor | None = None, cpu: HostPart | None = None,
                 shares: Shares | None = None) -> None:
        self.cfg = cfg
        self.device = device
        self.stats = stats
        gpu_cfg = _gpu_part_config(cfg)
        self._split = (gpu_cfg.host_buffer_bytes, cfg.host_buffer_bytes - gpu_cfg.host_buffer_bytes)
        self.gpu = gpu or GpuDecodeExecutor(gpu_cfg, device, stats, store)
        self.gpu.part_of = weakref.ref(self)  # (named as the hybrid in close's warning; no cycle)
        self.cpu = cpu or HostPart(dataclasses.replace(cfg, host_buffer_bytes=max(1 << 20, self._split[1])),
                                   device, stats, store)
        self.shares = shares or Shares()
        self.n_slots = self.gpu.n_slots
        self._closing = False
        self._cpu_free = 0.0  # when the CPU part finished its last batch
        self._described = Described()  # each array's codec and cast: whether the device decodes its chunks

    @classmethod
    def on_host(cls, cfg: Config, stats: StatsRecorder, store: LocalStore, max_stream_bytes: int = 1 << 24,
                decoder: Callable[[Any], Any] | None = None, shares: Shares | None = None,
                streams: HostStreams | None = None) -> "HybridExecutor":
        """The same executor on CPU tensors: the GPU part decodes with
        :class:`~stoker.engine.gpu.reference.HostDecoder` (or ``decoder(stream)``), on ``streams`` (a backend
        of :mod:`~stoker.engine.gpu.streams`: the tests' recorder), the host part is copied into the batch on
        the CPU (its tests)."""
        from ..gpu.reference import HostDecoder

        device = torch.device("cpu")
        make = decoder or (lambda stream: HostDecoder(max_stream_bytes))
        gpu = GpuDecodeExecutor(_gpu_part_config(cfg), device, stats, store, decoder=make, streams=streams)
        return cls(cfg, device, stats, store, gpu=gpu, shares=shares)

    def share_engine(self, shared: SharedEngine | None) -> SharedEngine:
        """The CPU part submits to ``shared`` (None: a new one, returned for the next lane), the one compiled
        engine of a pipeline's lanes (:meth:`~stoker.engine.cpu.executor.CpuExecutor.share_engine`): a pipeline
        of fields decoding on both runs ``n_compute_threads`` engine threads, not that many per field. Before
        :meth:`prepare`."""
        return self.cpu.share_engine(shared)

    # -- memory -----------------------------------------------------------------------------------

    @property
    def slots(self) -> SlotRing | None:
        """The delivered slots (the GPU part's; None until prepared)."""
        return self.gpu.slots

    @property
    def host_slots(self) -> SlotRing | None:
        """The CPU part's (pinned) staging slots."""
        return self.cpu.host_slots

    @property
    def budget(self):
        """The CPU part's Python-path budget."""
        return self.cpu.budget

    @property
    def cf_work(self) -> bool:
        return self.gpu.cf_work

    @property
    def dtype(self) -> torch.dtype | None:
        return self.gpu.dtype

    def work_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a batch of ``dtype`` is assembled in (the GPU part's: float32 for a transformed or
        CF-decoded 16-bit batch), which is also the host part's."""
        return self.gpu.work_dtype(dtype)

    def _budgets(self, fn: Callable[[], None]) -> None:
        """``fn()``, a BudgetExceeded of either part saying how host_buffer_bytes was split."""
        try:
            fn()
        except BudgetExceeded as exc:
            gpu, cpu = self._split
            raise BudgetExceeded(
                f"{exc} (decode_on='hybrid' splits Config.host_buffer_bytes={self.cfg.host_buffer_bytes:,}: "
                f"{gpu:,} B for the GPU decode's staging, {cpu:,} B for the CPU part's slots and scratch)",
                knob=getattr(exc, "knob", None) or "host_buffer_bytes", needed=getattr(exc, "needed", None)) from None

    def check_budget(self, shape: tuple[int, ...], dtype: torch.dtype, transient: int) -> None:
        """Both parts' budgets (see :data:`GPU_HOST_SHARE`)."""
        self._budgets(lambda: self.gpu.check_budget(shape, dtype, transient))
        self._budgets(lambda: self.cpu.check_budget(shape, self.gpu.work_dtype(dtype), transient))

    def prepare(self, sample_shape: tuple[int, ...], readers: list[ArrayReader], dtype: torch.dtype) -> None:
        """Both parts' slots and threads, once: the GPU part's first (its work dtype is the host part's)."""
        if self.slots is not None and self.cpu.slots is not None:
            return
        self._budgets(lambda: self.gpu.prepare(sample_shape, readers, dtype))
        self._budgets(lambda: self.cpu.prepare(sample_shape, readers, self.gpu.work_dtype(dtype)))
        ring = self.cpu.host_slots
        # read by the landing copies on the GPU part's place stream (once: a prepare tried again passes here too)
        if ring is not None and not any(r is ring for r in self.gpu.keep_with):
            self.gpu.keep_with.append(ring)

    def held(self) -> int:
        return self.gpu.held()

    def peak_bytes(self) -> int:
        """Host memory: both parts'."""
        return self.gpu.peak_bytes() + self.cpu.peak_bytes()

    def device_nbytes(self) -> int:
        return self.gpu.device_nbytes()

    # -- batches ----------------------------------------------------------------------------------

    def plan(self, batch_id: int, samples: Sequence[Sample], open_reader: Callable[[str], ArrayReader]) -> TablePlan:
        return plan_tables(batch_id, samples, open_reader)

    def acquire(self, plan: TablePlan, closed: Callable[[], bool]) -> Target:
        """The delivered slot (the GPU part's), then a host slot for the CPU part (always in this order, by
        the coordinator alone: no two batches wait on each other)."""
        gpu = self.gpu.acquire(plan, closed)
        try:
            host = self.cpu.acquire(plan, closed)
        except BaseException:
            self.gpu.drop(gpu)
            raise
        return _Target(gpu.out, gpu.slot, host.slot, gpu=gpu, host=host)

    def _on_device(self, plan: TablePlan, dtype: torch.dtype) -> np.ndarray:
        """Per chunk of ``plan``: whether the device decodes it (its array's codec and cast)."""
        return np.array([self._described.get(r, dtype).how != CPU for r in plan.sources], bool)[plan.chunk_source]

    def submit(self, plan: TablePlan, target: Target) -> Job:
        """Split ``plan`` and start both parts; the job completes when the GPU part has placed its chunks over
        the host part (its hook), or fails with the first error of either."""
        assert isinstance(target, _Target) and target.gpu is not None and target.host is not None
        job = Job(plan, target.out, 1)
        parts = target.parts = _Parts(job, target.host, time.perf_counter())
        try:
            dtype = self.gpu.dtype
            assert dtype is not None  # (prepared)
            cost = chunk_costs(plan)
            cpu_ids, gpu_ids = split(cost, self._on_device(plan, self.gpu.work_dtype(dtype)),
                                     self.shares.gpu_fraction())
        except BaseException as exc:  # noqa: BLE001 - the batch's error (describe refuses an array), at pop
            job.finish(1, exc)
            return job
        parts.cpu_bytes, parts.gpu_bytes = int(cost[cpu_ids].sum()), int(cost[gpu_ids].sum())
        job.on_cancel(lambda: self._stop(parts))
        if len(cpu_ids):
            host = target.host
            assert self.cpu.decoders is not None and host.out is not None
            if host.slot is not None:  # the host (the CPU engine's threads) writes the host slot from now on
                self.gpu.backend.access(None, writes=[("host", host.slot.index)])
            cpu_job = parts.cpu_job = self.cpu.decoders.submit(  # (in the GPU part's dtype, and its rounding)
                subset(plan, cpu_ids), host.out, then=lambda _job: self._cpu_done(parts),
                half_next=self.gpu.half_next)
            cpu_job.on_cancel(lambda: _fail_with(parts.job, cpu_job))
        else:  # no host part: its slot goes back now
            self._give_back_host(parts)
        gpu_target = target.gpu
        gpu_target.before = lambda batch: self._land(parts, batch)
        gpu_target.then = lambda gpu_job: self._gpu_done(parts, gpu_job)
        gpu_job = parts.gpu_job = self.gpu.submit(subset(plan, gpu_ids, plan.pads), gpu_target)
        gpu_job.on_cancel(lambda: _fail_with(parts.job, gpu_job))
        return job

    def _stop(self, parts: _Parts) -> None:
        """The batch failed (or was stopped): neither part writes on."""
        error = parts.job.error or pipeline_closed()
        for sub in (parts.cpu_job, parts.gpu_job):
            if sub is not None:
                sub.abandon(error)

    def _cpu_done(self, parts: _Parts) -> None:
        """The CPU part's completion hook (its finisher's thread): its rate, over the time since it could
        start (its batch was submitted, and the batch before it done)."""
        done = parts.cpu_done = time.perf_counter()
        start, self._cpu_free = max(parts.submitted, self._cpu_free), done
        self.shares.record("cpu", parts.cpu_bytes, done - start)

    def _land(self, parts: _Parts, batch: torch.Tensor) -> None:
        """The GPU part's ``before`` hook, on its thread and stream, before it writes any chunk: wait for the
        CPU part (checking shutdown; meanwhile the GPU part finishes the batches whose rounding checks wait
        for their events: :meth:`~stoker.engine.gpu.executor.GpuDecodeExecutor.idle`), then queue the host
        part's copy into ``batch``; the host slot goes back once the copy has read it."""
        t0 = parts.gpu_begun = time.perf_counter()
        cpu_job = parts.cpu_job
        if cpu_job is None:
            return
        pause = 0.0  # (while it waits, the GPU part's batches before it finish as their events are done: idle)
        while not cpu_job.wait(pause):
            if self._closing:
                raise pipeline_closed()
            pause = self.gpu.idle()
        parts.blocked = time.perf_counter() - t0
        if cpu_job.error is not None:
            raise cpu_job.error  # (the batch failed with it already: cpu_job.on_cancel)
        slot = parts.take_host_slot()
        if slot is None:  # dropped: the batch was given up
            raise pipeline_closed()
        host = slot.view(batch.dtype, tuple(batch.shape))
        t1 = time.perf_counter()
        # on the GPU part's place stream, through its streams' backend (the tests' recorder sees it): the slot is
        # read by the copy until the stream is past its event, and written again only after that
        ready = self.gpu.land(batch, host, slot.index)
        del host
        self._release_host(slot, ready)
        nbytes = batch.numel() * batch.element_size()
        parts.host_bytes = nbytes
        self.stats.stage("transfer", time.perf_counter() - t1, bytes_in=nbytes)

    def _gpu_done(self, parts: _Parts, gpu_job: Job) -> None:
        """The GPU part's completion hook (its thread): the batch is whole. The rates are recorded, then the
        batch's job finishes with both parts' counts (an error here would be lost: nothing raises)."""
        done = time.perf_counter()
        try:
            self.shares.record("gpu", parts.gpu_bytes, done - max(parts.gpu_begun, parts.submitted) - parts.blocked)
        except Exception:  # noqa: BLE001 - a rate not recorded costs nothing; the batch must finish
            pass
        counts = dict(gpu_job.counts)
        if parts.cpu_job is not None:
            for name, value in parts.cpu_job.counts.items():
                counts[name] = counts.get(name, 0) + value
        counts["bytes_to_device"] += parts.host_bytes
        counts["bytes_to_device_host"] += parts.host_bytes
        parts.job.finish(1, None, **counts)

    def _give_back_host(self, parts: _Parts) -> None:
        slot = parts.take_host_slot()
        if slot is not None:
            self._release_host(slot)

    def _release_host(self, slot: "Slot", ready: Any = None) -> None:
        ring = self.cpu.host_slots
        assert ring is not None
        ring.release(slot, ready_after=ready)

    def deliver(self, target: Target, rows: int) -> Delivery:
        assert isinstance(target, _Target) and target.gpu is not None
        return self.gpu.deliver(target.gpu, rows)

    def drop(self, target: Target) -> None:
        """Give back both slots of a batch that failed (the host slot unless its copy took it)."""
        assert isinstance(target, _Target)
        if target.gpu is not None:
            self.gpu.drop(target.gpu)
        if target.parts is not None:
            self._give_back_host(target.parts)
        elif target.host is not None:  # never submitted
            self.cpu.drop(target.host)

    def threads(self) -> list[threading.Thread]:
        """Both parts' threads started so far."""
        return self.cpu.threads() + self.gpu.threads()

    def forget(self, readers: list[ArrayReader]) -> None:
        """Drop what both parts and the split keep of ``readers``, arrays the pipeline forgot (see
        :meth:`CpuExecutor.forget <stoker.engine.cpu.executor.CpuExecutor.forget>`)."""
        self._described.forget(readers)
        self.gpu.forget(readers)
        self.cpu.forget(readers)

    def shutdown(self) -> None:
        """Stop both parts: no wait of the GPU part for the host part outlives it by more than 0.1 s."""
        self._closing = True
        self.cpu.shutdown()
        self.gpu.shutdown()

    def close(self, wait: CloseWait | None = None) -> None:
        """Close the GPU part (against ``wait``: :meth:`GpuDecodeExecutor.close`), then the CPU part, whose host
        slots of plain memory (the host stand-in's) go to the process's spare slots unless the GPU part's
        streams did not finish: a landing may still read them, so its close kept them (:meth:`.SlotRing.keep`)."""
        self.gpu.close(wait)
        self.cpu.close()
