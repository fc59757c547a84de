"""Splitting an epoch's global order across ranks, and resuming it, possibly on another world size.

Pure arithmetic on positions ``0..n-1`` of an epoch's global order:

>>> rank_positions(remaining=np.arange(10), rank=1, world_size=3, policy="strided", even="wrap")
array([1, 4, 7, 0])        # 10 samples over 3 ranks: 4 each, the short rank wraps to the start
>>> consumed(np.arange(10), world_size=3, steps=2, policy="strided", even="wrap")
array([0, 1, 2, 3, 4, 5])  # after 2 lockstep steps: a prefix, for the strided policy

A run that stopped after ``steps`` batches of samples on ``W`` ranks leaves the
positions ``remaining_after(...)``; a resumed run (any world size) splits those.
Every rank always gets the same number of samples, so no rank waits in a
collective for a batch that never comes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .checks import rank_in_world
from .errors import InvalidArgument

POLICIES = ("strided", "contiguous")
EVEN = ("wrap", "drop")


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


def rank_positions(remaining: np.ndarray, rank: int, world_size: int, policy: str, even: str) -> np.ndarray:
    """The positions (values of ``remaining``) rank ``rank`` visits, in order."""
    n = len(remaining)
    m = per_rank(n, world_size, even)
    if n == 0 or m == 0:
        return remaining[:0]
    j = np.arange(m)
    idx = rank + j * world_size if policy == "strided" else rank * m + j
    return remaining[idx % n]  # only "wrap" ever reaches past the end: short ranks wrap to the start


def consumed(remaining: np.ndarray, world_size: int, steps: int, policy: str, even: str) -> np.ndarray:
    """Positions all ranks together consumed after ``steps`` samples each (lockstep), no duplicates."""
    n = len(remaining)
    m = per_rank(n, world_size, even)
    steps = min(steps, m)
    if n == 0 or steps == 0:
        return remaining[:0]
    ranks = np.arange(world_size)[:, None]
    j = np.arange(steps)[None, :]
    idx = (ranks + j * world_size) if policy == "strided" else (ranks * m + j)
    return remaining[np.unique(idx.reshape(-1) % n)]


def remaining_after(n: int, segments: Sequence[Sequence]) -> np.ndarray:
    """Positions of an epoch of ``n`` not consumed by earlier runs, in global order.

    ``segments`` lists each earlier run as ``(world_size, policy, even, steps)``.
    """
    remaining = np.arange(n, dtype=np.int64)
    for world_size, policy, even, steps in segments:
        done = consumed(remaining, int(world_size), int(steps), policy, even)
        if even == "drop" and int(steps) >= per_rank(len(remaining), int(world_size), even):
            return remaining[:0]  # that run finished its epoch: the dropped tail is not carried over
        remaining = remaining[~np.isin(remaining, done)]
    return remaining
