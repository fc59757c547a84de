"""The optional compiled engine (``stoker._native``) and the codec functions it calls.

``stoker._native`` is built from ``csrc/*.c`` when stoker is installed and a C
compiler is present; without it (or with ``STOKER_NATIVE=0`` in the environment)
every chunk takes the pure-Python path, which reads and decodes the same bytes.
Its :data:`Engine` makes whole batches from flat plan tables on threads of its own
(see ``engine/decode_native.py``); ``decode_files`` reads a group of chunks on the
calling thread (the same readers and decoders; kept for tests and fuzzing).
The extension calls zstd's own ``ZSTD_decompress`` (or, where numcodecs exports them,
its context and buffer-less streaming functions, so a chunk whose copies need only
its first blocks is decoded only that far) and c-blosc's
``blosc_decompress_ctx`` / ``blosc_getitem``: the copies numcodecs carries in its
extension modules, found here through ctypes, so no second codec is built.

>>> from stoker import native
>>> native.Engine is None or callable(native.Engine)
True
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from ..runtime import gil

# chunk statuses of the compiled reader (see csrc/stoker_native.h)
(OK, MISSING, TOO_BIG, OS_ERROR, SHORT, CODEC_ERROR, SIZE, FRAME, NOT_REGULAR, CHANGED, CANCELLED, NO_MEMORY,
 PENDING) = range(13)
ZSTD, BLOSC, LZ4, ZLIB, GZIP = range(5)  # codecs of a stored chunk (decode_files: ZSTD and BLOSC)
FILL = -1  # an engine chunk with nothing stored: its copies take the fill value

# columns of the engine's plan tables (csrc/stoker_native.h: C_*, S_*, F_*)
(C_SOURCE, C_FILE, C_OFFSET, C_LENGTH, C_SPAN_START, C_SPAN_STOP, C_CODEC, C_NBYTES, C_MAX_STORED, C_FIRST_COPY,
 C_NCOPIES, C_BUFFER, N_CHUNK_COLS) = range(13)  # C_BUFFER: -1 (read from its file), or the buffer holding it
S_KIND, S_FILL, S_PATH_START, S_PATH_LEN, S_SEP, S_SWAP, S_STRIDES = range(7)  # then ndim chunk strides
F_SOURCE, F_HAS_IDENT, F_DEV, F_INO, F_SIZE, F_MTIME, F_CTIME, F_COORDS = range(8)  # then ndim grid coordinates

#: source kinds of a copy plan (native byte order), by numpy dtype
SOURCE_KINDS = {np.dtype(t): k for k, t in enumerate(
    ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float32", "float64"))}
SAME, F32, BF16 = 0, 1, 2  # batch kinds: the source's own dtype, float32, bfloat16
#: the longest chunk path the engine builds (csrc/pool.c PATH_CAP, NUL included): a source's prefix plus at
#: most 21 bytes per grid coordinate and separator must fit, or its chunks take the Python path
PATH_CAP = 4096


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
    """``(decode_files, Engine, zstd ready, blosc ready)``; the first two are None without the extension."""
    if _disabled():
        return None, None, False, False
    try:
        from .. import _native
    except ImportError:
        return None, None, False, False
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
    try:
        from numcodecs import lz4

        _, lz4_addrs = _symbols(lz4.__file__, "LZ4_decompress_safe")
    except ImportError:
        lz4_addrs = None
    global lz4_ready, zlib_ready
    _native.set_lz4(lz4_addrs[0] if lz4_addrs else 0)
    lz4_ready = bool(lz4_addrs)
    zlib_ready = _native.set_zlib(*(_zlib_functions() or (0, 0, 0, 0)))
    from ..zarr.codecs.blosc import PARTIAL_MAX_SHARE

    _native.set_codecs(*(zstd_addrs or (0, 0)), *(blosc_addrs or (0, 0)), PARTIAL_MAX_SHARE)
    global zstd_streaming
    zstd_streaming = bool(zstd_addrs and streaming_addrs)
    _native.set_zstd_streaming(*(streaming_addrs if zstd_streaming else (0,) * len(ZSTD_STREAMING)))
    if not zstd_addrs and not blosc_addrs:
        return None, None, False, False
    return _native.decode_files, _native.Engine, bool(zstd_addrs), bool(blosc_addrs)


_error_name = None

#: whether the engine decodes lz4 (numcodecs' framing), and zlib and gzip (zlib's inflate) chunks itself
lz4_ready = zlib_ready = False


def _zlib_functions():
    """Addresses of zlib's inflate functions in the library Python's zlib module uses, or None."""
    import ctypes.util
    import zlib

    names = ("inflateInit2_", "inflate", "inflateEnd", "inflateReset")
    for candidate in (ctypes.util.find_library("z"), getattr(zlib, "__file__", None)):
        if candidate:
            _, addrs = _symbols(candidate, *names)
            if addrs:
                return addrs
    return None


def zstd_error(code: int) -> str:
    """zstd's name for an error code that ``decode_files`` reported (status CODEC_ERROR)."""
    if _error_name is None:
        return f"zstd error {code}"
    return _error_name((1 << 64) - code if code > 0 else 0).decode(errors="replace")


def _released(fn):
    """``fn`` timed as a call that releases the GIL (:func:`stoker.runtime.gil.released`): the compiled reader
    reads, decodes and places with no GIL held, so its CPU time is not the pipeline's GIL time."""
    if fn is None:
        return None
    call = functools.partial(gil.released, fn)
    call.__doc__ = fn.__doc__
    return call


#: ``decode_files(codec, paths, regions, scratch, outs, nbytes, places, dst)
#: -> [(status, nread, decoded, read_ns, decode_ns, place_ns, placed)]`` and ``Engine(n_threads, budget_bytes)``,
#: or ``None`` where the extension is not built (or ``STOKER_NATIVE=0``); ``zstd`` / ``blosc``: which codecs
#: it can call
decode_files, Engine, zstd, blosc = _load()
decode_files = _released(decode_files)

#: ``plan_grid(starts, sids, shape, chunk_shapes, strides, itemsizes) -> (copies, chunks)`` (csrc/grid.c), or
#: None without the engine (engine/tables.py then plans with numpy)
plan_grid = None
#: ``plan_crops(boxes, sids, shape, rows) -> (copies, chunks, first_outside, bytes_needed, any_sharded)``
#: (csrc/tables.c: plan_grid from a batch's boxes and its arrays' rows, the boxes checked first), or None
plan_crops = None
#: ``shard_positions(index, chunks_per_shard, shard_strides) -> (inner, shard_of, first, numbers)`` and
#: ``gather_entries(tables, slot, shard_of, inner) -> bytes`` (csrc/grid.c: where a batch's chunks of a sharded
#: array are stored), or None without the engine (engine/tables.py then does both with numpy)
shard_positions = gather_entries = None
#: ``chunk_rows(info, <8 plan columns>, eids, fetched) -> bytes`` and ``copy_rows(src_offset, row, box_start,
#: extent, row_stride, dst_strides) -> bytes`` (csrc/tables.c): the engine's chunks and copies tables from a plan's
#: columns, or None without the engine
chunk_rows = copy_rows = None
#: ``local_file_system(path) -> bool``: whether the engine keeps a shard file there open between the inner
#: chunks a thread reads (a local file system; a network one is only checked against its server at open), or
#: None without the engine
local_file_system = None
if Engine is not None:
    from .._native import (chunk_rows, copy_rows, gather_entries, local_file_system,  # noqa: F401 (native.*)
                           plan_crops, plan_grid, shard_positions)
