"""The optional compiled fast path (``stoker._native``) and the codec functions it calls.

``stoker._native`` is built from ``_native.c`` when stoker is installed and a C
compiler is present; without it (or with ``STOKER_NATIVE=0`` in the environment)
every chunk takes the pure-Python path, which reads and decodes the same bytes.
The extension calls zstd's own ``ZSTD_decompress``: the copy numcodecs carries in
its extension module, found here through ctypes, so no second zstd is built.

>>> from stoker import native
>>> native.zstd_files is None or callable(native.zstd_files)
True
"""

from __future__ import annotations

import ctypes
import os

# status codes of decode_zstd_files (see _native.c)
OK, MISSING, TOO_BIG, OS_ERROR, SHORT, CODEC_ERROR, SIZE = range(7)


def _load():
    if os.environ.get("STOKER_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from . import _native
        from numcodecs import zstd
    except ImportError:
        return None
    try:
        lib = ctypes.CDLL(zstd.__file__)
        decompress = ctypes.cast(lib.ZSTD_decompress, ctypes.c_void_p).value
        is_error = ctypes.cast(lib.ZSTD_isError, ctypes.c_void_p).value
    except (OSError, AttributeError):  # a numcodecs build that does not export zstd's symbols
        return None
    error_name = lib.ZSTD_getErrorName
    error_name.restype = ctypes.c_char_p
    error_name.argtypes = [ctypes.c_size_t]
    _native.set_zstd(decompress, is_error)
    global _error_name
    _error_name = error_name
    return _native.decode_zstd_files


_error_name = None


def zstd_error(code: int) -> str:
    """zstd's name for an error code that ``zstd_files`` reported (status CODEC_ERROR)."""
    if _error_name is None:
        return f"zstd error {code}"
    return _error_name((1 << 64) - code if code > 0 else 0).decode(errors="replace")


#: ``zstd_files(paths, scratch, outs, nbytes) -> [(status, nread, detail, read_ns, decode_ns)]``, or
#: ``None`` where the extension is not built (or ``STOKER_NATIVE=0``)
zstd_files = _load()
