"""open_store: the store a URI names.

==============================================  =================================================
URI                                             store
==============================================  =================================================
``/data/a.zarr``, ``data/a.zarr``, ``file://``  :class:`~stoker.storage.files.FileStore`
``/data/a.zip`` (a file), ``zip:///data/a.zip``  :class:`~stoker.storage.zipstore.ZipStore`
``s3://``, ``gs://``, ``az://``, ``http(s)://``  :class:`~stoker.storage.objectstore.ObjectStore`
``memory://name``                               :class:`~stoker.storage.memory.MemoryStore`
                                                (one per name in a process, until closed)
==============================================  =================================================
"""

from __future__ import annotations

import os
import threading
from typing import Any
from urllib.parse import urlparse

from ..errors import InvalidArgument
from .store import Store

#: Schemes obstore opens (ObjectStore).
REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl", "http", "https"})

_memory: dict[str, Any] = {}
_memory_lock = threading.Lock()


def open_store(uri: str | os.PathLike, storage_options: dict[str, Any] | None = None, **settings: Any) -> Store:
    """The store ``uri`` names (see the module docstring).

    ``storage_options`` (credentials, endpoint, region, ``skip_signature``...) and ``settings``
    (``timeout_s``, ``retries``...; see :class:`~stoker.storage.objectstore.ObjectStore`) apply to
    remote URIs only.
    """
    if not isinstance(uri, (str, os.PathLike)):
        raise InvalidArgument(f"a store URI must be a string or path, got {type(uri).__name__}")
    uri = os.fspath(uri)
    scheme = urlparse(uri).scheme.lower() if "://" in uri else ""
    if scheme in REMOTE_SCHEMES:
        from .objectstore import ObjectStore

        return ObjectStore(uri, storage_options, **settings)
    if storage_options or settings:
        given = ", ".join(sorted([*(storage_options or {}), *settings]))
        raise InvalidArgument(f"{uri}: storage_options and store settings ({given}) apply to remote URIs only "
                              "(s3://, gs://, az://, http(s)://); drop them for this one", uri=uri)
    if scheme == "memory":
        from .memory import MemoryStore

        with _memory_lock:
            return _memory.setdefault(uri, MemoryStore(uri=uri))
    if scheme == "zip":
        from .zipstore import ZipStore

        return ZipStore(uri[len("zip://"):])
    from . import resolve_local_path  # file:// and plain paths; other schemes are refused there

    path = resolve_local_path(uri)
    if path.lower().endswith(".zip") and os.path.isfile(path):
        from .zipstore import ZipStore

        return ZipStore(path)
    from .files import FileStore

    return FileStore(path)


def forget_memory(store: Any) -> None:
    """Drop ``store`` from the ``memory://`` names (``MemoryStore.close``), so its values can be freed."""
    with _memory_lock:
        if _memory.get(store.uri) is store:
            del _memory[store.uri]


__all__ = ["REMOTE_SCHEMES", "open_store"]
