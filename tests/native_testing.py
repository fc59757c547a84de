"""``stoker._testing`` for the tests: ``decode_files``, the compiled engine's readers and decoders called on the
calling thread (see csrc/testing.c), with its codecs set up as :mod:`stoker.engine.cpu.native` sets up
``stoker._native``'s; and :func:`copy_plan`, the copy plans it places.

``stoker._testing`` is built from the same sources as ``stoker._native`` plus csrc/testing.c, in place only
(``python setup.py build_ext --inplace``, or ``make venv``'s editable install): no wheel holds it. ``module``
and ``decode_files`` are None where the engine is not loaded (not built, or ``STOKER_NATIVE=0``) or
``stoker._testing`` is not built; tests/engine/test_native.py fails when only the latter is missing.
"""

from __future__ import annotations

from array import array

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
