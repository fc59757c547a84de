"""The torch operations of a batched decode after decompression, for any device (CPU tensors too).

- :func:`unshuffle`: c-blosc's byte and bit unshuffle of a batch of equal blocks, as tensor
  reshapes (no loop over blocks);
- :func:`unshuffle_`: every block a :class:`~stoker.engine.gpu.frames.Layout` lists, in place in a flat
  byte buffer, one :func:`unshuffle` per kind of block (shuffle, item size, block size);
- :func:`copy_segments_`: many byte ranges from one buffer to another (raw streams), one gather and
  one scatter per distinct length;
- :func:`upload`: host index arrays to the device without waiting for it.

Blocks are gathered as rows of ``buf.unfold(0, size, 1)`` (a view of every ``size``-byte window)
and written back through the same view: the index tensors hold one entry per block, not per byte.
Rows never overlap (the layout's blocks and streams are disjoint), so each byte is written once.
"""

from __future__ import annotations

import numpy as np
import torch

from .frames import BITSHUFFLE, BYTESHUFFLE, Layout


def byte_unshuffle(blocks: torch.Tensor, typesize: int) -> torch.Tensor:
    """Undo c-blosc's byte shuffle of each row of ``blocks`` (uint8, ``(n, size)``).

    A shuffled block holds byte 0 of every item, then byte 1 of every item, and so on; the bytes
    past the last whole item stay where they are (c-blosc's ``unshuffle_generic``).
    """
    n, size = blocks.shape
    items = size // typesize
    if typesize <= 1 or not items:
        return blocks
    body = items * typesize
    planes = blocks[:, :body].reshape(n, typesize, items).transpose(1, 2).reshape(n, body)
    if body == size:
        return planes
    return torch.cat([planes, blocks[:, body:]], dim=1)


def bit_unshuffle(blocks: torch.Tensor, typesize: int) -> torch.Tensor:
    """Undo c-blosc's bit shuffle (bitshuffle's ``bshuf_untrans_bit_elem``) of each row of ``blocks``.

    A shuffled block of ``m`` items is ``8 * typesize`` rows of ``m`` bits: row ``8 * j + k`` holds
    bit ``k`` of byte ``j`` of every item, item ``i`` at bit ``i % 8`` of the row's byte ``i // 8``.
    c-blosc bit-shuffles only blocks whose item count is a multiple of 8 (others are stored as they
    are) and leaves the bytes past the last whole item in place.
    """
    n, size = blocks.shape
    items = size // typesize
    if not items or items % 8:
        return blocks
    body = items * typesize
    rows = blocks[:, :body].reshape(n, typesize, 8, items // 8)  # [block, byte j, bit k, byte of the row]
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device)
    out = torch.zeros((n, typesize, items // 8, 8), dtype=torch.uint8, device=blocks.device)
    for k in range(8):  # the 8 bits of a byte, not the blocks: each step is one op over the batch
        bits = (rows[:, :, k, :, None] >> shifts) & 1  # [block, byte j, i // 8, i % 8]
        out |= bits << k
    out = out.reshape(n, typesize, items).transpose(1, 2).reshape(n, body)
    if body == size:
        return out
    return torch.cat([out, blocks[:, body:]], dim=1)


def unshuffle(blocks: torch.Tensor, typesize: int, shuffle: int) -> torch.Tensor:
    """:func:`byte_unshuffle` (``shuffle == BYTESHUFFLE``) or :func:`bit_unshuffle` (``BITSHUFFLE``)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(f"unshuffle takes a 2-D uint8 tensor of blocks, got {blocks.dtype} {tuple(blocks.shape)}")
    if shuffle == BYTESHUFFLE:
        return byte_unshuffle(blocks, typesize)
    if shuffle == BITSHUFFLE:
        return bit_unshuffle(blocks, typesize)
    raise ValueError(f"unknown shuffle {shuffle}")


def _groups(*keys: np.ndarray):
    """``(key values, row indices)`` for each distinct combination of ``keys`` (few: one per kind of block)."""
    if not len(keys[0]):
        return
    table = np.stack(keys, axis=1)
    uniq, inverse = np.unique(table, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    for g, values in enumerate(uniq):
        yield tuple(int(v) for v in values), np.flatnonzero(inverse == g)


def unshuffle_(buf: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Unshuffle in place every block of ``layout`` in ``buf`` (flat uint8, ``layout.out_nbytes`` long)."""
    check_flat(buf, layout.out_nbytes, "unshuffle_")
    for (size, typesize, shuffle), rows in _groups(layout.block_size, layout.block_typesize, layout.block_shuffle):
        starts = upload(layout.block_dst[rows], buf.device)
        windows = buf.unfold(0, size, 1)
        windows.index_copy_(0, starts, unshuffle(windows.index_select(0, starts), typesize, shuffle))
    return buf


def copy_segments_(src: torch.Tensor, src_off: np.ndarray, dst: torch.Tensor, dst_off: np.ndarray,
                   sizes: np.ndarray) -> torch.Tensor:
    """``dst[dst_off[i]:dst_off[i] + sizes[i]] = src[src_off[i]:...]`` for every ``i`` (flat uint8 tensors)."""
    for (size,), rows in _groups(np.asarray(sizes)):
        if not size:
            continue
        take = upload(np.asarray(src_off)[rows], src.device)
        put = upload(np.asarray(dst_off)[rows], dst.device)
        dst.unfold(0, size, 1).index_copy_(0, put, src.unfold(0, size, 1).index_select(0, take).to(dst.device))
    return dst


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``. To a GPU it goes through pinned memory, queued on the current
    stream: a copy from pageable memory would wait for everything queued there first (the decode)."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def check_flat(buf: torch.Tensor, nbytes: int, what: str) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < nbytes:
        raise ValueError(f"{what}: needs a flat uint8 tensor of at least {nbytes} bytes, got {buf.dtype} "
                         f"{tuple(buf.shape)}")
