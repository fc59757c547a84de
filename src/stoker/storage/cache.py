"""A small thread-safe LRU bounded by the total size of what it holds."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Sequence, TypeVar

V = TypeVar("V")


class SizedLRU(Generic[V]):
    """LRU cache whose entries are weighed by ``sizeof`` and capped at ``max_bytes`` in total.

    >>> cache = SizedLRU(max_bytes=1 << 20, sizeof=lambda a: a.nbytes)
    >>> index = cache.get_or_load(("shard", 0), lambda: load_index())
    """

    def __init__(self, max_bytes: int, sizeof: Callable[[V], int],
                 evicted: Callable[[list[V]], None] | None = None) -> None:
        """``evicted(values)``: told the values a :meth:`put` evicted (past the bound) or replaced by another
        object, after it and outside the lock, so that what else keeps them may drop them too."""
        self.max_bytes = max_bytes
        self._sizeof = sizeof
        self._evicted = evicted
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._nones: set[Hashable] = set()  # the keys cached as None ("there is none"): see forget_nones
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def holds(self, keys: Sequence[Hashable]) -> list[bool]:
        """Whether each of ``keys`` is cached (as ``in``; none made the most recently used): one hold of the lock
        for them all.

        >>> cache.holds(["a", "b"])
        [True, False]
        """
        with self._lock:
            items = self._items
            return [key in items for key in keys]

    def get_or_load(self, key: Hashable, load: Callable[[], V]) -> V:
        """Cached value for ``key``, loading (outside the lock) on a miss.

        Two threads missing the same key may both load; the values are equal, the
        second insert wins, and nothing is held locked during I/O.
        """
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return item[0]
            self.misses += 1
        value = load()
        self.put(key, value)
        return value

    def get(self, key: Hashable) -> V | None:
        """The value cached for ``key`` (now the most recently used), or None."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def get_many(self, keys: Sequence[Hashable], missing: object = None) -> list:
        """The values cached for ``keys`` (each now the most recently used), ``missing`` in place of those not
        cached: one lock for them all, as a planner asks for a batch's shard indexes together.

        >>> cache.get_many([("shard", 0), ("shard", 1)], missing=NOT_CACHED)
        """
        out = []
        with self._lock:
            items = self._items
            for key in keys:
                item = items.get(key)
                if item is None:
                    out.append(missing)
                    self.misses += 1
                else:
                    items.move_to_end(key)
                    out.append(item[0])
                    self.hits += 1
        return out

    def put(self, key: Hashable, value: V) -> None:
        """Cache ``value`` as ``key`` (replacing what was), evicting the least recently used past the bound; a
        value weighing more than the whole bound is not kept."""
        size = self._sizeof(value)
        dropped = []
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
                if old[0] is not value:
                    dropped.append(old[0])
            self._nones.discard(key)
            if size <= self.max_bytes:
                self._items[key] = (value, size)
                self._bytes += size
                if value is None:
                    self._nones.add(key)
                while self._bytes > self.max_bytes:
                    gone, (old_value, evicted) = self._items.popitem(last=False)
                    self._bytes -= evicted
                    self._nones.discard(gone)
                    dropped.append(old_value)
        if dropped and self._evicted is not None:
            self._evicted(dropped)

    def reject(self, key: Hashable, value: V) -> None:
        """``value``, just got for ``key``, is out of date: drop it (if still cached) and count that get as a
        miss, not a hit (checked outside the lock by the caller, as a check may take system calls)."""
        with self._lock:
            item = self._items.get(key)
            if item is not None and item[0] is value:
                del self._items[key]
                self._bytes -= item[1]
                self._nones.discard(key)
            self.hits -= 1
            self.misses += 1

    def discard(self, key: Hashable, when: Callable[[V], bool] | None = None) -> None:
        """Drop ``key``'s value if it is cached (and ``when(value)`` is true, when given)."""
        with self._lock:
            item = self._items.get(key)
            if item is not None and (when is None or when(item[0])):
                del self._items[key]
                self._bytes -= item[1]
                self._nones.discard(key)

    def items(self) -> list[tuple[Hashable, V]]:
        """A snapshot of the ``(key, value)`` pairs cached, least recently used first (none made more recent)."""
        with self._lock:
            return [(key, item[0]) for key, item in self._items.items()]

    def forget_nones(self) -> int:
        """Drop every value cached as ``None`` (what was looked up and found not there, a shard not stored), so
        the next look-up loads it again: what was written since is found. One step per such key, not per entry
        (a pipeline does it at each push). Returns how many were dropped."""
        with self._lock:
            for key in self._nones:
                self._bytes -= self._items.pop(key)[1]
            n, self._nones = len(self._nones), set()
            return n

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._nones.clear()
            self._bytes = 0
