"""Where the bytes come from.

Two layers live here. The path-based local reader of local arrays (:class:`LocalStore`: positional
reads, descriptor cache, file identities; the compiled engine reads the same files). And the key-based
:class:`Store` protocol with one store per kind of storage (directory, zip archive, object store,
memory), picked by :func:`open_store`; arrays in object stores and zip archives are read through it
(:func:`~.locate.locate` says which, :class:`~.locate.Stores` keeps them open; see docs/remote.md).
"""

from __future__ import annotations

from .local import FileChanged, Identity, IOCounters, LocalStore, default_store, open_regular, read_regular
from .counting import CountingStore, StoreCounters
from .files import FileStore
from .memory import MemoryStore
from .objectstore import ObjectStore
from .ranges import Read, coalesce
from .store import ByteRange, Store
from .uri import open_store
from .urls import resolve_local_path
from .zipstore import ZipStore

__all__ = ["ByteRange", "CountingStore", "FileChanged", "FileStore", "IOCounters", "Identity", "LocalStore",
           "MemoryStore", "ObjectStore", "Read", "Store", "StoreCounters", "ZipStore", "coalesce", "default_store",
           "open_regular", "open_store", "read_regular", "resolve_local_path"]
