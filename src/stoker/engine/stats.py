"""Pipeline statistics: per-stage time and bytes, counters, amplification.

>>> s = pipeline.stats()
>>> s.read_amplification, s.decode_amplification
(1.9, 1.1)
>>> s.gil_per_batch     # seconds the pipeline's threads held the GIL per batch
0.0009
>>> s.workers[0].busy_share, s.coordinator_per_batch   # a compiled-engine thread; the coordinator
(0.93, 0.0004)
>>> print(s)            # a readable table
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..runtime import gil
from ..runtime.schedstat import run_times

STAGES = ("plan", "plan_wait", "io", "decode", "assemble", "transfer", "transform", "pop_wait")
COUNTERS = (
    "batches_emitted", "samples", "chunks_needed", "chunks_decoded", "chunk_dedup_hits",
    "bytes_read", "bytes_decoded", "bytes_delivered", "bytes_needed", "bytes_to_device", "bytes_to_device_host",
)


@dataclass(frozen=True)
class Metric:
    """One stage: total seconds across threads, how many times it ran, bytes in and out."""

    name: str
    seconds: float = 0.0
    count: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


#: where a compiled-engine thread's time goes (:class:`WorkerTimes`), in seconds; they sum to its ``wall``
WORKER_TIMES = ("read", "decode", "copy", "fill", "lock", "idle", "budget", "other")
_WORKER_WAITS = ("lock", "idle", "budget")


@dataclass(frozen=True)
class WorkerTimes:
    """One thread of the compiled engine over the window (since the pipeline began or ``stats_reset``):
    seconds reading, decoding, copying and casting into batches (``copy``), writing fill values, waiting
    for a lock (the engine's, a batch's), for work (``idle``: no batch had chunks left), for scratch memory
    (``budget``), and the rest (taking chunks, paths, bookkeeping); they sum to ``wall``. ``on_cpu`` and
    ``run_queue``: what the OS says of the same window (seconds running, and runnable but waiting for a
    core; Linux only, else None), so a thread busy on its own clocks but off a core shows the machine is
    oversubscribed.

    >>> w = s.workers[0]; w.busy_share, w.decode / w.wall
    (0.93, 0.61)
    """

    read: float = 0.0
    decode: float = 0.0
    copy: float = 0.0
    fill: float = 0.0
    lock: float = 0.0
    idle: float = 0.0
    budget: float = 0.0
    other: float = 0.0
    wall: float = 0.0
    chunks: int = 0
    on_cpu: float | None = None
    run_queue: float | None = None

    @property
    def busy(self) -> float:
        """Seconds working (reading, decoding, copying, filling, the rest): not waiting."""
        return self.wall - sum(getattr(self, name) for name in _WORKER_WAITS)

    @property
    def busy_share(self) -> float:
        return self.busy / self.wall if self.wall > 0 else 0.0


#: a compiled engine's clocks for :meth:`StatsRecorder.watch_workers`: per thread, its times (seconds, in
#: :data:`WORKER_TIMES` order), then its wall seconds, chunks, and its OS run times or None (see
#: :class:`WorkerTimes`), each summed since the thread started
WorkerClocks = Callable[[], Sequence[tuple[float, ...]]]


#: what :attr:`Stats.fields` counts per field
FIELD_COUNTERS = ("chunks_needed", "chunks_decoded", "bytes_needed", "bytes_read", "bytes_decoded",
                  "bytes_delivered")


class Amplification:
    """``read_amplification`` and ``decode_amplification`` of counters with ``bytes_read``, ``bytes_decoded``
    and ``bytes_needed``: a pipeline's :class:`Stats` and each field's :class:`FieldCounts`."""

    bytes_read: int
    bytes_decoded: int
    bytes_needed: int

    @property
    def read_amplification(self) -> float:
        """Encoded bytes read per source byte the samples need (compression lowers it)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 0.0

    @property
    def decode_amplification(self) -> float:
        """Bytes decoded per source byte the samples need (1.0 is perfect)."""
        return self.bytes_decoded / self.bytes_needed if self.bytes_needed else 0.0


@dataclass(frozen=True)
class FieldCounts(Amplification):
    """One field's share of a pipeline of samples of named fields (:attr:`Stats.fields`): what its crops
    need and what was read and decoded for them (its lane's chunks only, so a field's amplification is its
    own chunking's, not the others').

    >>> s.fields["labels"].decode_amplification
    1.0
    """

    chunks_needed: int = 0
    chunks_decoded: int = 0
    bytes_needed: int = 0  # source-dtype bytes of the field's crops
    bytes_read: int = 0
    bytes_decoded: int = 0
    bytes_delivered: int = 0  # the field's batches, in its output dtype



@dataclass(frozen=True)
class Stats(Amplification):
    """A snapshot of a pipeline's work since creation (or ``stats_reset()``).

    Counters describe popped batches. Stage times are added as the work is reported: planning when a batch
    is launched; the reads, decodes and placements of a batch the compiled engine made alone when it is
    popped (the pop settles it, see :meth:`stoker.engine.executor.Job.settled_by`), so a batch made ahead and
    never popped adds none; other batches' as their chunks finish."""

    stages: dict[str, Metric] = field(default_factory=dict)
    batches_emitted: int = 0
    samples: int = 0
    chunks_needed: int = 0  # chunk touches summed over samples
    chunks_decoded: int = 0  # chunks actually decoded (after per-batch de-duplication)
    # touches served by a chunk decoded once for several: another sample of the batch needed it too, or
    # another batch in flight (the compiled engine decodes a chunk jobs in flight share once)
    chunk_dedup_hits: int = 0
    bytes_read: int = 0  # encoded bytes read from storage
    bytes_decoded: int = 0  # decoded bytes produced (partial decodes count the blocks decoded)
    bytes_delivered: int = 0  # bytes of popped batches, in the output dtype
    bytes_needed: int = 0  # source-dtype bytes of the samples emitted
    bytes_to_device: int = 0  # bytes copied from host to device for the batches emitted (CUDA pipelines)
    # of bytes_to_device, the CPU engine's part under decode_on="hybrid" (its decoded host batches; the rest
    # crossed encoded, for the GPU decode); 0 on every other path
    bytes_to_device_host: int = 0
    peak_host_bytes: int = 0  # batch slots + peak transient buffers
    # CPU seconds the pipeline's own threads (coordinator, I/O and compute threads) held the GIL
    # (see stoker.runtime.gil for how it is measured and what it cannot see)
    gil_seconds: float = 0.0
    # samples of named fields: each field's counts (they sum to the counters above); {} for other samples
    fields: dict[str, FieldCounts] = field(default_factory=dict)
    # each thread of the compiled engine (every field's lane's in turn): where its time went; () without it
    workers: tuple[WorkerTimes, ...] = ()
    # CPU seconds of the coordinator thread (pulling samples, opening arrays, planning, submitting), and the
    # seconds it was runnable but waited for a core (the OS's count; None off Linux)
    coordinator_seconds: float = 0.0
    coordinator_run_queue: float | None = None

    @property
    def gil_per_batch(self) -> float:
        """Seconds the pipeline's threads held the GIL per batch emitted (the consumer's own Python aside)."""
        return self.gil_seconds / self.batches_emitted if self.batches_emitted else 0.0

    @property
    def coordinator_per_batch(self) -> float:
        """CPU seconds of the coordinator thread per batch emitted."""
        return self.coordinator_seconds / self.batches_emitted if self.batches_emitted else 0.0

    def __str__(self) -> str:
        lines = [f"{'stage':<10}{'seconds':>10}{'count':>10}{'MB in':>12}{'MB out':>12}"]
        for name in STAGES:
            m = self.stages.get(name, Metric(name))
            lines.append(f"{name:<10}{m.seconds:>10.3f}{m.count:>10}{m.bytes_in / 1e6:>12.1f}{m.bytes_out / 1e6:>12.1f}")
        lines.append("")
        for name in COUNTERS:
            lines.append(f"{name:<20}{getattr(self, name):>14,}")
        lines.append(f"{'peak_host_bytes':<20}{self.peak_host_bytes:>14,}")
        lines.append(f"{'gil_seconds':<20}{self.gil_seconds:>14.3f}")
        lines.append(f"{'gil_ms_per_batch':<20}{self.gil_per_batch * 1e3:>14.3f}")
        lines.append(f"{'read_amplification':<20}{self.read_amplification:>14.2f}")
        lines.append(f"{'decode_amplification':<20}{self.decode_amplification:>14.2f}")
        lines.append(f"{'coordinator_ms_batch':<20}{self.coordinator_per_batch * 1e3:>14.3f}")
        if self.workers:
            lines += ["", f"{'thread':<8}{'busy %':>8}" + "".join(f"{n + ' %':>9}" for n in WORKER_TIMES)
                      + f"{'chunks':>9}{'on CPU %':>10}{'run queue %':>13}"]
            for i, w in enumerate(self.workers):
                share = [100 * getattr(w, n) / w.wall if w.wall > 0 else 0.0 for n in WORKER_TIMES]
                ran = [f"{100 * v / w.wall:.1f}" if v is not None and w.wall > 0 else "-" for v in (w.on_cpu, w.run_queue)]
                lines.append(f"{i:<8}{100 * w.busy_share:>8.1f}" + "".join(f"{v:>9.1f}" for v in share)
                             + f"{w.chunks:>9}{ran[0]:>10}{ran[1]:>13}")
        if self.fields:
            lines += ["", f"{'field':<14}{'MB needed':>12}{'MB read':>12}{'MB decoded':>12}{'read amp':>10}"
                          f"{'decode amp':>12}"]
            for name, c in self.fields.items():
                lines.append(f"{name:<14}{c.bytes_needed / 1e6:>12.1f}{c.bytes_read / 1e6:>12.1f}"
                             f"{c.bytes_decoded / 1e6:>12.1f}{c.read_amplification:>10.2f}"
                             f"{c.decode_amplification:>12.2f}")
        return "\n".join(lines)


class StatsRecorder:
    """Thread-safe accumulation behind :class:`Stats` (one lock, tiny critical sections).

    GIL time: every report of a pipeline thread (:meth:`stage`, :meth:`chunk`, :meth:`charge_thread`)
    charges what the reporting thread held the GIL since its previous report
    (:func:`stoker.runtime.gil.held_since_last`: threads stoker started only). ``pop_wait`` is the consumer's
    report: what its thread held (the training step) is dropped, never charged. Time measured some other
    way, on a thread that is not enrolled or in native code that takes the GIL, is added with :meth:`gil`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._worker_clocks: list[WorkerClocks] = []
        self._coordinator_tid = 0
        self.reset()

    def reset(self) -> None:
        # A thread's report after a reset charges its whole interval since its previous report, as a
        # stage that straddles the reset counts whole: at most one piece of work per thread.
        with self._lock:
            # per stage: seconds, count, bytes in, bytes out (Metric's fields)
            self._stages: dict[str, list[Any]] = {name: [0.0, 0, 0, 0] for name in STAGES}
            self._counters = dict.fromkeys(COUNTERS, 0)
            self._per_field: dict[str, dict[str, int]] = {}
            self._gil_ns = 0
            self._coordinator_ns = 0
            self._coordinator_base = run_times(self._coordinator_tid)
            # each watched engine's clocks as of this reset: what a snapshot subtracts
            self._worker_base = [clocks() for clocks in self._worker_clocks]

    def watch_coordinator(self, tid: int) -> None:
        """The coordinator thread's id (``threading.get_native_id()``): its run-queue time is reported."""
        with self._lock:
            self._coordinator_tid = tid
            self._coordinator_base = run_times(tid)

    def watch_workers(self, clocks: WorkerClocks) -> None:
        """Report a compiled engine's threads in each snapshot (:attr:`Stats.workers`): ``clocks()`` gives
        their times since they started (:data:`WorkerClocks`), read as the engine starts and at each reset."""
        base = clocks()
        with self._lock:
            self._worker_clocks.append(clocks)
            self._worker_base.append(base)

    def coordinator(self, ns: int) -> None:
        """Add ``ns`` of the coordinator thread's CPU time (one of its rounds)."""
        with self._lock:
            self._coordinator_ns += ns

    def gil(self, seconds: float) -> None:
        """Add ``seconds`` of GIL-held time measured by the caller (not through :mod:`stoker.runtime.gil`)."""
        with self._lock:
            self._gil_ns += int(seconds * 1e9)

    def charge_thread(self) -> None:
        """Charge the calling pipeline thread's GIL time since its last report (a Python thread of the
        pipeline that reports no stage calls this after each piece of work)."""
        held = gil.held_since_last()
        if held:
            with self._lock:
                self._gil_ns += held

    def stage(self, name: str, seconds: float, bytes_in: int = 0, bytes_out: int = 0) -> None:
        held = gil.held_since_last()
        if name == "pop_wait":
            held = 0  # the consumer's: a pool thread that consumes a pipeline is still not the pipeline
        with self._lock:
            self._gil_ns += held
            m = self._stages[name]
            m[0] += seconds
            m[1] += 1
            m[2] += bytes_in
            m[3] += bytes_out

    def chunk(self, decode_s: float, assemble_s: float, bytes_in: int, decoded: int,
              read_s: float | None = None, count: int = 1) -> None:
        """``count`` decoded chunks (one, unless the compiled reader reports a call's worth): their decode
        and assemble stage times, and their reads when ``read_s`` is given, under one lock (the batch's
        counters are added when it is popped)."""
        held = gil.held_since_last()
        with self._lock:
            self._gil_ns += held
            if read_s is not None:
                r = self._stages["io"]
                r[0] += read_s
                r[1] += count
                r[3] += bytes_in
            d = self._stages["decode"]
            d[0] += decode_s
            d[1] += count
            d[2] += bytes_in
            d[3] += decoded
            a = self._stages["assemble"]
            a[0] += assemble_s
            a[1] += count

    def add(self, fields: dict[str, dict[str, int]] | None = None, **counts: int) -> None:
        """Add ``counts`` to the counters and, for a batch of fields, each field's ``fields[name]`` (names of
        :data:`FIELD_COUNTERS`) to its own, under the one lock (a snapshot sees both or neither)."""
        with self._lock:
            for name, value in counts.items():
                self._counters[name] += value
            for name, own in (fields or {}).items():
                mine = self._per_field.setdefault(name, dict.fromkeys(FIELD_COUNTERS, 0))
                for key, value in own.items():
                    mine[key] += value

    def snapshot(self, peak_host_bytes: int = 0) -> Stats:
        with self._lock:
            stages = {n: Metric(n, *v) for n, v in self._stages.items()}
            fields = {name: FieldCounts(**c) for name, c in self._per_field.items()}
            workers = tuple(_window(now, bases[i] if i < len(bases) else None)
                            for clocks, bases in zip(self._worker_clocks, self._worker_base)
                            for i, now in enumerate(clocks()))
            ran, base = run_times(self._coordinator_tid), self._coordinator_base
            return Stats(stages=stages, peak_host_bytes=peak_host_bytes, gil_seconds=self._gil_ns * 1e-9,
                         fields=fields, workers=workers, coordinator_seconds=self._coordinator_ns * 1e-9,
                         coordinator_run_queue=None if ran is None or base is None else ran[1] - base[1],
                         **self._counters)


def _window(now: tuple, base: tuple | None) -> WorkerTimes:
    """A thread's :class:`WorkerTimes` between two reads of its clocks (``base`` None: since it started)."""
    n = len(WORKER_TIMES) + 2  # the times, wall and chunks; then on-CPU and run-queue, or None
    base = base if base is not None else (0,) * (n + 2)
    vals = [a - b for a, b in zip(now[:n], base[:n])]
    on_cpu, run_queue = (None if a is None or b is None else a - b for a, b in zip(now[n:n + 2], base[n:n + 2]))
    times = dict(zip(WORKER_TIMES, vals))
    return WorkerTimes(**times, wall=vals[-2], chunks=int(vals[-1]), on_cpu=on_cpu, run_queue=run_queue)
