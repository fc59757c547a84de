"""Where the bytes come from. Today: local files; remote object stores plug in here later."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from ..errors import UnsupportedFormat
from .local import (FileChanged, Identity, IOCounters, LocalStore, default_store, open_regular,
                    read_regular)
from .ranges import Read, coalesce

_REMOTE_SCHEMES = {"s3", "gs", "gcs", "az", "abfs", "http", "https"}


def resolve_local_path(uri: str) -> str:
    """Turn ``/path``, ``relative/path`` or ``file:///path`` into an absolute local path.

    Remote URIs raise :class:`UnsupportedFormat` (object stores are not wired in yet).
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
                f"{uri}: remote stores ({parsed.scheme}://) are not supported yet; copy the data locally "
                "or mount it as a file system",
                uri=uri,
            )
        else:
            raise UnsupportedFormat(f"{uri}: unknown URI scheme {parsed.scheme!r}", uri=uri)
    return os.path.abspath(uri)


__all__ = ["FileChanged", "IOCounters", "Identity", "LocalStore", "Read", "coalesce", "default_store", "open_regular",
           "read_regular", "resolve_local_path"]
