"""Planning a batch as flat tables: numpy arrays, with no Python step per chunk.

:func:`plan_tables` is the planner of every batch, whoever makes it (the compiled engine, the Python path, the
GPU decode): every chunk a batch needs, once, its copies, the decoded bytes they read, where the chunk is
stored, with one Python step per sample, one per array and one per shard file, and numpy for the rest:

- per axis, the chunks each crop touches (chunk index, start in the chunk and in the crop, extent), every
  combination a copy; chunks de-duplicated across the batch, numbered in order of first use; copies grouped
  by chunk, each chunk's decoded byte span: in C where the extension is built (``native.plan_grid``,
  csrc/grid.c: a hash table, one pass; tested against the numpy reference), else with numpy (the crops'
  pieces from :func:`~stoker.zarr.grid.box_pieces`, the grid's one reference; ``np.unique`` over (array, grid
  index) rows; a stable sort; ``reduceat``);
- shard indexes looked up in bulk: each sharded array's shards in the batch numbered in C order over its shard
  grid (their keys made once per reader), looked up in the index cache in one call
  (:meth:`~stoker.reader.array.ArrayReader.cached_shard_entries`); those not cached read together
  (:func:`~stoker.reader.array.shard_entries`: an array's in a store in one round trip); then every chunk's
  ``(offset, length)`` gathered from its shard's ``(n_inner, 2)`` table with one fancy index.

The engine (``stoker._native.Engine``) takes the tables as they are; the Python path asks
:meth:`TablePlan.python_reads` for the reads of the chunks it reads itself (a whole chunk file each, a shard's
inner chunks coalesced) and ``plan.chunks[i]`` for each one's :class:`~stoker.engine.planning.tasks.ChunkTask`.

>>> plan = plan_tables(0, samples, open_reader)
>>> plan.n_chunks, plan.chunks_needed, plan.chunk_file[:4]
(61, 64, array([0, 1, -1, 2]))
"""

from __future__ import annotations

import functools
import math
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..cpu import native
from ...errors import InvalidArgument
from ...reader.array import NOT_CACHED, ArrayReader, shard_entries
from ...zarr.box import check_in_bounds
from ...sampling.sample import Sample, arrays_read, parts
from ...zarr.grid import box_pieces, c_strides
from ...zarr.sharding import EMPTY_ENTRY
from .padding import PadCrop, needs_padding, pad_crop
from .tasks import ChunkTask, Copy, FileRead, shard_reads

#: columns of the files table (csrc/stoker_native.h: F_*), by name: its source, whether it has an identity,
#: that identity (F_DEV, F_INO as uint64 bits, then F_SIZE, F_MTIME, F_CTIME), then its grid coordinates
F_SOURCE, F_HAS_IDENT, F_COORDS = native.F_SOURCE, native.F_HAS_IDENT, native.F_COORDS
#: the identity's columns, in the order of a file's identity tuple (dev, ino, size, mtime_ns, ctime_ns)
F_IDENT = [native.F_DEV, native.F_INO, native.F_SIZE, native.F_MTIME, native.F_CTIME]


def file_ident(row: np.ndarray) -> tuple[int, int, int, int, int]:
    """The identity ``(dev, ino, size, mtime_ns, ctime_ns)`` a files table's ``row`` holds (F_HAS_IDENT 1):
    dev and ino as uint64 bits, the rest as they are."""
    dev, ino = (int(v) for v in row[F_IDENT[:2]].view(np.uint64))
    size, mtime, ctime = (int(v) for v in row[F_IDENT[2:]])
    return dev, ino, size, mtime, ctime


class _Tasks:
    """``plan.chunks[i]``: the Python path's ChunkTask of chunk ``i``, made when first asked for (and kept:
    the Python path relocates a task in place when its shard changed)."""

    def __init__(self, plan: "TablePlan") -> None:
        self._plan = plan
        self._made: dict[int, ChunkTask] = {}

    def __getitem__(self, i: int) -> ChunkTask:
        task = self._made.get(i)
        if task is None:  # setdefault: two threads asking at once get the same task
            task = self._made.setdefault(i, self._plan.make_task(i))
        return task

    def __len__(self) -> int:
        return self._plan.n_chunks


@dataclass
class TablePlan:
    """A batch plan as arrays. Chunks are numbered in order of first use; their copies are rows
    ``[first_copy[i], first_copy[i] + n_copies[i])`` of the copy arrays (in the order the samples need them)."""

    batch_id: int
    samples: tuple[Sample, ...]
    sample_shape: tuple[int, ...]
    sources: list[ArrayReader]
    chunks_needed: int  # chunk touches summed over samples
    bytes_needed: int
    # per copy (M rows): batch row; per axis start in the chunk, start in the crop, extent
    copy_row: np.ndarray
    copy_chunk_start: np.ndarray
    copy_box_start: np.ndarray
    copy_extent: np.ndarray
    copy_src_offset: np.ndarray  # in elements of the decoded chunk (its layout's order: codec.element_strides)
    # per chunk (N rows)
    chunk_source: np.ndarray
    chunk_index: np.ndarray  # (N, ndim) grid index of the read chunk
    first_copy: np.ndarray
    n_copies: np.ndarray
    byte_start: np.ndarray  # decoded bytes the copies read: [byte_start, byte_stop), in the decoded layout
    byte_stop: np.ndarray
    chunk_file: np.ndarray  # row of ``files``; -1: nothing stored (the fill value)
    chunk_offset: np.ndarray  # -1: the whole file
    chunk_length: np.ndarray
    chunk_inner: np.ndarray  # flat inner-chunk index in its shard; -1 unsharded
    # per file: source, has identity, identity (dev, ino, size, mtime_ns, ctime_ns as int64 bits), grid coordinates
    files: np.ndarray
    channels: int | None = None  # multi-array samples: arrays per sample (copy rows are b * C + c)
    # per sample: its key (epoch, index), int64 (B, 2), set by the coordinator; what keyed transforms get
    keys: np.ndarray | None = None
    # the crops that reach past their arrays (Sample.pad), filled after the chunks are placed (padding.py)
    pads: tuple[PadCrop, ...] = ()
    # chunk -> (path, ident) of the disk-cache entry its store's entry_files gave when the batch's prefetch
    # asked (engine/pipeline/prefetch.prefetch_plan), so the decoder does not ask again; None: not asked. Not
    # an init field: a plan made from this one (hybrid's subset, chunks renumbered) starts without it
    disk_entries: dict[int, tuple[bytes, bytes]] | None = field(init=False, repr=False, default=None)
    chunks: _Tasks = field(init=False, repr=False)
    # per file row, made as asked: its key, its path, its identity
    _keys: dict[int, str] = field(init=False, repr=False, default_factory=dict)
    _paths: dict[int, str] = field(init=False, repr=False, default_factory=dict)
    _idents: dict[int, tuple] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.chunks = _Tasks(self)

    @property
    def rows(self) -> int:
        return len(self.samples)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One sample's shape in the batch: ``(C, *sample_shape)`` for multi-array samples."""
        return self.sample_shape if self.channels is None else (self.channels, *self.sample_shape)

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_source)

    @property
    def ndim(self) -> int:
        return len(self.sample_shape)

    def file_key(self, f: int) -> str:
        """The key of file ``f`` (a row of ``files``): a chunk file's (its chunk's key) or a shard's."""
        key = self._keys.get(f)
        if key is None:
            reader = self.sources[int(self.files[f, F_SOURCE])]
            key = self._keys[f] = reader.metadata.chunk_key(tuple(self.files[f, F_COORDS:].tolist()))
        return key

    def key(self, i: int) -> str:
        """Chunk ``i``'s key ("c/0/1", or "c/0/0[3]" for an inner chunk of a shard), as ArrayReader.locate says it."""
        f, inner = int(self.chunk_file[i]), int(self.chunk_inner[i])
        if f >= 0:  # its file's key (kept per file), and an inner chunk's place in its shard
            return self.file_key(f) if inner < 0 else f"{self.file_key(f)}[{inner}]"
        meta = self.sources[int(self.chunk_source[i])].metadata
        index = tuple(self.chunk_index[i].tolist())
        if meta.sharding is None:
            return meta.chunk_key(index)
        shard, inner = meta.sharding.inner_position(index)
        return f"{meta.chunk_key(shard)}[{inner}]"

    def file_path(self, f: int) -> str:
        """The path of file ``f`` (a row of ``files``): in its array's folder, or its key in the array's store."""
        path = self._paths.get(f)
        if path is None:
            path = self._paths[f] = self.sources[int(self.files[f, F_SOURCE])].file_path(self.file_key(f))
        return path

    def path(self, i: int) -> str | None:
        """The file holding chunk ``i``, or None (the fill value)."""
        f = int(self.chunk_file[i])
        return None if f < 0 else self.file_path(f)

    def copy_rows(self, ids: np.ndarray) -> np.ndarray:
        """The rows of the copy arrays holding the copies of chunks ``ids``, chunk after chunk, each chunk's run
        ``[first_copy, first_copy + n_copies)`` in order (numpy: no Python step per chunk or copy).

        >>> plan.copy_rows(np.array([2, 0]))  # chunk 2's copies are rows 3-4, chunk 0's row 0
        array([3, 4, 0])
        """
        count = self.n_copies[ids]
        starts = np.cumsum(count) - count  # each chunk's first place in the result
        return np.repeat(self.first_copy[ids] - starts, count) + np.arange(int(count.sum()), dtype=np.int64)

    def copies(self, i: int) -> list[Copy]:
        lo = int(self.first_copy[i])
        hi = lo + int(self.n_copies[i])
        return list(map(Copy, self.copy_row[lo:hi].tolist(), map(tuple, self.copy_chunk_start[lo:hi].tolist()),
                        map(tuple, self.copy_box_start[lo:hi].tolist()), map(tuple, self.copy_extent[lo:hi].tolist())))

    def make_task(self, i: int) -> ChunkTask:
        """Chunk ``i`` as the Python path reads it: its key, file and byte range, copies and decoded span (what
        each file says, its key, path and identity, made once per file)."""
        f = int(self.chunk_file[i])
        task = ChunkTask(int(self.chunk_source[i]), tuple(self.chunk_index[i].tolist()), self.key(i),
                         self.copies(i), None if f < 0 else self.file_path(f), byte_start=int(self.byte_start[i]),
                         byte_stop=int(self.byte_stop[i]))
        if f >= 0 and int(self.chunk_offset[i]) >= 0:
            task.offset, task.length = int(self.chunk_offset[i]), int(self.chunk_length[i])
            ident = self._idents.get(f)
            if ident is None:
                ident = self._idents[f] = file_ident(self.files[f])
            task.ident = ident
        return task

    def file_read(self, i: int) -> FileRead | None:
        """A read of chunk ``i`` on its own (a whole chunk file, or its inner chunk's range), or None (fill)."""
        task = self.chunks[i]
        if task.path is None:
            return None
        if task.offset is None:
            return FileRead(task.path, (i,))
        return FileRead.inner_chunk(task.path, i, task.offset, task.length)

    def python_reads(self, ids: np.ndarray | None = None, max_gap: int = 64 << 10, max_group: int = 8 << 20,
                     sizing: Callable[[int], int] = lambda n: n) -> tuple[list[int], list[FileRead]]:
        """``(fills, reads)``: the chunks ``ids`` (ascending; None: every chunk) as the Python path reads them.
        ``fills``: those with nothing stored (the fill value); ``reads``: a chunk file each (in chunk order),
        then each shard file's inner chunks (shards in order of their first chunk), coalesced in groups
        costing at most ``max_group`` (:func:`~stoker.engine.planning.tasks.shard_reads`). Numpy, and a Python
        step per read.

        >>> fills, reads = plan.python_reads()
        >>> fills, [fr.chunk_ids for fr in reads]
        ([2], [(0,), (1,), (3,)])
        """
        ids = np.arange(self.n_chunks) if ids is None else np.asarray(ids, np.int64)
        files = self.chunk_file[ids]
        fills = ids[files < 0].tolist()
        stored = ids[files >= 0]
        inner = self.chunk_offset[stored] >= 0
        reads = [FileRead(self.file_path(f), (i,))
                 for i, f in zip(stored[~inner].tolist(), self.chunk_file[stored[~inner]].tolist())]
        inner_ids = stored[inner]
        if not len(inner_ids):
            return fills, reads
        order = np.argsort(self.chunk_file[inner_ids], kind="stable")  # by shard file, each in chunk order
        inner_ids = inner_ids[order]
        shard = self.chunk_file[inner_ids]
        heads = np.flatnonzero(np.concatenate([[True], shard[1:] != shard[:-1]]))
        decoded = np.array([r.metadata.codec.nbytes for r in self.sources], np.int64)[self.chunk_source[inner_ids]]
        ends = np.append(heads[1:], len(inner_ids))
        for lo, hi in sorted(zip(heads.tolist(), ends.tolist()), key=lambda b: int(inner_ids[b[0]])):
            reads += shard_reads(self.file_path(int(shard[lo])), inner_ids[lo:hi], self.chunk_offset[inner_ids[lo:hi]],
                                 self.chunk_length[inner_ids[lo:hi]], decoded[lo:hi], max_gap, max_group, sizing)
        return fills, reads


def batch_shape(samples: Sequence[Sample]) -> tuple[tuple[int, ...], int | None]:
    """``(crop shape, channels)`` every sample of a batch shares (the offsets of every copy are into a crop
    of that shape, and its rows into ``channels`` arrays per sample); InvalidArgument naming the first sample
    that differs."""
    if not samples:
        return (), None
    first = samples[0]
    crop = first.crop_shape
    for s in samples:
        if s.channels != first.channels:
            raise InvalidArgument(
                f"{s} reads {arrays_read(s)}, the batch's first sample {first} reads {arrays_read(first)}; every "
                "sample of a pipeline must read the same number of arrays", uri=s.uri)
        if s.crop_shape != crop:
            raise InvalidArgument(f"{s} has shape {s.shape}; every sample of a batch must be {first.shape}",
                                  uri=s.uri)
    return crop, first.channels


def _unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, inverse)``: the distinct int64 rows of ``rows`` (or values of a 1-d ``rows``) numbered in order of first appearance:
    ``first[k]`` is the first row of distinct row k, ``inverse[r]`` the number of row r."""
    rows = np.ascontiguousarray(rows)
    keys = rows if rows.ndim == 1 else rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return first[order], rank[inverse.ravel()]


#: Largest shard index (inner chunks) whose tables are joined to gather a batch's entries in one step; a larger
#: one's rows are gathered a table at a time rather than copied whole.
_JOIN_ROWS = 4096


def _shard_positions(index: np.ndarray, cps: np.ndarray, inner_strides: np.ndarray,
                     shard_strides: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(inner, shard_of, first, numbers)`` of chunks of a sharded array at grid ``index`` (rows): each one's
    flat inner index in its shard and its shard, numbered in order of first use; each shard's first chunk and
    its number in C order over the shard grid (None when ``shard_strides`` is: a grid past int64). In C
    (csrc/grid.c) where the extension is built, else numpy."""
    if native.shard_positions is not None and shard_strides is not None:
        got = native.shard_positions(index, cps, shard_strides)
        inner, shard_of, first, numbers = (np.frombuffer(b, np.int64) for b in got)
        return inner, shard_of, first, numbers
    shard = index // cps
    inner = ((index - shard * cps) * inner_strides).sum(axis=1)
    if shard_strides is None:
        first, shard_of = _unique_rows(shard)
        return inner, shard_of, first, None
    number = shard @ shard_strides
    first, shard_of = _unique_rows(number)
    return inner, shard_of, first, number[first]


def _gather_entries(tables: list[np.ndarray], slot: np.ndarray, shard_of: np.ndarray,
                    inner: np.ndarray) -> np.ndarray:
    """``out[i] = tables[slot[shard_of[i]]][inner[i]]``: each chunk's ``(offset, length)`` from its shard's index
    (every table of one array has the same number of rows), the empty entry where the slot is -1 (no shard
    file). In C where the extension is built, else numpy."""
    if native.gather_entries is not None:
        return np.frombuffer(native.gather_entries(tables, slot, shard_of, inner), np.uint64).reshape(-1, 2)
    chunk_slot = slot[shard_of]
    out = np.full((len(shard_of), 2), EMPTY_ENTRY, np.uint64)
    held = np.flatnonzero(chunk_slot >= 0)
    chunk_slot, inner = chunk_slot[held], inner[held]
    n_inner = len(tables[0])
    if len(tables) == 1:
        out[held] = tables[0][inner]
    elif n_inner <= _JOIN_ROWS:
        out[held] = np.concatenate(tables)[chunk_slot * n_inner + inner]
    else:
        order = np.argsort(chunk_slot, kind="stable")
        bounds = np.searchsorted(chunk_slot[order], np.arange(len(tables) + 1)).tolist()
        for j, table in enumerate(tables):
            mine = order[bounds[j]:bounds[j + 1]]
            out[held[mine]] = table[inner[mine]]
    return out


def _shard_geometry(reader: ArrayReader) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(inner chunks per shard, their C-order strides, the shard grid's C-order strides)`` of a sharded array,
    kept on the reader; the last is None when the grid holds more shards than an int64 counts."""
    geometry = reader.__dict__.get("_shard_geometry")
    if geometry is None:
        cps = reader.metadata.sharding.chunks_per_shard
        grid = reader.shard_grid
        geometry = reader.__dict__["_shard_geometry"] = (
            np.array(cps, np.int64), np.array(c_strides(cps), np.int64),
            np.array(c_strides(grid), np.int64) if math.prod(grid) < 2**63 else None)
    return geometry


def _grid_compiled(start, sid, extent, chunk_shapes, chunk_strides, itemsize) -> tuple:
    """The chunks the crops touch and every copy, planned in C (csrc/grid.c): see :func:`_grid_numpy`."""
    return _grid_columns(*native.plan_grid(start, sid, extent, chunk_shapes, chunk_strides, itemsize), len(extent))


def _grid_columns(copies: bytes, chunks: bytes, ndim: int) -> tuple:
    """plan_grid's (or plan_crops') rows as the columns _grid_numpy returns (views, no copies)."""
    copies = np.frombuffer(copies, np.int64).reshape(-1, native.GRID_COPY_COLS(ndim))
    chunks = np.frombuffer(chunks, np.int64).reshape(-1, native.GRID_CHUNK_COLS + ndim)
    box, extent = native.GC_BOX_START(ndim), native.GC_EXTENT(ndim)
    return (copies[:, native.GC_ROW], copies[:, native.GC_CHUNK_START:box], copies[:, box:extent],
            copies[:, extent:extent + ndim], copies[:, native.GC_SRC_OFFSET], chunks[:, native.G_SOURCE],
            chunks[:, native.GRID_CHUNK_COLS:], chunks[:, native.G_FIRST_COPY], chunks[:, native.G_NCOPIES],
            chunks[:, native.G_SPAN_START], chunks[:, native.G_SPAN_STOP])


def _grid_of_crops(crops, sids, sources, shape, rows) -> tuple | None:
    """``(grid columns as _grid_numpy returns them, bytes needed, the sharded arrays' numbers)``, planned in one
    compiled call with the boxes' bounds checked there (csrc/tables.c: plan_crops), or None without the
    extension (or for a crop the check there and check_in_bounds disagree on, which the caller redoes).
    The boxes go as one flat array('q'): numpy's conversion of the nested tuples costs twice as much."""
    if native.plan_crops is None or not shape or not sources:
        return None
    try:
        boxes = array("q", [v for _, aabb in crops for box in aabb for v in box])  # crops x ndim x (start, stop)
    except OverflowError:  # a bound past int64, so past its array: the first crop out of bounds raises
        _check_each(crops, sids, sources)
        raise
    copies, chunks, outside, bytes_needed, any_sharded = native.plan_crops(boxes, array("q", sids),
                                                                           array("q", shape), rows)
    if outside >= 0:  # the first crop out of bounds raises OutOfBounds
        check_in_bounds(crops[outside][1], sources[sids[outside]].shape, crops[outside][0])
        return None
    sharded_ids = [k for k, r in enumerate(sources) if r.metadata.sharding is not None] if any_sharded else []
    return _grid_columns(copies, chunks, len(shape)), bytes_needed, sharded_ids


def _grid_numpy(start, sid, extent, chunk_shapes, chunk_strides, itemsize) -> tuple:
    """``(row, chunk_start, box_start, extent, src_offset)`` per copy, grouped by chunk, and ``(source, index,
    first_copy, n_copies, byte_start, byte_stop)`` per chunk, numbered in order of first use: the crops' pieces
    (:func:`~stoker.zarr.grid.box_pieces`, the grid's reference) de-duplicated with numpy."""
    pieces = box_pieces(start, start + extent, chunk_shapes[sid])
    row, c_index, c_start, b_start, c_extent = pieces
    copy_sid = sid[row]
    # one chunk per (array, grid index), in order of first use; copies grouped by chunk, in order
    first, chunk_of = _unique_rows(np.concatenate([copy_sid[:, None], c_index], axis=1))
    order = np.argsort(chunk_of, kind="stable")
    row, copy_sid, c_start, b_start, c_extent = row[order], copy_sid[order], c_start[order], b_start[order], \
        c_extent[order]
    n_copies = np.bincount(chunk_of, minlength=len(first))
    first_copy = np.cumsum(n_copies) - n_copies
    strides = chunk_strides[copy_sid]
    src_offset = (c_start * strides).sum(axis=1)
    last = src_offset + ((c_extent - 1) * strides).sum(axis=1)
    chunk_source = copy_sid[first_copy]
    item = itemsize[chunk_source]
    byte_start = np.minimum.reduceat(src_offset, first_copy) * item
    byte_stop = (np.maximum.reduceat(last, first_copy) + 1) * item
    return (row, c_start, b_start, c_extent, src_offset, chunk_source, c_index[first], first_copy, n_copies,
            byte_start, byte_stop)


def plan_tables(batch_id: int, samples: Sequence[Sample], open_reader: Callable[[str], ArrayReader]) -> TablePlan:
    """Plan one batch as arrays, of arrays of any rank (0-d too). Raises the typed errors of opening arrays, boxes
    out of bounds or of another shape (the first crop's in the batch's order), shard indexes that cannot be read
    and stored chunks over their codec's bound (the first chunk's in chunk order)."""
    sources: list[ArrayReader] = []
    source_of: dict[str, int] = {}
    shape, channels = batch_shape(samples)  # every copy's offsets are into a crop of this shape
    ndim = len(shape)
    crops = parts(samples)  # one per sample and channel (a row each: b * C + c)
    sids = []
    for uri, _ in crops:
        sid = source_of.get(uri)
        if sid is None:
            try:
                reader = open_reader(uri)
            except BaseException:  # a crop before it out of bounds is the batch's first error
                _check_each(crops, sids, sources, samples)
                raise
            sid = source_of[uri] = len(sources)
            sources.append(reader)
        sids.append(sid)
    if any(len(r.shape) != ndim for r in sources):  # the first crop at fault raises RankMismatch (or OutOfBounds)
        _check_each(crops, sids, sources, samples)
    # per array: item size, chunk shape, element strides in its decoded layout (C order, or permuted: v2 F
    # order, v3 transpose), sharded or not, shape
    rows = array("q", b"".join([_array_row(r) for r in sources]))
    # a batch with a box past its array (Sample.pad) is planned apart (the same columns); any other, as always
    padded = (_grid_padded(samples, crops, sids, sources, shape, rows)
              if any(s.pad is not None for s in samples) else None)
    pads = padded[1] if padded is not None else ()
    grid = padded[0] if padded is not None else _grid_of_crops(crops, sids, sources, shape, rows)
    if grid is None:  # no extension (numpy), or a crop past its array that check_in_bounds let through
        sid = np.array(sids, np.int64)
        try:
            boxes = np.array([aabb for _, aabb in crops], np.int64).reshape(len(crops), ndim, 2)
        except OverflowError:  # a bound past int64, so past its array: the first crop out of bounds raises
            _check_each(crops, sids, sources)
            raise
        per_array = np.frombuffer(rows, np.int64).reshape(len(sources), native.ARRAY_ROW_COLS(ndim))
        strides_at, shape_at = native.A_STRIDES(ndim), native.A_SHAPE(ndim)
        itemsize, chunk_shapes, chunk_strides = (np.ascontiguousarray(per_array[:, at]) for at in
                                                 (native.A_ITEMSIZE, slice(native.A_CHUNK_SHAPE, strides_at),
                                                  slice(strides_at, strides_at + ndim)))
        sharded_ids = np.flatnonzero(per_array[:, native.A_SHARDED(ndim)]).tolist()
        out_of_bounds = (boxes[:, :, 1] > per_array[sid, shape_at:shape_at + ndim]).any(axis=1)
        if out_of_bounds.any():  # the first crop out of bounds raises OutOfBounds
            at = int(np.argmax(out_of_bounds))
            check_in_bounds(crops[at][1], sources[sids[at]].shape, crops[at][0])
        bytes_needed = math.prod(shape) * int(itemsize[sid].sum())
        start = np.ascontiguousarray(boxes[:, :, 0])
        # the compiled grid takes crops of 1 to 32 axes, of at least one array; numpy the rest (0-d arrays)
        grid = _grid_compiled if native.plan_grid is not None and ndim and sources else _grid_numpy
        columns = grid(start, sid, np.array(shape, np.int64), chunk_shapes, chunk_strides, itemsize)
    else:
        columns, bytes_needed, sharded_ids = grid
    (row, c_start, b_start, c_extent, src_offset, chunk_source, chunk_index, first_copy, n_copies, byte_start,
     byte_stop) = columns
    m = len(row)

    n = len(chunk_source)
    # chunks of unsharded arrays: a file each, in chunk order, all at once
    if sharded_ids:
        chunk_offset = np.full(n, -1, np.int64)
        chunk_length = np.zeros(n, np.int64)
        chunk_inner = np.full(n, -1, np.int64)
        # chunks of the unsharded arrays (none in the usual sharded batch: np.isin costs tens of us)
        plain = (np.flatnonzero(~np.isin(chunk_source, sharded_ids)) if len(sharded_ids) < len(sources)
                 else np.empty(0, np.int64))
        chunk_file = np.full(n, -1, np.int64)
        chunk_file[plain] = np.arange(len(plain))
        table = np.zeros((len(plain), F_COORDS + ndim), np.int64)
        table[:, F_SOURCE] = chunk_source[plain]
        table[:, F_COORDS:] = chunk_index[plain]
    else:  # every chunk (the usual batch): the columns that say so are the same for every batch of n chunks
        chunk_file, chunk_offset, chunk_length, chunk_inner = _unsharded_columns(n)
        plain = chunk_file
        table = np.zeros((n, F_COORDS + ndim), np.int64)
        table[:, F_SOURCE] = chunk_source
        table[:, F_COORDS:] = chunk_index
    files: list[np.ndarray] = [table]
    n_files = len(plain)
    failures: list[tuple[int, Callable[[], None]]] = []  # (first chunk it concerns, raise it)
    # every sharded array's shards in the batch numbered, keyed and looked up in the index cache at once; those
    # not cached read before the loop (those of arrays in a store together, in one round trip)
    sharded = []  # (source, reader, its chunks, their grid indexes, shard and inner index, shards' first chunk...)
    missing: list[tuple[ArrayReader, str]] = []  # (reader, shard key) of every index not cached
    for s in sharded_ids:  # one step per sharded array
        reader = sources[s]
        ids = np.arange(n) if len(sources) == 1 else np.flatnonzero(chunk_source == s)
        index = np.ascontiguousarray(chunk_index[ids])
        cps, inner_strides, shard_strides = _shard_geometry(reader)
        inner, shard_of, shard_first, numbers = _shard_positions(index, cps, inner_strides, shard_strides)
        if numbers is not None:  # shards numbered in C order over the grid: each key made once per reader
            keys = reader.shard_keys(numbers.tolist())
        else:  # a grid of more shards than an int64 counts
            keys = [reader.metadata.chunk_key(tuple(c)) for c in (index[shard_first] // cps).tolist()]
        got = reader.cached_shard_entries(keys)
        missing += [(reader, keys[k]) for k, entry in enumerate(got) if entry is NOT_CACHED]
        chunk_inner[ids] = inner
        sharded.append((s, reader, ids, index, cps, inner, shard_of, shard_first, keys, got))
    loaded = iter(shard_entries(missing) if missing else ())
    for s, reader, ids, index, cps, inner, shard_of, shard_first, keys, got in sharded:  # a step per sharded array
        meta = reader.metadata
        slot, tables = [], []  # each shard's table in tables (-1: none: no shard file, or a failure)
        for k, entry in enumerate(got):  # a step per shard file
            if entry is NOT_CACHED:
                entry = got[k] = next(loaded)
            if isinstance(entry, BaseException):  # raised below if no earlier chunk has a failure
                failures.append((int(ids[shard_first[k]]), _raiser(entry)))
            if entry is None or isinstance(entry, BaseException):  # (None: every chunk of it is the fill value)
                slot.append(-1)
            else:
                slot.append(len(tables))
                tables.append(entry.table)
        if not tables:
            continue
        entries = _gather_entries(tables, np.array(slot, np.int64), shard_of, inner)  # (offset, length) per chunk
        stored = ~((entries[:, 0] == EMPTY_ENTRY) & (entries[:, 1] == EMPTY_ENTRY))
        over = stored & (entries[:, 1] > meta.codec.max_stored_nbytes)
        if over.any():  # before anyone reads or reserves room for it (as locate does): the first in chunk order
            bad = int(np.argmax(over))
            key = f"{keys[int(shard_of[bad])]}[{int(inner[bad])}]"
            failures.append((int(ids[bad]), _too_big(meta.codec, int(entries[bad, 1]), key)))
        with_data = np.flatnonzero(np.bincount(shard_of[stored], minlength=len(got)))  # shards holding a chunk
        if not len(with_data):
            continue
        rows = np.zeros((len(with_data), F_COORDS + ndim), np.int64)
        rows[:, F_SOURCE], rows[:, F_HAS_IDENT] = s, 1
        idents = [got[k].ident for k in with_data.tolist()]
        rows[:, F_IDENT[:2]] = np.array([(i[0] & (2**64 - 1), i[1] & (2**64 - 1)) for i in idents],
                                        np.uint64).view(np.int64)
        rows[:, F_IDENT[2:]] = [i[2:5] for i in idents]
        rows[:, F_COORDS:] = index[shard_first[with_data]] // cps
        files.append(rows)
        file_of = np.full(len(got), -1, np.int64)
        file_of[with_data] = n_files + np.arange(len(with_data))
        at, where = ids[stored], entries[stored].astype(np.int64)
        chunk_file[at] = file_of[shard_of[stored]]
        chunk_offset[at] = where[:, 0]
        chunk_length[at] = where[:, 1]
        n_files += len(with_data)
    if failures:
        min(failures, key=lambda f: f[0])[1]()
    return TablePlan(
        batch_id, tuple(samples), shape, sources, m, bytes_needed, row, c_start, b_start, c_extent, src_offset,
        chunk_source, chunk_index, first_copy, n_copies, byte_start, byte_stop, chunk_file, chunk_offset,
        chunk_length, chunk_inner,
        np.concatenate(files) if len(files) > 1 else files[0], channels, pads=pads,
    )


def _unsharded_columns(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``chunk_file`` (chunk i is file i), ``chunk_offset`` (-1: the whole file), ``chunk_length`` (0) and
    ``chunk_inner`` (-1) of a batch of ``n`` chunks, none in a shard: read-only, and shared by such batches
    of up to 4,096 chunks (four allocations fewer per batch, where they are a share of its cost)."""
    return _shared_unsharded_columns(n) if n <= 4096 else _make_unsharded_columns(n)


def _make_unsharded_columns(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    columns = (np.arange(n, dtype=np.int64), np.full(n, -1, np.int64), np.zeros(n, np.int64),
               np.full(n, -1, np.int64))
    for column in columns:
        column.flags.writeable = False
    return columns


_shared_unsharded_columns = functools.lru_cache(maxsize=64)(_make_unsharded_columns)


def _check_each(crops: list, sids: list[int], sources: list[ArrayReader],
                samples: Sequence[Sample] = ()) -> None:
    """Check, one by one and in order, the crops whose arrays are open (one per entry of ``sids``): the slow
    path that raises the first crop's error where the numpy check cannot (an array of another rank, or an
    array that failed to open after them). A padded crop (of ``samples``) is checked for its rank only."""
    padded = [s.pad is not None for s in samples for _ in s.uris]
    for k, ((uri, aabb), at) in enumerate(zip(crops, sids)):
        shape = sources[at].shape
        if k < len(padded) and padded[k] and len(aabb) == len(shape):
            continue
        check_in_bounds(aabb, shape, uri)


def _grid_padded(samples: Sequence[Sample], crops: list, sids: list[int], sources: list[ArrayReader],
                 shape: tuple[int, ...], rows: array) -> tuple[tuple, tuple[PadCrop, ...]] | None:
    """``((grid columns, bytes needed, sharded arrays' numbers), padded crops)`` of a batch with padded samples,
    or None when none of them reaches past its array (the usual planner takes the batch). Each padded crop is
    planned as its read box (:func:`~stoker.engine.planning.padding.pad_crop`) at its offset in the slot, with
    the numpy grid (the compiled one takes crops of one shape); an unpadded crop past its array raises
    OutOfBounds, in the batch's order."""
    modes = [s.pad for s in samples for _ in s.uris]
    ndim = len(shape)
    pads, starts, stops, offsets = [], [], [], []
    for k, ((uri, aabb), sid, mode) in enumerate(zip(crops, sids, modes)):
        array_shape = sources[sid].shape
        if mode is None or not needs_padding(aabb, array_shape):
            check_in_bounds(aabb, array_shape, uri)
            starts.append([a for a, _ in aabb])
            stops.append([b for _, b in aabb])
            offsets.append([0] * ndim)
            continue
        pc = pad_crop(k, sid, aabb, array_shape, mode, uri)
        pads.append(pc)
        starts.append([a for a, _ in pc.read])
        stops.append([a if pc.empty else b for a, b in pc.read])  # an empty crop reads nothing
        offsets.append(list(pc.offset))
    if not pads:
        return None
    sid = np.array(sids, np.int64)
    per_array = np.frombuffer(rows, np.int64).reshape(len(sources), native.ARRAY_ROW_COLS(ndim))
    strides_at = native.A_STRIDES(ndim)
    itemsize, chunk_shapes, chunk_strides = (np.ascontiguousarray(per_array[:, at]) for at in
                                             (native.A_ITEMSIZE, slice(native.A_CHUNK_SHAPE, strides_at),
                                              slice(strides_at, strides_at + ndim)))
    sharded_ids = np.flatnonzero(per_array[:, native.A_SHARDED(ndim)]).tolist()
    start = np.array(starts, np.int64).reshape(len(crops), ndim)
    extent = np.array(stops, np.int64).reshape(len(crops), ndim) - start
    reading = np.flatnonzero((extent > 0).all(axis=1))  # crops that read something
    columns = list(_grid_numpy(start[reading], sid[reading], extent[reading], chunk_shapes, chunk_strides,
                               itemsize)) if len(reading) else _no_columns(ndim)
    row = reading[columns[0]]  # the copies' crops, numbered among all crops again
    columns[2] = columns[2] + np.array(offsets, np.int64).reshape(len(crops), ndim)[row]  # into the crop's slot
    columns[0] = row
    bytes_needed = math.prod(shape) * int(itemsize[sid].sum())
    return (tuple(columns), bytes_needed, sharded_ids), tuple(pads)


def _no_columns(ndim: int) -> list:
    """The grid columns of a batch that reads nothing (every crop misses its array)."""
    copy = np.zeros((0, ndim), np.int64)
    none = np.zeros(0, np.int64)
    return [none, copy, copy, copy, none, none, copy, none, none, none, none]


def _array_row(reader: ArrayReader) -> bytes:
    """What plan_tables needs of an array, in one row of int64s: item size, chunk shape, element strides,
    sharded or not, shape. Kept on the metadata, packed (it never changes; every pipeline's reader of an
    unchanged document shares it, see stoker.reader.metacache): planning asks for it every batch, and joins
    a batch's rows in one call."""
    meta = reader.metadata
    row = meta.__dict__.get("_table_row")
    if row is None:  # written past the frozen dataclass's __setattr__: a cache, not a field (no eq, no repr)
        ndim = len(meta.shape)
        values = [0] * native.ARRAY_ROW_COLS(ndim)  # A_* columns (csrc/stoker_native.h)
        values[native.A_ITEMSIZE] = meta.dtype.itemsize
        for at, part in ((native.A_CHUNK_SHAPE, meta.read_chunk_shape),
                         (native.A_STRIDES(ndim), meta.codec.element_strides), (native.A_SHAPE(ndim), meta.shape)):
            values[at:at + ndim] = part
        values[native.A_SHARDED(ndim)] = meta.sharding is not None
        row = meta.__dict__["_table_row"] = array("q", values).tobytes()
    return row


def _raiser(exc: BaseException) -> Callable[[], None]:
    def throw() -> None:
        raise exc
    return throw


def _too_big(codec, stored: int, key: str) -> Callable[[], None]:
    return lambda: codec.check_stored_size(stored, key)
