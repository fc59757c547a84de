"""Planning one batch: which read chunks it needs, once each, and where their bytes are.

A :class:`BatchPlan` is plain data (no buffers, no threads). The only I/O the
planner causes is through the lookups it is handed (array metadata and shard
indexes, both cached by their owners), so it can be tested on its own:

>>> plan = plan_batch(0, samples, open_reader)
>>> plan.chunks_needed, len(plan.chunks)      # before and after de-duplication
(64, 61)

Per chunk it records every copy (batch row, selection in the chunk, selection in
the crop) and the byte range of the decoded chunk the copies actually read, so
the executor can decode only that part where the codec allows it.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..array import ArrayReader
from ..box import box_shape, check_in_bounds
from ..sample import Sample
from ..storage.ranges import Read, coalesce
from ..zarr.grid import c_order_span, chunk_intersections


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs several times more, per copy
class Copy:
    """Copy ``chunk[chunk_sel]`` into ``batch[row][box_sel]`` (``batch[dst]``)."""

    row: int
    chunk_sel: tuple[slice, ...]
    box_sel: tuple[slice, ...]
    dst: tuple = field(init=False, repr=False, compare=False)  # (row, *box_sel): built once, used per chunk

    def __post_init__(self) -> None:
        self.dst = (self.row, *self.box_sel)


@dataclass
class ChunkTask:
    """One read chunk of one array, needed by one or more samples of the batch."""

    source: int  # index into BatchPlan.sources
    index: tuple[int, ...]
    key: str
    copies: list[Copy] = field(default_factory=list)
    path: str | None = None  # file holding the chunk; None: fill value
    offset: int | None = None  # byte range in ``path`` (sharded); None: the whole file
    length: int | None = None
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


@dataclass
class BatchPlan:
    batch_id: int
    samples: tuple[Sample, ...]
    sample_shape: tuple[int, ...]
    sources: list[ArrayReader]
    chunks: list[ChunkTask]
    file_reads: list[FileRead]
    chunks_needed: int  # sum over samples of chunks touched (before de-duplication)
    bytes_needed: int  # source-dtype bytes the samples hold (what a perfect reader would decode)

    @property
    def rows(self) -> int:
        return len(self.samples)

    @property
    def fill_chunks(self) -> list[int]:
        return [i for i, c in enumerate(self.chunks) if c.fill]


def _groups(cids: list[int], chunks: list[ChunkTask], cost: Callable[[ChunkTask], int], limit: int) -> list[list[int]]:
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
) -> BatchPlan:
    """Plan one batch. Raises the typed errors of opening arrays and of out-of-bounds boxes.

    Inner chunks of one shard are read together, coalesced, in groups whose cost
    stays within ``max_group`` (unless a group is a single chunk). A group costs
    what the executor reserves for it: ``sizing`` of each coalesced read (gaps
    included) plus ``sizing`` of each chunk's decoded size.
    """
    sources: list[ArrayReader] = []
    source_of: dict[str, int] = {}
    tasks: dict[tuple[int, tuple[int, ...]], ChunkTask] = {}
    needed = 0
    bytes_needed = 0
    for row, sample in enumerate(samples):
        sid = source_of.get(sample.uri)
        if sid is None:
            sid = source_of[sample.uri] = len(sources)
            sources.append(open_reader(sample.uri))
        reader = sources[sid]
        check_in_bounds(sample.aabb, reader.shape, sample.uri)
        bytes_needed += math.prod(sample.shape) * reader.dtype.itemsize
        for piece in chunk_intersections(sample.aabb, reader.chunks):
            needed += 1
            task = tasks.get((sid, piece.index))
            if task is None:
                task = tasks[(sid, piece.index)] = ChunkTask(sid, piece.index, "")
            task.copies.append(Copy(row, piece.chunk_sel, piece.box_sel))

    chunks = list(tasks.values())
    by_shard: dict[str, list[int]] = {}
    file_reads: list[FileRead] = []
    for cid, task in enumerate(chunks):
        reader = sources[task.source]
        meta = reader.metadata
        task.byte_start, task.byte_stop = c_order_span(meta.read_chunk_shape, meta.dtype.itemsize, (c.chunk_sel for c in task.copies))
        loc = reader.locate(task.index)
        task.key, task.path = loc.key, loc.path
        if loc.path is None:
            continue  # missing shard or empty inner chunk: fill
        if loc.offset is None:
            file_reads.append(FileRead(loc.path, (cid,)))
            continue
        task.offset, task.length = loc.offset, loc.length
        by_shard.setdefault(task.path, []).append(cid)

    def chunk_cost(task: ChunkTask) -> int:
        return sizing(task.length) + sizing(sources[task.source].metadata.codec.nbytes)

    pending = collections.deque(
        g for cids in by_shard.values() for g in _groups(cids, chunks, chunk_cost, max_group)
    )
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
    shape = box_shape(samples[0].aabb) if samples else ()
    return BatchPlan(batch_id, tuple(samples), shape, sources, chunks, file_reads, needed, bytes_needed)
