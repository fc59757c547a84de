"""How much a crop shape costs on an array's chunking: expected read and decode amplification.

Pure geometry over the same chunk intersections the planner uses, averaged over
seeded random in-bounds crops:

>>> est = estimate(arr.metadata, sample_shape=(32, 128, 128), blocksize=262144, compression_ratio=2.0)
>>> est.chunks_per_crop, est.decode_full, est.decode_partial, est.read
(8.0, 7.4, 4.6, 2.3)

``decode_full`` is what a reader that decodes whole chunks pays (bytes decoded per
byte the crop holds); ``decode_partial`` what stoker pays when the codec lets it
decode only some blosc blocks; ``read`` the encoded bytes read per crop byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .codecs.blosc import decoded_span, partial_pays
from .grid import c_order_span, chunk_intersections
from .metadata import ArrayMetadata


@dataclass(frozen=True)
class Estimate:
    sample_shape: tuple[int, ...]
    chunks_per_crop: float
    decode_full: float
    decode_partial: float | None  # None: the codec does not allow partial decoding
    read: float | None  # None: no compression ratio known
    advice: tuple[str, ...]


def _partial_bytes(chunk_shape: Sequence[int], itemsize: int, sels: list[tuple[slice, ...]], blocksize: int) -> int:
    """Bytes stoker decodes for the selections in one chunk: the whole blosc blocks covering their C-order
    span, or the whole chunk where that needs most of its blocks."""
    lo, hi = c_order_span(chunk_shape, itemsize, sels)
    nbytes = math.prod(chunk_shape) * itemsize
    if not partial_pays(nbytes, blocksize, lo, hi):
        return nbytes  # stoker decodes such a chunk whole
    lo, hi = decoded_span(nbytes, blocksize, lo, hi)
    return hi - lo


def estimate(meta: ArrayMetadata, sample_shape: Sequence[int], n: int = 512, seed: int = 0,
             blocksize: int | None = None, compression_ratio: float | None = None) -> Estimate:
    """Average over ``n`` seeded random crops of ``sample_shape`` in ``meta``'s array."""
    shape = tuple(int(s) for s in sample_shape)
    chunk = meta.read_chunk_shape
    itemsize = meta.dtype.itemsize
    chunk_bytes = math.prod(chunk) * itemsize
    crop_bytes = math.prod(shape) * itemsize
    rng = np.random.default_rng(seed)
    touched = decoded_full = decoded_partial = 0
    for _ in range(n):
        corner = [int(rng.integers(0, s - c + 1)) for s, c in zip(meta.shape, shape)]
        pieces = list(chunk_intersections(tuple((a, a + c) for a, c in zip(corner, shape)), chunk))
        touched += len(pieces)
        decoded_full += len(pieces) * chunk_bytes
        if blocksize:
            decoded_partial += sum(_partial_bytes(chunk, itemsize, [p.chunk_sel], blocksize) for p in pieces)
    per_crop = touched / n
    full = decoded_full / (n * crop_bytes)
    partial = decoded_partial / (n * crop_bytes) if blocksize else None
    paid = partial if partial is not None else full
    read = paid / compression_ratio if compression_ratio else None
    return Estimate(shape, per_crop, full, partial, read,
                    tuple(_advice(chunk, shape, tuple(meta.shape), per_crop, paid)))


def _advice(chunk: Sequence[int], crop: Sequence[int], array: Sequence[int], per_crop: float,
            paid: float) -> list[str]:
    out = []
    if paid > 4:
        # A random crop straddles chunk boundaries on every axis it does not span whole; chunks about half
        # the crop there keep the decoded margin around it small without multiplying the number of chunks
        # too much. On an axis the crop spans whole it always starts at 0 and straddles nothing: one chunk
        # across the axis wastes nothing, where halving it would only double the chunks each crop touches.
        whole = [i for i, (c, n) in enumerate(zip(crop, array)) if c == n]
        suggestion = tuple(n if i in whole else max(c // 2, 1) for i, (c, n) in enumerate(zip(crop, array)))
        big = [i for i, (k, c) in enumerate(zip(chunk, crop)) if k > c]
        straddled = [i for i in range(len(crop)) if i not in whole]
        why = (f"chunks are larger than the crop on axes {big}" if big else
               "crops straddle chunk boundaries on every axis" if not whole else
               f"crops straddle chunk boundaries on axes {straddled}")
        out.append(
            f"chunks limit throughput: each crop decodes {paid:.1f}x the bytes it holds ({why}). Chunks of about "
            f"{suggestion}, or crops aligned to the chunk grid (stoker.TileGrid), would cut that."
        )
    if per_crop > 64:
        out.append(
            f"each crop touches {per_crop:.0f} chunks: per-chunk overhead (file opens, codec calls) will dominate; "
            "use larger chunks or sharding with inner chunks close to the crop size."
        )
    if not out:
        out.append("chunking suits this crop shape: decode work stays within 4x of the bytes delivered.")
    return out
