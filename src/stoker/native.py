"""The optional compiled fast path (``stoker._native``) and the codec functions it calls.

``stoker._native`` is built from ``_native.c`` when stoker is installed and a C
compiler is present; without it (or with ``STOKER_NATIVE=0`` in the environment)
every chunk takes the pure-Python path, which reads and decodes the same bytes.
The extension calls zstd's own ``ZSTD_decompress`` (or, where numcodecs exports them,
its context and buffer-less streaming functions, so a chunk whose copies need only
its first blocks is decoded only that far) and c-blosc's
``blosc_decompress_ctx`` / ``blosc_getitem``: the copies numcodecs carries in its
extension modules, found here through ctypes, so no second codec is built.

>>> from stoker import native
>>> native.decode_files is None or callable(native.decode_files)
True
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from . import gil

# status codes of decode_files (see _native.c)
OK, MISSING, TOO_BIG, OS_ERROR, SHORT, CODEC_ERROR, SIZE, FRAME, NOT_REGULAR, CHANGED = range(10)
ZSTD, BLOSC = 0, 1  # codecs of decode_files

#: source kinds of a copy plan (native byte order), by numpy dtype
SOURCE_KINDS = {np.dtype(t): k for k, t in enumerate(
    ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float32", "float64"))}
SAME, F32, BF16 = 0, 1, 2  # batch kinds: the source's own dtype, float32, bfloat16


#: zstd functions behind the context reuse and the early stop, in ``set_zstd_streaming``'s order (the
#: buffer-less streaming API: exported by zstd's shared builds, stable since zstd 1.0)
ZSTD_STREAMING = ("ZSTD_createDCtx", "ZSTD_freeDCtx", "ZSTD_decompressDCtx", "ZSTD_decompressBegin",
                  "ZSTD_decompressContinue", "ZSTD_nextSrcSizeToDecompress", "ZSTD_getFrameContentSize")

#: True when the compiled reader reuses one zstd context per call and stops reading and decoding a zstd
#: chunk after the blocks its copies read (frames that state their size and carry no checksum)
zstd_streaming = False


def _disabled() -> bool:
    return os.environ.get("STOKER_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _symbols(module_file: str, *names: str):
    """Addresses of ``names`` in a numcodecs extension module, or None when one is not exported."""
    try:
        lib = ctypes.CDLL(module_file)
        return lib, [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names]
    except (OSError, AttributeError):  # a numcodecs build that does not export the codec's symbols
        return None, None


def _load():
    """``(decode_files, zstd ready, blosc ready)``; ``decode_files`` is None without the extension."""
    if _disabled():
        return None, False, False
    try:
        from . import _native
    except ImportError:
        return None, False, False
    zstd_addrs = blosc_addrs = streaming_addrs = None
    try:
        from numcodecs import zstd

        lib, zstd_addrs = _symbols(zstd.__file__, "ZSTD_decompress", "ZSTD_isError")
        if zstd_addrs:
            global _error_name
            _error_name = lib.ZSTD_getErrorName
            _error_name.restype = ctypes.c_char_p
            _error_name.argtypes = [ctypes.c_size_t]
            _, streaming_addrs = _symbols(zstd.__file__, *ZSTD_STREAMING)
    except ImportError:
        pass
    try:
        from numcodecs import blosc

        _, blosc_addrs = _symbols(blosc.__file__, "blosc_decompress_ctx", "blosc_getitem")
    except ImportError:
        pass
    from .zarr.blosc_partial import PARTIAL_MAX_SHARE

    _native.set_codecs(*(zstd_addrs or (0, 0)), *(blosc_addrs or (0, 0)), PARTIAL_MAX_SHARE)
    global zstd_streaming
    zstd_streaming = bool(zstd_addrs and streaming_addrs)
    _native.set_zstd_streaming(*(streaming_addrs if zstd_streaming else (0,) * len(ZSTD_STREAMING)))
    if not zstd_addrs and not blosc_addrs:
        return None, False, False
    return _native.decode_files, bool(zstd_addrs), bool(blosc_addrs)


_error_name = None


def zstd_error(code: int) -> str:
    """zstd's name for an error code that ``decode_files`` reported (status CODEC_ERROR)."""
    if _error_name is None:
        return f"zstd error {code}"
    return _error_name((1 << 64) - code if code > 0 else 0).decode(errors="replace")


def _released(fn):
    """``fn`` timed as a call that releases the GIL (:func:`stoker.gil.released`): the compiled reader
    reads, decodes and places with no GIL held, so its CPU time is not the pipeline's GIL time."""
    if fn is None:
        return None
    call = functools.partial(gil.released, fn)
    call.__doc__ = fn.__doc__
    return call


#: ``decode_files(codec, paths, regions, scratch, outs, nbytes, places, dst)
#: -> [(status, nread, decoded, read_ns, decode_ns, place_ns, placed)]``, or ``None`` where the
#: extension is not built (or ``STOKER_NATIVE=0``); ``zstd`` / ``blosc``: which codecs it can call
decode_files, zstd, blosc = _load()
decode_files = _released(decode_files)
