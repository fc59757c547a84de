"""MemoryStore: values in a dict, for tests and small in-process data."""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

from ..errors import InvalidArgument
from .store import ByteRange, by_key, check_key, check_prefix, not_found, one_level, slice_value, under


class MemoryStore:
    """A :class:`~stoker.storage.store.Store` over a dict of ``key -> bytes``; thread-safe."""

    supports_ranges = True
    supports_list = True
    is_local = False

    def __init__(self, values: Mapping[str, bytes] | None = None, uri: str = "memory://") -> None:
        self.uri = uri
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()
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
            self._values[key] = data

    def _value(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            value = self._values.get(key)
        if value is None:
            raise not_found(self.uri, key)
        return value

    def get(self, key: str) -> bytes:
        return self._value(key)

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
_names_lock = threading.Lock()


def named(uri: str) -> MemoryStore:
    """The store ``memory://name`` names in this process (a new, empty one the first time, or after it was
    closed): what :func:`~stoker.storage.uri.open_store` gives for such a URI.

    >>> named("memory://a") is named("memory://a")
    True
    """
    with _names_lock:
        return _names.setdefault(uri, MemoryStore(uri=uri))
