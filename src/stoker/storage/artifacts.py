"""A local folder for what stoker derives from a dataset it cannot write next to: one in a store.

A local dataset keeps its derived files beside it (the statistics sidecar). A dataset in an object
store, behind HTTP or in a zip archive is read-only to stoker, so those files go to a folder of this
machine instead::

    $STOKER_CACHE/stores/<key>/                       ($STOKER_CACHE defaults to ~/.cache/stoker)
    $STOKER_CACHE/stores/<key>/precomputed/<record>/  (precompute's arrays, a Zarr group per record)

``<key>`` is a hash of the dataset's identity: its store root and key prefix as :func:`locate` reads them
(so every URI form of one zip archive maps to one folder), with user information, query and fragment
removed (:func:`~stoker.storage.uri.redact`), and the endpoint it is read from (an ``endpoint`` among its
storage options, else ``AWS_ENDPOINT_URL`` for S3): the same bucket name on two servers is two datasets.
Nothing else of the storage options goes in, and nothing secret appears in a path or a file.
What is inside a folder follows the rules of the local file it stands for (fingerprinted entries, atomic
writes under a claim); deleting the folder only costs recomputing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Mapping

from ..errors import InvalidArgument
from .locate import locate
from .uri import redact

#: The environment variable naming stoker's cache folder (demo data lives there too).
CACHE_ENV = "STOKER_CACHE"
_S3_SCHEMES = ("s3", "s3a")
_S3_ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")


def cache_root() -> Path:
    """``$STOKER_CACHE``, or ``~/.cache/stoker``, as an absolute path (not created here): paths under it are
    kept (a catalog's precomputed fields) and must not change meaning with the working directory."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "stoker")
    return Path(os.path.abspath(root))


def _endpoint(root: str, storage_options: Mapping | None) -> str | None:
    given = [str(v) for k, v in sorted((storage_options or {}).items())
             if "endpoint" in str(k).lower() and isinstance(v, str) and v]
    if given:
        return redact(given[0].rstrip("/"))
    if root.split("://", 1)[0].lower() in _S3_SCHEMES:
        for name in _S3_ENDPOINT_ENV:
            if os.environ.get(name):
                return redact(os.environ[name].rstrip("/"))
    return None


def dataset_identity(uri: str, storage_options: Mapping | None = None) -> dict:
    """What names a dataset in a store, with nothing secret in it: store root, key prefix, endpoint."""
    loc = locate(uri)
    if loc.is_local:
        raise InvalidArgument(f"{uri} is a local directory: what stoker derives from it lives beside it", uri=uri)
    if loc.archive:
        return {"archive": loc.root, "prefix": loc.prefix}
    return {"store": redact(loc.root), "prefix": loc.prefix, "endpoint": _endpoint(loc.root, storage_options)}


def dataset_dir(uri: str, storage_options: Mapping | None = None) -> Path:
    """The cache folder of the dataset in a store at ``uri`` (not created here)."""
    ident = json.dumps(dataset_identity(uri, storage_options), sort_keys=True)
    return cache_root() / "stores" / hashlib.sha256(ident.encode()).hexdigest()[:32]


def precomputed_dir(uri: str, storage_options: Mapping | None = None) -> Path:
    """Where :func:`~stoker.records.precompute` keeps the arrays it derives from the records of the dataset in
    a store at ``uri``: a folder per record, named as the record (not created here)."""
    return dataset_dir(uri, storage_options) / "precomputed"


__all__ = ["CACHE_ENV", "cache_root", "dataset_dir", "dataset_identity", "precomputed_dir"]
