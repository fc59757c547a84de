"""Buffers asked of the system, with its refusal typed: :class:`~stoker.errors.OutOfMemory` naming the budget.

``host_buffer_bytes`` and ``device_buffer_bytes`` are caps stoker stays under, not memory set aside: a
machine whose memory is taken by others (other ranks, the model, the page cache of a ``tmpfs``) can refuse
a buffer that fits its budget. torch says so with a ``RuntimeError`` (``DefaultCPUAllocator: can't allocate
memory``, ``CUDA out of memory``), numpy with a ``MemoryError``; both become ``OutOfMemory`` (a
``MemoryError``) naming the knob, the bytes asked and what they were for.

>>> slot = allocate((4, 32, 32), torch.float32, what="batch slot 0 of 3")
>>> allocate((1 << 50,), torch.uint8, what="a slot")   # doctest: +SKIP
OutOfMemory: the system refused 1,125,899,906,842,624 B of host memory for a slot ...

Transparent huge pages for large host buffers that are allocated once and rewritten every batch: a CPU
batch slot can be 128 MiB, and with 4 KiB pages filling it the first time costs 32,768 page faults, and
each later fill walks the TLB across as many pages. Linux backs memory with 2 MiB pages where a program
asks for them (``madvise(MADV_HUGEPAGE)``; the usual ``/sys/kernel/mm/transparent_hugepage/enabled``
setting is ``madvise``, under which nothing else gets them). Asking is only advice: without THP, off Linux,
or if the call fails, nothing changes.

>>> slot = torch.empty(64 << 20, dtype=torch.uint8)
>>> advise_huge_pages(slot)   # before the first write: pages are chosen when first touched  # doctest: +SKIP
True
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from ..errors import OutOfMemory
from ..runtime.libc import linux_function

# What torch's allocators say when the memory is not there (CPU, pinned and CUDA); anything else is a bug
# to report as it is.
_OOM_WORDS = ("can't allocate memory", "out of memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's refusal (not another error of the same type)."""
    if isinstance(exc, MemoryError) or isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _OOM_WORDS)


def refused(nbytes: int, where: str, knob: str, what: str, exc: BaseException) -> OutOfMemory:
    """The typed error for ``nbytes`` of ``where`` memory (host, pinned host, cuda:0...) refused for ``what``."""
    err = OutOfMemory(
        f"the system refused {nbytes:,} B of {where} memory for {what} ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else ''}). Config.{knob} is a cap stoker stays under, not memory "
        f"set aside: free memory (other processes, ranks, the model), or lower {knob}, batch_size, "
        "lookahead_batches or the sample shape", knob=knob, nbytes=nbytes)
    err.__cause__ = exc
    return err


def allocate(shape: tuple[int, ...] | int, dtype: torch.dtype, device: torch.device | str = "cpu",
             pin: bool = False, what: str = "a buffer") -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)``; OutOfMemory naming
    ``host_buffer_bytes`` (host and pinned memory) or ``device_buffer_bytes`` (a GPU's) when refused."""
    try:
        return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        dims = (shape,) if isinstance(shape, int) else shape
        nbytes = math.prod(dims) * dtype.itemsize
        on_host = torch.device(device).type == "cpu"
        where = ("pinned host" if pin else "host") if on_host else str(device)
        raise refused(nbytes, where, "host_buffer_bytes" if on_host else "device_buffer_bytes", what, exc) \
            from exc


def host_bytes(nbytes: int, what: str = "a read or decode buffer", zeroed: bool = False) -> np.ndarray:
    """``np.empty(nbytes, np.uint8)`` (``np.zeros`` when ``zeroed``); OutOfMemory naming ``host_buffer_bytes``
    when refused."""
    try:
        return (np.zeros if zeroed else np.empty)(nbytes, dtype=np.uint8)
    except MemoryError as exc:
        raise refused(nbytes, "host", "host_buffer_bytes", what, exc) from exc


HUGE_PAGE = 2 << 20
#: Buffers smaller than this are left alone: at most one or two whole huge pages fit inside them.
MIN_BYTES = 8 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


_MADVISE = linux_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


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
