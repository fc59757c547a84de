"""A Linux C library function called through ctypes, for the system calls Python does not wrap
(``madvise`` on a tensor's memory, ``sync_file_range``): None off Linux or where the library lacks it, so a
caller treats it as advice it may go without. Calls through it release the GIL (ctypes).

>>> madvise = linux_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
>>> madvise is None or madvise(address, nbytes, 14) == 0   # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any


def linux_function(name: str, argtypes: list, restype: Any = ctypes.c_int) -> Any:
    """The C library's function ``name`` with ``argtypes`` and ``restype`` (errno kept: ``ctypes.get_errno``),
    or None off Linux or where it is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


__all__ = ["linux_function"]
