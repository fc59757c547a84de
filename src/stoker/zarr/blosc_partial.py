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
from typing import Any

import numpy as np

_HEADER = struct.Struct("<BBBBIII")
_MEMCPYED = 0x2


def _load_getitem():
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
        starts = np.frombuffer(mv[_HEADER.size:table_end], dtype="<i4")
        if starts.size and (starts.min() < table_end or starts.max() >= cbytes):
            raise PartialDecodeError("blosc block table points outside the frame")
    elif flags & _MEMCPYED and cbytes != nbytes + _HEADER.size:
        raise PartialDecodeError("memcpyed blosc frame has the wrong size")
    return typesize, nbytes, blocksize, cbytes


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
