"""MemoryStore: values in a dict, for tests and small in-process data.

Each value's generation is the store's write count when it was set: every :meth:`MemoryStore.set` gives
the value a new one, so a reader tells a rewritten value from the one it read before (see
:mod:`stoker.storage.store`, "Generations")."""

from __future__ import annotations

import threading
from typing import Any, Collection, Mapping, Sequence

from ..errors import InvalidArgument, NotFound, StorageError, as_value
from .store import (ByteRange, Store, by_key, check_key, check_prefix, gone_or_shorter, not_found, one_level,
                    slice_value, under)


class MemoryStore(Store):
    """A :class:`~stoker.storage.store.Store` over a dict of ``key -> bytes``; thread-safe."""

    supports_ranges = True
    supports_list = True
    lists_in_memory = True
    is_local = False
    #: get_many and get_each can say which generation of each value they read (``versions=True``)
    reports_versions = True

    def __init__(self, values: Mapping[str, bytes] | None = None, uri: str = "memory://") -> None:
        self.uri = uri
        self._values: dict[str, bytes] = {}
        self._generations: dict[str, int] = {}  # each value's: the write count when it was set
        self._writes = 0
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        for key, value in (values or {}).items():
            self.set(key, value)

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` (bytes-like, copied) at ``key``."""
        check_key(key)
        try:
            data = bytes(value)
        except TypeError:
            raise InvalidArgument(f"{self.uri}: value at {key!r} must be bytes-like, got {type(value).__name__}",
                                  key=key) from None
        with self._lock:
            self._writes += 1
            self._values[key] = data
            self._generations[key] = self._writes

    def _value(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            value = self._values.get(key)
        if value is None:
            raise not_found(self.uri, key)
        return value

    def _value_and_generation(self, key: str) -> tuple[bytes, int]:
        check_key(key)
        with self._lock:
            value, generation = self._values.get(key), self._generations.get(key)
        if value is None:
            raise not_found(self.uri, key)
        return value, generation  # type: ignore[return-value]

    def get(self, key: str) -> bytes:
        return self._value(key)

    def get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                 lenient: Collection[int] = ()) -> tuple:
        """See :func:`~stoker.storage.store.get_many`: each value read once, with its generation."""
        values: list = []
        value_versions: list = []
        for key in keys:
            try:
                value, generation = self._value_and_generation(key)
            except NotFound:
                value, generation = None, None
            values.append(value)
            value_versions.append(generation)
        parts: list = [None] * len(requests)
        part_versions: list = [None] * len(requests)
        for key, numbers in by_key(requests).items():
            for i in numbers:
                try:
                    value, generation = self._value_and_generation(key)
                    parts[i], part_versions[i] = slice_value(value, requests[i], self.uri), generation
                except (NotFound, StorageError) as exc:
                    if i not in lenient or not gone_or_shorter(exc):
                        raise
                    parts[i] = as_value(exc)
        return (values, parts, value_versions, part_versions) if versions else (values, parts)

    def get_each(self, requests: Sequence[ByteRange], versions: bool = False) -> Any:
        """See :func:`~stoker.storage.store.get_each`."""
        out: list = []
        generations: list = []
        for r in requests:
            try:
                value, generation = self._value_and_generation(r.key)
                out.append(slice_value(value, r, self.uri))
                generations.append(generation)
            except Exception as exc:  # noqa: BLE001 - this range's own error, in its place
                out.append(as_value(exc))
                generations.append(None)
        return (out, generations) if versions else out

    def get_ranges(self, requests: Sequence[ByteRange]) -> list[memoryview]:
        out: list = [None] * len(requests)
        for key, numbers in by_key(requests).items():
            value = self._value(key)
            for i in numbers:
                out[i] = slice_value(value, requests[i], self.uri)
        return out

    def size(self, key: str) -> int:
        return len(self._value(key))

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._values

    def list(self, prefix: str = "") -> list[str]:
        prefix = check_prefix(prefix)
        with self._lock:
            keys = list(self._values)
        return under(keys, prefix)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        prefix = check_prefix(prefix)
        with self._lock:
            keys = list(self._values)
        return one_level(keys, prefix)

    def close(self) -> None:
        """Forget this store's name: ``open_store`` of its ``memory://`` URI gives a new, empty one (the
        values stay readable here)."""
        with _names_lock:
            if _names.get(self.uri) is self:
                del _names[self.uri]

    def __reduce__(self):  # a copy of the values (processes share no memory)
        with self._lock:
            return MemoryStore, (dict(self._values), self.uri)

    def __repr__(self) -> str:
        return f"MemoryStore({self.uri!r}, {len(self._values)} values)"


#: ``memory://name`` -> its store: one per name in a process, until closed (``open_store``)
_names: dict[str, MemoryStore] = {}
_names_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)


def named(uri: str) -> MemoryStore:
    """The store ``memory://name`` names in this process (a new, empty one the first time, or after it was
    closed): what :func:`~stoker.storage.uri.open_store` gives for such a URI.

    >>> named("memory://a") is named("memory://a")
    True
    """
    with _names_lock:
        return _names.setdefault(uri, MemoryStore(uri=uri))
