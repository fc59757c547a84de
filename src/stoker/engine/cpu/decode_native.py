"""The compiled decode path: one call into the engine per batch, and Python only for what it leaves.

:class:`NativeDecoder` turns a :class:`~stoker.engine.planning.tables.TablePlan` into the engine's tables (numpy,
a constant number of steps per batch plus one per array), submits them to ``stoker._native.Engine``, whose
threads read, decode, cast and place every chunk with no GIL held, and when the job is done maps its
statuses (also with numpy): chunks placed are counted in one step; the few that need Python (codecs, filters
and float16 batches the engine does not do, frames it declines, shards rewritten since their index was read) go to the
Python path (:mod:`.decode_python`), and failures become the same typed errors as there, naming the array
and the chunk key. Of the engine's chunks, the error a batch reports is the one of its lowest-numbered failing
chunk; a chunk the engine never took (another codec) runs beside them, and when one of those fails too, the
batch reports whichever failed first.

Chunks of arrays in stores (object stores, zip archives) are fetched first (:meth:`PythonDecoder.fetch`,
planned here with numpy), and each finished fetch goes to the engine in one call, which reads them from the
fetched buffers with the same checks as files; what it declines the Python path decodes from those bytes.
Those a store's disk cache holds at a generation known now are not fetched: the engine reads their entries
itself, as local files, checks and decodes them (:meth:`NativeDecoder._from_disk`); an entry it finds
missing or unsound sends its chunk to the fetch after all.

A batch the engine makes whole (every chunk its own, or every chunk read from disk-cache entries; no
completion hook) is settled by the thread that waits for it, the consumer's at ``pop``: its wait is the engine's, in C with the GIL released, and the
first waiter to see the job done maps its statuses, once (:meth:`~.executor.Job.settled_by`). Waking a
thread of ours to do that and then waking the consumer cost more GIL than the mapping itself (scenario 5:
about 0.19 ms a batch against 0.08). The rest (batches with chunks the engine did not place, fetched
chunks, batches with a hook: a transform, the copy to a GPU) go to a finisher thread per decoder, which
waits for each engine job in order, so neither the pipeline's coordinator nor ``pop`` runs the Python
path's reads.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import threading
import time
from array import array
from typing import Any, Callable

import numcodecs
import numpy as np
import torch

from ...runtime import gil
from ...runtime.faults import serve
from ...runtime.memo import remember
from ...runtime.schedstat import run_times
from ...runtime.workers import no_thread, start_thread
from . import native
from .cf import rounds_once
from ...errors import DecodeError, InternalError, OutOfMemory, StorageError, pipeline_closed
from ...storage.local import not_regular
from ..cast import fill_value_as, range_error, torch_dtype_of, unfit_range
from ...storage import ByteRange
from ...storage.objectstore import etag_version
from .decode_python import Fetch, PythonDecoder, fetches_within, span_bytes
from .entry_table import EntryTable
from ...zarr.grid import grid_shape
from ..executor import Job
from .frame_spans import FrameBuffers, FrameTables
from ..stats import StatsRecorder
from ..planning.tables import TablePlan

#: A fetch of whole values over a network holds at most this much: a batch's chunk files fetched in a few
#: calls, whose first ones the engine decodes while the others are still in flight (one call for the whole
#: batch decodes nothing until its slowest request is in: scenario 1 over S3 at 20 ms went from 150-167 to
#: 186-201 samples/s with 16 MiB, about four calls per batch; 8 MiB gave 182-196). Inner chunks of shards are
#: not split so: the ranges of one shard in one call are merged into few requests (scenario 2 lost 10-15% and
#: made 30.8 requests a batch instead of 24.4). See docs/performance.md, "Tuning constants".
FETCH_MAX_BYTES = 16 << 20

#: Batches at least this large are written with streaming stores (whole cache lines straight to memory).
#: A batch that size outgrows the caches before anyone reads it, so ordinary stores only add a read of
#: every line; smaller ones are better left cached (docs/performance.md, "Tuning constants").
STREAM_MIN_BYTES = 8 << 20

_BATCH_KINDS = {torch.float32: native.KIND_F32, torch.bfloat16: native.KIND_BF16, torch.int32: native.KIND_I32,
                torch.int64: native.KIND_I64}
_ALIGN = 64  # the engine's scratch holds a chunk's decoded bytes rounded up to this, then a file's stored bytes


def native_codec(codec) -> int | None:
    """The engine's codec for chunks of ``codec`` (one compressor, no filters; any layout and byte order), or
    None (the Python path reads them)."""
    if codec.lone_zstd and native.zstd:
        return native.CODEC_ZSTD
    if codec.lone_blosc and native.blosc:
        return native.CODEC_BLOSC
    if codec.filters or len(codec.compressors) != 1:
        return None
    kind = type(codec.compressors[0])
    if kind is numcodecs.LZ4 and native.lz4_ready:
        return native.CODEC_LZ4
    if kind is numcodecs.Zlib and native.zlib_ready:
        return native.CODEC_ZLIB
    if kind is numcodecs.GZip and native.zlib_ready:
        return native.CODEC_GZIP
    return None


def scratch_need(codec, in_memory: bool = False) -> int:
    """Scratch one engine thread needs for a chunk of ``codec``: its decoded bytes, then its stored bytes, which
    a chunk fetched into memory (``in_memory``) does not need: the engine decodes it from the fetched buffer."""
    return -(-codec.nbytes // _ALIGN) * _ALIGN + (0 if in_memory else codec.max_stored_nbytes)


def batch_kind(out: torch.Tensor) -> int | None:
    """The engine's kind of batch for ``out``, or None where it cannot write it (float16, or a tensor that is
    not a C-contiguous CPU batch)."""
    if not out.is_cpu or out.dim() < 2 or not out.is_contiguous() or out.dtype == torch.float16:
        return None
    return _BATCH_KINDS.get(out.dtype, native.KIND_SAME)


def _float64(reader) -> bool:
    """Whether ``reader``'s chunks decode to float64 (either byte order)."""
    dt = reader.metadata.codec.dtype
    return dt.kind == "f" and dt.itemsize == 8


_FILL_WORDS: dict[tuple, int] = {}  # (fill value's dtype and bytes, batch dtype) -> its S_FILL word


def _fill_word(fill_value: np.ndarray, dtype: torch.dtype) -> int:
    """The sources table's S_FILL column for ``fill_value`` (the metadata's 0-d array of a numeric dtype: the
    engine fills no other) in a batch of ``dtype``: its bytes in that dtype, zero-padded to 8, as an int64.
    Kept per value and dtype: many arrays share a fill value, and the cast through torch costs more than the
    rest of describing an array to the engine."""
    key = (fill_value.dtype.str, fill_value.tobytes(), dtype)
    word = _FILL_WORDS.get(key)
    if word is None:
        fill = fill_value_as(fill_value, dtype).reshape(1).view(torch.uint8).numpy().tobytes()
        word = int(np.frombuffer(fill.ljust(8, b"\0"), np.int64)[0])
        remember(_FILL_WORDS, key, word, 1024)
    return word


class _Source:
    """What the engine's tables say of one array, made once per array and batch dtype."""

    __slots__ = ("row", "prefix", "codec", "nbytes", "stored", "fills", "reads", "memory", "kv", "key_prefix", "sep",
                 "info_row", "engine_only", "spans", "uid", "file_strides", "file_grid", "disk_row")

    def __init__(self, reader, dtype: torch.dtype, kind: int | None, budget: int) -> None:
        meta = reader.metadata
        codec = meta.codec
        ndim = len(codec.shape)
        src_kind = native.SOURCE_KINDS.get(codec.dtype)
        same_ok = kind != native.KIND_SAME or (src_kind is not None and dtype == torch_dtype_of(codec.dtype))
        # fills need the array's element kind only (and, in an integer batch, a fill value that fits it: else
        # the Python path fills, and fails naming the chunk); reads a codec it has, no filters (any layout, any
        # byte order) and room in the budget
        self.fills = (kind is not None and src_kind is not None and same_ok
                      and unfit_range(meta.fill_value, dtype) is None)
        self.codec = native_codec(codec)
        enc = meta.key_encoding
        self.key_prefix = reader.file_path(enc.prefix + enc.separator if enc.prefix else "")  # its chunks' keys
        self.prefix = os.fsencode(self.key_prefix)
        # a path the engine cannot build (deep folders) is read by the Python path, which has no such cap
        short = len(self.prefix) + 21 * ndim + 1 <= native.PATH_CAP
        decodes = bool(self.fills and not codec.filters and self.codec is not None and codec.nbytes
                       and scratch_need(codec, not reader.kv.is_local) <= budget)
        # a local array's store (is_local) holds files, which the engine opens and reads itself by path
        self.reads = decodes and short and reader.kv.is_local
        # an array in another store (an object store, a zip archive) has no files the engine can open:
        # its chunks are fetched through the store, and the engine decodes them from the fetched buffers
        self.memory = decodes and not reader.kv.is_local
        self.kv = reader.kv
        # blosc chunks fetched from a store may later be fetched as their needed blocks (frame_spans): only where
        # the Python path, should the engine leave one, also decodes those blocks alone (a plain layout)
        self.spans = bool(self.memory and self.codec == native.CODEC_BLOSC and codec.partial)
        self.sep = enc.separator
        row = [0] * (native.S_STRIDES + ndim)  # a list packed once: numpy's per-item stores cost more here
        row[native.S_KIND] = src_kind if self.fills else 0  # any kind: no chunk of it goes to the engine
        if self.fills:
            row[native.S_FILL] = _fill_word(meta.fill_value, dtype)
        if not self.reads:  # the engine builds no path of it (the Python path reads its chunks, or a store
            self.prefix = b"/"  # fetches them: an array at a store's root has no prefix)
        row[native.S_PATH_LEN] = len(self.prefix)
        row[native.S_SEP] = ord(enc.separator)
        row[native.S_SWAP] = int(not codec.stored_dtype.isnative and codec.stored_dtype.itemsize > 1)
        row[native.S_STRIDES:] = codec.element_strides
        self.row = array("q", row).tobytes()  # the sources table's row (S_PATH_START set per batch)
        self.nbytes = codec.nbytes
        self.stored = codec.max_stored_nbytes
        # what submit asks of every array of a batch, as one packed row of I_* columns: one join per batch
        info = [0] * native.N_INFO_COLS
        info[native.I_FILLS], info[native.I_READS], info[native.I_MEMORY] = self.fills, self.reads, self.memory
        info[native.I_CODEC] = self.codec if self.reads or self.memory else native.CODEC_FILL
        info[native.I_NBYTES], info[native.I_STORED] = self.nbytes, self.stored
        self.info_row = array("q", info).tobytes()
        self.engine_only = self.reads and self.fills  # the engine reads and fills every chunk of it
        # its number in the decoder's table of disk-cache entries (entry_table.py; 0: none kept, as for a local
        # array, or a grid of files too large to number), and the strides that number its files (C order)
        grid = grid_shape(meta.shape, meta.chunk_shape)  # its files: chunks, or shards
        # math.prod of Python ints: exact at any size, as numpy's object product was, at a tenth of its cost
        # (an array new to the process is described under the GIL, in the batch that first reads it)
        numbered = math.prod(grid) < 1 << 62  # every file's number an int64
        self.file_grid = list(grid) if numbered else [0] * len(grid)
        self.file_strides = [math.prod(grid[i + 1:]) if numbered else 0 for i in range(len(grid))]
        self.uid = next(_UIDS) if self.memory and numbered else 0
        # what NativeDecoder._from_disk asks of it every batch, packed once per array (a batch of samples from
        # many arrays makes a new _SourceSet per batch, which joins these rows rather than asking each array
        # again): whether its chunks may be read from disk-cache entries (its store has a disk cache, and an
        # entry, read whole into a thread's scratch, fits the engine's budget), its number in the table of
        # entries (0: none), then its grid of files and their strides (see _entry_keys)
        room = getattr(reader.kv, "entry_files", None) is not None and \
            self.nbytes + _ALIGN + self.stored + ENTRY_ROOM <= budget
        self.disk_row = array("q", [int(room), self.uid if room else 0, *self.file_grid, *self.file_strides]).tobytes()


_UIDS = itertools.count(1)  # the numbers of _Source in tables of entries (never 0: a key of no array)
#: The columns of ``_Source.disk_row``: whether its chunks may be read from disk-cache entries, its number in
#: the table of entries, then its grid of files' shape (DISK_GRID on, one an axis) and their strides.
DISK_ROOM, DISK_UID, DISK_GRID = native.DISK_ROOM, native.DISK_UID, native.DISK_GRID  # (csrc: entry_hits reads it)


#: Most :class:`_Source` of local arrays kept for the process (see :func:`shared_source`); past it they are
#: forgotten together, as the per-pipeline caches of them are.
SHARED_SOURCES = 4096
_shared_sources: dict[tuple, tuple[object, _Source]] = {}


def shared_source(reader, dtype: torch.dtype, kind: int | None, budget: int) -> _Source:
    """The :class:`_Source` of a local array, shared by the process's pipelines.

    Every pipeline opens its arrays afresh, and with many small arrays (a batch of samples from arrays new to
    the pipeline) describing each to the engine cost 25-30 us of Python per array, under the GIL. A local
    array's description depends only on its parsed metadata, its folder, the batch dtype and kind and the
    engine's budget, and :mod:`stoker.reader.metacache` hands every reader of an unchanged document the same
    :class:`~stoker.zarr.metadata.ArrayMetadata`: keyed by that object, a rewritten array (parsed anew) is a
    miss. An entry holds its metadata, so the id in its key is not reused while it is kept.

    >>> a = shared_source(open_array("/data/a.zarr"), torch.float32, native.KIND_F32, 1 << 30)
    >>> a is shared_source(open_array("/data/a.zarr"), torch.float32, native.KIND_F32, 1 << 30)
    True
    """
    if not reader.kv.is_local:  # its store is one pipeline's: NativeDecoder keeps its _Source per pipeline
        raise ValueError(f"{reader.uri}: shared_source describes local arrays only")
    meta = reader.metadata
    return _kept(_shared_sources, (id(meta), reader.file_path(""), dtype, kind, budget), meta, _Source, reader,
                 dtype, kind, budget)


def _kept(table: dict, key: tuple, holder: object, make: Callable[..., _Source], *args: Any) -> _Source:
    """``table``'s _Source for ``key`` (whose first part is ``id(holder)``: an entry holds its holder, so the id
    is not reused while it is kept), ``make(*args)`` and kept on a miss (its arguments passed, not a closure
    made per call: every batch asks for each of its arrays'); past :data:`SHARED_SOURCES` entries the table
    is emptied (arrays come and go: a long-running pipeline meets new ones)."""
    held = table.get(key)
    if held is None or held[0] is not holder:
        held = remember(table, key, (holder, make(*args)), SHARED_SOURCES)
    return held[1]


class _SourceSet:
    """The arrays of a batch (``plan.sources``, in order) as the engine takes them: their :class:`_Source`,
    their ``info`` rows (I_* columns), the sources table and path blob of ``Engine.submit``, and whether the
    engine makes every chunk of them (files it reads, no store, every element kind it fills)."""

    __slots__ = ("readers", "sources", "info", "table", "blob", "all_engine", "all_fetched", "disk",
                 "disk_all", "disk_store", "disk_stores")

    def __init__(self, readers: list, sources: list[_Source]) -> None:
        # rows packed by each _Source, joined here: a batch of arrays new to the pipeline (many small arrays,
        # each sample from another) builds a set per batch, so this runs under the GIL every batch
        n = len(sources)
        self.readers = list(readers)
        self.sources = sources
        self.info = np.frombuffer(b"".join([s.info_row for s in sources]), np.int64).reshape(n, native.N_INFO_COLS)
        self.all_engine = bool(n) and all([s.engine_only for s in sources])
        # every array's stored chunks fetched through its store, then decoded by the engine (arrays in object
        # stores: a second epoch's batches read from the disk cache), none read by the Python path
        self.all_fetched = bool(n) and all([s.memory for s in sources])
        width = len(sources[0].row) // 8 if n else native.S_STRIDES  # every array of a batch has its rank
        table = array("q")
        table.frombytes(b"".join([s.row for s in sources]))
        start = 0
        for at, s in zip(range(native.S_PATH_START, len(table), width), sources):  # each path's place in the blob
            table[at] = start
            start += len(s.prefix)
        self.table = table
        self.blob = b"".join([s.prefix for s in sources])
        # per array, its _Source.disk_row (DISK_* columns): its chunks may be read from disk entries
        # (_from_disk), its number in the table of entries (0: none), its grid of files' shape and their strides
        self.disk: np.ndarray | None = None
        self.disk_all: bool | None = None  # whether every array's chunks may be read from entries (DISK_ROOM)
        self.disk_store: np.ndarray | None = None  # per array: the number of its store in disk_stores
        self.disk_stores: list = []  # the arrays' stores, each once, in order of first use

    def __getitem__(self, i: int) -> _Source:
        return self.sources[i]

    def __len__(self) -> int:
        return len(self.sources)


def _start_engine(n_threads: int, budget_bytes: int):
    """``native.Engine(n_threads, budget_bytes)``, its failures typed: the C engine says OSError when the
    system gives it no thread at all, MemoryError when it has no memory for its tables."""
    try:
        return native.Engine(n_threads, budget_bytes)
    except MemoryError as exc:
        raise OutOfMemory(f"the system has no memory to start the compiled engine ({n_threads} threads): free "
                          "memory, or lower Config.host_buffer_bytes or n_compute_threads",
                          knob="host_buffer_bytes", nbytes=None) from exc
    except OSError as exc:  # "the system gives no thread to the engine" (csrc/module.c, engine_init)
        raise no_thread(f"the compiled engine's {n_threads} threads", "n_compute_threads", exc) from exc


class SharedEngine:
    """One compiled engine for several :class:`NativeDecoder` (a pipeline's lanes: one per field of its samples),
    so a chunk that jobs of two fields need while both are in flight is read and decoded once (the engine's
    chunks shared by live jobs, csrc/pool.c). ``n_threads`` threads (``Config.n_compute_threads``) for all of
    them; its scratch budget is the sum of what each decoder joined with (each carved it from its own share of
    ``host_buffer_bytes``, only what the engine still lacked for its arrays: ``engine_budget``'s ``held``; a
    decoder may join with none). Started at the first job (every lane has joined by then: they are prepared before
    any submits), or by :meth:`start`; closed once, by the first decoder's shutdown, which stops every decoder
    of it first (a pipeline shuts all its lanes down together). Its threads' clocks are watched once, and its
    peak reported by its first decoder only.

    >>> shared = SharedEngine(4)
    >>> a = NativeDecoder(4, 64 << 20, python_a, stats, shared)
    >>> b = NativeDecoder(4, 32 << 20, python_b, stats, shared)
    >>> a.engine is b.engine        # one engine of 4 threads and 96 MiB of scratch
    True
    """

    def __init__(self, n_threads: int) -> None:
        self.n_threads = n_threads
        self.budget_bytes = 0
        self._engine = None
        self._closed = False
        self._decoders: list[NativeDecoder] = []
        self._watched: set[int] = set()  # ids of the StatsRecorders that watch its threads
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        # decoded chunks kept (csrc/pool.c "Reused"): each decoder's grant in bytes, the push count each decoder
        # last reported, and the engine's generation: its own count, moved on at every decoder's new push
        self._reuse: dict[int, int] = {}
        self._pushes: dict[int, int] = {}
        self._generation = 0

    def join(self, decoder: "NativeDecoder", budget_bytes: int) -> None:
        """Have ``decoder`` submit here, adding ``budget_bytes`` of scratch (unless already started)."""
        with self._lock:
            if self._engine is None:
                self.budget_bytes += budget_bytes
            self._decoders.append(decoder)

    def watch(self, stats: StatsRecorder) -> None:
        """Have ``stats`` report its threads (:attr:`~stoker.Stats.workers`), once however many decoders ask."""
        with self._lock:
            if id(stats) in self._watched:
                return
            self._watched.add(id(stats))
        stats.watch_workers(self.worker_clocks)

    def leave(self, decoder: "NativeDecoder") -> None:
        """Forget ``decoder`` (its finisher did not start), and its budget unless the engine has started."""
        with self._lock:
            if decoder in self._decoders:
                self._decoders.remove(decoder)
                if self._engine is None:
                    self.budget_bytes -= decoder.budget_bytes
            self._pushes.pop(id(decoder), None)
            if self._reuse.pop(id(decoder), None) is not None and self._engine is not None and not self._closed:
                self._engine.reuse(sum(self._reuse.values()), self._generation)  # its grant goes with it

    def start(self):
        """The engine, started now if it is not (ShutdownError once closed)."""
        with self._lock:
            if self._closed:
                raise pipeline_closed()
            if self._engine is None:
                self._engine = _start_engine(self.n_threads, self.budget_bytes)
                if self._reuse:
                    self._engine.reuse(sum(self._reuse.values()), self._generation)
            return self._engine

    def reuse(self, decoder: "NativeDecoder", max_bytes: int, generation: int) -> None:
        """Have the engine keep up to ``max_bytes`` of decoded chunks for ``decoder`` (on top of its other
        decoders' grants; 0 takes its grant back), ``generation`` being its count of pushes (csrc/pool.c
        "Reused": a batch placed from a chunk an earlier batch decoded; a new push of any decoder moves the engine
        to a new generation, whose batches read the files again)."""
        with self._lock:
            if max_bytes > 0:
                self._reuse[id(decoder)] = int(max_bytes)
            else:
                self._reuse.pop(id(decoder), None)
            # decoders count their pushes apart, so their numbers can meet (a lane's push 2 after another lane kept
            # chunks at its own 2, before a rewrite): the engine's generation is moved on at any decoder's new push
            if self._pushes.get(id(decoder)) != generation:
                self._pushes[id(decoder)] = int(generation)
                self._generation += 1
            if self._engine is not None and not self._closed:
                self._engine.reuse(sum(self._reuse.values()), self._generation)  # lock rank: the engine's is C's

    def reuse_info(self) -> dict:
        """The engine's kept chunks: ``Engine.reuse_info()`` (bytes held and at most, hits, kept, evicted), or
        zeros before it starts."""
        engine = self._engine
        if engine is None:
            return {"max_bytes": sum(self._reuse.values()), "held": 0, "peak": 0, "entries": 0, "hits": 0,
                    "inserted": 0, "evicted": 0, "generation": self._generation}
        return engine.reuse_info()

    @property
    def engine(self):
        engine = self._engine  # once closed, its submit says so (RuntimeError), as a decoder's own engine did
        return engine if engine is not None else self.start()

    @engine.setter
    def engine(self, engine) -> None:
        with self._lock:
            self._engine = engine

    def worker_clocks(self) -> list[tuple]:
        """Each engine thread's clocks, as :class:`~stoker.engine.stats.StatsRecorder.watch_workers` takes
        them: its times in seconds (``WORKER_TIMES`` order), wall seconds, chunks, and the OS's run times
        (none before it starts)."""
        if self._engine is None:
            return []
        rows = np.frombuffer(self._engine.worker_clocks(), np.int64).reshape(-1, native.N_WORKER_COLS)
        out = []
        for r in rows.tolist():
            ran = run_times(r[native.W_TID]) or (None, None)
            out.append((*(r[c] * 1e-9 for c in _WORKER_COLUMNS), r[native.W_WALL] * 1e-9, r[native.W_CHUNKS], *ran))
        return out

    def peak_bytes(self, decoder: "NativeDecoder") -> int:
        """The engine's peak scratch, and the most its kept chunks held (:meth:`reuse`), for its first decoder,
        0 for the others (a pipeline sums its lanes')."""
        if self._engine is None or not self._decoders or self._decoders[0] is not decoder:
            return 0
        return int(self._engine.info()["peak"]) + int(self._engine.reuse_info()["peak"])

    def close(self) -> None:
        """Stop every decoder of it, then cancel every job and stop the threads (a quarter of a second at most:
        see :meth:`NativeDecoder.shutdown`); once this returns the engine writes into no batch. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            decoders, engine = list(self._decoders), self._engine
        for decoder in decoders:  # none submits again (each checks its flag), nor finishes a job as placed
            decoder.stop()
        if engine is not None:
            engine.close(0.25)


#: A disk-cache entry's bytes before its payload, at most (header and ident: csrc/entries.c), in a thread's scratch.
ENTRY_ROOM = native.ENTRY_HEADER_BYTES + native.ENTRY_IDENT_CAP


class _FromDisk:
    """An engine job's chunks read from disk-cache entries: the stores they were read through (``stores``:
    their counters, and where a chunk is fetched from should its entry fail), chunk k's in
    ``stores[owner[k]]``, the batch kind and the arrays (to fetch again)."""

    __slots__ = ("stores", "owner", "kind", "sources")

    def __init__(self, stores: list, owner: np.ndarray, kind: int, sources: "_SourceSet") -> None:
        self.stores, self.owner, self.kind, self.sources = stores, owner, kind, sources


def _keys_of(source: "_Source", coords: np.ndarray) -> list[str]:
    """The store keys of one array's files at grid ``coords`` (a row each): its key prefix, then the coordinates
    joined by its separator. A format string per array, one call per file (numpy's string ops took a step per
    axis, each dearer than the whole of this for a batch's few dozen files)."""
    form = _key_form(source, coords.shape[1])
    return [form.format(*row) for row in coords.tolist()]


def _entry_keys(plan: TablePlan, ids: np.ndarray, sources: "_SourceSet", every: bool = False) -> np.ndarray:
    """The keys of the chunks ``ids`` of ``plan`` in a table of entries (:mod:`.entry_table`), ``(n, 4)``: its array's
    number (0: one whose entries are not kept), its file's number in the array's grid of files, and the chunk's
    offset and length in it (-1, -1: the whole file). A few numpy steps, whatever the number of chunks; fewer
    with ``every`` (``ids`` are every chunk of the plan, in order: a batch all fetched, a second epoch's from the
    disk cache), which needs no gather by ``ids`` (each step costs the coordinator microseconds in a busy
    pipeline)."""
    files = plan.files[plan.chunk_file if every else plan.chunk_file[ids]]
    keys = np.empty((len(ids), 4), np.int64)
    coords = files[:, native.F_COORDS:]
    rank = coords.shape[1]
    disk = sources.disk[files[:, native.F_SOURCE]]  # each chunk's array's row, in one gather
    # a file's number is its own only inside the grid: one outside (never planned so) gets no key (array 0); as
    # unsigned numbers, a coordinate below 0 is past every grid's end, so one comparison says both
    inside = (coords.view(np.uint64) < disk[:, DISK_GRID:DISK_GRID + rank].view(np.uint64)).all(axis=1)
    keys[:, 0] = np.where(inside, disk[:, DISK_UID], 0)
    keys[:, 1] = (coords * disk[:, DISK_GRID + rank:]).sum(axis=1)
    keys[:, 2] = plan.chunk_offset if every else plan.chunk_offset[ids]
    keys[:, 3] = plan.chunk_length if every else plan.chunk_length[ids]
    return keys


def _key_form(source: "_Source", rank: int) -> str:
    """The format string of the keys of ``source``'s files of ``rank`` grid coordinates, kept per prefix,
    separator and rank: a batch of samples from many arrays asks for one per array."""
    if rank == 0:
        raise IndexError("a file of no grid coordinates")
    what = (source.key_prefix, source.sep, rank)
    form = _KEY_FORMS.get(what)
    if form is None:
        form = remember(_KEY_FORMS, what, source.key_prefix.replace("{", "{{").replace("}", "}}") +
                        source.sep.replace("{", "{{").replace("}", "}}").join(["{}"] * rank), 4096)
    return form


_KEY_FORMS: dict[tuple, str] = {}  # (key prefix, separator, rank) -> the format string of its files' keys


#: the engine's clock columns (csrc/stoker_native.h) in :data:`~stoker.engine.stats.WORKER_TIMES` order
_WORKER_COLUMNS = (native.W_READ, native.W_DECODE, native.W_PLACE, native.W_FILL, native.W_LOCK, native.W_IDLE,
                   native.W_BUDGET, native.W_OTHER)


class NativeDecoder:
    """Whole batches on the engine's threads; what it cannot do goes to the Python path."""

    def __init__(self, n_threads: int, budget_bytes: int, python: PythonDecoder, stats: StatsRecorder,
                 shared: "SharedEngine | None" = None) -> None:
        # the engine it submits to: its own, started now; or a pipeline's lanes' one (started at its first job)
        self._shared = SharedEngine(n_threads) if shared is None else shared
        self.budget_bytes = budget_bytes
        self._python = python
        self._stats = stats
        self._sources: dict[tuple, tuple[object, _Source]] = {}
        self._sets: dict[tuple, _SourceSet] = {}  # the arrays of recent batches, as the engine's tables say them
        self._entries = EntryTable()  # the disk-cache entries its stores gave, found a batch at a time (_from_disk)
        self._frames = FrameTables()  # blosc frames of arrays in stores: fetch only the blocks crops need
        self._frame_buffers = FrameBuffers()  # where their fetched blocks are laid out as frames
        self._cond = threading.Condition()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        # (job, engine job, its chunks, for fetched chunks (their buffers, the fetch's reservation), and for a
        # settled job the claim of the settle that handed it on (see Job.take_over))
        self._pending: list[tuple[Job, object, np.ndarray, tuple | None, int | None]] = []
        self._closing = False
        # the finisher's fault (an exception escaping its loop, a bug): every job waiting for it, or submitted
        # later, fails with it, so pop raises it rather than wait for batches nobody finishes (see _faulted)
        self._fault: InternalError | None = None
        self._current: Job | None = None  # the job the finisher is finishing (failed with its fault)
        self._thread = threading.Thread(target=serve, args=(self._finisher, self._faulted),
                                        name="stoker-engine-finisher", daemon=True)
        self._shared.join(self, budget_bytes)
        if shared is None:
            self._shared.start()
        try:
            start_thread(self._thread, "n_compute_threads")
        except BaseException:
            if shared is None:
                self._shared.close()  # its threads run: they end with the error
            else:
                self._shared.leave(self)  # the other lanes' decoders keep it
            raise
        self._shared.watch(stats)

    @property
    def scratch_bytes(self) -> int:
        """The scratch of the engine it submits to, which a chunk it hands that engine must fit: a shared
        engine's is its lanes' together (a lane may join with none of its own, ``budget_bytes`` 0, and still
        has its chunks decoded there); final once every lane has joined, before any submits."""
        return self._shared.budget_bytes

    @property
    def engine(self):
        """The ``native.Engine`` its jobs go to (a shared one is started here, at its first use)."""
        return self._shared.engine

    @engine.setter
    def engine(self, engine) -> None:  # a stand-in that wraps it (tests count or interrupt its calls)
        self._shared.engine = engine

    def worker_clocks(self) -> list[tuple]:
        """Each thread's clocks of the engine it submits to (see :meth:`SharedEngine.worker_clocks`)."""
        return self._shared.worker_clocks()

    def peak_bytes(self) -> int:
        """The engine's peak scratch, reported by the first decoder of a shared engine only (once)."""
        return self._shared.peak_bytes(self)

    def reuse(self, max_bytes: int, generation: int) -> None:
        """Keep up to ``max_bytes`` of the chunks this decoder's jobs decode, for the jobs of ``generation``
        (:meth:`SharedEngine.reuse`)."""
        self._shared.reuse(self, max_bytes, generation)

    def reuse_info(self) -> dict:
        """The engine's kept chunks (:meth:`SharedEngine.reuse_info`)."""
        return self._shared.reuse_info()

    def stop(self) -> None:
        """Take no more work (finished jobs are failed as closed; see :meth:`shutdown`)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def threads(self) -> list[threading.Thread]:
        """The finisher thread (the engine's own threads never run Python)."""
        return [self._thread]

    def shutdown(self) -> None:
        """Cancel every job (once this returns the engine writes into no batch) and stop the threads,
        waiting a quarter of a second at most for them (one stuck in a system call is left behind)."""
        self._shared.close()  # every decoder of the engine stops (this one too), then its jobs are cancelled
        if self._thread is not threading.current_thread():
            self._thread.join(0.25)  # it leaves as soon as the engine's jobs are cancelled
        with self._cond:  # what the finisher left: its batches fail, their fetches' reservations go back
            left, self._pending = self._pending, []
        for job, _, eids, fetched, claim in left:
            if fetched and not isinstance(fetched, _FromDisk):
                fetched[1].done()
            if claim is None or job.take_over(claim):  # (else its waiter settles it again, as closed)
                job.finish(len(eids), pipeline_closed())

    # -- submission ------------------------------------------------------------------------------

    def _source(self, reader, dtype: torch.dtype, kind: int | None) -> _Source:
        """The engine's description of ``reader``'s array, kept per reader: a reader's metadata never changes,
        and a batch of arrays new to the set (many small arrays) asks for each every batch."""
        return _kept(self._sources, (id(reader), dtype, kind), reader, self._new_source, reader, dtype, kind)

    def forget(self, readers: list) -> None:
        """Drop what is kept of ``readers`` (arrays their pipeline forgot: rewritten, or in a zip archive
        replaced since): their descriptions and the sets of arrays that hold them. Kept, they held each
        reader and through it its store: a replaced archive's ZipStore, and so its open file, for as long as
        the pipeline lived (two descriptors of deleted archives more every epoch). A job in flight keeps the
        set it was given."""
        gone = {id(r) for r in readers}
        if not gone:
            return
        for key, held in list(self._sources.items()):  # (a copy: the coordinator's thread may add meanwhile)
            if id(held[0]) in gone:
                self._sources.pop(key, None)
        for key, kept in list(self._sets.items()):
            if any(id(r) in gone for r in kept.readers):
                self._sets.pop(key, None)

    def _new_source(self, reader, dtype: torch.dtype, kind: int | None) -> _Source:
        # a local array: described once per process; an array in a store: the store is this pipeline's, and so
        # is its _Source
        if reader.kv.is_local:
            return shared_source(reader, dtype, kind, self.scratch_bytes)
        return _Source(reader, dtype, kind, self.scratch_bytes)

    def _source_set(self, readers: list, dtype: torch.dtype, kind: int | None,
                    half_next: bool = False) -> "_SourceSet":
        """The engine's view of a batch's arrays, kept while the same arrays come again (a training run over
        one volume plans every batch from the same array): the per-array rows, their table and path blob.
        ``half_next`` (:attr:`~.executor.Job.half_next`): float64 arrays are left to the Python path, whose cast
        places their values as :func:`~stoker.engine.cast.half_exact` says (the engine rounds them to nearest)."""
        key = (tuple(map(id, readers)), dtype, kind, half_next)  # a kept set holds its readers: their ids stay
        held = self._sets.get(key)
        if held is None:  # many arrays (batches of random ones) rarely repeat a set: a few kept
            kinds = [None if _float64(r) and rounds_once(r, half_next) else kind for r in readers]
            held = remember(self._sets, key, _SourceSet(readers, [self._source(r, dtype, k)
                                                                  for r, k in zip(readers, kinds)]), 256)
        return held

    def submit(self, job: Job) -> None:
        """Start ``job`` (a TablePlan into ``job.out``): the engine's chunks in one call, the rest on the
        Python path."""
        fault = self._fault or self._python.fault.error  # the finisher gone, or a pool's task failed past its
        if fault is not None:  # handling (a bug): no batch could be trusted
            job.abandon(fault)
            return
        plan: TablePlan = job.plan
        out = job.out
        kind = batch_kind(out)
        sources = self._source_set(plan.sources, out.dtype, kind, job.half_next)
        if sources.all_engine:  # every array's chunks, stored or not, are the engine's: nothing to sort
            eids = None
        elif sources.all_fetched and plan.n_chunks and (plan.chunk_file >= 0).all():
            # every chunk stored in a store: all fetched (or read from disk-cache entries), none to sort either
            # (an array of which the engine fetches chunks also has it fill them: no chunk is the Python path's)
            self._fetch(job, np.arange(plan.n_chunks), kind, sources)
            return
        else:
            mine = sources.info[plan.chunk_source]
            stored = plan.chunk_file >= 0
            fetched = stored & (mine[:, native.I_MEMORY] != 0)  # fetched from a store, then decoded by the engine
            engine = np.where(stored, mine[:, native.I_READS], mine[:, native.I_FILLS]) != 0
            rest = np.flatnonzero(~engine & ~fetched)
            if rest.size:  # fills on their own, a read per chunk file, a shard's inner chunks coalesced
                self._python.submit_chunks(job, rest)
            if fetched.any():
                self._fetch(job, np.flatnonzero(fetched), kind, sources)
            eids = np.flatnonzero(engine)
            if not eids.size:
                return
        if eids is None and not plan.n_chunks:
            return
        try:
            # the call copies the tables and wakes the engine's threads with the GIL released
            bjob = gil.released(self.engine.submit, *self._tables(plan, out, kind, sources, eids))
        except BaseException as exc:  # noqa: BLE001 - the engine refused the tables (a bug): the batch fails
            job.finish(plan.n_chunks if eids is None else len(eids), exc)
            return
        job.on_cancel(bjob.cancel)
        if eids is None and not job.has_hook:  # the usual batch: settled by the thread that waits for it
            job.settled_by(bjob, self._settle)
            return
        self._to_finisher(job, bjob, eids)

    def _to_finisher(self, job: Job, bjob, eids: np.ndarray | None, claim: int | None = None,
                     disk: "_FromDisk | None" = None) -> None:
        """Have the finisher thread finish ``job`` once the engine's ``bjob`` (the chunks ``eids`` of its plan;
        None: every chunk; ``disk``: read from disk-cache entries) is done; ``claim``: the settle's that hands it
        on (see Job.take_over)."""
        with self._cond:
            fault = self._fault
            if fault is None:
                self._pending.append((job, bjob, np.arange(job.plan.n_chunks) if eids is None else eids, disk, claim))
                self._cond.notify_all()
                return
        job.abandon(fault)  # the finisher is gone (any state: a stale hand-off's waiter then finds it failed)

    def _tables(self, plan: TablePlan, out: torch.Tensor, kind: int, sources: "_SourceSet",
                eids: np.ndarray | None, fetched: bool = False):
        """The engine's arguments for the chunks ``eids`` of ``plan`` (None: all of them) into ``out`` (see
        Engine.submit); with ``fetched``, chunk k's stored bytes are the whole of buffer k (a fetch's values,
        then its parts)."""
        # each table in one compiled call (csrc/tables.c): numpy took a dozen calls per batch for the same
        chunks = native.chunk_rows(sources.info, plan.chunk_source, plan.chunk_file, plan.chunk_offset,
                                   plan.chunk_length, plan.byte_start, plan.byte_stop, plan.first_copy, plan.n_copies,
                                   eids, fetched)
        row_stride, *strides = out.stride()
        dst_strides = array("q", strides)
        copies = native.copy_rows(plan.copy_src_offset, plan.copy_row, plan.copy_box_start, plan.copy_extent,
                                  row_stride, dst_strides)
        nbytes = out.nbytes
        # holds the tensor's memory for the job's lifetime (numpy has no bfloat16: that batch as bytes, flat
        # first: a dtype view needs a last stride of 1, which a contiguous tensor need not have on an axis of 1)
        dst = out.numpy() if out.dtype != torch.bfloat16 else out.view(-1).view(torch.uint8).numpy()
        return (chunks, copies, sources.table, plan.files, sources.blob, dst, kind, nbytes >= STREAM_MIN_BYTES,
                dst_strides)

    # -- chunks of arrays in stores: fetched, then decoded by the engine ---------------------------------

    def _fetch(self, job: Job, ids: np.ndarray, kind: int, sources: "_SourceSet", disk: bool = True) -> None:
        """Fetch the stored chunks ``ids`` (of arrays in stores) through the Python path's fetches: per store,
        in groups of at most a quarter of its budget (a group at least one chunk), in chunk order; over a
        network, whole values in groups of at most FETCH_MAX_BYTES, before the ranges. Each finished fetch
        goes to the engine in one call (:meth:`_fetched`). A step per store and per group. With ``disk``,
        those a disk cache holds at a known generation are first handed to the engine to read from there
        (:meth:`_from_disk`)."""
        if disk:
            ids = self._from_disk(job, ids, kind, sources)
            if not len(ids):
                return
        plan = job.plan
        quarter = max(1, self._python.budget.capacity // 4)
        src = plan.chunk_source[ids]
        stored = np.array([s.stored for s in sources], np.int64)
        # before the fetch, a whole value may take the most its codec stores; a range is its length
        cost = np.where(plan.chunk_offset[ids] < 0, stored[src], plan.chunk_length[ids])
        kvs: dict[int, tuple[int, object]] = {}  # a number per store, in order of first use
        store_of = np.array([kvs.setdefault(id(s.kv), (len(kvs), s.kv))[0] for s in sources], np.int64)[src]
        then = functools.partial(self._fetched, kind=kind, sources=sources)
        whole = plan.chunk_offset[ids] < 0
        for k, kv in kvs.values():
            mine = store_of == k
            fetch_of = functools.partial(self._fetch_of, plan, kv, sources=sources, stored=stored)
            if not kv.starts_reads:  # a zip archive: its reads wait for nobody
                groups = [(mine, quarter)]
            else:
                # over a network the whole values go in a few fetches, decoded as each comes in; a shard's
                # ranges stay together, so the store merges them into few requests
                groups = [(mine & whole, min(quarter, FETCH_MAX_BYTES)), (mine & ~whole, quarter)]
            for chosen, limit in groups:
                group_ids, group_cost = ids[chosen], np.cumsum(cost[chosen])
                start = 0
                while start < len(group_ids):
                    base = int(group_cost[start - 1]) if start else 0
                    stop = max(start + 1, int(np.searchsorted(group_cost, base + limit, "right")))
                    for fetch in fetches_within(group_ids[start:stop], fetch_of, limit):
                        self._python.fetch(job, fetch, then)
                    start = stop

    # -- chunks a disk cache holds: read by the engine from its entry files ------------------------------------

    def _from_disk(self, job: Job, ids: np.ndarray, kind: int, sources: "_SourceSet") -> np.ndarray:
        """Of the stored chunks ``ids`` (of arrays in stores), hand those whose store's disk cache holds them at a
        generation known now to the engine in one call, which reads each entry as a local file, checks it
        (csrc/entries.c) and decodes it, with no Python per chunk; returns the rest, to fetch. A chunk whose
        entry turns out missing or unsound is fetched then (:meth:`_finish_from_disk`).

        Where each entry is, in order: the decoder's table of entries (:mod:`.entry_table`: what its stores gave
        before and what its fetches made, found for the whole batch in a few numpy steps, at generations
        still known and entries written), what the batch's prefetch found (``plan.disk_entries``), then the
        stores (``entry_rows``: a step per chunk, whose answers the table keeps). A second epoch in the
        pipeline that read the first asks its stores about no chunk."""
        plan = job.plan
        disk, store_of, stores = sources.disk, sources.disk_store, sources.disk_stores
        if disk is None:  # once per set of arrays (kept while they come again): each array's row, packed once
            rank = plan.files.shape[1] - native.F_COORDS
            disk = sources.disk = np.frombuffer(b"".join([s.disk_row for s in sources]), np.int64).reshape(
                len(sources), DISK_GRID + 2 * rank)
            # each array's store, numbered (many arrays of a batch share one): asked, and counted, per store
            kvs = [s.kv for s in sources]
            first = kvs[0]
            if all([kv is first for kv in kvs]):  # (the usual batch: its arrays in one bucket)
                store_of, stores = np.zeros(len(kvs), np.intp), [first]
            else:
                numbers: dict[int, int] = {}
                store_of = np.array([numbers.setdefault(id(kv), len(numbers)) for kv in kvs], np.intp)
                stores = list({id(kv): kv for kv in kvs}.values())
            sources.disk_store, sources.disk_stores = store_of, stores
        if sources.disk_all is None:  # (once per set) every array's chunks may be read from entries
            sources.disk_all = bool(disk[:, DISK_ROOM].all())
        if sources.disk_all:  # (the usual batch: a step fewer of each kind below, every batch)
            asked = ids
        else:
            mine = disk[plan.chunk_source[ids], DISK_ROOM] != 0
            if not mine.any():
                return ids
            asked = ids[mine]
        table = self._entries
        # each store's stamp number and settled writes, once a batch and before any look-up: a change after
        # them is a new number (what was found under the old one stale), a write after them found next batch
        # (0, the table's "no stamp", for a store that keeps no counts: a batch's local arrays, never asked here)
        stamps = [table.stamp_of(kv) or 0 for kv in stores]
        settled = [getattr(kv, "settled", 0) for kv in stores]
        now = time.monotonic()
        # (ids, as _fetch takes them, are distinct chunks in chunk order: as many as the plan's, they are all)
        every = len(asked) == plan.n_chunks
        if sources.disk_all:
            # a second epoch's batch, every chunk in the table: its keys, look-up, checks and the engine's rows in
            # one compiled call (the steps below, a few microseconds each on a busy coordinator, are for misses)
            got = table.hits(plan.files, plan.chunk_file, plan.chunk_offset, plan.chunk_length, None if every else asked,
                             disk, store_of, array("q", stamps), array("q", settled), now)
            if got is not None:
                return self._submit_from_disk(job, ids, asked, got[0], got[1], kind, sources)
        keys = _entry_keys(plan, asked, sources, every=every)
        if len(stores) == 1:  # (the usual batch: its arrays in one bucket) each chunk's store's, as one number
            slots, blobs, lens = table.lookup(keys, stamps[0], settled[0], now)
        else:
            owner = store_of[plan.chunk_source[asked]]
            slots, blobs, lens = table.lookup(keys, np.array(stamps, np.int64)[owner],
                                              np.array(settled, np.int64)[owner], now)
        # each found chunk's entry (its path and ident joined) and their lengths (a row each), as the table held
        # them when it checked them (one hold of its lock)
        hit = slots >= 0
        if hit.all():  # (a second epoch's batch: every chunk in the table) no step to pick the hits
            eids, rest = asked, asked[:0]
        else:
            blobs, lens = blobs[hit], lens[hit]
            eids = asked[hit]
            rest = asked if not len(eids) else asked[~hit]
        found: list = []  # (chunk, (path, ident)) of those not in the table
        known = plan.disk_entries
        if known and len(rest):  # what the batch's prefetch found on disk when it was planned ahead
            left: list[int] = []
            for cid in rest.tolist():
                entry = known.get(cid)
                if entry is None:
                    left.append(cid)
                else:
                    found.append((cid, entry))
            rest = np.array(left, np.int64)
        if len(rest):  # asked now (an entry written, or a generation learnt, since): a step per chunk
            by_store = store_of[plan.chunk_source[rest]]
            for k in (np.unique(by_store).tolist() if len(stores) > 1 else [0]):
                them = rest[by_store == k] if len(stores) > 1 else rest
                found += self._asked(plan, them, stores[k], stamps[k], settled[k], sources, now)
        if found:
            cids, entries = zip(*found)
            more = np.empty(len(entries), object)
            more[:] = [p + i for p, i in entries]
            blobs = np.concatenate([blobs, more])
            lens = np.concatenate([lens, np.array([(len(p), len(i)) for p, i in entries], np.int64)])
            eids = np.concatenate([eids, np.array(cids, np.int64)])
        if not len(eids):
            return ids
        # an ident or a path (a deep cache folder) the engine's tables cannot hold: fetched instead (the longest
        # of each looked at first: one step where all fit, as they do but in a folder hundreds of bytes deep)
        longest = lens.max(axis=0).tolist()
        order = None
        if longest[0] >= native.PATH_CAP or longest[1] > native.ENTRY_IDENT_CAP:
            fits = (lens[:, 0] < native.PATH_CAP) & (lens[:, 1] <= native.ENTRY_IDENT_CAP)
            order = np.flatnonzero(fits)
        # chunk order, as every engine call takes them (those of the table alone are: a subset of ids, in order)
        if found and len(eids) > 1 and (eids[1:] < eids[:-1]).any():
            by_chunk = np.argsort(eids, kind="stable")
            order = by_chunk if order is None else by_chunk[fits[by_chunk]]
        if order is not None:
            if not len(order):
                return ids
            eids, lens, blobs = eids[order], lens[order], blobs[order]
        # each entry's path then ident, end to end in the blob: their starts from the running sum of their lengths
        flat = lens.reshape(-1)
        starts = np.cumsum(flat) - flat
        rows = np.empty((len(eids), native.N_ENTRY_COLS), np.int64)
        rows[:, native.E_PATH_START] = starts[0::2]
        rows[:, native.E_PATH_LEN] = lens[:, 0]
        rows[:, native.E_IDENT_START] = starts[1::2]
        rows[:, native.E_IDENT_LEN] = lens[:, 1]
        return self._submit_from_disk(job, ids, eids, rows, b"".join(blobs), kind, sources)

    def _submit_from_disk(self, job: Job, ids: np.ndarray, eids: np.ndarray, rows: Any, blob: bytes, kind: int,
                          sources: "_SourceSet") -> np.ndarray:
        """Hand the chunks ``eids`` (of ``ids``, in chunk order) to the engine to read from their disk-cache
        entries (``rows``: the engine's entries rows, into ``blob``); returns the rest of ``ids``, to fetch."""
        plan = job.plan
        store_of, stores = sources.disk_store, sources.disk_stores
        owner = store_of[plan.chunk_source[eids]] if len(stores) > 1 else np.zeros(len(eids), np.intp)
        # the rest, to fetch (none where every chunk was taken: eids are distinct chunks of ids)
        rest = ids[:0] if len(eids) == len(ids) else ids[~np.isin(ids, eids)]
        try:
            if self._closing:
                raise pipeline_closed()
            bjob = gil.released(self.engine.submit, *self._tables(plan, job.out, kind, sources, eids, fetched=True),
                                [None] * len(eids), rows, blob)
        except BaseException as exc:  # noqa: BLE001 - closed meanwhile, or the engine refused the tables (a bug)
            job.finish(len(eids), pipeline_closed() if self._closing else exc)
            return rest
        job.on_cancel(bjob.cancel)
        disk = _FromDisk(stores, owner, kind, sources)
        if len(eids) == plan.n_chunks and not job.has_hook:
            # the whole batch from disk (a second epoch's): settled by the thread that waits for it, as a batch
            # of local files is, rather than by waking the finisher for it (see _settle)
            job.settled_by(bjob, functools.partial(self._settle, disk=disk))
            return rest
        with self._cond:
            fault = self._fault
            if not self._closing and fault is None:
                self._pending.append((job, bjob, eids, disk, None))
                self._cond.notify_all()
                return rest
        bjob.cancel()  # closed (or the finisher gone) between the submission and here: nobody else would end it
        job.finish(len(eids), fault or pipeline_closed())
        return rest

    def _asked(self, plan: TablePlan, them: np.ndarray, kv, stamp: int, settled: int, sources: "_SourceSet",
               now: float) -> list:
        """The entries of the chunks ``them`` (of arrays in the store ``kv``) asked of the store, as ``(chunk,
        (path, ident))``: those it gives at a generation known now, written (their ticket at most ``settled``).
        What it gives is kept in the table (``stamp``: the store's number, read before asking), queued ones too,
        so that a later batch finds them there once written. A step per chunk."""
        is_whole = plan.chunk_offset[them] < 0
        whole, ranged = them[is_whole], them[~is_whole]
        keys = self._keys(plan, plan.chunk_file[whole], sources)
        requests = list(map(ByteRange, self._keys(plan, plan.chunk_file[ranged], sources),
                            plan.chunk_offset[ranged].tolist(), plan.chunk_length[ranged].tolist())) \
            if len(ranged) else []
        cids = whole.tolist() + ranged.tolist()
        rows_of = getattr(kv, "entry_rows", None)
        if rows_of is None or not stamp:  # a store that gives no rows (no counts to trust them by): as it says
            return [(cid, entry) for cid, entry in zip(cids, kv.entry_files(keys, requests)) if entry is not None]
        rows = rows_of(keys, requests)
        self._keep_rows(plan, np.array(cids, np.int64), rows, stamp, sources, now)
        return [(cid, (row[0], row[1])) for cid, row in zip(cids, rows) if row is not None and row[3] <= settled]

    def _keep_rows(self, plan: TablePlan, cids: np.ndarray, rows: list, stamp: int, sources: "_SourceSet",
                   now: float) -> None:
        """Keep in the table the entries ``rows`` (a store's ``entry_rows``: ``(path, ident, until, ticket)`` or
        None) of the chunks ``cids`` of ``plan``, given under the store's ``stamp``."""
        got = [k for k, row in enumerate(rows) if row is not None]
        if not got:
            return
        kept = [rows[k] for k in got]
        self._entries.keep(_entry_keys(plan, cids[got], sources), np.full(len(got), stamp, np.int64),
                           np.array([row[2] for row in kept], np.float64), np.array([row[3] for row in kept], np.int64),
                           [row[0] for row in kept], [row[1] for row in kept], now)

    def _note_made(self, plan: TablePlan, fetch: Fetch, sources: "_SourceSet") -> None:
        """Keep in the table the entries that the values and inner chunks ``fetch`` brought were queued as by its
        store's disk cache (``entry_rows``; found once written): the next epoch finds them there, a batch at a
        time, rather than ask the store about each chunk. A step per chunk, in the epoch that fetched them;
        nothing for blosc spans (ranges that are not a chunk's)."""
        kv = fetch.kv
        rows_of = getattr(kv, "entries_made", None)  # not entry_rows: a prefetch buffer holds what was fetched
        if rows_of is None or sources.disk is None or not (fetch.keys or fetch.inner):
            return
        stamp = self._entries.stamp_of(kv)
        if not stamp:
            return
        cids = np.asarray(fetch.cids, np.int64)
        n_keys = len(fetch.keys)
        whole = cids[:n_keys]
        inner = [j for j in fetch.inner if j < len(fetch.requests)
                 and plan.chunk_offset[cids[n_keys + j]] == fetch.requests[j].start
                 and plan.chunk_length[cids[n_keys + j]] == fetch.requests[j].length]
        if not (plan.chunk_offset[whole] < 0).all():  # values that are not whole chunks: none kept
            return
        chosen = np.concatenate([whole, cids[[n_keys + j for j in inner]].reshape(-1)])
        rows = rows_of(fetch.keys, [fetch.requests[j] for j in inner])
        self._keep_rows(plan, chosen, rows, stamp, sources, time.monotonic())

    @staticmethod
    def _served(disk: "_FromDisk", ok: np.ndarray | None, detail: np.ndarray) -> None:
        """Count the chunks ``ok`` (None: all) of a job read from disk-cache entries as their stores' hits, with
        their payload bytes (``detail``): a step per store, none per chunk."""
        if ok is None and len(disk.stores) == 1:  # (a second epoch's batch, on the consumer's thread, in pop)
            if len(disk.owner):
                disk.stores[0].served_from_disk(len(disk.owner), int(detail.sum()))
            return
        if ok is None:
            ok = np.ones(len(disk.owner), bool)
        counts = np.bincount(disk.owner[ok], minlength=len(disk.stores)).tolist()
        sizes = np.bincount(disk.owner[ok], weights=detail[ok], minlength=len(disk.stores)).tolist()
        for kv, n, nbytes in zip(disk.stores, counts, sizes):
            if n:
                kv.served_from_disk(n, int(nbytes))

    @staticmethod
    def _missed(disk: "_FromDisk", missed: np.ndarray) -> None:
        """Tell the stores of the chunks ``missed`` (entries gone or unsound: evicted by another process sharing
        the folder, or corrupt) how many their caches lost (``entries_missed``), so that their next look-ups
        look on disk, and batches planned ahead fetch what is gone rather than hand it to the engine again."""
        if not missed.any():
            return
        for kv, n in zip(disk.stores, np.bincount(disk.owner[missed], minlength=len(disk.stores)).tolist()):
            report = getattr(kv, "entries_missed", None)
            if n and report is not None:
                report(n)

    def _finish_from_disk(self, job: Job, bjob, eids: np.ndarray, disk: "_FromDisk") -> None:
        """A finished engine job of chunks read from disk-cache entries (:meth:`_from_disk`): those placed are
        counted as the caches' hits; those whose entry was missing or unsound (ST_ENTRY), or that the engine
        could not decode from it, are fetched from their stores (the entry read, checked and replaced there:
        a corrupt one is never served); a cancelled or out-of-range one fails as any chunk does."""
        status, detail, c = bjob.results()
        self._account(c, fetched=False)
        status = np.frombuffer(status, np.int32)
        detail = np.frombuffer(detail, np.int64)
        ok = status == native.ST_OK
        self._served(disk, ok, detail)
        self._missed(disk, status == native.ST_ENTRY)
        final = (status == native.ST_CANCELLED) | (status == native.ST_RANGE)
        again = eids[~ok & ~final]
        # the placed and failed chunks first, the fetch last: it may finish every chunk it was given (the
        # batch) before it returns, and a count after that would be taken for a chunk reported twice
        self._finish_placed(job, int(ok.sum()), c, fetched=False)
        for cid, st, d in zip(eids[final].tolist(), status[final].tolist(), detail[final].tolist()):
            job.finish(1, self._outcome(job, cid, st, d, True)[0])
        if len(again):  # fetched as if never cached (a counted miss there, and a new entry written)
            self._fetch(job, again, disk.kind, disk.sources, disk=False)

    def _fetch_of(self, plan: TablePlan, kv, ids: np.ndarray, sources: "_SourceSet", stored: np.ndarray) -> Fetch:
        """One fetch of ``ids``: their whole values, then their ranges (inner chunks), then the blocks some
        crops need of blosc chunks whose frame tables are kept (:mod:`.frame_spans`), and what it holds."""
        whole = ids[plan.chunk_offset[ids] < 0]
        ranged = ids[plan.chunk_offset[ids] >= 0]
        shards, which = np.unique(plan.chunk_file[ranged], return_inverse=True)
        which = which.reshape(-1)
        paths = np.array(self._keys(plan, shards, sources) + [""], object)[:-1]  # 1-d even when empty
        offsets, lengths = plan.chunk_offset[ranged], plan.chunk_length[ranged]
        requests = list(map(ByteRange, paths[which].tolist(), offsets.tolist(), lengths.tolist()))
        keys = self._keys(plan, plan.chunk_file[whole], sources)
        # blosc spans only where an ETag tells versions apart (an object store's; see frame_spans); inner chunks'
        # generations wherever the store reports them (see PythonDecoder.check_generations)
        versions = kv.reports_versions and kv.starts_reads
        spans: dict = {}
        if versions and len(self._frames) and len(whole):
            whole, keys, span_ids = self._spans_of(plan, kv, whole, keys, sources, requests, spans)
        else:
            span_ids = whole[:0]
        held = int(stored[plan.chunk_source[whole]].sum()) + span_bytes(kv, which, offsets, lengths)
        held += sum(table.cbytes + hi - lo for lo, hi, table, _ in spans.values())  # each span's frame and blocks
        return Fetch(kv, keys, requests, np.concatenate([whole, ranged, span_ids]), held,
                     versions=versions or bool(len(ranged)),
                     spans={j: (lo, table, key) for j, (lo, _, table, key) in spans.items()} or None,
                     inner=range(len(ranged)))

    def _spans_of(self, plan: TablePlan, kv, whole: np.ndarray, keys: list[str], sources: "_SourceSet",
                  requests: list[ByteRange], spans: dict) -> tuple[np.ndarray, list[str], np.ndarray]:
        """Of the whole values ``whole`` (keys ``keys``), the blosc chunks whose frame tables are kept and
        whose crops need only some blocks become ranges of those blocks, appended to ``requests`` (their
        ``(lo, hi, table, key)`` in ``spans`` by part number); returns the values left whole, their keys and
        the chunks fetched as spans. A step per whole value of a blosc array in a store."""
        keep, span_ids = [], []
        for k, cid in enumerate(whole.tolist()):
            source = sources[int(plan.chunk_source[cid])]
            got = None
            if source.spans:
                got = self._frames.span(kv.uri, keys[k], source.nbytes, int(plan.byte_start[cid]),
                                        int(plan.byte_stop[cid]))
            if got is None:
                keep.append(k)
                continue
            lo, hi, table = got
            spans[len(requests)] = (lo, hi, table, keys[k])
            requests.append(ByteRange(keys[k], lo, hi - lo))
            span_ids.append(cid)
        return whole[keep], [keys[k] for k in keep], np.array(span_ids, np.int64)

    def _frames_from(self, fetch: Fetch, values: list, parts: list, sources: "_SourceSet",
                     plan: TablePlan, pooled: list) -> tuple[list, np.ndarray]:
        """Learn the frame tables of the blosc chunks ``fetch`` got whole, and lay out each span's blocks in a
        frame buffer (:meth:`~.frame_spans.FrameBuffers.assemble`, into buffers of the pool, listed in ``pooled``). Returns
        the parts as the engine reads them and the parts that came from another version of their object than
        their table (to fetch whole again)."""
        value_versions, part_versions = fetch.got_versions or ([None] * len(values), [None] * len(parts))
        store = fetch.kv.uri
        for k, value in enumerate(values):
            source = sources[int(plan.chunk_source[fetch.cids[k]])]
            if value is not None and source.spans:
                self._frames.learn(store, fetch.keys[k], value, source.nbytes, etag_version(value_versions[k]))
        stale = []
        if fetch.spans:
            parts = list(parts)
            for j, (lo, table, key) in fetch.spans.items():
                if isinstance(parts[j], BaseException):  # its object is now gone or shorter (the error in place)
                    self._frames.forget(store, key, table)
                    stale.append(j)
                elif not self._frames.fits(store, key, table, part_versions[j]):  # another version: forgotten
                    stale.append(j)
                else:
                    parts[j] = self._frame_buffers.assemble(table, lo, parts[j])
                    pooled.append(parts[j])
        return parts, np.array(stale, np.int64)

    def _refetch(self, job: Job, fetch: Fetch, values: list, parts: list, stale: np.ndarray, kind: int,
                 sources: "_SourceSet") -> tuple[np.ndarray, list]:
        """Fetch the chunks of the ``stale`` parts of ``fetch`` again, whole, in a fetch of their own (its
        own reservation; the engine decodes it when it comes); returns the ids and parts left to decode now."""
        first = len(values)
        gone = first + stale
        keep = np.setdiff1d(np.arange(len(fetch.cids)), gone)
        plan = job.plan
        cids = np.asarray(fetch.cids)[gone]
        cost = int(sum(sources[int(plan.chunk_source[c])].stored for c in cids.tolist()))
        again = Fetch(fetch.kv, [fetch.spans[int(j)][2] for j in stale.tolist()], [], cids, cost, versions=True)
        self._python.fetch(job, again, functools.partial(self._fetched, kind=kind, sources=sources))
        left = set(stale.tolist())
        return np.asarray(fetch.cids)[keep], [p for j, p in enumerate(parts) if j not in left]

    @staticmethod
    def _keys(plan: TablePlan, rows: np.ndarray, sources: "_SourceSet") -> list[str]:
        """The store keys of the files ``rows`` of ``plan``: each array's key prefix, then the file's grid
        coordinates joined by its separator (the paths the engine builds for files), with numpy string ops:
        a step per array and axis."""
        if not len(rows):
            return []
        table = plan.files[rows]
        sources_of = table[:, native.F_SOURCE]
        first = int(sources_of[0])
        if (sources_of == first).all():  # one array (the usual batch): its keys in one comprehension
            return _keys_of(sources[first], table[:, native.F_COORDS:])
        # many arrays (a sample from each): a form per array, then one comprehension (a mask and a gather per
        # array cost more than the keys)
        coords = table[:, native.F_COORDS:]
        of = sources_of.tolist()
        forms = {s: _key_form(sources[s], coords.shape[1]) for s in set(of)}
        return [forms[s].format(*row) for s, row in zip(of, coords.tolist())]

    def _fetched(self, job: Job, fetch: Fetch, values: list, parts: list, res, kind: int,
                 sources: "_SourceSet") -> None:
        """A finished fetch (on a compute thread): its chunks to the engine in one call, reading the fetched
        buffers, which the engine's job holds until it is done or cancelled (``res``, what the fetch reserved,
        is released once it is done)."""
        ids = fetch.cids
        pooled: list = []  # frame buffers of the pool: given back once the engine's job is done with them
        try:
            if self._closing:
                raise pipeline_closed()
            self._note_made(job.plan, fetch, sources)  # its entries, for the next epoch (see _from_disk)
            if fetch.versions:
                parts, stale = self._frames_from(fetch, values, parts, sources, job.plan, pooled)
                if len(stale):  # rewritten (or gone) since their tables were learnt: fetched whole, not decoded here
                    ids, parts = self._refetch(job, fetch, values, parts, stale, kind, sources)
                    if not len(ids):  # every chunk went to the refetch, which finishes them (maybe already):
                        # an engine job of none would count nothing after that, taken for a chunk reported twice
                        res.done()
                        self._frame_buffers.give(pooled)
                        return
            buffers = values + parts
            # in place: nothing changes them before the job is done (a writable one is else copied: Engine.submit)
            bjob = gil.released(self.engine.submit, *self._tables(job.plan, job.out, kind, sources, ids, fetched=True),
                                buffers, None, None, True)
        except BaseException as exc:  # noqa: BLE001 - closed meanwhile, or the engine refused the tables (a bug)
            res.done()
            self._frame_buffers.give(pooled)  # no engine job holds them
            error: BaseException = exc
            if self._closing:
                error = pipeline_closed()
            job.finish(len(ids), error)
            return
        job.on_cancel(bjob.cancel)
        with self._cond:
            fault = self._fault
            if not self._closing and fault is None:
                self._pending.append((job, bjob, ids, (buffers, res, pooled), None))
                self._cond.notify_all()
                return
        # closed (or the finisher gone) between the submission and here: nobody else would end it
        bjob.cancel()
        res.done()
        job.finish(len(ids), fault or pipeline_closed())

    # -- completion --------------------------------------------------------------------------------

    def _finisher(self) -> None:
        """Finish each job once the engine is done with it, in submission order (the order of pop)."""
        gil.enroll()  # its GIL time is the pipeline's (charged after each batch it finishes)
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    gil.wait(self._cond)
                if self._closing:
                    return
                job, bjob, eids, fetched, claim = self._pending[0]
            # In C, without the GIL, and with no timeout: shutdown cancels every job, which ends the wait
            # (a thread of this process waking up while it exits can abort it). A job whose worker is stuck
            # in a hung read keeps this thread waiting, as it keeps the batch from pop.
            gil.released(bjob.wait)
            with self._cond:
                if self._closing:
                    return
                self._pending.pop(0)
            if claim is not None and not job.take_over(claim):  # a stale hand-off: its waiter settles it again
                del job, bjob, eids, fetched
                continue
            self._current = job  # (failed by _faulted should this loop raise)
            all_placed = False
            # chunks read from disk-cache entries hold no fetch's buffers: nothing for the finally below to give
            # back (what _finish_from_disk raised reaches the consumer, and this thread goes on)
            disk = fetched if isinstance(fetched, _FromDisk) else None
            if disk is not None:
                fetched = None
            try:
                if disk is not None:
                    self._finish_from_disk(job, bjob, eids, disk)
                else:
                    all_placed = self._finish(job, bjob, eids, fetched and fetched[0])
            except BaseException as exc:  # noqa: BLE001 - a bug here must reach the consumer, not hang it
                job.finish(0, exc)
            finally:
                if fetched:
                    fetched[1].done()  # the engine is done with the buffers
                    if all_placed:  # else the Python path may still decode some of them
                        self._frame_buffers.give(fetched[2])
            self._stats.charge_thread()
            self._current = None
            del job, bjob, eids, fetched, disk  # hold nothing of a finished batch while idle

    def _faulted(self, fault: InternalError) -> None:
        """The finisher's loop raised (a bug, ``fault``; its thread ends): the job it was finishing, every job
        waiting for it and every later one (:meth:`submit`, :meth:`_to_finisher`) fail with ``fault``, so the
        consumer's next pop raises it at once instead of waiting for batches nobody would finish."""
        with self._cond:
            self._fault = fault
            left, self._pending = self._pending, []
            current, self._current = self._current, None
            self._cond.notify_all()
        if current is not None:
            current.abandon(fault)  # (one finished already, or failed, is left as it is)
        for job, _, _, fetched, claim in left:
            # a stale hand-off (as shutdown skips it; a settle's holds no fetch's reservation): its waiter
            # settles the job again and hands it to _to_finisher, which fails it with the fault, rather than
            # this failing it under that waiter's settle
            if claim is not None and not job.take_over(claim):
                continue
            job.abandon(fault)  # (cancels the engine's job: it reads the fetch's buffers no more)
            if fetched and not isinstance(fetched, _FromDisk):
                fetched[1].done()  # what the fetch reserved goes back

    @contextlib.contextmanager
    def _gil_charged(self):
        """What the calling thread holds of the GIL inside the block charged to this pipeline's stats: on a
        thread stoker started (enrolled), what it held since its last report less what it held before; on
        another (the consumer's), its CPU time in the block."""
        enrolled = gil.enrolled()
        before = gil.held_since_last() if enrolled else 0
        t0 = time.thread_time_ns()
        try:
            yield
        finally:
            if enrolled:
                self._stats.gil(gil.held_since_last() * 1e-9)
                gil.carry(before)
            else:
                self._stats.gil((time.thread_time_ns() - t0) * 1e-9)

    def _settle(self, job: Job, bjob, disk: "_FromDisk | None" = None) -> None:
        """Finish ``job``, every chunk of which the engine (done) was given (``disk``: read from disk-cache
        entries, then each store's hits counted), on the thread that waited for it (see Job.settled_by): the
        consumer's, whose GIL time is otherwise never the pipeline's, so what this holds is charged here, and
        only this (on a thread stoker started, what it held before, a training step or another pipeline's
        work, is left for its next report). A batch with chunks the engine did not place (or, from disk, a
        missing, short or corrupt entry: fetched again, as :meth:`_finish_from_disk` does) goes to the
        finisher thread: the Python path's reads never run inside ``pop``."""
        with self._gil_charged():
            try:
                if self._closing:  # cancelled by shutdown: nothing of it goes to the Python path now
                    job.finish(job.plan.n_chunks, pipeline_closed())
                    return
                _, detail, counts = bjob.results()
                if counts["not_placed"]:
                    # the finisher takes it over: an interrupt before that puts it back (see Job.take_over)
                    self._to_finisher(job, bjob, None, job.claim, disk)
                    return
                self._account(counts, fetched=False)
                if disk is not None:
                    self._served(disk, None, np.frombuffer(detail, np.int64))
                self._finish_placed(job, job.plan.n_chunks, counts, fetched=False)
            except Exception as exc:  # noqa: BLE001 - a bug here must reach the consumer, not hang it
                job.finish(0, exc)

    def _finish(self, job: Job, bjob, eids: np.ndarray, buffers: list | None = None) -> bool:
        """Account for a finished engine job of the chunks ``eids`` of its plan (``buffers``: those its chunks
        were read from, a fetch's) and finish them: placed, or handed to :meth:`_failed`. True when the engine
        placed every chunk (nothing of it goes to the Python path)."""
        status, detail, c = bjob.results()
        fetched = buffers is not None
        self._account(c, fetched)
        if not c["not_placed"]:  # the usual batch: no status to look at
            self._finish_placed(job, len(eids), c, fetched)
            return True
        status = np.frombuffer(status, np.int32)
        ok = status == native.ST_OK
        bad = np.flatnonzero(~ok)
        data = None if buffers is None else [buffers[k] for k in bad.tolist()]
        # the placed chunks first: the Python path may finish every other chunk (the batch) before _failed
        # returns, and a count after that, even of none, would be taken for a chunk reported twice
        self._finish_placed(job, int(ok.sum()), c, fetched)
        self._failed(job, eids[bad], status[bad], np.frombuffer(detail, np.int64)[bad], data)
        return False

    def _account(self, counts: dict, fetched: bool) -> None:
        """A finished engine job's counts into the pipeline's statistics (``fetched``: its chunks were decoded
        from a fetch's buffers, whose reads the fetch already timed)."""
        if counts["chunks_decoded"]:
            self._stats.chunk(counts["decode_ns"] * 1e-9, counts["place_ns"] * 1e-9, counts["bytes_read"],
                              counts["bytes_decoded"], read_s=None if fetched else counts["read_ns"] * 1e-9,
                              count=counts["chunks_decoded"])
        if counts["chunks_filled"]:
            self._stats.stage("assemble", counts["fill_ns"] * 1e-9)

    @staticmethod
    def _finish_placed(job: Job, n: int, counts: dict, fetched: bool) -> None:
        """Finish the ``n`` chunks of ``job`` the engine placed, with its ``counts`` (``fetched``: see
        :meth:`_account`; the fetch counted their bytes as read)."""
        # dedup hits: chunks another batch in flight decoded for this one, or one before it (kept: "Reused")
        job.finish(n, bytes_read=0 if fetched else counts["bytes_read"], bytes_decoded=counts["bytes_decoded"],
                   chunks_decoded=counts["chunks_decoded"],
                   chunk_dedup_hits=counts["chunks_shared"] + counts["chunks_reused"])

    def _failed(self, job: Job, cids: np.ndarray, statuses: np.ndarray, details: np.ndarray,
                data: list | None = None) -> None:
        """Chunks the engine did not place, in chunk order: errors, or reads for the Python path (``data``: the
        fetched bytes of each, decoded there again). The batch reports its lowest failing chunk's error: the
        Python path first reads the chunks below the first error here (in order, stopping at one that fails),
        then the rest are counted; with no error here, it reads them all in order in one task."""
        final = None
        retries: list[tuple[int, Callable, object]] = []
        for k, (cid, status, detail) in enumerate(zip(cids.tolist(), statuses.tolist(), details.tolist())):
            error, retry = self._outcome(job, cid, status, detail, data is not None)
            if retry is not None:
                retries.append((cid, retry, job.plan.file_read(cid) if data is None else (cid, data[k])))
            elif final is None:
                final = (cid, error)
        if final is None:  # one task, in chunk order: the batch reports the lowest of them that fails
            self._python.run(self._retry_in_order, job, len(retries), retries)
            return
        done = 0
        for cid, retry, arg in retries:
            if cid > final[0] or job.failed:
                break
            self._python.guard(job, 1, retry, job, arg, True)
            done += 1
        job.finish(len(cids) - done, final[1])

    def _retry_in_order(self, job: Job, n: int, retries: list) -> None:
        """The ``n`` chunks the Python path reads (or decodes) again, one after the other in chunk order; once
        one fails, the rest are only counted (``guard``)."""
        for _, retry, arg in retries:
            self._python.guard(job, 1, retry, job, arg, True)

    def _outcome(self, job: Job, cid: int, status: int, detail: int, fetched: bool = False):
        """``(error, None)`` for a chunk that failed, ``(None, retry)`` for one the Python path reads (or, for a
        ``fetched`` chunk, decodes from its fetched bytes)."""
        plan: TablePlan = job.plan
        reader = plan.sources[int(plan.chunk_source[cid])]
        codec = reader.metadata.codec
        whole = int(plan.chunk_offset[cid]) < 0
        python = self._python
        if status == native.ST_CANCELLED:
            return pipeline_closed(), None
        if status == native.ST_RANGE:  # a value its copies read does not fit the integer batch
            return range_error(reader.uri, plan.key(cid), codec.dtype, job.out.dtype), None
        if fetched and not (status in (native.ST_CODEC_ERROR, native.ST_SIZE) and whole
                            and native_codec(codec) == native.CODEC_ZSTD):
            # any other failure of a chunk in memory (no file: nothing changed or vanished meanwhile): the
            # Python path decodes the same bytes and decides, and words the error, as it always does
            return None, python.decode_bytes
        if status == native.ST_NOT_REGULAR:
            return not_regular(plan.path(cid), detail), None
        if status == native.ST_CHANGED:  # the shard is not the file its cached index was read from
            return None, python.relocate
        if status == native.ST_OS_ERROR and whole:
            path = plan.path(cid)
            return StorageError(f"cannot read {path}: {os.strerror(detail)}", path=path), None
        if status in (native.ST_TOO_BIG, native.ST_NO_MEMORY, native.ST_FRAME, native.ST_MISSING,
                      native.ST_PENDING, native.ST_ENTRY) or native_codec(codec) != native.CODEC_ZSTD or not whole:
            # (ST_ENTRY: only chunks read from disk-cache entries get it, and _finish_from_disk fetches those)
            # larger than any stored chunk of this codec (the Python path refuses it unread); blosc, lz4, zlib
            # and gzip: any chunk the engine declined or could not decode; any failure of an inner chunk of a
            # shard. The Python path reads it again and decides (and words the error) as it always does.
            return None, python.read_file
        key = plan.key(cid)
        if status == native.ST_SHORT:
            return DecodeError(f"{reader.uri}: chunk {key!r} changed while it was read", uri=reader.uri,
                               key=key), None
        if status == native.ST_CODEC_ERROR:
            return codec.decode_error(key, ValueError(native.zstd_error(detail))), None
        if status == native.ST_SIZE:  # by name: a status this code does not know is not taken for this one
            try:
                codec.check_size(detail, key)
            except DecodeError as exc:
                return exc, None
        return DecodeError(f"{reader.uri}: chunk {key!r}: unknown reader status {status}", uri=reader.uri,
                           key=key), None
