"""A finished region's chunks encoded on the calling thread and stored through zarr-python's store API.

zarr-python's ``array[region] = values`` spends, per chunk, an asyncio round trip to its event loop, one
to a worker thread for the codec, and a full pass over the chunk to see whether it holds only the fill
value (``write_empty_chunks=False``), on top of the encoding itself. A TileWriter's write threads already
run beside the caller, and numcodecs releases the GIL while it compresses, so :class:`ChunkWriter` encodes
the chunks of a region on the thread that writes it and hands the bytes to ``store.set`` (one event-loop
round trip per region; a LocalStore's files are written right there, as LocalStore writes them: a
temporary file renamed over the chunk), with zarr-python still owning the metadata and the chunk keys.
zstd goes through :class:`~.zstdframes.ZstdFrames` (the same frames, one context per thread) into a
buffer from the writer's pool.

It writes directly only layouts whose bytes it encodes exactly as zarr-python does (``tests/inference/
test_chunks.py`` compares the stored bytes): no shards, native little-endian numeric data, and

- v3: the ``bytes`` codec (little endian) optionally followed by ``zstd``, the default of numeric arrays;
- v2: no filters, ``order="C"``, any numcodecs compressor or none.

Anything else (shards, filters, transposes, other codecs, a fill value of ``None``) goes through
zarr-python as before, and so does every chunk that may hold only the fill value: zarr-python decides
whether to store or delete it. A region that is not aligned to the chunks also goes to zarr-python.

>>> cw = ChunkWriter(zarr.open_array("/out/prob.zarr", mode="r+"))
>>> cw.direct
True
>>> cw.write((slice(0, 64), slice(64, 128)), values)   # a chunk-aligned box
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import InvalidArgument
from . import zstdframes
from .buffers import BufferPool
from .durable import start_writeback


def _raw(chunk: np.ndarray) -> np.ndarray:
    """A chunk without a compressor: its own bytes (C-contiguous, little endian), as they are; the caller copies
    them for a store that keeps what it is given (the region's buffer is recycled), and hands them over as they
    are to one that is done with them once stored (files, uploads: no 1 MiB copy a chunk)."""
    return chunk


def _encoder(array: Any) -> Callable[[np.ndarray], bytes] | zstdframes.ZstdFrames | None:
    """What turns a whole chunk (C-contiguous) into its stored bytes exactly as zarr-python does (zstd:
    :class:`~.zstdframes.ZstdFrames`, written into the calling thread's arena), or None when this layout is
    left to zarr-python."""
    import numcodecs
    from zarr.codecs import BytesCodec, ZstdCodec

    dtype = np.dtype(array.dtype)
    if array.shards is not None or dtype.kind not in "iuf" or sys.byteorder != "little":
        return None
    if dtype.itemsize > 1 and dtype.byteorder not in ("=", "<"):
        return None
    if array.fill_value is None:
        return None
    meta = array.metadata
    if meta.zarr_format == 2:
        if meta.filters or meta.order != "C":
            return None
        compressor = meta.compressor
        if compressor is None:
            return _raw
        if type(compressor) is numcodecs.Zstd and zstdframes.available():
            return zstdframes.ZstdFrames(compressor.level, getattr(compressor, "checksum", False))
        return lambda chunk: bytes(compressor.encode(chunk))  # an ndarray, as zarr passes it (Blosc's typesize)
    codecs = list(meta.codecs)
    if not codecs or not isinstance(codecs[0], BytesCodec):
        return None
    if dtype.itemsize > 1 and codecs[0].endian is not None and codecs[0].endian.value != "little":
        return None
    if len(codecs) == 1:
        return _raw
    if len(codecs) == 2 and isinstance(codecs[1], ZstdCodec):
        if zstdframes.available():  # the same frames, without a fresh context and output per chunk
            return zstdframes.ZstdFrames(codecs[1].level, codecs[1].checksum)
        zstd = numcodecs.Zstd(level=codecs[1].level, checksum=codecs[1].checksum)
        return lambda chunk: bytes(zstd.encode(chunk))
    return None


class ChunkWriter:
    """Writes chunk-aligned boxes of ``array`` (a zarr-python array open for writing; see the module
    docstring). ``direct``: whether its chunks are encoded and stored here, not by zarr-python. ``durable``:
    the chunks must be files it can fsync (a TileWriter's local completion record vouches for them): any other
    store is refused (InvalidArgument, naming ``uri``)."""

    def __init__(self, array: Any, pool: BufferPool | None = None, durable: bool = False, uri: str = "") -> None:
        self.array = array
        # where the encoded frames go: a TileWriter's recycled buffers (fresh memory faults in page by page)
        self._take: Callable[..., np.ndarray] = pool.take if pool is not None else \
            (lambda shape, dtype, zero: np.empty(shape, dtype))
        self._give: Callable[[np.ndarray], None] = pool.give if pool is not None else (lambda buf: None)
        self._encode = _encoder(array)
        self.direct = self._encode is not None
        self.chunks = tuple(int(c) for c in array.chunks)
        self.shape = tuple(int(s) for s in array.shape)
        self.dtype = np.dtype(array.dtype)
        fill = np.asarray(array.fill_value if array.fill_value is not None else 0, dtype=self.dtype)
        self._fill = fill
        self._nan_fill = bool(self.dtype.kind == "f" and np.isnan(fill))
        self._keep_empty = bool(array.config.write_empty_chunks)
        self.direct_chunks = 0  # chunks stored here (the rest went through zarr-python)
        from zarr.storage import LocalStore

        store = array.store_path.store
        self._reuse = _keeps_nothing(store)
        # a LocalStore's chunk files are written on the calling thread as LocalStore writes them, not through
        # store.set: that goes to zarr's event loop and from there to a worker thread, two thread hops a
        # chunk for a write of a file
        self._local_root = Path(store.root) if type(store) is LocalStore and not store.read_only else None
        # durable: each file's writeback started as it is written, so the mark's fsync finds it under way
        self._files = _ChunkFiles(str(self._local_root), writeback=durable) if self._local_root is not None else None
        # the array's folder on a local disk, whose files a region's mark waits for (see files()); None elsewhere
        prefix = self.array.store_path.path
        self.folder = None if not isinstance(store, LocalStore) else \
            Path(store.root) / prefix if prefix else Path(store.root)
        self._unit = tuple(int(c) for c in (array.shards or array.chunks))  # what one file holds
        if durable and self.folder is None:  # marks on the disk would vouch for chunks nothing made durable
            raise InvalidArgument(f"{uri or store}: zarr-python opened this output as {type(store).__name__}, whose "
                                  "files stoker cannot fsync, while its completion record is on a local disk: give "
                                  "a local path (or file:///path) or an object store URI (s3://, gs://, az://)",
                                  uri=uri or None)

    def files(self, box: tuple[slice, ...]) -> list[Path]:
        """The files on a local disk that hold ``box`` (its chunks, or its shards; those of chunks holding only
        the fill value may not exist); none on other stores. Where a region's write went, for
        :mod:`.durable`.

        >>> writer.files((slice(0, 64), slice(0, 64)))   # doctest: +SKIP
        [PosixPath('/out/pred.zarr/c/0/0')]
        """
        if self.folder is None:
            return []
        meta = self.array.metadata
        ranges = [range((0 if s.start is None else s.start) // u, -(-(n if s.stop is None else s.stop) // u))
                  for s, u, n in zip(box, self._unit, self.shape)]
        return [self.folder / meta.encode_chunk_key(index) for index in itertools.product(*ranges)]

    def metadata_files(self) -> list[Path]:
        """The array's metadata files on a local disk (zarr.json; .zarray and .zattrs), to be durable before
        the first mark; none on other stores.

        >>> writer.metadata_files()   # doctest: +SKIP
        [PosixPath('/out/pred.zarr/zarr.json')]
        """
        if self.folder is None:
            return []
        names = ["zarr.json"] if self.array.metadata.zarr_format == 3 else [".zarray", ".zattrs"]
        return [self.folder / name for name in names]

    def write(self, box: tuple[slice, ...], values: np.ndarray) -> None:
        """``array[box] = values``, each whole chunk of ``box`` encoded here where :attr:`direct`."""
        sel = tuple(slice(0 if s.start is None else s.start, n if s.stop is None else s.stop)
                    for s, n in zip(box, self.shape))
        aligned = all(s.start % c == 0 and (s.stop % c == 0 or s.stop == n)
                      for s, c, n in zip(sel, self.chunks, self.shape))
        if self._encode is None or not aligned or values.dtype != self.dtype:
            self.array[box] = values
            return
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        store, root = self.array.store_path.store, self.array.store_path.path
        meta, proto = self.array.metadata, default_buffer_prototype()
        puts = []
        ranges = [range(s.start // c, -(-s.stop // c)) for s, c in zip(sel, self.chunks)]
        frames = self._encode if isinstance(self._encode, zstdframes.ZstdFrames) else None
        if frames is not None:  # the region's frames side by side in one buffer, recycled once they are stored
            bound = frames.bound(int(np.prod(self.chunks)) * self.dtype.itemsize)
            arena, at = self._take((bound * int(np.prod([len(r) for r in ranges])),), np.uint8, False), 0
        for index in itertools.product(*ranges):
            where = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, self.chunks, self.shape))
            part = values[tuple(slice(w.start - s.start, w.stop - s.start) for w, s in zip(where, sel))]
            if not self._keep_empty and not self._not_empty(part):
                self.array[where] = part  # zarr-python decides whether it is stored or deleted
                continue
            if part.shape != self.chunks:  # a chunk past the array's end: the rest is the fill value
                whole = np.full(self.chunks, self._fill, dtype=self.dtype)
                whole[tuple(slice(0, n) for n in part.shape)] = part
                part = whole
            if frames is not None:
                n = frames.encode(np.ascontiguousarray(part), arena[at:at + bound])
                # a view of the buffer, reused once the region's puts are done: only for stores that keep
                # no reference to what they were given (files, object stores); others get a copy
                blob: Any = arena[at:at + n] if self._reuse else arena[at:at + n].tobytes()
                at += bound
            else:
                blob = self._encode(np.ascontiguousarray(part))  # type: ignore[operator]  # not ZstdFrames here
                if self._encode is _raw and not self._reuse:
                    blob = blob.tobytes()  # the store keeps it: not a view of the region's recycled buffer
            key = meta.encode_chunk_key(index)
            key = f"{root}/{key}" if root else key
            if self._local_root is not None:  # a file, written here (no hop to zarr's loop and its thread)
                self._files.put(key, blob)
                self.direct_chunks += 1
            else:
                puts.append(store.set(key, proto.buffer.from_bytes(blob)))
        try:
            if puts:
                sync(_all(puts))  # one round trip to zarr's event loop for the region
                self.direct_chunks += len(puts)
        finally:
            if frames is not None and (self._reuse or not puts):
                self._give(arena)  # the store is done with it (or it holds copies)

    def _not_empty(self, part: np.ndarray) -> bool:
        """Whether ``part`` surely holds a value other than the fill value (zarr-python then stores it); a
        chunk for which this is not sure goes to zarr-python, whose own test decides."""
        first = part.flat[0]
        if self._nan_fill:
            return bool(first == first) or bool(np.any(part == part))  # a value that is not NaN
        # compared as values: a voxel that differs in value differs in bits (zarr compares 0.0 by its bits)
        return bool(first != self._fill) or bool(np.any(part != self._fill))


class _ChunkFiles:
    """Chunk files under ``root`` written as zarr's LocalStore writes them: parents made, a temporary file
    renamed over the chunk (a reader sees the old chunk or the new one, never part of one). Thread-safe.

    Leaner than LocalStore's per chunk, on the write threads where every call that drops the GIL waits to take
    it back: a folder made (or found) once is not made again, and the temporary names are a random prefix per
    writer and a counter instead of a fresh uuid (``os.urandom``) each. ``writeback``: each file's writeback
    is started once it is written (:func:`~.durable.start_writeback`), for a TileWriter whose marks fsync the
    files later: the disk writes a chunk while the next ones are encoded, and the fsync of a volume's last
    regions, which nothing else overlaps, waits for less.

    >>> files = _ChunkFiles("/out/pred.zarr")
    >>> files.put("c/0/0/0", frame)
    """

    def __init__(self, root: str, writeback: bool = False) -> None:
        self.root = root
        self.writeback = writeback
        self._folders: set[str] = set()  # folders known to exist (made or found here)
        self._prefix = uuid.uuid4().hex  # unique between writers, processes and hosts, as LocalStore's uuids are
        self._count = itertools.count()  # next() is atomic under the GIL

    def put(self, key: str, blob: Any) -> None:
        """Write ``blob`` (bytes or a uint8 array) as the file ``key`` (relative to the root, "/"-separated)."""
        path = os.path.join(self.root, key)
        folder = os.path.dirname(path)
        if folder not in self._folders:
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
        tmp = f"{path}.{self._prefix}{next(self._count)}.partial"
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            except FileNotFoundError:  # the folder was removed since it was made here
                os.makedirs(folder, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                view = memoryview(blob).cast("B")
                while view:  # a regular file takes it whole, save a signal or a full disk (then it raises)
                    n = os.write(fd, view)
                    if n <= 0:
                        raise OSError(f"{tmp}: write took {n} of {len(view)} bytes")
                    view = view[n:]
                if self.writeback:
                    start_writeback(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise


def _keeps_nothing(store: Any) -> bool:
    """Whether ``store.set`` is done with the buffer it was given once it returns (it writes a file, or
    uploads): then an encoder's buffer can be reused for the next region. A MemoryStore keeps it, zarr's
    or obstore's (behind zarr's ObjectStore): only files and the uploading object stores qualify."""
    from zarr.storage import LocalStore, ObjectStore

    if type(store) is LocalStore:
        return True
    if type(store) is not ObjectStore:
        return False
    import obstore.store as backends

    uploaders = tuple(getattr(backends, name) for name in ("S3Store", "GCSStore", "AzureStore", "HTTPStore",
                                                           "LocalStore") if hasattr(backends, name))
    return isinstance(getattr(store, "store", None), uploaders)


async def _all(puts: list) -> None:
    """Every put finished (failed or not) before the first error is raised: a put still running reads its
    view of the region's buffer, which goes back to the pool once this returns."""
    results = await asyncio.gather(*puts, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


__all__ = ["ChunkWriter"]
