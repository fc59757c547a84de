"""What a record's fields store now: the local identity the records' caches are checked against.

    >>> ident = record_identity(ds._catalog, 0, ["positions"])  # ((("", -1, mtime_ns, inode), ("c", ...), ...),)
    >>> unchanged(ds._catalog, 0, ["positions"], ident)          # True until the record is rewritten
    >>> fields_digest(ds._catalog, 0, ["positions"])           # {"positions": "3f1c..."}: size and time only

A field of a local record is identified by every file of its array (the metadata document and each chunk
or shard file) with its size, modification time and inode, and by its folders' times and inodes:
zarr-python and tensorstore write a file to a temporary name and rename it into place, so a rewritten
chunk usually gets another inode (the temporary file is made while the old one still holds its inode) and
a file added, removed or renamed into place changes its folder's time. Taking it is one ``scandir`` per
folder and one ``stat`` per file; checking it (:func:`unchanged`) one ``stat`` per file and folder, no
listing and no read. Not detected: a rewrite that keeps a file's size and inode (written in place, or
deleted and made again on a file system that hands the freed inode back) within the file system's
timestamp granularity (a few ms on ext4) of when the identity was taken, which leaves its time as it was;
likewise a file added within that granularity of the listing goes unseen until its folder changes again.
An entry whose folder was missing when the identity was taken (``()``) or that could not be stat'ed
(``UNKNOWN``) is never unchanged, and digests (:func:`digest`) to a new value each time. A field in a zip
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
import secrets
from typing import Any, Sequence

from ..storage.locate import locate

Files = tuple[tuple[str, int, int, int], ...]
UNKNOWN = -2  # the size of an entry that could not be stat'ed or listed (a symlink loop, EACCES)


def files_of(folder: str) -> Files:
    """``(key, size, mtime_ns, inode)`` of every file under ``folder`` and of every folder (``folder`` itself
    as key ``""``; a folder's size is -1: not compared), sorted; empty when ``folder`` is missing. An entry
    that cannot be stat'ed or a folder that cannot be listed (a symlink loop, EACCES) has size ``UNKNOWN``:
    never unchanged. A folder's
    time changes when an entry is added to it, removed or renamed into it, so :func:`unchanged` can tell a
    new file without listing again."""
    out: list[tuple[str, int, int, int]] = []
    try:
        st = os.stat(folder)
    except OSError:
        return ()
    out.append(("", -1, st.st_mtime_ns, st.st_ino))
    stack = [("", folder)]
    while stack:
        key, path = stack.pop()
        try:
            entries = list(os.scandir(path))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:  # EACCES, ...: what it holds is unknown
            out.append((f"{key}/" if key else "/", UNKNOWN, -1, -1))
            continue
        for e in entries:
            name = f"{key}/{e.name}" if key else e.name
            try:
                if e.is_dir(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    stack.append((name, e.path))
                    out.append((name, -1, st.st_mtime_ns, st.st_ino))
                    continue
                st = e.stat()
            except FileNotFoundError:
                continue  # removed while listed: as if never there
            except OSError:  # a symlink loop, EACCES: unknown, so never "unchanged" (read again each time)
                out.append((name, UNKNOWN, -1, -1))
                continue
            out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    out.sort()
    return tuple(out)


def _base(catalog: Any, b: int, name: str) -> str | None:
    """The local path the identity of field ``name`` of record ``b`` is taken at: its folder, the zip archive
    holding it, or None (an object store, an HTTP server)."""
    path = catalog.path(b, name)
    if name in catalog.local_fields or "://" not in path and ".zip" not in path.lower():
        return path
    loc = locate(path)
    if loc.is_local and not loc.archive:
        return loc.path or path
    if loc.archive and loc.root:
        return loc.root
    return None


def field_identity(catalog: Any, b: int, name: str) -> Files | None:
    """What field ``name`` of record ``b`` of ``catalog`` stores now (see the module), or None where it cannot
    be told cheaply (an object store, an HTTP server)."""
    base = _base(catalog, b, name)
    if base is None or not os.path.isfile(base):
        return None if base is None else files_of(base)
    try:  # a zip archive: its file
        st = os.stat(base)
    except OSError:
        return ()
    return (("", st.st_size, st.st_mtime_ns, st.st_ino),)


def record_identity(catalog: Any, b: int, names: Sequence[str]) -> tuple[Files | None, ...]:
    """:func:`field_identity` of each of ``names`` in record ``b``."""
    return tuple(field_identity(catalog, b, name) for name in names)


def unchanged(catalog: Any, b: int, names: Sequence[str], identity: tuple[Files | None, ...]) -> bool:
    """Whether record ``b``'s ``names`` still hold what ``identity`` (:func:`record_identity`) says: a ``stat``
    of each file and folder it lists, no listing (a file added or removed changes its folder's time)."""
    for name, files in zip(names, identity):
        if files is None:
            continue  # cannot be told cheaply: checked by shape and dtype only
        if not files:
            # (): the folder was missing when the identity was taken (a writer's ``overwrite=True`` between
            # its removal and its rewrite): what was read after it is of unknown origin, so never "unchanged"
            # (an entry taken so would otherwise never be checked again and be served through later rewrites).
            return False
        base = _base(catalog, b, name)
        if base is None:
            return False
        for key, size, mtime, ino in files:
            if size == UNKNOWN:
                return False
            try:
                st = os.stat(os.path.join(base, key) if key else base)
            except OSError:
                return False
            if st.st_mtime_ns != mtime or st.st_ino != ino or (size >= 0 and st.st_size != size):
                return False
    return True


def identity_nbytes(identity: tuple[Files | None, ...]) -> int:
    """About the memory :func:`record_identity`'s ``identity`` holds (a tuple of three ints and a key per file
    and folder, about 200 bytes with the key): what a cache bounded in bytes counts for it beside the sample."""
    return 64 + sum(0 if files is None else sum(_ENTRY_BYTES + len(f[0]) for f in files) for files in identity)


_ENTRY_BYTES = 200  # sys.getsizeof of a 4-tuple (72), of its three ints (3 x 32) and of a short str (about 50)


def digest(files: Files | None) -> str | None:
    """Hex digest of ``files``' keys, sizes and modification times (files only, not folders, and not inodes: a
    copy that keeps times, on another node, digests alike); None for None. An identity that tells nothing for
    sure (its folder missing, ``()``, or an entry that could not be stat'ed or listed, ``UNKNOWN``) digests to
    a random value, equal to no other: what was computed from it is computed again (as :func:`unchanged` is
    never true of it), not kept for as long as the folder stays unlistable whatever is written below it."""
    if files is None:
        return None
    if not files or any(f[1] == UNKNOWN for f in files):
        return secrets.token_hex(16)
    return hashlib.sha256(json.dumps([f[:3] for f in files if f[1] != -1]).encode()).hexdigest()[:32]


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


__all__ = ["files_of", "field_identity", "record_identity", "unchanged", "identity_nbytes", "digest", "fields_digest", "dataset_digest"]
