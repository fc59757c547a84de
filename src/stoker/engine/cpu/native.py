"""The optional compiled engine (``stoker._native``) and the codec functions it calls.

``stoker._native`` is built from ``csrc/*.c`` when stoker is installed and a C
compiler is present; without it (or with ``STOKER_NATIVE=0`` in the environment)
every chunk takes the pure-Python path, which reads and decodes the same bytes.
Its :data:`Engine` makes whole batches from flat plan tables on threads of its own
(see ``engine/cpu/decode_native.py``). Its statuses, codecs and table columns are the
constants of ``csrc/stoker_native.h``, by their C names (``ST_OK``, ``CODEC_ZSTD``,
``C_SOURCE``...): :mod:`stoker.engine.cpu.interface` is written from that header, and
this module re-exports it and checks the extension was compiled with the same values.
The extension calls zstd's own ``ZSTD_decompress`` (or, where numcodecs exports them,
its context and buffer-less streaming functions, so a chunk whose copies need only
its first blocks is decoded only that far) and c-blosc's
``blosc_decompress_ctx`` / ``blosc_getitem``: the copies numcodecs carries in its
extension modules, found here through ctypes, so no second codec is built.

>>> from stoker import native
>>> native.Engine is None or callable(native.Engine)
True
>>> native.ST_OK, native.CODEC_ZSTD
(0, 0)
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings

import numpy as np

from . import interface
from .interface import *  # noqa: F403 - the header's constants, by their C names (native.ST_OK, native.C_FILE...)


#: source kinds of a copy-cast (csrc/stoker_native.h: K_U8...K_F64), by numpy dtype of native byte order
SOURCE_KINDS = {np.dtype({"U": "uint", "I": "int", "F": "float"}[name[2]] + name[3:]): value
                for name, value in interface.CONSTANTS.items() if name.startswith("K_")}


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


@functools.lru_cache(maxsize=None)
def _codec_functions() -> dict:
    """The addresses of the codecs' functions in numcodecs' extension modules and zlib's library, found once:
    ``zstd`` and ``blosc`` (a pair each), ``streaming`` (:data:`ZSTD_STREAMING`), ``lz4`` and ``zlib``, each
    None where it is not exported."""
    found: dict = {"zstd": None, "streaming": None, "blosc": None, "lz4": None, "zlib": _zlib_functions()}
    try:
        from numcodecs import zstd

        lib, found["zstd"] = _symbols(zstd.__file__, "ZSTD_decompress", "ZSTD_isError")
        if found["zstd"]:
            global _error_name
            _error_name = lib.ZSTD_getErrorName
            _error_name.restype = ctypes.c_char_p
            _error_name.argtypes = [ctypes.c_size_t]
            _, found["streaming"] = _symbols(zstd.__file__, *ZSTD_STREAMING)
    except ImportError:
        pass
    try:
        from numcodecs import blosc

        _, found["blosc"] = _symbols(blosc.__file__, "blosc_decompress_ctx", "blosc_getitem")
    except ImportError:
        pass
    try:
        from numcodecs import lz4

        _, lz4_addrs = _symbols(lz4.__file__, "LZ4_decompress_safe")
        found["lz4"] = lz4_addrs[0] if lz4_addrs else None
    except ImportError:
        pass
    return found


def configure(module) -> dict | None:
    """Hand a compiled module of ``csrc`` (``stoker._native``; the tests' ``stoker._testing``, which holds
    codec state of its own) the codecs' functions; returns which it decodes now (``zstd``, ``blosc``, ``lz4``,
    ``zlib``, and ``streaming``: zstd's early stop). None, with a warning, when the module was compiled from
    another ``stoker_native.h`` than :mod:`.interface` was written from (a stale build, whose statuses and
    columns would be misread): it is then not to be used.

    >>> configure(stoker_testing)["zstd"]  # tests/native_testing.py sets up stoker._testing so
    True
    """
    built = getattr(module, "interface", None)
    if _stale(module):
        differ = sorted(k for k in set(built or {}) | set(interface.CONSTANTS)
                        if (built or {}).get(k) != interface.CONSTANTS.get(k))
        warnings.warn(f"{module.__file__} was compiled from another csrc/stoker_native.h than this stoker's "
                      f"(differing: {', '.join(differ[:8])}{'...' if len(differ) > 8 else ''}): rebuild it "
                      "(python setup.py build_ext --inplace, or reinstall); until then every chunk takes the "
                      "Python path", RuntimeWarning, stacklevel=2)
        return None
    found = _codec_functions()
    module.set_lz4(found["lz4"] or 0)
    zlib = module.set_zlib(*(found["zlib"] or (0, 0, 0, 0)))
    from ...zarr.codecs.blosc import PARTIAL_MAX_SHARE

    module.set_codecs(*(found["zstd"] or (0, 0)), *(found["blosc"] or (0, 0)), PARTIAL_MAX_SHARE)
    streaming = bool(found["zstd"] and found["streaming"])
    module.set_zstd_streaming(*(found["streaming"] if streaming else (0,) * len(ZSTD_STREAMING)))
    return {"zstd": bool(found["zstd"]), "blosc": bool(found["blosc"]), "lz4": bool(found["lz4"]),
            "zlib": bool(zlib), "streaming": streaming}


def why_off() -> tuple[str, str] | None:
    """Why the compiled reader is off, and what turns it on (``stoker doctor`` says both); None when it is
    on. The switch (any spelling :func:`_disabled` honours), no build, a build from another
    ``stoker_native.h`` (warned at import), or a numcodecs without the codec functions it calls."""
    if Engine is not None:
        return None
    module, why = _extension()
    if why is not None:
        return why
    if _stale(module):
        return ("built from another csrc/stoker_native.h than this stoker's (a stale build)",
                "rebuild it: python setup.py build_ext --inplace, or reinstall")
    return "numcodecs exports neither zstd's nor blosc's functions", "install numcodecs from its wheels"


def _extension():
    """``(stoker._native, None)``, or ``(None, (why it is off, what turns it on))`` where it is switched off
    or not built: the first steps of :func:`_load`, which :func:`why_off` retraces."""
    if _disabled():
        return None, (f"STOKER_NATIVE={os.environ.get('STOKER_NATIVE')}", "unset STOKER_NATIVE to turn it on")
    try:
        from ... import _native
    except ImportError:
        return None, ("not built (no C compiler at install?)", "reinstall with a C compiler")
    return _native, None


def _stale(module) -> bool:
    """Whether ``module`` was compiled from another ``stoker_native.h`` than :mod:`.interface` was written from."""
    return getattr(module, "interface", None) != interface.CONSTANTS


def _load():
    """``(Engine, zstd ready, blosc ready)``; Engine is None without the extension (or with neither codec)."""
    _native, _ = _extension()
    if _native is None:
        return None, False, False
    ready = configure(_native)
    if ready is None:
        return None, False, False
    global lz4_ready, zlib_ready, zstd_streaming
    lz4_ready, zlib_ready, zstd_streaming = ready["lz4"], ready["zlib"], ready["streaming"]
    if not ready["zstd"] and not ready["blosc"]:
        return None, False, False
    return _native.Engine, ready["zstd"], ready["blosc"]


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
    """zstd's name for an error code the engine reported (status ST_CODEC_ERROR)."""
    if _error_name is None:
        return f"zstd error {code}"
    return _error_name((1 << 64) - code if code > 0 else 0).decode(errors="replace")


#: ``Engine(n_threads, budget_bytes)``, or ``None`` where the extension is not built (or ``STOKER_NATIVE=0``);
#: ``zstd`` / ``blosc``: which codecs it can call
Engine, zstd, blosc = _load()

#: ``plan_grid(starts, sids, shape, chunk_shapes, strides, itemsizes) -> (copies, chunks)`` (csrc/grid.c), or
#: None without the engine (engine/planning/tables.py then plans with numpy)
plan_grid = None
#: ``plan_crops(boxes, sids, shape, rows) -> (copies, chunks, first_outside, bytes_needed, any_sharded)``
#: (csrc/tables.c: plan_grid from a batch's boxes and its arrays' rows, the boxes checked first), or None
plan_crops = None
#: ``shard_positions(index, chunks_per_shard, shard_strides) -> (inner, shard_of, first, numbers)`` and
#: ``gather_entries(tables, slot, shard_of, inner) -> bytes`` (csrc/grid.c: where a batch's chunks of a sharded
#: array are stored), or None without the engine (engine/planning/tables.py then does both with numpy)
shard_positions = gather_entries = None
#: ``chunk_rows(info, <8 plan columns>, eids, fetched) -> bytes`` and ``copy_rows(src_offset, row, box_start,
#: extent, row_stride, dst_strides) -> bytes`` (csrc/tables.c): the engine's chunks and copies tables from a plan's
#: columns, or None without the engine
chunk_rows = copy_rows = None
#: ``local_file_system(path) -> bool``: whether the engine keeps a shard file there open between the inner
#: chunks a thread reads (a local file system; a network one is only checked against its server at open), or
#: None without the engine
local_file_system = None
#: ``read_files(paths, max_bytes[, idents]) -> [memoryview | False | None]`` (csrc/py_engine.c): whole files in one
#: call, the GIL released twice per 64 files rather than per system call; with idents each judged as that ident's
#: disk-cache entry (its payload, or False), only a sound one touched (the disk cache's hits; see
#: storage/diskcache.py), or None without the engine
read_files = None
#: ``crc32c(data, value=0) -> int`` (csrc/entries.c): the checksum with which the engine checks disk-cache entries
#: it reads itself (the crc32c package's), or None without the engine
crc32c = None
if Engine is not None:
    from ..._native import (chunk_rows, copy_rows, crc32c, gather_entries,  # noqa: F401 (native.*)
                           local_file_system, plan_crops, plan_grid, read_files, shard_positions)
#: ``stage_read(buf, paths, files, reads, out, whole_base, threads) -> (opens, reads)`` and
#: ``blosc_streams(buf, chunks, fault) -> (streams, blocks)`` and ``chunk_paths(blob, prefixes, names, ndim) ->
#: bytes`` (csrc/staging.c): the GPU decode's reads of a wave into its staging on the threads of a
#: ``stage_pool(threads)`` (persistent: ``stage_pool_close``, ``stage_pool_info``, ``stage_threads_started``) or
#: threads of their own, the GIL released once, stopped between reads by a ``stage_cancel_flag()`` once
#: ``stage_cancel`` sets it, its blosc1 frames parsed and its files' paths built as the engine builds them
#: (engine/gpu/native_reads.py wraps them), or None without the engine
stage_read = blosc_streams = chunk_paths = stage_pool = stage_pool_close = stage_pool_info = None
stage_threads_started = stage_cancel_flag = stage_cancel = None
if Engine is not None:
    from ..._native import (blosc_streams, chunk_paths, stage_cancel, stage_cancel_flag,  # noqa: F401 (native.*)
                           stage_pool, stage_pool_close, stage_pool_info, stage_read, stage_threads_started)
#: ``entry_hits(hash, rec, entries, files, chunk_file, chunk_offset, chunk_length, ids, disk, store_of, stamps,
#: settled, now) -> (rows, blob) | None`` (csrc/py_entries.c): a batch's chunks found in a decoder's table of
#: disk-cache entries and made the engine's entries rows in one call (engine/cpu/entry_table.py, ``EntryTable.hits``),
#: or None without the engine
entry_hits = None
if Engine is not None:
    from ..._native import entry_hits  # noqa: F401, F811 (native.*)
#: ``write_entries(items, tag, seed) -> (results, allocated, grown)`` (csrc/entries.c): the disk cache's entry
#: files made with the GIL released once per batch (storage/diskcache.py's writer thread uses it once this module
#: is loaded: ``use_entry_writer``), or None without the engine
write_entries = None
if Engine is not None:
    from ..._native import write_entries  # noqa: F811 (native.*)
    from ...storage.diskcache import use_entry_writer

    use_entry_writer(write_entries)
#: ``evict_entries(root, bound, target, incoming, block) -> (total, evicted, temp)`` (csrc/evict.c):
#: the disk cache's eviction scan with the GIL released once (storage/diskcache.py uses it once this module is
#: loaded: ``use_entry_evictor``), or None without the engine
evict_entries = None
if Engine is not None:
    from ..._native import evict_entries  # noqa: F811 (native.*)
    from ...storage.diskcache import use_entry_evictor

    use_entry_evictor(evict_entries)
#: ``blend_mean(out, parts)`` (csrc/blend.c): a TileWriter's weighted mean where predictions overlap, one pass over
#: the voxels with the GIL released (stoker/inference/weighted.py wraps it), or None without the engine
blend_mean = None
if Engine is not None:
    from ..._native import blend_mean  # noqa: F401, F811 (native.*)
