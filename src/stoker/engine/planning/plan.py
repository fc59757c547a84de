"""Planning one batch: which read chunks it needs, once each, and where their bytes are.

A :class:`BatchPlan` is plain data (no buffers, no threads). The only I/O the
planner causes is through the lookups it is handed (array metadata and shard
indexes, both cached by their owners), so it can be tested on its own:

>>> plan = plan_batch(0, samples, open_reader)
>>> plan.chunks_needed, len(plan.chunks)      # before and after de-duplication
(64, 61)

Per chunk it records every copy (batch row, selection in the chunk, selection in
the crop; a batch of multi-array samples has one row per sample and channel, ``b * C + c``, so
the channel slices of the ``(B, C, *box)`` batch are rows of its ``(B * C, *box)`` view) and the byte range of the decoded chunk the copies actually read, so
the executor can decode only that part where the codec allows it. This is the
Python path's planner; the compiled engine's is :mod:`.tables` (the same plan as
arrays, checked against this one).
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from ...reader.array import ArrayReader, shard_entries
from ...zarr.box import check_in_bounds
from ...errors import InvalidArgument
from ...sampling.sample import Sample, arrays_read, parts
from ...storage.ranges import Read, coalesce
from ...zarr.grid import c_strides


class Copy:
    """Copy ``chunk[chunk_sel]`` into ``batch[row][box_sel]`` (``batch[dst]``).

    Held as numbers, made per chunk per crop: where the copy starts in the chunk and in the crop, and its
    extent; the slices are made only when the Python path asks for them.

    >>> c = Copy.of(0, (slice(1, 3), slice(0, 4)), (slice(0, 2), slice(2, 6)))
    >>> c.extent, c.chunk_sel
    ((2, 4), (slice(1, 3, None), slice(0, 4, None)))
    """

    __slots__ = ("row", "chunk_start", "box_start", "extent")

    def __init__(self, row: int, chunk_start: tuple[int, ...], box_start: tuple[int, ...],
                 extent: tuple[int, ...]) -> None:
        self.row = row
        self.chunk_start = chunk_start
        self.box_start = box_start
        self.extent = extent

    @classmethod
    def of(cls, row: int, chunk_sel: tuple[slice, ...], box_sel: tuple[slice, ...]) -> "Copy":
        """A copy from unit-step slices (tests and hand-made plans)."""
        return cls(row, tuple(s.start for s in chunk_sel), tuple(b.start for b in box_sel),
                   tuple(s.stop - s.start for s in chunk_sel))

    @property
    def chunk_sel(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + e) for s, e in zip(self.chunk_start, self.extent))

    @property
    def box_sel(self) -> tuple[slice, ...]:
        return tuple(slice(b, b + e) for b, e in zip(self.box_start, self.extent))

    @property
    def dst(self) -> tuple:
        """``(row, *box_sel, ...)``: where the copy lands in the batch (the Ellipsis keeps a crop of a 0-d
        array, ``(row,)`` alone, a view: an integer index alone gives numpy's scalar, a copy)."""
        return (self.row, *self.box_sel, Ellipsis)

    def __repr__(self) -> str:
        return f"Copy(row={self.row}, chunk_sel={self.chunk_sel}, box_sel={self.box_sel})"


@dataclass(slots=True)
class ChunkTask:
    """One read chunk of one array, needed by one or more samples of the batch."""

    source: int  # index into BatchPlan.sources
    index: tuple[int, ...]
    key: str
    copies: list[Copy] = field(default_factory=list)
    path: str | None = None  # file holding the chunk; None: fill value
    offset: int | None = None  # byte range in ``path`` (sharded); None: the whole file
    length: int | None = None
    ident: tuple | None = None  # sharded: the identity of the shard file its index was read from
    byte_start: int = 0  # decoded bytes the copies read (C order), for partial decoding
    byte_stop: int = 0

    @property
    def fill(self) -> bool:
        return self.path is None


@dataclass(frozen=True)
class FileRead:
    """One file's share of the batch: the whole file (one chunk) or coalesced ranges (inner chunks)."""

    path: str
    chunk_ids: tuple[int, ...]  # ChunkTask indices, in request order
    reads: tuple[Read, ...] = ()  # empty: read the whole file for chunk_ids[0]

    @property
    def whole_file(self) -> bool:
        return not self.reads

    @classmethod
    def inner_chunk(cls, path: str, cid: int, offset: int, length: int) -> "FileRead":
        """A read of one inner chunk of a shard on its own: ``length`` bytes at ``offset`` of ``path``."""
        return cls(path, (cid,), (Read(offset, length, ((0, offset, length),)),))


@dataclass
class BatchPlan:
    batch_id: int
    samples: tuple[Sample, ...]
    sample_shape: tuple[int, ...]
    sources: list[ArrayReader]
    chunks: list[ChunkTask]
    file_reads: list[FileRead]
    chunks_needed: int  # sum over samples (and channels) of chunks touched (before de-duplication)
    bytes_needed: int  # source-dtype bytes the samples hold (what a perfect reader would decode)
    channels: int | None = None  # multi-array samples: arrays per sample (copy rows are b * C + c)

    @property
    def rows(self) -> int:
        return len(self.samples)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One sample's shape in the batch: ``(C, *sample_shape)`` for multi-array samples."""
        return self.sample_shape if self.channels is None else (self.channels, *self.sample_shape)

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def fill_chunks(self) -> list[int]:
        return [i for i, c in enumerate(self.chunks) if c.fill]


def _axis_pieces(start: int, stop: int, chunk: int, chunk_stride: int) -> list[tuple[int, ...]]:
    """The chunks ``[start, stop)`` touches along one axis, each as ``(chunk index, start in the chunk,
    start in the box, extent, and in elements along this axis: the chunk offset of the start and of the
    last element)``. A copy's span in the chunk is the sums over axes."""
    pieces = []
    ci, lo = divmod(start, chunk)
    at = 0
    while at < stop - start:
        n = min(chunk - lo, stop - start - at)
        pieces.append((ci, lo, at, n, lo * chunk_stride, (lo + n - 1) * chunk_stride))
        ci, lo, at = ci + 1, 0, at + n
    return pieces


def _groups(cids: list[int], chunks, cost: Callable[[ChunkTask], int], limit: int) -> list[list[int]]:
    """Split one shard's chunks (in file order) into groups costing at most ``limit`` (a lone chunk always fits)."""
    groups: list[list[int]] = []
    total = 0
    for cid in sorted(cids, key=lambda c: chunks[c].offset):
        c = cost(chunks[cid])
        if groups and total + c <= limit:
            groups[-1].append(cid)
            total += c
        else:
            groups.append([cid])
            total = c
    return groups


def plan_batch(
    batch_id: int,
    samples: Sequence[Sample],
    open_reader: Callable[[str], ArrayReader],
    max_gap: int = 64 << 10,
    max_group: int = 8 << 20,
    sizing: Callable[[int], int] = lambda n: n,
    one_by_one: Callable[[ArrayReader], bool] = lambda reader: False,
) -> BatchPlan:
    """Plan one batch. Raises the typed errors of opening arrays and of out-of-bounds boxes.

    Inner chunks of one shard are read together, coalesced, in groups whose cost
    stays within ``max_group`` (unless a group is a single chunk). A group costs
    what the executor reserves for it: ``sizing`` of each coalesced read (gaps
    included) plus ``sizing`` of each chunk's decoded size. Inner chunks of arrays
    for which ``one_by_one`` is true get a read each instead (the reads the Python
    path makes of chunks the engine leaves to it).
    """
    sources: list[ArrayReader] = []
    source_of: dict[str, int] = {}
    tasks: dict[tuple[int, tuple[int, ...]], ChunkTask] = {}
    spans: dict[tuple[int, tuple[int, ...]], list[int]] = {}  # first and last element the copies read
    needed = 0
    bytes_needed = 0
    shape, channels = batch_shape(samples)
    for row, (uri, aabb) in enumerate(parts(samples)):  # a row per sample and channel
        sid = source_of.get(uri)
        if sid is None:
            sid = source_of[uri] = len(sources)
            sources.append(open_reader(uri))
        reader = sources[sid]
        check_in_bounds(aabb, reader.shape, uri)
        bytes_needed += math.prod(shape) * reader.dtype.itemsize
        chunk_shape = reader.chunks
        per_axis = [_axis_pieces(start, stop, c, cs) for (start, stop), c, cs
                    in zip(aabb, chunk_shape, c_strides(chunk_shape))]
        for combo in itertools.product(*per_axis):
            index, c_lo, b_lo, extent, src, last = zip(*combo) if combo else ((),) * 6  # () for 0-d
            needed += 1
            key = (sid, index)
            first, last = sum(src), sum(last)
            task = tasks.get(key)
            if task is None:
                task = tasks[key] = ChunkTask(sid, index, "")
                spans[key] = [first, last]
            else:
                span = spans[key]
                if first < span[0]:
                    span[0] = first
                if last > span[1]:
                    span[1] = last
            task.copies.append(Copy(row, c_lo, b_lo, extent))

    chunks = list(tasks.values())
    failed = _read_stored_indexes(chunks, sources)
    # by file and identity: inner chunks located through two versions of a shard's index are two reads
    by_shard: dict[tuple[str, tuple], list[int]] = {}
    file_reads: list[FileRead] = []
    alone = [one_by_one(r) if r.metadata.sharding is not None else False for r in sources]
    for cid, task in enumerate(chunks):
        reader = sources[task.source]
        meta = reader.metadata
        first, last = spans[(task.source, task.index)]
        task.byte_start, task.byte_stop = first * meta.dtype.itemsize, (last + 1) * meta.dtype.itemsize
        if failed and meta.sharding is not None:  # an index that could not be read: its first chunk raises
            error = failed.get((task.source, meta.chunk_key(meta.sharding.inner_position(task.index)[0])))
            if error is not None:
                raise error
        loc = reader.locate(task.index)
        task.key, task.path = loc.key, loc.path
        if loc.path is None:
            continue  # missing shard or empty inner chunk: fill
        if loc.offset is None:
            file_reads.append(FileRead(loc.path, (cid,)))
            continue
        task.offset, task.length, task.ident = loc.offset, loc.length, loc.ident
        if alone[task.source]:
            file_reads.append(FileRead.inner_chunk(loc.path, cid, loc.offset, loc.length))
        else:
            by_shard.setdefault((task.path, task.ident), []).append(cid)

    file_reads += shard_reads(by_shard.values(), chunks, sources, max_gap, max_group, sizing)
    return BatchPlan(batch_id, tuple(samples), shape, sources, chunks, file_reads, needed, bytes_needed, channels)


def _read_stored_indexes(chunks: list[ChunkTask], sources: Sequence[ArrayReader]) -> dict[tuple[int, str], BaseException]:
    """Read the indexes of the shards the batch touches in arrays in a store before the chunks are located
    (together, one round trip: :func:`~stoker.reader.array.shard_entries`); the errors met, by (source, shard key),
    for the planner to raise at the first chunk they concern. Local arrays' indexes are read as located."""
    wanted: dict[tuple[int, str], None] = {}
    for task in chunks:
        reader = sources[task.source]
        spec = reader.metadata.sharding
        if not reader.kv.is_local and spec is not None:
            wanted[(task.source, reader.metadata.chunk_key(spec.inner_position(task.index)[0]))] = None
    if not wanted:
        return {}
    got = shard_entries([(sources[sid], key) for sid, key in wanted])
    return {at: entry for at, entry in zip(wanted, got) if isinstance(entry, BaseException)}


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


def shard_reads(shards: Iterable[list[int]], chunks, sources: Sequence[ArrayReader], max_gap: int, max_group: int,
                sizing: Callable[[int], int]) -> list[FileRead]:
    """The reads of inner chunks, given per shard file (``chunks[c]`` located: path, offset, length): nearby
    ones coalesced, in groups whose cost stays within ``max_group`` (see :func:`plan_batch`)."""
    def chunk_cost(task: ChunkTask) -> int:
        return sizing(task.length) + sizing(sources[task.source].metadata.codec.nbytes)

    file_reads = []
    pending = collections.deque(g for cids in shards for g in _groups(cids, chunks, chunk_cost, max_group))
    while pending:
        group = pending.popleft()
        reads = coalesce([(chunks[c].offset, chunks[c].length) for c in group], max_gap=max_gap,
                         max_length=max_group)
        total = sum(sizing(r.length) for r in reads) + sum(
            sizing(sources[chunks[c].source].metadata.codec.nbytes) for c in group)
        if total > max_group and len(group) > 1:  # the gaps pushed it over: split and try again
            half = len(group) // 2
            pending.extendleft([group[half:], group[:half]])
            continue
        file_reads.append(FileRead(chunks[group[0]].path, tuple(group), tuple(reads)))
    return file_reads
