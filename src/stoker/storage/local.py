"""Encoded bytes from local files: positional reads through a bounded file-descriptor cache.

``os.pread`` releases the GIL and needs no shared file position, so any number
of threads can read the same file at once. Descriptors of files read in ranges
(shards, read again and again) are cached (LRU, bounded) and reference-counted:
one is closed only when no thread is reading through it. Whole-file reads
(metadata, chunk files) open, read and close.

A missing file reads as ``None`` (the caller decides that means "fill value");
any other failure is a :class:`~stoker.errors.StorageError` naming the path.

Every file is opened non-blocking and checked to be a regular file before it is
read (:func:`open_regular`): a FIFO, socket or device where a chunk or metadata
file should be is refused at once rather than read, which could block forever.

A file's :data:`Identity` (device, inode, size, modification and change times) says
whether two reads saw the same file: bytes located by a shard index are read only
from the file at the path when it still has the identity the index was read with
(:class:`FileChanged` otherwise), so a shard rewritten or replaced meanwhile is never
read at the old offsets.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from ..runtime import gil
from ..errors import DecodeError, StorageError

_MISSING = (errno.ENOENT, errno.ENOTDIR)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}

#: ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``: equal for two stats of one unchanged file.
Identity = tuple[int, int, int, int, int]

_T = TypeVar("_T")


def identity(st: os.stat_result) -> Identity:
    """The :data:`Identity` of a stat result."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def describe_mode(mode: int) -> str:
    """What a file of ``st_mode`` is, in words: ``"a FIFO"``, ``"a directory"``..."""
    return _KINDS.get(stat.S_IFMT(mode), f"a special file (mode {stat.S_IFMT(mode):#o})")


def not_regular(path: str, mode: int) -> StorageError:
    """The error for a file that is not a regular file (see :func:`open_regular`)."""
    return StorageError(
        f"{path} is {describe_mode(mode)}, not a regular file; stoker reads only regular files (reading a FIFO, "
        "socket or device could block forever): put the file itself there",
        path=path,
    )


def refuse_irregular(path: str) -> None:
    """Raise :func:`not_regular` when what is at ``path`` is not a regular file (a directory, a FIFO); return
    when nothing is there, or a regular file. For a chunk file its store read as no value: a
    :class:`~stoker.storage.files.FileStore` reads a directory at a key as no value (as zarr-python's store
    does, and as every store reads a prefix), where stoker reads chunks only from regular files (the engine's
    ``ST_NOT_REGULAR``), never the fill value in their place.

    >>> refuse_irregular("/no/such/file")   # nothing there: the caller's fill value
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno in _MISSING:
            return
        raise StorageError(f"cannot stat {path}: {exc.strerror}", path=path) from None
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode)


def open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result] | None:
    """``(descriptor, its stat)`` of the regular file at ``path``, read-only; ``None`` when it does not exist.

    Opened non-blocking, so opening a FIFO returns at once (a blocking open waits for a writer
    forever), then refused unless it is a regular file (:class:`StorageError` naming what it is).
    ``O_NONBLOCK`` changes nothing for reads of regular files. Any other failure is a
    :class:`StorageError` naming the path.
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in _MISSING:
            return None
        raise StorageError(f"cannot open {path}: {exc.strerror}", path=path) from None
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise StorageError(f"cannot stat {path}: {exc.strerror}", path=path) from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_regular(path, st.st_mode)
    os.set_blocking(fd, True)  # a no-op for reads of local regular files, but some FUSE and network ones honour it
    return fd, st


#: The largest document :func:`read_regular` reads: statistics sidecars and attributes are kilobytes.
MAX_DOCUMENT_BYTES = 64 << 20


def read_regular(path: str | os.PathLike, limit: int = MAX_DOCUMENT_BYTES) -> bytes | None:
    """The whole regular file at ``path`` (see :func:`open_regular`), or ``None`` when it does not exist;
    a :class:`StorageError` for a file larger than ``limit`` bytes, before any of it is read.

    For small documents read outside a store (a statistics sidecar, attributes).
    """
    opened = open_regular(path)
    if opened is None:
        return None
    fd, st = opened
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise StorageError(f"{path} is {st.st_size} bytes, more than the {limit} stoker reads as a document; "
                               "it is not one of its documents (it was not read)", path=os.fspath(path))
        return f.read(limit + 1)


class FileChanged(DecodeError):
    """A file is not the one (or no longer as) a shard index was read from; reload the index and retry."""


@dataclass
class IOCounters:
    """What a store has read so far (cumulative)."""

    reads: int = 0
    bytes_read: int = 0
    files_opened: int = 0


class _Handle:
    __slots__ = ("fd", "size", "users")  # size: at open; the file may have changed since

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.users = 0


class LocalStore:
    """Reads byte ranges of local files; thread-safe.

    >>> store = LocalStore()
    >>> store.read("/data/a.zarr/zarr.json")          # whole file, or None when missing
    >>> store.read_range("/data/a.zarr/c/0/0", 4096, 512)  # bytes 4096..4607, or None when missing
    """

    def __init__(self, max_open_files: int = 128) -> None:
        self.max_open_files = max_open_files
        self._handles: OrderedDict[str, _Handle] = OrderedDict()
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._closed = False  # after close(), descriptors are still usable but no longer cached
        self.counters = IOCounters()

    # -- descriptors -------------------------------------------------------------------------

    @contextmanager
    def _open(self, path: str) -> Iterator[_Handle | None]:
        with self._lock:
            handle = self._handles.get(path)
            if handle is not None:
                self._handles.move_to_end(path)
                handle.users += 1
        if handle is None:
            opened = open_regular(path)
            if opened is None:
                yield None
                return
            fd, st = opened
            handle = _Handle(fd, st.st_size)
            handle.users = 1
            with self._lock:
                self.counters.files_opened += 1
                raced = self._handles.get(path)
                if raced is not None:  # another thread opened it meanwhile: use theirs
                    os.close(fd)
                    handle = raced
                    handle.users += 1
                    self._handles.move_to_end(path)
                elif not self._closed:
                    self._handles[path] = handle
                    self._evict_locked()
        try:
            yield handle
        finally:
            with self._lock:
                handle.users -= 1
                # Evicted (or forgotten) while in use: closed by its last user. The path may be
                # cached again meanwhile under a new descriptor, so compare handles, not paths.
                if handle.users == 0 and self._handles.get(path) is not handle:
                    os.close(handle.fd)

    def _drop(self, path: str, handle: _Handle) -> None:
        """Stop caching ``handle`` (in use: its last user closes it); a newer handle for ``path`` stays."""
        with self._lock:
            if self._handles.get(path) is handle:
                del self._handles[path]

    def _identity(self, fd: int, path: str) -> Identity:
        try:
            return identity(os.fstat(fd))
        except OSError as exc:
            raise StorageError(f"cannot stat {path}: {exc.strerror}", path=path) from None

    def _check(self, handle: _Handle, path: str, expected: Identity | None) -> None:
        """FileChanged unless the file read through ``handle`` still has identity ``expected`` and is still
        the file at ``path`` (``expected`` None: any file). A descriptor of a file since replaced at ``path``
        would read the old file: every read sees the file as it is now, as the compiled reader (which
        opens each file anew) does."""
        if expected is None:
            return
        try:
            now = identity(os.stat(path))
        except OSError:
            now = None  # removed since: the caller looks again and finds it missing
        if now != expected or self._identity(handle.fd, path) != expected:
            raise FileChanged(f"{path} changed since its index was read", path=path)

    def _check_after(self, handle: _Handle, path: str, expected: Identity | None) -> None:
        """FileChanged when the file was rewritten in place while it was read: the bytes may mix the old
        file and the new one. (A replacement by rename leaves the open file as it was: nothing to check.)"""
        if expected is not None and self._identity(handle.fd, path) != expected:
            raise FileChanged(f"{path} changed while it was read", path=path)

    def _checked_read(self, path: str, expected: Identity | None, read: Callable[[int], _T]) -> _T | None:
        """``read(fd)`` on the cached descriptor of ``path``, between :meth:`_check` and :meth:`_check_after`
        against ``expected``; ``None`` when the file is missing (:class:`FileChanged` with ``expected``: the file
        of that identity is gone, so what its index located is not there; the caller reads the index anew, which
        finds the shard gone, its chunks the fill value, as zarr-python deletes a shard all of fill value)."""
        with self._open(path) as handle:
            if handle is None:
                if expected is not None:
                    raise FileChanged(f"{path} is gone since its index was read", path=path)
                return None
            self._check(handle, path, expected)
            got = read(handle.fd)
            self._check_after(handle, path, expected)
            return got

    def _evict_locked(self) -> None:
        while len(self._handles) > self.max_open_files:
            path, handle = next(iter(self._handles.items()))
            del self._handles[path]
            if handle.users == 0:
                os.close(handle.fd)

    def forget(self, prefix: str) -> None:
        """Drop cached descriptors of files under ``prefix`` so the next read sees the file as it is now.

        Called when an array is (re)opened: a file replaced since it was cached
        must not be read through the old descriptor.
        """
        under = prefix.rstrip(os.sep) + os.sep
        with self._lock:
            stale = [p for p in self._handles if p == prefix or p.startswith(under)]
            for path in stale:
                handle = self._handles.pop(path)
                if handle.users == 0:
                    os.close(handle.fd)

    def close(self) -> None:
        """Close every cached descriptor not in use (those in use close when released)."""
        with self._lock:
            self._closed = True
            for handle in self._handles.values():
                if handle.users == 0:
                    os.close(handle.fd)
            self._handles.clear()

    # -- reads -------------------------------------------------------------------------------

    def _pread(self, fd: int, path: str, offset: int, length: int) -> bytes:
        chunks = []
        done = 0
        while done < length:
            try:
                got = gil.released(os.pread, fd, length - done, offset + done)
            except OSError as exc:
                raise StorageError(f"read of {path} at {offset + done} failed: {exc.strerror}", path=path) from None
            if not got:
                break  # end of file: the caller sees a short read and decides
            chunks.append(got)
            done += len(got)
        with self._lock:
            self.counters.reads += 1
            self.counters.bytes_read += done
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _preadv_into(self, fd: int, path: str, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset``; returns the bytes read (fewer only at end of file)."""
        done = 0
        while done < len(view):
            try:
                got = gil.released(os.preadv, fd, [view[done:]], offset + done)
            except OSError as exc:
                raise StorageError(f"read of {path} at {offset + done} failed: {exc.strerror}", path=path) from None
            if not got:
                break
            done += got
        with self._lock:
            self.counters.reads += 1
            self.counters.bytes_read += done
        return done

    def open_file(self, path: str) -> "OpenFile | None":
        """An uncached descriptor for files read once per use (unsharded chunks); ``None`` when missing.

        Thousands of chunk files would only churn the descriptor cache, so they
        are opened here and closed by the caller (``with store.open_file(p) as f``
        after checking for ``None``, or ``f.close()``). A plain object, not a
        generator context manager: this runs once per chunk.
        """
        opened = open_regular(path)
        if opened is None:
            return None
        fd, st = opened
        with self._lock:
            self.counters.files_opened += 1
        return OpenFile(self, fd, path, st.st_size)

    def read_range_into(self, path: str, offset: int, view: memoryview,
                        expected: Identity | None = None) -> int | None:
        """Fill ``view`` with the file's bytes at ``offset`` (cached descriptor); ``None`` when missing.

        With ``expected``, only from a file of that :data:`Identity` (:class:`FileChanged` otherwise).
        """
        return self._checked_read(path, expected, lambda fd: self._preadv_into(fd, path, view, offset))

    def read_ranges_into(self, path: str, offsets: list[int], views: list[memoryview],
                         expected: Identity | None = None) -> list[int] | None:
        """:meth:`read_range_into` for several ranges of one file, its identity checked once before and once
        after them all; the bytes read into each view, or ``None`` when the file is missing."""
        return self._checked_read(path, expected, lambda fd: [self._preadv_into(fd, path, view, offset)
                                                              for offset, view in zip(offsets, views)])

    def read_current(self, path: str, where: Callable[[int], tuple[int, int]],
                     attempts: int = 3) -> tuple[bytes, Identity] | None:
        """The bytes at ``where(size)`` (an ``(offset, length)``) of the file now at ``path``, with the
        :data:`Identity` of the file they came from; ``None`` when there is no file.

        For reads that later reads are checked against (a shard's index). A cached descriptor of a file
        since replaced at ``path`` (renamed over) is dropped and the path reopened; a file that changes
        while it is read is read again, and after ``attempts`` tries :class:`FileChanged`.
        """
        for _ in range(attempts):
            with self._open(path) as handle:
                if handle is None:
                    return None
                before = self._identity(handle.fd, path)
                try:
                    now = identity(os.stat(path))
                except OSError:
                    now = None  # removed (or unreadable) since it was opened: look again
                if now != before:
                    self._drop(path, handle)
                    continue
                offset, length = where(before[2])
                data = self._pread(handle.fd, path, offset, length)
                if self._identity(handle.fd, path) == before:
                    return data, before
        raise FileChanged(f"{path} kept changing while it was read ({attempts} tries)", path=path)

    def size(self, path: str) -> int | None:
        """File size in bytes, or ``None`` when the file does not exist."""
        with self._open(path) as handle:
            return None if handle is None else handle.size

    def read(self, path: str) -> bytes | None:
        """The whole file, or ``None`` when it does not exist.

        Through an uncached descriptor, as :meth:`open_file`: whole files (metadata documents, chunk
        files) are read once per use, and caching their descriptors would only evict the shard files
        that ranged reads come back to (and make :meth:`forget` scan them at every array open).
        """
        f = self.open_file(path)
        if f is None:
            return None
        with f:
            return self._pread(f.fd, path, 0, f.size) if f.size else b""

    def read_range(self, path: str, offset: int, length: int, expected: Identity | None = None) -> bytes | None:
        """``length`` bytes at ``offset`` (fewer at end of file), or ``None`` when the file does not exist.

        With ``expected``, only from a file of that :data:`Identity` (:class:`FileChanged` otherwise).
        """
        return self._checked_read(path, expected, lambda fd: self._pread(fd, path, offset, length))


class OpenFile:
    """A file opened by :meth:`LocalStore.open_file`: its size and positional reads into buffers."""

    __slots__ = ("store", "fd", "path", "size")

    def __init__(self, store: LocalStore, fd: int, path: str, size: int) -> None:
        self.store, self.fd, self.path, self.size = store, fd, path, size

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset``; returns bytes read (fewer only at end of file)."""
        return self.store._preadv_into(self.fd, self.path, view, offset)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> "OpenFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def default_store() -> LocalStore:
    """The process-wide local store (one descriptor cache shared by every array)."""
    return _DEFAULT


_DEFAULT = LocalStore()
