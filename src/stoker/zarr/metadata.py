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
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import MetadataError, UnsupportedFormat
from .codecs import ChunkCodec, codec_name_and_config, v2_codec, v3_bytes_codec
from .dtypes import parse_fill_value, parse_v2_dtype, parse_v3_dtype
from .grid import ChunkKeyEncoding, grid_shape
from .sharding import ShardingSpec, parse_index_codecs


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


def _shape(value: Any, what: str, uri: str, *, positive: bool) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise MetadataError(f"{uri}: {what} must be a list of integers, got {value!r}", uri=uri)
    if any(v < (1 if positive else 0) for v in value):
        raise MetadataError(f"{uri}: {what} {value!r} has {'non-positive' if positive else 'negative'} entries", uri=uri)
    return tuple(value)


def parse_v2(doc: dict, uri: str) -> ArrayMetadata:
    """Parse a ``.zarray`` document."""
    shape = _shape(doc.get("shape"), "shape", uri, positive=False)
    chunks = _shape(doc.get("chunks"), "chunks", uri, positive=True)
    if len(chunks) != len(shape):
        raise MetadataError(f"{uri}: chunks {chunks} and shape {shape} differ in rank", uri=uri)
    stored = parse_v2_dtype(doc.get("dtype"), uri)
    separator = doc.get("dimension_separator") or "."
    if separator not in (".", "/"):
        raise UnsupportedFormat(f"{uri}: dimension_separator {separator!r} is not '.' or '/'", uri=uri)
    return ArrayMetadata(
        uri=uri,
        zarr_format=2,
        shape=shape,
        dtype=stored.newbyteorder("="),
        chunk_shape=chunks,
        fill_value=parse_fill_value(doc.get("fill_value"), stored, uri, 2),
        key_encoding=ChunkKeyEncoding(prefix="", separator=separator),
        codec=v2_codec(uri, doc, chunks, stored),
    )


def _v3_chunk_codec(entries: list, chunk_shape: tuple[int, ...], dtype: np.dtype, uri: str):
    """Walk a v3 codec list: array->array, one array->bytes, then bytes->bytes.

    Returns a :class:`ChunkCodec` for plain chunks or a :class:`ShardingSpec`.
    """
    order: tuple[int, ...] = tuple(range(len(chunk_shape)))
    serializer: tuple[str, dict] | None = None
    compressors = []
    for entry in entries:
        name, config = codec_name_and_config(entry, uri)
        if serializer is None:
            if name == "transpose":
                perm = config.get("order")
                if perm == "C":
                    perm = list(range(len(chunk_shape)))
                elif perm == "F":
                    perm = list(reversed(range(len(chunk_shape))))
                if not isinstance(perm, list) or sorted(perm) != list(range(len(chunk_shape))):
                    raise UnsupportedFormat(f"{uri}: transpose order {perm!r} is not a permutation", uri=uri)
                order = tuple(order[p] for p in perm)  # stored = chunk.transpose(order)
            elif name in ("bytes", "sharding_indexed"):
                serializer = (name, config)
            else:
                raise UnsupportedFormat(
                    f"{uri}: array-to-array codec {name!r} is not supported (stoker reads 'transpose')",
                    uri=uri, codec=name,
                )
        else:
            if serializer[0] == "sharding_indexed":
                raise UnsupportedFormat(
                    f"{uri}: codec {name!r} after sharding_indexed is not supported", uri=uri, codec=name
                )
            compressors.append(v3_bytes_codec(name, config, uri))
    if serializer is None:
        raise UnsupportedFormat(f"{uri}: codec chain {entries!r} has no array-to-bytes codec", uri=uri)
    name, config = serializer
    if name == "sharding_indexed":
        if order != tuple(range(len(chunk_shape))):
            raise UnsupportedFormat(f"{uri}: transpose before sharding_indexed is not supported", uri=uri)
        inner_shape = _shape(config.get("chunk_shape"), "sharding chunk_shape", uri, positive=True)
        if len(inner_shape) != len(chunk_shape) or any(s % i for s, i in zip(chunk_shape, inner_shape)):
            raise MetadataError(
                f"{uri}: inner chunk shape {inner_shape} does not divide shard shape {chunk_shape}", uri=uri
            )
        inner = _v3_chunk_codec(config.get("codecs") or [{"name": "bytes"}], inner_shape, dtype, uri)
        if isinstance(inner, ShardingSpec):
            raise UnsupportedFormat(f"{uri}: nested sharding is not supported yet", uri=uri, codec=name)
        location = config.get("index_location", "end")
        if location not in ("start", "end"):
            raise UnsupportedFormat(f"{uri}: index_location {location!r} is not 'start' or 'end'", uri=uri)
        big, crc = parse_index_codecs(
            config.get("index_codecs") or [{"name": "bytes"}, {"name": "crc32c"}], uri
        )
        return ShardingSpec(
            chunks_per_shard=tuple(s // i for s, i in zip(chunk_shape, inner_shape)),
            index_location=location,
            index_big_endian=big,
            index_crc32c=crc,
            inner=inner,
        )
    endian = config.get("endian", "little")
    if endian not in ("little", "big"):
        raise UnsupportedFormat(f"{uri}: bytes codec endian {endian!r}", uri=uri)
    stored = dtype.newbyteorder("<" if endian == "little" else ">") if dtype.itemsize > 1 else dtype
    identity = order == tuple(range(len(chunk_shape)))
    return ChunkCodec(
        uri=uri,
        shape=chunk_shape,
        dtype=dtype,
        stored_dtype=stored,
        order=None if identity else order,
        compressors=tuple(compressors),
    )


def parse_v3(doc: dict, uri: str) -> ArrayMetadata:
    """Parse a ``zarr.json`` array document."""
    if doc.get("node_type") != "array":
        raise MetadataError(f"{uri}: is a Zarr v3 {doc.get('node_type')!r}, not an array", uri=uri)
    shape = _shape(doc.get("shape"), "shape", uri, positive=False)
    dtype = parse_v3_dtype(doc.get("data_type"), uri)
    grid = doc.get("chunk_grid") or {}
    if grid.get("name") != "regular":
        raise UnsupportedFormat(
            f"{uri}: chunk grid {grid.get('name')!r} is not supported (stoker reads 'regular')",
            uri=uri, grid=grid.get("name"),
        )
    chunks = _shape((grid.get("configuration") or {}).get("chunk_shape"), "chunk_shape", uri, positive=True)
    if len(chunks) != len(shape):
        raise MetadataError(f"{uri}: chunk_shape {chunks} and shape {shape} differ in rank", uri=uri)
    if doc.get("storage_transformers"):
        raise UnsupportedFormat(f"{uri}: storage transformers are not supported", uri=uri)
    kenc = doc.get("chunk_key_encoding") or {"name": "default"}
    kname, kconf = codec_name_and_config(kenc, uri)
    if kname == "default":
        encoding = ChunkKeyEncoding(prefix="c", separator=kconf.get("separator", "/"))
    elif kname == "v2":
        encoding = ChunkKeyEncoding(prefix="", separator=kconf.get("separator", "."))
    else:
        raise UnsupportedFormat(f"{uri}: chunk_key_encoding {kname!r} is not supported", uri=uri)
    if encoding.separator not in (".", "/"):
        raise UnsupportedFormat(f"{uri}: chunk key separator {encoding.separator!r}", uri=uri)
    chain = _v3_chunk_codec(doc.get("codecs") or [], chunks, dtype, uri)
    sharding = chain if isinstance(chain, ShardingSpec) else None
    return ArrayMetadata(
        uri=uri,
        zarr_format=3,
        shape=shape,
        dtype=dtype,
        chunk_shape=chunks,
        fill_value=parse_fill_value(doc.get("fill_value"), dtype, uri, 3),
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
    if not isinstance(doc, dict):
        raise MetadataError(f"{uri}: {name} must hold a JSON object", uri=uri)
    return doc

