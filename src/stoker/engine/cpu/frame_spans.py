"""Fetch only the blocks a crop needs of a blosc chunk in an object store.

A blosc1 frame is a 16-byte header, a table of where each block is stored, then the blocks; the engine
decodes only the blocks that hold a crop's bytes when they are at most ``PARTIAL_MAX_SHARE`` of the chunk
(csrc/codecs.c, the rule of :mod:`stoker.zarr.codecs.blosc`). From a local file it reads just those blocks;
from an object store the first fetch of a chunk has to take the whole value, since nothing says where its
blocks are. :class:`FrameTables` keeps the header and table of each blosc frame fetched whole from a store,
with the version of the object it came from (:data:`~stoker.storage.objectstore.Version`: its size and
ETag). A later crop of the same chunk then fetches one range, the stored bytes of the blocks it needs
(:meth:`FrameTables.span`), and :func:`assemble` lays them out where they sit in the frame, in a buffer of
the frame's size holding the kept header and table; the engine decodes that buffer as the whole frame, and
reads only those blocks (the rest of the buffer is zeros it never reads).

A range whose answer comes from another version of the object (rewritten since its table was kept), or
whose object is now gone or shorter than the range, is not decoded: its table is forgotten and the chunk
fetched whole again (:meth:`FrameTables.fits`; a missing value then reads as the fill value). A store that
sends no ETag gets no spans: nothing could tell its versions apart. Versions are compared after the read
(no ``If-Match``): a server whose ETag stays the same across a rewrite (one made of the size and a
modification time in whole seconds, rewritten twice in a second) cannot be told apart by either.

>>> tables = FrameTables()
>>> tables.learn(store_id, "c/0/1", frame, nbytes=1 << 20, version=(736564, '"abc"'))
>>> lo, hi, table = tables.span(store_id, "c/0/1", nbytes=1 << 20, byte_start=0, byte_stop=200_000)
>>> buffer = assemble(table, lo, fetched)   # then decoded as the whole frame
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

from ...runtime import gil
from ...storage.cache import SizedLRU
from ...zarr.codecs import blosc
from ..allocate import host_bytes

#: default bound on the tables kept per pipeline: about 100,000 frames of 4-16 blocks
DEFAULT_TABLE_BYTES = 16 << 20
_ENTRY_OVERHEAD = 200  # bytes of Python objects around each kept header and table


@dataclass(frozen=True)
class FrameTable:
    """What is kept of one blosc frame: its header and block table (``head``), its stored size
    (``cbytes``) and the version of the object it was fetched from."""

    head: bytes
    cbytes: int
    version: Any


class FrameTables:
    """Headers and block tables of blosc frames fetched whole from object stores, by ``(store, key)``;
    bounded by ``max_bytes`` (least recently used first out). Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_TABLE_BYTES) -> None:
        self._kept: SizedLRU[FrameTable] = SizedLRU(max_bytes, lambda t: len(t.head) + _ENTRY_OVERHEAD)

    def __len__(self) -> int:
        return len(self._kept)

    def learn(self, store: Hashable, key: str, frame: Any, nbytes: int, version: Any) -> None:
        """Keep the header and table of ``frame`` (a chunk of ``nbytes`` decoded bytes, the whole value of
        ``key``) when a later crop could fetch only some of its blocks: a sound blosc1 frame of that size,
        blocks not memcpy'd, whole items, and a version to check later reads against."""
        if version is None:
            return
        try:
            typesize, size, blocksize, cbytes = blosc.frame_info(frame)
            mv = memoryview(frame).cast("B")
            table_end = blosc.table_size(mv[:blosc.HEADER_SIZE])
        except (blosc.PartialDecodeError, ValueError, TypeError):
            return  # the engine reports what is wrong with it
        if size != nbytes or size % typesize or table_end == blosc.HEADER_SIZE or nbytes <= blocksize:
            return  # decoded whole (another size, partial items, memcpy'd or a single block)
        self._kept.put((store, key), FrameTable(bytes(mv[:table_end]), cbytes, version))

    def span(self, store: Hashable, key: str, nbytes: int, byte_start: int,
             byte_stop: int) -> tuple[int, int, FrameTable] | None:
        """``(lo, hi, table)``: the stored bytes ``[lo, hi)`` of the blocks holding decoded bytes
        ``[byte_start, byte_stop)`` of ``key``'s frame, when its table is kept and the engine decodes that
        span from those blocks alone (the rule csrc/codecs.c applies: the blocks are at most
        ``PARTIAL_MAX_SHARE`` of the chunk); else None (fetch the whole value)."""
        table = self._kept.get((store, key))
        if table is None or not 0 <= byte_start < byte_stop <= nbytes:
            return None
        try:
            if not blosc.partial_ok(table.head, nbytes, byte_start, byte_stop):
                return None
            lo, hi = blosc.stored_range(table.head, byte_start, byte_stop)
        except blosc.PartialDecodeError:
            return None
        return max(lo, len(table.head)), hi, table

    def fits(self, store: Hashable, key: str, table: FrameTable, version: Any) -> bool:
        """Whether a range of ``key`` read at ``version`` came from the object ``table`` was learnt from;
        when not, the table is forgotten (the chunk is then fetched whole, and its new table learnt)."""
        if version is not None and version == table.version:
            return True
        self.forget(store, key, table)
        return False

    def forget(self, store: Hashable, key: str, table: FrameTable) -> None:
        """Drop ``table`` of ``key`` (if it is still the one kept): its object changed or is gone."""
        self._kept.discard((store, key), lambda kept: kept is table)


#: byte spans ``(start, stop)`` of a buffer
Spans = tuple[tuple[int, int], ...]


class FrameBuffers:
    """Buffers the assembled frames are laid out in, used again once the engine is done with them: a fresh
    buffer costs a page fault per 4 KiB page on its first write (176 us of CPU for a 736 KB frame of
    scenario 1, measured in the pipeline), one used before costs none. At most ``max_bytes`` of free
    buffers are kept; a buffer is given back only when nothing else can still read it. Thread-safe.

    :meth:`assemble` also remembers which bytes of each buffer a frame wrote, so the next frame laid out in it
    writes zeros only where the last one left bytes, not over the whole frame: a span is about half of its
    frame in scenario 1, and those zeros were about half of the cost of laying it out (a new buffer is
    zeroed by the allocator, which leaves its untouched pages unmapped).

    >>> pool = FrameBuffers()
    >>> out = pool.take(736_564)      # len(out) == 736_564, from a free buffer when one is large enough
    >>> pool.give([out])              # once the engine's job that read it is done
    >>> frame = pool.assemble(table, lo, blocks)  # assemble() into a buffer of the pool
    """

    ROUND = 64 << 10  # buffers are made in sizes rounded up to this, so frames of near sizes share them

    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self.max_bytes = max_bytes
        # free buffers by size (a multiple of ROUND), each with the spans of it that may hold bytes other than zero
        # (None: any byte may), and their sizes in order: the smallest that fits is found by bisection, not by a
        # scan of every free buffer (32 MiB of them are some 40, and a batch takes tens)
        self._free: dict[int, list[tuple[np.ndarray, Spans | None]]] = {}
        self._sizes: list[int] = []
        self._free_bytes = 0
        # what the frames laid out by assemble wrote, by id of the buffer lent (dropped if the buffer dies lent)
        self._written: dict[int, Spans] = {}
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)

    def _take(self, nbytes: int, zeroed: bool) -> tuple[np.ndarray, Spans | None]:
        """A whole buffer of at least ``nbytes`` and its spans that may hold bytes (a new one: ``()`` when
        ``zeroed``, else None)."""
        with self._lock:
            at = bisect.bisect_left(self._sizes, nbytes)
            if at < len(self._sizes):  # the smallest free buffer that fits (the one given back last of that size)
                size = self._sizes[at]
                same = self._free[size]
                base, written = same.pop()
                if not same:
                    del self._free[size]
                    del self._sizes[at]
                self._free_bytes -= len(base)
                return base, written
        size = -(-nbytes // self.ROUND) * self.ROUND
        base = host_bytes(size, "a blosc frame's fetched blocks", zeroed=zeroed)
        # its record of what was written goes with it, should it die lent (dropped by a failed batch): every
        # new buffer, as one from take() may be given back, then lent by assemble (a record left at its id
        # would be picked up by a later buffer at the same id: zeros not written where they are needed)
        weakref.finalize(base, self._written.pop, id(base), None)
        return base, (() if zeroed else None)

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes`` (its contents whatever they were: :func:`assemble` writes every byte)."""
        return self._take(nbytes, zeroed=False)[0][:nbytes]

    def assemble(self, table: FrameTable, lo: int, blocks: Any) -> np.ndarray:
        """:func:`assemble` into a buffer of the pool: the same bytes, but zeros written only over what an
        earlier frame left in that buffer."""
        base, written = self._take(table.cbytes, zeroed=True)
        data = np.frombuffer(blocks, np.uint8)
        head, end = len(table.head), table.cbytes
        ours = ((0, head), (lo, lo + len(data)))
        left = ((0, len(base)),) if written is None else written
        zeros = _minus(_within(left, 0, end), ours)
        out = base[:end]
        out[:head] = np.frombuffer(table.head, np.uint8)
        gil.released(_write, out, zeros, lo, data)
        with self._lock:  # what may hold bytes now: this frame's, and what is left past its end
            self._written[id(base)] = ours + _within(left, end, len(base))
        return out

    def give(self, buffers: list[np.ndarray]) -> None:
        """Keep ``buffers`` (from :meth:`take` or :meth:`assemble`) for later frames, within ``max_bytes``."""
        with self._lock:
            for b in buffers:
                base = b.base if isinstance(b.base, np.ndarray) else b
                written = self._written.pop(id(base), None)  # None: taken, written by anyone
                if self._free_bytes + len(base) <= self.max_bytes:
                    size = len(base)
                    if size not in self._free:
                        self._free[size] = []
                        bisect.insort(self._sizes, size)
                    self._free[size].append((base, written))
                    self._free_bytes += size


def _within(spans: Spans, lo: int, hi: int) -> Spans:
    """The parts of ``spans`` inside ``[lo, hi)``."""
    return tuple((max(a, lo), min(b, hi)) for a, b in spans if max(a, lo) < min(b, hi))


def _minus(spans: Spans, cut: Spans) -> Spans:
    """The parts of ``spans`` outside every span of ``cut``."""
    for c0, c1 in cut:
        spans = tuple(part for a, b in spans for part in ((a, min(b, c0)), (max(a, c1), b)) if part[0] < part[1])
    return spans


def _write(out: np.ndarray, zeros: Spans, lo: int, data: np.ndarray) -> None:
    """Zeros over ``zeros``, ``data`` from ``lo`` (numpy fills and copies without holding the GIL)."""
    for a, b in zeros:
        out[a:b] = 0
    out[lo:lo + len(data)] = data


def assemble(table: FrameTable, lo: int, blocks: Any, out: np.ndarray | None = None) -> np.ndarray:
    """The frame ``table`` describes with ``blocks`` (its stored bytes from ``lo``) in place, as one
    buffer of the frame's size (``out`` when given, e.g. from :class:`FrameBuffers`): header and table,
    zeros, the blocks, zeros. Every byte is written, so nothing of another chunk is ever left in it, and
    the bulk of it without the GIL."""
    if out is None:
        out = host_bytes(table.cbytes, "a blosc frame's fetched blocks")
    out = out[:table.cbytes]
    head = np.frombuffer(table.head, np.uint8)
    out[:len(head)] = head
    gil.released(_lay_out, out, len(head), lo, np.frombuffer(blocks, np.uint8))
    return out


def _lay_out(out: np.ndarray, start: int, lo: int, data: np.ndarray) -> None:
    """Zeros in ``out[start:lo]`` and after the blocks, ``data`` from ``lo`` (numpy fills and copies without
    holding the GIL)."""
    hi = lo + len(data)
    out[start:lo] = 0
    out[lo:hi] = data
    out[hi:] = 0
