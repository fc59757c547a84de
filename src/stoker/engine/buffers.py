"""Host memory inside ``host_buffer_bytes``: batch slots plus a budget for transient buffers.

Two parts share the cap:

- :class:`SlotRing`: a fixed number of batch-sized tensors. A slot is reused only
  when its batch was released **and** no tensor still views its storage (a
  ``torch.from_dlpack`` result, a slice of it, a numpy view...), so a batch the
  user still holds is never overwritten.
- :class:`TransientBudget`: encoded bytes and decode scratch of in-flight chunks.
  A task reserves everything it will need in one step, and never waits while it
  holds a reservation, so reservations cannot deadlock. Freed scratch buffers are
  kept for reuse (fresh pages cost a page fault each) and count against the cap.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable

import numpy as np
import torch

from ..errors import ShutdownError


def storage_refs(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s storage, or None when torch cannot tell us."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    return int(fn(tensor.untyped_storage()._cdata))


class Cancelled(Exception):
    """Internal: work stopped because the pipeline is closing."""


class TransientBudget:
    """Byte budget for in-flight buffers, with a free list of decode scratch buffers."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._reserved = 0
        self._cached = 0
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._cond = threading.Condition()
        self.peak = 0

    @property
    def in_use(self) -> int:
        return self._reserved + self._cached

    def reserve(self, nbytes: int, cancelled: Callable[[], bool]) -> None:
        """Wait until ``nbytes`` fit (dropping cached buffers if needed); raise Cancelled on close."""
        if nbytes > self.capacity:
            raise ValueError(f"a reservation of {nbytes} bytes exceeds the budget of {self.capacity}")
        with self._cond:
            while True:
                while self._reserved + self._cached + nbytes > self.capacity and self._cached:
                    self._drop_one_locked()
                if self._reserved + self._cached + nbytes <= self.capacity:
                    self._reserved += nbytes
                    self.peak = max(self.peak, self._reserved + self._cached)
                    return
                if cancelled():
                    raise Cancelled()
                self._cond.wait(0.05)

    def _drop_one_locked(self) -> None:
        for size, pool in self._free.items():
            if pool:
                pool.pop()
                self._cached -= size
                return

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._reserved -= nbytes
            self._cond.notify_all()

    def take_scratch(self, nbytes: int) -> np.ndarray:
        """A ``nbytes`` uint8 buffer from inside an existing reservation (never waits)."""
        with self._cond:
            pool = self._free.get(nbytes)
            if pool:
                self._cached -= nbytes  # the buffer now lives inside the caller's reservation
                return pool.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give_scratch(self, buf: np.ndarray) -> None:
        """Return a scratch buffer: its share of the reservation becomes cached memory."""
        with self._cond:
            self._reserved -= buf.nbytes
            self._free[buf.nbytes].append(buf)
            self._cached += buf.nbytes
            self._cond.notify_all()


class Slot:
    __slots__ = ("index", "tensor", "busy", "baseline")

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.tensor = tensor
        self.busy = False
        self.baseline = storage_refs(tensor)


class SlotRing:
    """``n`` batch slots; :meth:`acquire` returns one no consumer can still see."""

    def __init__(self, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype
        self.slots = [Slot(i, torch.empty(shape, dtype=dtype)) for i in range(n)]
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.slots)

    def _free_locked(self) -> Slot | None:
        for slot in self.slots:
            if slot.busy:
                continue
            refs = storage_refs(slot.tensor)
            if refs is None or refs <= slot.baseline:
                return slot
        return None

    def acquire(self, cancelled: Callable[[], bool], timeout: float | None = None) -> Slot | None:
        """A free slot (marked busy), or None after ``timeout``. Views die without telling us, so poll."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                slot = self._free_locked()
                if slot is not None:
                    slot.busy = True
                    return slot
                if cancelled():
                    raise ShutdownError("pipeline closed")
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                self._cond.wait(0.002)

    def release(self, slot: Slot) -> None:
        with self._cond:
            slot.busy = False
            self._cond.notify_all()

    def held(self) -> int:
        """Slots a consumer still holds (released or not, but with live views)."""
        with self._cond:
            return sum(1 for s in self.slots if s.busy or (storage_refs(s.tensor) or 0) > (s.baseline or 0))
