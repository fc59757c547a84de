"""Placing decoded chunks on the device: each chunk's copies as runs of contiguous elements (numpy, no
Python step per chunk or copy), gathered from the decoded scratch, cast and scattered into the batch with
one ``index_select`` / ``index_copy_`` per run length and source dtype; chunks with nothing stored filled
with ``index_fill_``. Elements move as integers of their width (``index_copy_`` has no uint16 kernels);
casts follow the CPU path's rules (:mod:`.cast`: bfloat16 through float32)."""

from __future__ import annotations

import numpy as np
import torch

from .gpu_sources import Source
from .tables import TablePlan

_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def carrier(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of ``dtype``'s width: what elements are moved as."""
    return _CARRIERS[dtype.itemsize]


def cast(values: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """``values`` in ``out`` by the CPU path's rules (bfloat16 through float32)."""
    if values.dtype == out:
        return values
    if out == torch.bfloat16 and values.dtype != torch.float32:
        values = values.to(torch.float32)
    return values.to(out)


def spans(counts: np.ndarray) -> np.ndarray:
    """``0..counts[i]-1`` for each ``i``, end to end."""
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)


def runs(plan: TablePlan, sources: list[Source], dest: torch.Tensor, cids: np.ndarray,
         element_base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every copy of chunks ``cids`` as runs of contiguous elements: ``(src, dst, length)`` per run, ``src``
    in elements of the chunks' dtype from the start of the scratch (chunk ``cids[i]`` at
    ``element_base[i]``), ``dst`` in elements of the flat batch."""
    n = plan.n_copies[cids]
    rows = np.repeat(plan.first_copy[cids], n) + spans(n)
    strides = np.stack([sources[int(s)].strides for s in plan.chunk_source[cids]]) if len(cids) else \
        np.zeros((0, plan.ndim), np.int64)
    owner = np.repeat(np.arange(len(cids)), n)
    src = element_base[owner] + (plan.copy_chunk_start[rows] * strides[owner]).sum(axis=1)
    row_stride, *dst_strides = dest.stride()
    dst_strides = np.array(dst_strides, np.int64)
    dst = plan.copy_row[rows] * row_stride + plan.copy_box_start[rows] @ dst_strides
    extent = plan.copy_extent[rows]
    if plan.ndim == 0:
        return src, dst, np.ones(len(rows), np.int64)
    outer = extent[:, :-1]
    count = outer.prod(axis=1)
    run_of = np.repeat(np.arange(len(rows)), count)
    k = spans(count)
    s, d = src[run_of].copy(), dst[run_of].copy()
    for a in range(outer.shape[1] - 1, -1, -1):  # the run's index along each outer axis, innermost first
        size = outer[run_of, a]
        idx = k % size
        k //= size
        s += idx * strides[owner[run_of], a]
        d += idx * dst_strides[a]
    return s, d, extent[run_of, -1]


def place(plan: TablePlan, sources: list[Source], dest: torch.Tensor, scratch: torch.Tensor, cids: np.ndarray,
          outs: np.ndarray, elements: list[torch.dtype]) -> None:
    """Gather the copies of chunks ``cids`` (decoded at byte ``outs`` of ``scratch``, as ``elements``), cast,
    and scatter them into ``dest``, in pieces whose gathered and cast values and indices take at most the
    scratch's size."""
    flat = dest.view(-1).view(carrier(dest.dtype))
    budget = scratch.numel()
    for element in set(elements):
        mine = np.array([e == element for e in elements])
        view = scratch.view(carrier(element))  # the scratch's size is a multiple of ALIGN
        src, dst, length = runs(plan, sources, dest, cids[mine], outs[mine] // element.itemsize)
        per = element.itemsize + (dest.dtype.itemsize if dest.dtype != element else 0)
        for size in np.unique(length).tolist():
            sel = np.flatnonzero(length == size)
            step = max(1, budget // (size * per + 16))
            for lo in range(0, len(sel), step):
                part = sel[lo:lo + step]
                take = torch.as_tensor(src[part], device=dest.device)
                put = torch.as_tensor(dst[part], device=dest.device)
                values = view.unfold(0, size, 1).index_select(0, take)
                if element != dest.dtype:
                    values = cast(values.view(element), dest.dtype)
                flat.unfold(0, size, 1).index_copy_(0, put, values.view(flat.dtype))


def fill(plan: TablePlan, sources: list[Source], dest: torch.Tensor, cids: np.ndarray) -> None:
    """Every copy of the chunks ``cids`` (nothing stored) filled with its array's fill value."""
    flat = dest.view(-1).view(carrier(dest.dtype))
    by_source = plan.chunk_source[cids]
    for s in np.unique(by_source).tolist():
        mine = cids[by_source == s]
        _, dst, length = runs(plan, sources, dest, mine, np.zeros(len(mine), np.int64))
        for size in np.unique(length).tolist():
            put = torch.as_tensor(dst[length == size], device=dest.device)
            flat.unfold(0, size, 1).index_fill_(0, put, sources[s].fill.view(flat.dtype))
