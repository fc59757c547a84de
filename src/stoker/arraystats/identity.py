"""What the cached statistics of one array are keyed on, and where they are kept.

    >>> fp = fingerprint(reader, region=((0, 64), (0, 512)), channel_axis=None, nonfinite="skip")
    >>> folder_of(reader.uri, None)       # the array's own folder when local, else its folder in $STOKER_CACHE

The key covers the array's metadata (shape, dtype, chunking, fill value) and what is stored (the metadata
document among it, so a change of codecs too):
every file (key) of a local array with its size, modification time and inode (one ``stat`` per chunk or
shard file: a rewritten chunk changes its time, and its inode where it is replaced by a rename as zarr-python
writes; a deleted one leaves the listing; a rewrite in place of the same size within the file system's
timestamp granularity is not seen: pass ``cache=False`` after such a write), every object of an array in
an object store with its version (size and ETag, from the listing itself: no request per object), and a
zip archive's identity. A store that cannot list its keys (HTTP) has no such key: :func:`data_identity`
returns None and the statistics are computed every time. The statistics file itself
(``.stoker-stats.json``, its claim and temporary siblings) is left out, so writing it never invalidates it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..reader.array import ArrayReader
from ..records import sidecar
from ..storage.artifacts import dataset_dir
from ..storage.locate import locate

FORMAT = "stoker-array-stats"
VERSION = 1
_OWN = sidecar.FILENAME.lstrip(".")  # the statistics file and its claim/temporary siblings: ".<name>..."


def _own_file(name: str) -> bool:
    return name.lstrip(".").startswith(_OWN)


def _local_files(folder: str) -> list[tuple[str, int, int, int]]:
    """``(key, size, mtime_ns, inode)`` of every file under ``folder`` but the statistics' own, sorted."""
    out: list[tuple[str, int, int, int]] = []
    stack = [("", folder)]
    while stack:
        key, path = stack.pop()
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            continue
        for e in entries:
            name = f"{key}/{e.name}" if key else e.name
            if not key and _own_file(e.name):
                continue
            if e.is_dir():
                stack.append((name, e.path))
            else:
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue  # removed while listed: as if never there
                out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return sorted(out)


def data_identity(reader: ArrayReader) -> Any:
    """A JSON-able description of what ``reader``'s array stores now, or None where it cannot be told."""
    kv = reader.kv
    prefix = reader.path
    if kv.is_local:
        return {"files": _local_files(reader.file_path("").rstrip("/") or "/")}
    keep = [k for k in (prefix,) if k]
    lister = getattr(kv, "list_versions", None)
    if callable(lister) and kv.supports_list:  # an object store: versions come with the listing
        return {"objects": [[k, v] for k, v in lister(*keep) if not _own_file(k.rsplit("/", 1)[-1])]}
    generation = getattr(kv, "generation", None)  # a zip archive's identity (a property) covers every member
    if isinstance(generation, tuple) and kv.supports_list:
        return {"archive": list(generation), "keys": kv.list(*keep)}
    return None


def _metadata(reader: ArrayReader) -> dict:
    meta = reader.metadata
    return {"shape": list(reader.shape), "dtype": reader.dtype.str, "chunks": list(reader.chunks),
            "shards": list(reader.shards) if reader.shards else None, "zarr_format": reader.zarr_format,
            "fill": bytes(meta.fill_value.tobytes()).hex()}  # codecs: the metadata document is among the files


def fingerprint(reader: ArrayReader, region: Any, channel_axis: int | None, nonfinite: str,
                cf: bool = True) -> str | None:
    """Hex digest of what the statistics of ``reader``'s array over ``region`` depend on (``cf``: CF attributes
    applied; the attributes themselves are in the metadata document, among the files), or None where the
    stored data cannot be identified (then nothing is cached)."""
    stored = data_identity(reader)
    if stored is None:
        return None
    head = {"format": FORMAT, "version": VERSION, "metadata": _metadata(reader), "region": [list(b) for b in region],
            "channel_axis": channel_axis, "nonfinite": nonfinite, "cf": bool(cf)}
    h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    h.update(json.dumps(stored, sort_keys=True).encode())
    return h.hexdigest()


def folder_of(uri: str, storage_options: dict | None) -> str:
    """Where the statistics of the array at ``uri`` live: its own folder when local (beside its chunks, as a
    record dataset's beside its records), else its folder in the local cache (:mod:`stoker.storage.artifacts`)."""
    loc = locate(uri)
    if loc.is_local:
        return str(Path(loc.path or uri))
    return str(dataset_dir(uri, storage_options))


__all__ = ["FORMAT", "VERSION", "data_identity", "fingerprint", "folder_of"]
