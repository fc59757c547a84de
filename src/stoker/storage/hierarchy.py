"""The metadata documents of Zarr nodes in a store, from consolidated metadata where a group has it.

Opening an array ``g.zarr/a`` looks at its ancestors, nearest first, for consolidated metadata: a v3
group's ``zarr.json`` with ``consolidated_metadata``, or a v2 group's ``.zmetadata``. The first one that
lists the array gives its document with no request of its own. The walk stops at an ancestor that is
neither (no ``zarr.json``, no ``.zmetadata``) or that is not a group, and every answer (found or not)
is kept per store, so opening many arrays of one hierarchy costs a constant number of round trips: the
first array pays for the walk (two requests per level at most), later ones read nothing (consolidated)
or only their own document (not consolidated).

A group's documents are loaded once however many threads ask at once (single flight): the first asks
the store, the others wait for its answer (at most :data:`LOAD_WAIT_S`); a failure is raised in all of
them (in each a new error of the same type naming its own array, the loader's as its cause) and not kept,
so the next open asks again.

Ancestors' documents are optional: a key the store refuses to read (HTTP 403, what S3 answers for a
missing key without ``s3:ListBucket`` permission) is read as absent. Of an array's own documents
(:meth:`Hierarchy.first`) a refusal is raised when none of them is found.

The groups above an array are also asked for their attributes (:meth:`Hierarchy.group_node`: an
OME-Zarr level's image group holds its ``multiscales``): through what the walk above already read, each
group once per store, and with :func:`read_group_node` the fewest documents that say whether a node is
a group (a v3 ``zarr.json``; a v2 ``.zattrs``, or ``.zgroup`` where it has none).

Consolidated metadata is trusted as it is (as zarr-python's ``open_consolidated`` does): an array
rewritten with a new shape or codec after the group was consolidated reads with the old metadata.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from typing import Any, Callable

from ..errors import MetadataError, NotFound, StokerError, StorageError, as_value
from .store import Store, bucket_missing, denied

#: Ancestors looked at for consolidated metadata, nearest first.
MAX_LEVELS = 8
#: Largest metadata document read (as for local files; see array.MAX_METADATA_BYTES).
MAX_DOCUMENT_BYTES = 16 << 20
#: The longest a thread waits for another thread's load of the same group (a store's reads have bounds of
#: their own: this only keeps a waiter from outliving a loader that hangs).
LOAD_WAIT_S = 600.0


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def read_group_node(read: Callable[[str], bytes | None], fmt: int | None = None) -> tuple[int, Any, bool] | None:
    """``(zarr_format, attributes, is_group)`` of the node whose documents ``read(name)`` gives (its document
    ``name``, ``"zarr.json"``, or None where there is none); None where it has none (a folder zarr-python
    writes no document for: the ``s`` of a level at ``s/1``). ``fmt``: the format its hierarchy is known to
    have (a group's children share their group's), so the other one's documents are not asked for. v3:
    ``zarr.json``, a group when its ``node_type`` is "group" (else attributes None). v2: ``.zattrs`` present,
    else ``.zgroup`` (a group written with no attributes), both read as a group's. Attributes that are no JSON
    object read as None: no attribute of them is found."""
    return group_node_of(lambda name, parse: _ABSENT if (raw := read(name)) is None else _json(raw) if parse else raw,
                         fmt)


#: What a loader of :func:`group_node_of` gives for a document that is not there.
_ABSENT = object()


def group_node_of(load: Callable[[str, bool], Any], fmt: int | None = None) -> tuple[int, Any, bool] | None:
    """:func:`read_group_node` from ``load(name, parse)``: the node's document ``name`` parsed (None where it
    is no JSON) when ``parse``, else anything but ``_ABSENT`` (only whether it is there counts: ``.zgroup``),
    and ``_ABSENT`` where there is none; each document is loaded, and parsed, once."""
    if fmt != 2:
        doc = load("zarr.json", True)
        if doc is not _ABSENT:
            if not isinstance(doc, dict) or doc.get("node_type") != "group":
                return 3, None, False
            return 3, _json_object(doc.get("attributes", {})), True
        if fmt == 3:
            return None
    doc = load(".zattrs", True)
    if doc is not _ABSENT:
        return 2, _json_object(doc), True
    return (2, {}, True) if load(".zgroup", False) is not _ABSENT else None


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None  # no document stoker can read: nothing is found in it


def second_reply(first: bytes, get: Callable[[], bytes | None]) -> bytes:
    """A document whose bytes ``first`` did not parse, read once more (``get``): a reply cut short with headers
    that agree on fewer bytes (a faulty server or proxy) cannot be told from a malformed document by its bytes,
    but its second reply differs. That reply where there is one; else ``first`` (gone at the second read: the
    first is all there is). The same bytes twice are the document. One rule for an array's documents
    (reader.coords) and a group's (:meth:`Hierarchy.group_node`).

    >>> second_reply(b'{"a": 1', lambda: b'{"a": 1}')
    b'{"a": 1}'
    """
    again = get()
    return first if again is None else again


def _json_object(value: Any) -> dict | None:
    return value if isinstance(value, dict) else None


_UNREAD = object()  # a group of Hierarchy._groups not read yet


def _parents(prefix: str) -> list[str]:
    """``"a/b/c"`` -> ``["a/b", "a", ""]``."""
    parts = prefix.split("/") if prefix else []
    return ["/".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


class Hierarchy:
    """Metadata reads of one store, with its groups' consolidated metadata cached; thread-safe."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # group prefix -> (format, {relative key: doc}, is a group, its attributes) or None (see _group)
        self._groups: dict[str, tuple | None] = {}
        self._loading: dict[str, concurrent.futures.Future] = {}  # group prefix -> its load in flight
        self._nodes: dict[tuple, tuple | None] = {}  # (prefix, format asked) -> group_node's answer
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)

    def read(self, key: str, uri: str, optional: bool = False) -> bytes | None:
        """The document at ``key`` (at most :data:`MAX_DOCUMENT_BYTES`), or None when there is none (or,
        ``optional``, when the store refuses to read it: see the module docstring); a missing bucket
        (:func:`~stoker.storage.store.bucket_missing`) is raised, whatever ``optional``."""
        try:
            data = self.store.get(key)
        except NotFound as exc:
            if bucket_missing(exc):  # no document of any node can be read: "no array here" would mislead
                raise
            return None
        except StorageError as exc:
            if optional and denied(exc):
                return None
            raise
        if len(data) > MAX_DOCUMENT_BYTES:
            raise MetadataError(f"{uri}: {key} is {len(data)} bytes, more than the {MAX_DOCUMENT_BYTES} bytes stoker "
                                "reads as Zarr metadata; it is not a Zarr metadata document", uri=uri, key=key)
        return bytes(data)

    def first(self, keys: list[str], uri: str) -> tuple[str, bytes] | None:
        """``(key, document)`` of the first of ``keys`` found (alternatives, such as an array's ``zarr.json``
        and ``.zarray``), or None when none exists; a refusal (403) of one of them is raised when none is
        found, since the one refused may be the one that exists."""
        refused = None
        for key in keys:
            try:
                raw = self.read(key, uri)
            except StorageError as exc:
                if not denied(exc):
                    raise
                refused = refused or as_value(exc)  # (kept past its except: no traceback, so no cycle)
                continue
            if raw is not None:
                return key, raw
        if refused is not None:
            raise refused
        return None

    def exists(self, key: str) -> bool:
        """Whether an optional key exists (a refusal reads as no)."""
        try:
            return self.store.exists(key)
        except StorageError as exc:
            if denied(exc):
                return False
            raise

    def consolidated(self, prefix: str, uri: str) -> tuple[int, dict] | None:
        """``(zarr_format, document)`` of the node at ``prefix`` from an ancestor's consolidated metadata
        (v2: ``{".zarray": doc, ".zattrs": attributes}``-like dict of its documents; v3: its ``zarr.json``
        document), or None.
        Ancestors already read are asked first (no request), so the nodes of a group consolidated at its
        top cost nothing once it was read, however deep they are. A v2 entry is taken so only where the walk
        below would reach it (every group between known and consolidated): a v2 group without ``.zmetadata``
        ends the walk, and its arrays read their own documents whatever was opened before them (after a
        top-level sibling's open, the root's possibly stale entry was taken)."""
        with self._lock:
            chain = [(g, self._groups.get(g, _UNREAD)) for g in _parents(prefix)]
        passable = True  # every group nearer than this one is known, consolidated and a group: the walk passes
        for level, (group, found) in enumerate(chain):
            passable = passable and level < MAX_LEVELS  # nor does the walk go further up
            if found is not _UNREAD and found is not None:
                hit = self._lookup(prefix, group, found)
                if hit is not None and (hit[0] == 3 or passable):
                    return hit
            passable = passable and found is not _UNREAD and found is not None and bool(found[2])
        for level, group in enumerate(_parents(prefix)):
            if level >= MAX_LEVELS:
                return None
            found = self._group(group, uri)
            if found is None:
                return None
            hit = self._lookup(prefix, group, found)
            if hit is not None:
                return hit
            if not found[2]:  # not a group
                return None
        return None

    @staticmethod
    def _lookup(prefix: str, group: str, found: tuple) -> tuple[int, dict] | None:
        fmt, entries = found[:2]
        rel = prefix[len(group) + 1:] if group else prefix
        if fmt == 3 and rel in entries:
            return 3, entries[rel]
        if fmt == 2 and (f"{rel}/.zarray" in entries or f"{rel}/.zgroup" in entries):
            return 2, {name: entries[f"{rel}/{name}"] for name in (".zarray", ".zgroup", ".zattrs")
                       if f"{rel}/{name}" in entries}
        return None

    def group_node(self, group: str, uri: str, fmt: int | None = None) -> tuple[int, Any, bool] | None:
        """:func:`read_group_node` of the node at ``group``, each asked once per store: a v3 node from the
        ``zarr.json`` :meth:`consolidated` read of it where it read it, anything else from the store (a refused
        document reads as absent). A v2 group's attributes are its own ``.zattrs``, never those its
        ``.zmetadata`` names: attributes written after the group was consolidated (an OME ``multiscales``)
        are what zarr-python reads too."""
        key = (group, fmt)
        with self._lock:
            if key in self._nodes:
                return self._nodes[key]
            known = self._groups.get(group, self)  # self: never read
        if known is not self and known is not None and known[0] == 3:
            node: tuple[int, Any, bool] | None = (3, known[3] if known[2] else None, bool(known[2]))
        elif known is None and fmt == 3:
            node = None  # a v3 hierarchy's folder without zarr.json: no document
        else:
            # never read; or no zarr.json there (known None: nor .zmetadata), so v2's own documents are left;
            # or a v2 group known by its .zmetadata, whose .zattrs is read as it is now
            node = group_node_of(lambda name, parse: self._load_twice_if_torn(_join(group, name), uri, parse),
                                 fmt if known is self else 2)
        with self._lock:
            return self._nodes.setdefault(key, node)

    def _load_twice_if_torn(self, key: str, uri: str, parse: bool) -> Any:
        """The document at ``key`` as :func:`group_node_of` loads it (parsed once, when ``parse``; ``_ABSENT``:
        none), read once more where it is no JSON: a reply cut short with headers that agree (a faulty server
        or proxy) reads as a malformed document, which a group's node keeps for the store's life as "no
        attributes" (an OME image's ``multiscales`` lost, its levels no levels): :func:`second_reply`."""
        raw = self.read(key, uri, optional=True)
        if raw is None:
            return _ABSENT
        if not parse:
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            again = second_reply(raw, lambda: self.read(key, uri, optional=True))
        return _json(again) if again is not raw else None  # (gone at the second read: the first is all there is)

    def group_entries(self, group: str, uri: str) -> tuple[int, dict] | None:
        """``(zarr_format, entries)`` of the consolidated metadata of the group at ``group`` (keys relative
        to it: v3 node paths, v2 document paths such as ``"a/.zarray"``), or None when it has none."""
        found = self._group(group, uri)
        if found is None or not found[1]:
            return None
        return found[0], found[1]

    def _group(self, group: str, uri: str) -> tuple | None:
        """``(format, entries, is_group, attributes)`` of an ancestor (entries empty when it is not
        consolidated; attributes None where it has none read), or None when it is no Zarr group; read once per
        store, by one thread (the others wait for it)."""
        with self._lock:
            if group in self._groups:
                return self._groups[group]
            flight = self._loading.get(group)
            mine = flight is None
            if mine:
                flight = self._loading[group] = concurrent.futures.Future()
        if not mine:
            try:
                return flight.result(timeout=LOAD_WAIT_S)
            except concurrent.futures.TimeoutError:
                raise StorageError(f"{uri}: the metadata of group {group or '/'!r} was not read in {LOAD_WAIT_S:.0f} s "
                                   "by the thread reading it", uri=uri, key=group) from None
            except StokerError as exc:  # the loader's error names the array it opened: this one names ours
                raise type(exc)(f"{uri}: reading the metadata of group {group or '/'!r} (for another open at "
                                f"once) failed: {exc.message}", **{**exc.context, "uri": uri}) from exc
        try:
            found = self._load(group, uri)
        except BaseException as exc:
            with self._lock:
                del self._loading[group]  # not kept: the next open asks again
            flight.set_exception(exc)
            raise
        with self._lock:
            self._groups[group] = found
            del self._loading[group]
        flight.set_result(found)
        return found

    def _load(self, group: str, uri: str) -> tuple | None:
        from ..zarr.metadata import parse_json

        raw = self.read(_join(group, "zarr.json"), uri, optional=True)
        if raw is not None:
            doc = parse_json(raw, uri, _join(group, "zarr.json"))
            if doc.get("node_type") != "group":
                return 3, {}, False, None
            cm = doc.get("consolidated_metadata")
            entries = cm.get("metadata") if isinstance(cm, dict) else None
            return 3, entries if isinstance(entries, dict) else {}, True, _json_object(doc.get("attributes", {}))
        raw = self.read(_join(group, ".zmetadata"), uri, optional=True)
        if raw is None:
            return None
        doc = parse_json(raw, uri, _join(group, ".zmetadata"))
        entries = doc.get("metadata")
        if not isinstance(entries, dict):
            raise MetadataError(f"{uri}: {_join(group, '.zmetadata')} holds no 'metadata' object; it is not v2 "
                                "consolidated metadata", uri=uri)
        return 2, entries, True, None  # (its attributes are its .zattrs as it is now: see group_node)
