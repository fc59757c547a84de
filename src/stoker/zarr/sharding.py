"""The ``sharding_indexed`` codec: where inner chunks live inside a shard file.

A shard holds ``chunks_per_shard`` inner chunks and an index of
``(offset, nbytes)`` uint64 pairs (C order), at the start or the end of the
file, encoded by its own codec chain (``bytes`` then optionally ``crc32c``).
An entry of two all-ones words means "this inner chunk is empty" (fill value).

A shard compressed whole (bytes-to-bytes codecs after ``sharding_indexed``) is
read as one chunk by :class:`CompressedShardCodec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numcodecs
import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray

from ..errors import DecodeError, UnsupportedFormat
from .codecs import bounds
from .codecs.chain import ChunkCodec, decode_stages, run_stages
from .codecs.spec import bytes_endian, codec_name_and_config
from .fields import lst, show

EMPTY_ENTRY = 2**64 - 1  # offset and length of an inner chunk that is not stored
EMPTY = np.uint64(EMPTY_ENTRY)
_INNER_SLACK = 1 << 10  # room per inner chunk of a shard compressed whole (see CompressedShardCodec)


@dataclass(frozen=True)
class ShardingSpec:
    """Layout of a sharded array: inner chunk codec plus where the index is and how it is encoded."""

    chunks_per_shard: tuple[int, ...]
    index_location: str  # "start" | "end"
    index_big_endian: bool
    index_crc32c: bool
    inner: ChunkCodec

    @property
    def n_inner(self) -> int:
        return math.prod(self.chunks_per_shard)

    @property
    def index_nbytes(self) -> int:
        return 16 * self.n_inner + (4 if self.index_crc32c else 0)

    def index_range(self, shard_size: int) -> tuple[int, int]:
        """``(offset, length)`` of the index inside a shard file of ``shard_size`` bytes."""
        if self.index_location == "start":
            return 0, self.index_nbytes
        return shard_size - self.index_nbytes, self.index_nbytes

    def decode_index(self, raw: bytes | memoryview, uri: str, key: str, shard_size: int | None) -> np.ndarray:
        """Decode and validate a shard index into a ``(n_inner, 2)`` native uint64 array.

        Raises :class:`DecodeError` on a checksum mismatch or when an entry points
        outside the shard file (a shard shorter than its index claims). ``shard_size`` None: not known
        (a remote shard's index read as a suffix); only entries past any value's size are refused then.
        """
        known = shard_size is not None
        if shard_size is None:
            shard_size = (1 << 63) - 1  # no stored value is larger
        if len(raw) != self.index_nbytes:
            raise DecodeError(
                f"{uri}: shard {key!r} is truncated: its index needs {self.index_nbytes} bytes, "
                + (f"the file has {shard_size}" if known else f"{len(raw)} were read"),
                uri=uri, key=key,
            )
        payload = raw
        if self.index_crc32c:
            try:
                payload = numcodecs.CRC32C(location="end").decode(raw)
            except Exception as exc:
                raise DecodeError(
                    f"{uri}: shard {key!r} has a corrupt index ({exc})", uri=uri, key=key
                ) from None
        dtype = np.dtype(">u8" if self.index_big_endian else "<u8")
        index = np.frombuffer(payload, dtype=dtype).astype(np.uint64).reshape(self.n_inner, 2)
        present = ~((index[:, 0] == EMPTY) & (index[:, 1] == EMPTY))
        if present.any():
            ends = index[present, 0] + index[present, 1]
            overflow = (ends < index[present, 0]) | (ends > np.uint64(shard_size))
            if overflow.any():
                bad = int(np.flatnonzero(present)[np.argmax(overflow)])
                off, n = (int(v) for v in index[bad])
                raise DecodeError(
                    f"{uri}: shard {key!r} is shorter than its index claims: inner chunk {bad} at "
                    f"[{off}, {off + n}) " + (f"but the file has {shard_size} bytes" if known else
                                              "past the end of any value a store can hold"),
                    uri=uri, key=key,
                )
        return index

    def inner_position(self, chunk_index: Sequence[int]) -> tuple[tuple[int, ...], int]:
        """``(shard grid index, flat inner-chunk index)`` of a read-chunk grid index."""
        shard = tuple(i // c for i, c in zip(chunk_index, self.chunks_per_shard))
        flat = 0
        for i, c in zip(chunk_index, self.chunks_per_shard):
            flat = flat * c + i % c
        return shard, flat


@dataclass(frozen=True)
class CompressedShardCodec(ChunkCodec):
    """A shard compressed whole: bytes-to-bytes codecs after ``sharding_indexed``.

    zarr-python writes this when a sharding codec is the serializer and compressors follow it
    (``create_array(..., serializer=ShardingCodec(...))`` with its default compressors). The file is then
    one compressed blob of inner chunks and index, and no byte range of it is an inner chunk, so the
    shard is the read chunk: :meth:`decode` decompresses the file, validates the index against the
    decompressed size and assembles every inner chunk (the fill value for empty entries) into one
    shard-shaped array. The array reads as unsharded (``ArrayMetadata.sharding`` is None), so the reader,
    the planner and the executor take it unchanged; the compiled reader does not (no lone compressor).
    A decode holds the decompressed shard and the assembled array at once.
    """

    spec: ShardingSpec | None = None
    outer: tuple[Codec, ...] = ()  # the codecs after sharding_indexed, in encode order
    fill_value: np.ndarray | None = field(default=None, compare=False)  # 0-d, native dtype
    _outer: tuple = field(init=False, repr=False, compare=False)  # per outer codec, in decode order

    def __post_init__(self) -> None:
        super().__post_init__()
        # The decompressed blob holds every inner chunk at its largest stored size, and the index. Per inner
        # chunk 1 KiB over the proportional share suffices for any codec stoker knows (each adds at most a
        # few hundred bytes to incompressible input: docs/performance.md, "Tuning constants"); 64 KiB each,
        # the slack of a lone chunk, would make the bound 100x the shard.
        spec = self.spec
        blob = spec.n_inner * spec.inner.stored_bound(_INNER_SLACK) + spec.index_nbytes + bounds.OVERHEAD_SLACK
        stages, stored = decode_stages(self.outer, blob)
        object.__setattr__(self, "_outer", stages)
        object.__setattr__(self, "max_stored_nbytes", stored)

    @property
    def names(self) -> tuple[str, ...]:
        inner = " -> ".join(self.spec.inner.names) or "bytes"
        return (f"sharding_indexed({inner})", *(c.codec_id for c in self.outer))

    def decode(self, encoded: Any, key: str = "?") -> np.ndarray:
        """Decompress the shard file ``encoded`` and assemble its inner chunks (C-contiguous, native)."""
        with self.typed_errors(key):
            blob = memoryview(ensure_contiguous_ndarray(run_stages(self._outer, encoded))).cast("B")
        spec = self.spec
        size = blob.nbytes
        if size < spec.index_nbytes:
            raise DecodeError(f"{self.uri}: shard {key!r} is truncated: {size} bytes decompressed, but its index "
                              f"alone needs {spec.index_nbytes}", uri=self.uri, key=key)
        start, length = spec.index_range(size)
        index = spec.decode_index(blob[start:start + length], self.uri, key, size)
        out = np.empty(self.shape, dtype=self.dtype)
        out[...] = self.fill_value
        inner = spec.inner
        for i, (offset, nbytes) in enumerate(index.tolist()):
            if offset == nbytes == EMPTY_ENTRY:
                continue
            at = np.unravel_index(i, spec.chunks_per_shard)
            sel = tuple(slice(a * c, (a + 1) * c) for a, c in zip(at, inner.shape))
            out[sel] = inner.decode(blob[offset:offset + nbytes], f"{key}[{i}]")
        return out


def parse_index_codecs(entries: Any, uri: str) -> tuple[bool, bool]:
    """``(big_endian, crc32c)`` from ``index_codecs``; anything else is unsupported."""
    names = [codec_name_and_config(e, uri, "index codec") for e in lst(entries, "sharding index_codecs", uri)]
    if not names or names[0][0] != "bytes":
        raise UnsupportedFormat(f"{uri}: shard index codecs {show(entries)} must start with 'bytes'", uri=uri)
    big = bytes_endian(names[0][1], 8, uri)
    rest = [n for n, _ in names[1:]]
    if rest and rest != ["crc32c"]:
        raise UnsupportedFormat(
            f"{uri}: shard index codecs {show(rest)} are not supported (only 'bytes' and 'crc32c')",
            uri=uri, codec=rest[0],
        )
    return big, bool(rest)
