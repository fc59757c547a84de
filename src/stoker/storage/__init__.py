"""Where the bytes come from.

Two layers live here. The path-based local reader of local arrays (:class:`LocalStore`: positional
reads, descriptor cache, file identities; the compiled engine reads the same files). And the key-based
:class:`Store` protocol with one store per kind of storage (directory, zip archive, object store,
memory), picked by :func:`open_store`; arrays in object stores and zip archives are read through it
(:func:`~.locate.locate` says which, :class:`~.locate.Stores` keeps them open; see docs/remote.md).
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from ..errors import UnsupportedFormat
from .local import FileChanged, Identity, IOCounters, LocalStore, default_store, open_regular, read_regular
from .counting import CountingStore, StoreCounters
from .files import FileStore
from .memory import MemoryStore
from .objectstore import ObjectStore
from .ranges import Read, coalesce
from .store import ByteRange, Store
from .uri import open_store
from .zipstore import ZipStore

_REMOTE_SCHEMES = {"s3", "gs", "gcs", "az", "abfs", "http", "https"}


def resolve_local_path(uri: str) -> str:
    """Turn ``/path``, ``relative/path`` or ``file:///path`` into an absolute local path.

    Remote URIs raise :class:`UnsupportedFormat`: they name no local path (:func:`~.locate.locate` and
    :func:`open_store` take them).
    """
    if not isinstance(uri, (str, os.PathLike)):
        raise TypeError(f"uri must be a string or path, got {type(uri).__name__}")
    uri = os.fspath(uri)
    if "://" in uri:
        parsed = urlparse(uri)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise UnsupportedFormat(f"file URI {uri!r} names host {parsed.netloc!r}; use file:///path", uri=uri)
            uri = unquote(parsed.path)
        elif parsed.scheme in _REMOTE_SCHEMES:
            raise UnsupportedFormat(
                f"{uri}: a remote URI ({parsed.scheme}://) names no local path; this needs a local file or "
                "directory (open_array, Sample, the samplers, ZarrRecords and stoker inspect take remote URIs)",
                uri=uri,
            )
        else:
            raise UnsupportedFormat(f"{uri}: unknown URI scheme {parsed.scheme!r}", uri=uri)
    return os.path.abspath(uri)


__all__ = ["ByteRange", "CountingStore", "FileChanged", "FileStore", "IOCounters", "Identity", "LocalStore",
           "MemoryStore", "ObjectStore", "Read", "Store", "StoreCounters", "ZipStore", "coalesce", "default_store",
           "open_regular", "open_store", "read_regular", "resolve_local_path"]
