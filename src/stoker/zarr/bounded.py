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

``decoder(codec, bound)`` is the call to use; it is None for codecs not listed,
which keep numcodecs' own decode (their output is size-checked afterwards).
:func:`encoded_bound` is the other direction: the largest stored form of a
codec's input: the bound of the stage that decodes before it, and of a stored
chunk (``ChunkCodec.max_stored_nbytes``, which refuses files no chunk can be).
"""

from __future__ import annotations

import bz2
import ctypes
import lzma
import struct
import zlib
from functools import partial
from typing import Any, Callable

import numcodecs
import numpy as np
from numcodecs.abc import Codec

from .blosc_partial import blosc_header

#: room over the input that any compressor stoker knows needs at most: zstd and lz4 add under 1/256,
#: bzip2 1% plus 600 bytes, deflate and xz a few bytes per block, blosc 16 bytes
_OVERHEAD_SHARE = 64
OVERHEAD_SLACK = 64 << 10
_CHECKSUMS = {"crc32c", "crc32", "adler32", "fletcher32", "jenkins_lookup3"}  # each adds 4 bytes


class TooLarge(ValueError):
    """The stored bytes decode to more than ``bound`` bytes (the caller words the error with its context)."""

    def __init__(self, codec_id: str, bound: int, claimed: int | None = None) -> None:
        said = f" (its header says {claimed})" if claimed is not None else ""
        super().__init__(f"{codec_id} output exceeds {bound} bytes{said}")
        self.codec_id, self.bound, self.claimed = codec_id, bound, claimed


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
        return partial(zstd, bound=bound)
    if kind is numcodecs.LZ4:
        return partial(lz4, bound=bound)
    if codec.codec_id == "blosc":
        return partial(blosc, codec, bound=bound)
    if kind is numcodecs.GZip:
        return partial(gzip, bound=bound)
    if kind is numcodecs.Zlib:
        return partial(zlib_, bound=bound)
    if kind is numcodecs.BZ2:
        return partial(_streams, bz2.BZ2Decompressor, "bz2", bound=bound)
    if getattr(numcodecs, "LZMA", None) is not None and kind is numcodecs.LZMA:
        return partial(_streams, partial(lzma.LZMADecompressor, format=codec.format, filters=codec.filters),
                       "lzma", bound=bound)
    return None


# -- zstd ------------------------------------------------------------------------------------------

_CONTENTSIZE_UNKNOWN = 2**64 - 1
_CONTENTSIZE_ERROR = 2**64 - 2
_ERROR_DST_TOO_SMALL = 70  # ZSTD_error_dstSize_tooSmall, a stable value of zstd's error enum


def _load_zstd():
    """zstd's size and one-shot functions from numcodecs' extension (as ``stoker.native`` finds them)."""
    try:
        from numcodecs import zstd as nz

        lib = ctypes.CDLL(nz.__file__)
        size, dec, is_error, code = (lib.ZSTD_findDecompressedSize, lib.ZSTD_decompress, lib.ZSTD_isError,
                                     lib.ZSTD_getErrorCode)
        name = lib.ZSTD_getErrorName
    except (ImportError, OSError, AttributeError):
        return None
    size.argtypes, size.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_ulonglong
    dec.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    dec.restype = ctypes.c_size_t
    is_error.argtypes, is_error.restype = [ctypes.c_size_t], ctypes.c_uint
    code.argtypes, code.restype = [ctypes.c_size_t], ctypes.c_int
    name.argtypes, name.restype = [ctypes.c_size_t], ctypes.c_char_p
    return nz.decompress, size, dec, is_error, code, name


_zstd = _load_zstd()


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]  # what ``a.ctypes.data`` gives, without its costly object


def zstd(data: Any, bound: int) -> Any:
    """Decode zstd frames to at most ``bound`` bytes (``TooLarge`` otherwise; ``ValueError`` if corrupt)."""
    if _zstd is None:  # a numcodecs build without zstd's symbols: its own decode, unbounded
        return numcodecs.zstd.decompress(data)
    decompress, find_size, raw_decompress, is_error, error_code, error_name = _zstd
    src = np.frombuffer(data, dtype=np.uint8)
    address = _address(src)
    size = find_size(address, src.nbytes)
    if size == _CONTENTSIZE_ERROR:
        raise ValueError("not a zstd frame")
    if size != _CONTENTSIZE_UNKNOWN:
        if size > bound:
            raise TooLarge("zstd", bound, size)
        return decompress(src)  # allocates the stated size, which fits
    # a frame that does not state its size (streamed compressors write these): decode into the bound
    out = np.empty(bound, dtype=np.uint8)
    got = raw_decompress(_address(out), bound, address, src.nbytes)
    if is_error(got):
        if error_code(got) == _ERROR_DST_TOO_SMALL:
            raise TooLarge("zstd", bound)
        raise ValueError(f"zstd: {error_name(got).decode(errors='replace')}")
    return out[:got]


# -- codecs whose header states the decoded size ---------------------------------------------------


def lz4(data: Any, bound: int) -> Any:
    """numcodecs' LZ4: a little-endian 4-byte decoded size, then one LZ4 block."""
    if memoryview(data).nbytes < 4:
        raise ValueError("lz4 data shorter than its 4-byte size prefix")
    (size,) = struct.unpack_from("<I", data)
    if size > bound:
        raise TooLarge("lz4", bound, size)
    return numcodecs.lz4.decompress(data)


def blosc_frame_nbytes(buf: Any) -> int:
    """A blosc1 frame's decoded size; ``ValueError`` unless its header accounts for exactly the bytes stored."""
    stored = memoryview(buf).nbytes
    nbytes, _, cbytes = blosc_header(buf)
    if cbytes != stored:
        raise ValueError(f"blosc frame claims {cbytes} bytes but {stored} are stored")
    return nbytes


def blosc(codec: Codec, data: Any, bound: int) -> Any:
    """c-blosc trusts its header: the frame's sizes are checked before it allocates."""
    nbytes = blosc_frame_nbytes(data)
    if nbytes > bound:
        raise TooLarge("blosc", bound, nbytes)
    return codec.decode(data)


# -- streams: the standard library's decompressors with a maximum output ------------------------------


def _take(d: Any, data: Any, room: int, codec_id: str, bound: int) -> bytes:
    """One stream's output, at most ``room`` bytes; the decompressor must reach the stream's end."""
    out = d.decompress(data, room + 1)
    if len(out) > room:
        raise TooLarge(codec_id, bound)
    if not d.eof:
        raise ValueError(f"{codec_id}: compressed data ended before the end of its stream")
    return out


def zlib_(data: Any, bound: int) -> bytes:
    """numcodecs' Zlib (``zlib.decompress``): one zlib stream; bytes after it are ignored."""
    return _take(zlib.decompressobj(), data, bound, "zlib", bound)


def gzip(data: Any, bound: int) -> bytes:
    """numcodecs' GZip (``gzip.GzipFile``): gzip members one after the other, zero padding between or after."""
    parts = []
    room = bound
    while True:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip header and trailer (CRC, length) checked
        parts.append(_take(d, data, room, "gzip", bound))
        room -= len(parts[-1])
        data = d.unused_data.lstrip(b"\0")
        if not data:
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _streams(new: Callable[[], Any], codec_id: str, data: Any, bound: int) -> bytes:
    """bz2 / lzma as their one-shot ``decompress`` reads them: concatenated streams, junk after one ignored."""
    parts: list[bytes] = []
    room = bound
    while memoryview(data).nbytes:
        d = new()
        try:
            out = _take(d, data, room, codec_id, bound)
        except (OSError, lzma.LZMAError):  # bz2's OSError, lzma's LZMAError
            if parts:
                break  # leftover data that is not a stream, ignored as bz2/lzma.decompress do
            raise
        parts.append(out)
        room -= len(out)
        data = d.unused_data
    return parts[0] if len(parts) == 1 else b"".join(parts)
