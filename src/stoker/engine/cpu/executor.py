"""The CPU executor: batch slots in host memory, and which decode path fills them.

Every batch is planned as flat tables (:func:`~stoker.engine.planning.tables.plan_tables`). With the compiled
engine (``stoker._native.Engine``, see :mod:`.decode_native`) it is made in one call on the engine's threads
(chunks of arrays in stores: object stores and zip archives, fetched first, then one engine call per fetch,
from the fetched buffers); the chunks it leaves (other codecs and layouts, doubtful frames, rewritten shards,
arrays of rank 0) take the Python path. Without the engine (no compiler, ``STOKER_NATIVE=0``, or no array of
the first batch it decodes) the Python path (:mod:`.decode_python`) makes the whole batch from the same plan.

With ``Config.transform`` and a 16-bit float output, a batch is assembled in a float32 *work* slot,
transformed there, and cast once into the delivered slot (:meth:`CpuExecutor.work_dtype`): a transform
(``Normalize`` near a large mean) sees the values before the 16-bit rounding, which happens once, after it.

Arrays with CF attributes are decoded in the slot after the cast (:mod:`.cf`); a 16-bit output is then made in
a float32 work slot too. A packed array (``scale_factor``, ``add_offset``) whose stored values float32 does not
hold exactly (32- and 64-bit integers, float64) is made in a float64 work slot when the first batch reads one
(:attr:`CpuExecutor.exact_cf`), so its values are xarray's, rounded once into the output: decoding a float32
rounding of the stored value is wrong by far more than a rounding where ``add_offset`` cancels most of it.

Memory: ``host_buffer_bytes`` holds the batch slots and work slots (:class:`~.buffers.SlotRing`), the engine's
threads' scratch (its budget) and the Python path's buffers (the :class:`~.buffers.TransientBudget`):
:meth:`CpuExecutor.prepare` splits what the slots leave between the two, so together they never pass it.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Sequence

import torch

from . import native
from ...config import Config
from ...errors import BudgetExceeded
from ...sampling.sample import Sample
from ...reader.array import ArrayReader
from ...storage import LocalStore
from ...transforms import apply as apply_transform
from ..buffers import Slot, SlotRing, TransientBudget, size_class
from .cf import RowDecode, masks_wide, needs_float64, plan_decoder
from ..rounding import needs_probe, round_into
from .decode_native import NativeDecoder, SharedEngine, native_codec, scratch_need
from .decode_python import PythonDecoder
from ..executor import Delivery, Job, SlotsDelivery, Target
from ..planning.padding import fill_padding
from ..stats import StatsRecorder
from ..planning.tables import TablePlan, plan_tables

__all__ = ["CpuExecutor", "Decoders", "Job", "engine_available", "native_codec", "scratch_need"]


_HALF = (torch.bfloat16, torch.float16)
_FLOATS = (torch.float32, *_HALF)


def engine_available() -> bool:
    """True when the compiled engine is built and loaded (and ``STOKER_NATIVE`` does not turn it off)."""
    return native.Engine is not None


def half_next(work: torch.Tensor, into: torch.dtype | None) -> bool:
    """Whether a batch made in ``work`` is rounded into float16 next, untransformed (``into``: the output then,
    None when a transform comes first): its float64 values then go into a float32 ``work`` as their one
    rounding's float32 (:attr:`~.executor.Job.half_next`)."""
    return into == torch.float16 and work.dtype == torch.float32


class Decoders:
    """Plans batches and fills tensors in CPU memory: the compiled engine, or the Python path."""

    def __init__(self, n_io: int, n_compute: int, budget: TransientBudget, stats: StatsRecorder,
                 store: LocalStore, engine_budget: int = 0, group_limit: int = 8 << 20,
                 shared: SharedEngine | None = None, native: bool | None = None) -> None:
        self.budget = budget
        self.python = PythonDecoder(n_io, n_compute, budget, stats, store, max_group=group_limit)
        # ``shared``: the engine of a pipeline's lanes (see CpuExecutor.share_engine), else one of its own;
        # ``native``: submit to it even with no scratch of its own (the lanes' engine holds enough already)
        native = engine_budget > 0 if native is None else native
        self.native = (NativeDecoder(n_compute, engine_budget, self.python, stats, shared)
                       if engine_available() and native else None)

    @staticmethod
    def plan(batch_id: int, samples: Sequence[Sample], open_reader: Callable[[str], ArrayReader]) -> TablePlan:
        """The batch's plan, the same for both paths: flat tables (:func:`~.tables.plan_tables`)."""
        return plan_tables(batch_id, samples, open_reader)

    def submit(self, plan: TablePlan, out: torch.Tensor, then: Callable[[Job], None] | None = None,
               cf: bool = False, half_next: bool = False) -> Job:
        """Start making ``plan`` into ``out``; ``then(job)`` runs once every chunk is in place.

        A batch of multi-array samples, ``(B, C, *box)``, is made through its ``(B * C, *box)`` view: the
        plans' copy rows are ``b * C + c``, so neither path knows about channels. A batch with boxes past their
        arrays (``plan.pads``) has them filled first in the hook
        (:func:`~stoker.engine.planning.padding.fill_padding`; ``cf``: CF attributes are decoded after it).
        ``half_next``: ``out`` is float32 rounded into float16 next (:attr:`~.executor.Job.half_next`)."""
        if plan.channels is not None:
            out = out.flatten(0, 1)
        if plan.pads:
            then = _padded_then(plan, out, then, cf, half_next)
        job = Job(plan, out, plan.n_chunks, then)
        job.half_next = half_next
        if self.native is not None:
            self.native.submit(job)
        else:
            self.python.submit_chunks(job, None)
        return job

    def shutdown(self) -> None:
        """Cancel work in flight: once this returns the engine writes into no batch; Python tasks stop at
        their next check."""
        if self.native is not None:
            self.native.shutdown()
        self.python.shutdown()

    def threads(self) -> list[threading.Thread]:
        """The threads of both paths started so far."""
        return self.python.threads() + (self.native.threads() if self.native is not None else [])

    def peak_bytes(self) -> int:
        """The most the decode paths' buffers held at once (the engine's scratch and the transient budget)."""
        return self.budget.peak + (self.native.peak_bytes() if self.native is not None else 0)


def _padded_then(plan: TablePlan, out: torch.Tensor, then: Callable[[Job], None] | None,
                 cf: bool = False, half_next: bool = False) -> Callable[[Job], None]:
    """A completion hook that fills the padded crops of ``plan`` in ``out``, then runs ``then``."""
    def hook(job: Job) -> None:
        fill_padding(plan.pads, plan.sources, out, cf=cf, half_next=half_next)
        if then is not None:
            then(job)
    return hook


#: The engine's scratch budget: room for every compute thread's scratch for the largest chunk of the first
#: batch's arrays, twice over (later arrays may have larger chunks), and at least this much.
_ENGINE_MIN_BYTES = 64 << 20


#: The most decoded chunks the engine keeps for a grid's epoch read ahead (CpuExecutor.reuse_bytes): a 3-d
#: grid's tiles share chunks with their neighbours only, so a few planes of chunks are reused at once.
REUSE_MAX_BYTES = 64 << 20


def engine_wants(threads: int, readers: list) -> int:
    """The scratch an engine of ``threads`` threads wants for ``readers``' chunks (see ``_ENGINE_MIN_BYTES``);
    0 when the engine decodes none of them. Arrays whose codec the engine does not decode size nothing."""
    needs = [scratch_need(r.metadata.codec, not r.kv.is_local) for r in readers
             if native_codec(r.metadata.codec) is not None]
    return max(_ENGINE_MIN_BYTES, 2 * threads * max(needs)) if needs else 0


def engine_budget(left: int, python_need: int, threads: int, readers: list, held: int = 0) -> int:
    """The share of ``left`` (host_buffer_bytes minus the batch slots) the compiled engine's threads take
    for their scratch; the Python path keeps the rest, at least ``python_need`` (one file's chunks). ``held``:
    what an engine shared with other lanes holds already (their shares), which this share only tops up to
    :func:`engine_wants`. When the first batch has no array the engine decodes, the engine gets nothing and
    the Python path, which reads them all, keeps everything."""
    return max(0, min(left - python_need, engine_wants(threads, readers) - held))


def take_slot(ring: SlotRing, closed: Callable[[], bool]) -> Slot:
    """A free slot of ``ring``, waiting for one (ShutdownError once ``closed()``: the executor's
    :meth:`~CpuExecutor.shutdown` wakes the wait); the CPU and CUDA executors' ``acquire``."""
    slot = None
    while slot is None:
        slot = ring.acquire(closed)
    return slot


class CpuExecutor(SlotsDelivery):
    """The executor of CPU batches (see :class:`~.executor.Executor`): ``lookahead_batches + 1`` slots in
    host memory, filled by :class:`Decoders` and handed out as they are. One per pipeline; nothing is
    allocated and no thread started before :meth:`prepare`."""

    staging = "batch slots (lookahead_batches + 1)"  # what the host slots are, in budget messages
    #: packed CF arrays that float32 does not hold exactly are made in float64 work slots (see the module note);
    #: executors that stage or cast elsewhere (CUDA, the hybrid's host part) refuse them instead (cf.check_output)
    exact_cf = True
    applies_cf = True  # decodes arrays' CF attributes (Config.cf): engine/cpu/cf.py, in the completion hook

    def __init__(self, cfg: Config, stats: StatsRecorder, store: LocalStore) -> None:
        self.cfg = cfg
        self.stats = stats
        self.store = store
        # batches made ahead: cfg's, raised at prepare towards ``read_ahead`` (a wish the pipeline sets before
        # the first batch for a grid's epoch, Pipeline(read_ahead=...): see _read_further)
        self.lookahead = cfg.lookahead_batches
        self.read_ahead = 0
        # with read_ahead, the engine keeps decoded chunks for the next batches (csrc/pool.c "Reused"): the
        # bytes granted at prepare, and the pushes so far (a push's batches are served only its own decodes)
        self.reuse_bytes = 0
        self._pushes = 0
        # orders the engine's generation updates (prepare's and push's); held only around SharedEngine.reuse,
        # whose lock (rank 4) is a leaf
        self._reuse_lock = threading.Lock()
        self._reuse_asked = False  # the engine holds a grant of this executor's decoders
        self.n_slots = cfg.lookahead_batches + 1  # slots the consumer sees
        self.slots: SlotRing | None = None  # what batches are delivered from
        self.host_slots: SlotRing | None = None  # where they are assembled (the same ring here)
        self.budget: TransientBudget | None = None
        self.decoders: Decoders | None = None
        # one read group (a shard's coalesced inner chunks plus their decode scratch) reserves at most this
        self.group_limit = min(8 << 20, cfg.host_buffer_bytes // 16)
        self.cf_work = False  # the first batch reads arrays with CF attributes: decoded in float32 work slots
        self.cf_wide = False  # ... and packed or masked ones float32 does not hold exactly: float64 work slots
        self.engine_share: SharedEngine | None = None  # a lane's: the compiled engine of its pipeline's lanes

    def share_engine(self, shared: SharedEngine | None) -> SharedEngine:
        """Submit to ``shared`` (None: a new one, returned for the next lane), the one compiled engine of a
        pipeline's lanes (:class:`~.decode_native.SharedEngine`): a chunk two fields' jobs in flight need is
        decoded once, and the pipeline runs ``n_compute_threads`` engine threads, not that many per field.
        Before :meth:`prepare`."""
        self.engine_share = shared if shared is not None else SharedEngine(self.cfg.compute_threads)
        return self.engine_share

    # -- memory -----------------------------------------------------------------------------------

    def work_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype batches of ``dtype`` are assembled and transformed in: float32 when the output is a 16-bit
        float (``dtype='bf16'`` or ``'f16'``) and there is a transform (one rounding, after it), else ``dtype``.
        (``dtype='native'`` batches are transformed in the source dtype.) The same for arrays with CF
        attributes (:mod:`.cf`), when the first batch reads one; float64 for a float output when it reads a
        packed array float32 does not hold exactly (:attr:`exact_cf`, :func:`.cf.needs_float64`)."""
        if self.cf_wide and dtype in _FLOATS:
            return torch.float64
        if (self.cfg.transform is not None or self.cf_work) and self.cfg.output_dtype in _HALF:
            return torch.float32
        return dtype

    def host_rings(self, dtype: torch.dtype) -> list[tuple[int, torch.dtype, str]]:
        """``(slots, dtype, what)`` of each ring of host slots for batches of ``dtype``: the delivered slots,
        and with a float32 work dtype the work slots of the batches being made."""
        work = self.work_dtype(dtype)
        if work == dtype:
            return [(self.n_slots, dtype, self.staging)]
        return [(self.n_slots, dtype, self.staging),
                (self.lookahead, work, f"{str(work).removeprefix('torch.')} work slots for the transform or CF "
                 "decoding (lookahead_batches)")]

    def host_slot_bytes(self, slot_bytes: int) -> int:
        """Host memory one slot of ``slot_bytes`` takes."""
        return slot_bytes

    def check_budget(self, shape: tuple[int, ...], dtype: torch.dtype, transient: int) -> None:
        """BudgetExceeded unless the host slots plus ``transient`` fit host_buffer_bytes, with a breakdown."""
        cfg = self.cfg
        parts, held = [], 0
        for n, ring_dtype, what in self.host_rings(dtype):  # at cfg's lookahead: read-ahead comes after
            slot_bytes = cfg.batch_size * math.prod(shape) * ring_dtype.itemsize
            host_slot = self.host_slot_bytes(slot_bytes)
            pinned = (f", each pinned as {host_slot:,} B (torch rounds pinned memory up to a power of two)"
                      if host_slot != slot_bytes else "")
            parts.append(f"{n} {what} x {cfg.batch_size} samples x {shape} x {ring_dtype.itemsize} B{pinned} = "
                         f"{n * host_slot:,} B")
            held += n * host_slot
        need = held + transient
        if need > cfg.host_buffer_bytes:
            raise BudgetExceeded(
                f"Config.host_buffer_bytes={cfg.host_buffer_bytes:,} cannot hold this pipeline: "
                f"{', plus '.join(parts)}, "
                f"plus at least {transient:,} B for reading and decoding one file's chunks; needs {need:,} B. Raise "
                f"host_buffer_bytes to at least {need:,}, or lower batch_size, lookahead_batches or the sample shape.",
                knob="host_buffer_bytes", needed=need,
            )

    def prepare(self, sample_shape: tuple[int, ...], readers: list[ArrayReader], dtype: torch.dtype) -> None:
        """Slots, budgets and decode threads, once: at the first batch, whose arrays size the buffers."""
        if self.slots is not None:
            return
        from ...reader.coords import coding

        self.cf_work = self.cfg.cf and any(coding(r) is not None for r in readers)
        self.cf_wide = self.exact_cf and self.cf_work and any(needs_float64(r) or masks_wide(r) for r in readers)
        # The largest single reservation of the Python path: one read group, or one chunk's encoded bytes
        # (at most its decoded size plus codec overhead for what we read) and its decode scratch.
        chunk = max(size_class(r.metadata.codec.nbytes) for r in readers)
        transient = max(self.group_limit, 2 * chunk + size_class(1))
        self.check_budget(sample_shape, dtype, transient)
        self._read_further(sample_shape, dtype, transient)
        self._make_slots((self.cfg.batch_size, *sample_shape), dtype)
        left = self.cfg.host_buffer_bytes - self.host_nbytes()
        threads = self.cfg.compute_threads
        native = engine_available() and engine_wants(threads, readers) > 0
        # a lane of a shared engine gives it only what it lacks: one engine of n_compute_threads threads, sized as
        # one (not once per lane); the rest of the lane's share stays its Python path's
        held = self.engine_share.budget_bytes if self.engine_share is not None else 0
        engine = engine_budget(left, transient, threads, readers, held) if native else 0
        native = native and engine + held > 0  # no room for an engine at all: the Python path reads every chunk
        # a grid's epoch read ahead: its batches share chunks (tiles overlap), kept decoded by the engine for the
        # batches after the first that needs each, from what the Python path's room leaves (half of it past one
        # file's reads and decodes, at most REUSE_MAX_BYTES)
        self.reuse_bytes = min(REUSE_MAX_BYTES, max(0, left - engine - transient) // 2) \
            if native and self.read_ahead > 0 else 0
        self.budget = TransientBudget(left - engine - self.reuse_bytes)
        self.decoders = Decoders(self.cfg.n_io_threads, threads, self.budget, self.stats, self.store,
                                 engine_budget=engine, group_limit=self.group_limit, shared=self.engine_share,
                                 native=native)
        self._apply_reuse()

    def pushed(self) -> None:
        """A new push (before its samples are queued): its batches are placed only from chunks decoded after
        it (a file rewritten between two pushes is read again), and what the engine keeps is dropped."""
        self._pushes += 1
        self._apply_reuse()

    def forget(self, readers: list[ArrayReader]) -> None:
        """Drop what the decoders keep of ``readers``, arrays the pipeline forgot (see
        :meth:`NativeDecoder.forget <.decode_native.NativeDecoder.forget>`), so their stores can be closed."""
        native = self.decoders.native if self.decoders is not None else None
        if native is not None:
            native.forget(readers)

    def _apply_reuse(self) -> None:
        with self._reuse_lock:
            native = self.decoders.native if self.decoders is not None else None
            if native is not None and (self.reuse_bytes or self._reuse_asked):
                native.reuse(self.reuse_bytes, self._pushes)  # 0 after a grant: the engine's grant taken back
                self._reuse_asked = self.reuse_bytes > 0

    def _read_further(self, shape: tuple[int, ...], dtype: torch.dtype, transient: int) -> None:
        """Raise :attr:`lookahead` towards ``read_ahead`` (a :class:`~stoker.CropDataset` over a grid asks for
        it) by as many batches as host_buffer_bytes holds next to the slots at cfg's lookahead (which
        check_budget found to fit) and ``transient``, the room one file's chunks need to be read and decoded:
        never below cfg's, so a config that fits without read-ahead fits with it."""
        if self.read_ahead <= self.lookahead:
            return
        held = step = 0
        for n, ring_dtype, _ in self.host_rings(dtype):
            slot = self.host_slot_bytes(self.cfg.batch_size * math.prod(shape) * ring_dtype.itemsize)
            held, step = held + n * slot, step + slot  # each ring has one slot more per batch ahead
        room = self.cfg.host_buffer_bytes - transient - held
        more = min(self.read_ahead - self.lookahead, max(0, room) // max(step, 1))
        self.lookahead += more
        self.n_slots += more

    def _make_slots(self, batch_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.slots = self.host_slots = SlotRing(self.n_slots, batch_shape, dtype)
        work = self.work_dtype(dtype)
        if work != dtype:
            self.host_slots = SlotRing(self.lookahead, batch_shape, work)

    def host_nbytes(self) -> int:
        """Host memory the slot rings hold."""
        return self.host_slots.nbytes + (self.slots.nbytes if self.slots is not self.host_slots else 0)

    def peak_bytes(self) -> int:
        """The most host memory the pipeline's buffers held at once: the slots, the engine's scratch and the
        Python path's buffers."""
        if self.host_slots is None:
            return 0
        return self.host_nbytes() + self.decoders.peak_bytes()

    # -- batches ----------------------------------------------------------------------------------

    def plan(self, batch_id: int, samples: Sequence[Sample], open_reader: Callable[[str], ArrayReader]) -> TablePlan:
        return plan_tables(batch_id, samples, open_reader)

    def acquire(self, plan: TablePlan, closed: Callable[[], bool]) -> Target:
        """The slot ``plan``'s batch is made in (waits until one is free): its delivered slot, or a work slot
        when batches are transformed in float32."""
        slot = take_slot(self.slots, closed)
        if self.host_slots is self.slots:
            return Target(slot.batch(plan.rows), slot, slot)
        host_slot = take_slot(self.host_slots, closed)
        return Target(host_slot.batch(plan.rows), slot, host_slot)

    def submit(self, plan: TablePlan, target: Target) -> Job:
        """Start making ``plan`` into ``target``; the job completes or fails. With ``Config.transform`` the
        job's completion hook runs it on the batch in its slot (its error is the job's), then casts a work
        slot's batch into the delivered slot. Arrays' CF attributes are decoded there first (:mod:`.cf`)."""
        # the output the decoded batch is rounded into next, where no transform comes between (an f16 batch's
        # float32 work then takes the float64 results rounded to odd: one rounding in all, as NumPy casts)
        into = target.slot.tensor.dtype if self.cfg.transform is None else None
        decode = plan_decoder(plan, self.cfg.cf, into)
        if self.cfg.transform is None and decode is None and target.host_slot is target.slot:
            return self.decoders.submit(plan, target.out)  # made in the delivered slot: nothing after it
        # so are plain float64 arrays' values placed in that work (cast.half_exact): rounded once too
        return self.decoders.submit(plan, target.out, then=lambda job: self._transform(target, job, decode),
                                    cf=decode is not None, half_next=half_next(target.out, into))

    def _transform(self, target: Target, job: Job, decode: RowDecode | None = None) -> None:
        t0 = time.perf_counter()
        if decode is not None:
            decode(target.out)
            error = decode.error(job.plan)  # a finite decoded value past float32: never an inf
            if error is not None:
                raise error
        if self.cfg.transform is not None:
            apply_transform(self.cfg.transform, target.out, job.plan.keys)
        if target.host_slot is not target.slot:
            work = target.out
            out = target.slot.tensor[: work.shape[0]]
            # the one rounding to the output, checked unless no value can be past it (no transform: bounded)
            checked = needs_probe(job.plan, self.cfg, out.dtype)
            round_into(out, work, job.plan, checked)
            job.out = job.out_np = target.out = None  # no view may keep the work slot from its next batch
            self.host_slots.release(target.host_slot)
            target.host_slot = None
        self.stats.stage("transform", time.perf_counter() - t0)

    def deliver(self, target: Target, rows: int) -> Delivery:
        """``(view, release, ready event, ready stream)`` of a finished batch (see Batch)."""
        slots, slot = self.slots, target.slot
        return slot.batch(rows), lambda waits: slots.release(slot, stream_waits=waits), None, None

    def drop(self, target: Target) -> None:
        """Give back the slots of a batch that failed."""
        if target.slot is not None:
            self.slots.release(target.slot)
        if target.host_slot is not None and target.host_slot is not target.slot:
            self.host_slots.release(target.host_slot)

    def shutdown(self) -> None:
        """Cancel work in flight: once this returns the engine writes into no batch; Python tasks stop at
        their next check. A coordinator waiting for a slot is woken, to see the close."""
        if self.decoders is not None:
            self.decoders.shutdown()
        for ring in (self.slots, self.host_slots):
            if ring is not None:
                ring.wake()

    def close(self) -> None:
        """After :meth:`shutdown`: the slots go back to the process's spare slots (``SlotRing.close``), for
        the next pipeline to take instead of new memory."""
        for ring in {id(r): r for r in (self.slots, self.host_slots) if r is not None}.values():
            ring.close()

    def threads(self) -> list[threading.Thread]:
        """The decode threads started so far."""
        return self.decoders.threads() if self.decoders is not None else []
