"""Run the benchmark scenarios: every peer on the same seeded crops, in one process run.

Peers:
- ``stoker``: the Pipeline (batch slots, per-batch dedup, partial decode).
- ``tensorstore``: futures for every crop of a batch in flight (and the next batch's issued before the
  current one is assembled), then one copy-cast per crop into a float32 batch.
- ``zarr``: zarr-python, crop by crop, on the calling thread.
- ``zarr+DataLoader``: zarr-python reads inside ``torch.utils.data.DataLoader(num_workers=cores)``.
- ``decode bound``: each chunk a batch needs, decoded once in full on all cores, nothing else: each
  thread loops over its share of the (already read) chunks into one reused buffer (the throughput if
  reading and assembling were free).

Every peer runs one untimed warm-up batch, then ``n`` timed batches; the page cache is warmed first.
stoker, tensorstore and the decode bound run in interleaved rounds (``rounds``) and report their median
round, so a slow spell of a shared machine does not skew one peer against the others.

Busy consumer (``step_s``): after each batch every peer's consumer runs pure Python for ``step_s``
(:func:`busy_step`), holding the GIL as an eager training step's Python does. Its reads for the next
batch are already under way: stoker's pipeline and the DataLoader prefetch by themselves, and
tensorstore's next batch is issued before the current one is delivered. The decode bound has no
consumer and is left out.
"""

from __future__ import annotations

import gc
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from numcodecs import zstd as numcodecs_zstd

from ..runtime import gil
from ..reader.array import open_array
from ..config import Config
from ..engine.pipeline.facade import Pipeline
from ..sampling.sample import Sample
from ..zarr.grid import chunk_intersections
from .datasets import VolumeSpec, compression_ratio, ensure, warm_page_cache
from .epochs import (CACHE_BYTES, LOCAL, LOCAL_SAME, SAME, cache_peak_line, epoch_peers, epochs_note, hit_rate,
                     same_pipeline_peers, second_epoch_lines, tensorstore_epoch_peers, zarr_epoch_peers)
from .remote import Remote, ZarrOpener
from .rss import RssSampler, rss_bytes  # noqa: F401 - rss_bytes: also read from here (memory.py, tests)
from .threadcpu import ThreadCPU


LOOKAHEAD = 3  # stoker's lookahead_batches in the benchmark
BATCH_SIZE = 8  # samples per batch, unless a scenario says otherwise


@dataclass(frozen=True)
class Scenario:
    number: int
    title: str
    volume: VolumeSpec
    crop: tuple[int, ...]
    grid: bool = False  # crops on the aligned chunk grid (shuffled) instead of random corners
    # Timed batches per fast peer: about a second of stoker, so the steady state is measured and not the
    # first touches of fresh buffers (30 batches of scenario 5 last a tenth of a second).
    timed_batches: int = 30
    batch_size: int = BATCH_SIZE


def scenarios(tiny: bool = False) -> list[Scenario]:
    if tiny:  # CI smoke: same code paths, seconds instead of minutes
        v = VolumeSpec("tiny-lz4", (64, 256, 256), (16, 64, 64), "uint16", "blosc-lz4")
        return [
            Scenario(1, "tiny blosc lz4, random crops", v, (16, 64, 64)),
            Scenario(2, "tiny sharded", VolumeSpec("tiny-sharded", (64, 256, 256), (16, 64, 64), "uint16",
                                                   "blosc-lz4", shards=(32, 128, 128)), (16, 64, 64)),
            Scenario(6, "tiny many arrays, zstd", VolumeSpec("tiny-many", (32, 64, 64), (16, 32, 32), "uint8",
                                                             "zstd", count=20), (16, 32, 32)),
            Scenario(8, "tiny sharded zstd, small inner chunks",
                     VolumeSpec("tiny-small-inner", (64, 128, 128), (16, 16, 16), "uint16", "zstd",
                                shards=(32, 64, 64)), (32, 32, 32), batch_size=16),
            # scenario 9's inner chunks and content (its compression ratio), in a smaller volume and crops
            Scenario(9, "tiny microscopy-like, sharded zstd",
                     VolumeSpec("tiny-microscopy", (64, 256, 256), (32, 64, 64), "uint16", "zstd",
                                shards=(64, 128, 128), content="microscopy"), (32, 96, 96)),
            Scenario(10, "tiny weather-like fields, blosc zstd bitshuffle",
                     VolumeSpec("tiny-weather", (48, 91, 180), (4, 91, 180), "float32", "blosc-zstd-bitshuffle",
                                content="weather"), (8, 91, 180)),
        ]
    base = VolumeSpec("s1-lz4", (256, 1024, 1024), (32, 128, 128), "uint16", "blosc-lz4")
    return [
        Scenario(1, "blosc lz4+shuffle, random 32x128x128", base, (32, 128, 128), timed_batches=60),
        Scenario(2, "as 1, sharded 64x512x512",
                 VolumeSpec("s2-sharded", base.shape, base.chunks, "uint16", "blosc-lz4", shards=(64, 512, 512)),
                 (32, 128, 128), timed_batches=60),
        Scenario(3, "as 1, blosc zstd", VolumeSpec("s3-zstd", base.shape, base.chunks, "uint16", "blosc-zstd"),
                 (32, 128, 128), timed_batches=60),
        Scenario(4, "as 1, random 64x256x256", base, (64, 256, 256)),
        Scenario(5, "as 1, aligned tile grid", base, (32, 128, 128), grid=True, timed_batches=250),
        Scenario(6, "1,000 arrays 64x256x256 u8, zstd, random 32x64x64",
                 VolumeSpec("s6-many", (64, 256, 256), (32, 64, 64), "uint8", "zstd", count=1000), (32, 64, 64),
                 timed_batches=120),
        Scenario(7, "as 1, zstd alone (zarr v3's default codec)",
                 VolumeSpec("s7-zstd", base.shape, base.chunks, "uint16", "zstd"), (32, 128, 128), timed_batches=40),
        # Sharding exists to make inner chunks small: 64 KiB zstd chunks, 8-27 of them per crop.
        Scenario(8, "shards 128x256x256 of zstd 32x32x32 inner chunks, random 64x64x64",
                 VolumeSpec("s8-small-inner", base.shape, (32, 32, 32), "uint16", "zstd", shards=(128, 256, 256)),
                 (64, 64, 64), timed_batches=40, batch_size=16),
        # Data that compresses like real measurements (the others store nearly as many bytes as they decode).
        # Microscopy-like uint16 (cells, membranes, nuclei, shot noise; zstd stores it about 2.9x smaller)
        # in the layout of a common microscopy training setup: 32x64x64 zstd inner chunks in shards, random
        # 128^3 crops, 32 a batch (256 MiB of float32: the bench's 4 slots and 256 MiB take 1.25 GiB).
        Scenario(9, "microscopy-like u16, shards 128x256x256 of zstd 32x64x64, random 128^3",
                 VolumeSpec("s9-microscopy", base.shape, (32, 64, 64), "uint16", "zstd", shards=(128, 256, 256),
                            content="microscopy"), (128, 128, 128), timed_batches=10, batch_size=32),
        # Weather-like float32 (time in 6-hour steps, 1-degree latitude, longitude), chunked as xarray
        # writes a reanalysis (a day of steps a chunk, the whole globe), blosc zstd with bitshuffle; crops
        # are 2-day windows of the whole globe.
        Scenario(10, "weather-like f32 1460x181x360, blosc zstd bitshuffle 4x181x360, 8-step windows",
                 VolumeSpec("s10-weather", (1460, 181, 360), (4, 181, 360), "float32", "blosc-zstd-bitshuffle",
                            content="weather"), (8, 181, 360), timed_batches=30),
    ]


def make_samples(paths: list[str], shape: tuple[int, ...], crop: tuple[int, ...], n: int, grid: bool,
                 seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    if grid:
        corners = [c for c in np.ndindex(*(s // k for s, k in zip(shape, crop)))]
        order = rng.permutation(len(corners))
        out = []
        while len(out) < n:
            for i in order:
                corner = [c * k for c, k in zip(corners[i], crop)]
                out.append(Sample(paths[int(rng.integers(len(paths)))], [(a, a + k) for a, k in zip(corner, crop)]))
                if len(out) == n:
                    break
        return out
    out = []
    for _ in range(n):
        corner = [int(rng.integers(0, s - k + 1)) for s, k in zip(shape, crop)]
        out.append(Sample(paths[int(rng.integers(len(paths)))], [(a, a + k) for a, k in zip(corner, crop)]))
    return out


# -- measurement helpers ----------------------------------------------------------------------------


@dataclass
class Result:
    peer: str
    seconds: float
    samples: int
    delivered_bytes: int  # source-dtype bytes of the crops
    peak_rss: int
    extra: dict = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.delivered_bytes / self.seconds / 1e6 if self.seconds else 0.0


def busy_step(seconds: float) -> int:
    """Run pure Python for ``seconds`` of wall time, as an eager training step's Python does: small
    operations in a loop until the deadline, holding the GIL (``time.sleep`` would release it). Other
    threads get the GIL only when the interpreter's switch interval makes this loop hand it over."""
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        for i in range(64):
            n += i & 7
    return n


class Consumer:
    """What a peer's consumer does with each timed batch: nothing, or a busy step of ``step_s``; keeps the
    CPU time of its steps (``step_cpu_s``), which is the training loop's, not the loader's."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.step_cpu_s = 0.0

    def __call__(self, batch=None) -> None:
        if self.step_s > 0:
            t0 = time.thread_time()
            busy_step(self.step_s)
            self.step_cpu_s += time.thread_time() - t0


def split_batches(samples: list[Sample], batch_size: int) -> list[list[Sample]]:
    """``samples`` in consecutive batches of ``batch_size`` (a short tail left out)."""
    return [samples[i:i + batch_size] for i in range(0, len(samples) - batch_size + 1, batch_size)]


def _slices(s: Sample) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in s.aabb)


# -- peers ------------------------------------------------------------------------------------------


def time_pipeline(p: Pipeline, samples: list[Sample], batch_size: int, consume=lambda x: None,
                  sync=lambda: None, clock: dict | None = None) -> tuple[int, float, float]:
    """``(timed batches, seconds, first-batch seconds)`` for a pipeline over ``samples``.

    Warm-up: the first batch (its latency is the first-batch time), then its crops again until every
    batch slot has been written once. A pipeline allocates its slots once and reuses them for the whole
    run, so their first touch (page faults, huge-page compaction: scenario 4's four 128 MB slots cost
    its 30-batch window a third of its rate) is not the steady state. The timed samples are pushed only
    when the clock starts, as tensorstore issues its first timed read only after its warm-up: no peer
    has work done before its clock starts. ``consume(x)`` runs on every timed batch; ``sync`` before the
    clock starts and before it stops. ``clock`` (a dict) gets ``"cpu"``: the process's CPU seconds in the
    timed window (every thread of it, the pipeline's and the consumer's).
    """
    n = len(samples) // batch_size - 1
    t_push = time.perf_counter()
    p.push(samples[:batch_size])
    with p.pop() as b:
        torch.from_dlpack(b)
    first = time.perf_counter() - t_push
    p.push(samples[:batch_size] * p.cfg.lookahead_batches)  # the other slots, once each
    for _ in range(p.cfg.lookahead_batches):
        with p.pop() as b:
            torch.from_dlpack(b)
    p.stats_reset()
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    p.push(samples[batch_size: (n + 1) * batch_size])
    for _ in range(n):
        with p.pop() as b:
            consume(torch.from_dlpack(b))
    sync()
    if clock is not None:
        clock["cpu"] = time.process_time() - c0
    return n, time.perf_counter() - t0, first


def stoker_config(batch_size: int, host_buffer_bytes: int, dtype: str = "f32", device: str = "cpu",
                  threads: int | None = None, storage_options: dict | None = None,
                  cache_dir: str | None = None, cache_bytes: int = CACHE_BYTES,
                  cache_staleness_s: float | None = None) -> Config:
    """The pipeline every stoker peer runs (``device="cpu"`` also on a GPU machine unless asked); compute
    threads: the default (this rank's share of the CPUs) unless ``threads`` says; a disk cache at
    ``cache_dir`` (None: none) bounded by ``cache_bytes``, its generations trusted for ``cache_staleness_s``
    (None: the library's default)."""
    return Config(batch_size=batch_size, dtype=dtype, host_buffer_bytes=host_buffer_bytes, device_buffer_bytes=2 << 30,
                  n_io_threads=2, lookahead_batches=LOOKAHEAD, device=device, n_compute_threads=threads,
                  storage_options=storage_options, cache_dir=cache_dir,
                  cache_bytes=None if cache_dir is None else cache_bytes,
                  cache_staleness_s=None if cache_dir is None else cache_staleness_s)


class PipelineCollections:
    """CPU seconds of the garbage collections run on a pipeline's threads while the block runs. A
    collection holds the GIL and runs on whichever thread's allocation triggers it, so these are part of
    ``Stats.gil_seconds``; a full one can take tens of milliseconds and dominate a short window."""

    def __enter__(self) -> "PipelineCollections":
        self.seconds = 0.0
        self._t0 = None
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase: str, info: dict) -> None:
        if not gil.enrolled():  # a collection on the consumer's thread is not the pipeline's
            return
        if phase == "start":
            self._t0 = time.thread_time()  # one collection at a time: it holds the GIL
        elif self._t0 is not None:
            self.seconds += time.thread_time() - self._t0
            self._t0 = None

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def run_stoker(samples: list[Sample], batch_size: int, itemsize: int, host_buffer_bytes: int,
               threads: int | None = None, step_s: float = 0.0, storage_options: dict | None = None,
               mark=lambda: None, cache_dir: str | None = None, cache_bytes: int = CACHE_BYTES,
               cache_staleness_s: float | None = None, between: Callable[[], None] | None = None) -> Result:
    """The stoker peer; ``threads`` compute threads (a peer of a thread sweep, named ``stoker t=N``) or the
    default. ``cpu_s``: the process's CPU time while timed, less the consumer's steps; ``gc_s``: the
    pipeline threads' garbage collections while timed. ``mark`` runs as the clock starts and stops.

    ``between``: two epochs of ``samples`` in one pipeline, as a training loop's ``set_epoch`` and ``push``
    make them (bench/epochs.py, the ``(same pipeline)`` peers): the first untimed and without the consumer's
    steps, then ``between()``, then the second, timed as a lone epoch is (its first batch and the slots' warm-up
    over the same crops again, then the clock); ``extra["first_epoch_s"]``: the first epoch's wall time and
    ``between``'s (how old what the first epoch learnt is as the second starts)."""
    marks: list[tuple[float, float]] = []  # (process CPU time, collections) as the clock starts and stops
    thread_cpu = ThreadCPU()  # each thread's CPU in the window, by role (--thread-cpu)

    def sync() -> None:
        mark()
        marks.append((time.process_time(), collections.seconds))
        thread_cpu.mark()

    consume = Consumer(step_s)
    config = stoker_config(batch_size, host_buffer_bytes, threads=threads, storage_options=storage_options,
                           cache_dir=cache_dir, cache_bytes=cache_bytes, cache_staleness_s=cache_staleness_s)
    with RssSampler() as rss, PipelineCollections() as collections, Pipeline(config) as p:
        if between is not None:  # the first epoch, untimed: its marks and steps would be the second's
            t_first = time.perf_counter()
            time_pipeline(p, samples, batch_size)
            between()
            first_epoch_s = time.perf_counter() - t_first
        n, seconds, first = time_pipeline(p, samples, batch_size, consume=consume, sync=sync)
        stats = p.stats()
    crop = int(np.prod(samples[0].shape))
    name = "stoker" if threads is None else f"stoker t={threads}"
    on_cpu = [w.on_cpu for w in stats.workers]  # the compiled engine's threads (none without it)
    if between is not None:
        on_cpu = [None]  # the engine's counts span both epochs: not this window's
    result = Result(name, seconds, n * batch_size, n * batch_size * crop * itemsize, rss.peak,
                    {"stats": stats, "first_batch_s": first, "batches": n,
                     "cpu_s": marks[-1][0] - marks[0][0] - consume.step_cpu_s, "gc_s": marks[-1][1] - marks[0][1],
                     "thread_cpu": thread_cpu.per_batch(n, None if None in on_cpu else sum(on_cpu),
                                                        consume.step_cpu_s)})
    if between is not None:
        result.extra["first_epoch_s"] = first_epoch_s
    return result


def cpu_breakdown(stats, cpu_s: float, batches: int, wall_s: float, gc_s: float = 0.0, remote: bool = False) -> str:
    """One line: stoker's CPU time per timed batch (the process's, so every thread, less a busy consumer's
    steps) and its stage times per batch with their shares of it. Stage times are thread time, waits for
    a core included; "other" is the rest: Python bookkeeping, the consumer. The decode
    bound times the decode stage alone, so read, cast, plan and other are what stoker pays on top of it.
    Last, the CPU time the pipeline's threads held the GIL (``Stats.gil_seconds``; it overlaps the
    stages), and the part of it that garbage collections took (``gc_s``, see :class:`PipelineCollections`).
    With ``remote``, what are waits for the network, not CPU: the fetches from the store, and the planning's
    waits for arrays' opens and shard indexes (the ``plan_wait`` stage; ``plan`` is the planning's CPU).

    >>> cpu_breakdown(stats, cpu_s=1.58, batches=120, wall_s=0.82)
    'stoker per batch: 13.20 ms CPU (1.9 cores busy); decode 9.83 (75%), ...; GIL held 1.10 (8%; garbage ...)'
    """
    if cpu_s <= 0 or wall_s <= 0 or batches <= 0:
        return "stoker per batch: no CPU time measured"
    from .report import stage_breakdown

    b = stage_breakdown(stats, cpu_s, batches, wall_s, gc_s)
    fetch = ""
    if remote:  # reads from a store are waits for the network (summed over the fetches in flight), not CPU
        wait = b["stages_ms_per_batch"].pop("read")
        b["stages_ms_per_batch"]["other"] += wait
        fetch = (f"; fetches from the store {wait:.2f} ms (wall time, summed over the fetches in flight); planning "
                 f"waited {b['plan_wait_ms_per_batch']:.2f} ms (wall time: arrays' opens, shard indexes)")
    shares = ", ".join(f"{name} {ms:.2f} ({ms / b['cpu_ms_per_batch']:.0%})"
                       for name, ms in b["stages_ms_per_batch"].items())
    held = (f"GIL held {b['gil_ms_per_batch']:.2f} ({b['gil_ms_per_batch'] / b['cpu_ms_per_batch']:.0%}; "
            f"garbage collection {b['gc_ms_per_batch']:.2f} of it)")
    return (f"stoker per batch: {b['cpu_ms_per_batch']:.2f} ms CPU ({b['cores_busy']:.1f} cores busy); {shares}; "
            f"{held}{fetch}")


def worker_table(results: list[Result]) -> list[str]:
    """A row per stoker peer of a thread sweep: where its engine threads' timed window went (shares of their
    wall time, means over the threads; busy is all but the waits: lock, idle, budget), what the OS says
    (on a core, waiting in the run queue), the work per chunk (busy time, and CPU time: the OS's), and the
    coordinator's CPU per batch, its share of a core and its run-queue wait per batch (see
    docs/performance.md, "Many cores")."""
    from .report import worker_breakdown

    rows = [(r.peer, worker_breakdown(r.extra["stats"], r.extra["batches"], r.seconds)) for r in results
            if r.extra.get("stats") is not None and r.extra.get("batches")]
    rows = [(peer, w) for peer, w in rows if w["threads"]]
    if not rows:
        return []

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}"

    def _ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    def _us(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    out = ["engine threads in the timed window (% of their wall time, mean over threads; busy: not waiting for a "
           "lock, work or the budget):",
           f"{'peer':<14}{'thr':>4}{'busy':>7}{'min-max':>13}{'read':>6}{'decode':>7}{'copy':>6}{'fill':>6}"
           f"{'lock':>6}{'idle':>6}{'budget':>7}{'other':>6}{'on CPU':>8}{'run q':>7}{'us/chunk':>9}{'cpu us':>8}{'coord ms':>9}"
           f"{'coord cores':>12}{'coord runq':>11}"]
    for peer, w in rows:
        sh = w["shares"]
        out.append(f"{peer:<14}{w['threads']:>4}{pct(w['busy_share']):>7}"
                   f"{pct(w['busy_min']) + '-' + pct(w['busy_max']):>13}"
                   + "".join(f"{pct(sh[name]):>{width}}" for name, width in
                             (("read", 6), ("decode", 7), ("copy", 6), ("fill", 6), ("lock", 6), ("idle", 6),
                              ("budget", 7), ("other", 6)))
                   + f"{pct(w['on_cpu_share']):>8}{pct(w['run_queue_share']):>7}{w['us_per_chunk']['busy']:>9.1f}"
                   f"{_us(w['cpu_us_per_chunk']):>8}"
                   f"{w['coordinator_ms_per_batch']:>9.3f}{w['coordinator_cores']:>12.2f}"
                   f"{_ms(w['coordinator_run_queue_ms_per_batch']):>11}")
    return out


def interleaved(peers: dict, rounds: int) -> dict[str, Result]:
    """Run every peer ``rounds`` times, taking turns, and keep each one's median round: a slow spell of
    a shared machine then costs every peer a round instead of skewing one peer's number."""
    runs: dict[str, list[Result]] = {name: [] for name in peers}
    for _ in range(rounds):
        for name, fn in peers.items():
            runs[name].append(fn())
    return {name: _median(rs) for name, rs in runs.items()}


def time_tensorstore(samples: list[Sample], batch_size: int, deliver, sync=lambda: None,
                     consume=lambda batch: None, kvstore=None, context=None) -> float:
    """Seconds for tensorstore to read every batch after the first, ``deliver(futures)`` each and
    ``consume`` what it returns.

    Futures for every crop of a batch are in flight together, and the next batch's are issued before
    the current one is delivered (and so read while it is consumed, as a training loop that prefetches
    one batch would). ``sync`` runs before the clock starts and before it stops (a GPU synchronise for
    device peers). ``kvstore(uri)``: the kvstore spec of an array (default: a local directory).
    ``context``: a ``tensorstore.Context`` to open the arrays in (its cache kept between calls).
    """
    import tensorstore as ts

    kvstore = kvstore or (lambda uri: {"driver": "file", "path": uri})
    # a context kept between epochs (bench/epochs.py): what its cache_pool holds is revalidated at open
    extra = {} if context is None else {"context": context}
    recheck = {} if context is None else {"recheck_cached_data": "open"}

    arrays: dict[str, object] = {}

    def arr(uri: str):
        if uri not in arrays:
            arrays[uri] = ts.open({"driver": "zarr3", "kvstore": kvstore(uri), **recheck}, **extra).result()
        return arrays[uri]

    def issue(batch):
        return [arr(s.uri)[_slices(s)].read() for s in batch]

    batches = split_batches(samples, batch_size)
    deliver(issue(batches[0]))  # warm-up (also opens arrays)
    sync()
    t0 = time.perf_counter()
    pending = issue(batches[1])
    for batch in batches[2:]:
        nxt = issue(batch)
        consume(deliver(pending))
        pending = nxt
    consume(deliver(pending))
    sync()
    return time.perf_counter() - t0


def run_tensorstore(samples: list[Sample], batch_size: int, itemsize: int, step_s: float = 0.0, kvstore=None,
                    mark=lambda: None, context=None) -> Result:
    shape = samples[0].shape

    def assemble(futures):
        out = np.empty((len(futures), *shape), dtype=np.float32)
        for i, f in enumerate(futures):
            out[i] = f.result()
        return torch.from_numpy(out)

    with RssSampler() as rss:
        seconds = time_tensorstore(samples, batch_size, assemble, consume=Consumer(step_s), kvstore=kvstore,
                                   sync=mark, context=context)
    n = len(split_batches(samples, batch_size)) - 1
    return Result("tensorstore", seconds, n * batch_size, n * batch_size * int(np.prod(shape)) * itemsize, rss.peak)


def run_zarr(samples: list[Sample], batch_size: int, itemsize: int, max_batches: int,
             step_s: float = 0.0, opener: ZarrOpener | None = None, mark=lambda: None) -> Result:
    opener = opener or ZarrOpener(None)
    consume = Consumer(step_s)
    arrays: dict[str, object] = {}
    batches = split_batches(samples, batch_size)[: max_batches + 1]
    shape = samples[0].shape
    with RssSampler() as rss:
        t0 = 0.0
        for i, batch in enumerate(batches):
            if i == 1:
                mark()
                t0 = time.perf_counter()
            out = np.empty((len(batch), *shape), dtype=np.float32)
            for row, s in enumerate(batch):
                z = arrays.get(s.uri) or arrays.setdefault(s.uri, opener(s.uri))
                out[row] = z[_slices(s)]
            if i:
                consume(torch.from_numpy(out))
        seconds = time.perf_counter() - t0
        mark()
    n = len(batches) - 1
    return Result("zarr", seconds, n * batch_size, n * batch_size * int(np.prod(shape)) * itemsize, rss.peak)


class _ZarrCrops(torch.utils.data.Dataset):
    def __init__(self, samples: list[Sample], opener: ZarrOpener) -> None:
        self.samples = samples
        self.opener = opener
        self._arrays: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = self.samples[i]
        z = self._arrays.get(s.uri) or self._arrays.setdefault(s.uri, self.opener(s.uri))
        return torch.from_numpy(z[_slices(s)].astype(np.float32))


def dataloader_batches(max_batches: int) -> tuple[int, int]:
    """``(in_flight, timed)`` for the DataLoader peer: its prefetch depth, and at least 8 batches per worker."""
    workers = os.cpu_count() or 1
    return 2 * workers, max(max_batches, 8 * workers)


def run_zarr_dataloader(samples: list[Sample], batch_size: int, itemsize: int, max_batches: int,
                        step_s: float = 0.0, opener: ZarrOpener | None = None, mark=lambda: None) -> Result:
    # Timed in steady state: `in_flight` batches are being prepared when the clock starts and again when
    # it stops (the loader has more to do afterwards), so neither its prefetch head start nor its drain
    # counts. Timing from the first batch would mostly time batches prepared before the clock started.
    in_flight, n = dataloader_batches(max_batches)
    n_total = (1 + in_flight + n + in_flight) * batch_size
    if len(samples) < n_total:
        raise ValueError(f"the DataLoader peer needs {n_total} samples, got {len(samples)}")
    opener = opener or ZarrOpener(None)
    # Remote reads go through obstore, whose runtime does not survive a fork once this process has used
    # it (stoker's peer has): workers then start from a fresh forkserver process instead.
    loader = torch.utils.data.DataLoader(_ZarrCrops(samples[:n_total], opener), batch_size=batch_size,
                                         num_workers=os.cpu_count() or 1, prefetch_factor=2,
                                         multiprocessing_context="forkserver" if opener.remote else None)
    shape = samples[0].shape
    with RssSampler() as rss:
        it = iter(loader)
        for _ in range(1 + in_flight):  # warm-up: workers start, the prefetch queue fills
            next(it)
        consume = Consumer(step_s)
        mark()
        t0 = time.perf_counter()
        for _ in range(n):
            consume(next(it))
        seconds = time.perf_counter() - t0
        mark()
        del it  # the remaining batches are not needed: stop the workers
    return Result("zarr+DataLoader", seconds, n * batch_size, n * batch_size * int(np.prod(shape)) * itemsize,
                  rss.peak, {"note": "RSS of the main process only"})


_BOUND_WINDOW = 4  # batches read (untimed) and then decoded in one stream (timed)
_BOUND_SHARES_PER_CORE = 4  # a window's chunks are split into this many runs per thread, for balance


def decode_chunk_into(codec, key: str, data, out: np.ndarray) -> None:
    """Decode one stored chunk the cheapest way its codec offers: a lone zstd frame or blosc frame
    straight into ``out`` (``codec.nbytes`` bytes, reused), anything else through the codec chain.
    The bound's inner loop: no per-chunk allocation, no size checks, no layout views."""
    if codec.lone_zstd:
        numcodecs_zstd.decompress(data, out)
    elif codec.plain and codec.lone_blosc:
        codec.compressors[0].decode(data, out=out)
    else:
        codec.decode(data, key)


def _decode_run(run: list[tuple]) -> None:
    """Decode a run of ``(codec, key, data)`` on one thread into one reused buffer."""
    out = None
    for codec, key, data in run:
        if out is None or out.nbytes != codec.nbytes:
            out = np.empty(codec.nbytes, dtype=np.uint8)
        decode_chunk_into(codec, key, data, out)


def run_decode_bound(samples: list[Sample], batch_size: int, itemsize: int) -> Result:
    """Every chunk each batch needs, decoded once in full on all cores and nothing else: per thread a
    tight loop over its share into one reused buffer, as close to the codec's own speed as Python gets."""
    readers: dict[str, object] = {}
    batches = split_batches(samples, batch_size)[1:]
    cores = os.cpu_count() or 1
    seconds = 0.0
    decoded = 0
    with RssSampler() as rss, ThreadPoolExecutor(cores) as pool:
        for w in range(0, len(batches), _BOUND_WINDOW):
            encoded = []
            for batch in batches[w: w + _BOUND_WINDOW]:  # each batch's chunks once, as stoker de-duplicates
                needed: dict[tuple, tuple] = {}
                for s in batch:
                    r = readers.get(s.uri) or readers.setdefault(s.uri, open_array(s.uri))
                    for piece in chunk_intersections(s.aabb, r.chunks):
                        needed.setdefault((s.uri, piece.index), (r, piece.index))
                encoded += [(r, *r.encoded_chunk(idx)) for r, idx in needed.values()]  # untimed: read
            encoded = [(r.metadata.codec, key, data) for r, key, data in encoded if data is not None]
            # Several batches' chunks in one stream over all cores, in a few runs per thread: no wait
            # between batches and no per-chunk task holds the bound back.
            n_runs = min(len(encoded), cores * _BOUND_SHARES_PER_CORE) or 1
            runs = [encoded[i::n_runs] for i in range(n_runs)]
            t0 = time.perf_counter()
            for _ in pool.map(_decode_run, runs):
                pass
            seconds += time.perf_counter() - t0
            decoded += sum(codec.nbytes for codec, _, _ in encoded)
    n = len(batches)
    return Result("decode bound", seconds, n * batch_size, n * batch_size * int(np.prod(samples[0].shape)) * itemsize,
                  rss.peak, {"bytes_decoded": decoded})


# -- the run ----------------------------------------------------------------------------------------


def host_budget(sc: Scenario, batch_size: int, requested: int | None) -> int:
    """The scenario's host_buffer_bytes: as requested, or batch slots plus 256 MiB for reading and decoding."""
    if requested:
        return requested
    slot = batch_size * int(np.prod(sc.crop)) * 4  # float32 output
    return (LOOKAHEAD + 1) * slot + (256 << 20)


def measure_alone(paths: list[str], sc: Scenario, n_batches: int, batch_size: int, host_buffer_bytes: int) -> dict:
    """Run stoker on the same crops in a fresh process and return its memory figures."""
    import json
    import subprocess
    import sys

    args = json.dumps({"paths": paths, "shape": list(sc.volume.shape), "crop": list(sc.crop), "grid": sc.grid,
                       "seed": sc.number, "n_batches": n_batches, "batch_size": batch_size,
                       "host_buffer_bytes": host_buffer_bytes})
    out = subprocess.run([sys.executable, "-m", "stoker.bench.memory", args], capture_output=True, text=True,
                         check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(rounds: list[Result]) -> Result:
    """The round with the median throughput, carrying the highest peak RSS of all rounds."""
    ranked = sorted(rounds, key=lambda r: r.samples_per_s)
    mid = ranked[(len(ranked) - 1) // 2]
    mid.peak_rss = max(r.peak_rss for r in rounds)
    mid.extra["rounds"] = [r.samples_per_s for r in rounds]
    # each round's CPU per batch (ms), in round order: what a ratio of two peers per round is taken from
    mid.extra["rounds_cpu_ms"] = [r.extra["cpu_s"] / r.extra["batches"] * 1e3
                                  if r.extra.get("batches") and "cpu_s" in r.extra else None for r in rounds]
    return mid


@dataclass(frozen=True)
class Step:
    """A busy consumer's step after each batch: ``seconds`` of Python, and how they were chosen
    (``auto``: tensorstore's median batch time in the scenario, measured first without a step)."""

    seconds: float
    auto: bool = False


def _counted(fn, counters, batch_size: int):
    """``fn(mark)`` run with the server's counters read as its clock starts and stops: its result gets the
    requests and bytes served per timed batch, and the server's CPU seconds per batch where ``counters()``
    gives them (a third value)."""

    def run() -> Result:
        marks: list[tuple[int, int]] = []
        result = fn(lambda: marks.append(counters()))
        batches = result.samples / batch_size
        (q0, b0, *c0), (q1, b1, *c1) = marks[0], marks[-1]
        result.extra["requests_per_batch"] = (q1 - q0) / batches
        result.extra["bytes_per_batch"] = (b1 - b0) / batches
        if c0 and c1:  # the server's own CPU seconds (Served.counters(cpu=True)): what the loopback server cost
            result.extra["server_cpu_s_per_batch"] = (c1[0] - c0[0]) / batches
        return result

    return run


def auto_step(samples: list[Sample], batch_size: int, itemsize: int, rounds: int, kvstore=None) -> Step:
    """A step as long as tensorstore's median time per batch on ``samples`` (no consumer work)."""
    ts = interleaved({"tensorstore": lambda: run_tensorstore(samples, batch_size, itemsize, kvstore=kvstore)},
                     rounds)["tensorstore"]
    return Step(ts.seconds / (ts.samples // batch_size), auto=True)


def run_scenario(sc: Scenario, root: Path, n_batches: int, batch_size: int, host_buffer_bytes: int,
                 slow_batches: int, peers: set[str], growth: bool = False, rounds: int = 1,
                 threads: tuple[int, ...] = (), step_ms: float | str | None = None,
                 remote: Remote | None = None, counters=None, epochs: int = 0,
                 cache_bytes: int = CACHE_BYTES, cache_staleness_s: float | None = None
                 ) -> tuple[list[Result], Step | None]:
    """Every peer in ``peers`` on the scenario's crops, in interleaved rounds; ``threads``: a stoker peer
    per compute-thread count besides the default one (a thread sweep, for machines of many cores).
    ``step_ms``: a busy consumer (milliseconds of Python after each batch, or ``"auto"``); the decode
    bound is then left out. Returns the results and the step (None without a busy consumer).

    ``remote``: every peer reads the arrays through the bench server (``--store``), and ``counters()``
    (the server's ``(requests, bytes)``) gives each peer's requests and bytes per timed batch; the
    decode bound and stoker's fresh-process memory runs are left out. ``epochs``: with ``remote``, also
    stoker through a local disk cache bounded by ``cache_bytes`` (its generations trusted for
    ``cache_staleness_s``; None: the library's default), a peer per epoch, each a new pipeline, and with 2 or
    more the second epoch of one pipeline, beside the same from local files (:mod:`stoker.bench.epochs`)."""
    paths = ensure(root, sc.volume)
    warm_page_cache(paths)
    in_flight, dl_timed = dataloader_batches(slow_batches)
    n_samples = max(n_batches + 1, 1 + 2 * in_flight + dl_timed) * batch_size
    uris = [remote.uri(p) for p in paths] if remote else paths
    samples = make_samples(uris, sc.volume.shape, sc.crop, n_samples, sc.grid, seed=sc.number)
    timed = samples[: (n_batches + 1) * batch_size]  # the same crops for every peer but the DataLoader
    samples, all_samples = timed, samples
    itemsize = np.dtype(sc.volume.dtype).itemsize
    step = None
    if step_ms == "auto":
        step = auto_step(samples, batch_size, itemsize, rounds, remote.tensorstore_kvstore if remote else None)
    elif step_ms is not None:
        step = Step(step_ms / 1e3)
    step_s = step.seconds if step else 0.0
    options = remote.storage_options() if remote else None
    kvstore = remote.tensorstore_kvstore if remote else None
    opener = ZarrOpener(remote)
    # Every peer takes its turn in every round, the slow ones too: a ratio to a peer timed minutes
    # later would mostly measure how the shared machine's speed drifted meanwhile.
    every = {
        "stoker": lambda m: run_stoker(samples, batch_size, itemsize, host_buffer_bytes, step_s=step_s,
                                       storage_options=options, mark=m),
        **{f"stoker t={t}": (lambda m, t=t: run_stoker(samples, batch_size, itemsize, host_buffer_bytes, t, step_s,
                                                       options, m))
           for t in threads},
        "tensorstore": lambda m: run_tensorstore(samples, batch_size, itemsize, step_s, kvstore, m),
        "zarr": lambda m: run_zarr(samples, batch_size, itemsize, slow_batches, step_s, opener, m),
        "dataloader": lambda m: run_zarr_dataloader(all_samples, batch_size, itemsize, slow_batches, step_s, opener,
                                                    m),
        "bound": lambda m: run_decode_bound(samples, batch_size, itemsize),
    }
    if remote is not None and epochs:
        peers = set(peers)
        if "stoker" in peers:  # the same crops from the local files; then each epoch through the disk cache
            local = dict(zip(uris, paths))
            on_disk = [Sample(local[s.uri], s.aabb) for s in samples]
            every[LOCAL] = lambda m: _named(run_stoker(on_disk, batch_size, itemsize, host_buffer_bytes,
                                                       step_s=step_s, mark=m), LOCAL)
            every.update(epoch_peers(epochs, lambda m, folder: run_stoker(
                samples, batch_size, itemsize, host_buffer_bytes, step_s=step_s, storage_options=options, mark=m,
                cache_dir=folder, cache_bytes=cache_bytes, cache_staleness_s=cache_staleness_s), cache_bytes,
                cache_staleness_s))
            if epochs >= 2:  # the second epoch as a training loop reads it: in the pipeline that read the first
                every.update(same_pipeline_peers(
                    lambda m, folder, between: run_stoker(
                        samples, batch_size, itemsize, host_buffer_bytes, step_s=step_s, storage_options=options,
                        mark=m, cache_dir=folder, cache_bytes=cache_bytes, cache_staleness_s=cache_staleness_s,
                        between=between),
                    lambda m, between: run_stoker(on_disk, batch_size, itemsize, host_buffer_bytes, step_s=step_s,
                                                  mark=m, between=between),
                    cache_bytes, cache_staleness_s))
        if "tensorstore" in peers:
            every.update(tensorstore_epoch_peers(epochs, lambda m, context: run_tensorstore(
                samples, batch_size, itemsize, step_s, kvstore, m, context)))
        if "zarr" in peers:
            every.update(zarr_epoch_peers(epochs, lambda m: run_zarr(samples, batch_size, itemsize, slow_batches,
                                                                      step_s, opener, m)))
        peers |= {name for name in every if name in (LOCAL, LOCAL_SAME, SAME) or name.rsplit(" e", 1)[-1].isdigit()}
    if step is not None or remote is not None:
        del every["bound"]  # no consumer to be busy, or no reads to make: its number would not compare
    if counters is not None:
        every = {name: _counted(fn, counters, batch_size) for name, fn in every.items()}
    else:
        every = {name: (lambda fn=fn: fn(lambda: None)) for name, fn in every.items()}
    # the sweep's peers were asked for by name (--threads), whatever --peers says
    medians = interleaved({name: fn for name, fn in every.items() if name in peers or name.startswith("stoker t=")},
                          rounds)
    results = [medians[name] for name in every if name in medians]
    if "stoker" in peers and remote is None:
        st = next(r for r in results if r.peer == "stoker")
        st.extra["alone"] = measure_alone(paths, sc, n_batches, batch_size, host_buffer_bytes)
        st.extra["host_buffer_bytes"] = host_buffer_bytes
        if growth and len(paths) >= 10:
            # Enough crops to visit every array about twice, over all arrays and over a tenth of them.
            n_growth = max(n_batches, -(-2 * len(paths) // batch_size))
            st.extra["growth_all"] = measure_alone(paths, sc, n_growth, batch_size, host_buffer_bytes)
            st.extra["growth_tenth"] = measure_alone(paths[: len(paths) // 10], sc, n_growth, batch_size,
                                                     host_buffer_bytes)
            st.extra["growth_batches"] = n_growth
    return results, step


def _named(result: Result, name: str) -> Result:
    result.peer = name
    return result


def ratio_note(ratio: float | None) -> str:
    """The header's words for a dataset's compression ratio (decoded bytes over stored bytes)."""
    return "" if ratio is None else f"; compression ratio {ratio:.2f} (decoded / stored bytes)"


def dataset_ratio(root: Path, sc: Scenario) -> float:
    """The compression ratio of the scenario's dataset (written first if it is not yet): decoded / stored."""
    return compression_ratio(ensure(root, sc.volume)[0], sc.volume)


def format_results(sc: Scenario, results: list[Result], timed_batches: int, batch_size: int,
                   step: Step | None = None, compression: float | None = None) -> str:
    by = {r.peer: r for r in results}
    st = by.get("stoker")
    lines = [f"\nScenario {sc.number}: {sc.title} (batch {batch_size}, {timed_batches} timed batches per fast peer"
             f"{ratio_note(compression)})"]
    if step is not None:
        how = "auto: tensorstore's median batch time without a step" if step.auto else "--step-ms"
        lines.append(f"busy consumer: {step.seconds * 1e3:.2f} ms of Python holding the GIL after each batch ({how}); "
                     f"the steps alone allow at most {batch_size / step.seconds:.1f} samples/s; decode bound left "
                     "out (it has no consumer)")
    served = any("requests_per_batch" in r.extra for r in results)  # --store: what the server was asked
    if any(r.peer.endswith(" e1") for r in results):
        lines.append(epochs_note(by))
    width = max([18] + [len(r.peer) + 2 for r in results])  # the epochs' "(same pipeline)" rows are longer
    lines.append(f"{'peer':<{width}}{'samples/s':>11}{'MB/s':>9}{'stoker x':>10}{'peak RSS MB':>13}"
                 + (f"{'requests/batch':>16}{'MB/batch':>10}" if served else ""))
    for r in results:
        ratio = f"{st.samples_per_s / r.samples_per_s:>9.2f}x" if st and r is not st and r.samples_per_s else f"{'':>10}"
        line = f"{r.peer:<{width}}{r.samples_per_s:>11.1f}{r.mb_per_s:>9.1f}{ratio}{r.peak_rss / 1e6:>13.0f}"
        if "requests_per_batch" in r.extra:
            line += f"{r.extra['requests_per_batch']:>16.1f}{r.extra['bytes_per_batch'] / 1e6:>10.2f}"
        if hit_rate(r.extra) is not None:
            line += f"  disk cache: {r.extra['disk_bytes_per_batch'] / 1e6:.2f} MB/batch, hit rate {hit_rate(r.extra):.1%}"
        lines.append(line)
    server_cpu = [f"{r.peer} {r.extra['server_cpu_s_per_batch'] * 1e3:.2f} ms" for r in results
                  if "server_cpu_s_per_batch" in r.extra]
    if server_cpu:  # on this machine's cores beside the peers; a remote server's would not be
        lines.append("bench server CPU per batch (its own process, not the peer's): " + ", ".join(server_cpu))
    lines += second_epoch_lines(by)
    lines += [line for line in (cache_peak_line(r.peer, r.extra) for r in results) if line]
    if st:
        stats = st.extra["stats"]
        bound = by.get("decode bound")
        frac = f"{st.samples_per_s / bound.samples_per_s:.0%}" if bound and bound.samples_per_s else "n/a"
        lines.append(
            f"stoker: {frac} of decode bound; read amplification {stats.read_amplification:.2f}, "
            f"decode amplification {stats.decode_amplification:.2f} (bound decodes "
            f"{bound.extra['bytes_decoded'] / max(1, bound.delivered_bytes):.2f}x)" if bound else
            f"stoker: read amplification {stats.read_amplification:.2f}, decode {stats.decode_amplification:.2f}"
        )
    for r in results:  # the default stoker, then each peer of a thread sweep
        if "cpu_s" in r.extra:
            line = cpu_breakdown(r.extra["stats"], r.extra["cpu_s"], r.extra["batches"], r.seconds,
                                 r.extra.get("gc_s", 0.0), remote=served and r.peer not in (LOCAL, LOCAL_SAME))
            lines.append(line if r is st else line.replace("stoker per batch", f"{r.peer} per batch", 1))
    if any(r.peer.startswith("stoker t=") for r in results):  # a thread sweep: where each count's time went
        lines += worker_table(results)
    if st:
        spread = [f"{r.peer} {min(r.extra['rounds']):.0f}-{max(r.extra['rounds']):.0f}" for r in results
                  if len(r.extra.get("rounds", ())) > 1]
        if spread:
            lines.append(f"rounds: {len(st.extra['rounds'])} interleaved, median shown; samples/s range: "
                         + ", ".join(spread))
        alone = st.extra.get("alone")
        cold = alone.get("first_batch_s") if alone else None
        lines.append(f"stoker: first batch {st.extra['first_batch_s'] * 1e3:.0f} ms after push" + (
            f"; {cold * 1e3:.0f} ms in a fresh process with its arrays out of the page cache" if cold is not None
            else ""))
        if alone:
            budget = st.extra["host_buffer_bytes"]
            lines.append(
                f"stoker alone (fresh process): peak RSS {alone['peak'] / 1e6:.0f} MB = host_buffer_bytes "
                f"{budget / 1e6:.0f} MB {(alone['peak'] - budget) / 1e6:+.0f} MB (interpreter and libraries "
                f"{alone['baseline'] / 1e6:.0f} MB); buffers at peak {alone['peak_host_bytes'] / 1e6:.0f} MB")
        small, full = st.extra.get("growth_tenth"), st.extra.get("growth_all")
        if small and full:
            # Above the interpreter and libraries: the part of RSS that stoker's own state could grow.
            grow_small, grow_full = small["peak"] - small["baseline"], full["peak"] - full["baseline"]
            lines.append(f"stoker dataset growth ({st.extra['growth_batches']} batches, every array visited): peak "
                         f"RSS above baseline {grow_small / 1e6:.0f} MB over a tenth of the arrays, "
                         f"{grow_full / 1e6:.0f} MB over all ({grow_full / grow_small - 1:+.1%})")
    return "\n".join(lines)
