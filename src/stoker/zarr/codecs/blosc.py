"""blosc1 frames: their header, a bounded decode, and a decode of only the blocks a byte range needs.

:func:`blosc_frame_nbytes` and :func:`decode_bounded` check a frame's sizes before c-blosc (which trusts
its header) allocates; :func:`blosc_compressors` is what this c-blosc can decode.

Partial decode: only the blocks that hold a byte range of the chunk.

A blosc frame is split into independently compressed blocks (typically 256 KiB
of a 1 MiB chunk). A crop that needs the first 8 of a chunk's 32 z-planes needs
only the first block, so decoding just that block does a quarter of the work.
c-blosc's ``blosc_getitem`` does exactly this; numcodecs bundles c-blosc and its
extension exports the symbol, which we call through ctypes (the GIL is released
during the call, and ``blosc_getitem`` keeps all its state on its own stack, so
threads can call it at once).

``blosc_getitem`` trusts the frame, so :func:`decode_range` validates the header
and the block-offset table against the stored size before calling it.

>>> decode_range(frame, byte_start=8192, byte_stop=16384, dest=scratch)  # fills scratch[8192:16384]
"""

from __future__ import annotations

import ctypes
import functools
import struct
import sys
from typing import Any

import numpy as np

from numcodecs.abc import Codec

from ...runtime import gil
from .limit import TooLarge

_HEADER = struct.Struct("<BBBBIII")
_MEMCPYED = 0x2


def _load_getitem():
    if sys.byteorder != "little":  # the frame's little-endian fields are read as native ints
        return None
    try:
        import numcodecs.blosc as nb

        lib = ctypes.CDLL(nb.__file__)
        fn = lib.blosc_getitem
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_getitem = _load_getitem()


def available() -> bool:
    """True when partial blosc decoding can be used in this environment."""
    return _getitem is not None


class PartialDecodeError(ValueError):
    """The frame is malformed (the caller turns this into a DecodeError with context)."""


def frame_info(frame: Any) -> tuple[int, int, int, int]:
    """``(typesize, nbytes, blocksize, cbytes)`` after checking the header and block table."""
    mv = memoryview(frame).cast("B")
    if len(mv) < _HEADER.size:
        raise PartialDecodeError(f"blosc frame of {len(mv)} bytes is shorter than its header")
    version, _, flags, typesize, nbytes, blocksize, cbytes = _HEADER.unpack_from(mv)
    if version == 0 or version > 4 or typesize == 0 or blocksize == 0:
        raise PartialDecodeError("not a blosc1 frame")
    if cbytes != len(mv):
        raise PartialDecodeError(f"blosc frame claims {cbytes} bytes but {len(mv)} are stored")
    if not flags & _MEMCPYED and nbytes:
        nblocks = -(-nbytes // blocksize)
        table_end = _HEADER.size + 4 * nblocks
        if table_end > cbytes:
            raise PartialDecodeError("blosc block table runs past the end of the frame")
        starts = mv[_HEADER.size:table_end].cast("i")  # little-endian hosts only (see _getitem)
        if min(starts) < table_end or max(starts) >= cbytes:
            raise PartialDecodeError("blosc block table points outside the frame")
    elif flags & _MEMCPYED and cbytes != nbytes + _HEADER.size:
        raise PartialDecodeError("memcpyed blosc frame has the wrong size")
    return typesize, nbytes, blocksize, cbytes


HEADER_SIZE = _HEADER.size


def blosc_header(buf: Any) -> tuple[int, int, int]:
    """``(nbytes, blocksize, cbytes)`` from a blosc1 frame header, unchecked (``ValueError`` when short)."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _HEADER.size:
        raise ValueError(f"blosc frame of {len(mv)} bytes is shorter than its 16-byte header")
    _, _, _, _, nbytes, blocksize, cbytes = _HEADER.unpack_from(mv)
    return nbytes, blocksize, cbytes


def _fields(mv: memoryview) -> tuple[int, int, int, int, int]:
    """``(flags, typesize, nbytes, blocksize, cbytes)``, rejecting values that would divide by zero."""
    if len(mv) < _HEADER.size:
        raise PartialDecodeError("short blosc header")
    version, _, flags, typesize, nbytes, blocksize, cbytes = _HEADER.unpack_from(mv)
    if version == 0 or version > 4 or typesize == 0 or blocksize == 0 or nbytes == 0:
        raise PartialDecodeError("not a blosc1 frame (zero version, typesize, blocksize or size)")
    return flags, typesize, nbytes, blocksize, cbytes


def table_size(header: Any) -> int:
    """Bytes of header plus block-offset table, from the first 16 bytes of a frame."""
    flags, _, nbytes, blocksize, _ = _fields(memoryview(header).cast("B"))
    if flags & _MEMCPYED:
        return _HEADER.size
    return _HEADER.size + 4 * -(-nbytes // blocksize)


# blosc_getitem decodes each block into scratch and copies it out: per block it costs 1.03x (zstd, 8
# blocks of 128 KiB) to 1.10x (lz4, 4 blocks of 256 KiB) what a whole single-threaded decode does
# (blosc_decompress_ctx with one thread, as the compiled reader and numcodecs off the main thread run it;
# 1 MiB uint16 chunks of the bench's scenarios 1 and 3). So skipping even one block of four pays, and a
# range is decoded whole only when it needs more than this share of the chunk.
PARTIAL_MAX_SHARE = 0.9


def decoded_span(nbytes: int, blocksize: int, byte_start: int, byte_stop: int) -> tuple[int, int]:
    """``(lo, hi)``: the decoded bytes a partial decode of ``[byte_start, byte_stop)`` produces (whole blocks)."""
    lo = byte_start // blocksize * blocksize
    return lo, min(-(-byte_stop // blocksize) * blocksize, nbytes)


def partial_pays(nbytes: int, blocksize: int, byte_start: int, byte_stop: int) -> bool:
    """True when decoding only the blocks around ``[byte_start, byte_stop)`` is cheaper than the whole chunk."""
    lo, hi = decoded_span(nbytes, blocksize, byte_start, byte_stop)
    return hi - lo <= PARTIAL_MAX_SHARE * nbytes


def partial_ok(header: Any, expected_nbytes: int, byte_start: int = 0, byte_stop: int = 0) -> bool:
    """True when the frame's header allows, and the range makes worthwhile, reading and decoding only some
    blocks of a chunk of that size (``byte_stop == 0``: any range).

    False for frames whose size is not a whole number of items (decoded in full),
    for frames of the wrong size (the full decode then reports the error) and for
    ranges that need most of the blocks (:data:`PARTIAL_MAX_SHARE`).
    """
    _, typesize, nbytes, blocksize, _ = _fields(memoryview(header).cast("B"))
    if nbytes != expected_nbytes or nbytes % typesize:
        return False
    return not byte_stop or partial_pays(nbytes, blocksize, byte_start, byte_stop)


def stored_range(head: Any, byte_start: int, byte_stop: int) -> tuple[int, int]:
    """``(offset, stop)`` of the stored bytes that hold decoded bytes ``[byte_start, byte_stop)``.

    ``head`` is the frame's header and block table (:func:`table_size` bytes);
    reading just this range (plus ``head``) is enough for :func:`decode_range`.
    Blocks need not be stored in order (c-blosc compressing on several threads
    writes them as they finish), so a block's stored extent runs from its start
    to the next larger start of any block, and the range covers the needed
    blocks' extents wherever they are.
    """
    mv = memoryview(head).cast("B")
    flags, typesize, nbytes, blocksize, cbytes = _fields(mv)
    if not 0 <= byte_start < byte_stop <= nbytes:
        raise PartialDecodeError(f"byte range [{byte_start}, {byte_stop}) outside the frame")
    if flags & _MEMCPYED:
        lo = byte_start // typesize * typesize
        return _HEADER.size + lo, min(cbytes, _HEADER.size + -(-byte_stop // typesize) * typesize)
    nblocks = -(-nbytes // blocksize)
    table_end = _HEADER.size + 4 * nblocks
    if len(mv) < table_end:
        raise PartialDecodeError("blosc block table is incomplete")
    starts = list(mv[_HEADER.size:table_end].cast("i"))
    if min(starts) < table_end or max(starts) >= cbytes or len(set(starts)) != nblocks:
        raise PartialDecodeError("blosc block table points outside the frame or repeats a block")
    ordered = sorted(starts)
    end_of = dict(zip(ordered, ordered[1:] + [cbytes]))
    needed = starts[byte_start // blocksize:(byte_stop - 1) // blocksize + 1]
    return min(needed), max(end_of[s] for s in needed)


def decode_range(frame: Any, byte_start: int, byte_stop: int, dest: np.ndarray,
                 read_end: int | None = None) -> int | None:
    """Decode bytes ``[byte_start, byte_stop)`` of ``frame``'s payload into the same positions of ``dest``,
    when decoding only their blocks is cheaper than decoding the chunk (:func:`partial_pays`).

    Returns the bytes blosc decompressed, or None, doing nothing, when the caller
    should decode the frame in full: the range needs most blocks, or the frame's
    size is not a whole number of items. See :func:`decode_blocks` for the rest.

    ``read_end``: only the header, the block table and the stored range of the needed blocks
    (:func:`stored_range`) were read into ``frame``, a writable buffer, up to this offset; the rest
    holds leftovers. c-blosc bounds what it reads by the frame's stated size, so that size is set to
    ``read_end`` for the decode: a block whose streams run past it (no frame c-blosc writes, but a
    crafted one) fails instead of decoding leftovers.
    """
    try:
        nbytes, blocksize, _ = blosc_header(frame)  # the cheap decision first: most full decodes stop here
    except ValueError as exc:
        raise PartialDecodeError(str(exc)) from None
    if not blocksize or not partial_pays(nbytes, blocksize, byte_start, byte_stop):
        return None
    info = frame_info(frame)
    if nbytes % info[0]:
        return None
    mv = memoryview(frame).cast("B")
    # A memcpy'd frame is copied item by item from exactly the bytes read (and c-blosc wants its true size).
    if read_end is None or read_end >= info[3] or mv[2] & _MEMCPYED:
        return _decode_blocks(frame, info, byte_start, byte_stop, dest)
    struct.pack_into("<I", mv, 12, read_end)  # the stated size: what was read
    try:
        return _decode_blocks(frame, info, byte_start, byte_stop, dest)
    finally:
        struct.pack_into("<I", mv, 12, info[3])


def decode_blocks(frame: Any, byte_start: int, byte_stop: int, dest: np.ndarray) -> int | None:
    """Decode the blocks holding bytes ``[byte_start, byte_stop)`` into the same positions of ``dest``.

    ``dest`` is the whole chunk's buffer (C-contiguous, ``nbytes`` long); bytes
    outside the range (rounded out to whole blosc items) are left untouched.
    Returns the bytes decompressed (whole blocks), or None, doing nothing, for
    the rare frame whose size is not a whole number of items.
    """
    return _decode_blocks(frame, frame_info(frame), byte_start, byte_stop, dest)


def _decode_blocks(frame: Any, info: tuple[int, int, int, int], byte_start: int, byte_stop: int,
                   dest: np.ndarray) -> int | None:
    typesize, nbytes, blocksize, _ = info
    if dest.nbytes != nbytes:
        raise PartialDecodeError(f"blosc frame holds {nbytes} bytes, the chunk needs {dest.nbytes}")
    if not 0 <= byte_start <= byte_stop <= nbytes:
        raise PartialDecodeError(f"byte range [{byte_start}, {byte_stop}) outside the frame")
    if nbytes % typesize:
        return None
    if byte_stop == byte_start:
        return 0
    first = byte_start // typesize
    last = -(-byte_stop // typesize)
    src = np.frombuffer(frame, dtype=np.uint8)  # no copy, also for read-only memoryviews
    got = gil.released(_getitem, src.ctypes.data, first, last - first, dest.ctypes.data + first * typesize)
    if got != (last - first) * typesize:
        raise PartialDecodeError(f"blosc_getitem returned {got}")
    lo, hi = decoded_span(nbytes, blocksize, byte_start, byte_stop)
    return hi - lo


@functools.cache
def blosc_compressors() -> tuple[str, ...]:
    """The compressors numcodecs' c-blosc was built with; a frame of any other cannot be decoded."""
    from numcodecs import blosc

    return tuple(blosc.list_compressors())


def blosc_frame_nbytes(buf: Any) -> int:
    """A blosc1 frame's decoded size; ``ValueError`` unless its header accounts for exactly the bytes stored."""
    stored = memoryview(buf).nbytes
    nbytes, _, cbytes = blosc_header(buf)
    if cbytes != stored:
        raise ValueError(f"blosc frame claims {cbytes} bytes but {stored} are stored")
    return nbytes


def decode_bounded(codec: Codec, data: Any, bound: int) -> Any:
    """c-blosc trusts its header: the frame's sizes are checked before it allocates."""
    nbytes = blosc_frame_nbytes(data)
    if nbytes > bound:
        raise TooLarge("blosc", bound, nbytes)
    return codec.decode(data)
