"""Splitting an epoch's global order across ranks, and resuming it, possibly on another world size.

Pure arithmetic on positions ``0..n-1`` of an epoch's global order, in memory
independent of ``n``: the positions an epoch has left are :class:`Positions`, a
few disjoint intervals, and a rank's share is a lazy sequence over them.

>>> list(rank_positions(Positions.range(10), rank=1, world_size=3, policy="strided", even="wrap"))
[1, 4, 7, 0]               # 10 samples over 3 ranks: 4 each, the short rank wraps to the start
>>> consumed(Positions.range(10), world_size=3, steps=2, policy="strided", even="wrap")
Positions([(0, 6)])        # after 2 lockstep steps: a prefix, for the strided policy

A run that stopped after ``steps`` batches of samples on ``W`` ranks leaves the
positions ``remaining_after(...)``; a resumed run (any world size) splits those.
Every rank always gets the same number of samples, so no rank waits in a
collective for a batch that never comes.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence as _SequenceABC
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..checks import rank_in_world
from ..errors import InvalidArgument

POLICIES = ("strided", "contiguous")
EVEN = ("wrap", "drop")

Ranges = list[tuple[int, int]]  # sorted, disjoint, non-empty half-open intervals


def check(rank: int, world_size: int, policy: str, even: str) -> tuple[int, int]:
    """``(rank, world_size)`` as ints, after checking them and the policy names."""
    rank, world_size = rank_in_world(rank, world_size)
    if policy not in POLICIES:
        raise InvalidArgument(f"policy must be one of {POLICIES}, got {policy!r}")
    if even not in EVEN:
        raise InvalidArgument(f"even must be one of {EVEN}, got {even!r}")
    return rank, world_size


def per_rank(n: int, world_size: int, even: str) -> int:
    """Samples every rank gets from ``n`` remaining ones."""
    return -(-n // world_size) if even == "wrap" else n // world_size


class Positions(_SequenceABC):
    """A sorted set of positions held as disjoint intervals; ``p[i]`` is its i-th smallest member.

    Indexing takes O(log intervals); the size of the set does not matter.
    """

    __slots__ = ("intervals", "_starts", "_before")

    def __init__(self, intervals: Iterable[tuple[int, int]] = ()) -> None:
        merged: Ranges = []
        for a, b in intervals:  # sorted and disjoint by construction; touching ones are joined
            if b <= a:
                continue
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], int(b))
            else:
                merged.append((int(a), int(b)))
        self.intervals = merged
        self._starts = [a for a, _ in merged]
        self._before = [0]  # members in the intervals before each one; the last entry is the size
        for a, b in merged:
            self._before.append(self._before[-1] + b - a)

    @classmethod
    def range(cls, n: int) -> "Positions":
        """All positions ``0..n-1``."""
        return cls([(0, n)])

    def __len__(self) -> int:
        return self._before[-1]

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        i = operator.index(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} positions")
        k = bisect.bisect_right(self._before, i) - 1
        return self._starts[k] + i - self._before[k]

    def __iter__(self) -> Iterator[int]:
        for a, b in self.intervals:
            yield from range(a, b)

    def take(self, index: np.ndarray) -> np.ndarray:
        """``[self[i] for i in index]`` as an int64 array, vectorised (indices in ``0..len-1``)."""
        index = np.asarray(index, dtype=np.int64)
        before = np.asarray(self._before[:-1], dtype=np.int64)
        k = np.searchsorted(before, index, side="right") - 1
        return np.asarray(self._starts, dtype=np.int64)[k] + (index - before[k])

    def select(self, ranges: Ranges) -> "Positions":
        """The members whose indices lie in ``ranges`` (sorted, disjoint index intervals within ``len``)."""
        out: Ranges = []
        for i, j in ranges:
            k = bisect.bisect_right(self._before, i) - 1
            while i < j:
                a, b = self.intervals[k]
                start = a + i - self._before[k]
                stop = min(b, start + j - i)
                out.append((start, stop))
                i += stop - start
                k += 1
        return Positions(out)

    def __repr__(self) -> str:
        return f"Positions({self.intervals})"


class RankPositions(_SequenceABC):
    """The positions one rank visits, in order, computed on demand (see :func:`rank_positions`)."""

    __slots__ = ("remaining", "rank", "world_size", "policy", "_m")

    def __init__(self, remaining: Positions, rank: int, world_size: int, policy: str, m: int) -> None:
        self.remaining, self.rank, self.world_size, self.policy, self._m = remaining, rank, world_size, policy, m

    def __len__(self) -> int:
        return self._m

    def _index(self, j):  # an int or an int64 array; only "wrap" ever reaches past the end (mod n)
        idx = self.rank + j * self.world_size if self.policy == "strided" else self.rank * self._m + j
        return idx % len(self.remaining)

    def __getitem__(self, j: int) -> int:  # type: ignore[override]
        j = operator.index(j)
        if j < 0:
            j += self._m
        if not 0 <= j < self._m:
            raise IndexError(f"index {j} out of range for {self._m} positions of rank {self.rank}")
        return self.remaining[self._index(j)]

    def __iter__(self) -> Iterator[int]:
        return (self[j] for j in range(self._m))

    def to_array(self) -> np.ndarray:
        """All of them as an int64 array (memory proportional to this rank's share)."""
        if self._m == 0:
            return np.zeros(0, dtype=np.int64)
        return self.remaining.take(self._index(np.arange(self._m, dtype=np.int64)))

    def __repr__(self) -> str:
        return f"RankPositions(rank={self.rank}, world_size={self.world_size}, {self.policy}, {self._m} of " \
               f"{self.remaining!r})"


def rank_positions(remaining: Positions, rank: int, world_size: int, policy: str, even: str) -> RankPositions:
    """The positions (members of ``remaining``) rank ``rank`` visits, in order.

    Index ``j`` of the rank's share is ``remaining[(rank + j * world_size) % n]`` (strided) or
    ``remaining[(rank * m + j) % n]`` (contiguous, ``m`` samples per rank).
    """
    m = per_rank(len(remaining), world_size, even)
    return RankPositions(remaining, rank, world_size, policy, m)


def _consumed_indices(n: int, world_size: int, steps: int, policy: str, even: str) -> Ranges:
    """Indices (into ``n`` remaining positions) all ranks consumed after ``steps`` lockstep samples each."""
    m = per_rank(n, world_size, even)
    steps = min(steps, m)
    if n == 0 or steps == 0:
        return []
    if policy == "strided":  # rank r took r, r+W, ...: together the indices 0 .. W*steps-1
        return [(0, min(n, world_size * steps))]
    pieces = []
    for r in range(world_size):  # rank r took r*m .. r*m+steps-1, wrapped mod n (steps <= m <= n)
        a = r * m % n
        b = a + steps
        pieces += [(a, n), (0, b - n)] if b > n else [(a, b)]
    merged: Ranges = []
    for a, b in sorted(pieces):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def consumed(remaining: Positions, world_size: int, steps: int, policy: str, even: str) -> Positions:
    """Positions all ranks together consumed after ``steps`` samples each (lockstep), no duplicates."""
    return remaining.select(_consumed_indices(len(remaining), world_size, steps, policy, even))


def remaining_after(n: int, segments: Sequence[Sequence]) -> Positions:
    """Positions of an epoch of ``n`` not consumed by earlier runs, in global order.

    ``segments`` lists each earlier run as ``(world_size, policy, even, steps)``.
    """
    remaining = Positions.range(n)
    for world_size, policy, even, steps in segments:
        if even == "drop" and int(steps) >= per_rank(len(remaining), int(world_size), even):
            return Positions()  # that run finished its epoch: the dropped tail is not carried over
        done = _consumed_indices(len(remaining), int(world_size), int(steps), policy, even)
        keep, start = [], 0
        for a, b in done:
            keep.append((start, a))
            start = b
        keep.append((start, len(remaining)))
        remaining = remaining.select([(a, b) for a, b in keep if b > a])
    return remaining
