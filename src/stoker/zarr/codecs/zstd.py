"""zstd, bounded: a frame's stated content size is checked first; a frame without one is decoded into a
buffer of the bound (zstd's ``ZSTD_decompress`` stops when it is full)."""

from __future__ import annotations

import ctypes
from typing import Any

import numcodecs
import numpy as np

from .limit import TooLarge, address

_CONTENTSIZE_UNKNOWN = 2**64 - 1
_CONTENTSIZE_ERROR = 2**64 - 2
_ERROR_DST_TOO_SMALL = 70  # ZSTD_error_dstSize_tooSmall, a stable value of zstd's error enum


def _load_zstd():
    """zstd's size and one-shot functions from numcodecs' extension (as ``stoker.engine.cpu.native`` finds them)."""
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


def decode(data: Any, bound: int) -> Any:
    """Decode zstd frames to at most ``bound`` bytes (``TooLarge`` otherwise; ``ValueError`` if corrupt)."""
    if _zstd is None:  # a numcodecs build without zstd's symbols: its own decode, unbounded
        return numcodecs.zstd.decompress(data)
    decompress, find_size, raw_decompress, is_error, error_code, error_name = _zstd
    src = np.frombuffer(data, dtype=np.uint8)
    at = address(src)
    size = find_size(at, src.nbytes)
    if size == _CONTENTSIZE_ERROR:
        raise ValueError("not a zstd frame")
    if size != _CONTENTSIZE_UNKNOWN:
        if size > bound:
            raise TooLarge("zstd", bound, size)
        return decompress(src)  # allocates the stated size, which fits
    # a frame that does not state its size (streamed compressors write these): decode into the bound
    out = np.empty(bound, dtype=np.uint8)
    got = raw_decompress(address(out), bound, at, src.nbytes)
    if is_error(got):
        if error_code(got) == _ERROR_DST_TOO_SMALL:
            raise TooLarge("zstd", bound)
        raise ValueError(f"zstd: {error_name(got).decode(errors='replace')}")
    return out[:got]
