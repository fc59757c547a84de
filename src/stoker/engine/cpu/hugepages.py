"""Transparent huge pages for large host buffers that are allocated once and rewritten every batch.

A CPU batch slot can be 128 MiB: with 4 KiB pages, filling it the first time costs 32,768 page faults, and
each later fill walks the TLB across as many pages. Linux backs memory with 2 MiB pages
where a program asks for them (``madvise(MADV_HUGEPAGE)``; the usual ``/sys/kernel/mm/transparent_hugepage
/enabled`` setting is ``madvise``, under which nothing else gets them). Asking is only advice: without
THP, off Linux, or if the call fails, nothing changes.

>>> slot = torch.empty(64 << 20, dtype=torch.uint8)
>>> advise_huge_pages(slot)   # before the first write: pages are chosen when first touched
True
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
#: Buffers smaller than this are left alone: at most one or two whole huge pages fit inside them.
MIN_BYTES = 8 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages behind the whole 2 MiB pages inside ``tensor``'s memory (a CPU tensor of at least
    :data:`MIN_BYTES`, not yet written); True when the kernel took the advice. The bytes before the first
    and after the last 2 MiB boundary keep ordinary pages, so memory use does not grow."""
    nbytes = tensor.numel() * tensor.element_size()
    if _MADVISE is None or tensor.device.type != "cpu" or nbytes < MIN_BYTES:
        return False
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    stop = (tensor.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    return stop > start and _MADVISE(start, stop - start, _MADV_HUGEPAGE) == 0
