"""Reading a group's stored chunks into a staging buffer, with a fixed number of Python steps per read.

:func:`plan_reads` orders a batch's device-decoded chunks once per batch (numpy): inner chunks of local
shards first, by file and offset, then whole local chunk files, then chunks of arrays in stores, by store.
Inner chunks of one file at most :data:`MAX_GAP` apart join one read, the gap read with them (it crosses
to the device too, and is counted as read). :meth:`ReadPlan.take` cuts the next group off that order with
two ``searchsorted`` over running sums of staging bytes (whole chunk files and values at their stored
bound) and decoded bytes.

:meth:`Stager.read` then reads the group: one ``os.preadv`` per coalesced read of a local shard (the GIL
released, the file's identity checked as the index was read), one open and read per whole chunk file,
and, for chunks of arrays in stores, their disk cache's entries where it holds them at a generation known now
(read by the compiled reads, each payload checked, no ``get_many`` and no Python per chunk's bytes:
:meth:`Stager._entries`), then one :func:`~stoker.storage.store.get_many` per store for the rest (whole values
and inner chunks' ranges, which the store coalesces), copied into the staging in one ``np.concatenate``. Chunks of a shard rewritten since
its index was read, and reads the compiled side leaves to the store to word, are read again the Python way,
a group's together on the read threads (:meth:`Stager.fetch`: :func:`.fallback.fetch`, the one way a chunk
is fetched through its reader, which the chunks the CPU decodes take too; those with nothing stored now are
filled) and staged like the CPU's chunks.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...errors import BudgetExceeded, DecodeError, InternalError, ShutdownError, pipeline_closed
from ...reader.array import ChunkLocation, fetch_stored
from ...runtime import gil
from ...runtime.workers import DaemonPool
from ...storage import ByteRange, FileChanged
from ..cpu import native
from . import fallback as gpu_fallback, native_reads
from .sources import CPU, Source
from ..planning.tables import F_COORDS, F_HAS_IDENT, F_IDENT, F_SOURCE, TablePlan, file_ident

#: inner chunks of one shard file at most this far apart are read together, the gap included
MAX_GAP = 64 << 10
_RANGED, _WHOLE, _STORE = 0, 1, 2


@dataclass
class Pending:
    """A chunk staged from a buffer: decoded on the CPU (``how`` CPU: raw bytes of the batch dtype) or
    fetched again through its reader (encoded), ``out`` bytes of scratch."""

    cid: int
    how: int
    data: np.ndarray
    out: int


@dataclass
class Group:
    """The chunks in one staging buffer: where each one's stored bytes are (``at``, ``size``) and where
    its decoded bytes go in the scratch (``out``); ``pos`` and ``end``: staging and scratch bytes used."""

    pos: int = 0
    end: int = 0
    parts: list = field(default_factory=list)  # (cid, how, at, size, out) arrays

    def add(self, cid, how, at, size, out) -> None:
        self.parts.append(tuple(np.asarray(a, np.int64).reshape(-1) for a in (cid, how, at, size, out)))

    def stage(self, item: Pending, buf: np.ndarray) -> None:
        n = len(item.data)
        buf[self.pos:self.pos + n] = item.data
        self.add(item.cid, item.how, self.pos, n, self.end)
        self.pos += n
        self.end += item.out

    def fits(self, item: Pending, enc_cap: int, dec_cap: int) -> bool:
        return self.pos + len(item.data) <= enc_cap and self.end + item.out <= dec_cap

    def table(self) -> tuple[np.ndarray, ...]:
        """``(cid, how, at, size, out)`` of every chunk in the group."""
        if not self.parts:
            return tuple(np.zeros(0, np.int64) for _ in range(5))
        return tuple(np.concatenate(col) for col in zip(*self.parts))

    @property
    def rows(self) -> int:
        """Chunks in the group so far."""
        return sum(len(part[0]) for part in self.parts)

    def __bool__(self) -> bool:
        return bool(self.parts)


@dataclass
class ReadPlan:
    """A batch's device-decoded chunks in read order (see the module docstring)."""

    order: np.ndarray  # chunk ids
    kind: np.ndarray
    joined: np.ndarray  # read with the chunk before it
    enc: np.ndarray  # running sums (n + 1) of staging bytes (gaps of joined chunks included)
    gap: np.ndarray  # the gap before a joined chunk
    dec: np.ndarray  # running sums (n + 1) of scratch bytes
    # one row per file of the plan: whether its identity is checked, then that identity (dev, ino, size, mtime_ns,
    # ctime_ns), as the compiled reads take them: made once per batch, each group's reads pick their rows
    idents: np.ndarray = field(default_factory=lambda: np.zeros((0, 6), np.int64))
    # each array's path prefix (folder, key prefix and separator) as native_reads.chunk_paths takes them: the blob
    # and a (start, length, separator) row per source; None where paths are built in Python (see path_prefixes)
    prefixes: tuple[bytes, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.order)

    def take(self, i: int, enc_room: int, dec_room: int) -> int:
        """The end of the chunks from ``i`` on that fit ``enc_room`` staging and ``dec_room`` scratch bytes
        (the first starts a read of its own: its gap is not read)."""
        e1 = int(np.searchsorted(self.enc, self.enc[i] + self.gap[i] + enc_room, "right")) - 1
        e2 = int(np.searchsorted(self.dec, self.dec[i] + dec_room, "right")) - 1
        return min(e1, e2, len(self.order))


def plan_reads(plan: TablePlan, sources: list[Source]) -> ReadPlan:
    """The stored chunks of ``plan`` decoded on the device, ordered and costed for :meth:`ReadPlan.take`."""
    how = np.array([s.how for s in sources], np.int64)
    in_store = np.array([not r.kv.is_local for r in plan.sources], bool)  # the rest: files read by path
    # stores numbered by identity: arrays of one store are fetched together
    store_no = {id(r.kv): k for k, r in enumerate(plan.sources) if not r.kv.is_local}
    store = np.array([store_no.get(id(r.kv), -1) for r in plan.sources], np.int64)
    ids = np.flatnonzero((plan.chunk_file >= 0) & (how[plan.chunk_source] != CPU))
    src = plan.chunk_source[ids]
    offset, length = plan.chunk_offset[ids], plan.chunk_length[ids]
    kind = np.where(in_store[src], _STORE, np.where(offset >= 0, _RANGED, _WHOLE))
    order = np.lexsort((offset, plan.chunk_file[ids], store[src], kind))
    ids, src, kind = ids[order], src[order], kind[order]
    offset, length, file = offset[order], length[order], plan.chunk_file[ids]
    bound = np.array([s.stored for s in sources], np.int64)[src]
    size = np.where(offset >= 0, length, bound)
    end = offset + length
    gap = np.zeros(len(ids), np.int64)
    joined = np.zeros(len(ids), bool)
    if len(ids) > 1:
        gap[1:] = offset[1:] - end[:-1]
        joined[1:] = (kind[1:] == _RANGED) & (kind[:-1] == _RANGED) & (file[1:] == file[:-1]) & \
            (gap[1:] >= 0) & (gap[1:] <= MAX_GAP)
    gap = np.where(joined, gap, 0)
    enc = np.concatenate([[0], np.cumsum(size + gap)])
    dec = np.concatenate([[0], np.cumsum(np.array([s.nbytes for s in sources], np.int64)[src])])
    idents = np.ascontiguousarray(plan.files[:, [F_HAS_IDENT, *F_IDENT]], np.int64)
    return ReadPlan(ids, kind, joined, enc, gap, dec, idents, path_prefixes(plan))


def path_prefixes(plan: TablePlan) -> tuple[bytes, np.ndarray] | None:
    """Each array's path prefix, ``reader.file_path`` of its key prefix and separator, as
    :func:`.native_reads.chunk_paths` takes them (a file's path: that prefix, then its grid coordinates joined by
    the separator, as ``ChunkKeyEncoding.key`` joins them); None without the compiled reads, or for a plan of
    zero-dimensional arrays (their one key has no coordinate: ``c`` or ``0``)."""
    if not native_reads.available() or plan.files.shape[1] <= F_COORDS:
        return None
    prefixes = []
    for reader in plan.sources:
        enc = reader.metadata.key_encoding
        prefixes.append(os.fsencode(reader.file_path(enc.prefix + enc.separator if enc.prefix else "")))
    rows = np.zeros((len(prefixes), 3), np.int64)
    rows[:, 1] = [len(p) for p in prefixes]
    rows[:, 0] = np.cumsum(rows[:, 1]) - rows[:, 1]
    rows[:, 2] = [ord(r.metadata.key_encoding.separator) for r in plan.sources]
    return b"".join(prefixes), rows


class Stager:
    """Reads groups of a batch's chunks into staging buffers (see the module docstring).

    ``store``: the pipeline's :class:`~stoker.storage.local.LocalStore`; ``stats``: its recorder.
    """

    def __init__(self, store, stats, threads: int = 1) -> None:
        self.store = store
        self.stats = stats
        self.pool = ReadPool(threads)

    def cancel(self) -> None:
        """The pipeline is closing: the compiled round under way stops at its next read, and :meth:`read`
        raises :func:`~stoker.errors.pipeline_closed` rather than stage what it left unread (or read it again
        the Python way). On the Python path only the caller's wait for the read threads ends
        (:meth:`ReadPool.map` raises :class:`~stoker.errors.ShutdownError`): a read thread goes on with the
        reads of its slice into the staging, which the views it holds keep alive, and nothing is placed from
        them (the batch being staged fails).

        >>> stager.cancel()   # doctest: +SKIP
        """
        self.pool.cancel()

    def close(self, timeout: float = 1.0) -> None:
        """:meth:`cancel`, then wait ``timeout`` seconds at most for the compiled reads' threads."""
        self.pool.close(timeout)

    def _compiled(self, *args, **kw) -> np.ndarray:
        """:func:`.native_reads.read` on the pool's readers; a round cancelled under way (:meth:`cancel`) raises
        :func:`~stoker.errors.pipeline_closed`: nothing is placed from the staging it left unread."""
        out = native_reads.read(*args, self.pool.readers(), **kw)
        if native_reads.cancelled(out):
            raise pipeline_closed()
        return out

    def file(self, plan: TablePlan, f: int, files: dict) -> tuple[str, tuple | None]:
        """``(path, identity or None)`` of file row ``f`` (its store key for an array in a store), once per
        file and batch."""
        held = files.get(f)
        if held is None:
            row = plan.files[f]
            reader = plan.sources[int(row[F_SOURCE])]
            held = files[f] = (reader.file_path(plan.file_key(f)), file_ident(row))
        return held

    def path(self, plan: TablePlan, cid: int, files: dict) -> str:
        return self.file(plan, int(plan.chunk_file[cid]), files)[0]

    def read(self, plan: TablePlan, sources: list[Source], reads: ReadPlan, i: int, e: int, buf: np.ndarray,
             group: Group, files: dict, counts: dict) -> tuple[list[int], list[Pending]]:
        """Read chunks ``reads.order[i:e]`` into ``buf`` from ``group.pos`` on and add them to ``group``;
        returns the chunks with nothing stored (the fill value) and those fetched again (to stage)."""
        fills: list[int] = []
        again: list[Pending] = []
        kind = reads.kind[i:e]
        lo, hi = i + int(np.searchsorted(kind, _WHOLE)), i + int(np.searchsorted(kind, _STORE))
        if hi > i and native_reads.available():  # local files: one call into the compiled reads
            missing, again = self._native(plan, sources, reads, i, lo, hi, buf, group, files, counts)
            fills += missing
        else:
            if lo > i:
                missing, again = self._ranged(plan, sources, reads, i, lo, buf, group, files, counts)
                fills += missing
            if hi > lo:
                fills += self._whole(plan, sources, reads.order[lo:hi], buf, group, files, counts)
        if e > hi:
            fills += self._stores(plan, sources, reads.order[hi:e], buf, group, files, counts)
        return fills, again

    def _ranged(self, plan, sources, reads: ReadPlan, i: int, e: int, buf, group: Group, files, counts):
        """Inner chunks of local shards: one positional read per run of joined chunks."""
        cids = reads.order[i:e]
        runs = _runs(plan, reads, i, e, group)
        heads, read_of, start, span, read_at = runs
        t0 = time.perf_counter()
        view = memoryview(buf)
        run_file = plan.chunk_file[cids[heads]]
        cuts = np.flatnonzero(np.diff(run_file)) + 1  # the runs of one file are adjacent (read order)
        bounds = np.concatenate([[0], cuts, [len(heads)]]).tolist()
        per_file = [(*self.file(plan, int(run_file[lo]), files), start[lo:hi].tolist(),
                     [view[a:a + n] for a, n in zip(read_at[lo:hi].tolist(), span[lo:hi].tolist())])
                    for lo, hi in zip(bounds[:-1], bounds[1:])]
        got_of: list = []  # bytes read per run; None for the runs of a shard that changed
        for lo, hi, got in zip(bounds[:-1], bounds[1:], self.pool.map(self._read_file, per_file)):
            got_of += got if got is not None else [None] * (hi - lo)
        got = np.array([-1 if g is None else g for g in got_of], np.int64)
        fills, again, got_total = self._runs_read(plan, sources, reads, i, e, group, files, counts, got, runs)
        self._counted(t0, got_total, counts)
        return fills, again

    def _runs_read(self, plan, sources, reads: ReadPlan, i: int, e: int, group: Group, files, counts,
                   got: np.ndarray, runs) -> tuple[list[int], list[Pending], int]:
        """The runs of chunks ``reads.order[i:e]`` read (``got``: bytes per run, -1 where the shard changed)
        added to ``group``; returns the chunks of changed shards with nothing stored now (filled) and those
        fetched again (:meth:`fetch`), and the bytes read."""
        cids = reads.order[i:e]
        heads, read_of, start, span, read_at = runs
        offset, length = plan.chunk_offset[cids], plan.chunk_length[cids]
        at = read_at[read_of] + offset - start[read_of]
        how = np.array([s.how for s in sources], np.int64)[plan.chunk_source[cids]]
        dec = np.diff(reads.dec[i:e + 1])
        out = group.end + np.cumsum(dec) - dec
        # a fixed number of steps whatever the runs: Python only for the runs of a shard that changed
        changed = got < 0
        short = np.flatnonzero(~changed & (got != span))
        if len(short):
            cid = int(cids[heads[short[0]]])
            reader = plan.sources[int(plan.chunk_source[cid])]
            raise DecodeError(f"{reader.uri}: the shard holding inner chunk {plan.key(cid)!r} changed or "
                              "vanished while it was read", uri=reader.uri, key=plan.key(cid))
        keep = ~changed[read_of]
        fills, again = self.fetch(plan, sources, cids[~keep], files, counts)  # their shards changed
        got_total = int(span[~changed].sum())
        group.add(cids[keep], how[keep], at[keep], length[keep], out[keep])
        group.pos += int(span.sum())
        group.end += int(dec.sum())
        return fills, again, got_total

    def _native(self, plan, sources, reads: ReadPlan, i: int, lo: int, hi: int, buf, group: Group, files, counts):
        """:meth:`_ranged` and :meth:`_whole` in one call into the compiled reads (:mod:`.native_reads`): the
        runs of shards' inner chunks, then the whole chunk files, read on the call's threads without the GIL.
        A file whose read fails in a way that has a typed error of its own (missing, short, not regular, an OS
        error) is read again the Python way, which raises that error (or, the file back to health, reads it)."""
        cids = reads.order[i:lo]
        runs = _runs(plan, reads, i, lo, group)
        heads, read_of, start, span, read_at = runs
        whole = reads.order[lo:hi]
        # the table: one row per run of a shard, one per whole chunk file; its files numbered in order of use
        file_rows = np.concatenate([plan.chunk_file[cids[heads]], plan.chunk_file[whole]])
        used, local = np.unique(file_rows, return_inverse=True)
        if reads.prefixes is not None:  # built in C (the CPU engine's paths), not per file in Python
            names = plan.files[used][:, [F_SOURCE, *range(F_COORDS, plan.files.shape[1])]]
            paths: bytes | list[str] = native_reads.chunk_paths(*reads.prefixes, names)
        else:
            paths = [self.file(plan, int(f), files)[0] for f in used.tolist()]
        bound = np.array([s.stored for s in sources], np.int64)[plan.chunk_source[whole]]
        table = np.zeros((len(file_rows), 4), np.int64)
        table[:, 0] = local
        table[:len(heads), 1], table[:len(heads), 2], table[:len(heads), 3] = start, span, read_at
        table[len(heads):, 1], table[len(heads):, 2] = -1, bound
        t0 = time.perf_counter()
        out = self._compiled(buf, paths, reads.idents[used], table, group.pos + int(span.sum()))
        fills, again, got = self._native_ranged(plan, sources, reads, i, lo, buf, group, files, counts,
                                                out[:len(heads)], runs)
        missing, got_whole, again_whole = self._native_whole(plan, sources, whole, buf, group, out[len(heads):],
                                                             files, counts)
        self._counted(t0, got + got_whole, counts)
        return fills + missing, again + again_whole

    def _native_ranged(self, plan, sources, reads: ReadPlan, i: int, e: int, buf, group: Group, files, counts, out,
                       runs) -> tuple[list[int], list[Pending], int]:
        heads, read_of, start, span, read_at = runs
        cids = reads.order[i:e]
        if not len(cids):
            return [], [], 0
        got = out[:, native_reads.NREAD].copy()
        status = out[:, native_reads.STATUS]
        failed = np.flatnonzero((status != native_reads.ST_OK) & (status != native_reads.ST_CHANGED)).tolist()
        view = memoryview(buf)
        # the runs the compiled read failed on, read again together as the Python path reads them (on the read
        # threads), which raises the store's own error for what still fails
        retried = self.pool.map(self._read_file, [
            (*self.file(plan, int(plan.chunk_file[cids[heads[r]]]), files), [int(start[r])],
             [view[read_at[r]:read_at[r] + span[r]]]) for r in failed])
        for r, again in zip(failed, retried):
            got[r] = -1 if again is None else again[0]
        got[status == native_reads.ST_CHANGED] = -1
        return self._runs_read(plan, sources, reads, i, e, group, files, counts, got, runs)

    def _native_whole(self, plan, sources, cids, buf, group: Group, out, files,
                      counts) -> tuple[list[int], int, list[Pending]]:
        """The whole chunk files the compiled call read added to ``group`` (a fixed number of steps; Python
        per chunk only for those that failed); returns the missing ones (filled), the bytes read and those read
        again the Python way (to stage): the files the compiled read failed on with an error of the store's own
        (an OS error, not a regular file), which that read raises, or reads once the file is back to health."""
        status, size, at, got = (out[:, j] for j in range(4))
        hard = (native_reads.ST_TOO_BIG, native_reads.ST_CHANGED, native_reads.ST_SHORT)
        bad = np.flatnonzero(np.isin(status, hard))
        for k in bad[:1].tolist():  # the first failure raises, as the Python path would
            cid = int(cids[k])
            reader = plan.sources[int(plan.chunk_source[cid])]
            if status[k] == native_reads.ST_TOO_BIG:  # past its codec's bound, or past the staging
                reader.metadata.codec.check_stored_size(int(size[k]), plan.key(cid))
                placed = (at + got)[:k][status[:k] == native_reads.ST_OK]  # the files placed before it
                _fit(reader, plan, cid, int(size[k]), len(buf) - int(placed.max(initial=group.pos)))
            raise DecodeError(f"{reader.uri}: chunk {plan.key(cid)!r} changed while it was read",
                              uri=reader.uri, key=plan.key(cid))
        missing = cids[status == native_reads.ST_MISSING].tolist()
        # (the detail, an errno or a file type, is the Python read's to word; gone since: nothing stored now)
        gone, again = self.fetch(plan, sources, cids[(status != native_reads.ST_OK) &
                                                      (status != native_reads.ST_MISSING)], files, counts)
        missing += gone
        ok = status == native_reads.ST_OK
        if np.any(ok & (got != size)):  # (a read cut short reports ST_SHORT: never here)
            k = int(np.flatnonzero(ok & (got != size))[0])
            reader = plan.sources[int(plan.chunk_source[int(cids[k])])]
            raise DecodeError(f"{reader.uri}: chunk {plan.key(int(cids[k]))!r} changed while it was read",
                              uri=reader.uri, key=plan.key(int(cids[k])))
        src = plan.chunk_source[cids[ok]]
        nbytes = np.array([s.nbytes for s in sources], np.int64)[src]
        how = np.array([s.how for s in sources], np.int64)[src]
        group.add(cids[ok], how, at[ok], got[ok], group.end + np.cumsum(nbytes) - nbytes)
        if np.any(ok):
            group.pos = int(at[ok][-1] + got[ok][-1])
        group.end += int(nbytes.sum())
        return missing, int(got[ok].sum()), again

    def fetch(self, plan: TablePlan, sources: list[Source], cids, files: dict,
              counts: dict) -> tuple[list[int], list[Pending]]:
        """Chunks ``cids`` read the Python way, through their readers (:func:`.fallback.fetch`: a shard's index
        read anew, the store's own error for a file that cannot be read), together on the read threads (the
        first failure in order raises), their bytes counted read; returns those with nothing stored now
        (filled) and the others, encoded (``Pending.out``: their decoded bytes). The one way a chunk is fetched
        through its reader: chunks the compiled or positional reads could not take, and those the CPU decodes
        (the executor's ``_cpu_chunk``)."""
        cids = np.asarray(cids, np.int64).reshape(-1)
        if not len(cids):
            return [], []
        t0 = time.perf_counter()
        got = self.pool.map(lambda c: gpu_fallback.fetch(plan, c, self.path(plan, c, files)), cids.tolist())
        fills, items = [], []
        for cid, data in zip(cids.tolist(), got):
            if data is None:
                fills.append(cid)
                continue
            src = sources[int(plan.chunk_source[cid])]
            items.append(Pending(cid, src.how, np.frombuffer(memoryview(data).cast("B"), np.uint8), src.nbytes))
        if items:  # every chunk absent (the fill value): nothing read, no io event (as the CPU path's)
            self._counted(t0, sum(len(p.data) for p in items), counts)
        return fills, items

    def _read_file(self, read: tuple) -> list[int] | None:
        """The runs of one shard file, each one positional read (None: the shard is not the one its index was
        read from, or is gone)."""
        path, ident, starts, views = read
        try:
            got = self.store.read_ranges_into(path, starts, views, ident)
        except FileChanged:
            return None
        return got if got is not None else [0] * len(views)

    def _size(self, path: str):
        """The size of the chunk file at ``path`` (None: no such file), or what looking raised: one ``stat``
        (no descriptor); what is not a regular file is opened as the store opens it, to raise its error."""
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            return st.st_size
        try:
            f = self.store.open_file(path)
        except Exception as exc:  # noqa: BLE001 - raised by _whole, after every look
            return exc
        if f is None:
            return None
        with f:
            return f.size

    def _read_whole(self, read: tuple[str, int, memoryview]) -> int:
        """Read the chunk file at ``path`` into ``view``: the bytes read, -1 when its size is no longer
        ``size``. Each task opens and closes its own file: no descriptor outlives it or is shared."""
        path, size, view = read
        f = self.store.open_file(path)
        if f is None or f.size != size:
            if f is not None:
                f.close()
            return -1
        with f:
            return f.read_into(view, 0)

    def _whole(self, plan, sources, cids, buf, group: Group, files, counts) -> list[int]:
        """Whole chunk files: their sizes looked up on the read threads, placed end to end by them, then read
        there (each task opening and closing its own file: at most one descriptor per thread)."""
        fills, room = [], len(buf)
        t0 = time.perf_counter()
        cids = cids.tolist()
        paths = [self.path(plan, cid, files) for cid in cids]
        sizes = self.pool.map(self._size, paths)
        failed = next((f for f in sizes if isinstance(f, BaseException)), None)
        if failed is not None:
            raise failed
        reads, placed = [], []
        for cid, path, size in zip(cids, paths, sizes):
            if size is None:
                fills.append(cid)
                continue
            reader = plan.sources[int(plan.chunk_source[cid])]
            reader.metadata.codec.check_stored_size(size, plan.key(cid))
            _fit(reader, plan, cid, size, room - group.pos)
            reads.append((path, size, memoryview(buf)[group.pos:group.pos + size]))
            placed.append((cid, group.pos, size))
            group.pos += size
        got_of = self.pool.map(self._read_whole, reads)
        total = 0
        for (cid, at, size), got in zip(placed, got_of):
            if got != size:
                reader = plan.sources[int(plan.chunk_source[cid])]
                raise DecodeError(f"{reader.uri}: chunk {plan.key(cid)!r} changed while it was read",
                                  uri=reader.uri, key=plan.key(cid))
            src = sources[int(plan.chunk_source[cid])]
            group.add(cid, src.how, at, size, group.end)
            group.end += src.nbytes
            total += size
        self._counted(t0, total, counts)
        return fills

    def _stores(self, plan, sources, cids, buf, group: Group, files, counts) -> list[int]:
        """Chunks of arrays in stores: those a disk cache holds at a generation known now read from its entry
        files by the compiled reads (:meth:`_entries`), the rest one get_many per store (whole values, then
        ranges)."""
        fills: list[int] = []
        kvs = [plan.sources[int(s)].kv for s in plan.chunk_source[cids]]
        for kv in {id(k): k for k in kvs}.values():
            mine = cids[np.array([k is kv for k in kvs])]
            mine = self._entries(plan, sources, kv, mine, buf, group, files, counts)
            if not len(mine):
                continue
            whole = mine[plan.chunk_offset[mine] < 0]
            ranged = mine[plan.chunk_offset[mine] >= 0]
            t0 = time.perf_counter()
            inner = []  # (reader, grid index, location) of each inner chunk: checked against its index's generation
            for c, o, n in zip(ranged.tolist(), plan.chunk_offset[ranged].tolist(), plan.chunk_length[ranged].tolist()):
                path, ident = self.file(plan, int(plan.chunk_file[c]), files)
                inner.append((plan.sources[int(plan.chunk_source[c])], tuple(int(v) for v in plan.chunk_index[c]),
                              ChunkLocation(plan.key(c), path, o, n, ident)))
            values, parts = fetch_stored(kv, [self.path(plan, c, files) for c in whole.tolist()], inner)
            got = values + list(parts)
            order = np.concatenate([whole, ranged])
            missing = np.array([v is None for v in got], bool)
            fills += order[missing].tolist()
            order = order[~missing]
            got = [v for v in got if v is not None]
            sizes = np.fromiter(map(len, got), np.int64, len(got))
            bounds = np.array([sources[int(s)].stored for s in plan.chunk_source[order]], np.int64)
            for k in np.flatnonzero(sizes > bounds).tolist():  # refused unread elsewhere: refused here
                plan.sources[int(plan.chunk_source[order[k]])].metadata.codec.check_stored_size(
                    int(sizes[k]), plan.key(int(order[k])))
            total = int(sizes.sum())
            if total > len(buf) - group.pos:  # (values within their bounds fit: ReadPlan.take)
                raise BudgetExceeded(f"{kv.uri}: the chunks of one group take {total:,} B, more than the "
                                     f"{len(buf) - group.pos:,} B of staging", knob="host_buffer_bytes", needed=total)
            if len(order):
                np.concatenate([np.frombuffer(memoryview(v).cast("B"), np.uint8) for v in got],
                               out=buf[group.pos:group.pos + total])
            nbytes = np.array([sources[int(s)].nbytes for s in plan.chunk_source[order]], np.int64)
            how = np.array([sources[int(s)].how for s in plan.chunk_source[order]], np.int64)
            group.add(order, how, group.pos + np.cumsum(sizes) - sizes, sizes, group.end + np.cumsum(nbytes) - nbytes)
            group.pos += total
            group.end += int(nbytes.sum())
            self._counted(t0, total, counts)
        return fills

    def _entries(self, plan, sources, kv, cids, buf, group: Group, files, counts) -> np.ndarray:
        """Of chunks ``cids`` of arrays in the store ``kv``, read those its disk cache holds at a generation known
        now (the batch's prefetch found them: ``plan.disk_entries``; else ``kv.entry_files``, no request) from
        their entry files in one call into the compiled reads (:func:`.native_reads.read`, offset
        :data:`~.native_reads.ENTRY`: each payload checked as the CPU engine checks entries, and placed into
        the staging with no Python per chunk and no get_many), counted as the cache's hits; returns the rest,
        to fetch through the store (among them those whose entry turned out missing or unsound: read, checked
        and replaced there, as the CPU path's)."""
        entry_files = getattr(kv, "entry_files", None)
        if entry_files is None or not native_reads.available() or not len(cids):
            return cids
        known = plan.disk_entries or {}
        found = [(cid, known[cid]) for cid in cids.tolist() if cid in known] if known else []
        rest = cids[~np.isin(cids, [cid for cid, _ in found])] if found else cids
        if len(rest):  # the rest: asked now (an entry written, or a generation learnt, since it was planned)
            whole, ranged = rest[plan.chunk_offset[rest] < 0], rest[plan.chunk_offset[rest] >= 0]
            keys = [plan.sources[int(plan.chunk_source[c])].key_of(self.path(plan, c, files)) for c in whole.tolist()]
            requests = [ByteRange(plan.sources[int(plan.chunk_source[c])].key_of(self.path(plan, c, files)), o, n)
                        for c, o, n in zip(ranged.tolist(), plan.chunk_offset[ranged].tolist(),
                                           plan.chunk_length[ranged].tolist())]
            found += zip(whole.tolist() + ranged.tolist(), entry_files(keys, requests))
        found = [(cid, e) for cid, e in found if e is not None and len(e[1]) <= native.ENTRY_IDENT_CAP]
        if not found:
            return cids
        t0 = time.perf_counter()
        eids = np.array([cid for cid, _ in found], np.int64)
        paths = b"".join(e[0] + b"\0" for _, e in found)
        idents = [e[1] for _, e in found]
        lens = np.fromiter(map(len, idents), np.int64, len(idents))
        table = np.zeros((len(eids), 4), np.int64)
        table[:, 0] = np.arange(len(eids))
        table[:, 1] = native_reads.ENTRY
        src = plan.chunk_source[eids]
        ranged = plan.chunk_offset[eids] >= 0  # a range's payload is its length; a value's, at most its bound
        table[:, 2] = np.where(ranged, plan.chunk_length[eids], np.array([s.stored for s in sources], np.int64)[src])
        out = self._compiled(buf, paths, np.zeros((len(eids), 6), np.int64), table, group.pos,
                             idents=(b"".join(idents), np.stack([np.cumsum(lens) - lens, lens], 1)))
        status, at, got = out[:, native_reads.STATUS], out[:, native_reads.AT], out[:, native_reads.NREAD]
        ok = status == native_reads.ST_OK
        at = _packed(buf, at, got, ok, group.pos)
        group.pos += int(got[ok].sum())
        nbytes = np.array([s.nbytes for s in sources], np.int64)[src[ok]]
        how = np.array([s.how for s in sources], np.int64)[src[ok]]
        group.add(eids[ok], how, at[ok], got[ok], group.end + np.cumsum(nbytes) - nbytes)
        group.end += int(nbytes.sum())
        if np.any(ok):
            kv.served_from_disk(int(ok.sum()), int(got[ok].sum()))
            self._counted(t0, int(got[ok].sum()), counts)
        _report_missed(kv, int(np.count_nonzero(status == native_reads.ST_ENTRY)))
        return cids[~np.isin(cids, eids[ok])]

    def _counted(self, t0: float, nbytes: int, counts: dict) -> None:
        self.stats.stage("io", time.perf_counter() - t0, bytes_out=nbytes)
        counts["bytes_read"] += nbytes


def _report_missed(kv: Any, n: int) -> None:
    """Tell ``kv`` that ``n`` entries it gave were missing or unsound (``ST_ENTRY``: evicted by another process
    sharing the folder, or corrupt), as the CPU path does (``NativeDecoder._missed``): its disk cache counts a
    loss, so its next look-ups look on disk and batches planned ahead fetch what is gone rather than have
    its entries handed out again."""
    report = getattr(kv, "entries_missed", None)
    if n and report is not None:
        report(n)


class ReadPool:
    """Runs a group's reads on ``threads`` threads, the caller's among them (each read releases the GIL).

    >>> pool = ReadPool(4)
    >>> pool.map(len, [b"ab", b"c"])
    [2, 1]
    >>> pool.close()
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        # a slice's task raising past its own handling (a bug) ends its slice with that InternalError, which
        # map raises (the batch's error), rather than leave map waiting for a slice nobody ends
        self._pool = (DaemonPool(self.threads - 1, "stoker-gpu-read", knob="n_compute_threads", on_fault=_slice_failed)
                      if self.threads > 1 else None)
        # the compiled reads' persistent threads (as many, the caller's among them; started at the first read)
        self._readers = native_reads.Readers(self.threads)
        self.closing = False

    def readers(self) -> native_reads.Readers:
        """The compiled reads' threads: none is started per read call (:class:`.native_reads.Readers`)."""
        return self._readers

    def started(self) -> list:
        """The pool's threads started so far (the callers' are not its own)."""
        return self._pool.threads if self._pool is not None else []

    def map(self, fn: Callable[[Any], Any], items: list) -> list:
        """``[fn(x) for x in items]``, in slices on the threads; the first exception raised is raised here.
        Every wait is bounded: :class:`~stoker.errors.ShutdownError` once :meth:`close` was called."""
        k = min(self.threads, len(items))
        if self._pool is None or k < 2:
            return [fn(x) for x in items]
        cuts = np.linspace(0, len(items), k + 1).astype(np.int64).tolist()
        slices = _Slices(fn, items, cuts)
        for j in range(k - 1):
            self._pool.submit(_run_slice, slices, j)
        _run_slice(slices, k - 1)
        for event in slices.done[:k - 1]:
            while not gil.released(event.wait, 0.1):
                if self.closing:
                    raise ShutdownError("the pipeline was closed while chunks were being read")
        for exc in slices.errors:
            if exc is not None:
                raise exc
        return [r for part in slices.results for r in part]

    def cancel(self) -> None:
        """Closing: waits for the read threads raise ShutdownError, and the compiled reads stop between two
        reads (:meth:`.native_reads.Readers.cancel`)."""
        self.closing = True
        self._readers.cancel()

    def close(self, timeout: float = 1.0) -> None:
        """:meth:`cancel` and stop the threads; the compiled reads' are waited for ``timeout`` seconds at most
        (those of :meth:`map` end after their slice, unwaited for)."""
        self.cancel()
        if self._pool is not None:
            self._pool.shutdown()
        self._readers.close(timeout)


class _Slices:
    """One :meth:`ReadPool.map` call's slices: ``fn`` over ``items[cuts[j]:cuts[j + 1]]`` for slice ``j``, its
    results or error, and whether it ended (``done[j]``, set by the thread that ran it)."""

    __slots__ = ("fn", "items", "cuts", "results", "errors", "done")

    def __init__(self, fn: Callable[[Any], Any], items: list, cuts: list[int]) -> None:
        k = len(cuts) - 1
        self.fn, self.items, self.cuts = fn, items, cuts
        self.results: list = [None] * k
        self.errors: list[BaseException | None] = [None] * k
        self.done = [threading.Event() for _ in range(k)]


def _run_slice(slices: _Slices, j: int) -> None:
    """Slice ``j`` of a map (a task of the pool, or the caller's own): its error is raised by the caller."""
    try:
        slices.results[j] = [slices.fn(x) for x in slices.items[slices.cuts[j]:slices.cuts[j + 1]]]
    except BaseException as exc:  # noqa: BLE001 - raised by the caller
        slices.errors[j] = exc
    finally:
        slices.done[j].set()


def _slice_failed(fault: InternalError, args: tuple) -> None:
    """The pool's ``on_fault``: a slice's task raised past :func:`_run_slice`'s handling (a bug): the slice
    ends with ``fault``, which the map raises (its batch's error)."""
    slices, j = args
    if slices.errors[j] is None:
        slices.errors[j] = fault
    slices.done[j].set()


def _runs(plan: TablePlan, reads: ReadPlan, i: int, e: int, group: Group) -> tuple[np.ndarray, ...]:
    """The positional reads of shard chunks ``reads.order[i:e]``, one per run of joined chunks: ``(heads, read_of,
    start, span, read_at)`` (each run's first chunk, each chunk's run, where a run starts in its file and how
    long it is, where it goes in the staging from ``group.pos`` on)."""
    cids = reads.order[i:e]
    offset, length = plan.chunk_offset[cids], plan.chunk_length[cids]
    first = ~reads.joined[i:e]
    if len(first):
        first[0] = True
    heads = np.flatnonzero(first)
    read_of = np.cumsum(first) - 1
    start = offset[heads]
    stop = np.maximum.reduceat(offset + length, heads) if len(heads) else start
    span = stop - start
    read_at = group.pos + np.cumsum(span) - span
    return heads, read_of, start, span, read_at


def _packed(buf: np.ndarray, at: np.ndarray, got: np.ndarray, ok: np.ndarray, base: int) -> np.ndarray:
    """Where the sound payloads ``ok`` (read at ``at``, ``got`` bytes each) are once moved end to end from
    ``base``, in place order: an entry placed and found unsound before a sound one leaves no hole, whose room
    the group's reservation (to the byte for ranges: ReadPlan.take) lacks for the chunk's refetch."""
    sound = np.flatnonzero(ok)[np.argsort(at[ok], kind="stable")]
    to = base + np.cumsum(got[sound]) - got[sound]
    moved = to != at[sound]
    if not moved.any():  # (every sound one where it was read: no Python step per entry)
        return at
    at = at.copy()
    for k, dst in zip(sound[moved].tolist(), to[moved].tolist()):  # (after an unsound one's room only: rare)
        src, n = int(at[k]), int(got[k])
        buf[dst:dst + n] = buf[src:src + n]  # (to lower addresses, in order; numpy copies overlapping views safely)
        at[k] = dst
    return at


def _fit(reader, plan: TablePlan, cid: int, size: int, room: int) -> None:
    if size > room:
        raise BudgetExceeded(f"{reader.uri}: chunk {plan.key(cid)!r} is stored in {size:,} B, more than the "
                             f"{room:,} B of staging", knob="host_buffer_bytes", needed=size)
