"""Placing decoded chunks on the device: each copy of a chunk is a box of elements, described on the host by
a few numbers (its start in the scratch and in the batch, its extent, the strides of both: numpy, no Python
step per chunk or copy), expanded into element indices on the device (``repeat_interleave`` and integer
arithmetic, in pieces that fit the scratch), then gathered from the decoded scratch, cast and scattered into
the batch in one ``index_select`` / ``index_copy_`` per piece; chunks with nothing stored are filled the same
way with ``index_fill_``. Elements move as integers of their width (``index_copy_`` has no uint16 kernels);
casts follow the CPU path's rules (:mod:`.cast`: bfloat16 through float32)."""

from __future__ import annotations

import numpy as np
import torch

from .ops import upload
from .sources import Source, carrier
from ..planning.tables import TablePlan


def cast(values: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """``values`` in ``out`` by the CPU path's rules (bfloat16 through float32)."""
    if values.dtype == out:
        return values
    if out == torch.bfloat16 and values.dtype != torch.float32:
        values = values.to(torch.float32)
    return values.to(out)


def copies(plan: TablePlan, sources: list[Source], dest: torch.Tensor, cids: np.ndarray,
           element_base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every copy of chunks ``cids`` as ``(src, dst, extent, strides)``: its first element in the scratch (chunk
    ``cids[i]`` starts at element ``element_base[i]``) and in the flat batch, its extent per axis, and the
    element strides of its chunk in the scratch, one row per copy."""
    rows = plan.copy_rows(cids)
    owner = np.repeat(np.arange(len(cids)), plan.n_copies[cids])
    if len(cids):
        strides = np.stack([sources[int(s)].strides for s in plan.chunk_source[cids]])[owner]
    else:
        strides = np.zeros((0, plan.ndim), np.int64)
    src = element_base[owner] + (plan.copy_chunk_start[rows] * strides).sum(axis=1)
    row_stride, *dst_strides = dest.stride()
    dst = plan.copy_row[rows] * row_stride + plan.copy_box_start[rows] @ np.array(dst_strides, np.int64)
    return src, dst, plan.copy_extent[rows].reshape(len(rows), plan.ndim), strides.reshape(len(rows), plan.ndim)


def pieces(counts: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of rows whose ``counts`` add up to at most ``limit`` (a row larger than that alone)."""
    ends = np.cumsum(counts)
    out, lo = [], 0
    while lo < len(counts):
        base = ends[lo - 1] if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, base + limit, side="right")))
        out.append((lo, hi))
        lo = hi
    return out


def elements(src: np.ndarray | None, dst: np.ndarray, extent: np.ndarray, strides: np.ndarray | None,
             dest_strides: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The element indices of the copies ``(src, dst, extent, strides)``, expanded on ``device``: for each
    copy, every element of its box in C order, as an index into the scratch (None without ``src``) and into
    the flat batch."""
    counts_np = extent.prod(axis=1)  # 1 for 0-d copies (an empty product)
    total = int(counts_np.sum())  # known on the host: no wait for the device
    n, ndim = extent.shape
    # one upload of every per-copy number (uploads from the host do not wait for the device: ops.upload)
    rows = [counts_np, dst, *extent.T] + ([*strides.T, src] if src is not None else [])
    on_device = upload(np.stack(rows).astype(np.int64, copy=False).reshape(len(rows), n), device)
    counts, ext = on_device[0], on_device[2:2 + ndim].T
    copy = torch.repeat_interleave(torch.arange(n, device=device), counts, output_size=total)
    k = torch.arange(total, device=device) - (torch.cumsum(counts, 0) - counts)[copy]
    d = on_device[1][copy]
    s = on_device[-1][copy] if src is not None else None
    st = on_device[2 + ndim:2 + 2 * ndim].T if src is not None else None
    for a in range(extent.shape[1] - 1, -1, -1):  # the element's index along each axis, innermost first
        size = ext[copy, a]
        idx = k % size
        k = k // size
        d += idx * int(dest_strides[a])
        if s is not None:
            s += idx * st[copy, a]
    return s, d


def place(plan: TablePlan, sources: list[Source], dest: torch.Tensor, scratch: torch.Tensor, cids: np.ndarray,
          outs: np.ndarray, elements_of: list[torch.dtype]) -> None:
    """Gather the copies of chunks ``cids`` (decoded at byte ``outs`` of ``scratch``, as ``elements_of``), cast,
    and scatter them into ``dest``, in pieces whose indices and gathered values take at most the scratch's
    size."""
    flat = dest.view(-1).view(carrier(dest.dtype))
    for element in set(elements_of):
        mine = np.array([e == element for e in elements_of])
        view = scratch.view(carrier(element))  # the scratch's size is a multiple of ALIGN
        src, dst, extent, strides = copies(plan, sources, dest, cids[mine], outs[mine] // element.itemsize)
        per = 16 + 8 * 4 + element.itemsize + 2 * dest.dtype.itemsize  # indices, their temporaries, values
        for lo, hi in pieces(extent.prod(axis=1), max(1, scratch.numel() // per)):
            take, put = elements(src[lo:hi], dst[lo:hi], extent[lo:hi], strides[lo:hi], dest.stride()[1:],
                                 dest.device)
            values = view.index_select(0, take)
            if element != dest.dtype:
                values = cast(values.view(element), dest.dtype)
            flat.index_copy_(0, put, values.view(flat.dtype))


def fill(plan: TablePlan, sources: list[Source], dest: torch.Tensor, cids: np.ndarray) -> None:
    """Every copy of the chunks ``cids`` (nothing stored) filled with its array's fill value."""
    flat = dest.view(-1).view(carrier(dest.dtype))
    by_source = plan.chunk_source[cids]
    for s in np.unique(by_source).tolist():
        mine = cids[by_source == s]
        _, dst, extent, _ = copies(plan, sources, dest, mine, np.zeros(len(mine), np.int64))
        for lo, hi in pieces(extent.prod(axis=1), 1 << 24):
            _, put = elements(None, dst[lo:hi], extent[lo:hi], None, dest.stride()[1:], dest.device)
            flat.index_fill_(0, put, sources[s].fill)
