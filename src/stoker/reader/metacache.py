"""Parsed metadata of local arrays, kept per process: opening an unchanged array again costs a ``stat``.

Every pipeline opens its arrays afresh (and ``open_array`` is called again and again), and reading and
parsing a metadata document costs tens of microseconds of Python under the GIL. An entry is keyed by the
document's path, the URI the array was opened as (the metadata names it in every message) and the
file's identity (device, inode, size, modification and change times), so a document rewritten or
replaced since is a miss and is read again.

Documents are also kept by content: many arrays of a dataset have byte-identical documents (their names
are not in them), so the first open of each array but one copies a parse (:func:`~stoker.zarr.metadata.renamed`)
instead of parsing. Content is never stale, so this needs no settling.

File timestamps are coarse (a kernel tick; a second on some file systems): a document rewritten in
place at the same size within one tick keeps its identity. So, as git does for its index ("racily
clean" files), a document is kept only when its identity was the same before and after it was read and
it last changed more than :data:`SETTLE_NS` before; until then every open reads it.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any

from ..storage.cache import SizedLRU
from ..storage.local import Identity, identity

#: Bytes of cached entries kept, weighed at their document's size plus :data:`ENTRY_BYTES` for the parsed
#: objects (least recently used dropped first).
MAX_BYTES = 32 << 20
ENTRY_BYTES = 4096
#: How long ago a document must have last changed to be kept: longer than any file system's timestamp
#: granularity (FAT's two seconds).
SETTLE_NS = 3_000_000_000

_cache: SizedLRU = SizedLRU(MAX_BYTES, lambda entry: entry[1])
#: Parses by document content: ``(file name, bytes) -> ((document or None, metadata), weight)``.
_by_content: SizedLRU = SizedLRU(MAX_BYTES // 4, lambda entry: entry[1])


def stat_document(path: str) -> os.stat_result | None:
    """The stat of the regular file at ``path``, or None (missing, not a regular file, or not statable:
    reading it says what is wrong)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def lookup(path: str, uri: str, st: os.stat_result | None) -> Any:
    """What :func:`keep` kept for the document at ``path`` opened as ``uri`` with stat ``st``, or None."""
    if st is None:
        return None
    entry = _cache.get((path, uri, identity(st)))
    return None if entry is None else entry[0]


def keep(path: str, uri: str, before: os.stat_result | None, after: Identity | None, value: Any,
         nbytes: int) -> None:
    """Keep ``value`` (parsed from ``nbytes`` bytes read from ``path``) when the file's identity ``after``
    the read is the one ``before`` it and it has settled (see the module docstring)."""
    if before is None or after is None or identity(before) != after:
        return
    if time.time_ns() - max(before.st_mtime_ns, before.st_ctime_ns) <= SETTLE_NS:
        return
    _cache.put((path, uri, after), (value, nbytes + ENTRY_BYTES))


def parse_of(name: str, raw: bytes) -> tuple[dict | None, Any] | None:
    """``(document, metadata)`` as :func:`share_parse` kept them for a document named ``name`` (``zarr.json``,
    ``.zarray``) holding exactly ``raw``, or None. The metadata names the array first parsed from it."""
    entry = _by_content.get((name, raw))
    return None if entry is None else entry[0]


def share_parse(name: str, raw: bytes, doc: dict | None, meta: Any) -> None:
    """Keep the parse of ``raw`` (``doc``: the decoded document, where opens of other arrays need it again:
    a v2 separator is detected from each array's own chunks) for arrays whose documents hold the same bytes.
    Neither is changed after: both are shared."""
    _by_content.put((name, bytes(raw)), ((doc, meta), 2 * len(raw) + ENTRY_BYTES))


def clear() -> None:
    """Forget every kept document and parse."""
    _cache.clear()
    _by_content.clear()
