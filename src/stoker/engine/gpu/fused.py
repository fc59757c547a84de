"""Placing decoded chunks with one Triton kernel per element dtype: the GPU-decode executor's placement where
``triton`` imports (CUDA builds of torch ship it), in place of :mod:`.place`'s torch operations, which
expand every element's indices (``repeat_interleave``, per-axis ``%`` and ``//``, ``index_select``, ``.to``,
``index_copy_``: about a dozen passes over index tensors eight bytes an element, in pieces that fit the
scratch).

Here each copy of a chunk is one row of a small table (its element count, first element in the scratch and
in the batch, extent and scratch strides per axis); a program of the kernel takes ``BLOCK`` elements of one
copy, works out their offsets in registers, loads them, casts and stores: the scratch is read once and the
batch written once, with no index tensor. Chunks with nothing stored are filled the same way (no load).

What it covers is :mod:`.place`'s, bit for bit: moves without a cast as integers of their width (NaN
payloads kept), the casts the device makes (:func:`~.sources.device_casts`: bool and integers of at most 2
bytes into floats, bfloat16 through float32 rounded to nearest even; widening integer casts, which need no
range check: narrowing ones are cast and checked on the CPU), fills from the carrier's bits. What it does
not take (:func:`supports` false: an element or batch dtype of no carrier) goes to :mod:`.place`, explicitly,
per element dtype. Padding (:func:`~stoker.engine.planning.padding.fill_padding`, a few slices per crop) and
CF decoding (after placement) stay torch operations.

``TRITON_INTERPRET=1`` (read when this module is first imported) runs the kernels on CPU tensors, as the
tests do; :func:`available` says whether a device can run them. A kernel variant is compiled on its first
launch, one compile at a time in the process; one Triton cannot compile is placed by :mod:`.place` instead
(the same bits), with a RuntimeWarning.

>>> if available(dest.device):
...     place(plan, sources, dest, scratch, cids, outs, elements_of)  # as stoker.engine.gpu.place.place
"""

from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import torch

from ...errors import MissingDependency
from . import place as torch_place
from .ops import upload
from .place import copies
from .sources import Source, carrier
from ..planning.tables import TablePlan

BLOCK = 1024  # elements per program: a few per thread of a warp group, enough to hide the loads' latency
#: programs along a grid's second axis at most (CUDA's limit): longer copies are launched in parts
MAX_BLOCKS = 65535
_INT = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64)

try:  # module level: Triton's interpreter patches the kernel's globals (tl), not a closure's names
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except ImportError:
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
# Process-wide, held around a launch that may compile: the first of each kernel variant (Triton compiles it
# there, and compiles from several threads at once, e.g. one executor per field, can fail:
# triton-lang/triton#5933), and under Triton's interpreter every launch (it patches triton.language for the
# whole process while a kernel runs: two threads' launches would undo each other's patches). Warm variants
# on a device launch without it. lock rank 4 (a leaf: held around one compile and launch, which call no code
# of ours)
_LAUNCH_LOCK = threading.Lock()
#: the variants (:func:`_variant`) launched once, and those whose compile failed (with its error)
_warm: set[tuple] = set()
_broken: dict[tuple, BaseException] = {}


class _CompileFailed(Exception):
    """Triton could not compile a variant of a kernel; ``first``: this call found it (and warns once)."""

    def __init__(self, name: str, error: BaseException, first: bool):
        super().__init__(f"{name}: {type(error).__name__}: {error}")
        self.first = first


def available(device: torch.device | None = None) -> bool:
    """True when ``triton`` imports (CUDA builds of torch ship it; CPU ones do not) and can run on ``device``:
    a CUDA device, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` when this module was
    first imported)."""
    if triton is None:
        return False
    return device is None or device.type == "cuda" or _INTERPRET


def supports(element: torch.dtype, out: torch.dtype) -> bool:
    """True when the kernel places ``element`` values into an ``out`` batch as :func:`.place.place` does: the
    same dtype of a carrier's width, or a cast the device makes (:func:`~.sources.device_casts`)."""
    if element == out:
        return element.itemsize in (1, 2, 4, 8)
    if element not in (torch.bool, *_INT[:4]) and not (element == torch.int32 and out == torch.int64):
        return False
    return out in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)


if triton is not None:
    @triton.jit
    def _gather_cast_scatter(scratch, batch, table, batch_strides, base, NDIM: tl.constexpr, BLOCK: tl.constexpr,
                             TO_BF16: tl.constexpr, FROM_BOOL: tl.constexpr):
        # table row: count, first element in the scratch, in the batch, extent[NDIM], scratch strides[NDIM]
        row = table + tl.program_id(0).to(tl.int64) * (3 + 2 * NDIM)
        k = (tl.program_id(1).to(tl.int64) + base) * BLOCK + tl.arange(0, BLOCK)
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
        if FROM_BOOL:  # bools are read as bytes: any nonzero byte is True, as numpy's cast takes it
            values = (values != 0).to(tl.uint8)
        if TO_BF16:
            # The CPU path's rule, bfloat16 through float32, rounded to nearest even in integers: Triton's
            # interpreter truncates in .to(tl.bfloat16) whatever the rounding asked. The sources cast on the
            # device are integers of at most 2 bytes (sources.device_casts): never NaN or infinite.
            bits = values.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(batch + dst, bits.to(tl.uint16), mask=inside)
        else:
            tl.store(batch + dst, values.to(batch.dtype.element_ty), mask=inside)

    @triton.jit
    def _fill(batch, table, batch_strides, value, base, NDIM: tl.constexpr, BLOCK: tl.constexpr):
        # table row: count, first element in the batch, extent[NDIM]; value: the fill's bits in the carrier
        row = table + tl.program_id(0).to(tl.int64) * (2 + NDIM)
        k = (tl.program_id(1).to(tl.int64) + base) * BLOCK + tl.arange(0, BLOCK)
        inside = k < tl.load(row)
        dst = k * 0 + tl.load(row + 1)
        rest = k
        for i in tl.static_range(NDIM):
            axis = NDIM - 1 - i
            size = tl.load(row + 2 + axis)
            at = rest % size
            rest = rest // size
            dst += at * tl.load(batch_strides + axis)
        tl.store(batch + dst, (k * 0 + value).to(batch.dtype.element_ty), mask=inside)


def _variant(kernel, args: tuple, constants: dict) -> tuple:
    """What Triton specialises a compiled kernel on, for launching ``kernel`` with ``args``: each tensor's
    dtype, device and 16-byte alignment, each integer's ``== 1``, divisibility by 16 and type (i32, u32 or
    i64), and the constants. (Coarser than Triton's key would only let a compile run outside the lock.)"""
    parts: list = [id(kernel)]
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.dtype, a.device, a.data_ptr() % 16 == 0))
        elif isinstance(a, int):
            parts.append((a == 1, a % 16 == 0, -(1 << 31) <= a < 1 << 31, 0 <= a < 1 << 32))
        else:
            parts.append(type(a))
    return (*parts, *sorted(constants.items()))


def _launch(kernel, counts: np.ndarray, *args, **constants) -> None:
    """``kernel`` over one program row per copy and ``BLOCK`` elements per program, in launches of at most
    :data:`MAX_BLOCKS` programs along the second axis (``base``: the first block of a launch). A variant's
    first launch compiles it (``warmup``) under :data:`_LAUNCH_LOCK`; a compile that fails raises
    :class:`_CompileFailed` (for this call and every later one of that variant, without compiling again)."""
    blocks = -(-int(counts.max()) // BLOCK)
    for base in range(0, blocks, MAX_BLOCKS):
        grid = (len(counts), min(MAX_BLOCKS, blocks - base))
        call = (*args, base)
        key = _variant(kernel, call, constants)
        if key in _warm and not _INTERPRET:
            kernel[grid](*call, BLOCK=BLOCK, **constants)
            continue
        with _LAUNCH_LOCK:
            if key in _broken:
                raise _CompileFailed(_name(kernel), _broken[key], first=False)
            if key not in _warm:
                try:
                    kernel.warmup(*call, grid=grid, BLOCK=BLOCK, **constants)
                except Exception as exc:  # noqa: BLE001 - any failure to compile: Triton's, ptxas', the launcher's C compiler
                    _broken[key] = exc
                    raise _CompileFailed(_name(kernel), exc, first=True) from exc
            kernel[grid](*call, BLOCK=BLOCK, **constants)
            _warm.add(key)


def _name(kernel) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))


def _fell_back(exc: _CompileFailed, what: str) -> None:
    """Say once per variant that Triton's compile failed and :mod:`.place`'s torch operations place instead
    (the same bits, more passes over memory)."""
    if exc.first:
        warnings.warn(f"stoker's GPU decode: Triton could not compile its {what} kernel ({exc}); those copies are "
                      "placed by torch operations instead (the same values, slower)", RuntimeWarning, stacklevel=3)


def place(plan: TablePlan, sources: list[Source], dest: torch.Tensor, scratch: torch.Tensor, cids: np.ndarray,
          outs: np.ndarray, elements_of: list[torch.dtype]) -> None:
    """Gather the copies of chunks ``cids`` (decoded at byte ``outs`` of ``scratch``, as ``elements_of``), cast,
    and scatter them into ``dest``: one kernel launch per element dtype, whatever the number of copies;
    element dtypes the kernel does not take (:func:`supports`) are placed by :func:`.place.place`."""
    if triton is None:
        raise MissingDependency("stoker.engine.gpu.fused needs triton (CUDA builds of torch ship it): use "
                                "stoker.engine.gpu.place.place without it", package="triton")
    flat = dest.view(-1)
    batch_strides = None
    for element in set(elements_of):
        mine = np.array([e == element for e in elements_of])
        if not supports(element, dest.dtype):
            torch_place.place(plan, sources, dest, scratch, cids[mine], outs[mine], [element] * int(mine.sum()))
            continue
        src, dst, extent, strides = copies(plan, sources, dest, cids[mine], outs[mine] // element.itemsize)
        if not len(src):
            continue
        counts = extent.prod(axis=1)
        table = np.concatenate([counts[:, None], src[:, None], dst[:, None], extent, strides], axis=1)
        on_device = upload(table.astype(np.int64, copy=False), dest.device)
        if batch_strides is None:
            batch_strides = upload(np.array(dest.stride()[1:], np.int64), dest.device)
        to_bf16 = element != dest.dtype and dest.dtype == torch.bfloat16
        if element == dest.dtype:  # moved as integers of their width: no cast, every bit kept (NaN payloads)
            values, into = scratch.view(carrier(element)), flat.view(carrier(dest.dtype))
        else:  # bool read as bytes; bfloat16 written as its bits (see the kernel)
            values = scratch.view(torch.uint8 if element == torch.bool else element)
            into = flat.view(torch.uint16) if to_bf16 else flat
        try:
            _launch(_gather_cast_scatter, counts, values, into, on_device, batch_strides, NDIM=extent.shape[1],
                    TO_BF16=to_bf16, FROM_BOOL=element == torch.bool)
        except _CompileFailed as exc:  # all of this dtype's copies again (a part launched before is rewritten)
            _fell_back(exc, "placement")
            torch_place.place(plan, sources, dest, scratch, cids[mine], outs[mine], [element] * int(mine.sum()))


def fill(plan: TablePlan, sources: list[Source], dest: torch.Tensor, cids: np.ndarray) -> None:
    """Every copy of the chunks ``cids`` (nothing stored) filled with its array's fill value (its bits in the
    batch dtype's carrier, :attr:`~.sources.Source.fill`), one launch per array; as :func:`.place.fill`."""
    if triton is None:
        raise MissingDependency("stoker.engine.gpu.fused needs triton: use stoker.engine.gpu.place.fill without it",
                                package="triton")
    if dest.dtype.itemsize not in (1, 2, 4, 8):
        torch_place.fill(plan, sources, dest, cids)
        return
    into = dest.view(-1).view(carrier(dest.dtype))
    batch_strides = None
    by_source = plan.chunk_source[cids]
    for s in np.unique(by_source).tolist():
        mine = cids[by_source == s]
        _, dst, extent, _ = copies(plan, sources, dest, mine, np.zeros(len(mine), np.int64))
        if not len(dst):
            continue
        counts = extent.prod(axis=1)
        table = np.concatenate([counts[:, None], dst[:, None], extent], axis=1)
        on_device = upload(table.astype(np.int64, copy=False), dest.device)
        if batch_strides is None:
            batch_strides = upload(np.array(dest.stride()[1:], np.int64), dest.device)
        try:
            _launch(_fill, counts, into, on_device, batch_strides, int(sources[s].fill), NDIM=extent.shape[1])
        except _CompileFailed as exc:
            _fell_back(exc, "fill")
            torch_place.fill(plan, sources, dest, mine)
