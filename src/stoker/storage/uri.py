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

An ``https://`` URL of a provider's object store (``https://<account>.blob.core.windows.net/<container>/...``,
``https://s3.<region>.amazonaws.com/<bucket>/...``, ``https://<bucket>.s3.<region>.amazonaws.com/...``) opens
that provider's store, as obstore's ``from_url`` parses it (credentials, listing); every other ``https://``
URL is a plain HTTP server. :func:`store_root` says where such a store's root ends.
"""

from __future__ import annotations

import functools
import os
from typing import Any
from urllib.parse import quote, unquote, urlparse, urlsplit

from ..errors import InvalidArgument
from .store import Store
from .urls import REMOTE_SCHEMES, check_remote_url, redact, resolve_local_path

#: Hosts whose https URLs obstore (object_store) may open as a provider's store rather than plain HTTP.
_PROVIDER_HOSTS = (".amazonaws.com", ".r2.cloudflarestorage.com", ".blob.core.windows.net", ".dfs.core.windows.net",
                   ".blob.fabric.microsoft.com", ".dfs.fabric.microsoft.com")


def store_root(uri: str) -> tuple[str, str]:
    """``(root, path inside)`` of a remote URI: the bucket, container or host a store opens, and the rest.
    ``s3://bucket/a/b`` -> ``("s3://bucket", "a/b")``; ``https://host/a/b`` -> ``("https://host", "a/b")``;
    a provider's https URL whose bucket or container is its first path segment keeps that segment in
    the root (``https://s3.eu-west-1.amazonaws.com/bkt/a`` -> ``(".../bkt", "a")``)."""
    parsed = urlsplit(uri)
    root, path = f"{parsed.scheme}://{parsed.netloc}", unquote(parsed.path).strip("/")
    host = (parsed.hostname or "").lower()
    if parsed.scheme.lower() == "https" and host.endswith(_PROVIDER_HOSTS) and path:
        first, _, rest = path.partition("/")
        if _first_segment_is_root(root, first):
            return f"{root}/{first}", rest
    return root, path


def join_key(root: str, *names: str) -> str:
    """``root`` joined with the key segments ``names`` (folder names as a store lists them): a remote URI's
    segments percent-encoded, since :func:`store_root` decodes a URI's path (a record listed as
    ``x%20y.zarr`` must not be read as ``x y.zarr``, nor ``q?.zarr`` cut at a query string); a local
    path's, or a zip archive's, as they are.

    >>> join_key("s3://bkt/data", "x%20y.zarr", "p")
    's3://bkt/data/x%2520y.zarr/p'
    >>> join_key("/data", "x%20y.zarr", "p")
    '/data/x%20y.zarr/p'
    """
    if urlsplit(root).scheme.lower() in REMOTE_SCHEMES:
        return "/".join([root.rstrip("/"), *(quote(n, safe="") for n in names)])
    return os.path.join(root, *names)


@functools.lru_cache(maxsize=256)
def _first_segment_is_root(root: str, first: str) -> bool:
    """Whether obstore opens ``root/first/...`` as a provider's store rooted at ``first`` (path-style S3, an
    Azure container); asked of obstore's own URL parser (no request is made)."""
    try:
        from obstore.store import from_url

        store = from_url(f"{root}/{first}/k")
    except Exception:  # obstore missing (ObjectStore says what to install) or a URL it does not parse
        return False
    return type(store).__name__ != "HTTPStore" and getattr(store, "prefix", None) == "k"


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
        from .memory import named

        return named(uri)
    if scheme == "zip":
        from .zipstore import ZipStore

        return ZipStore(uri[len("zip://"):])
    path = resolve_local_path(uri)  # file:// and plain paths; other schemes are refused there
    if path.lower().endswith(".zip") and os.path.isfile(path):
        from .zipstore import ZipStore

        return ZipStore(path)
    from .files import FileStore

    return FileStore(path)


__all__ = ["REMOTE_SCHEMES", "check_remote_url", "open_store", "redact", "resolve_local_path"]
