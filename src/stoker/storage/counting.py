"""CountingStore: what is read through any store, counted around it (not inside each backend)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Collection, Sequence

from .store import ByteRange, Store, get_each, get_many


@dataclass
class StoreCounters:
    """Cumulative counts of one :class:`CountingStore`.

    ``requests`` counts values and ranges asked (a ``get`` is one, a ``get_ranges`` call one per
    range, a ``get_many`` call one per key and range, a ``get_each`` call one per range); a backend may merge ranges into fewer network requests. ``bytes`` counts bytes returned.
    ``calls`` counts every method call, ``size``, ``exists`` and ``list`` included.
    """

    calls: int = 0
    requests: int = 0
    bytes: int = 0


class CountingStore(Store):
    """Wraps ``store``: same reads, plus :attr:`counters`; thread-safe."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.counters = StoreCounters()
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)

    @property
    def uri(self) -> str:
        return self.store.uri

    @property
    def supports_ranges(self) -> bool:
        return self.store.supports_ranges

    @property
    def supports_list(self) -> bool:
        return self.store.supports_list

    @property
    def lists_in_memory(self) -> bool:
        return self.store.lists_in_memory

    @property
    def is_local(self) -> bool:
        return self.store.is_local

    def _count(self, requests: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            self.counters.calls += 1
            self.counters.requests += requests
            self.counters.bytes += nbytes

    def get(self, key: str):
        data = self.store.get(key)
        self._count(1, memoryview(data).nbytes)
        return data

    def get_ranges(self, requests: Sequence[ByteRange]) -> list:
        out = self.store.get_ranges(requests)
        self._count(len(requests), sum(memoryview(d).nbytes for d in out))
        return out

    #: what the store it wraps reports, or None for every read (see Store.get_many)
    reports_versions = True
    #: every read on the caller's thread, so that it is counted (never the wrapped store's start_get_many)
    starts_reads = False

    @property
    def max_gap(self) -> int:  # type: ignore[override]
        return self.store.max_gap

    @property
    def root(self) -> str | None:  # type: ignore[override]
        return self.store.root

    def get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                 lenient: Collection[int] = ()) -> tuple:
        got = get_many(self.store, keys, requests, versions, lenient)
        values, out = got[0], got[1]
        self._count(len(keys) + len(requests),
                    sum(memoryview(d).nbytes for d in values if d is not None)
                    + sum(memoryview(d).nbytes for d in out if not isinstance(d, Exception)))
        return got

    def get_each(self, requests: Sequence[ByteRange], versions: bool = False) -> Any:
        got = get_each(self.store, requests, versions)
        out = got[0] if versions else got
        self._count(len(requests), sum(memoryview(d).nbytes for d in out if not isinstance(d, Exception)))
        return got

    def size(self, key: str) -> int:
        self._count()
        return self.store.size(key)

    def exists(self, key: str) -> bool:
        self._count()
        return self.store.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        self._count()
        return self.store.list(prefix)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        self._count()
        return self.store.list_dir(prefix)

    def close(self) -> None:
        self.store.close()

    def __getattr__(self, name: str):  # backend extras (FileStore.path...) stay reachable
        if name == "store":
            raise AttributeError(name)
        return getattr(self.store, name)

    def reset(self) -> StoreCounters:
        """The counts so far; starts again from zero."""
        with self._lock:
            counts, self.counters = self.counters, StoreCounters()
        return counts

    def __repr__(self) -> str:
        return f"CountingStore({self.store!r})"
