"""``stoker._testing`` for the tests: ``decode_files``, the compiled engine's readers and decoders called on the
calling thread (see csrc/testing.c), with its codecs set up as :mod:`stoker.engine.cpu.native` sets up
``stoker._native``'s; and :func:`copy_plan`, the copy plans it places.

``stoker._testing`` is built from the same sources as ``stoker._native`` plus csrc/testing.c, in place only
(``python setup.py build_ext --inplace``, or ``make venv``'s editable install): no wheel holds it. ``module``
and ``decode_files`` are None where the engine is not loaded (not built, or ``STOKER_NATIVE=0``) or
``stoker._testing`` is not built; tests/engine/test_native.py fails when only the latter is missing.

:func:`one_chunk_tables` writes one chunk file and gives the tables of an ``Engine.submit`` that reads it.
"""

from __future__ import annotations

import os
from array import array

import numcodecs
import numpy as np
import torch

from stoker.engine.cpu import native
from stoker.engine.cast import torch_dtype_of
from stoker.zarr.grid import c_strides

module = None
if native.Engine is not None:
    try:
        from stoker import _testing as module
    except ImportError:
        module = None
    if module is not None and native.configure(module) is None:
        module = None

#: ``decode_files(codec, paths, regions, scratch, outs, nbytes, places, dst)
#: -> [(status, nread, decoded, read_ns, decode_ns, place_ns, placed)]``, or None (see above)
decode_files = module.decode_files if module is not None else None


def copy_plan(task, codec, out: torch.Tensor, kind: int, out_strides: tuple[int, ...] | None = None) -> array | None:
    """``decode_files``' copy plan for casting ``task``'s copies (a ChunkTask's) from its decoded chunk into
    ``out`` (see csrc/testing.c: ``[src_kind, ndim, ncopies, chunk strides, batch strides]``, then per copy
    ``[src_offset, dst_offset, extent...]``), or None where the chunk's layout or dtype is not one it places.

    >>> copy_plan(task, codec, batch, native.KIND_F32)
    """
    src = native.SOURCE_KINDS.get(codec.dtype) if codec.plain else None
    if src is None or (kind == native.KIND_SAME and out.dtype != torch_dtype_of(codec.dtype)):
        return None
    chunk_strides = c_strides(codec.shape)
    row_stride, *dst_strides = out.stride() if out_strides is None else out_strides
    values = [src, len(chunk_strides), len(task.copies), *chunk_strides, *dst_strides]
    for c in task.copies:
        src_offset = sum(s * cs for s, cs in zip(c.chunk_start, chunk_strides))
        dst_offset = c.row * row_stride + sum(b * ds for b, ds in zip(c.box_start, dst_strides))
        values += (src_offset, dst_offset, *c.extent)
    return array("q", values)


def one_chunk_tables(root: str, chunk: np.ndarray, layout: str, ncopies: int) -> tuple:
    """Write the 2-d ``chunk`` zstd-compressed to ``root``/c/0.0 in ``layout`` ("C" or "F" order; a "-swapped"
    suffix: in the other byte order) and build the engine's tables for one job reading it with ``ncopies``
    copies (the caller makes the copy table). Returns ``(chunks, sources, files, blob, strides)``, ``strides``
    the chunk's element strides in that layout.

    >>> chunks, sources, files, blob, strides = one_chunk_tables(str(tmp_path) + "/", chunk, "F-swapped", 1)
    """
    dt = chunk.dtype
    order = "F" if layout.startswith("F") else "C"
    swapped = layout.endswith("swapped")
    stored = chunk.astype(dt.newbyteorder("S")) if swapped else chunk
    os.makedirs(os.path.join(root, "c"))
    with open(os.path.join(root, "c", "0.0"), "wb") as f:
        f.write(numcodecs.Zstd(level=1).encode(np.asarray(stored).tobytes(order=order)))
    blob = os.fsencode(os.path.join(root, "c") + "/")
    strides = (1, chunk.shape[0]) if order == "F" else (chunk.shape[1], 1)
    sources = np.array([[native.SOURCE_KINDS[dt], 0, 0, len(blob), ord("."), int(swapped), *strides]], np.int64)
    files = np.zeros((1, native.F_COORDS + 2), np.int64)
    chunks = np.zeros((1, native.N_CHUNK_COLS), np.int64)
    chunks[0, native.C_OFFSET] = chunks[0, native.C_BUFFER] = -1
    chunks[0, native.C_SPAN_STOP] = chunks[0, native.C_NBYTES] = chunk.nbytes
    chunks[0, native.C_CODEC] = native.CODEC_ZSTD
    chunks[0, native.C_MAX_STORED] = chunk.nbytes + 4096
    chunks[0, native.C_NCOPIES] = ncopies
    return chunks, sources, files, blob, strides
