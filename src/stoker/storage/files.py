"""FileStore: the :class:`~stoker.storage.store.Store` of a local directory.

Keys name files under the root (``"c/0/1"`` is ``<root>/c/0/1``). Reads go through a
:class:`~stoker.storage.local.LocalStore` (the process-wide one by default): positional reads, the
bounded descriptor cache for files read by ranges (shards), regular files only. Ranges of one file
are merged by :func:`~stoker.storage.ranges.coalesce` before they are read.

A value's generation (see :mod:`stoker.storage.store`, "Generations") is its file's identity (device,
inode, size, modification and change times), taken before and after the read: a file that changed while it
was read gets a generation equal to no other, so bytes that may mix two versions never pass for either.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Collection, Sequence

from ..errors import StorageError, as_value
from .local import FileChanged, Identity, LocalStore, default_store, identity
from .ranges import coalesce
from .store import (ByteRange, Store, by_key, check_key, check_prefix, each_alone, not_found, ranges_in_place, read_values,
                    short_read)


class FileStore(Store):
    """A directory read as a store (see the module docstring); thread-safe."""

    supports_ranges = True
    supports_list = True
    is_local = True
    root: str  # the directory (absolute) whose files are the values
    #: get_many and get_each can say which generation of each value they read (``versions=True``)
    reports_versions = True

    def __init__(self, root: str | os.PathLike, files: LocalStore | None = None,
                 max_gap: int = 64 << 10, max_length: int = 64 << 20) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.uri = self.root
        self._head = self.root.rstrip("/") + "/"
        self.files = files if files is not None else default_store()
        self.max_gap, self.max_length = max_gap, max_length

    def path(self, key: str) -> str:
        """The local path of ``key``."""
        if os.sep == "/":  # a checked key is already the path under the root: one concatenation per chunk
            return self._head + check_key(key)
        return os.path.join(self.root, *check_key(key).split("/"))

    def _read(self, key: str, read, *args):
        """``read(path, *args)``; a directory where a value should be reads as missing, like no file."""
        path = self.path(key)
        try:
            data = read(path, *args)
        except StorageError:
            if os.path.isdir(path):
                raise not_found(self.uri, key) from None
            raise
        if data is None:
            raise not_found(self.uri, key)
        return data

    def get(self, key: str) -> bytes:
        return self._read(key, self.files.read)

    def get_ranges(self, requests: Sequence[ByteRange]) -> list[bytes | memoryview]:
        return self._get_ranges(requests)

    def _get_ranges(self, requests: Sequence[ByteRange], expected: Identity | None = None) -> list:
        """:meth:`get_ranges`; with ``expected``, from files of that identity only (:class:`FileChanged`)."""
        out: list = [None] * len(requests)
        for key, numbers in by_key(requests).items():
            plain = [i for i in numbers if not requests[i].is_suffix]
            for i in numbers:
                r = requests[i]
                if r.is_suffix:
                    data, ident = self._read(key, self.files.read_current,
                                             lambda size, n=r.length: (max(0, size - n), min(n, size)))
                    if len(data) != r.length:
                        raise short_read(self.uri, r, len(data), size=ident[2])
                    out[i] = data
            if plain and all(requests[i].length == 0 for i in plain) and not self.exists(key):
                raise not_found(self.uri, key)
            for read in coalesce([(requests[i].start, requests[i].length) for i in plain],
                                 self.max_gap, self.max_length):
                view = memoryview(self._read(key, self.files.read_range, read.offset, read.length, expected)
                                  if read.length else b"")
                for j, part in read.slices():
                    if part.stop > len(view):
                        # a read ends short only at the end of the file: its size is known
                        raise short_read(self.uri, requests[plain[j]], max(0, len(view) - part.start),
                                         size=read.offset + len(view))
                    out[plain[j]] = view[part]
        return out

    def _identity(self, key: str) -> tuple | None:
        st = self._stat(key)
        return None if st is None else identity(st)

    def _versioned(self, key: str, read) -> tuple[Any, Any]:
        """``(read(expected), generation)``: the file's identity, the same before and after the read; else a
        generation equal to no other (the bytes may mix two versions of the file). ``read`` reads only from a
        file of identity ``expected`` (the one at the path before): a cached descriptor of a file since
        replaced there fails it (:class:`FileChanged`), and is dropped before the one read again."""
        for attempt in range(2):
            before = self._identity(key)
            try:
                data = read(before)
            except FileChanged:
                if attempt:
                    raise
                self.files.forget(self.path(key))  # the next open sees the file now at the path
                continue
            after = self._identity(key)
            return data, (after if before == after else ("changed while read", before, after))
        raise AssertionError("unreachable")

    def get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                 lenient: Collection[int] = ()) -> tuple:
        """See :func:`~stoker.storage.store.get_many`."""
        if not versions:
            return read_values(self, keys), ranges_in_place(self.get_ranges, requests, lenient)
        values, value_versions = [], []
        for key in keys:
            value, generation = self._get_versioned(key)
            values.append(value)
            value_versions.append(generation)
        parts: list = [None] * len(requests)
        part_versions: list = [None] * len(requests)
        for key, numbers in by_key(requests).items():
            mine = {n for n, i in enumerate(numbers) if i in lenient}
            got, generation = self._versioned(
                key, lambda expected, ns=numbers, m=mine: ranges_in_place(
                    lambda rs: self._get_ranges(rs, expected), [requests[i] for i in ns], m))
            for i, data in zip(numbers, got):
                parts[i] = data
                part_versions[i] = None if isinstance(data, Exception) else generation
        return values, parts, value_versions, part_versions

    def get_each(self, requests: Sequence[ByteRange], versions: bool = False) -> Any:
        """See :func:`~stoker.storage.store.get_each`."""
        if not versions:
            return each_alone(self, requests)
        out, generations = [], []
        for r in requests:
            got, generation = self._versioned(r.key, lambda expected, r=r: _one(self._get_ranges, r, expected))
            out.append(got)
            generations.append(None if isinstance(got, Exception) else generation)
        return out, generations

    def _get_versioned(self, key: str) -> tuple[bytearray | None, Any]:
        """A whole value (None when missing) and its generation: the identity of the file read, taken through
        its descriptor once read (a file rewritten in place while read: its size says it)."""
        path = self.path(key)
        try:
            f = self.files.open_file(path)
        except StorageError:
            if os.path.isdir(path):
                return None, None
            raise
        if f is None:
            return None, None
        with f:
            data = bytearray(f.size)
            got = f.read_into(memoryview(data), 0) if f.size else 0
            try:
                after = identity(os.fstat(f.fd))
            except OSError as exc:
                raise StorageError(f"cannot stat {path}: {exc.strerror}", uri=self.uri, key=key, path=path) from None
        same = got == f.size == after[2]
        return (data if same else data[:got]), (after if same else ("changed while read", f.size, after))

    def _stat(self, key: str) -> os.stat_result | None:
        path = self.path(key)
        try:
            return os.stat(path)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot stat {path}: {exc.strerror}", uri=self.uri, key=key, path=path) from None

    def size(self, key: str) -> int:
        st = self._stat(key)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise not_found(self.uri, key)
        return st.st_size

    def exists(self, key: str) -> bool:
        st = self._stat(key)
        return st is not None and stat.S_ISREG(st.st_mode)

    def list(self, prefix: str = "") -> list[str]:
        prefix = check_prefix(prefix)
        top = self.path(prefix) if prefix else self.root
        keys: list[str] = []
        self._walk(top, prefix, keys)
        return sorted(keys)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """One directory's files and subdirectories (one ``scandir``; an empty subdirectory is listed too)."""
        prefix = check_prefix(prefix)
        folder = self.path(prefix) if prefix else self.root
        keys: list[str] = []
        folders: list[str] = []
        for entry in self._scan(folder):
            name = f"{prefix}/{entry.name}" if prefix else entry.name
            if entry.is_dir(follow_symlinks=False):
                folders.append(name)
            elif entry.is_file():
                keys.append(name)
        return sorted(keys), sorted(folders)

    def _scan(self, folder: str) -> list[os.DirEntry]:
        try:
            return list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise StorageError(f"cannot list {folder}: {exc.strerror}", uri=self.uri, path=folder) from None

    def _walk(self, folder: str, key: str, keys: list[str]) -> None:
        for entry in self._scan(folder):
            name = f"{key}/{entry.name}" if key else entry.name
            if entry.is_dir(follow_symlinks=False):
                self._walk(entry.path, name, keys)
            elif entry.is_file():  # regular files (through symlinks); never FIFOs, sockets, devices
                keys.append(name)

    def close(self) -> None:
        """Drops the cached descriptors of files under the root (the shared cache stays usable)."""
        self.files.forget(self.root)

    def __reduce__(self):  # for worker processes: the process-wide descriptor cache there
        return FileStore, (self.root, None, self.max_gap, self.max_length)

    def __repr__(self) -> str:
        return f"FileStore({self.root!r})"


def _one(get_ranges, r: ByteRange, expected: Identity | None):
    """The bytes of ``r``, or the error reading it met (a file that changed under a cached descriptor:
    :class:`FileChanged` raised, to be read again)."""
    try:
        return get_ranges([r], expected)[0]
    except FileChanged:
        raise
    except Exception as exc:  # noqa: BLE001 - this range's own error, returned in its place
        return as_value(exc)
