"""Decode part of a blosc1 frame: only the blocks that hold a byte range of the chunk.

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
import struct
import sys
from typing import Any

import numpy as np

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


def table_size(header: Any) -> int:
    """Bytes of header plus block-offset table, from the first 16 bytes of a frame."""
    mv = memoryview(header).cast("B")
    if len(mv) < _HEADER.size:
        raise PartialDecodeError("short blosc header")
    _, _, flags, typesize, nbytes, blocksize, _ = _HEADER.unpack_from(mv)
    if flags & _MEMCPYED or not nbytes or not blocksize:
        return _HEADER.size
    return _HEADER.size + 4 * -(-nbytes // blocksize)


def stored_range(head: Any, byte_start: int, byte_stop: int) -> tuple[int, int]:
    """``(offset, stop)`` of the stored bytes that hold decoded bytes ``[byte_start, byte_stop)``.

    ``head`` is the frame's header and block table (:func:`table_size` bytes);
    reading just this range (plus ``head``) is enough for :func:`decode_range`.
    """
    mv = memoryview(head).cast("B")
    _, _, flags, typesize, nbytes, blocksize, cbytes = _HEADER.unpack_from(mv)
    if flags & _MEMCPYED:
        lo = byte_start // typesize * typesize
        return _HEADER.size + lo, min(cbytes, _HEADER.size + -(-byte_stop // typesize) * typesize)
    nblocks = -(-nbytes // blocksize)
    if len(mv) < _HEADER.size + 4 * nblocks:
        raise PartialDecodeError("blosc block table is incomplete")
    starts = mv[_HEADER.size:_HEADER.size + 4 * nblocks].cast("i")
    first, last = byte_start // blocksize, (byte_stop - 1) // blocksize
    stop = int(starts[last + 1]) if last + 1 < nblocks else cbytes
    lo = int(starts[first])
    if not _HEADER.size + 4 * nblocks <= lo <= stop <= cbytes:
        raise PartialDecodeError("blosc block table points outside the frame")
    return lo, stop


def decode_range(frame: Any, byte_start: int, byte_stop: int, dest: np.ndarray) -> bool:
    """Decode bytes ``[byte_start, byte_stop)`` of ``frame``'s payload into the same positions of ``dest``.

    ``dest`` is the whole chunk's buffer (C-contiguous, ``nbytes`` long); bytes
    outside the range (rounded out to whole blosc items) are left untouched.
    Returns False, doing nothing, for the rare frame whose size is not a whole
    number of items: the caller then decodes the frame in full.
    """
    typesize, nbytes, _, _ = frame_info(frame)
    if dest.nbytes != nbytes:
        raise PartialDecodeError(f"blosc frame holds {nbytes} bytes, the chunk needs {dest.nbytes}")
    if not 0 <= byte_start <= byte_stop <= nbytes:
        raise PartialDecodeError(f"byte range [{byte_start}, {byte_stop}) outside the frame")
    if nbytes % typesize:
        return False
    if byte_stop == byte_start:
        return True
    first = byte_start // typesize
    last = -(-byte_stop // typesize)
    src = np.frombuffer(frame, dtype=np.uint8)  # no copy, also for read-only memoryviews
    got = _getitem(src.ctypes.data, first, last - first, dest.ctypes.data + first * typesize)
    if got != (last - first) * typesize:
        raise PartialDecodeError(f"blosc_getitem returned {got}")
    return True
