"""What a record's fields store now: the local identity the records' caches are checked against.

    >>> field_identity(ds._catalog, 0, "positions")            # (("c/0/0", size, mtime_ns, inode), ...)
    >>> fields_digest(ds._catalog, 0, ["positions"])           # {"positions": "3f1c..."}: size and time only

A field of a local record is identified by every file of its array (the metadata document and each chunk
or shard file) with its size, modification time and inode: zarr-python writes a file to a temporary name
and renames it into place, so a rewritten chunk gets a new inode and time, a deleted one leaves the listing
and a new one joins it. One ``scandir`` per folder and one ``stat`` per file, no read. A field in a zip
archive is identified by the archive's file; a field in an object store or on an HTTP server by nothing
(None: such caches are checked by shape and dtype only, as a listing per record would cost about what the
read it guards costs).

This identity is local: a copy of the dataset on another node has other inodes (and, unless copied with its
times, ``cp -a``, other times). The cross-rank fingerprint (:func:`stoker.records.sidecar.fingerprint`) is
therefore made of shapes and dtypes alone, and the caches on disk (statistics, precomputed arrays) key on
size and time only, so a copy that keeps times keeps them valid.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

from ..storage.locate import locate

Files = tuple[tuple[str, int, int, int], ...]


def files_of(folder: str) -> Files:
    """``(key, size, mtime_ns, inode)`` of every file under ``folder`` (sorted; empty when it is missing)."""
    out: list[tuple[str, int, int, int]] = []
    stack = [("", folder)]
    while stack:
        key, path = stack.pop()
        try:
            entries = list(os.scandir(path))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            name = f"{key}/{e.name}" if key else e.name
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append((name, e.path))
                    continue
                st = e.stat()
            except FileNotFoundError:
                continue  # removed while listed: as if never there
            out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    out.sort()
    return tuple(out)


def field_identity(catalog: Any, b: int, name: str) -> Files | None:
    """What field ``name`` of record ``b`` of ``catalog`` stores now (see the module), or None where it cannot
    be told cheaply (an object store, an HTTP server)."""
    path = catalog.path(b, name)
    if name in catalog.local_fields or "://" not in path and ".zip" not in path.lower():
        return files_of(path)
    loc = locate(path)
    if loc.is_local and not loc.archive:
        return files_of(loc.path or path)
    if loc.archive and loc.root:
        try:
            st = os.stat(loc.root)
        except OSError:
            return ()
        return (("", st.st_size, st.st_mtime_ns, st.st_ino),)
    return None


def record_identity(catalog: Any, b: int, names: Sequence[str]) -> tuple[Files | None, ...]:
    """:func:`field_identity` of each of ``names`` in record ``b``."""
    return tuple(field_identity(catalog, b, name) for name in names)


def digest(files: Files | None) -> str | None:
    """Hex digest of ``files``' keys, sizes and modification times (not inodes: a copy that keeps times, on
    another node, digests alike); None for None."""
    if files is None:
        return None
    return hashlib.sha256(json.dumps([f[:3] for f in files]).encode()).hexdigest()[:32]


def fields_digest(catalog: Any, b: int, names: Sequence[str]) -> dict[str, str | None]:
    """``{field: digest}`` of record ``b``'s ``names``: what a result computed from them was computed from."""
    return {name: digest(field_identity(catalog, b, name)) for name in names}


def dataset_digest(catalog: Any, names: Sequence[str]) -> str:
    """One hex digest of ``names`` in every record of ``catalog`` (size and time of each file, see
    :func:`digest`): what statistics over them were computed from."""
    h = hashlib.sha256()
    for b in range(len(catalog.names)):
        h.update(json.dumps(fields_digest(catalog, b, names), sort_keys=True).encode())
    return h.hexdigest()


__all__ = ["files_of", "field_identity", "record_identity", "digest", "fields_digest", "dataset_digest"]
