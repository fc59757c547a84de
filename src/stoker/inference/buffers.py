"""Recycled region buffers for a TileWriter: the accumulators of a written region serve the next one.

A region's accumulators are megabytes (a 64^3 region: 2 MiB of float64 per channel, and as much again
for the sum of weights). A fresh array of that size is new memory from the kernel, which faults in page
by page on first touch (each page zeroed on the way): on one 128x256x256 volume that was ~50 000 faults
and about a third of the ``hann`` blend's time. A buffer taken back from a written region costs one
``fill`` instead. The pool holds at most ``max_bytes`` of buffers (one more goes to the spare pool below,
or is dropped), so what it holds on top of the regions in flight is bounded; it is shared between the
caller's thread (``take``) and the background writers (``give``), hence the lock.

A writer's buffers would be new memory again for the next writer (a volume after another, in one
process), so a closed writer's pool hands what it holds to :data:`SPARE` (:meth:`BufferPool.release`),
a process-wide pool of at most ``SPARE_BYTES``, from which the next writers' pools take before they
allocate.

>>> pool = BufferPool(max_bytes=8 << 20)
>>> a = pool.take((64, 64, 64), np.float64)   # zeros
>>> pool.give(a)                              # after the region is written
>>> pool.take((64, 64, 64), np.float64) is a
True
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np


class BufferPool:
    """Arrays handed back by :meth:`give` and handed out again by :meth:`take` (see the module docstring)."""

    def __init__(self, max_bytes: int, spare: "BufferPool | None" = None) -> None:
        self.max_bytes = int(max_bytes)
        self.spare = spare  # taken from when this pool has no buffer of the shape; released to
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        self._held = 0

    def _pop(self, key: tuple[tuple[int, ...], str]) -> np.ndarray | None:
        with self._lock:
            free = self._free.get(key)
            buf = free.pop() if free else None
            self._held -= 0 if buf is None else buf.nbytes
        if buf is None and self.spare is not None:
            buf = self.spare._pop(key)
        return buf

    def take(self, shape: tuple[int, ...], dtype: Any, zero: bool = True) -> np.ndarray:
        """An array of ``shape`` and ``dtype``: zeros, or (``zero=False``) whatever it held."""
        key = (tuple(int(s) for s in shape), np.dtype(dtype).str)
        buf = self._pop(key)
        if buf is None:
            return np.zeros(key[0], dtype=dtype) if zero else np.empty(key[0], dtype=dtype)
        if zero:
            buf.fill(0)
        return buf

    def give(self, buf: np.ndarray) -> None:
        """Hand ``buf`` back (nothing may use it afterwards). When keeping it would hold more than ``max_bytes``
        it goes to :attr:`spare` (dropped past the spare's bound too): a grid's tiles keep more regions open
        at once than one per write thread, and a buffer dropped comes back as new memory for a later region
        (on a 128x256x256 volume of 64^3 regions, blend "none", no write threads: half of the region buffers,
        ~6000 page faults, 7% of the writer's CPU)."""
        if not (buf.flags.c_contiguous and buf.flags.owndata):
            return  # a view: its memory belongs to another array
        key = (tuple(buf.shape), buf.dtype.str)
        with self._lock:
            kept = self._held + buf.nbytes <= self.max_bytes
            if kept:
                self._free.setdefault(key, []).append(buf)
                self._held += buf.nbytes
        if not kept and self.spare is not None:  # outside this pool's lock: one lock held at a time
            self.spare.give(buf)

    def release(self) -> None:
        """Hand every buffer held to :attr:`spare` (which keeps what fits its bound), or drop them."""
        with self._lock:
            bufs = [b for free in self._free.values() for b in free]
            self._free, self._held = {}, 0
        if self.spare is not None:
            for buf in bufs:
                self.spare.give(buf)

    @property
    def held_bytes(self) -> int:
        """The bytes of the buffers waiting in the pool."""
        with self._lock:
            return self._held


#: the most a process keeps of closed writers' buffers for the next ones (see the module docstring)
SPARE_BYTES = 64 << 20
SPARE = BufferPool(SPARE_BYTES)


def _after_fork_in_child() -> None:
    """A forked child's spare pool: a new lock (a writer's thread may have held the parent's at the fork: the
    child's first take would wait for ever) and nothing held (the parent's buffers, copied on write)."""
    SPARE._lock = threading.Lock()
    SPARE._free, SPARE._held = {}, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["SPARE", "SPARE_BYTES", "BufferPool"]
