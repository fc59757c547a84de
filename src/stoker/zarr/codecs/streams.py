"""gzip, zlib, bz2 and lzma, bounded: the standard library's streaming decompressors with a maximum output,
reading what numcodecs (the stdlib one-shot functions) reads: concatenated streams, trailing bytes."""

from __future__ import annotations

import lzma
import zlib as zlib_
from typing import Any, Callable

from .limit import TooLarge

def _take(d: Any, data: Any, room: int, codec_id: str, bound: int) -> bytes:
    """One stream's output, at most ``room`` bytes; the decompressor must reach the stream's end."""
    out = d.decompress(data, room + 1)
    if len(out) > room:
        raise TooLarge(codec_id, bound)
    if not d.eof:
        raise ValueError(f"{codec_id}: compressed data ended before the end of its stream")
    return out


def zlib(data: Any, bound: int) -> bytes:
    """numcodecs' Zlib (``zlib.decompress``): one zlib stream; bytes after it are ignored."""
    return _take(zlib_.decompressobj(), data, bound, "zlib", bound)


def gzip(data: Any, bound: int) -> bytes:
    """numcodecs' GZip (``gzip.GzipFile``): gzip members one after the other, zero padding between or after."""
    parts = []
    room = bound
    while True:
        d = zlib_.decompressobj(16 + zlib_.MAX_WBITS)  # gzip header and trailer (CRC, length) checked
        parts.append(_take(d, data, room, "gzip", bound))
        room -= len(parts[-1])
        data = d.unused_data.lstrip(b"\0")
        if not data:
            return parts[0] if len(parts) == 1 else b"".join(parts)


def concatenated(new: Callable[[], Any], codec_id: str, data: Any, bound: int) -> bytes:
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
