"""Marks that never outrun the data: a region is marked done only once its chunk files are on the disk.

A TileWriter's completion record tells a restarted job which regions to skip. If a mark reached the disk
before the chunk files it vouches for (a power loss, a kernel crash: the page cache is lost, and the kernel
writes dirty pages back in no particular order), the restart would skip a region whose data is not there:
silently wrong output. So on a local disk :class:`DurableMarks` makes each written region's files durable
before its mark is written: every chunk (or shard) file the region covers is fsynced, and so is each
folder that took a new name (the chunk renamed into it, a folder made for it: each folder's entry in its
parent once, the first time it is seen), then the marks are appended to the record's log and the log is
fsynced (the record's folder too, when the log is new).

Done one region at a time on the write threads this cost more than the writes (an fsync waits for the
disk: ~2 ms for a 1 MiB chunk here, and the log's fsync is a journal commit of its own), so it is batched
and kept off them: the write threads hand each written region's files over and go on to the next region;
one sync thread takes everything handed over since its last pass, fsyncs those files and folders, appends
the marks and fsyncs the log once for the whole group (group commit: the more regions finish while a pass
waits for the disk, the fewer passes). A pass waits up to :data:`GROUP_WAIT_S` for :data:`GROUP_REGIONS`
regions before it starts (until :meth:`drain` is called): regions written one after another otherwise made
a pass each, with the same fsyncs of their folder and of the log every time. ``threaded=False`` (a writer
with ``write_threads=0``) does the pass on the caller's thread, one region at a time. The disk is asked to
write each chunk file as soon as it is written (:func:`start_writeback`, on the write thread), and a pass
asks again for all its files before it fsyncs the first: the fsyncs then wait for writes already under way,
together, instead of each starting its own in turn (what a volume waits for after its last region was
written: medians of 7.6-16.2 ms a process before, 3.5-12.3 ms after; docs/inference.md).

An object store needs none of it: a PUT that succeeded is durable, and the mark is a PUT after the chunks'.
Nothing on the disk is fsynced there (``files`` is empty), and each mark is written as it comes, on the
write thread that wrote the region (no sync thread: one would send the marks' PUTs one at a time, behind
each other, however many write threads send the chunks').

A pass that fails (an fsync or a mark raising) counts none of its regions as marked (where the log's fsync
failed their lines may survive, their chunks fsynced before them: already on the disk); the error is kept and
raised, as a :class:`~stoker.errors.StorageError`, by :meth:`add`, :meth:`check` and :meth:`drain` from then
on, and nothing is marked after it (an fsync that failed may succeed the next time with the data lost).

>>> marks = DurableMarks(record, Path("/out/pred.zarr"), on_marked=print, threaded=True, timeout_s=600)
>>> marks.add((0, 0, 0), [Path("/out/pred.zarr/c/0/0/0")])   # after the region's chunks were written
>>> marks.drain()    # every region handed over is marked, its chunks and the mark on the disk
(0, 0, 0)
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Sequence

from ..errors import StorageError
from ..runtime.libc import linux_function
from ..runtime.waits import wait_until
from ..runtime.workers import DaemonPool
from ..storage.fsutil import fsync_path as _fsync
from .record import CompletionRecord


#: a pass waits for this many regions handed over (or GROUP_WAIT_S, or a drain) before it starts
GROUP_REGIONS = 4
#: the longest a pass waits for GROUP_REGIONS: a region's mark is that much later at most, never its write
GROUP_WAIT_S = 0.02
#: the most files a pass holds open at once (their writeback started together, then each fsynced)
OPEN_FILES = 64

_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writing the range's dirty pages, do not wait for them


_SYNC_FILE_RANGE = linux_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file ``fd``'s dirty pages to the disk now, without waiting for them
    (Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere nothing). Only advice, its errors ignored:
    what vouches for the data is the fsync after it, which then waits for writes already under way instead of
    starting them (a pass's files written one after another, each fsync waiting for the disk in turn, made the
    last pass of a volume, after its last region, 6-15 ms; see docs/inference.md).

    >>> start_writeback(fd); ...; os.fsync(fd)   # doctest: +SKIP
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # the GIL dropped for the call (ctypes)


class DurableMarks:
    """Marks regions in ``record`` once their files (under ``root``, the array's folder; None on an object
    store) are fsynced; ``on_marked(region)`` after each mark. See the module docstring."""

    def __init__(self, record: CompletionRecord, root: Path | None, on_marked: Callable[[tuple[int, ...]], None],
                 threaded: bool, timeout_s: float, metadata: Sequence[Path] = ()) -> None:
        self.record, self.root, self.timeout_s = record, root, float(timeout_s)
        # weakly, when a method: a writer dropped unclosed is not kept alive by its sync thread's pass
        self._on_marked: Callable[[], Callable[[tuple[int, ...]], None] | None] = \
            weakref.WeakMethod(on_marked) if hasattr(on_marked, "__self__") else lambda: on_marked  # type: ignore
        self._cv = threading.Condition()
        self._queued: list[tuple[tuple[int, ...], list[Path]]] = []
        self._busy = False  # a pass is queued or running on the sync thread
        self._in_pass = 0  # regions in the pass running (for the drain's message)
        self._draining = False  # drain() was called: passes start at once
        self._error: BaseException | None = None
        # folders whose own entry in their parent is on the disk (fsynced after they were made); the array's
        # metadata files and the record's settings, fsynced with the first pass (a mark vouches for an array that
        # exists, under those settings)
        self._known: set[Path] = set()
        self._metadata = list(metadata)
        self.passes = 0  # passes that marked something (for tests and the benchmark)
        # a sync thread where there is a disk to wait for; an object store's marks are PUTs on the write threads
        self._pool = DaemonPool(1, "stoker-tilewriter-sync", knob="write_threads", owner="TileWriter") \
            if threaded and root is not None else None

    def add(self, region: tuple[int, ...], files: list[Path]) -> None:
        """``region`` is written, in ``files`` (its chunk or shard files; none on an object store): mark it
        once they are durable. Raises the error of an earlier pass."""
        if self._pool is None:  # on the calling thread (no write threads, or an object store)
            self.check()
            try:
                self._sync_and_mark([(region, files)])
            except BaseException as exc:  # kept: nothing is marked after a failed pass, here too
                self._keep(exc)
                raise
            return
        with self._cv:
            self._raise_error()
            self._queued.append((region, files))
            if self._busy:
                if len(self._queued) == GROUP_REGIONS:
                    self._cv.notify_all()  # a pass waiting for a group has one now (woken once, not per region)
                return  # the pass running takes it with the others handed over meanwhile
            self._busy = True
        try:
            self._pool.submit(self._passes)
        except BaseException:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
            raise

    def _passes(self) -> None:
        """The sync thread: passes over what was handed over, until nothing is left."""
        while True:
            with self._cv:
                if self._queued and len(self._queued) < GROUP_REGIONS and not self._draining:
                    self._cv.wait_for(lambda: len(self._queued) >= GROUP_REGIONS or self._draining
                                      or self._error is not None, GROUP_WAIT_S)
                group, self._queued = self._queued, []
                self._in_pass = len(group)
                if not group or self._error is not None:
                    self._queued = []  # after a failure nothing more is marked
                    self._busy = False
                    self._in_pass = 0
                    self._cv.notify_all()
                    return
            try:
                self._sync_and_mark(group)
            except BaseException as exc:  # kept for the caller's thread, which raises it
                self._keep(exc)
            with self._cv:
                self._in_pass = 0
                self._cv.notify_all()

    def _keep(self, exc: BaseException) -> None:
        """The first error of a pass, raised from then on."""
        with self._cv:
            if self._error is None:
                self._error = exc

    def _sync_and_mark(self, group: list[tuple[tuple[int, ...], list[Path]]]) -> None:
        regions = ", ".join(str(r) for r, _ in group[:4]) + (f" and {len(group) - 4} more" if len(group) > 4 else "")
        if self.root is not None:
            try:
                self._fsync_files([f for _, files in group for f in files])
            except OSError as exc:
                raise StorageError(f"{self.root}: flushing the chunks of region(s) {regions} to the disk failed "
                                   f"({type(exc).__name__}: {exc}); they are not marked written, so a restarted "
                                   "job writes them again. Check the disk", uri=str(self.root), key=None,
                                   status=None, attempts=None) from exc
        try:
            for r, _ in group:
                self.record.mark(r)
            self.record.flush()
        except OSError as exc:
            raise StorageError(f"{self.record.path}: recording region(s) {regions} as written failed "
                               f"({type(exc).__name__}: {exc}); a restarted job writes them again. Check the disk",
                               uri=self.record.uri, key=None, status=None, attempts=None) from exc
        with self._cv:
            self.passes += 1
        on_marked = self._on_marked()
        try:
            for r, _ in group:
                if on_marked is not None:
                    on_marked(r)
        finally:
            del on_marked  # the writer is not held past its last region's bookkeeping

    def _fsync_files(self, files: list[Path]) -> None:
        """Every file of ``files`` that exists (a chunk holding only the fill value may have been deleted
        instead) and the folders whose entries changed, each once."""
        assert self.root is not None
        if self._metadata:
            files = self._metadata + files
        files = list(dict.fromkeys(files))
        for at in range(0, len(files), OPEN_FILES):
            _fsync_together(files[at:at + OPEN_FILES])
        folders: set[Path] = set()
        fresh: list[Path] = []  # folders whose entries in their parents become durable with this pass
        for f in files:
            d = f.parent
            folders.add(d)  # the chunk's name (renamed in, or removed) in its folder
            while d not in self._known and d != self.root.parent and d.parent != d:
                folders.add(d.parent)  # a folder seen for the first time: its own name in its parent
                # known only if it is there now (its parent's fsync below comes after): one that is not (a
                # fill-value chunk's folder zarr never made) needs its parent fsynced when a later region makes it
                if d.is_dir():
                    fresh.append(d)
                d = d.parent
        for d in sorted(folders, key=lambda p: -len(p.parts)):  # deepest first
            _fsync(d, missing_ok=True, folder=True)
        self._known.update(fresh)
        self._metadata = []

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def check(self) -> None:
        """Raise the error of a pass that failed, if one did."""
        with self._cv:
            self._raise_error()

    def drain(self, deadline: float | None = None) -> None:
        """Wait (until ``deadline``, a ``time.monotonic()``; by default ``timeout_s`` from now) until every region
        handed over is marked; raise the first error."""
        def timed_out() -> StorageError:  # only with a sync thread: a local disk's fsyncs (object stores mark inline)
            return StorageError(f"{self.record.uri}: flushing the written regions to the disk did not finish within "
                                f"write_timeout_s={self.timeout_s:g} s ({self._in_pass + len(self._queued)} regions "
                                "not yet marked); check the disk, or raise write_timeout_s",
                                uri=self.record.uri, key=None, status=None, attempts=None)

        if deadline is None:  # (taken before the lock: the wait for the lock counts against it)
            deadline = time.monotonic() + self.timeout_s
        with self._cv:
            self._draining = True  # a pass waiting for a group starts now
            self._cv.notify_all()
            wait_until(self._cv, lambda: not self._busy or self._error is not None, deadline, timed_out)
            self._raise_error()

    def stop(self) -> None:
        """Let the sync thread end once its pass ran, without waiting for it."""
        if self._pool is not None:
            self._pool.shutdown(drain=True)

    @property
    def threads(self) -> list[threading.Thread]:
        """The sync thread, once started."""
        return [] if self._pool is None else self._pool.threads


def _fsync_together(files: list[Path]) -> None:
    """fsync every file of ``files`` that exists (a chunk holding only the fill value may have been deleted
    instead), their writeback started together first (:func:`start_writeback`): the disk writes them all at
    once, and each fsync waits for what is left of its own, not for the files before it one by one. An
    fsync's error is raised (the data may not be on the disk), after every file is closed."""
    fds: list[int] = []
    try:
        for f in files:
            try:
                fds.append(os.open(f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
            except FileNotFoundError:
                continue
            start_writeback(fds[-1])
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)


__all__ = ["DurableMarks", "start_writeback"]
