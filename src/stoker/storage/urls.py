"""URLs and paths, checked and made fit for messages before any store opens them: no credentials in a
URI that messages, logs and ``uri`` attributes show (:func:`check_remote_url`, :func:`redact`), and the
local path a ``file://`` URI or plain path names (:func:`resolve_local_path`).

>>> redact("https://user:secret@example.com/data.zarr?sig=abc")
'https://***@example.com/data.zarr?***'
>>> resolve_local_path("file:///data/a.zarr")
'/data/a.zarr'
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse, urlsplit, urlunsplit

from ..errors import InvalidArgument, UnsupportedFormat

#: Schemes obstore opens (:class:`~stoker.storage.objectstore.ObjectStore`): remote URIs, which name no local path.
REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl", "http", "https"})


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
        elif parsed.scheme in REMOTE_SCHEMES:
            raise UnsupportedFormat(
                f"{uri}: a remote URI ({parsed.scheme}://) names no local path; this needs a local file or "
                "directory (open_array, Sample, the samplers, ZarrRecords and stoker inspect take remote URIs)",
                uri=uri,
            )
        else:
            raise UnsupportedFormat(f"{uri}: unknown URI scheme {parsed.scheme!r}", uri=uri)
    return os.path.abspath(uri)



def redact(uri: str) -> str:
    """``uri`` fit for a message: its user information (``user:password@``), query and fragment masked."""
    if "://" not in uri:
        return uri
    parsed = urlsplit(uri)
    netloc = parsed.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return urlunsplit((parsed.scheme, netloc, parsed.path, "***" if parsed.query else "",
                       "***" if parsed.fragment else ""))


def check_remote_url(uri: str) -> None:
    """InvalidArgument for a remote URI carrying what obstore never sends (a query, a fragment; user
    information over HTTP) or a password: credentials go in ``storage_options``, never in a URI that ends up
    in messages, logs and ``uri`` attributes. (Azure's ``abfs://container@account...`` names no password.)"""
    parsed = urlsplit(uri)
    scheme = parsed.scheme.lower()
    userinfo = parsed.netloc.rpartition("@")[0] if "@" in parsed.netloc else None
    if userinfo is not None and (":" in userinfo or scheme in ("http", "https")):
        raise InvalidArgument(
            f"{redact(uri)}: credentials in the URL are not used (obstore does not send them) and would leak "
            "into messages; drop the user:password@ part and pass credentials in storage_options (an "
            "'Authorization' header in default_headers for HTTP; access_key_id/secret_access_key, "
            "account_key... for a bucket)", uri=redact(uri))
    if parsed.query or parsed.fragment:
        raise InvalidArgument(
            f"{redact(uri)}: a query string or fragment is not sent with a store's requests (keys are read "
            "under the URI's path); drop it, and pass tokens in storage_options (e.g. sas_key for Azure)",
            uri=redact(uri))
