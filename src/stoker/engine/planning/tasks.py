"""A batch plan's chunks as the Python path reads them: one chunk (:class:`ChunkTask`, its copies as
:class:`Copy`), one file's share of the batch (:class:`FileRead`), and a shard's inner chunks coalesced
into bounded reads (:func:`shard_reads`).

:class:`~stoker.engine.planning.tables.TablePlan` makes them from its tables, only for the chunks the Python
path reads (all of a batch without the compiled engine, else the few the engine leaves):

>>> fills, reads = plan.python_reads(max_group=8 << 20)
>>> reads[0].chunk_ids, plan.chunks[reads[0].chunk_ids[0]].key
((0,), 'c/0/0/0')
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ...storage.ranges import Read, coalesce


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

    source: int  # index into the plan's sources
    index: tuple[int, ...]
    key: str
    copies: list[Copy] = field(default_factory=list)
    path: str | None = None  # file holding the chunk; None: fill value
    offset: int | None = None  # byte range in ``path`` (sharded); None: the whole file
    length: int | None = None
    ident: tuple | None = None  # sharded: the identity of the shard file its index was read from
    byte_start: int = 0  # decoded bytes the copies read (in the decoded layout), for partial decoding
    byte_stop: int = 0

    @property
    def fill(self) -> bool:
        return self.path is None


@dataclass(frozen=True)
class FileRead:
    """One file's share of the batch: the whole file (one chunk) or coalesced ranges (inner chunks)."""

    path: str
    chunk_ids: tuple[int, ...]  # chunk numbers in the plan, in request order
    reads: tuple[Read, ...] = ()  # empty: read the whole file for chunk_ids[0]

    @property
    def whole_file(self) -> bool:
        return not self.reads

    @classmethod
    def inner_chunk(cls, path: str, cid: int, offset: int, length: int) -> "FileRead":
        """A read of one inner chunk of a shard on its own: ``length`` bytes at ``offset`` of ``path``."""
        return cls(path, (cid,), (Read(offset, length, ((0, offset, length),)),))


def _groups(order: list[int], cost: list[int], limit: int) -> list[list[int]]:
    """Split one shard's chunks (positions ``order``, in file order) into groups costing at most ``limit``
    (a lone chunk always fits)."""
    groups: list[list[int]] = []
    total = 0
    for k in order:
        c = cost[k]
        if groups and total + c <= limit:
            groups[-1].append(k)
            total += c
        else:
            groups.append([k])
            total = c
    return groups


def shard_reads(path: str, cids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, decoded: np.ndarray,
                max_gap: int, max_group: int, sizing: Callable[[int], int]) -> list[FileRead]:
    """The reads of one shard file's inner chunks ``cids`` (in chunk order; at ``offsets``, ``lengths`` bytes
    long, ``decoded`` bytes each once decoded): in file order, nearby ones (at most ``max_gap`` apart)
    coalesced, in groups whose cost stays within ``max_group`` unless a group is a single chunk. A group costs
    what the Python path reserves for it: ``sizing`` of each coalesced read (gaps included) plus ``sizing`` of
    each chunk's decoded size.

    >>> [fr.chunk_ids for fr in shard_reads("s", np.array([4, 7]), np.array([100, 0]), np.array([50, 50]),
    ...                                      np.array([64, 64]), 64 << 10, 8 << 20, lambda n: n)]
    [(7, 4)]
    """
    ids, offs, lens = cids.tolist(), offsets.tolist(), lengths.tolist()
    scratch = [sizing(n) for n in decoded.tolist()]
    cost = [sizing(n) + s for n, s in zip(lens, scratch)]
    order = np.argsort(offsets, kind="stable").tolist()
    file_reads = []
    pending = collections.deque(_groups(order, cost, max_group))
    while pending:
        group = pending.popleft()
        reads = coalesce([(offs[k], lens[k]) for k in group], max_gap=max_gap, max_length=max_group)
        total = sum(sizing(r.length) for r in reads) + sum(scratch[k] for k in group)
        if total > max_group and len(group) > 1:  # the gaps pushed it over: split and try again
            half = len(group) // 2
            pending.extendleft([group[half:], group[:half]])
            continue
        file_reads.append(FileRead(path, tuple(ids[k] for k in group), tuple(reads)))
    return file_reads
