"""zstd frames encoded exactly as numcodecs' ``Zstd`` encodes them, without its fresh memory per chunk.

numcodecs' ``Zstd.encode`` makes a compression context for every call (``ZSTD_createCCtx``: over a megabyte
of tables at the default level, cleared on first use) and a new output ``bytes`` of ``ZSTD_compressBound``
size, then frees both. On a TileWriter's write threads, whose heaps glibc gives back to the kernel as they
shrink, that is new memory for every chunk, faulted in and zeroed page by page: on a 128x256x256 float32
output about a third of the page faults of a whole inference, more than the tiling and blend cost.
:class:`ZstdFrames` calls the same library (the ``zstd`` extension numcodecs carries, through ctypes, as
the engine's decoder does: ``engine/cpu/native.py``) with the same calls (``ZSTD_compress2`` with the level
and the checksum flag), so the frames are the same bytes, but each thread keeps one context, and the frames go
into an output the caller reuses (a TileWriter's recycled buffers). ctypes releases the GIL for the call,
as numcodecs does; only for that one: the output bound is remembered per input size and an error code is
told from a length in Python, because each call that drops the GIL has to take it back, behind the
caller's thread and the other write threads, while the core waits.

>>> frames = ZstdFrames(level=0, checksum=False)
>>> out = np.empty(frames.bound(chunk.nbytes), dtype=np.uint8)
>>> n = frames.encode(chunk, out)
>>> out[:n].tobytes() == numcodecs.Zstd(level=0).encode(chunk)
True
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

_LEVEL, _CHECKSUM = 100, 201  # ZSTD_c_compressionLevel, ZSTD_c_checksumFlag (zstd.h, stable since 1.4)


def _library() -> Any:
    """numcodecs' zstd extension opened through ctypes with the compression API declared, or None."""
    try:
        from numcodecs import zstd

        lib = ctypes.CDLL(zstd.__file__)
        sigs = {"ZSTD_createCCtx": ([], ctypes.c_void_p), "ZSTD_freeCCtx": ([ctypes.c_void_p], ctypes.c_size_t),
                "ZSTD_CCtx_setParameter": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int], ctypes.c_size_t),
                "ZSTD_compress2": ([ctypes.c_void_p] * 2 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t],
                                   ctypes.c_size_t),
                "ZSTD_compressBound": ([ctypes.c_size_t], ctypes.c_size_t),
                "ZSTD_isError": ([ctypes.c_size_t], ctypes.c_uint),
                "ZSTD_getErrorName": ([ctypes.c_size_t], ctypes.c_char_p)}
        for name, (args, res) in sigs.items():
            fn = getattr(lib, name)  # AttributeError: a build without the symbol
            fn.argtypes, fn.restype = args, res
        return lib
    except (ImportError, OSError, AttributeError):
        return None


_LIB = _library()

# an error code of zstd is (size_t)-code, code < ZSTD_error_maxCode (< 2**16 in every version): any result
# below this is a length, and only a result at or above it is asked of ZSTD_isError
_ERRORS_FROM = (1 << 64) - (1 << 16)


class _Context:
    """One thread's compression context, freed with the thread's locals."""

    def __init__(self, lib: Any, level: int, checksum: bool) -> None:
        self.lib, self.ptr = lib, lib.ZSTD_createCCtx()
        if not self.ptr:
            raise MemoryError("ZSTD_createCCtx returned NULL")
        # kept by the context across ZSTD_compress2 calls (each resets only the session), as numcodecs sets them
        for param, value in ((_LEVEL, level), (_CHECKSUM, int(checksum))):
            _check(lib.ZSTD_CCtx_setParameter(self.ptr, param, value))

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.ZSTD_freeCCtx(self.ptr)
            self.ptr = None


class ZstdFrames:
    """Encodes C-contiguous arrays into zstd frames at ``level`` with or without a checksum (see the module
    docstring). :func:`available` says whether the library was found."""

    def __init__(self, level: int, checksum: bool) -> None:
        if _LIB is None:
            raise RuntimeError("numcodecs' zstd library was not found: use numcodecs.Zstd")
        self.level, self.checksum = int(level), bool(checksum)
        self._local = threading.local()
        self._bounds: dict[int, int] = {}  # input bytes -> ZSTD_compressBound (the same few chunk sizes)

    def bound(self, nbytes: int) -> int:
        """The most bytes a frame of ``nbytes`` of input takes."""
        found = self._bounds.get(nbytes)
        if found is None:
            found = self._bounds[nbytes] = int(_LIB.ZSTD_compressBound(int(nbytes)))
        return found

    def encode(self, chunk: np.ndarray, out: np.ndarray) -> int:
        """Write the frame of ``chunk`` (C-contiguous) to the start of ``out`` (uint8, C-contiguous, at least
        :meth:`bound` bytes); return its length."""
        if not (chunk.flags.c_contiguous and out.flags.c_contiguous and out.dtype == np.uint8):
            raise ValueError("ZstdFrames.encode takes a C-contiguous chunk and a C-contiguous uint8 output")
        if out.size < self.bound(chunk.nbytes):
            raise ValueError(f"ZstdFrames.encode: {out.size} bytes of output, {self.bound(chunk.nbytes)} needed")
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = _Context(_LIB, self.level, self.checksum)
        return _check(_LIB.ZSTD_compress2(ctx.ptr, out.ctypes.data, out.size, chunk.ctypes.data, chunk.nbytes))


def _check(code: int) -> int:
    if code >= _ERRORS_FROM and _LIB.ZSTD_isError(code):
        raise RuntimeError(f"Zstd compression error: {_LIB.ZSTD_getErrorName(code).decode()}")
    return int(code)


def available() -> bool:
    """Whether numcodecs' zstd library was found (else numcodecs' own ``Zstd.encode`` is used)."""
    return _LIB is not None


__all__ = ["ZstdFrames", "available"]
