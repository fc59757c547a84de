"""Coalescing byte ranges of one file into fewer, larger reads.

Reading ``[0, 100)`` and ``[120, 200)`` as one ``[0, 200)`` read wastes 20 bytes
but saves a system call (or, remotely, a round trip)::

    >>> coalesce([(0, 100), (120, 80)], max_gap=64)
    [Read(offset=0, length=200, parts=((0, 0, 100), (1, 120, 80)))]

Each :class:`Read` remembers which requested ranges it serves and where they sit
inside it, so the caller can hand every request its own slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Read:
    offset: int
    length: int
    parts: tuple[tuple[int, int, int], ...]  # (request number, file offset, length)

    def slices(self) -> list[tuple[int, slice]]:
        """``(request number, slice into this read's buffer)`` for every request it serves."""
        return [(i, slice(off - self.offset, off - self.offset + n)) for i, off, n in self.parts]


def coalesce(ranges: Sequence[tuple[int, int]], max_gap: int = 64 << 10, max_length: int = 64 << 20) -> list[Read]:
    """Merge ``(offset, length)`` ranges whose gaps are at most ``max_gap`` bytes.

    Merged reads never exceed ``max_length`` unless a single range does. Overlapping
    and duplicate ranges are allowed. Reads come out sorted by offset.
    """
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    reads: list[Read] = []
    start = end = -1
    parts: list[tuple[int, int, int]] = []
    for i in order:
        off, n = ranges[i]
        if parts and off - end <= max_gap and max(end, off + n) - start <= max_length:
            end = max(end, off + n)
            parts.append((i, off, n))
            continue
        if parts:
            reads.append(Read(start, end - start, tuple(parts)))
        start, end, parts = off, off + n, [(i, off, n)]
    if parts:
        reads.append(Read(start, end - start, tuple(parts)))
    return reads
