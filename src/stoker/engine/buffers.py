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

A pipeline's slots would be new memory again for the next pipeline (a :class:`~stoker.CropDataset`
iterated again makes one per epoch; a volume after another in inference): each slot's pages fault in and
are zeroed by the kernel at the first batch, which was a quarter of the CPU of reading a 128x256x256
volume's tiles. So a closed ring hands its plain host slots that no tensor views any more to
:data:`SPARE_SLOTS` (:meth:`SlotRing.close`), a process-wide pool of at most :data:`SPARE_SLOT_BYTES`
keyed by size, from which the next rings take before they allocate.
"""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
from collections import OrderedDict, defaultdict
from typing import Callable

import numpy as np
import torch

from ..errors import BudgetExceeded, ShutdownError
from ..runtime import gil
from .allocate import advise_huge_pages, allocate, host_bytes


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _alone() -> int | None:
    """What :meth:`Slot.refs` reads for a tensor over memory nothing else holds, measured as it measures (the
    storage's handle first, its Python object gone): a fresh tensor's count, the baseline of every slot."""
    if _use_count is None:
        return None
    tensor = torch.empty(1)
    storage = tensor.untyped_storage()._cdata
    return int(_use_count(storage))


#: the baseline of a slot over pooled memory (SPARE_SLOTS): a constant, not measured on the slot, where a
#: holder left over from the memory's last owner (a closing ring's local, see SpareSlots.give) would raise it
#: and make one live view of a batch read as none; such a holder only makes the slot look taken a moment longer
_ALONE = _alone()


class Cancelled(Exception):
    """Internal: work stopped because the pipeline is closing."""


_GRAIN = 64 << 10  # buffers are pooled in 64 KiB size classes


def size_class(nbytes: int) -> int:
    """The pooled capacity that holds ``nbytes``."""
    return max(_GRAIN, -(-nbytes // _GRAIN) * _GRAIN)


class TransientBudget:
    """Byte budget for in-flight buffers, with a free list of reusable buffers.

    ``reserved`` bytes are promised to in-flight work (buffers in use count here);
    ``cached`` bytes are free buffers kept for reuse. ``reserved + cached`` never
    exceeds ``capacity``: cached buffers are dropped to make room.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._reserved = 0
        self._cached = 0
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._cond = threading.Condition()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._waiting = 0  # threads inside reserve()'s wait: only then do returns need a notify
        self.peak = 0

    @property
    def in_use(self) -> int:
        return self._reserved + self._cached

    @property
    def reserved(self) -> int:
        return self._reserved

    def reserve(self, nbytes: int, cancelled: Callable[[], bool]) -> None:
        """Wait until ``nbytes`` fit (dropping cached buffers if needed); raise Cancelled on close."""
        self._check_capacity(nbytes)
        with self._cond:
            while not self._reserve_locked(nbytes):
                if cancelled():
                    raise Cancelled()
                self._waiting += 1
                try:
                    gil.wait(self._cond, 0.05)
                finally:
                    self._waiting -= 1

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit now; never waits."""
        self._check_capacity(nbytes)
        with self._cond:
            return self._reserve_locked(nbytes)

    def _check_capacity(self, nbytes: int) -> None:
        if nbytes > self.capacity:
            raise BudgetExceeded(
                f"reading and decoding one group of chunks needs {nbytes:,} B, but host_buffer_bytes leaves "
                f"{self.capacity:,} B next to the batch slots; raise Config.host_buffer_bytes",
                knob="host_buffer_bytes", needed=nbytes,
            )

    def _reserve_locked(self, nbytes: int) -> bool:
        # drop cached buffers only when that makes the request fit
        while self._cached and self._reserved + nbytes <= self.capacity < self._reserved + self._cached + nbytes:
            self._drop_one_locked()
        if self._reserved + self._cached + nbytes > self.capacity:
            return False
        self._reserved += nbytes
        self.peak = max(self.peak, self._reserved + self._cached)
        return True

    def _drop_one_locked(self) -> None:
        for size, pool in self._free.items():
            if pool:
                pool.pop()
                self._cached -= size
                return

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` of a reservation that no buffer holds."""
        self.give_back([], nbytes)

    def give_back(self, bufs: list[np.ndarray], nbytes: int = 0) -> None:
        """Return buffers (their share of a reservation becomes cached memory) and release ``nbytes``
        more of it, under one lock: what a finished read does with everything it held."""
        with self._cond:
            for buf in bufs:
                self._reserved -= buf.nbytes
                self._free[buf.nbytes].append(buf)
                self._cached += buf.nbytes
            self._reserved -= nbytes
            if self._waiting:  # Condition.notify_all is Python code: skip it when nobody waits
                self._cond.notify_all()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``size_class(nbytes)`` bytes, paid for by the caller's reservation."""
        cap = size_class(nbytes)
        with self._cond:
            pool = self._free.get(cap)
            if pool:
                self._cached -= cap
                return pool.pop()
        return host_bytes(cap)

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer: its share of the caller's reservation becomes cached memory."""
        self.give_back([buf])


class Reservation:
    """What one unit of work (a file read and its chunks' decodes) holds of the budget.

    Shared by ``users`` tasks on several threads; when the last one calls
    :meth:`done`, whatever the buffers did not take back is released.
    """

    def __init__(self, budget: TransientBudget, users: int) -> None:
        self.budget = budget
        self.users = users
        self.held = 0
        self._kept: list[np.ndarray] = []  # buffers shared by all users, given back by the last
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)

    def reserve(self, nbytes: int, cancelled: Callable[[], bool]) -> None:
        self.budget.reserve(nbytes, cancelled)
        self._hold(nbytes)

    def try_reserve(self, nbytes: int) -> bool:
        if not self.budget.try_reserve(nbytes):
            return False
        self._hold(nbytes)
        return True

    def _hold(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes

    def take(self, nbytes: int, keep: bool = False) -> np.ndarray:
        """A pooled buffer inside this reservation; ``keep`` returns it when the last user is done."""
        buf = self.budget.take(nbytes)
        if keep:
            with self._lock:
                self._kept.append(buf)
        return buf

    def give(self, buf: np.ndarray) -> None:
        self.budget.give(buf)
        with self._lock:
            self.held -= buf.nbytes

    def done(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users:
                return
            kept, self._kept = self._kept, []
        with self._lock:
            rest, self.held = self.held - sum(b.nbytes for b in kept), 0
        self.budget.give_back(kept, rest)


class Slot:
    __slots__ = ("index", "tensor", "rows", "busy", "baseline", "ready_after", "stream_waits", "_storage")

    def __init__(self, index: int, tensor: torch.Tensor, pooled: bool = False) -> None:
        self.index = index
        self.tensor = tensor
        self.rows = tensor.shape[0] if tensor.dim() else 0
        self.busy = False
        # the storage's handle, asked for once: the slot's tensor keeps it (and never swaps it) for its life
        self._storage = tensor.untyped_storage()._cdata if _use_count is not None else None
        # fresh memory: its own count (nothing else can hold it yet); pooled memory: a fresh tensor's (_ALONE)
        self.baseline = _ALONE if pooled else self.refs()
        self.ready_after = None  # CUDA event the host waits for before reuse (a copy still reading the slot)
        self.stream_waits: list = []  # CUDA events/streams the next writer's stream must wait for

    def refs(self) -> int | None:
        """How many tensors share the slot's storage (itself and every view), or None when torch cannot tell."""
        return None if self._storage is None else int(_use_count(self._storage))

    def batch(self, rows: int) -> torch.Tensor:
        """A new view of the slot's first ``rows`` rows: a batch's target, whose life tells that the slot is
        still written or read (see :meth:`SlotRing.acquire`). A full slot's is a ``detach()``, which costs a
        third of a slice."""
        return self.tensor.detach() if rows == self.rows else self.tensor[:rows]

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot's first bytes as a ``shape`` tensor of ``dtype`` (byte slots hold any dtype)."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self.tensor.view(-1).view(torch.uint8)[:nbytes].view(dtype).view(shape)


def pinned_footprint(nbytes: int) -> int:
    """Page-locked bytes torch holds for an ``nbytes`` pinned tensor: its host allocator rounds each request
    up to a power of two (ATen/core/CachingHostAllocator.h, default settings), so 40 MiB pins 64 MiB.

    >>> pinned_footprint(40 << 20) >> 20
    64
    """
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


class SpareSlots:
    """Freed host batch slots waiting for the next :class:`SlotRing` (see the module docstring): flat
    ``uint8`` tensors keyed by their size in bytes, at most ``max_bytes`` of them, the oldest dropped first to
    make room for the newest (the next pipeline is most likely the one just closed, again).

    >>> spare = SpareSlots(max_bytes=64 << 20)
    >>> spare.give([torch.empty(16 << 20, dtype=torch.uint8)])
    >>> spare.take(16 << 20) is not None, spare.take(16 << 20)
    (True, None)
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._free: OrderedDict[int, torch.Tensor] = OrderedDict()  # id -> buffer, oldest first
        self._held = 0
        # adopted buffers a consumer still views: (buffer, its storage's handle, use count when ours alone)
        self._waiting: list[tuple[torch.Tensor, int, int]] = []
        self._waiting_bytes = 0
        self.taken = 0  # buffers handed out again (what spared a fresh allocation)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of exactly ``nbytes`` bytes that was given back (or adopted with :meth:`adopt` and no longer
        viewed), or None."""
        with self._lock:
            self._sweep_locked()
            for key, buf in reversed(self._free.items()):  # the newest: its pages are the likeliest in cache
                if buf.numel() == nbytes:
                    del self._free[key]
                    self._held -= nbytes
                    self.taken += 1
                    return buf
        return None

    def give(self, held: list[torch.Tensor]) -> None:
        """Keep the one buffer in ``held`` (a flat uint8 CPU tensor nothing else uses) for a later
        :meth:`take`, emptying the list under the pool's lock: the caller's reference is gone before another
        thread can take the buffer. The oldest buffers are dropped until it fits, and a buffer larger than
        ``max_bytes`` is not kept."""
        with self._lock:
            self._keep_locked(held.pop())

    def adopt(self, held: list[torch.Tensor], alone: int) -> None:
        """Keep the one buffer in ``held`` (a closed ring's slot that a consumer's batch still views: the last
        batch a loop holds as its pipeline closes, a volume after another in inference) until no tensor but
        ours views it (its storage's use count at most ``alone``), then as :meth:`give` would: looked at by
        each :meth:`take`. Emptied from the list under the lock, as :meth:`give`. At most ``max_bytes`` wait
        (the oldest let go first: their memory is the consumer's until it drops them, then the system's)."""
        with self._lock:
            buf = held.pop()
            nbytes = buf.numel()
            if nbytes > self.max_bytes:
                return
            self._waiting.append((buf, buf.untyped_storage()._cdata, alone))
            self._waiting_bytes += nbytes
            while self._waiting_bytes > self.max_bytes:
                old, _, _ = self._waiting.pop(0)
                self._waiting_bytes -= old.numel()

    def _sweep_locked(self) -> None:
        """Adopted buffers no consumer views any more join the free ones."""
        if not self._waiting or _use_count is None:
            return
        still = []
        for entry in self._waiting:
            if _use_count(entry[1]) <= entry[2]:
                self._waiting_bytes -= entry[0].numel()
                self._keep_locked(entry[0])
            else:
                still.append(entry)
        self._waiting = still
        del entry

    def _keep_locked(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel()
        if nbytes > self.max_bytes:
            return
        while self._held + nbytes > self.max_bytes:
            _, old = self._free.popitem(last=False)
            self._held -= old.numel()
        self._free[id(buf)] = buf
        self._held += nbytes

    def clear(self) -> None:
        """Drop every buffer held (their memory goes back to the system)."""
        with self._lock:
            self._free.clear()
            self._held = 0
            self._waiting = []
            self._waiting_bytes = 0

    @property
    def held_bytes(self) -> int:
        """The bytes of the buffers waiting in the pool."""
        with self._lock:
            return self._held

    def after_fork(self) -> None:
        """In a forked child: a new lock (the parent's may have been held by another thread at the fork, and
        stays held in the child for ever) and no buffers (the parent's threads' memory, copied on write)."""
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self.clear()


#: the most a process keeps of closed pipelines' host batch slots for the next ones (see the module docstring)
SPARE_SLOT_BYTES = 256 << 20
SPARE_SLOTS = SpareSlots(SPARE_SLOT_BYTES)


def _after_fork_in_child() -> None:
    SPARE_SLOTS.after_fork()  # the pool of the moment (tests swap it)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _host_slot(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    """A plain host slot of ``shape``: a spare one of its size (:data:`SPARE_SLOTS`), else new memory asked
    for huge pages. A spare's storage is set into a new tensor, not viewed (a view keeps its base alive), and
    the pool lets it go on return: the slot's tensor is its only holder, as a new tensor is."""
    nbytes = math.prod(shape) * dtype.itemsize
    spare = SPARE_SLOTS.take(nbytes)
    if spare is not None:
        return _over(spare, dtype, shape)
    tensor = allocate(shape, dtype, "cpu", False, what=what)
    advise_huge_pages(tensor)  # before the first write: rewritten every batch, faulted once
    return tensor


def _over(tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``tensor``'s whole storage (no view: nothing else holds it)."""
    return torch.empty(0, dtype=dtype).set_(tensor.untyped_storage(), 0, shape)


#: The longest :meth:`SlotRing.acquire` sleeps while every slot is busy: a bound, not a poll (a release and a
#: close wake it).
BUSY_WAIT_S = 1.0


class SlotRing:
    """``n`` batch slots; :meth:`acquire` returns one no consumer can still see.

    ``pin`` allocates page-locked host memory (the staging of the CUDA path);
    ``device`` puts the slots on a GPU. Plain host slots come from :data:`SPARE_SLOTS` when it holds some
    of their size, and go back to it at :meth:`close`.
    """

    def __init__(self, n: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
                 pin: bool = False) -> None:
        if _use_count is None:
            warnings.warn(
                "this torch build cannot report tensor storage use counts: stoker reuses a batch slot as soon "
                "as the batch is released, so clone() any tensor you keep past release()",
                RuntimeWarning, stacklevel=3,
            )
        self.dtype = dtype
        self.pinned = pin
        # plain host memory: pooled between rings (page-locked memory is torch's to manage, a GPU's too)
        self.spared = not pin and torch.device(device).type == "cpu"
        self.kept = False  # a device stream may still use the slots: close() hands none back (keep)
        if self.spared:
            self.slots = [Slot(i, _host_slot(shape, dtype, f"batch slot {i + 1} of {n}"), pooled=True)
                          for i in range(n)]
        else:
            self.slots = [Slot(i, allocate(shape, dtype, device, pin, what=f"batch slot {i + 1} of {n}"))
                          for i in range(n)]
        sizes = (s.tensor.numel() * s.tensor.element_size() for s in self.slots)
        self._nbytes = sum(pinned_footprint(n) if self.pinned else n for n in sizes)
        self._cond = threading.Condition()  # lock rank 4, a leaf (engine/pipeline/facade.py)

    @property
    def nbytes(self) -> int:
        """Memory the slots hold (pinned slots: what torch's host allocator really locked)."""
        return self._nbytes

    def keep(self) -> None:
        """A device stream that a close stopped waiting for may still read or write the slots (a hung device,
        :mod:`stoker.engine.gpu.streams`): :meth:`close` leaves them in the ring, handing none to
        :data:`SPARE_SLOTS`, where another ring would take the memory under that work.

        >>> ring.keep(); ring.close()   # doctest: +SKIP
        """
        self.kept = True

    def close(self) -> None:
        """Hand the plain host slots no batch uses any more to :data:`SPARE_SLOTS` (once the work is stopped:
        nothing writes into a slot after this), and those a tensor still views (the batch a loop holds as the
        pipeline closes) to be taken once the last view is gone (:meth:`SpareSlots.adopt`). A slot still taken
        is left to be freed with its last view; the ring holds no slot afterwards, so none is acquired again. A ring told to :meth:`keep` its slots keeps them all."""
        if not self.spared or self.kept:
            return
        with self._cond:
            slots, self.slots = self.slots, []
            self._cond.notify_all()
        for slot in slots:
            refs = slot.refs()
            if slot.busy or refs is None:
                continue
            # in a list the pool empties under its lock (SpareSlots.give): no reference of ours outlives the
            # hand-over, so a ring made meanwhile on another thread sees the memory held by its slot alone
            flat = [_over(slot.tensor, torch.uint8, (slot.tensor.numel() * slot.tensor.element_size(),))]
            slot.tensor = None  # type: ignore[assignment]  # the slot's hold on the memory ends here
            if _use_count(slot._storage) <= slot.baseline:  # flat alone holds it now
                SPARE_SLOTS.give(flat)
            else:  # a batch the consumer still holds: the pool takes it once the consumer lets it go
                SPARE_SLOTS.adopt(flat, slot.baseline)

    def _free_locked(self) -> Slot | None:
        for slot in self.slots:
            if slot.busy:
                continue
            if slot.ready_after is not None:
                if not slot.ready_after.query():
                    continue
                slot.ready_after = None
            refs = slot.refs()
            if refs is None or refs <= slot.baseline:
                return slot
        return None

    def acquire(self, cancelled: Callable[[], bool], timeout: float | None = None) -> Slot | None:
        """A free slot (marked busy), or None after ``timeout``. A slot given back but still viewed (or still
        read by a CUDA copy) frees without telling us, so while there is one this polls (2 ms); while every
        slot is busy only :meth:`release` frees one, and it notifies, and a close wakes the waiter
        (:meth:`wake`, which the executors' ``shutdown`` calls), so the wait is long (:data:`BUSY_WAIT_S`, a
        bound only): a coordinator waiting for a slot takes the GIL from a busy training loop once a release,
        not 500 times a second, and an idle pipeline's (every slot full, the consumer away) sleeps, where
        waking every 50 ms to look cost it 2 ms of CPU a second."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                slot = self._free_locked()
                if slot is not None:
                    slot.busy = True
                    return slot
                if cancelled():
                    raise ShutdownError("pipeline closed")
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return None
                wait = BUSY_WAIT_S if all(s.busy for s in self.slots) else 0.002
                gil.wait(self._cond, wait if deadline is None else min(wait, deadline - now))

    def wake(self) -> None:
        """Wake every :meth:`acquire` waiting, to look at its ``cancelled`` again (an executor's shutdown: the
        close sets what it looks at first)."""
        with self._cond:
            self._cond.notify_all()

    def release(self, slot: Slot, ready_after=None, stream_waits: list | None = None) -> None:
        """Give ``slot`` back; with ``ready_after`` (a CUDA event) it is reused only once that event completed,
        and ``stream_waits`` are what its next writer's stream must wait for."""
        with self._cond:
            slot.busy = False
            if ready_after is not None:
                slot.ready_after = ready_after
            if stream_waits is not None:
                slot.stream_waits = stream_waits
            self._cond.notify_all()

    def held(self) -> int:
        """Slots a consumer still holds (released or not, but with live views)."""
        with self._cond:
            return sum(1 for s in self.slots if s.busy or (s.refs() or 0) > (s.baseline or 0))
