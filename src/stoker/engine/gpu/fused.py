"""A prototype: placing decoded chunks with one Triton kernel per element dtype, where :mod:`.place` expands
every element's indices with torch operations and then gathers, casts and scatters them
(``repeat_interleave``, per-axis ``%`` and ``//``, ``index_select``, ``.to``, ``index_copy_``: about a dozen
passes over index tensors eight bytes an element, in pieces that fit the scratch).

Here each copy of a chunk is one row of a small table (its element count, first element in the scratch and
in the batch, extent and scratch strides per axis); a program of the kernel takes ``BLOCK`` elements of one
copy, works out their offsets in registers, loads them, casts and stores: the scratch is read once and the
batch written once, with no index tensor. Same signature and results as :func:`.place.place`, so it can
be put in its place; not wired into the executor yet (it needs ``triton``, which CUDA builds of torch ship).
``TRITON_INTERPRET=1`` runs the kernel on CPU tensors, as the tests do.

>>> place(plan, sources, dest, scratch, cids, outs, elements_of)  # as stoker.engine.gpu.place.place
"""

from __future__ import annotations

import numpy as np
import torch

from .ops import upload
from .place import copies
from .sources import Source, carrier
from ..planning.tables import TablePlan

BLOCK = 1024  # elements per program: a few per thread of a warp group, enough to hide the loads' latency


try:  # module level: Triton's interpreter patches the kernel's globals (tl), not a closure's names
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except ImportError:
    triton = None


def available() -> bool:
    """True when ``triton`` imports (CUDA builds of torch ship it; CPU ones do not). ``TRITON_INTERPRET``
    is read when this module is first imported."""
    return triton is not None


if triton is not None:
    @triton.jit
    def _gather_cast_scatter(scratch, batch, table, batch_strides, NDIM: tl.constexpr, BLOCK: tl.constexpr,
                             TO_BF16: tl.constexpr):
        # table row: count, first element in the scratch, in the batch, extent[NDIM], scratch strides[NDIM]
        row = table + tl.program_id(0).to(tl.int64) * (3 + 2 * NDIM)
        k = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = k < tl.load(row)
        src = k * 0 + tl.load(row + 1)  # (tl.zeros is a jit function, which the interpreter refuses here)
        dst = k * 0 + tl.load(row + 2)
        rest = k
        for i in tl.static_range(NDIM):  # the element's index along each axis, innermost first
            axis = NDIM - 1 - i
            size = tl.load(row + 3 + axis)
            at = rest % size
            rest = rest // size
            src += at * tl.load(row + 3 + NDIM + axis)
            dst += at * tl.load(batch_strides + axis)
        values = tl.load(scratch + src, mask=inside)
        if TO_BF16:
            # The CPU path's rule, bfloat16 through float32, rounded to nearest even in integers: Triton's
            # interpreter truncates in .to(tl.bfloat16) whatever the rounding asked. The sources cast on the
            # device are integers of at most 2 bytes (sources.device_casts): never NaN or infinite.
            bits = values.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(batch + dst, bits.to(tl.uint16), mask=inside)
        else:
            tl.store(batch + dst, values.to(batch.dtype.element_ty), mask=inside)


def place(plan: TablePlan, sources: list[Source], dest: torch.Tensor, scratch: torch.Tensor, cids: np.ndarray,
          outs: np.ndarray, elements_of: list[torch.dtype]) -> None:
    """Gather the copies of chunks ``cids`` (decoded at byte ``outs`` of ``scratch``, as ``elements_of``), cast,
    and scatter them into ``dest``: one kernel launch per element dtype, whatever the number of copies."""
    if triton is None:
        raise ImportError("stoker.engine.gpu.fused needs triton (CUDA builds of torch ship it): use "
                          "stoker.engine.gpu.place.place without it")
    flat = dest.view(-1)
    for element in set(elements_of):
        mine = np.array([e == element for e in elements_of])
        src, dst, extent, strides = copies(plan, sources, dest, cids[mine], outs[mine] // element.itemsize)
        if not len(src):
            continue
        counts = extent.prod(axis=1)
        table = np.concatenate([counts[:, None], src[:, None], dst[:, None], extent, strides], axis=1)
        on_device = upload(table.astype(np.int64, copy=False), dest.device)
        batch_strides = upload(np.array(dest.stride()[1:], np.int64), dest.device)
        to_bf16 = element != dest.dtype and dest.dtype == torch.bfloat16
        if element == dest.dtype:  # moved as integers of their width: no cast, every bit kept (NaN payloads)
            values, into = scratch.view(carrier(element)), flat.view(carrier(dest.dtype))
        else:  # bfloat16 is written as its bits (see the kernel)
            values, into = scratch.view(element), flat.view(torch.uint16) if to_bf16 else flat
        grid = (len(counts), triton.cdiv(int(counts.max()), BLOCK))
        _gather_cast_scatter[grid](values, into, on_device, batch_strides, NDIM=extent.shape[1], BLOCK=BLOCK,
                                   TO_BF16=to_bf16)
