"""Array metadata for Zarr v2 (``.zarray``) and v3 (``zarr.json``), parsed into one frozen shape.

:class:`ArrayMetadata` is plain data: parsing does no I/O beyond the JSON document
it is handed, and never touches chunk data. Everything stoker does not
understand (an unknown codec, data type, chunk grid, storage transformer) is an
:class:`~stoker.errors.UnsupportedFormat` naming the array, so an unknown layout
can never be read as fill values.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import MetadataError, UnsupportedFormat
from .codecs.spec import (ARRAY_TO_BYTES, SerializedArray, bytes_endian, codec_name_and_config, v2_codec,
                          v3_array_codec, v3_bytes_codec)
from .codecs.chain import ChunkCodec
from .dtypes import parse_fill_value, parse_v2_dtype, parse_v3_dtype
from .fields import integer, lst, required, show, string
from .grid import ChunkKeyEncoding, grid_shape
from .sharding import CompressedShardCodec, ShardingSpec, parse_index_codecs


@dataclass(frozen=True)
class ArrayMetadata:
    """What an array's bytes mean.

    ``chunk_shape`` is the stored grid's chunk (the shard when sharded);
    ``read_chunk_shape`` is the unit that is decoded (the inner chunk when sharded).
    """

    uri: str
    zarr_format: int
    shape: tuple[int, ...]
    dtype: np.dtype  # native byte order
    chunk_shape: tuple[int, ...]
    fill_value: np.ndarray  # 0-d, of dtype
    key_encoding: ChunkKeyEncoding
    codec: ChunkCodec  # decodes one read chunk
    sharding: ShardingSpec | None = None
    #: the v3 ``zarr.json`` it was parsed from, kept by the read (of a local file or a store's: its attributes
    #: and dimension names are then read from it, not again: stoker.reader.coords), or a store's v2 ``.zarray``
    #: (its stored fill value, likewise); read-only, never compared
    document: dict | None = field(default=None, compare=False, repr=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def read_chunk_shape(self) -> tuple[int, ...]:
        return self.codec.shape

    @property
    def grid(self) -> tuple[int, ...]:
        """Number of read chunks along each axis."""
        return grid_shape(self.shape, self.read_chunk_shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def chunk_key(self, chunk_index: tuple[int, ...]) -> str:
        """Store key (relative to the array) of a stored chunk or shard by its grid index."""
        return self.key_encoding.key(chunk_index)


def renamed(meta: ArrayMetadata, uri: str) -> ArrayMetadata:
    """``meta`` as the parse of the same document for the array at ``uri``: every object that names its
    array (the metadata, its chunk codec, a sharded array's inner codec, a shard compressed whole and its
    inner codec) copied to name ``uri``; the rest (codecs, fill value) shared, as it is read-only.

    Many arrays of one dataset often have byte-identical documents (one shape, one chunking, one codec
    chain), and parsing one costs about 40 us of Python; a copy costs a few (``stoker.reader.metacache``).

    >>> renamed(parse_v3(doc, "/data/a.zarr"), "/data/b.zarr") == parse_v3(doc, "/data/b.zarr")
    True
    """
    sharding = _renamed_spec(meta.sharding, uri) if meta.sharding is not None else None
    return _with(meta, uri=uri, codec=sharding.inner if sharding is not None else _renamed_codec(meta.codec, uri),
                 sharding=sharding)


def _renamed_codec(codec: ChunkCodec, uri: str) -> ChunkCodec:
    if isinstance(codec, CompressedShardCodec):
        return _with(codec, uri=uri, spec=_renamed_spec(codec.spec, uri) if codec.spec is not None else None)
    return _with(codec, uri=uri)


def _renamed_spec(spec: ShardingSpec, uri: str) -> ShardingSpec:
    return _with(spec, inner=_renamed_codec(spec.inner, uri))


def with_document(meta: ArrayMetadata, doc: dict) -> ArrayMetadata:
    """``meta`` (parsed from ``doc``, a v3 ``zarr.json`` or a v2 ``.zarray``) keeping ``doc`` for what else it
    says (attributes and dimension names; v2's stored fill value), so nothing requests the document again."""
    return _with(meta, document=doc)


def _with(obj: Any, **fields: Any) -> Any:
    """A shallow copy of the frozen dataclass ``obj`` with ``fields`` set. Not ``dataclasses.replace``: that
    runs ``__post_init__`` again (the codec chain's bounds: the cost being saved), for the same values; nor
    ``copy.copy``, three times the cost of this for the same result (these dataclasses have no slots)."""
    out = object.__new__(type(obj))
    out.__dict__.update(obj.__dict__)
    out.__dict__.update(fields)
    return out


#: Most dimensions an array may have: numpy's own limit, and the one tensorstore keeps.
MAX_NDIM = 64
_MAX_INDEX = 2**63 - 1  # numpy indexes (and allocates) with signed 64-bit integers


def _shape(value: Any, what: str, uri: str, *, positive: bool) -> tuple[int, ...]:
    items = lst(value, what, uri)
    if len(items) > MAX_NDIM:
        raise UnsupportedFormat(
            f"{uri}: {what} has {len(items)} dimensions; stoker reads at most {MAX_NDIM} (numpy's limit)", uri=uri
        )
    for v in items:
        integer(v, f"{what} entry", uri, lo=1 if positive else 0)
        if v > _MAX_INDEX:
            raise UnsupportedFormat(f"{uri}: {what} entry {v} exceeds 2**63 - 1, the largest index numpy takes",
                                    uri=uri)
    return tuple(items)


def _check_chunk_size(chunks: tuple[int, ...], dtype: np.dtype, uri: str) -> None:
    """A chunk too large for any process to hold is refused at open, not when its first read allocates."""
    nbytes = math.prod(chunks) * dtype.itemsize
    if nbytes > _MAX_INDEX:
        raise UnsupportedFormat(f"{uri}: a chunk of shape {chunks} holds {nbytes} bytes, more than a process "
                                "can address", uri=uri)


def _v2_separator(doc: dict, uri: str, detected: str) -> str:
    """The chunk key separator: ``dimension_separator`` when the document has one (null counts as none,
    as some writers serialize an unset field), else ``detected`` (see ``array.detect_v2_separator``)."""
    separator = doc.get("dimension_separator")
    if separator is None:
        return detected
    if separator not in (".", "/"):
        raise MetadataError(f"{uri}: dimension_separator {show(separator)} is not '.' or '/'", uri=uri)
    return separator


def parse_v2(doc: dict, uri: str, *, separator: str = ".") -> ArrayMetadata:
    """Parse a ``.zarray`` document. ``separator`` is the chunk key separator to use when the document
    does not say (arrays written before zarr-python 2.8 do not)."""
    where = ".zarray"
    fmt = required(doc, "zarr_format", where, uri)
    if fmt != 2 or isinstance(fmt, bool):
        raise MetadataError(f"{uri}: .zarray has zarr_format {show(fmt)}, expected 2", uri=uri)
    shape = _shape(required(doc, "shape", where, uri), "shape", uri, positive=False)
    chunks = _shape(required(doc, "chunks", where, uri), "chunks", uri, positive=True)
    if len(chunks) != len(shape):
        raise MetadataError(f"{uri}: chunks {chunks} and shape {shape} differ in rank", uri=uri)
    stored = parse_v2_dtype(required(doc, "dtype", where, uri), uri)
    _check_chunk_size(chunks, stored, uri)
    return ArrayMetadata(
        uri=uri,
        zarr_format=2,
        shape=shape,
        dtype=stored.newbyteorder("="),
        chunk_shape=chunks,
        fill_value=parse_fill_value(required(doc, "fill_value", where, uri), stored, uri, 2),
        key_encoding=ChunkKeyEncoding(prefix="", separator=_v2_separator(doc, uri, separator)),
        codec=v2_codec(uri, doc, chunks, stored),
    )


def _transpose_order(config: dict, ndim: int, uri: str) -> tuple[int, ...]:
    """The permutation of a v3 ``transpose`` codec (``"C"``/``"F"`` are early drafts' spellings)."""
    perm = required(config, "order", "transpose codec configuration", uri)
    if perm == "C":
        return tuple(range(ndim))
    if perm == "F":
        return tuple(reversed(range(ndim)))
    items = lst(perm, "transpose order", uri)
    for p in items:
        integer(p, "transpose order entry", uri)
    if sorted(items) != list(range(ndim)):
        raise MetadataError(
            f"{uri}: transpose order {show(perm)} is not a permutation of the {ndim} axes", uri=uri
        )
    return tuple(items)


def _v3_chunk_codec(entries: Any, chunk_shape: tuple[int, ...], dtype: np.dtype, fill: np.ndarray, uri: str,
                    where: str = "codecs") -> ChunkCodec | ShardingSpec:
    """Walk a v3 codec list: array->array, one array->bytes, then bytes->bytes.

    Returns a :class:`ChunkCodec` for plain chunks (a :class:`CompressedShardCodec` for shards compressed
    whole) or a :class:`ShardingSpec`.
    """
    order: tuple[int, ...] = tuple(range(len(chunk_shape)))
    filters: list = []  # numcodecs array-to-array codecs, in encode order
    decoded = encoded = dtype  # what the first filter's decoder returns; what the last one stores
    serializer: tuple[str, dict] | None = None
    compressors = []
    for entry in lst(entries, where, uri):
        name, config = codec_name_and_config(entry, uri)
        if serializer is None:
            if name == "transpose":
                perm = _transpose_order(config, len(chunk_shape), uri)
                order = tuple(order[p] for p in perm)  # stored = chunk.transpose(order)
            elif name in ("bytes", "sharding_indexed"):
                serializer = (name, config)
            elif name in ARRAY_TO_BYTES:
                raise UnsupportedFormat(
                    f"{uri}: array-to-bytes codec {name!r} is not supported (stoker reads 'bytes' and "
                    "'sharding_indexed')", uri=uri, codec=name,
                )
            else:
                codec, decoding, encoded = v3_array_codec(name, config, encoded, uri)
                decoded = decoding if not filters else decoded
                filters.append(codec)
        else:
            compressors.append(v3_bytes_codec(name, config, uri))
    if serializer is None:
        raise MetadataError(f"{uri}: {where} {show(entries)} has no array-to-bytes codec ('bytes' or "
                            "'sharding_indexed')", uri=uri)
    identity = order == tuple(range(len(chunk_shape)))
    if filters and not identity:
        raise UnsupportedFormat(f"{uri}: transpose together with numcodecs array-to-array codecs is not "
                                "supported", uri=uri)
    name, config = serializer
    if name == "sharding_indexed":
        if not identity or filters:
            raise UnsupportedFormat(f"{uri}: array-to-array codecs before sharding_indexed are not supported",
                                    uri=uri)
        spec = _sharding(config, chunk_shape, dtype, fill, uri)
        if not compressors:
            return spec
        return CompressedShardCodec(uri=uri, shape=chunk_shape, dtype=dtype, stored_dtype=spec.inner.stored_dtype,
                                    spec=spec, outer=tuple(compressors), fill_value=fill)
    big = bytes_endian(config, encoded.itemsize, uri)
    if not filters:
        stored = dtype.newbyteorder(">" if big else "<") if dtype.itemsize > 1 else dtype
    else:  # the filters' decoders see the bytes; the chunk is what the first one returns
        serialized = encoded.newbyteorder(">" if big else "<") if encoded.itemsize > 1 else encoded
        if serialized != encoded:
            filters.append(SerializedArray(serialized, encoded))
        stored = decoded
    return ChunkCodec(
        uri=uri,
        shape=chunk_shape,
        dtype=dtype,
        stored_dtype=stored,
        order=None if identity else order,
        filters=tuple(filters),
        compressors=tuple(compressors),
    )


def _sharding(config: dict, shard_shape: tuple[int, ...], dtype: np.dtype, fill: np.ndarray,
              uri: str) -> ShardingSpec:
    """The layout a ``sharding_indexed`` codec configuration describes."""
    what = "sharding_indexed configuration"
    inner_shape = _shape(required(config, "chunk_shape", what, uri), "sharding chunk_shape", uri, positive=True)
    if len(inner_shape) != len(shard_shape) or any(s % i for s, i in zip(shard_shape, inner_shape)):
        raise MetadataError(
            f"{uri}: inner chunk shape {inner_shape} does not divide shard shape {shard_shape}", uri=uri
        )
    inner = _v3_chunk_codec(config.get("codecs", [{"name": "bytes"}]), inner_shape, dtype, fill, uri,
                            "sharding_indexed codecs")
    if isinstance(inner, (ShardingSpec, CompressedShardCodec)):
        raise UnsupportedFormat(f"{uri}: nested sharding is not supported yet", uri=uri, codec="sharding_indexed")
    location = string(config.get("index_location", "end"), "sharding index_location", uri)
    if location not in ("start", "end"):
        raise MetadataError(f"{uri}: index_location {show(location)} is not 'start' or 'end'", uri=uri)
    big, crc = parse_index_codecs(config.get("index_codecs", [{"name": "bytes"}, {"name": "crc32c"}]), uri)
    return ShardingSpec(
        chunks_per_shard=tuple(s // i for s, i in zip(shard_shape, inner_shape)),
        index_location=location,
        index_big_endian=big,
        index_crc32c=crc,
        inner=inner,
    )


def _key_encoding(value: Any, uri: str) -> ChunkKeyEncoding:
    name, config = codec_name_and_config(value, uri, "chunk_key_encoding")
    if name == "default":
        prefix, separator = "c", config.get("separator", "/")
    elif name == "v2":
        prefix, separator = "", config.get("separator", ".")
    else:
        raise UnsupportedFormat(f"{uri}: chunk_key_encoding {name!r} is not supported", uri=uri)
    if separator not in (".", "/"):
        raise MetadataError(f"{uri}: chunk key separator {show(separator)} is not '.' or '/'", uri=uri)
    return ChunkKeyEncoding(prefix=prefix, separator=separator)


#: The members of a v3 array document (the core specification's); any other is an extension.
V3_ARRAY_FIELDS = frozenset({"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
                             "fill_value", "codecs", "attributes", "dimension_names", "storage_transformers"})


def parse_v3(doc: dict, uri: str) -> ArrayMetadata:
    """Parse a ``zarr.json`` array document."""
    where = "zarr.json"
    node_type = required(doc, "node_type", where, uri)
    if node_type != "array":
        raise MetadataError(f"{uri}: is a Zarr v3 {show(node_type)}, not an array", uri=uri)
    # an extension member may change what the bytes mean: the specification lets a reader ignore only those
    # that say "must_understand": false (zarr-python refuses the others too)
    for name in doc.keys() - V3_ARRAY_FIELDS:
        value = doc[name]
        if not (isinstance(value, dict) and value.get("must_understand") is False):
            raise UnsupportedFormat(
                f"{uri}: zarr.json has the extension field {show(name)}, which stoker does not understand (only "
                "fields marked \"must_understand\": false may be ignored); read it with a reader that implements "
                "that extension, or remove the field if it does not change the stored values", uri=uri)
    shape = _shape(required(doc, "shape", where, uri), "shape", uri, positive=False)
    dtype = parse_v3_dtype(required(doc, "data_type", where, uri), uri)
    grid_name, grid = codec_name_and_config(required(doc, "chunk_grid", where, uri), uri, "chunk_grid")
    if grid_name != "regular":
        raise UnsupportedFormat(
            f"{uri}: chunk grid {grid_name!r} is not supported (stoker reads 'regular')", uri=uri, grid=grid_name,
        )
    chunks = _shape(required(grid, "chunk_shape", "regular chunk_grid configuration", uri), "chunk_shape", uri,
                    positive=True)
    if len(chunks) != len(shape):
        raise MetadataError(f"{uri}: chunk_shape {chunks} and shape {shape} differ in rank", uri=uri)
    _check_chunk_size(chunks, dtype, uri)
    transformers = doc.get("storage_transformers")
    if transformers is not None and lst(transformers, "storage_transformers", uri):
        raise UnsupportedFormat(f"{uri}: storage transformers are not supported", uri=uri)
    encoding = _key_encoding(required(doc, "chunk_key_encoding", where, uri), uri)
    fill = parse_fill_value(required(doc, "fill_value", where, uri), dtype, uri, 3)
    chain = _v3_chunk_codec(required(doc, "codecs", where, uri), chunks, dtype, fill, uri)
    sharding = chain if isinstance(chain, ShardingSpec) else None
    return ArrayMetadata(
        uri=uri,
        zarr_format=3,
        shape=shape,
        dtype=dtype,
        chunk_shape=chunks,
        fill_value=fill,
        key_encoding=encoding,
        codec=sharding.inner if sharding else chain,
        sharding=sharding,
    )


def parse_json(raw: bytes, uri: str, name: str) -> dict:
    """Decode a metadata document, naming the file when it is not valid JSON."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MetadataError(f"{uri}: {name} is not valid JSON ({exc})", uri=uri) from None
    except RecursionError:  # the C decoder recurses once per level of nesting
        raise MetadataError(f"{uri}: {name} is nested too deeply to be Zarr metadata", uri=uri) from None
    if not isinstance(doc, dict):
        raise MetadataError(f"{uri}: {name} must hold a JSON object", uri=uri)
    return doc

