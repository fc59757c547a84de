"""``open_array``: read boxes of a Zarr array, chunk by chunk, bit-exactly.

This is the reference read path. It is deliberately simple (one chunk at a time,
on the calling thread; an array in a store fetches a box's shard indexes, then its
chunks, in one call each, since there every call is a round trip); the batch engine
uses the same pieces (metadata, grid, shard index, codec) with its own planning and threads.

>>> arr = stoker.open_array("/data/volume.zarr")
>>> arr.shape, arr.dtype, arr.chunks, arr.shards
((256, 1024, 1024), dtype('uint16'), (32, 128, 128), None)
>>> crop = arr.read([(0, 32), (100, 228), (0, 128)])   # numpy array of shape (32, 128, 128)
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
import threading
import weakref
from typing import Any, Callable, Iterable, NamedTuple, NoReturn, Sequence

import numpy as np

from ..zarr.box import Box, box_shape, parse_box
from ..storage.cache import SizedLRU
from ..runtime.memo import remember
from ..errors import (DecodeError, InvalidArgument, MetadataError, NotFound, OutOfBounds, StorageError, UnsupportedFormat,
                      as_value)
from ..storage import ByteRange, FileChanged, FileStore, Identity, LocalStore, Store, default_store
from ..storage.hierarchy import Hierarchy
from ..storage.local import identity, refuse_irregular
from ..storage.store import get_each, get_many, stamp
from ..storage.locate import Stores, default_stores, locate
from ..zarr.fields import show
from ..zarr.grid import chunk_intersections, grid_shape
from ..zarr.metadata import ArrayMetadata, parse_json, parse_v2, parse_v3, renamed, with_document
from ..zarr.sharding import EMPTY_ENTRY, ShardingSpec
from . import metacache

DEFAULT_INDEX_CACHE_BYTES = 64 << 20
_reader_tokens = itertools.count()  # cache keys unique per reader, never reused like id()


#: Largest metadata document read. Real ones are a few KiB (attributes live elsewhere in v2, and rarely
#: reach a MiB in v3); a larger file is refused before it is read, so a hostile one costs no memory.
MAX_METADATA_BYTES = 16 << 20


def read_document(store: LocalStore, path: str, uri: str) -> bytes | None:
    """A metadata file's bytes (at most :data:`MAX_METADATA_BYTES`), or None when it does not exist."""
    got = _read_document(store, path, uri)
    return None if got is None else got[0]


def _read_document(store: LocalStore, path: str, uri: str) -> tuple[bytes, Identity | None] | None:
    """:func:`read_document`, with the file's identity once read (None when it cannot be told)."""
    f = store.open_file(path)
    if f is None:
        return None
    with f:
        if f.size > MAX_METADATA_BYTES:
            raise MetadataError(
                f"{uri}: {os.path.basename(path)} is {f.size} bytes, more than the {MAX_METADATA_BYTES} bytes "
                "stoker reads as array metadata; it is not a Zarr metadata document",
                uri=uri,
            )
        buf = bytearray(f.size)
        got = f.read_into(memoryview(buf), 0)
        try:
            after = identity(os.fstat(f.fd))
        except OSError:
            after = None
    return bytes(buf[:got]), after


def _is_index(name: str) -> bool:
    return name.isascii() and name.isdigit()


def detect_v2_separator(path: str, doc: dict, uri: str) -> str:
    """The chunk key separator of a v2 array whose ``.zarray`` does not name one.

    zarr-python before 2.8 wrote nested keys (``0/0``) without saying so in ``.zarray``; reading them as
    ``0.0`` would find no chunk and return fill values everywhere. The array's directory tells: a
    subdirectory named by an integer means ``/``, a file named like ``0.0`` (one integer per dimension)
    means ``.``. The scan stops at the first chunk file (a flat array keeps every chunk in this
    directory, so it may be huge; a nested one holds only its first axis' directories). Both kinds at
    once is a MetadataError; neither (nothing written yet) reads as ``.``.
    """
    ndim = len(doc["shape"]) if isinstance(doc.get("shape"), list) else 0
    if doc.get("dimension_separator") is not None or ndim < 2:
        return "."  # said, or one-dimensional keys (no separator in them)
    try:
        with os.scandir(path) as entries:
            return _separator_of(((e.name, e.is_dir()) for e in entries), ndim, uri,
                                 lambda name: os.path.isdir(os.path.join(path, name)))
    except OSError as exc:
        raise StorageError(f"{uri}: cannot list {path}: {exc.strerror}", path=path) from None


def _separator_of(entries: Iterable[tuple[str, bool]], ndim: int, uri: str, is_dir: Callable[[str], bool]) -> str:
    """The rule of :func:`detect_v2_separator`, over an array's ``entries`` (``(name, is a directory)``, read
    lazily: it stops at the first chunk file): a directory named by an integer means ``/``, a file named like
    ``0.0`` means ``.``, both (``is_dir`` of the file's first part, or a directory seen before it) is a
    MetadataError, neither ``.``."""
    nested = None
    for name, folder in entries:
        if folder:
            if _is_index(name):
                nested = nested or name
            continue
        parts = name.split(".")
        if len(parts) == ndim and all(_is_index(p) for p in parts):
            first = nested or (parts[0] if is_dir(parts[0]) else None)
            if first is not None:
                raise _both_layouts(uri, name, first)
            return "."
    return "/" if nested is not None else "."


def detect_store_separator(store: Store, prefix: str, doc: dict, uri: str) -> str:
    """:func:`detect_v2_separator`'s rule for the v2 array at key ``prefix`` of ``store``, from one listing of
    the array's keys, where the store lists from memory (a zip archive's member list); any other store
    (an object store lists in requests, a page per 1,000 keys of a flat array) reads with ``.``.

    Without it an array of nested keys in a zip archive read as fill values everywhere, silently, where the
    same array read from its directory read its data."""
    ndim = len(doc["shape"]) if isinstance(doc.get("shape"), list) else 0
    if doc.get("dimension_separator") is not None or ndim < 2 or not store.lists_in_memory:
        return "."
    keys, folders = store.list_dir(prefix)
    names: Sequence[str] = keys  # (Store.list_dir's annotation names its own method `list`, which mypy reads)
    subfolders: Sequence[str] = folders
    dirs = [f.rpartition("/")[2] for f in subfolders]
    entries = itertools.chain(((d, True) for d in dirs), ((k.rpartition("/")[2], False) for k in names))
    return _separator_of(entries, ndim, uri, set(dirs).__contains__)


def _both_layouts(uri: str, flat: str, nested: str) -> MetadataError:
    return MetadataError(
        f"{uri}: .zarray names no dimension_separator and the array holds both flat chunk keys ({flat!r}) and "
        f"nested ones (directory {nested!r}); add \"dimension_separator\" to .zarray to say which", uri=uri)


def read_metadata(path: str, store: LocalStore, uri: str | None = None,
                  stats: tuple[os.stat_result | None, os.stat_result | None] | None = None) -> ArrayMetadata:
    """Parse the metadata of the array at local ``path`` (v3 ``zarr.json`` first, then v2 ``.zarray``).

    A document unchanged since an earlier open is not read again (:mod:`stoker.reader.metacache`: its
    file's identity says so), and one holding the same bytes as another array's is not parsed again; a v2
    array's chunk key separator, when ``.zarray`` does not name it, is detected anew on every open (chunks
    written since may tell). ``stats``: those of ``zarr.json`` and ``.zarray``
    (:func:`~stoker.reader.metacache.stat_document`'s) its caller took just before, so that they are not
    taken twice (a pipeline keeps them to tell a rewrite: the parse it keeps is the one of those files)."""
    uri = uri or path
    folder = _folder(path)
    doc_path = folder + "zarr.json"
    before = metacache.stat_document(doc_path) if stats is None else stats[0]
    kept = metacache.lookup(doc_path, uri, before)
    if kept is not None:
        return kept
    got = _read_document(store, doc_path, uri)  # also when the stat failed: the read says why, or that it is missing
    if got is not None:
        shared = metacache.parse_of("zarr.json", got[0])
        if shared is not None:  # another array's document holds the same bytes
            meta = renamed(shared[1], uri)
        else:
            # the document kept with its parse: its attributes and dimension names are read from it
            # (stoker.reader.coords; a pipeline asks for them at each open), not from the file again
            parsed = parse_json(got[0], uri, "zarr.json")
            meta = with_document(_v3(parsed, uri), parsed)
            metacache.share_parse("zarr.json", got[0], None, meta)
        metacache.keep(doc_path, uri, before, got[1], meta, len(got[0]))
        return meta
    doc_path = folder + ".zarray"
    before = metacache.stat_document(doc_path) if stats is None else stats[1]
    kept = metacache.lookup(doc_path, uri, before)
    if kept is not None:
        meta, doc = kept
        return meta if doc is None else _v2_as_detected(meta, doc, path, uri)
    got = _read_document(store, doc_path, uri)
    if got is not None:
        shared = metacache.parse_of(".zarray", got[0])
        if shared is not None and shared[0] is None:  # another array's document holds the same bytes
            meta, doc = renamed(shared[1], uri), None
        elif shared is not None:  # the same bytes, naming no separator: this array's chunks may say another
            doc = shared[0]
            meta = _v2_as_detected(renamed(shared[1], uri), doc, path, uri)
        else:
            doc = parse_json(got[0], uri, ".zarray")
            meta = parse_v2(doc, uri, separator=detect_v2_separator(path, doc, uri))
            if doc.get("dimension_separator") is not None or meta.ndim < 2:  # the separator is the document's
                doc = None
            metacache.share_parse(".zarray", got[0], doc, meta)
        # doc: the document, kept where each open detects the separator from the chunks present
        metacache.keep(doc_path, uri, before, got[1], (meta, doc), len(got[0]))
        return meta
    if store.size(os.path.join(path, ".zgroup")) is not None:
        raise _v2_group(uri)
    raise _no_array(uri)


#: The metadata documents a user may name in place of the array's folder.
_DOCUMENTS = ("zarr.json", ".zarray", ".zattrs", ".zgroup")


def _no_array(uri: str) -> NotFound:
    """NotFound for ``uri``, where neither document exists; naming the folder to give where ``uri`` names an
    array's metadata file itself (``a.zarr/zarr.json``: a first try, whose "neither exists" misleads)."""
    head, _, name = str(uri).rstrip("/").rpartition("/")
    if name in _DOCUMENTS and head:
        return NotFound(f"{uri} is the array's metadata file: name its folder, {head}", uri=uri)
    return NotFound(f"no Zarr array at {uri} (neither zarr.json nor .zarray exists)", uri=uri)


def _folder(path: str) -> str:
    """``os.path.join(path, "")``, at a third of its cost: run for every array a pipeline opens."""
    return path + "/" if path and path[-1] != "/" else path


def _v2_as_detected(meta: ArrayMetadata, doc: dict, path: str, uri: str) -> ArrayMetadata:
    """``meta`` (parsed from ``doc``, a ``.zarray`` naming no separator) if its separator is the one this
    array's chunks say now, else ``doc`` parsed with that one."""
    separator = detect_v2_separator(path, doc, uri)
    return meta if meta.key_encoding.separator == separator else parse_v2(doc, uri, separator=separator)


def _v3(doc: dict, uri: str) -> ArrayMetadata:
    if doc.get("node_type") == "group":
        raise InvalidArgument(f"{uri} is a Zarr group, not an array; name one of its arrays", uri=uri,
                              node_type="group")
    fmt = doc.get("zarr_format")
    if fmt != 3 or isinstance(fmt, bool):
        raise MetadataError(f"{uri}: zarr.json has zarr_format {show(fmt)}, expected 3", uri=uri)
    return parse_v3(doc, uri)


def _v2_group(uri: str) -> InvalidArgument:
    return InvalidArgument(f"{uri} is a Zarr v2 group, not an array; name one of its arrays", uri=uri,
                           node_type="group")


def read_store_metadata(hierarchy: Hierarchy, prefix: str, uri: str) -> ArrayMetadata:
    """Parse the metadata of the array at key ``prefix`` of a store: from an ancestor group's consolidated
    metadata when one lists it (see :mod:`stoker.storage.hierarchy`), else its own ``zarr.json`` or
    ``.zarray``. A v2 array whose ``.zarray`` names no ``dimension_separator`` has its layout detected where
    the store lists from memory (:func:`detect_store_separator`), else reads with ``.`` (an object store
    is not listed for it)."""
    found = hierarchy.consolidated(prefix, uri)
    if found is not None:
        fmt, doc = found
        if fmt == 3:
            return _v3(doc, uri)
        if ".zarray" not in doc:
            raise _v2_group(uri)
        zarray = doc[".zarray"]
        return parse_v2(zarray, uri, separator=_store_separator(hierarchy, prefix, zarray, uri))
    join = (lambda name: f"{prefix}/{name}") if prefix else (lambda name: name)
    own = hierarchy.first([join("zarr.json"), join(".zarray")], uri)
    if own is not None:
        key, raw = own
        if key.endswith("zarr.json"):
            # a document holding the same bytes as one parsed before (another array's of the dataset, or this
            # one's at an earlier open: a new pipeline opens each of its arrays afresh) is not parsed again,
            # as read_metadata does for local files
            shared = metacache.parse_of("zarr.json", raw)
            if shared is not None:
                return renamed(shared[1], uri)
            doc = parse_json(raw, uri, "zarr.json")
            meta = with_document(_v3(doc, uri), doc)  # its attributes: a request spared (reader.coords)
            metacache.share_parse("zarr.json", raw, None, meta)
            return meta
        zarray = parse_json(raw, uri, ".zarray")
        meta = parse_v2(zarray, uri, separator=_store_separator(hierarchy, prefix, zarray, uri))
        return with_document(meta, zarray)  # its stored fill value: a request spared (reader.coords)
    if hierarchy.exists(join(".zgroup")):
        raise _v2_group(uri)
    raise _no_array(uri)


def _store_separator(hierarchy: Hierarchy, prefix: str, doc: Any, uri: str) -> str:
    """The separator of a v2 ``.zarray`` ``doc`` read from a store; a document that is not a JSON object is
    left to :func:`parse_v2` to refuse."""
    return detect_store_separator(hierarchy.store, prefix, doc, uri) if isinstance(doc, dict) else "."


class ChunkLocation(NamedTuple):
    """Where a read chunk is stored (see :meth:`ArrayReader.locate`)."""

    key: str  # "c/0/1", or "c/0/0[3]" for inner chunk 3 of the shard at "c/0/0"
    path: str | None  # the file (a store that is not local: the store's key); None: nothing stored (the fill value)
    offset: int | None = None  # an inner chunk's byte range in ``path``; None: the whole file
    length: int | None = None
    ident: Identity | None = None  # an inner chunk's: the shard file its index was read from


class ShardIndex(NamedTuple):
    """A shard's decoded ``(n_inner, 2)`` index and the :data:`~stoker.storage.Identity` of the file it
    was read from: its offsets hold in that file only (an index read through a local store: the generation
    that store reports, the file's identity). An index read through any other store has an identity of
    its own, ``(0, reader token, 0, generation stamp, 0)``: the :func:`~stoker.storage.store.stamp` of the
    generation of the shard value it was read from (0: the store cannot tell), checked by
    :func:`same_generation` against every range read of the shard's chunks."""

    table: np.ndarray
    ident: Identity


def _is_stamped(ident: Identity) -> bool:
    """Whether a :class:`ShardIndex` identity is a stamped generation, not a file's :data:`Identity` (a file an
    index was read from is never empty, so its size is never 0)."""
    return ident[0] == 0 and ident[2] == 0


class ArrayReader:
    """One Zarr array, opened for reading. Create with :func:`open_array`.

    Every array is read by key through one store ``kv``: ``path`` is the array's key prefix there. A local
    array's store is a :class:`~stoker.storage.FileStore` rooted at its directory (``path`` is ``""``),
    which declares ``is_local``: its keys are files, whose paths :meth:`file_path` and :meth:`locate` name
    (what the compiled engine reads itself), and the generations it reports are the files' identities. For
    an array in another store (an object store, a zip archive) they name keys (:meth:`key_of` is the key).
    """

    def __init__(
        self,
        metadata: ArrayMetadata,
        path: str,
        kv: Store,
        index_cache: SizedLRU | None = None,
    ) -> None:
        self.metadata = metadata
        self.path = path
        self.kv = kv
        self._keys = f"{path}/" if path else ""  # the array's key prefix in kv, with its separator
        # where file_path puts a key (one concatenation): under the store's root if its keys are files
        self._dir = _folder(kv.root) + self._keys if kv.is_local else self._keys
        # "is None", not "or": an empty SizedLRU is falsy, and a pipeline hands every reader its shared one
        if index_cache is None:
            index_cache = SizedLRU(DEFAULT_INDEX_CACHE_BYTES, index_size)
        self._index_cache = index_cache
        self._token = next(_reader_tokens)
        # what other modules derive from the array's documents, once per reader (its metadata never changes), by
        # key: reader/coords.py's attributes, CF coding (asked several times a batch by the planner) and
        # coordinates, a pipeline's identities of the metadata files it was opened from
        # (Coordinator.forget_rewritten) and its batch dtypes; the one memo per reader, gone with it
        self.derived: dict[Any, Any] = {}
        # shard indexes being read, or queued to be read ahead (start_shard_entries): key -> its flight, for a
        # planner's read to wait for (started) or take over (queued)
        self._index_flights: dict[str, _Flight] = {}
        self._flights_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        if metadata.sharding is not None:
            check_index_fits(metadata.sharding, self._index_cache.max_bytes, metadata.uri)
            if not kv.is_local:
                _SHARDED_REMOTE.add(self)  # its flights forgotten in a forked child (_after_fork_in_child)

    def file_path(self, key: str) -> str:
        """The local file holding chunk (or shard) ``key``; for an array in a store whose keys are not files,
        the store's key."""
        return self._dir + key

    def key_of(self, path: str) -> str:
        """The store key of what :meth:`file_path` (or :meth:`locate`) names ``path``."""
        return path if self._dir is self._keys else self._keys + path[len(self._dir):]

    # -- what the array is ------------------------------------------------------------------

    @property
    def uri(self) -> str:
        return self.metadata.uri

    @property
    def shape(self) -> tuple[int, ...]:
        return self.metadata.shape

    @property
    def ndim(self) -> int:
        return self.metadata.ndim

    @property
    def dtype(self) -> np.dtype:
        """Element type in native byte order (what reads return)."""
        return self.metadata.dtype

    @property
    def chunks(self) -> tuple[int, ...]:
        """The unit that is decoded: the inner chunk when sharded."""
        return self.metadata.read_chunk_shape

    @property
    def shards(self) -> tuple[int, ...] | None:
        return self.metadata.chunk_shape if self.metadata.sharding else None

    @property
    def fill_value(self) -> Any:
        return self.metadata.fill_value[()]

    @property
    def zarr_format(self) -> int:
        return self.metadata.zarr_format

    def __repr__(self) -> str:
        shards = f", shards={self.shards}" if self.shards else ""
        return f"ArrayReader({self.uri!r}, shape={self.shape}, dtype={self.dtype}, chunks={self.chunks}{shards})"

    # -- reading ----------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> np.ndarray:
        """numpy's basic indexing: slices of step 1 (negative and open ends as numpy has them), integers
        (which drop their axis), ``...``, and fewer indices than axes (the rest whole).

        >>> arr[0:32, 100:228, :].shape
        (32, 128, 512)
        >>> arr[5, ...].shape            # one plane
        (512, 512)
        """
        box, dropped = _basic_index(key, self.shape, self.uri)
        out = self.read(box)
        return out.reshape([n for axis, n in enumerate(out.shape) if axis not in dropped])

    def read(self, aabb: Any) -> np.ndarray:
        """Read the half-open box ``aabb`` (``(start, stop)`` pairs or slices) as a new array: the stored values,
        as zarr-python reads them (CF attributes are not applied here; the pipeline applies them, and
        ``stoker.reader.coords.coding(arr).decode(values)`` does)."""
        box = parse_box(aabb, self.shape, uri=self.uri)
        shape = box_shape(box)
        try:
            out = np.empty(shape, dtype=self.dtype)
        except (MemoryError, ValueError) as exc:  # ValueError: numpy's "array is too big"
            nbytes = math.prod(shape) * self.dtype.itemsize
            raise InvalidArgument(f"{self.uri}: the box {box} needs {nbytes:,} bytes, more than this process can "
                                  f"allocate ({exc}); read it in smaller boxes", uri=self.uri) from None
        self.read_into(box, out)
        return out

    def read_into(self, box: Box, out: np.ndarray) -> None:
        """Fill ``out`` (shaped like ``box``) with the box's data, casting to ``out.dtype`` if needed.

        The box's shard indexes not cached are read together (see
        :func:`shard_entries`), then its chunks fetched by one ``get_many`` call per
        :data:`STORE_READ_BYTES` (whole values and inner chunks' ranges, which the store merges per object),
        each call's chunks decoded before the next is fetched."""
        meta = self.metadata
        pieces = list(chunk_intersections(box, self.chunks))
        if meta.sharding is not None:
            shards = list({meta.chunk_key(meta.sharding.inner_position(p.index)[0]): None for p in pieces})
            for entry in shard_entries([(self, key) for key in shards]):
                if isinstance(entry, BaseException):
                    raise entry  # the first in the box's order (locate would raise it too)
        group: list = []
        cost = 0
        for piece in pieces:
            loc = self.locate(piece.index)
            if loc.path is None:
                out[piece.box_sel] = meta.fill_value
                continue
            n = meta.codec.nbytes if loc.length is None else loc.length  # a whole value: its decoded size
            if group and cost + n > STORE_READ_BYTES:
                self._fetch_into(group, out)
                group, cost = [], 0
            group.append((piece, loc))
            cost += n
        if group:
            self._fetch_into(group, out)

    def _fetch_into(self, group: list, out: np.ndarray) -> None:
        """Fetch ``(piece, location)``s in one store call, then decode each into ``out``."""
        whole = [(p, loc) for p, loc in group if loc.offset is None]
        ranged = [(p, loc) for p, loc in group if loc.offset is not None]
        self._refuse_oversized([loc for _, loc in whole])
        values, parts = self._fetch_checked([self.key_of(loc.path) for _, loc in whole],
                                            [(p.index, loc) for p, loc in ranged])
        codec = self.metadata.codec
        for (piece, loc), data in itertools.chain(zip(whole, values), zip(ranged, parts)):
            if data is None:  # a chunk not stored: the fill value
                if loc.offset is None:
                    self._no_value(loc)
                out[piece.box_sel] = self.metadata.fill_value
                continue
            if loc.offset is None:
                codec.check_stored_size(len(data), loc.key)
            out[piece.box_sel] = codec.decode(data, loc.key)[piece.chunk_sel]

    def _no_value(self, loc: ChunkLocation) -> None:
        """A chunk file its store holds no value for: the fill value, unless (a local array) something other
        than a regular file is at its path: a directory reads as no value in a store (as in zarr-python), where
        the engine refuses it (``ST_NOT_REGULAR``): :func:`~stoker.storage.local.not_regular`'s StorageError, the
        same on every path that reads chunks through this reader (the GPU decode's fallback fetch, records)."""
        if self.kv.is_local:
            refuse_irregular(loc.path)

    def _refuse_oversized(self, whole: list[ChunkLocation]) -> None:
        """Local chunk files larger than the codecs can write are refused by their size before a byte is read
        (a sparse file of 3 GiB costs a stat, not 3 GiB; a missing one is left to the read: the fill value).
        An object store's values are bounded as they are fetched (``max_value_bytes``), where asking each
        size first would cost a request per chunk."""
        if not self.kv.is_local:
            return
        for loc in whole:
            try:
                size = self.kv.size(self.key_of(loc.path))
            except NotFound:
                continue
            self.metadata.codec.check_stored_size(size, loc.key)

    def _fetch_checked(self, keys: list[str], ranged: list[tuple[tuple[int, ...], ChunkLocation]]) -> tuple[list, list]:
        """:func:`fetch_stored` of this array's chunks."""
        return fetch_stored(self.kv, keys, [(self, index, loc) for index, loc in ranged])

    def read_chunk(self, index: tuple[int, ...]) -> np.ndarray | None:
        """Decoded read chunk at grid ``index`` (a view, maybe strided), or ``None`` for fill."""
        key, encoded = self.encoded_chunk(index)
        return None if encoded is None else self.metadata.codec.decode(encoded, key)

    def locate(self, index: tuple[int, ...]) -> ChunkLocation:
        """Where read chunk ``index`` is stored: its file, and for an inner chunk of a shard its byte range
        (from the shard's cached index). A missing shard or an empty inner chunk has no file (fill value);
        a missing chunk file is found only when it is read.

        >>> arr.locate((0, 1, 1))
        ChunkLocation(key='c/0/0/0[3]', path='/data/a.zarr/c/0/0/0', offset=1024, length=4096)
        """
        meta = self.metadata
        if meta.sharding is None:
            key = meta.chunk_key(index)
            return ChunkLocation(key, self.file_path(key))
        shard_index, inner = meta.sharding.inner_position(index)
        shard_key = meta.chunk_key(shard_index)
        key = f"{shard_key}[{inner}]"
        entry = self._shard_entry(shard_key)
        if entry is None:
            return ChunkLocation(key, None)
        table = entry.table
        offset, length = table.item(inner, 0), table.item(inner, 1)  # Python ints, without a row view
        if offset == length == EMPTY_ENTRY:
            return ChunkLocation(key, None)
        meta.codec.check_stored_size(length, key)  # before anyone reads or reserves room for it
        return ChunkLocation(key, self.file_path(shard_key), offset, length, entry.ident)

    def relocate(self, index: tuple[int, ...], stale: Identity) -> ChunkLocation:
        """:meth:`locate` again after a read found the shard of chunk ``index`` changed since its index
        (read from a file of identity ``stale``) was cached: that index is dropped and read anew, unless
        another thread did so already."""
        shard_index, _ = self.metadata.sharding.inner_position(index)
        self._index_cache.discard((self._token, self.metadata.chunk_key(shard_index)),
                                  lambda entry: entry is None or entry.ident == stale)
        return self.locate(index)

    def encoded_chunk(self, index: tuple[int, ...]) -> tuple[str, Any]:
        """``(key, stored bytes or None)`` of read chunk ``index``; ``None`` means fill value."""
        loc = self.locate(index)
        if loc.path is None:
            return loc.key, None
        return loc.key, self._get_stored(index, loc)

    def _get_stored(self, index: tuple[int, ...], loc: ChunkLocation):
        """A chunk read through the store: a whole value (None when missing: the fill value) or an inner
        chunk's range (checked against its index's generation: see :meth:`_fetch_checked`)."""
        if loc.offset is None:
            self._refuse_oversized([loc])
            try:
                data = self.kv.get(self.key_of(loc.path))
            except NotFound:
                self._no_value(loc)
                return None
            self.metadata.codec.check_stored_size(len(data), loc.key)
            return data
        return self._fetch_checked([], [(index, loc)])[1][0]

    def shard_changed(self, key: str) -> DecodeError:
        """The error for a shard that changed again after its index was read anew."""
        return DecodeError(f"{self.uri}: the shard holding chunk {key!r} changed while it was read (it was "
                           "rewritten again after its index was read anew); read it once writing has finished",
                           uri=self.uri, key=key)

    def shard_index(self, shard_key: str) -> np.ndarray | None:
        """Decoded ``(n_inner, 2)`` index of a shard (cached), or ``None`` when the shard file is missing."""
        entry = self._shard_entry(shard_key)
        return None if entry is None else entry.table

    def shard_entry(self, shard_key: str) -> ShardIndex | None:
        """A shard's cached index with the identity of the file it was read from (read, checked and cached on
        first use), or ``None`` when the shard file is missing."""
        return self._shard_entry(shard_key)

    def cached_shard_entries(self, shard_keys: Sequence[str]) -> list:
        """Each shard's cached :class:`ShardIndex` (or None: no shard file), :data:`NOT_CACHED` where the cache
        holds none: one look-up for them all, as a planner asks for a batch's shards together (read the
        missing ones with :func:`shard_entries`)."""
        token = self._token
        return self._index_cache.get_many([(token, key) for key in shard_keys], NOT_CACHED)

    def shard_keys(self, numbers: Sequence[int]) -> list[str]:
        """The keys of the shards numbered ``numbers`` in C order over the shard grid (see
        :attr:`shard_grid`), each kept once made (in a table bounded for the whole process): a planner names
        every shard of a batch, every batch.

        >>> arr.shard_keys([0, 5])
        ['c/0/0/0', 'c/0/1/1']
        """
        made, token = _SHARD_KEYS, self._token
        keys: list = [made.get((token, n)) for n in numbers]
        if None in keys:
            grid, key = self.shard_grid, self.metadata.chunk_key
            for at, n in enumerate(numbers):
                if keys[at] is None:  # bounded for the process: past it, start afresh
                    keys[at] = remember(made, (token, n), key(tuple(int(v) for v in np.unravel_index(n, grid))),
                                        _MAX_KEPT_KEYS)
        return keys

    @property
    def shard_grid(self) -> tuple[int, ...]:
        """Shards along each axis (of a sharded array)."""
        return grid_shape(self.metadata.shape, self.metadata.chunk_shape)

    def _shard_entry(self, shard_key: str) -> ShardIndex | None:
        return self._index_cache.get_or_load((self._token, shard_key), lambda: self._load_shard_index(shard_key))

    def _load_shard_index(self, shard_key: str, attempts: int = 3) -> ShardIndex | None:
        """A shard's index read through the store by one range (see :meth:`_index_range`). A file read while
        it changed (its generation before and after the read differ) is read again, ``attempts`` times."""
        for _ in range(attempts):
            out, generations = get_each(self.kv, [self._index_range(shard_key)], versions=True)
            if isinstance(out[0], NotFound):
                if self.kv.is_local:  # a directory there is no value to the store, but no missing shard
                    refuse_irregular(self.file_path(shard_key))
                return None
            if isinstance(out[0], (StorageError, FileChanged)):
                raise self.index_error(shard_key, out[0])
            if isinstance(out[0], Exception):
                raise out[0]
            if not self.kv.is_local:
                return self._stored_index(shard_key, out[0], generations[0])
            if is_identity(generations[0]):  # a file's: what the compiled engine checks the file against
                ident = generations[0]
                spec = self.metadata.sharding
                return ShardIndex(spec.decode_index(out[0], self.uri, shard_key, ident[2]), ident)
        raise self.index_error(shard_key, FileChanged(f"{self.file_path(shard_key)} kept changing while read"))

    def read_error(self, exc: BaseException) -> BaseException:
        """What a failed store read of this array's chunks means: a range past the end of one of its shard
        values (the store knows the value's size) is a shard shorter than its index claims, corrupt data (the
        DecodeError a local read gives); anything else is the store's error as it came."""
        if not isinstance(exc, StorageError) or not self.raised_by_my_store(exc):
            return exc
        key, size = exc.context.get("key"), exc.context.get("value_size")
        below = exc.context.get("value_below")  # a range past the value's end (416): its size is under this
        if self.metadata.sharding is None or (size is None and below is None) or not isinstance(key, str) or \
                not key.startswith(self._keys):
            return exc
        shard_key = key[len(self._keys):]
        held = f"{size} bytes" if size is not None else f"fewer than {below} bytes"
        return DecodeError(f"{self.uri}: shard {shard_key!r} is shorter than its index claims: the store holds "
                           f"{held} of it ({exc})", uri=self.uri, key=shard_key)

    def raised_by_my_store(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a StorageError of the store this array is read from (it names its URI)."""
        return isinstance(exc, StorageError) and exc.context.get("uri") == self.kv.uri

    def index_error(self, shard_key: str, exc: Exception) -> Exception:
        """The error for a shard whose index read through the store failed with ``exc``: a shard shorter than
        its index is corrupt data, as is a file that kept changing while read; anything else the store's
        error."""
        if isinstance(exc, FileChanged):
            return DecodeError(f"{self.uri}: shard {shard_key!r} kept changing while its index was read; read it "
                               "once writing has finished", uri=self.uri, key=shard_key)
        size = exc.context.get("value_size") if isinstance(exc, StorageError) else None
        need = self.metadata.sharding.index_nbytes
        if size is None or size >= need:
            return exc
        return DecodeError(f"{self.uri}: shard {shard_key!r} is truncated: {size} bytes, but its index alone needs "
                           f"{need}", uri=self.uri, key=shard_key)

    def _index_range(self, shard_key: str) -> ByteRange:
        """The range of a stored shard holding its index: a suffix when it ends the shard, so the shard's size
        is not needed (a shard whose entries reach past its end fails when they are read)."""
        spec = self.metadata.sharding
        key = self._keys + shard_key
        return ByteRange.suffix(key, spec.index_nbytes) if spec.index_location == "end" else \
            ByteRange(key, 0, spec.index_nbytes)

    def _stored_index(self, shard_key: str, raw, generation: Any = None) -> ShardIndex:
        """The index ``raw`` read at ``generation`` of the shard: an identity per reader and generation (see
        :class:`ShardIndex`), so neither readers' nor generations' shards ever mix."""
        table = self.metadata.sharding.decode_index(raw, self.uri, shard_key, None)
        return ShardIndex(table, (0, self._token, 0, stamp(generation), 0))

    def _cached_index(self, shard_key: str, entry: ShardIndex | None) -> ShardIndex | None:
        """``entry`` cached as ``shard_key``'s index (unless another thread cached one first: that one)."""
        return self._index_cache.get_or_load((self._token, shard_key), lambda: entry)

    def _is_cached(self, shard_key: str) -> bool:
        return (self._token, shard_key) in self._index_cache


def raise_read_error(readers: Iterable[ArrayReader], exc: BaseException) -> NoReturn:
    """Raise what the failed store read ``exc`` of chunks of ``readers`` means (:meth:`ArrayReader.read_error`
    of the array whose shard it read; the store's error itself otherwise). Call it inside an ``except``."""
    # the array whose folder holds the key, in the store that raised: the deepest, should folders nest
    mine = [r for r in {id(r): r for r in readers}.values() if r.read_error(exc) is not exc]
    if mine:
        raise max(mine, key=lambda r: len(r._keys)).read_error(exc) from exc
    raise exc


def fetch_stored(kv: Store, keys: Sequence[str],
                 ranged: Sequence[tuple[ArrayReader, tuple[int, ...], ChunkLocation]]) -> tuple[list, list]:
    """Whole values of ``keys`` (None: missing) and the bytes of the inner chunks ``(reader, index, location)``
    of arrays read through ``kv``, in one store call. An inner chunk whose range came from another generation
    of its shard than its index, or whose shard is now gone or shorter, is located again in the shard's
    index read anew (:meth:`ArrayReader.relocate`) and fetched once more (None: now the fill value); changed
    again, :meth:`ArrayReader.shard_changed`. Never bytes of one version located by the index of another.

    >>> values, parts = fetch_stored(arr.kv, [], [(arr, (0, 1), arr.locate((0, 1)))])
    """
    readers = [reader for reader, _, _ in ranged]
    try:
        values, parts, _, versions = get_many(kv, keys, [ByteRange(reader.key_of(loc.path), loc.offset, loc.length)
                                                         for reader, _, loc in ranged],
                                              versions=True, lenient=range(len(ranged)))
    except StorageError as exc:
        raise_read_error(readers, exc)
    stale = [k for k, ((_, _, loc), data, version) in enumerate(zip(ranged, parts, versions))
             if isinstance(data, Exception) or not same_generation(loc.ident, version)]
    if not stale:
        return values, parts
    parts = list(parts)
    moved = [(k, ranged[k][0].relocate(ranged[k][1], ranged[k][2].ident)) for k in stale]
    for k, _ in moved:
        parts[k] = None  # empty in the new shard, or the shard is gone: the fill value
    again = [(k, loc) for k, loc in moved if loc.path is not None]
    try:
        _, got, _, got_versions = get_many(kv, [], [ByteRange(ranged[k][0].key_of(loc.path), loc.offset, loc.length)
                                                    for k, loc in again], versions=True)
    except StorageError as exc:  # read anew, a range past its shard's end: that array's DecodeError
        raise_read_error(readers, exc)
    for (k, loc), data, version in zip(again, got, got_versions):
        if not same_generation(loc.ident, version):
            raise ranged[k][0].shard_changed(loc.key)
        parts[k] = data
    return values, parts


def same_generation(ident: Identity | None, generation: Any) -> bool:
    """Whether a range read through a store at ``generation`` (None: the store cannot tell) may be decoded as
    located by a shard index of identity ``ident`` (a :class:`ShardIndex`'s): the same generation of the
    shard value, or one of the two unknown. A shard file's index (read through a store that is local) holds
    the file's identity, which is its generation: the range's must be that very one."""
    if ident is None:
        return True
    if not _is_stamped(ident):
        return generation == ident
    if generation is None or not ident[3]:
        return True
    return stamp(generation) == ident[3]


def is_identity(generation: Any) -> bool:
    """Whether a generation a local store reported is a file's :data:`~stoker.storage.Identity` (the same
    before and after the read), not a file that changed while read."""
    return isinstance(generation, tuple) and len(generation) == 5 and all(isinstance(v, int) for v in generation)


#: What :meth:`ArrayReader.cached_shard_entries` gives for a shard whose index is not cached.
NOT_CACHED = type("NotCached", (), {"__repr__": lambda self: "NOT_CACHED"})()
#: Shard keys made by ArrayReader.shard_keys, by (reader token, shard number): at most _MAX_KEPT_KEYS for the
#: whole process (about 200 bytes each), however many arrays are open.
_SHARD_KEYS: dict[tuple[int, int], str] = {}
_MAX_KEPT_KEYS = 1 << 14
_UNREAD = object()
#: Encoded bytes one store call of :meth:`ArrayReader.read` fetches at most (whole values counted at their
#: codec's decoded size): a large box is read in several calls, each decoded before the next is fetched.
STORE_READ_BYTES = 64 << 20


#: The longest a read of shard indexes waits for the same indexes read by another thread (read ahead:
#: :func:`start_shard_entries`) before reading them itself: that read is bounded by its store's limits.
FLIGHT_WAIT_S = 60.0

#: The share of the index cache (its max_bytes) that indexes read ahead and not yet landed may weigh: the rest
#: keeps the indexes of the batches about to be planned from being evicted by those of the batches after them.
AHEAD_SHARE = 0.5


class _Flight:
    """One shard index being read, or queued to be read ahead. ``started`` once a thread reads it: the read
    ahead's job, or a planner that took it over while it was queued (``claim``); only the thread that started
    it lands it (``done`` set, the flight dropped), and only a started read is waited for. ``nbytes``: what a
    read ahead reserved of its index cache's :data:`AHEAD_SHARE` (0 for a planner's own read)."""

    __slots__ = ("reader", "shard_key", "done", "started", "nbytes")

    def __init__(self, reader: ArrayReader, shard_key: str, started: bool, nbytes: int = 0) -> None:
        self.reader, self.shard_key, self.nbytes = reader, shard_key, nbytes
        self.done: concurrent.futures.Future = concurrent.futures.Future()
        self.started = started


# remote sharded readers, whose flights a forked child forgets; index cache (id) -> bytes reserved ahead
_SHARDED_REMOTE: weakref.WeakSet = weakref.WeakSet()
_ahead_bytes: dict[int, int] = {}
_ahead_lock = threading.Lock()  # a leaf, taken under a reader's _flights_lock


def _after_fork_in_child() -> None:
    """A forked child's readers forget the parent's flights (reads by threads the child has not: waiting for
    them would wait :data:`FLIGHT_WAIT_S` for nothing) and their locks, perhaps held by such a thread."""
    global _ahead_lock
    _ahead_lock = threading.Lock()
    _ahead_bytes.clear()
    for reader in list(_SHARDED_REMOTE):
        reader._flights_lock = threading.Lock()
        reader._index_flights = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _reserve(reader: ArrayReader) -> int:
    """Bytes of ``reader``'s index cache reserved for one index read ahead (what index_size weighs it at), 0
    when the reads ahead already reserve its :data:`AHEAD_SHARE`: that index is then read by its batch."""
    spec = reader.metadata.sharding
    cost = 16 * spec.n_inner + 64 if spec is not None else 64
    cache = reader._index_cache
    with _ahead_lock:
        held = _ahead_bytes.get(id(cache), 0)
        if held + cost > cache.max_bytes * AHEAD_SHARE:
            return 0
        _ahead_bytes[id(cache)] = held + cost
    return cost


def _release(flight: _Flight) -> None:
    if flight.nbytes:
        key = id(flight.reader._index_cache)
        with _ahead_lock:
            left = _ahead_bytes.get(key, 0) - flight.nbytes
            if left > 0:
                _ahead_bytes[key] = left
            else:
                _ahead_bytes.pop(key, None)


def start_shard_entries(wanted: Sequence[tuple[ArrayReader, str]], run: Callable[[Callable[[], None]], None]) -> int:
    """Start reading the indexes of the ``wanted`` shards (``(reader, shard key)``) of arrays in stores that
    are neither cached nor being read already, as :func:`shard_entries` reads them (one round trip per store),
    on the thread ``run(fn)`` gives ``fn``; never waits. A :func:`shard_entries` asking for one of them
    meanwhile waits for this read once it has started, and reads it itself while it is still queued (this
    read then skips it). At most :data:`AHEAD_SHARE` of an index cache is read ahead at a time: the rest are
    left to their batches. Returns how many were started. What this read met (an error, a corrupt index) is
    not kept: the batch that needs the shard reads it again and raises it then. A ``run`` that refuses (a
    closed pool) starts nothing.

    >>> start_shard_entries([(reader, "c/0/1/1")], pool.submit)   # its batch's planning waits for it, once
    1
    """
    queued: list[_Flight] = []
    for reader, shard_key in wanted:
        if not reader.kv.is_local and not reader._is_cached(shard_key):
            with reader._flights_lock:
                if shard_key in reader._index_flights:
                    continue
                nbytes = _reserve(reader)
                if not nbytes:
                    break  # the cache's share read ahead: the rest are read by their batches
                flight = reader._index_flights[shard_key] = _Flight(reader, shard_key, False, nbytes)
            queued.append(flight)
    if not queued:
        return 0

    def read() -> None:
        mine = _claim(queued)  # those no planner took over meanwhile
        try:
            if mine:
                _read_indexes([(f.reader, f.shard_key) for f in mine])
        except Exception:  # noqa: BLE001 - (a shard's error comes back in its place) read again by its batch
            pass
        finally:
            _landed(mine)

    try:
        run(read)
    except BaseException:  # noqa: BLE001 - no thread: nothing read ahead, each batch reads its own
        _landed(_claim(queued))
        return 0
    return len(queued)


def _claim(flights: list[_Flight]) -> list[_Flight]:
    """Those of ``flights`` not started yet, now started by the caller (who must land them)."""
    mine = []
    for flight in flights:
        with flight.reader._flights_lock:
            if not flight.started:
                flight.started = True
                mine.append(flight)
    return mine


def _landed(flights: list[_Flight]) -> None:
    """The reads of ``flights`` are over (their indexes cached, or not: a failure): their waiters wake."""
    for flight in flights:
        reader = flight.reader
        with reader._flights_lock:
            if reader._index_flights.get(flight.shard_key) is flight:
                del reader._index_flights[flight.shard_key]
        _release(flight)
        flight.done.set_result(None)


def shard_entries(wanted: Sequence[tuple[ArrayReader, str]]) -> list[ShardIndex | None | Exception]:
    """:meth:`ArrayReader.shard_entry` of every ``(reader, shard key)``, with the error reading one met in its
    place (raised by the caller for the first chunk it concerns, as the serial reads would have).

    The indexes not cached in arrays in stores are read together, one round trip per store (stores of theirs
    are read at once, a thread each), so a cold batch touching N shards waits one round trip, not N. Each is
    decoded and checked as :meth:`~ArrayReader.shard_entry` does, and cached (a missing shard as None).
    Arrays in a local store (files, read by positional reads, no round trip to wait) read their indexes one
    after the other, through the cache. An index another thread has started reading (ahead:
    :func:`start_shard_entries`, or a planner's) is waited for (at most :data:`FLIGHT_WAIT_S`), not asked
    again; one queued to be read ahead is taken over and read here (never waiting behind the queue); one that
    read did not bring is read here, and every index read here is marked as being read meanwhile."""
    out: list = [_UNREAD] * len(wanted)
    mine: dict[tuple[int, str], _Flight] = {}
    waits: list[tuple[int, concurrent.futures.Future]] = []  # (position, another thread's read of it)
    read: list[int] = []
    try:
        for i, (reader, shard_key) in enumerate(wanted):
            if reader.kv.is_local or reader._is_cached(shard_key) or (id(reader), shard_key) in mine:
                read.append(i)
                continue
            with reader._flights_lock:
                flight = reader._index_flights.get(shard_key)
                if flight is None:
                    flight = reader._index_flights[shard_key] = _Flight(reader, shard_key, True)
                elif flight.started:
                    waits.append((i, flight.done))
                    continue
                else:  # queued behind other work: taken over, read here; the queued job skips it
                    flight.started = True
                mine[(id(reader), shard_key)] = flight
                read.append(i)
        for i, entry in zip(read, _read_indexes([wanted[i] for i in read]) if read else ()):
            out[i] = entry
    finally:
        _landed(list(mine.values()))
    if waits:
        concurrent.futures.wait([flight for _, flight in waits], timeout=FLIGHT_WAIT_S)
        again = []
        for i, _ in waits:
            reader, shard_key = wanted[i]
            entry = reader.cached_shard_entries([shard_key])[0]
            if entry is NOT_CACHED:  # that read failed, or is late: read here (its error raised here)
                again.append(i)
            else:
                out[i] = entry
        for i, entry in zip(again, _read_indexes([wanted[i] for i in again]) if again else ()):
            out[i] = entry
    return out


def _read_indexes(wanted: Sequence[tuple[ArrayReader, str]]) -> list[ShardIndex | None | Exception]:
    """:func:`shard_entries`' reads, whatever other threads read meanwhile."""
    out: list = [_UNREAD] * len(wanted)
    by_store: dict[int, tuple[Store, list[int]]] = {}
    for i, (reader, shard_key) in enumerate(wanted):
        if not reader.kv.is_local and not reader._is_cached(shard_key):
            by_store.setdefault(id(reader.kv), (reader.kv, []))[1].append(i)
        else:
            try:
                out[i] = reader.shard_entry(shard_key)
            except Exception as exc:  # noqa: BLE001 - returned in its place
                out[i] = as_value(exc)

    def load(kv: Store, numbers: list[int]) -> None:
        firsts: dict[tuple[int, str], int] = {}  # a shard asked twice is read once
        for i in numbers:
            firsts.setdefault((id(wanted[i][0]), wanted[i][1]), i)
        asked = list(firsts.values())
        try:
            got, generations = get_each(kv, [wanted[i][0]._index_range(wanted[i][1]) for i in asked], versions=True)
        except Exception as exc:  # noqa: BLE001 - the store failed as a whole (closed...): every shard's error
            got, generations = [as_value(exc)] * len(asked), [None] * len(asked)
        for i, raw, generation in zip(asked, got, generations):
            reader, shard_key = wanted[i]
            if isinstance(raw, NotFound):
                out[i] = reader._cached_index(shard_key, None)
            elif isinstance(raw, Exception):
                out[i] = reader.index_error(shard_key, raw)
            else:
                try:
                    out[i] = reader._cached_index(shard_key, reader._stored_index(shard_key, raw, generation))
                except Exception as exc:  # noqa: BLE001 - a corrupt index: this shard's error
                    out[i] = as_value(exc)
        for i in numbers:
            out[i] = out[firsts[(id(wanted[i][0]), wanted[i][1])]]

    def guarded(kv: Store, numbers: list[int]) -> None:
        try:
            load(kv, numbers)
        except BaseException as exc:  # noqa: BLE001 - never an unread index taken for a missing shard
            for i in numbers:
                if out[i] is _UNREAD:
                    out[i] = as_value(exc)

    groups = list(by_store.values())
    if len(groups) == 1:
        load(*groups[0])
    elif groups:
        threads = [threading.Thread(target=guarded, args=group, name="stoker-indexes", daemon=True)
                   for group in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # bounded: every store request has its own time limit
    return out


def _basic_index(key: Any, shape: tuple[int, ...], uri: str) -> tuple[list[tuple[int, int]], set[int]]:
    """The box numpy's basic index ``key`` selects in an array of ``shape``, and the axes integers drop."""
    items = list(key) if isinstance(key, tuple) else [key]
    if sum(item is Ellipsis for item in items) > 1:
        raise InvalidArgument(f"{uri}: an index can hold one '...', got {key!r}", uri=uri)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        raise InvalidArgument(f"{uri}: {len(items)} indices for an array of {len(shape)} axes (shape {shape})",
                              uri=uri)
    items += [slice(None)] * (len(shape) - len(items))
    box, dropped = [], set()
    for axis, (item, n) in enumerate(zip(items, shape)):
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            if step != 1:
                raise InvalidArgument(f"{uri}: axis {axis}: slice step must be 1, got {item.step!r}; read the box "
                                      "and step the result", uri=uri, axis=axis)
            box.append((start, max(start, stop)))
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            i = int(item) + (n if item < 0 else 0)
            if not 0 <= i < n:
                raise OutOfBounds(f"{uri}: axis {axis}: index {int(item)} is outside 0..{n - 1}", uri=uri, axis=axis)
            box.append((i, i + 1))
            dropped.add(axis)
        else:
            raise InvalidArgument(f"{uri}: axis {axis}: an index must be a slice, an integer or '...', got "
                                  f"{item!r} (arrays of indices are not read: read the box around them)",
                                  uri=uri, axis=axis)
    return box, dropped


def index_size(entry: ShardIndex | None) -> int:
    """Bytes a cached shard index costs (``None``, a missing shard, costs a little too)."""
    return 64 if entry is None else entry.table.nbytes + 64


def check_index_fits(spec: ShardingSpec, capacity: int, uri: str) -> None:
    """UnsupportedFormat when one shard's index would not fit the index cache (``capacity`` bytes).

    Checked when the array is opened, before any shard is read: such an index would be read and
    decoded whole for every chunk (it is never cached), and its size comes from metadata alone.
    """
    cost = 16 * spec.n_inner + 64  # what index_size will weigh it at
    if cost > capacity:
        most = (capacity - 64) // 16
        raise UnsupportedFormat(
            f"{uri}: each shard holds {spec.n_inner:,} inner chunks ({' x '.join(map(str, spec.chunks_per_shard))}), "
            f"so its index takes {spec.index_nbytes:,} bytes, more than the shard index cache holds "
            f"({capacity:,} bytes); re-shard the array with at most {most:,} inner chunks per shard (larger "
            "inner chunks or smaller shards)",
            uri=uri, chunks_per_shard=spec.chunks_per_shard, inner_chunks=spec.n_inner,
        )


def open_array(uri: str | os.PathLike, storage_options: dict[str, Any] | None = None, *,
               store: LocalStore | None = None, index_cache: SizedLRU | None = None,
               stores: Stores | None = None) -> ArrayReader:
    """Open the Zarr array at ``uri`` (v2 or v3): a local path or ``file://`` URI, an object store URI
    (``s3://``, ``gs://``, ``az://``, ``http(s)://``) or a path inside a zip archive
    (``/data/d.zip/g.zarr/a`` or ``zip:///data/d.zip!/g.zarr/a``); see docs/remote.md.

    Reads the metadata document only (or an ancestor's consolidated metadata): no chunk data is touched
    until ``read``. ``storage_options`` (credentials, endpoint, region, timeouts, retries...) apply to
    remote URIs; ``stores`` is where remote stores are opened and kept (a pipeline's; by default one per
    process).

    >>> arr = stoker.open_array("/data/plate.zarr/A/1/0")
    >>> arr.read(numpy.s_[0:1, 0:64, 0:64]).shape
    (1, 64, 64)
    >>> arr = stoker.open_array("s3://bucket/plate.zarr/A/1/0", {"region": "eu-west-1"})
    """
    loc = locate(uri)
    store = store or default_store()
    if not loc.is_local:
        kv, hierarchy = (stores or default_stores()).get(loc, storage_options)
        opened = getattr(kv, "opened", None)  # a disk cache: its objects revalidated in bulk, from now
        if opened is not None:
            opened(loc.prefix)
        return ArrayReader(read_store_metadata(hierarchy, loc.prefix, loc.uri), loc.prefix, kv, index_cache)
    if storage_options:
        raise InvalidArgument(f"{uri}: storage_options apply to remote URIs only (s3://, gs://, az://, "
                              "http(s)://); drop them for a local path", uri=os.fspath(uri))
    return open_local(loc.path, os.fspath(uri), store, index_cache)


def open_local(path: str, uri: str, store: LocalStore, index_cache: SizedLRU | None = None,
               stats: tuple[os.stat_result | None, os.stat_result | None] | None = None) -> ArrayReader:
    """:func:`open_array` of the array in the local directory ``path`` (``uri`` as given), its ``zarr.json``
    and ``.zarray`` with ``stats`` where its caller took them (see :func:`read_metadata`)."""
    store.forget(path)  # the array may have been rewritten since its files were last opened
    return ArrayReader(read_metadata(path, store, uri=uri, stats=stats), "", FileStore(path, store), index_cache)
