"""numcodecs' LZ4, bounded: the decoded size in its 4-byte prefix is checked before numcodecs allocates."""

from __future__ import annotations

import struct
from typing import Any

import numcodecs

from .limit import TooLarge

def decode(data: Any, bound: int) -> Any:
    """numcodecs' LZ4: a little-endian 4-byte decoded size, then one LZ4 block."""
    if memoryview(data).nbytes < 4:
        raise ValueError("lz4 data shorter than its 4-byte size prefix")
    (size,) = struct.unpack_from("<I", data)
    if size > bound:
        raise TooLarge("lz4", bound, size)
    return numcodecs.lz4.decompress(data)
