"""An array's attributes, dimension names, CF coding and coordinates, read through its own store.

Dimension names are Zarr v3's ``dimension_names`` or, in v2, xarray's ``_ARRAY_DIMENSIONS`` attribute. A
dimension's coordinates are the xarray layout's: the 1-d array named like the dimension in the array's
parent group, as long as the dimension. They are read with :func:`~stoker.reader.array.open_array` (local
paths, object stores, zip archives alike) and decoded as xarray decodes them (CF times to ``datetime64``,
time spans to ``timedelta64``, packed or filled values to floats; :mod:`stoker.zarr.cf`). Everything is read once per reader and kept
with it (a pipeline opens each array once).

>>> arr = stoker.open_array("/data/era5.zarr/t2m")
>>> dimension_names(arr)
('time', 'lat', 'lon')
>>> coordinates(arr)["time"][:2]
array(['2000-01-01T00:00:00.000000000', '2000-01-01T06:00:00.000000000'], dtype='datetime64[ns]')
>>> coding(arr)            # CFCoding(scale=..., offset=..., fills=(...)) or None
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Sequence

import numpy as np

from ..errors import InvalidArgument, MetadataError, NotFound, StorageError, UnsupportedFormat
from ..storage.hierarchy import second_reply
from ..storage.locate import Stores, locate, options_for
from ..storage.store import denied
from ..zarr.cf import CFCoding, coding_of, decode_timedeltas, decode_times, is_time_units, timedelta_dtype
from ..zarr.fields import show
from ..zarr.metadata import parse_json
from .array import MAX_METADATA_BYTES, ArrayReader, open_array

# What is read once per reader is kept on it (ArrayReader.derived, the one memo a reader has: gone with it), by
# key: "documents" (attributes, v2 stored fill value, dimension names; or the _Failed reading them), "cf"
# (coding), ("coordinate", name) (a dimension's labels, None where it has none) and "coordinates" (all of them).
# Two threads working one out at once both read it and keep the same (equal) answer: a dict's item set is
# atomic, no lock needed.
_MISSING = object()

#: How long a MetadataError reading an array's documents is kept on its reader (raised again with no request)
#: before the next asker reads them anew. Kept: a malformed ``_ARRAY_DIMENSIONS`` is asked for by the CF reader
#: and each group's channel check, a request each. Not for ever: a reply a faulty server or proxy cut short
#: twice running reads as a malformed document too, and the server may answer whole a while later.
KEEP_ERROR_S = 60.0


class _Failed:
    """A MetadataError kept on a reader (``derived["documents"]``), raised at ``at`` (``time.monotonic()``)."""

    __slots__ = ("error", "at")

    def __init__(self, error: MetadataError, at: float) -> None:
        self.error, self.at = error, at


def _get(reader: ArrayReader, key: str) -> bytes | None:
    try:
        raw = reader.kv.get(key)
    except NotFound:
        return None
    except StorageError as exc:
        if denied(exc):  # S3's answer for a missing key to a client without s3:ListBucket (see store.denied)
            return None
        raise
    if len(raw) > MAX_METADATA_BYTES:
        raise MetadataError(f"{reader.uri}: {key.rsplit('/', 1)[-1]} is {len(raw)} bytes, more than the "
                            f"{MAX_METADATA_BYTES} bytes stoker reads as Zarr metadata", uri=reader.uri)
    return bytes(raw)


def _read(reader: ArrayReader, name: str) -> dict | None:
    """The document ``name`` of the array, None where it has none. One that is no JSON object is read once
    more (:func:`~stoker.storage.hierarchy.second_reply`): the same bytes twice, or the document gone at the
    second read, are a MetadataError (no document would read as no attributes: a scale_factor dropped without
    a word)."""
    key = f"{reader.path}/{name}" if reader.path else name
    raw = _get(reader, key)
    if raw is None:
        return None
    try:
        return parse_json(raw, reader.uri, name)
    except MetadataError:
        again = second_reply(raw, lambda: _get(reader, key))
        if again == raw:  # the document itself, or gone: no document would read as no attributes
            raise
    return parse_json(again, reader.uri, name)


def _consolidated(reader: ArrayReader, stores: Stores | None, options: dict | None) -> dict | None:
    """The array's documents from an ancestor's consolidated metadata, when it was opened from a store whose
    groups are consolidated (read already: no request), as ``{name: document}``; else None."""
    if reader.kv.is_local or stores is None:
        return None
    loc = locate(reader.uri)
    if loc.is_local:
        return None
    found = stores.get(loc, options)[1].consolidated(loc.prefix, reader.uri)
    if found is None:
        return None
    fmt, doc = found
    return {"zarr.json": doc} if fmt == 3 else {".zattrs": {}, **doc}


def _documents_of(reader: ArrayReader, stores: Stores | None = None,
                  options: dict | None = None) -> tuple[dict, Any, tuple | None]:
    """``(attributes, v2 stored fill value, dimension names)`` of ``reader``'s array, read once: from the
    consolidated metadata of ``stores`` (those it was opened in, with its ``options``) where its group has
    it, else its own documents. A MetadataError is kept as the answer too and raised again for
    :data:`KEEP_ERROR_S`, so a remote array's malformed ``_ARRAY_DIMENSIONS`` costs one request however many
    ask (the CF reader, each group's channel-order check) in that time, and is read anew after it (a reply cut
    short twice running is not kept for the reader's life); a StorageError is not kept: the next asker retries."""
    got = reader.derived.get("documents")
    if isinstance(got, _Failed):
        if time.monotonic() - got.at < KEEP_ERROR_S:
            raise got.error
        got = None
    if got is not None:
        return got
    try:
        got = _read_documents(reader, stores, options)
    except MetadataError as exc:
        reader.derived["documents"] = _Failed(exc, time.monotonic())
        raise
    reader.derived["documents"] = got
    return got


def _read_documents(reader: ArrayReader, stores: Stores | None, options: dict | None) -> tuple[dict, Any, tuple | None]:
    """:func:`_documents_of`'s reading and checking, none of it kept."""
    uri = reader.uri
    known = _consolidated(reader, stores, options) or {}
    if not known and reader.metadata.document is not None:  # the zarr.json or .zarray its metadata was read from
        known = {"zarr.json" if reader.zarr_format == 3 else ".zarray": reader.metadata.document}
    read = (lambda name: known[name] if name in known else _read(reader, name))
    if reader.zarr_format == 3:
        doc = read("zarr.json") or {}
        attrs, fill, dims = doc.get("attributes") or {}, None, doc.get("dimension_names")
    else:
        attrs = read(".zattrs") or {}
        dims = attrs.get("_ARRAY_DIMENSIONS") if isinstance(attrs, dict) else None
        # the stored fill value as written (null or not), which xarray takes for _FillValue in what it wrote
        fill = (read(".zarray") or {}).get("fill_value") if dims is not None else None
    if not isinstance(attrs, dict):
        raise MetadataError(f"{uri}: attributes {show(attrs)} are not a JSON object", uri=uri)
    names = None
    if dims is not None:
        if not isinstance(dims, list) or len(dims) != reader.ndim or \
                not all(d is None or isinstance(d, str) for d in dims):
            raise MetadataError(f"{uri}: dimension names {show(dims)} are not {reader.ndim} names (strings or "
                                "null), one per axis", uri=uri)
        names = tuple(dims)
    return attrs, fill, names


def attributes(reader: ArrayReader, stores: Stores | None = None, options: dict | None = None) -> dict:
    """The array's user attributes (v3 ``attributes``, v2 ``.zattrs``; ``{}`` when there are none).
    ``stores`` and ``options``: those the array was opened with, whose consolidated metadata may hold them."""
    return _documents_of(reader, stores, options)[0]


def dimension_names(reader: ArrayReader, stores: Stores | None = None,
                    options: dict | None = None) -> tuple[str | None, ...] | None:
    """The array's dimension names (v3 ``dimension_names``, v2 ``_ARRAY_DIMENSIONS``), or None."""
    return _documents_of(reader, stores, options)[2]


#: The most arrays whose documents :func:`_names_at_once` reads at once (each a thread waiting on its request).
MAX_READ_AT_ONCE = 16


def _names_at_once(readers: Sequence[ArrayReader], stores: Stores | None,
                   storage_options: Any) -> list[tuple | None]:
    """Each reader's dimension names, None where it has none or they cannot be read (MetadataError,
    StorageError: the order checks are advisory). A sampler's fields are opened one after the other, and a
    remote v2 array's names are in its ``.zattrs``, read by nothing before: asked one after the other, they
    cost a round trip per field (and mask) at construction. Where two or more need a request, they are asked
    at once (a thread each, up to :data:`MAX_READ_AT_ONCE`); what is read is kept on each reader as before."""

    def names_of(r: ArrayReader) -> tuple | None:
        try:
            return dimension_names(r, stores, options_for(storage_options, r.uri))
        except (MetadataError, StorageError):
            return None

    # a local array's documents cost a file read, and those already read (kept) nothing: no thread for them
    asking = sum(1 for r in readers if not r.kv.is_local and "documents" not in r.derived)
    if asking < 2:
        return [names_of(r) for r in readers]
    with concurrent.futures.ThreadPoolExecutor(min(asking, MAX_READ_AT_ONCE),
                                               thread_name_prefix="stoker-dimensions") as pool:
        return list(pool.map(names_of, readers))


def _order_clash(named: Sequence[tuple[str, ArrayReader]], stores: Stores | None,
                 storage_options: Any) -> tuple[str, ArrayReader, tuple, str, ArrayReader, tuple] | None:
    """The first of ``named`` (label, reader) pairs whose dimension names are those of an earlier one in another
    order, with that earlier one; None when there is none. Arrays without names, naming other dimensions, or
    whose names cannot be read (malformed ``_ARRAY_DIMENSIONS``, a store that fails the request) are not
    compared: the check is advisory."""
    first: tuple[str, ArrayReader, tuple] | None = None
    for (label, r), names in zip(named, _names_at_once([r for _, r in named], stores, storage_options)):
        if names is None or any(n is None for n in names):
            continue
        if first is None:
            first = (label, r, tuple(names))
        elif tuple(names) != first[2] and sorted(names) == sorted(first[2]):
            return (label, r, tuple(names)) + first
    return None


def check_channel_dimensions(readers: Sequence[ArrayReader], stores: Stores | None = None,
                             storage_options: Any = None) -> None:
    """InvalidArgument where arrays read as the channels of one box name the same dimensions in another order
    (xarray's ``(time, y, x)`` beside ``(time, x, y)`` on a square grid): stacked by axis position, one would
    be transposed against the other, where xarray aligns them by name. Arrays without names, or naming other
    dimensions, are not compared. ``stores`` and ``storage_options`` (by URI prefix, as Config's): those the
    arrays were opened with. An array whose names cannot be read (malformed ``_ARRAY_DIMENSIONS``, a store
    that fails the request) is left out: the check is advisory, and such an array was read before it. With
    ``Config(cf=True)`` (the default) the names were read with the arrays' CF attributes when opened; else a
    v2 array's ``.zattrs`` is read here, once per array and pipeline (a malformed one too: its error is kept)."""
    clash = _order_clash([("", r) for r in readers], stores, storage_options)
    if clash is not None:
        _, r, names, _, first_reader, first = clash
        raise InvalidArgument(f"{r.uri}: its dimensions {names} are those of {first_reader.uri} {first} in "
                              "another order, and channels are stacked by axis position: one would be "
                              "transposed against the other; store them in one order (xarray: "
                              "ds[var].transpose(*dims) before to_zarr)", uri=r.uri)


def check_field_dimensions(named: Sequence[tuple[str, ArrayReader]], who: str, stores: Stores | None = None,
                           storage_options: Any = None) -> None:
    """InvalidArgument where the arrays of a sampler's fields (``named``: ``("field 'x'", reader)``, a mask
    too) name the same dimensions in another order: the fields share one anchor and each box is placed on its
    arrays by axis position, so a target over ``(time, lon, lat)`` beside an input over ``(time, lat, lon)``
    would take the input's lat range on lon, where xarray aligns them by name. The rules of
    :func:`check_channel_dimensions` otherwise (advisory; unnamed or other dimensions are not compared). Remote
    v2 arrays' names (their ``.zattrs``, which nothing read before) are asked for all at once: a round trip at
    construction however many fields, not one per field."""
    clash = _order_clash(named, stores, storage_options)
    if clash is not None:
        label, r, names, first_label, first_reader, first = clash
        raise InvalidArgument(f"{who}: {label}'s array {r.uri} names its dimensions {names}, those of "
                              f"{first_label}'s {first_reader.uri} {first} in another order; fields share one "
                              "anchor, placed on every array by axis position, so one box would be transposed "
                              "against the other: store them in one order (xarray: ds[var].transpose(*dims) "
                              "before to_zarr)", uri=r.uri)


def stored_fill(reader: ArrayReader, stores: Stores | None = None, options: dict | None = None) -> Any:
    """A v2 array's ``.zarray`` ``fill_value`` as stored (JSON), where xarray takes it for the ``_FillValue``
    (the array names its dimensions); else None."""
    return _documents_of(reader, stores, options)[1]


def coding(reader: ArrayReader, stores: Stores | None = None, options: dict | None = None) -> CFCoding | None:
    """What CF decoding does to the array's values (:func:`stoker.zarr.cf.coding_of`), or None; worked out
    once per reader and kept on it (a planner asks for each array's several times a batch)."""
    derived = reader.derived
    if "cf" in derived:
        return derived["cf"]
    attrs, fill, _ = _documents_of(reader, stores, options)
    # setdefault: two threads working it out at once keep the same (equal) answer
    return derived.setdefault("cf", coding_of(attrs, reader.dtype, reader.zarr_format, fill, reader.uri))


def sibling_uri(uri: str, name: str) -> str:
    """The URI of the node ``name`` beside the array at ``uri`` (in its parent group)."""
    text = os.fspath(uri).rstrip("/")
    if "://" not in text:
        return os.path.join(os.path.dirname(os.path.abspath(text)), name)
    return text.rsplit("/", 1)[0] + "/" + name


def decoded(reader: ArrayReader, values: np.ndarray, stores: Stores | None = None,
            options: dict | None = None) -> np.ndarray:
    """``values`` read from ``reader`` decoded as xarray decodes a variable: CF times to dates and time spans
    (xarray's ``dtype: timedelta64`` beside a time unit) to timedeltas (masked values: NaT), else packed or
    filled values to floats; values without a coding as they are."""
    attrs = attributes(reader, stores, options)
    code = coding(reader, stores, options)
    spans = timedelta_dtype(attrs)
    if spans is not None:  # time spans (lead times), as xarray wrote them: hours beside dtype: timedelta64[..]
        if code is not None:
            values = code.decode(values, np.float64)
        return decode_timedeltas(values, attrs["units"], spans, reader.uri)
    if is_time_units(attrs.get("units")):
        if code is not None:  # masked or packed times: floats first, NaN the fills
            values = code.decode(values, np.float64)
        return decode_times(values, attrs["units"], attrs.get("calendar"), reader.uri)
    return values if code is None else code.decode(values, np.float64)


def coordinate(reader: ArrayReader, name: str, storage_options: dict | None = None,
               stores: Stores | None = None) -> np.ndarray | None:
    """The decoded labels of ``reader``'s dimension ``name`` (None: no coordinate array beside it, or one
    that is not 1-d and as long as the axis), read once per reader and name. A coordinate array stoker
    cannot read (strings: UnsupportedFormat) raises here, for the one who asked for it."""
    kept = reader.derived.get(("coordinate", name), _MISSING)
    if kept is not _MISSING:
        return kept
    names = dimension_names(reader, stores, storage_options) or ()
    if name not in names:
        return None
    axis = names.index(name)
    if reader.ndim == 1 and axis == 0 and os.path.basename(reader.uri.rstrip("/")) == name:
        coord = reader  # the coordinate itself
    else:
        try:
            coord = open_array(sibling_uri(reader.uri, name), storage_options, stores=stores)
        except (NotFound, InvalidArgument):  # nothing of that name, or a group: no coordinate array
            coord = None
    got = None
    if coord is not None and coord.ndim == 1 and coord.shape[0] == reader.shape[axis]:
        got = decoded(coord, coord.read([(0, coord.shape[0])]), stores, storage_options)
    reader.derived[("coordinate", name)] = got
    return got


def coordinates(reader: ArrayReader, storage_options: dict | None = None,
                stores: Stores | None = None) -> dict[str, np.ndarray | None]:
    """Each named dimension's coordinate labels, decoded (None: no coordinate array beside it, or one stoker
    cannot read, such as strings), read once per reader. A coordinate is the 1-d array named like the
    dimension in the array's parent group, as long as the axis (the xarray layout); see :func:`coordinate`
    for one dimension's, which says why it cannot be read."""
    kept = reader.derived.get("coordinates")
    if kept is not None:
        return kept
    out: dict[str, np.ndarray | None] = {}
    for name in dimension_names(reader, stores, storage_options) or ():
        if name is None or name in out:
            continue
        try:
            out[name] = coordinate(reader, name, storage_options, stores)
        except UnsupportedFormat:  # labels stoker reads no values of (strings): no labels to select by
            out[name] = None
    reader.derived["coordinates"] = out
    return out
