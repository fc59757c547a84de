"""The staging's compiled side (``csrc/staging.c``): a wave's reads of local files in one call, and blosc1 frames
parsed in C, each with the GIL released once; ``None`` / numpy where the compiled engine is absent.

:func:`read` takes a table of reads (a coalesced run of a shard's inner chunks: file, offset, length, where in
the staging; a whole chunk file: file, -1, the most bytes it may take) and reads them all on the caller's
thread and the persistent threads of a :class:`Readers` (or up to ``threads`` threads of the call's own): no
Python step and no GIL per read, no thread started per call; :func:`chunk_paths` builds the files' paths
(no Python step per file). :func:`parse_blosc_batch` is
:func:`.frames.parse_blosc_batch` with the frames walked in C: the same :class:`~.frames.Layout` (held to it by
``tests/gpu/test_gpu_native_reads.py``), and for a refused frame the numpy parser's words (it parses only the
refused ones again).

>>> import numpy as np
>>> out = read(bytearray(4), ["/no/such/file"], np.zeros((1, 6), np.int64), np.array([[0, -1, 4, 0]]), 0, 1)
>>> int(out[0, STATUS]) == ST_MISSING  # (with the compiled engine)
True
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from typing import Any, Iterator

import numpy as np

from ...runtime import gil
from ..cpu import native
from . import frames

#: statuses of a read (csrc/stoker_native.h)
ST_OK, ST_MISSING, ST_TOO_BIG, ST_CHANGED = native.ST_OK, native.ST_MISSING, native.ST_TOO_BIG, native.ST_CHANGED
ST_SHORT, ST_NOT_REGULAR, ST_ENTRY = native.ST_SHORT, native.ST_NOT_REGULAR, native.ST_ENTRY
#: a read not run: its round was cancelled (:meth:`Readers.cancel`) before it started; nothing of it is staged
ST_CANCELLED = native.ST_CANCELLED
#: a read's offset that makes it a disk-cache entry file's payload (csrc/staging.h SR_ENTRY)
ENTRY = -2
#: columns of a read's result: status, detail (errno, a size), where its bytes are in the staging, bytes read
STATUS, DETAIL, AT, NREAD = 0, 1, 2, 3


def available() -> bool:
    """Whether the compiled reads and parser are built (not where ``STOKER_NATIVE=0``)."""
    return native.stage_read is not None


class Readers:
    """Persistent reader threads for :func:`read` (``csrc/staging.c``'s ``stage_pool``): the caller and
    ``threads - 1`` helpers, started at the first read with work for them and kept until :meth:`close`. A
    forked child gets threads of its own at its first read (the parent's are not there; its lock is made anew
    there, as another thread may have held it at the fork), and the pools still open at interpreter exit are
    closed then (a second at most each). :meth:`cancel` stops the round under way between two reads (its
    pipeline is closing) and every later one before its first.

    >>> readers = Readers(4)
    >>> out = read(bytearray(4), ["/no/such/file"], np.zeros((1, 6), np.int64), np.array([[0, -1, 4, 0]]), 0, readers)
    >>> readers.close()
    True
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, int(threads))
        self.closed = False
        self._pool: Any = None
        self._pid = 0
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py); new in a forked child
        # the rounds' cancel flag (csrc/staging.c reads it between reads, without a lock); None without the engine
        self._cancel: Any = native.stage_cancel_flag() if available() else None
        _open.add(self)
        _every.add(self)

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[bool]:
        """The lock, taken within :data:`LOCK_WAIT_S` (True), or not (False: it never came free, which only a
        fork that ran no ``register_at_fork`` handler leaves behind: a C library's ``fork()``); never a hang."""
        lock = self._lock
        held = lock.acquire(timeout=LOCK_WAIT_S)
        try:
            yield held
        finally:
            if held:
                lock.release()

    def after_fork(self) -> None:
        """In a forked child: a new lock (another thread of the parent may have held it at the fork, and it
        stays held in the child for ever). Its pool stays the parent's, which :meth:`handle` replaces."""
        self._lock = threading.Lock()

    def handle(self) -> Any:
        """What :func:`read` reads on: the pool, made at first use and again in a forked child; after
        :meth:`close`, 1 (the caller's thread alone)."""
        with self._guarded() as held:
            if self.closed or not held:  # (not held: the caller's thread alone, no pool made unlocked)
                return 1
            if self._pool is None or self._pid != os.getpid():
                # (in a child the parent's pool is dropped: its threads are not here, it frees nothing)
                self._pool, self._pid = native.stage_pool(self.threads), os.getpid()
            return self._pool

    def info(self) -> tuple[int, int, int, bool]:
        """``(wanted, started, alive, closing)``: the helper threads this process's pool wants, started and
        has running (zeros before the first read)."""
        with self._guarded():  # (not held: read unlocked, as no thread that holds it runs here)
            pool = self._pool if self._pid == os.getpid() else None
        if pool is None:
            return self.threads - 1, 0, 0, self.closed
        wanted, started, alive, closing = native.stage_pool_info(pool)
        return int(wanted), int(started), int(alive), bool(closing)

    def cancel(self) -> None:
        """Stop the round reading on these readers (from any thread, its caller's reads too): no read starts
        after this, each under way ends (a whole file: its ``read_range``), the rest are :data:`ST_CANCELLED`
        (not run, nothing staged), and so is every read of a later round. For a pipeline that is closing: its
        reader then returns at once rather than after the wave's last read.

        >>> readers.cancel()   # doctest: +SKIP
        """
        if self._cancel is not None:
            native.stage_cancel(self._cancel)

    def cancel_flag(self) -> Any:
        """The cancel flag :func:`read` hands to the compiled reads."""
        return self._cancel

    def close(self, timeout: float = 1.0) -> bool:
        """Stop the helpers (one in a read finishes the file it holds) and wait for them at most ``timeout``
        seconds, the GIL released: True when none is left. Reads after it run on the caller's thread."""
        with self._guarded():  # (not held: closed unlocked, as no thread that holds it runs here)
            self.closed = True
            pool = self._pool if self._pid == os.getpid() else None
        _open.discard(self)
        return True if pool is None else bool(native.stage_pool_close(pool, timeout))


#: the longest :class:`Readers` waits for its lock (held for microseconds: a longer wait is a bug, not load)
LOCK_WAIT_S = 10.0
_open: weakref.WeakSet[Readers] = weakref.WeakSet()  # not closed yet: the atexit hook closes them
_every: weakref.WeakSet[Readers] = weakref.WeakSet()  # closed or not: their locks are made anew in a child


@atexit.register
def _close_open_readers() -> None:
    for readers in list(_open):
        readers.close(1.0)


def _after_fork_in_child() -> None:
    for readers in list(_every):
        readers.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def threads_started() -> int:
    """The reader threads the compiled reads started in this process so far (pooled or per call)."""
    return int(native.stage_threads_started())


def read(buf: Any, paths: list[str] | bytes, files: np.ndarray, reads: np.ndarray, whole_base: int,
         threads: int | Readers, idents: tuple[bytes, np.ndarray] | None = None) -> np.ndarray:
    """The rows of ``reads`` (file, offset or -1, length or bound, at) read into ``buf``: one row per read
    (:data:`STATUS`, :data:`DETAIL`, :data:`AT`, :data:`NREAD`); ``files`` one identity row per path
    (has_ident, dev, ino, size, mtime_ns, ctime_ns), ``paths`` one per row (or :func:`chunk_paths`'). Whole files go end to end from ``whole_base``. A read
    outside ``buf`` is a ``ValueError``, before any byte is read. ``threads``: :class:`Readers` (their
    persistent threads), or a count of threads started for this call. A read of offset :data:`ENTRY` is a
    disk-cache entry file's (its payload placed with the whole files, checked as the CPU engine checks entries:
    ``ST_ENTRY`` and an ``ENTRY_*`` detail where it cannot be used), its ident row ``(start, length)`` of
    ``idents[1]`` in the bytes ``idents[0]``. On :class:`Readers` cancelled (:meth:`Readers.cancel`, before
    or during the call) the reads not run are :data:`ST_CANCELLED` (:func:`cancelled`): the caller drops the
    round. (``native.stage_read`` also returns its opens and reads, which tests count.)"""
    reads = np.ascontiguousarray(reads, np.int64).reshape(-1, 4)
    out = np.zeros((len(reads), 4), np.int64)
    extra = () if idents is None else (idents[0], np.ascontiguousarray(idents[1], np.int64).reshape(-1, 2))
    pooled = isinstance(threads, Readers)
    gil.released(native.stage_read, buf, paths, np.ascontiguousarray(files, np.int64).reshape(-1, 6), reads, out,
                 int(whole_base), threads.handle() if pooled else int(threads), *extra,
                 cancel=threads.cancel_flag() if pooled else None)
    return out


def cancelled(out: np.ndarray) -> bool:
    """Whether :func:`read`'s result holds reads its round's cancel left unrun (:data:`ST_CANCELLED`)."""
    return bool(np.any(out[:, STATUS] == ST_CANCELLED))


def chunk_paths(blob: bytes, prefixes: np.ndarray, names: np.ndarray) -> bytes:
    """The paths of the file rows ``names`` (a source, then its grid coordinates), built in C as the engine builds
    them, NUL-terminated and back to back (:func:`read` takes them as its ``paths``): row ``(start, length,
    separator)`` of ``prefixes`` says where its source's prefix (folder, key prefix and separator) is in ``blob``.

    >>> chunk_paths(b"/d/a.zarr/c/", np.array([[0, 12, ord("/")]]), np.array([[0, 1, 2]]))
    b'/d/a.zarr/c/1/2\\x00'
    """
    names = np.ascontiguousarray(names, np.int64)
    return native.chunk_paths(blob, np.ascontiguousarray(prefixes, np.int64).reshape(-1, 3), names,
                              names.shape[1] - 1)


def parse_blosc_batch(buf: Any, chunk_in: Any, chunk_in_nbytes: Any, chunk_nbytes: Any,
                      chunk_out: Any = None) -> tuple[frames.Layout, dict[int, str]]:
    """:func:`.frames.parse_blosc_batch`, the frames walked in C (numpy's parser where the engine is absent)."""
    if not available():
        return frames.parse_blosc_batch(buf, chunk_in, chunk_in_nbytes, chunk_nbytes, chunk_out)
    data = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
    ins, sizes, nbytes = (np.asarray(a, np.int64).reshape(-1) for a in (chunk_in, chunk_in_nbytes, chunk_nbytes))
    outs = np.cumsum(nbytes) - nbytes if chunk_out is None else np.asarray(chunk_out, np.int64).reshape(-1)
    if not len(ins) == len(sizes) == len(nbytes) == len(outs):
        raise ValueError("chunk_in, chunk_in_nbytes, chunk_nbytes and chunk_out must have one entry per chunk")
    if len(ins) > 1 and chunk_out is not None:
        order = np.argsort(outs, kind="stable")
        if np.any((outs[order] + nbytes[order])[:-1] > outs[order][1:]):
            raise ValueError("the chunks' outputs overlap: the unshuffle writes each chunk's blocks in place")
    fault = np.zeros(len(ins), np.int64)
    streams, blocks = gil.released(native.blosc_streams, data, np.stack([ins, sizes, nbytes, outs], 1), fault)
    s = np.frombuffer(streams, np.int64).reshape(-1, 6)
    b = np.frombuffer(blocks, np.int64).reshape(-1, 4)
    order = np.argsort(s[:, 2], kind="stable")  # by where each decodes to, as the numpy parser orders them
    src, csize, dst, dsize, codec, chunk = (s[order, j] for j in range(6))
    bad = np.flatnonzero(fault)
    why: dict[int, str] = {}
    if len(bad):  # the numpy parser's words for the frames refused (few: damaged chunks)
        _, words = frames.parse_blosc_batch(data, ins[bad], sizes[bad], nbytes[bad], outs[bad])
        why = {int(bad[j]): text for j, text in words.items()}
        for j in bad.tolist():
            why.setdefault(int(j), f"blosc frame refused by the compiled parser (fault {int(fault[j])})")
    layout = frames.Layout(src, csize, dst, dsize, csize == dsize, codec.astype(np.int8), chunk,
                           b[:, 0].copy(), b[:, 1].copy(), b[:, 2].copy(), b[:, 3].astype(np.int8),
                           ins, sizes, outs, nbytes, len(data), int((outs + nbytes).max()) if len(ins) else 0)
    return layout, why
