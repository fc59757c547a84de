"""``ZarrRecords``: a map-style PyTorch dataset of Zarr groups, opened lazily per process.

Construction reads metadata only (see :mod:`stoker.records.catalog`); ``ds[i]``
reads record ``i``'s fields, chunk by chunk, into torch tensors::

    >>> ds = ZarrRecords("/data/crash", fields={"positions": ("T", "N", 3), "cells": ("M", 3)},
    ...                  time_slice=10)
    >>> len(ds), ds.metadata(0).fields["positions"].shape
    (400, (10, 5120, 3))
    >>> sample = ds[0]                       # {"positions": tensor (10, 5120, 3), "cells": ...}
    >>> mine = ds.for_rank(rank, world_size) # records rank, rank + world_size, ...: reads nothing else

The dataset pickles to its catalog (names, shapes, dtypes) and options only: no
store, no descriptor, no cache, so DataLoader workers (spawn, forkserver or fork)
each open files in their own process on first use.
"""

from __future__ import annotations

import operator
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..reader.array import open_array
from ..storage.cache import SizedLRU
from ..checks import integer
from ..dist.collectives import resolve_rank
from ..errors import InvalidArgument, MetadataError, NotFound, OutOfBounds
from ..storage import LocalStore
from ..storage.locate import Stores, locate
from .catalog import TIME_DIM, Catalog, FieldsArg, scan
from .identity import dataset_digest, fields_digest, identity_nbytes, record_identity, unchanged

Sample = dict[str, torch.Tensor]

# Descriptors a worker's private store keeps open: enough for a sharded field's index and data
# reads to share one, few enough that an epoch over many records keeps almost nothing open.
_WORKER_OPEN_FILES = 8


@dataclass(frozen=True)
class FieldInfo:
    """One field of one record: ``shape`` as ``ds[i]`` returns it (after ``time_slice``)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    stored_shape: tuple[int, ...]


@dataclass(frozen=True)
class SampleInfo:
    """What ``ds.metadata(i)`` reports: the record's name, path and fields, from metadata only."""

    name: str
    path: str
    fields: dict[str, FieldInfo]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(f.shape)) * f.dtype.itemsize for f in self.fields.values())


@dataclass(frozen=True)
class CacheInfo:
    """The sample cache of this process: ``nbytes`` never exceeds ``max_bytes``."""

    hits: int
    misses: int
    entries: int
    nbytes: int
    max_bytes: int


def _sample_nbytes(sample: Sample) -> int:
    return sum(t.numel() * t.element_size() for t in sample.values()) + 64 * len(sample)


class ZarrRecords(torch.utils.data.Dataset):
    """Records (Zarr groups) under ``root`` as dicts of tensors.

    ``fields``: None (every array of the first record; all records must have them),
    a list of names, or a dict ``name -> dims`` such as ``("T", "N", 3)`` whose named
    dims must agree across a record's fields. ``time_slice=k`` keeps the first ``k``
    steps (Python slicing: fewer when a record is shorter, which one RuntimeWarning at
    construction names, field by field) along the dim named ``"T"``, or along axis 0 of
    fields given without dims (such a field shorter than ``k`` in every record while
    another field reaches ``k``, e.g. a label of shape ``(1,)``, is taken as no time series
    and not warned about; give dims without ``"T"`` to leave a field unsliced). ``cache_bytes`` bounds a
    per-process LRU of decoded samples (0: nothing is kept between reads).
    ``lazy=False`` reads every record at construction. ``store`` (a
    :class:`~stoker.storage.LocalStore`) serves reads in the constructing process
    only; other processes use a private store of their own. ``root`` may be in a
    store (``s3://bucket/crash``, ``https://``, a zip archive), with ``storage_options``
    for remote ones (see docs/remote.md); each process opens its own connections.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        fields: FieldsArg = None,
        time_slice: int | None = None,
        cache_bytes: int = 0,
        lazy: bool = True,
        store: LocalStore | None = None,
        storage_options: dict | None = None,
    ) -> None:
        time_slice = integer("time_slice", time_slice, 1, optional=True)
        cache_bytes = integer("cache_bytes", cache_bytes, 0)
        if store is not None and not isinstance(store, LocalStore):
            raise InvalidArgument(f"store must be a stoker.storage.LocalStore, got {type(store).__name__}")
        self._storage_options = dict(storage_options) if storage_options else None
        self._catalog: Catalog = scan(root, fields, store, self._storage_options)
        self._in_store = not locate(self._catalog.root).is_local
        self._time_slice = time_slice
        self._warn_if_clipped()
        self._cache_bytes = cache_bytes
        self._lazy = bool(lazy)
        # The view: positions of the catalog this object serves, and which strided part it is.
        self._indices: np.ndarray = np.arange(len(self._catalog), dtype=np.int64)
        self._part: tuple[int, int] = (0, 1)
        self._eager: dict[int, Sample] | None = None
        self._eager_ids: dict[int, Any] = {}  # each preloaded record's identity as it was read
        self._init_process_state(store)
        if not self._lazy:
            self._eager = {}
            for b in map(int, self._indices):
                self._eager_ids[b] = record_identity(self._catalog, b, self._catalog.fields)
                self._eager[b] = self._read(b, self._catalog.fields)
            self.close()  # everything is in memory: keep no descriptor open

    # -- per-process state (never pickled) ---------------------------------------------------

    def _init_process_state(self, store: LocalStore | None) -> None:
        self._user_store = store
        self._owner_pid = os.getpid()
        self._local_store: LocalStore | None = None
        self._local_pid = -1
        self._stores: Stores | None = None  # a dataset in a store: its stores and metadata, per process
        self._stores_pid = -1
        self._lock = threading.Lock()
        # (sample, the record's identity when it was read); both count towards cache_bytes
        self._cache: SizedLRU[tuple[Sample, Any]] | None = (
            SizedLRU(self._cache_bytes, lambda entry: _sample_nbytes(entry[0]) + identity_nbytes(entry[1]))
            if self._cache_bytes > 0 else None
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_user_store", "_owner_pid", "_local_store", "_local_pid", "_stores", "_stores_pid", "_lock", "_cache"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state(None)
        self._owner_pid = -1  # a copy never uses a store it did not open itself

    def _store(self) -> LocalStore:
        """The store reads go through in this process, opened on first use."""
        pid = os.getpid()
        if self._user_store is not None and pid == self._owner_pid:
            return self._user_store
        with self._lock:
            # A forked child sees the parent's store object: its pid check makes it open its own.
            if self._local_store is None or self._local_pid != pid:
                store = LocalStore(max_open_files=_WORKER_OPEN_FILES)
                weakref.finalize(self, store.close)
                self._local_store, self._local_pid = store, pid
            return self._local_store

    def _remote_stores(self) -> Stores:
        """The stores of a dataset in a store, opened on first use in this process (as a pipeline's: the
        metadata of records and their groups is read once, not at every sample)."""
        with self._lock:
            if self._stores is None or self._stores_pid != os.getpid():
                stores = Stores()
                weakref.finalize(self, stores.close)
                self._stores, self._stores_pid = stores, os.getpid()
            return self._stores

    def _forget_changed_archives(self) -> None:
        """After a record's identity is taken, before it is read: drop this process's stores of zip archives
        changed since they were opened, so the read goes through the archive there now, never through the old
        one's open store with the new identity (served stale for ever). The identity (a stat of the archive's
        file) must come first: an archive replaced after it shows as a change at the next check, whichever
        archive the read went through."""
        if self._in_store:
            with self._lock:
                stores = self._stores if self._stores_pid == os.getpid() else None
            if stores is not None:
                stores.forget_changed_archives()

    def close(self) -> None:
        """Close this process's private descriptors and stores and drop the cache (reads reopen on demand)."""
        with self._lock:
            if self._local_store is not None and self._local_pid == os.getpid():
                self._local_store.close()
            if self._stores is not None and self._stores_pid == os.getpid():
                self._stores.close()
            self._local_store = self._stores = None
        if self._cache is not None:
            self._cache.clear()

    # -- what the dataset is -----------------------------------------------------------------

    @property
    def root(self) -> str:
        return self._catalog.root

    @property
    def fields(self) -> tuple[str, ...]:
        return self._catalog.fields

    @property
    def dims(self) -> dict[str, tuple | None]:
        """Each field's dims as the ``fields=`` spec gave them (None for a field given by name only)."""
        return {name: self._catalog.specs.get(name) for name in self._catalog.fields}

    @property
    def in_store(self) -> bool:
        """Whether the records are in a store (s3://, http(s)://, a zip archive...) rather than a local folder."""
        return self._in_store

    @property
    def storage_options(self) -> dict | None:
        """The storage options the dataset was opened with (a copy; None for none)."""
        return dict(self._storage_options) if self._storage_options else None

    @property
    def names(self) -> list[str]:
        """Record names of this view, in index order."""
        return [self._catalog.names[int(b)] for b in self._indices]

    @property
    def time_slice(self) -> int | None:
        return self._time_slice

    @property
    def part(self) -> tuple[int, int]:
        """``(rank, world_size)``: this view holds records ``rank::world_size`` of the full dataset."""
        return self._part

    @property
    def base_size(self) -> int:
        """Number of records in the full dataset (not only this rank's part)."""
        return len(self._catalog)

    def __len__(self) -> int:
        return len(self._indices)

    def __repr__(self) -> str:
        part = f", part={self._part}" if self._part != (0, 1) else ""
        return f"ZarrRecords({self.root!r}, records={len(self)}, fields={list(self.fields)}{part})"

    def _base_index(self, i: Any) -> int:
        try:
            i = operator.index(i)
        except TypeError:
            raise InvalidArgument(f"record index must be an integer, got {type(i).__name__}") from None
        n = len(self._indices)
        if not -n <= i < n:
            raise OutOfBounds(f"record index {i} is out of range for {n} records", index=i)
        return int(self._indices[i % n])

    def _time_axis(self, name: str) -> int | None:
        spec = self._catalog.specs.get(name)
        if spec is None:
            return 0
        return spec.index(TIME_DIM) if TIME_DIM in spec else None

    def _warn_if_clipped(self) -> None:
        """One RuntimeWarning naming, field by field, the records whose time axis holds fewer than
        ``time_slice`` steps: they keep all of theirs (Python's slicing, as documented), so those samples hold
        fewer steps than asked, which a model expecting ``time_slice`` steps would otherwise meet only as a
        shape error, or not at all.

        Each field is judged alone (fields differ: a per-record label has one "step" while the positions have
        many, and a minimum over fields would call every record short). A field whose dims name ``"T"`` is
        named wherever it is short. A field given without dims is sliced along axis 0 only by presumption: it is
        named wherever it is short if it reaches ``time_slice`` in some record, if its length differs between
        records (a series of varied lengths: one short of ``time_slice`` everywhere is still sliced along that
        axis, and any record that reaches it would be cut), or if no field reaches it (``time_slice`` longer
        than every record); one of the same length in every record that reaches it nowhere while another
        field does is taken as no time series (a label, a per-record table): it comes out whole, unwarned."""
        k, cat = self._time_slice, self._catalog
        if k is None:
            return
        steps: dict[str, np.ndarray] = {}  # field -> its time-axis length in each record
        for name in cat.fields:
            axis = self._time_axis(name)
            if axis is not None and cat.shapes[name].shape[1]:
                steps[name] = cat.shapes[name][:, axis]
        reached = any(bool((t >= k).any()) for t in steps.values())
        parts, presumed = [], False
        for name, t in steps.items():
            short = np.flatnonzero(t < k)
            named_time = cat.specs.get(name) is not None
            varied = bool((t != t[0]).any())  # a length of its own in each record: a series, not a label
            if not short.size or not (named_time or (t >= k).any() or not reached or varied):
                continue
            presumed |= not named_time
            shown = ", ".join(f"{cat.names[b]!r} (T={int(t[b])})" for b in short[:5])
            more = f" and {short.size - 5} more" if short.size > 5 else ""
            parts.append(f"field {name!r}: {short.size} of {len(cat)} records hold fewer than {k} steps "
                         f"(shortest {int(t.min())}): {shown}{more}")
        if not parts:
            return
        hint = (". Fields given without dims are sliced along axis 0; to slice only a time axis, give dims "
                "(fields={name: ('T', ...)}; a field whose dims name no 'T' is not sliced)" if presumed else "")
        warnings.warn(f"ZarrRecords({cat.root!r}, time_slice={k}): {'; '.join(parts)}. Those records keep all of "
                      f"their steps, so their samples hold fewer than {k} of that field; for {k} in every sample "
                      f"leave them out, or pass a time_slice no longer than that field's shortest{hint}",
                      RuntimeWarning, stacklevel=3)

    def _out_shape(self, b: int, name: str) -> tuple[int, ...]:
        shape = self._catalog.shape(b, name)
        axis = self._time_axis(name)
        if self._time_slice is None or axis is None or not shape:
            return shape
        return shape[:axis] + (min(self._time_slice, shape[axis]),) + shape[axis + 1:]

    def metadata(self, i: int) -> SampleInfo:
        """Names, shapes (as ``ds[i]`` returns them) and dtypes of record ``i``; reads nothing."""
        b = self._base_index(i)
        cat = self._catalog
        fields = {
            name: FieldInfo(self._out_shape(b, name), cat.dtype(b, name), cat.shape(b, name)) for name in cat.fields
        }
        return SampleInfo(cat.names[b], cat.path(b), fields)

    def files_digest(self, i: int, names: Sequence[str]) -> dict[str, str | None]:
        """``{field: digest}`` of the size and modification time of each file of record ``i``'s ``names`` (None
        for a field in an object store): what a result computed from them was computed from.

        >>> ds.files_digest(0, ["points"])        # {'points': '3f2a...'}
        """
        return fields_digest(self._catalog, self._base_index(i), names)

    def dataset_digest(self, names: Sequence[str]) -> str:
        """One digest of ``names``' files in every record of the full dataset (see :meth:`files_digest`): what
        statistics over them were computed from."""
        return dataset_digest(self._catalog, names)

    def base_shapes(self, name: str) -> np.ndarray:
        """``(base_size, ndim)`` shapes of field ``name`` in every record of the full dataset, as returned."""
        if name not in self._catalog.fields:
            raise InvalidArgument(f"unknown field {name!r}; the dataset has {list(self.fields)}", field=name)
        shapes = self._catalog.shapes[name].copy()
        axis = self._time_axis(name)
        if self._time_slice is not None and axis is not None and shapes.shape[1]:
            shapes[:, axis] = np.minimum(shapes[:, axis], self._time_slice)
        return shapes

    def base_dtypes(self, name: str) -> list[np.dtype]:
        """Dtype of field ``name`` in every record of the full dataset."""
        return [self._catalog.dtype_table[int(c)] for c in self._catalog.dtype_codes[name]]

    def base_names(self) -> list[str]:
        return list(self._catalog.names)

    # -- reading -----------------------------------------------------------------------------

    def __getitem__(self, i: int) -> Sample:
        return self.read(i)

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self.read(i)

    def read(self, i: int, fields: Sequence[str] | None = None) -> Sample:
        """Record ``i`` as ``{field: tensor}``; ``fields`` narrows it to a subset (in that order)."""
        b = self._base_index(i)
        names = self._check_subset(fields)
        if self._eager is not None:
            if not unchanged(self._catalog, b, self._catalog.fields, self._eager_ids[b]):  # rewritten since
                ident = record_identity(self._catalog, b, self._catalog.fields)            # read: read again
                self._forget_changed_archives()
                try:
                    self._eager[b] = self._read(b, self._catalog.fields)
                    self._eager_ids[b] = ident
                except NotFound:
                    pass  # removed (or mid-rewrite): what was preloaded is served, as before the check existed
            held = self._eager[b]
            return {name: held[name].clone() for name in names}
        if self._cache is not None:
            # Each hit is checked against what the record's files and folders were when it was read (a stat
            # of each, no listing: see records.identity); the identity of a read is taken before it, so a write
            # during the read shows as a change next time.
            key = (b, names)
            entry = self._cache.get(key)
            if entry is not None and not unchanged(self._catalog, b, names, entry[1]):
                self._cache.reject(key, entry)
                entry = None
            if entry is None:
                ident = record_identity(self._catalog, b, names)
                self._forget_changed_archives()
                entry = (self._read(b, names), ident)
                self._cache.put(key, entry)
            # Clones out: a caller normalising in place must not change what the cache holds.
            return {name: t.clone() for name, t in entry[0].items()}
        return self._read(b, names)

    def _check_subset(self, fields: Sequence[str] | None) -> tuple[str, ...]:
        if fields is None:
            return self._catalog.fields
        names = (fields,) if isinstance(fields, str) else tuple(fields)
        unknown = [f for f in names if f not in self._catalog.fields]
        if unknown:
            raise InvalidArgument(f"unknown fields {unknown}; the dataset has {list(self.fields)}", field=unknown[0])
        return names

    def _read(self, b: int, names: Sequence[str]) -> Sample:
        cat = self._catalog
        store = self._store()
        stores = self._remote_stores() if self._in_store else None
        out: Sample = {}
        for name in names:
            path = cat.path(b, name)
            if name in cat.local_fields:  # precomputed for a dataset in a store: a local array
                arr = open_array(path, store=store)
            else:
                arr = open_array(path, self._storage_options, store=store, stores=stores)
            want_shape, want_dtype = cat.shape(b, name), cat.dtype(b, name)
            if arr.shape != want_shape or arr.dtype != want_dtype:
                raise MetadataError(
                    f"record {cat.names[b]!r}, field {name!r} changed since the dataset was opened: "
                    f"{arr.shape} {arr.dtype}, was {want_shape} {want_dtype}",
                    uri=path, sample=cat.names[b], field=name,
                )
            shape = self._out_shape(b, name)
            out[name] = torch.from_numpy(arr.read([(0, s) for s in shape]))
        return out

    def cache_info(self) -> CacheInfo:
        """Hits, misses and size of this process's sample cache."""
        c = self._cache
        if c is None:
            return CacheInfo(0, 0, 0, 0, 0)
        return CacheInfo(c.hits, c.misses, len(c), c.nbytes, c.max_bytes)

    # -- views -------------------------------------------------------------------------------

    def for_rank(self, rank: int | None = None, world_size: int | None = None) -> "ZarrRecords":
        """Records ``rank, rank + world_size, ...`` of this view, without reading anything.

        Parts are disjoint and cover the view; their lengths differ by at most one
        (pad or drop in the sampler when ranks must step in lockstep). Defaults come
        from :func:`stoker.rank_info`.
        """
        rank, world_size = resolve_rank(rank, world_size)
        view = object.__new__(type(self))
        view.__dict__.update(self.__getstate__())
        view._indices = self._indices[rank::world_size].copy()
        # base[r::w][r2::w2] == base[r + w*r2 :: w*w2]: a strided part of a strided part is one.
        r, w = self._part
        view._part = (r + w * rank, w * world_size)
        if self._eager is not None:
            view._eager = {int(b): self._eager[int(b)] for b in view._indices}
            view._eager_ids = dict(self._eager_ids)  # its own: a record it reads again is new to it alone
        view._init_process_state(self._user_store)
        view._owner_pid = self._owner_pid
        return view


def base_subset(ds: ZarrRecords, indices: np.ndarray) -> ZarrRecords:
    """A view of ``ds``'s full dataset holding the records at base ``indices`` (in that order), without reading
    anything: what a collective reads when its own partition is not ``rank::world_size`` (compute_stats' fixed
    blocks). Records ``ds`` preloaded are kept where it holds them all, else read from the store."""
    view = object.__new__(type(ds))
    view.__dict__.update(ds.__getstate__())
    view._indices = np.asarray(indices, dtype=ds._indices.dtype).copy()
    if ds._eager is not None:
        held = all(int(b) in ds._eager for b in view._indices)
        view._eager = {int(b): ds._eager[int(b)] for b in view._indices} if held else None
        view._eager_ids = dict(ds._eager_ids)
    view._init_process_state(ds._user_store)
    view._owner_pid = ds._owner_pid
    return view


def rank_part(ds: ZarrRecords, rank: int, world: int) -> ZarrRecords:
    """The part of ``ds`` that ``rank`` of ``world`` works on in a collective: its strided share of the
    full dataset, or ``ds`` itself when it already is that share (InvalidArgument for any other part)."""
    if ds.part == (0, 1):
        return ds.for_rank(rank, world) if world > 1 else ds
    if ds.part == (rank, world):
        return ds
    raise InvalidArgument(
        f"ds is part {ds.part} (rank, world_size) of its dataset but this is rank {rank} of {world}; pass the "
        "full dataset or ds.for_rank(rank, world_size) for this rank",
        part=ds.part,
    )
