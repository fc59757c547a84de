"""Decompressors that never produce (or allocate for) more than a bound.

A stored chunk is untrusted: a 48 KB zstd frame can claim gigabytes, a gzip
stream of zeros expands a thousandfold. Each decoder here takes the most bytes
its output may hold (the chunk's size, or a bound on a filter's input) and
raises :class:`TooLarge` as soon as the output would pass it, having allocated
about the bound at most:

- zstd: the frames' content size is read from their headers first (zstd's own
  ``ZSTD_findDecompressedSize``); a frame that does not state it is decoded into
  a buffer of the bound (``ZSTD_decompress`` stops when it is full);
- lz4 (numcodecs' framing) and blosc: the decoded size in their headers is
  checked before numcodecs allocates it;
- gzip, zlib, bz2, lzma: the standard library's streaming decompressors with a
  maximum output, following numcodecs (the stdlib one-shot functions) on
  concatenated streams and trailing bytes.

``decoder(codec, bound)`` is the call to use (each family's decoder lives in its module: :mod:`.zstd`,
:mod:`.lz4`, :mod:`.blosc`, :mod:`.streams`); it is None for codecs not listed,
which keep numcodecs' own decode (their output is size-checked afterwards).
:func:`encoded_bound` is the other direction: the largest stored form of a
codec's input: the bound of the stage that decodes before it, and of a stored
chunk (``ChunkCodec.max_stored_nbytes``, which refuses files no chunk can be).
"""
from __future__ import annotations

import bz2
import lzma
from functools import partial
from typing import Any, Callable

import numcodecs
from numcodecs.abc import Codec

from . import blosc, lz4, streams, zstd
from .limit import TooLarge

__all__ = ["OVERHEAD_SLACK", "TooLarge", "decoder", "encoded_bound"]

#: room over the input that any compressor stoker knows needs at most: zstd and lz4 add under 1/256,
#: bzip2 1% plus 600 bytes, deflate and xz a few bytes per block, blosc 16 bytes
_OVERHEAD_SHARE = 64
OVERHEAD_SLACK = 64 << 10
_CHECKSUMS = {"crc32c", "crc32", "adler32", "fletcher32", "jenkins_lookup3"}  # each adds 4 bytes


def encoded_bound(codec: Codec, nbytes: int, slack: int = OVERHEAD_SLACK) -> int:
    """The most bytes ``codec`` can store for an input of ``nbytes``: generous, never tight. ``slack`` is
    the room added on top of the proportional share (headers, block tables, a tiny input's expansion)."""
    if codec.codec_id in _CHECKSUMS:
        return nbytes + 4
    if decoder(codec, 0) is not None:  # a compressor this module knows
        return nbytes + nbytes // _OVERHEAD_SHARE + slack
    return 2 * nbytes + slack  # any other bytes codec (base64 grows by a third)


def decoder(codec: Codec, bound: int) -> Callable[[Any], Any] | None:
    """A function decoding ``codec``'s output to at most ``bound`` bytes, or None for codecs not listed."""
    kind = type(codec)
    if kind is numcodecs.Zstd:
        return partial(zstd.decode, bound=bound)
    if kind is numcodecs.LZ4:
        return partial(lz4.decode, bound=bound)
    if codec.codec_id == "blosc":
        return partial(blosc.decode_bounded, codec, bound=bound)
    if kind is numcodecs.GZip:
        return partial(streams.gzip, bound=bound)
    if kind is numcodecs.Zlib:
        return partial(streams.zlib, bound=bound)
    if kind is numcodecs.BZ2:
        return partial(streams.concatenated, bz2.BZ2Decompressor, "bz2", bound=bound)
    if getattr(numcodecs, "LZMA", None) is not None and kind is numcodecs.LZMA:
        return partial(streams.concatenated, partial(lzma.LZMADecompressor, format=codec.format, filters=codec.filters),
                       "lzma", bound=bound)
    return None
