"""ZipStore: a zip archive read as a store, as the Zarr zip store convention lays it out.

Keys are member names (the Zarr hierarchy at the archive's root). The central directory is read
once, by :mod:`zipfile`, when the store opens. Stored (uncompressed) members are read by byte range
straight from the archive with positional reads: ranges of every member of one call are merged into
few reads, since all of them live in one file. Compressed members (deflate, bzip2, lzma) are read
whole and inflated by :mod:`zipfile` (which checks their CRC), then sliced.

Refused when the archive opens (:class:`~stoker.errors.DecodeError` naming the member): a name that
is not a relative key (absolute, ``..``, backslashes), a name stored twice, a stored member whose
size differs from its stored size, a member whose bytes would reach past the next member's header or the start of the central directory. A member without
its local header where the central directory says is refused when it is first read.

The archive must stay the file it was when it opened: every read checks the open file's device, inode,
size and modification time before and after it, and an archive rewritten in
place is a :class:`~stoker.errors.StorageError` (its central directory, and so every offset, is stale),
never bytes of the new archive at the old offsets. An archive replaced by a rename leaves the open file
as it was: it is still read. Opening the array again (a new store) reads the new archive. So the
generation of every member read (see :mod:`stoker.storage.store`, "Generations") is the archive's identity:
a reader holding a member's index read through another store of that path (an older archive) tells.
"""

from __future__ import annotations

import os
import struct
import threading
import weakref
import zipfile
import zlib
from typing import Any, Collection, Sequence

from ..errors import DecodeError, InvalidArgument, NotFound, StorageError, UnsupportedFormat
from .local import LocalStore, OpenFile, default_store, identity, open_regular
from .ranges import coalesce
from .store import (ByteRange, Store, by_key, check_key, check_prefix, each_alone, not_found, one_level, ranges_in_place,
                    read_values, short_read, slice_value, under)

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader: a member's local header
_LOCAL_MAGIC = b"PK\x03\x04"


class ZipStore(Store):
    """A zip archive on the local file system, read as a store (see the module docstring)."""

    supports_ranges = True
    supports_list = True
    lists_in_memory = True  # the central directory, read when the archive opens
    is_local = False
    #: get_many and get_each can say which generation of each member they read (``versions=True``)
    reports_versions = True

    def __init__(self, path: str | os.PathLike, files: LocalStore | None = None,
                 max_gap: int = 64 << 10, max_length: int = 64 << 20) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.uri = self.path
        self.max_gap, self.max_length = max_gap, max_length
        opened = open_regular(self.path)
        if opened is None:
            raise NotFound(f"{self.path}: no zip archive there", uri=self.uri)
        fd, st = opened
        self.identity = identity(st)
        self._file = OpenFile(files if files is not None else default_store(), fd, self.path, st.st_size)
        # lock rank 4, a leaf (engine/pipeline/facade.py): zipfile's reads of compressed members share one file position
        self._lock = threading.Lock()
        self._offsets: dict[str, int] = {}
        try:
            self._zip = zipfile.ZipFile(os.fdopen(os.dup(fd), "rb"))
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as exc:
            self._file.close()
            raise DecodeError(f"{self.path} is not a readable zip archive: {exc}", uri=self.uri) from None
        except OSError as exc:
            self._file.close()
            raise StorageError(f"cannot read {self.path}: {exc}", uri=self.uri) from None
        try:
            self._members = self._index()
        except Exception:
            self.close()
            raise
        # A store dropped unclosed (default_stores forgets a changed or least recently used archive while
        # arrays may still read through it) releases its descriptors when the last of them is gone.
        weakref.finalize(self, _release, self._zip, self._file)

    def _index(self) -> dict[str, zipfile.ZipInfo]:
        members: dict[str, zipfile.ZipInfo] = {}
        for info in self._zip.infolist():
            if info.is_dir():
                continue
            try:
                check_key(info.filename)
            except InvalidArgument:
                raise DecodeError(f"{self.path}: member {info.filename!r} is not a relative key (absolute, '..' "
                                  "or backslashes); stoker does not read archives whose names leave their root",
                                  uri=self.uri, key=info.filename) from None
            if info.filename in members:
                # zarr-python's ZipStore (xarray's to_zarr into one) appends a member again at every update of
                # it, metadata above all; a zip tool keeps each name once
                raise DecodeError(f"{self.path}: member {info.filename!r} is stored twice; which one is meant is "
                                  "ambiguous (zarr-python's ZipStore, also under xarray's to_zarr, writes a member "
                                  "again at each update). Write the store to a directory and archive that, each name "
                                  "once: cd store.zarr && zip -0 -r ../store.zip .", uri=self.uri, key=info.filename)
            # A stored member's bytes are bounds-checked by compress_size and read by file_size: sizes
            # that differ would read past the member, into the next header or member.
            if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
                raise DecodeError(f"{self.path}: stored member {info.filename!r} claims {info.file_size} bytes but "
                                  f"holds {info.compress_size}; the archive is corrupt", uri=self.uri,
                                  key=info.filename)
            members[info.filename] = info
        # A member's bytes end before the next member's header, the last one's before the central
        # directory: sizes that reach further would read other members' bytes as this one's.
        ordered = sorted(self._zip.infolist(), key=lambda i: i.header_offset)
        ends = [i.header_offset for i in ordered[1:]] + [self._zip.start_dir]
        self._ends: dict[str, int] = {}
        for info, end in zip(ordered, ends):
            if info.filename in members and info.header_offset + _LOCAL_HEADER.size + info.compress_size > end:
                raise DecodeError(
                    f"{self.path}: member {info.filename!r} claims {info.compress_size} bytes at offset "
                    f"{info.header_offset}, past the next member or the central directory (at {end}); the "
                    "archive is corrupt", uri=self.uri, key=info.filename)
            self._ends[info.filename] = end
        return members

    def _info(self, key: str) -> zipfile.ZipInfo:
        info = self._members.get(check_key(key))
        if info is None:
            raise not_found(self.uri, key)
        if info.flag_bits & 0x1:
            raise UnsupportedFormat(f"{self.path}: member {key!r} is encrypted; stoker reads only unencrypted "
                                    "archives", uri=self.uri, key=key)
        return info

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        """Where a member's bytes start: after its local header, whose name and extra field lengths
        may differ from the central directory's."""
        offset = self._offsets.get(info.filename)
        if offset is not None:
            return offset
        header = bytearray(_LOCAL_HEADER.size)
        got = self._file.read_into(memoryview(header), info.header_offset)
        fields = _LOCAL_HEADER.unpack(header) if got == len(header) else None
        if fields is None or fields[0] != _LOCAL_MAGIC:
            raise DecodeError(f"{self.path}: member {info.filename!r} has no local header at offset "
                              f"{info.header_offset}; the archive is corrupt", uri=self.uri, key=info.filename)
        offset = info.header_offset + _LOCAL_HEADER.size + fields[10] + fields[11]
        if offset + info.compress_size > self._ends[info.filename]:
            raise DecodeError(f"{self.path}: member {info.filename!r} reaches past the next member or the central "
                              "directory; the archive is corrupt", uri=self.uri, key=info.filename)
        self._offsets[info.filename] = offset
        return offset

    def _read_at(self, offset: int, length: int) -> memoryview:
        buf = bytearray(length)
        got = self._file.read_into(memoryview(buf), offset)
        return memoryview(buf)[:got]

    def _inflate(self, info: zipfile.ZipInfo) -> bytes:
        try:
            with self._lock, self._zip.open(info) as member:
                return member.read()
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
            raise DecodeError(f"{self.path}: member {info.filename!r} cannot be read: {exc}",
                              uri=self.uri, key=info.filename) from None
        except OSError as exc:
            raise StorageError(f"read of {self.path} member {info.filename!r} failed: {exc}",
                               uri=self.uri, key=info.filename) from None

    def _check_unchanged(self, key: str | None) -> None:
        """StorageError when the open archive is no longer as it was opened (rewritten in place)."""
        try:
            now = identity(os.fstat(self._file.fd))
        except (OSError, ValueError) as exc:  # closed: fd -1
            raise StorageError(f"cannot stat {self.path}: {exc}", uri=self.uri, key=key, path=self.path) from None
        # Not the change time: unlinking a file (a new archive renamed over it) changes it, not its bytes.
        if now[:4] != self.identity[:4]:
            raise StorageError(
                f"{self.path}: the zip archive changed since it was opened (rewritten in place: size or times "
                "differ), so the member offsets read from its central directory are stale; open the array again "
                "to read the new archive, and replace archives by renaming a new file over them rather than "
                "rewriting them while they are read", uri=self.uri, key=key, path=self.path)

    def get(self, key: str) -> bytes | memoryview:
        self._check_unchanged(key)
        data = self._get(key)
        self._check_unchanged(key)  # rewritten while it was read: the bytes may mix both archives
        return data

    def _get(self, key: str) -> bytes | memoryview:
        info = self._info(key)
        if info.compress_type != zipfile.ZIP_STORED:
            return self._inflate(info)
        data = self._read_at(self._data_offset(info), info.file_size)
        if len(data) != info.file_size:
            raise short_read(self.uri, ByteRange(key, 0, info.file_size), len(data), size=info.file_size)
        if zlib.crc32(data) != info.CRC:
            raise DecodeError(f"{self.path}: member {key!r} fails its CRC check; the archive is corrupt",
                              uri=self.uri, key=key)
        return data

    def get_ranges(self, requests: Sequence[ByteRange]) -> list[bytes | memoryview]:
        key = getattr(requests[0], "key", None) if requests else None
        self._check_unchanged(key)
        out = self._get_ranges(requests)
        self._check_unchanged(key)
        return out

    def _get_ranges(self, requests: Sequence[ByteRange]) -> list[bytes | memoryview]:
        out: list = [None] * len(requests)
        stored: list[tuple[int, int, int]] = []  # (request number, archive offset, length)
        for key, numbers in by_key(requests).items():
            info = self._info(key)
            if info.compress_type != zipfile.ZIP_STORED:
                value = self._inflate(info)
                for i in numbers:
                    out[i] = slice_value(value, requests[i], self.uri)
                continue
            base = self._data_offset(info)
            for i in numbers:
                r = requests[i]
                start = info.file_size - r.length if r.is_suffix else r.start
                if start < 0 or start + r.length > info.file_size:
                    raise short_read(self.uri, r, max(0, min(info.file_size - max(start, 0), r.length)),
                                     size=info.file_size)
                stored.append((i, base + start, r.length))
        for read in coalesce([(off, n) for _, off, n in stored], self.max_gap, self.max_length):
            view = self._read_at(read.offset, read.length)
            for j, part in read.slices():
                i = stored[j][0]
                if part.stop > len(view):
                    raise short_read(self.uri, requests[i], max(0, len(view) - part.start))
                out[i] = view[part]
        return out

    @property
    def generation(self) -> tuple[int, int, int, int]:
        """The generation of every member: the archive's device, inode, size and modification time as it
        opened (a read of an archive changed since is an error, never another generation's bytes)."""
        return self.identity[:4]  # type: ignore[return-value]

    def get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                 lenient: Collection[int] = ()) -> tuple:
        """See :func:`~stoker.storage.store.get_many`."""
        values, parts = read_values(self, keys), ranges_in_place(self.get_ranges, requests, lenient)
        if not versions:
            return values, parts
        return (values, parts, [None if v is None else self.generation for v in values],
                [None if isinstance(p, Exception) else self.generation for p in parts])

    def get_each(self, requests: Sequence[ByteRange], versions: bool = False) -> Any:
        """See :func:`~stoker.storage.store.get_each`."""
        out = each_alone(self, requests)
        return (out, [None if isinstance(d, Exception) else self.generation for d in out]) if versions else out

    def size(self, key: str) -> int:
        return self._info(key).file_size

    def exists(self, key: str) -> bool:
        return check_key(key) in self._members

    def list(self, prefix: str = "") -> list[str]:
        return under(self._members, check_prefix(prefix))

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        return one_level(self._members, check_prefix(prefix))

    def changed(self) -> bool:
        """Whether the file at :attr:`path` is no longer the archive opened (rewritten, replaced, gone)."""
        try:
            return identity(os.stat(self.path)) != self.identity
        except OSError:
            return True

    def close(self) -> None:
        _release(self._zip, self._file)

    def __reduce__(self):
        return ZipStore, (self.path, None, self.max_gap, self.max_length)

    def __repr__(self) -> str:
        return f"ZipStore({self.path!r}, {len(self._members)} members)"


def _release(archive: zipfile.ZipFile, file: OpenFile) -> None:
    archive.close()
    file.close()
