"""The completion record of a TileWriter: which regions are written, beside the array.

A region is marked after its chunks are written, so a job killed mid-way and restarted skips exactly the
regions that were written whole. In ``<array>.tiles-done/``:

- on a local disk, one line ``<i>_<j>_<k>`` a region, appended (``O_APPEND``: one ``write`` a mark, whole
  whatever the threads do) to a log file of each record object, ``marks-<host>-<pid>-<random>.log``: a file
  made and renamed per region cost ~150-700 µs of CPU in the kernel, a line a few; a line cut short (a
  crash) is no mark;
- on an object store, one object ``<i>_<j>_<k>.json`` a region (one PUT: no appends there), and a local
  record's per-region files of earlier versions are read the same way.

A TileWriter marks a region only once its chunk files are on the disk, and makes the marks durable a group
at a time (:mod:`.durable`: its chunks fsynced, then the marks appended, then :meth:`CompletionRecord.flush`,
one fsync of the log for the group); a writer that makes the array anew first removes a record left
beside a removed one (:func:`forget`); :meth:`CompletionRecord.sync` flushes the log and the folder once more
and closes the log, at the writer's close. ``writer.json`` there holds the settings the record is valid for.

>>> rec = CompletionRecord("/out/pred.zarr")
>>> rec.mark((0, 1, 2))
>>> (0, 1, 2) in rec.done()
True
"""

from __future__ import annotations

import json
import os
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from ..storage.fsutil import HOST, fsync_dir, replace_atomically, sibling_path
from .target import is_remote, local_path, remote_store

SUFFIX = ".tiles-done"
LOG_PREFIX, LOG_SUFFIX = "marks-", ".log"  # a record object's log of marks (local disks)


class CompletionRecord:
    """Which regions of the array at ``uri`` are written (see the module docstring)."""

    def __init__(self, uri: str, storage_options: dict | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.remote = is_remote(self.uri)
        path = local_path(self.uri) if not self.remote else self.uri  # beside the array zarr-python opens
        self.path = path + SUFFIX
        self._store: Any = None
        # the log's descriptor, opened at the first mark (local disks): in a list the finalizer (a record dropped
        # without sync()) shares, so it closes the descriptor only while it is this record's
        self._log: list[int | None] = [None]
        self._log_lock = threading.Lock()
        self._log_new = False  # the log was made since the last flush: the folder's entry for it is not durable
        self._appended = False  # marks appended since the log was last fsynced
        self._synced = False  # the record's folder fsynced (by a flush of a new log, or by sync()) since it changed
        weakref.finalize(self, _close_log, self._log, self._log_lock)
        if self.remote:  # the record's folder as a store of its own: keys are the marks' names
            self._store = remote_store(self.path, storage_options)
        else:
            Path(self.path).mkdir(parents=True, exist_ok=True)

    def _write(self, name: str, blob: bytes, durable: bool = True) -> None:
        if self.remote:
            self._store.put(name, blob)
        elif durable:
            replace_atomically(Path(self.path) / name, lambda f: f.write(blob))
        else:  # atomic (a reader sees the whole mark or none), flushed later by sync()
            final = Path(self.path) / name
            tmp = sibling_path(final, "tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            self._synced = False  # a new name in the folder, for sync() to make durable

    def flush(self) -> None:
        """Make the marks written so far durable (the log fsynced, and the record's folder when the log is new),
        keeping the log open for the next marks.

        >>> record.mark((0, 0, 0)); record.flush()   # doctest: +SKIP
        """
        if self.remote:
            return
        with self._log_lock:  # a mark's append and sync() do not run meanwhile
            fd, new, self._log_new = self._log[0], self._log_new, False
            if fd is not None:
                os.fsync(fd)
                self._appended = False
        if new:
            fsync_dir(self.path)
            self._synced = True

    def sync(self) -> None:
        """Make the marks written so far durable (the log and the record's folder fsynced once); the log is
        closed (a later mark opens another). What the last :meth:`flush` made durable is not fsynced again: a
        TileWriter's close() waits on the disk only for what changed since its last group of marks."""
        if self.remote:
            return
        with self._log_lock:
            fd, self._log[0] = self._log[0], None
            appended, self._appended = self._appended, False
            folder = not self._synced or self._log_new
            self._log_new = False
        if fd is not None:
            try:
                if appended:
                    os.fsync(fd)
            finally:
                os.close(fd)
        if folder:
            fsync_dir(self.path)
            self._synced = True

    def _read(self, name: str) -> bytes | None:
        try:
            if self.remote:
                return bytes(self._store.get(name))
            return (Path(self.path) / name).read_bytes()
        except FileNotFoundError:
            return None

    @property
    def settings_file(self) -> Path | None:
        """The settings' file on a local disk (``writer.json``), which :meth:`check_settings` with ``durable=False``
        leaves to be fsynced before the first mark; None on an object store (a PUT is durable)."""
        return None if self.remote else Path(self.path) / "writer.json"

    def check_settings(self, settings: dict, optional: tuple[str, ...] = (), durable: bool = True) -> None:
        """Start the record for ``settings``, or check that those it was started with are the same; a key of
        ``optional`` is compared only where both name it (a writer's ``grid``, which a restart may leave out).

        ``durable=False``: a record started here is written atomically but not fsynced; the caller makes
        :attr:`settings_file` and its folder durable before the first mark (a TileWriter's first group of marks:
        :mod:`.durable`), instead of waiting on the disk before its first tile. A crash before then may leave the
        file empty or cut short (its name on the disk, its bytes not): with no mark in the record that is a record
        never used, started again here; beside marks (which come only after the settings are on the disk) it is
        refused."""
        blob = self._read("writer.json")
        saved = _parsed(blob)
        if saved is _TORN and self._has_marks():
            raise InvalidArgument(
                f"{self.uri}: the completion record's settings {self.path}/writer.json are not whole JSON, beside "
                "marks of written regions that they vouch for: remove the array and its record to start over",
                uri=self.uri)
        if blob is None or saved is _TORN:
            self._write("writer.json", json.dumps(settings, sort_keys=True).encode(), durable=durable)
            return
        now = json.loads(json.dumps(settings))

        def compared(d: dict, other: dict) -> dict:
            return {k: v for k, v in d.items() if k not in optional or k in other}

        if not isinstance(saved, dict) or compared(saved, now) != compared(now, saved):
            raise InvalidArgument(
                f"{self.uri}: the completion record {self.path} was written by a TileWriter with other settings "
                f"({saved}, now {settings}); regions it marks done would not match. Use the same settings, or "
                "remove the array and its record to start over", uri=self.uri)

    def mark(self, index: tuple[int, ...]) -> None:
        """Record region ``index`` as written (after its chunks are). Thread-safe."""
        stem = "_".join(str(int(i)) for i in index)
        if self.remote:
            self._write(stem + ".json", json.dumps({"region": list(index)}).encode(), durable=False)
            return
        line = (stem + "\n").encode()
        with self._log_lock:  # sync() closes the descriptor; a short write (a full disk) must not interleave
            fd = self._log[0]
            if fd is None:
                name = f"{LOG_PREFIX}{HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}{LOG_SUFFIX}"
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
                fd = self._log[0] = os.open(os.path.join(self.path, name), flags, 0o644)
                self._log_new = True
            size = os.fstat(fd).st_size  # this record's own log: only this lock's holder appends to it
            self._appended = True
            try:
                written = os.write(fd, line)
            except BaseException:
                _drop_torn_log(self._log, size)
                raise
            if written != len(line):
                _drop_torn_log(self._log, size)
                raise OSError(f"{self.path}: a mark of region {index} was cut short ({written} of {len(line)} "
                              "bytes; disk full or file size limit?); it was removed, and the region is written "
                              "again by a restarted job")

    def done(self) -> set[tuple[int, ...]]:
        """The regions recorded as written."""
        return self._marks(self._grid())

    def _marks(self, grid: tuple[int, ...] | None) -> set[tuple[int, ...]]:
        """The regions the record's marks name (of ``grid``: regions per axis; None, any): the one rule of what
        a mark is, for :meth:`done` and the torn-settings check alike. A mark is a region's object
        ``<i>_<j>_<k>.json`` or a whole line of a local log; any other name (a user's note, a tool's summary
        beside them) is none."""
        if self.remote:
            names = self._store.list()  # an empty folder lists no keys (object stores have no folders)
        else:
            names = os.listdir(self.path)
        out: set[tuple[int, ...]] = set()
        for name in names:
            stem, ext = os.path.splitext(name)
            if ext == ".json" and stem != "writer":
                if (index := _index(stem, grid)) is not None:
                    out.add(index)
            elif not self.remote and name.startswith(LOG_PREFIX) and ext == LOG_SUFFIX:
                try:
                    text = (Path(self.path) / name).read_bytes().decode("ascii", errors="replace")
                except FileNotFoundError:
                    continue
                for line in text.split("\n")[:-1]:  # the part after the last newline: a mark cut short
                    index = _index(line, grid)
                    if index is not None:
                        out.add(index)
        return out

    def _has_marks(self) -> bool:
        """Whether the record holds any mark (:meth:`_marks`' rule; of any grid: its settings are unread)."""
        return bool(self._marks(None))

    def _grid(self) -> tuple[int, ...] | None:
        """The regions per axis of the array (``writer.json``'s shape over its write unit); None before the
        record is started."""
        saved = _parsed(self._read("writer.json"))
        if saved is None:
            return None
        if saved is _TORN:  # (TileWriter checks the settings first: this is a record read on its own)
            raise InvalidArgument(f"{self.uri}: the completion record's settings {self.path}/writer.json are not "
                                  "whole JSON: remove the array and its record to start over", uri=self.uri)
        return tuple(-(-int(s) // int(u)) for s, u in zip(saved["shape"], saved["unit"]))


_TORN = object()  # settings that are not whole JSON (see CompletionRecord.check_settings)


def _parsed(blob: bytes | None) -> Any:
    """The settings in ``blob``; None for none, ``_TORN`` for bytes that are not whole JSON (a crash cut them)."""
    if blob is None:
        return None
    try:
        return json.loads(blob)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError of bytes that never were text
        return _TORN


def forget(uri: str, storage_options: dict | None = None) -> None:
    """Remove the completion record beside the array at ``uri``, if there is one: every mark and the settings.
    For a writer about to make the array anew: the record vouched for regions of an array that is gone, and
    its marks would have the new array's regions skipped, left at the fill value without a word.

    >>> forget("/out/pred.zarr")   # doctest: +SKIP
    """
    uri = uri.rstrip("/")
    if is_remote(uri):
        store = remote_store(uri + SUFFIX, storage_options)
        try:
            names = store.list()
            if names:
                import obstore

                obstore.delete(store.writable_obstore(), names)
        finally:
            store.close()
        return
    path = local_path(uri) + SUFFIX
    if not os.path.isdir(path):
        return
    for name in os.listdir(path):
        stem, ext = os.path.splitext(name)
        if ext == ".json" or (name.startswith(LOG_PREFIX) and ext == LOG_SUFFIX):
            (Path(path) / name).unlink(missing_ok=True)
    fsync_dir(path)  # gone from the disk before the array is made: a crash leaves no stale mark over it


def _index(stem: str, grid: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """``"1_0_2"`` as ``(1, 0, 2)``; None for anything else, and for an index that is not a region of ``grid``
    (regions per axis; a region index names the spatial axes: all, or all but a channel axis first)."""
    parts = stem.split("_")
    if not all(p.isdigit() and p.isascii() for p in parts):
        return None
    index = tuple(int(p) for p in parts)
    if grid is not None:
        if len(index) not in (len(grid), len(grid) - 1) or len(index) == 0:
            return None
        if any(i >= n for i, n in zip(index, grid[len(grid) - len(index):])):
            return None
    return index


def _drop_torn_log(log: list[int | None], size: int) -> None:
    """After a mark cut short or failed: cut the log back to ``size`` (the marks before it), and close it, so
    the next mark starts another log instead of being appended to the torn bytes (``"1"`` + ``"5_6_7\\n"``
    would read as region ``15_6_7``). The caller holds the log's lock."""
    fd, log[0] = log[0], None
    if fd is None:
        return
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass  # the torn line has no newline yet: it stays no mark as long as nothing is appended to it
    finally:
        os.close(fd)


def _close_log(log: list[int | None], lock: threading.Lock) -> None:
    """Close a dropped record's log (its marks stay: they are written as they are made)."""
    with lock:
        fd, log[0] = log[0], None
    if fd is not None:
        os.close(fd)
