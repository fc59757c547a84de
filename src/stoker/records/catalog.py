"""What a record dataset holds, from metadata alone: sample names, field shapes and dtypes.

A *record* is one Zarr group (v2 or v3); its arrays are the record's *fields*. The
records are the child groups of ``root``, which is either a plain directory of
stores or a Zarr group of groups::

    root/sample_0000.zarr/{positions,velocity,cells}
    root/sample_0001.zarr/...

:func:`scan` lists the groups and reads each field's metadata document
(``zarr.json`` or ``.zarray``), never chunk data, and checks the records against
an optional field spec::

    >>> cat = scan("/data/crash", {"positions": ("T", "N", 3), "cells": ("M", 3)})
    >>> cat.names[:2], cat.shape(0, "positions"), cat.dtype(0, "positions")
    (['run_000', 'run_001'], (40, 5120, 3), dtype('float32'))

The result is compact and picklable: names in one list, shapes in one integer
array per field, dtypes as small codes into a table. No file stays open.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

import numpy as np

from ..reader.array import read_document, read_metadata, read_store_metadata
from ..errors import InvalidArgument, MetadataError, NotFound, RankMismatch, UnsupportedFormat
from ..storage import LocalStore
from ..storage.artifacts import precomputed_dir
from ..storage.hierarchy import MAX_DOCUMENT_BYTES
from ..storage.locate import default_stores, locate
from ..runtime.callers import user_stacklevel
from ..storage.store import get_many
from ..storage.uri import join_key
from ..zarr.metadata import parse_json

Dim = Union[str, int, None]
"""One entry of a field spec: a dimension name (must agree across a record's fields),
a fixed size, or ``None`` for any size."""

FieldsArg = Union[None, Sequence[str], Mapping[str, Union[Sequence[Dim], None]]]

TIME_DIM = "T"


@dataclass(frozen=True)
class Catalog:
    """Metadata of every record: ``names[i]`` and per field an ``(n, ndim)`` array of stored shapes."""

    root: str
    names: list[str]
    fields: tuple[str, ...]
    specs: dict[str, tuple[Dim, ...] | None]
    shapes: dict[str, np.ndarray]  # field -> int64 (n_records, ndim)
    dtype_codes: dict[str, np.ndarray]  # field -> uint8 (n_records,), indexes dtype_table
    dtype_table: tuple[np.dtype, ...]
    #: fields of a dataset in a store read from precompute's local folder (field -> the folder of its records)
    local_fields: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.names)

    def path(self, i: int, name: str | None = None) -> str:
        """Local path (or URI, for a dataset in a store) of record ``i`` or of one of its fields (a field
        precomputed for a dataset in a store: its local path)."""
        if name is not None and name in self.local_fields:
            return os.path.join(self.local_fields[name], self.names[i], *name.split("/"))
        return join_key(self.root, self.names[i], *(name.split("/") if name is not None else ()))

    def shape(self, i: int, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in self.shapes[name][i])

    def dtype(self, i: int, name: str) -> np.dtype:
        return self.dtype_table[int(self.dtype_codes[name][i])]


# -- discovery ---------------------------------------------------------------------------------


def _node_kind(path: str, store: LocalStore) -> str | None:
    """``"group"``, ``"array"`` or None for a directory that holds no Zarr node (metadata read only)."""
    raw = read_document(store, os.path.join(path, "zarr.json"), path)  # capped: a huge file is refused unread
    if raw is not None:
        doc = parse_json(raw, path, "zarr.json")
        kind = doc.get("node_type")
        if kind not in ("group", "array"):
            raise MetadataError(f"{path}/zarr.json has node_type {kind!r}, expected 'group' or 'array'", uri=path)
        return kind
    if store.size(os.path.join(path, ".zgroup")) is not None:
        return "group"
    if store.size(os.path.join(path, ".zarray")) is not None:
        return "array"
    return None


def _children(path: str) -> list[str]:
    """Sorted names of the visible subdirectories of ``path``."""
    try:
        with os.scandir(path) as it:
            # Hidden names are never records: they hold our sidecar files and tools' scratch.
            return sorted(e.name for e in it if not e.name.startswith(".") and e.is_dir())
    except FileNotFoundError:
        raise NotFound(f"no record dataset at {path}: the directory does not exist", uri=path) from None
    except NotADirectoryError:
        raise NotFound(f"{path} is a file; a record dataset is a directory of Zarr groups", uri=path) from None


def warn_headless(root: str, folders: Sequence[str]) -> None:
    """One RuntimeWarning naming the ``folders`` under ``root`` that hold Zarr arrays but no group document.

    Such a folder is no group, so no record, and is left out; but leaving it out without a word hid records
    whose arrays were written straight to ``root/<record>/<array>`` (zarr-python writes no document for the
    folders above an array). It may equally be data beside the records (split indices in ``root/splits``), so
    this warns rather than refuses, and says how to make one a record. Folders holding no Zarr array are not
    named."""
    if not folders:
        return
    shown = ", ".join(repr(f) for f in folders[:5]) + (f" and {len(folders) - 5} more" if len(folders) > 5 else "")
    warnings.warn(
        f"{root}: the folder(s) {shown} hold Zarr arrays but are no groups (no zarr.json or .zgroup), so they are "
        "not records and are left out of the dataset. If one is meant to be a record, write its group document: "
        f"zarr.open_group('{join_key(root, folders[0])}', mode='a', zarr_format=<its arrays' format>) (writing "
        "arrays straight to root/<record>/<array> writes none); if not, nothing needs to change",
        RuntimeWarning, stacklevel=user_stacklevel())  # the user's call (a dataset's constructor, scan), not ours


def list_records(root: str, store: LocalStore) -> list[str]:
    """Names of the child groups of ``root`` (sorted); other entries are left out, folders that hold Zarr
    arrays without being groups with a warning (:func:`warn_headless`)."""
    if _node_kind(root, store) == "array":
        raise InvalidArgument(f"{root} is a Zarr array; a record dataset is a directory or group of groups", uri=root)
    kinds = {n: _node_kind(os.path.join(root, n), store) for n in _children(root)}
    names = [n for n, kind in kinds.items() if kind == "group"]
    warn_headless(root, [n for n, kind in kinds.items() if kind is None and list_arrays(os.path.join(root, n), store)])
    if not names:
        raise NotFound(
            f"{root} holds no Zarr groups; each record must be a group (e.g. {root}/sample_0000.zarr/positions)",
            uri=root,
        )
    return names


def list_arrays(path: str, store: LocalStore) -> list[str]:
    """Names of the arrays directly inside the group at ``path`` (sorted)."""
    return [n for n in _children(path) if _node_kind(os.path.join(path, n), store) == "array"]


# -- specs -------------------------------------------------------------------------------------


def parse_fields(fields: FieldsArg) -> tuple[tuple[str, ...] | None, dict[str, tuple[Dim, ...] | None]]:
    """Normalise the ``fields`` argument to (names or None, spec per name)."""
    if fields is None:
        return None, {}
    if isinstance(fields, str):
        raise InvalidArgument(f"fields must be a list of names or a dict of name -> dims, got the string {fields!r}")
    if isinstance(fields, Mapping):
        items = list(fields.items())
    elif isinstance(fields, Sequence):
        items = [(name, None) for name in fields]
    else:
        raise InvalidArgument(f"fields must be None, a list of names or a dict of name -> dims, got {fields!r}")
    if not items:
        raise InvalidArgument("fields is empty; pass None to load every array of the records")
    specs: dict[str, tuple[Dim, ...] | None] = {}
    for name, dims in items:
        _check_field_name(name)
        if name in specs:
            raise InvalidArgument(f"field {name!r} is listed twice", field=name)
        if dims is not None:
            if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
                raise InvalidArgument(f"dims of field {name!r} must be a tuple like ('T', 'N', 3), got {dims!r}",
                                      field=name)
            for d in dims:
                ok = d is None or isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool) and d >= 0)
                if not ok:
                    raise InvalidArgument(
                        f"dims of field {name!r}: {d!r} is not a name, a size >= 0 or None", field=name)
            dims = tuple(dims)
        specs[name] = dims
    return tuple(specs), specs


def _check_field_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"field names must be non-empty strings, got {name!r}")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidArgument(f"field {name!r} must be a relative path inside the record, like 'mesh/positions'",
                              field=name)


def check_dims(record: str, name: str, shape: tuple[int, ...], spec: tuple[Dim, ...] | None,
               bound: dict[str, tuple[int, str]]) -> None:
    """Check one field's shape against its spec, binding named dims in ``bound`` (shared by a record)."""
    if spec is None:
        return
    if len(shape) != len(spec):
        raise RankMismatch(
            f"record {record!r}, field {name!r}: shape {shape} has {len(shape)} dims but the spec "
            f"{spec} has {len(spec)}",
            sample=record, field=name, dims=spec, shape=shape,
        )
    for axis, (dim, size) in enumerate(zip(spec, shape)):
        if dim is None:
            continue
        if isinstance(dim, int):
            if size != dim:
                raise InvalidArgument(
                    f"record {record!r}, field {name!r}: axis {axis} has size {size}, the spec {spec} needs {dim}",
                    sample=record, field=name, dims=spec, shape=shape,
                )
            continue
        seen = bound.get(dim)
        if seen is None:
            bound[dim] = (size, name)
        elif seen[0] != size:
            raise InvalidArgument(
                f"record {record!r}: dim {dim!r} is {size} in field {name!r} (shape {shape}) but {seen[0]} "
                f"in field {seen[1]!r}",
                sample=record, field=name, dims=(dim,), shape=shape, other_field=seen[1],
            )


# -- the scan ----------------------------------------------------------------------------------


def scan(root: str | os.PathLike, fields: FieldsArg = None, store: LocalStore | None = None,
         storage_options: dict | None = None) -> Catalog:
    """Read every record's metadata under ``root`` and check it; no chunk is read.

    ``root`` may be in a store (``s3://bucket/crash``, ``https://...``, a zip archive; see
    :func:`~stoker.storage.locate.locate`), with ``storage_options`` for remote ones: records are found
    in the root group's consolidated metadata when it has some, else by listing the store.

    A field a dataset in a store lacks is read from :func:`~stoker.records.precompute`'s local folder
    (:func:`~stoker.storage.artifacts.precomputed_dir`) when its first record has it there.

    Raises :class:`~stoker.errors.NotFound` when a record lacks a field and
    :class:`~stoker.errors.InvalidArgument` (naming record, field and dims) when
    shapes break the spec or a field's rank differs between records.
    """
    loc = locate(root)
    if not loc.is_local:
        kv, hierarchy = default_stores().get(loc, storage_options)
        uri = loc.uri.rstrip("/")
        local = LocalStore(max_open_files=8)
        try:
            return _scan(uri, fields, _StoreNodes(uri, loc.prefix, kv, hierarchy),
                         _Precomputed(str(precomputed_dir(uri, storage_options)), local))
        finally:
            local.close()
    if storage_options:
        raise InvalidArgument(f"{root}: storage_options apply to remote URIs only; drop them for a local path",
                              uri=os.fspath(root))
    root_path = loc.path
    own = store is None
    store = store or LocalStore(max_open_files=8)
    try:
        return _scan(root_path, fields, _LocalNodes(root_path, store))
    finally:
        if own:
            store.close()  # a catalog keeps no file open: nothing to leak into forked workers


class _LocalNodes:
    """Records and fields as directories (the functions above)."""

    def __init__(self, root: str, store: LocalStore) -> None:
        self.root, self.store = root, store

    def records(self) -> list[str]:
        return list_records(self.root, self.store)

    def arrays(self, record: str) -> list[str]:
        return list_arrays(os.path.join(self.root, record), self.store)

    def metadata(self, path: str, record: str, name: str):
        return read_metadata(path, self.store, uri=path)


class _StoreNodes:
    """Records and fields of a dataset in a store: from the root group's consolidated metadata when it has
    some (no listing: works on HTTP servers too), else from one-level listings of the store (a delimiter
    listing: a request per 1,000 children, none of the keys below them) and the children's own documents,
    read together in one call."""

    def __init__(self, uri: str, prefix: str, kv, hierarchy) -> None:
        self.uri, self.prefix, self.kv, self.hierarchy = uri, prefix, kv, hierarchy

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix and rel else (rel or self.prefix)

    def _children(self, rel: str, want: str) -> list[str]:
        """Sorted names of the Zarr nodes of kind ``want`` (``"group"``, ``"array"``) directly under ``rel``
        ("": the root)."""
        consolidated = self.hierarchy.group_entries(self.prefix, self.uri)
        if consolidated is None:
            return self._listed(rel, want)
        head = f"{rel}/" if rel else ""
        found: dict[str, str] = {}
        fmt, entries = consolidated
        for key, doc in entries.items():
            if not key.startswith(head):
                continue
            rest = key[len(head):].split("/")
            if fmt == 3 and len(rest) == 1 and isinstance(doc, dict) and doc.get("node_type") in ("group", "array"):
                found[rest[0]] = doc["node_type"]
            elif fmt == 2 and len(rest) == 2 and rest[1] in (".zgroup", ".zarray"):
                found[rest[0]] = "group" if rest[1] == ".zgroup" else "array"
        return sorted(n for n, k in found.items() if k == want and not n.startswith("."))

    def _listed(self, rel: str, want: str, others: list[str] | None = None) -> list[str]:
        """The children of kind ``want``, listed; the folders that are no Zarr node go to ``others`` if given."""
        if not self.kv.supports_list:
            raise UnsupportedFormat(
                f"{self.uri}: this store cannot be listed (a plain HTTP server) and the root group has no "
                "consolidated metadata; consolidate it (zarr.consolidate_metadata) to read it from here",
                uri=self.uri)
        folder = self._key(rel)
        keys, folders = self.kv.list_dir(folder)
        names = sorted(f.rsplit("/", 1)[-1] for f in folders)
        names = [n for n in names if not n.startswith(".")]  # hidden: sidecars and tools' scratch
        own = {k.rsplit("/", 1)[-1] for k in keys}
        # The parent's own document says the hierarchy's format: ask the children for that one only.
        v2 = ".zgroup" if want == "group" else ".zarray"
        documents = ["zarr.json"] if "zarr.json" in own else [v2] if ".zgroup" in own else ["zarr.json", v2]
        kinds: dict[str, str] = {}
        for document in documents:
            asked = [n for n in names if n not in kinds]
            values, _ = get_many(self.kv, [f"{folder}/{n}/{document}" if folder else f"{n}/{document}"
                                           for n in asked], [])
            for name, raw in zip(asked, values):
                if raw is not None:
                    kinds[name] = self._kind(f"{rel}/{name}" if rel else name, document, raw)
        if others is not None:
            others.extend(n for n in names if n not in kinds)
        return [n for n in names if kinds.get(n) == want]

    def _kind(self, rel: str, document: str, raw) -> str | None:
        if document != "zarr.json":
            return "group" if document == ".zgroup" else "array"
        if len(raw) > MAX_DOCUMENT_BYTES:
            raise MetadataError(f"{self.uri}: {rel}/zarr.json is {len(raw)} bytes, more than the "
                                f"{MAX_DOCUMENT_BYTES} bytes stoker reads as Zarr metadata", uri=self.uri)
        kind = parse_json(bytes(raw), self.uri, f"{rel}/zarr.json").get("node_type")
        return kind if kind in ("group", "array") else None

    def records(self) -> list[str]:
        if self.hierarchy.group_entries(self.prefix, self.uri) is None:  # listed: folders that are no node seen
            others: list[str] = []
            names = self._listed("", "group", others)
            warn_headless(self.uri, [n for n in others if self._listed(n, "array")])
        else:  # consolidated metadata names groups only: a folder that is no group is not in it
            names = self._children("", "group")
        if not names:
            raise NotFound(f"{self.uri} holds no Zarr groups; each record must be a group (e.g. "
                           f"{self.uri}/sample_0000.zarr/positions)", uri=self.uri)
        return names

    def arrays(self, record: str) -> list[str]:
        return self._children(record, "array")

    def metadata(self, path: str, record: str, name: str):
        return read_store_metadata(self.hierarchy, self._key(f"{record}/{name}"), path)


class _Precomputed:
    """The arrays precompute derived from a dataset in a store, in its local folder (a group per record)."""

    def __init__(self, folder: str, store: LocalStore) -> None:
        self.folder, self.store = folder, store

    def has(self, record: str, name: str) -> bool:
        return os.path.isdir(os.path.join(self.folder, record, *name.split("/")))

    def metadata(self, record: str, name: str):
        path = os.path.join(self.folder, record, *name.split("/"))
        try:
            return read_metadata(path, self.store, uri=path)
        except NotFound:
            raise NotFound(f"record {record!r} has no precomputed {name!r} in {self.folder} (run precompute again "
                           "to complete it)", uri=path, sample=record, field=name) from None


def _scan(root: str, fields: FieldsArg, nodes, precomputed: _Precomputed | None = None) -> Catalog:
    names = nodes.records()
    wanted, specs = parse_fields(fields)
    if wanted is None:
        wanted = tuple(nodes.arrays(names[0]))
        if not wanted:
            raise NotFound(f"record {names[0]!r} under {root} holds no arrays", uri=root, sample=names[0])
        specs = {name: None for name in wanted}

    n = len(names)
    shapes: dict[str, np.ndarray] = {}
    codes = {name: np.zeros(n, dtype=np.uint8) for name in wanted}
    table: list[np.dtype] = []
    local: dict[str, str] = {}  # fields read from precompute's folder (decided by the first record)
    for i, record in enumerate(names):
        bound: dict[str, tuple[int, str]] = {}
        for name in wanted:
            path = join_key(root, record, *name.split("/"))
            meta = None
            try:
                meta = (precomputed.metadata(record, name) if name in local
                        else nodes.metadata(path, record, name))
            except NotFound:
                if name in local:
                    raise
                if not (i == 0 and precomputed is not None and precomputed.has(record, name)):
                    raise NotFound(f"record {record!r} has no field {name!r} (no Zarr array at {path})",
                                   uri=path, sample=record, field=name) from None
            except InvalidArgument as exc:  # a group where an array should be
                raise InvalidArgument(f"record {record!r}, field {name!r}: {exc.message}",
                                      uri=path, sample=record, field=name) from None
            if meta is None:  # the store's first record lacks it, precompute's folder has it: read from there
                local[name] = precomputed.folder
                meta = precomputed.metadata(record, name)
            shape = tuple(meta.shape)
            check_dims(record, name, shape, specs[name], bound)
            if name not in shapes:
                shapes[name] = np.zeros((n, len(shape)), dtype=np.int64)
            elif shapes[name].shape[1] != len(shape):
                raise RankMismatch(
                    f"record {record!r}, field {name!r}: shape {shape} has {len(shape)} dims but record "
                    f"{names[0]!r} has {shapes[name].shape[1]}",
                    sample=record, field=name, shape=shape,
                )
            shapes[name][i] = shape
            if meta.dtype not in table:
                if len(table) == 255:
                    raise InvalidArgument(f"more than 255 distinct dtypes under {root}", uri=root)
                table.append(meta.dtype)
            codes[name][i] = table.index(meta.dtype)
    return Catalog(root=root, names=names, fields=tuple(wanted), specs=dict(specs), shapes=shapes,
                   dtype_codes=codes, dtype_table=tuple(table), local_fields=local)
