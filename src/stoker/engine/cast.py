"""Casting rules from a source dtype to a batch dtype, and the copy-cast itself.

- ``"native"``: a plain copy; the batch has the source dtype (all sources of a
  batch must agree).
- ``"f32"`` / ``"f16"``: integer and float sources round to nearest even
  (numpy's casts: one correctly rounded conversion).
- ``"bf16"``: via float32, then round-to-nearest-even to bfloat16 (torch's
  conversion), so ``bf16(x) == bf16(f32(x))`` for every source.
- ``"i32"`` / ``"i64"``: integer and bool sources only, every value kept exactly; a value that does not
  fit (a uint64 id >= 2**63 into ``"i64"``, one beyond int32's range into ``"i32"``) is a
  :class:`~stoker.errors.DtypeMismatch` naming the array and the chunk (:func:`unfit_range`,
  :func:`range_error`; a fill value: :func:`check_fill`), never a wrapped id. Float sources are refused (:func:`batch_dtype`).
- 32- and 64-bit integer sources into float batches are refused unless ``lossy_casts`` (float32 holds
  integers exactly only up to 2**24, bfloat16 and float16 far fewer: label ids would merge); 8- and
  16-bit integers (images) are allowed, but for the levels of an OME-Zarr label image (``ids``: their
  values are ids): 16-bit ones into ``"bf16"`` (exact up to 256) or ``"f16"`` (up to 2048) are refused too.
- A finite value past the float batch's largest finite value (65504 for ``"f16"``: a uint16 of 65520 or more;
  float32's and bfloat16's for a float64 or float32 source) would become inf: a
  :class:`~stoker.errors.DtypeMismatch` naming the array and the chunk, as for an integer batch
  (:func:`unfit_range`), with ``lossy_casts`` too (it allows rounding, not infinities). NaN and inf stay
  themselves.
- complex sources cannot become real batches: :class:`~stoker.errors.DtypeMismatch`.

Copies run in compute threads; numpy and torch release the GIL while copying.
"""

from __future__ import annotations

import functools

import warnings

import numpy as np
import torch

from ..runtime import gil
from ..errors import DtypeMismatch

# Decoded chunks are often read-only numpy views; we only ever read from the tensors made of them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

_NUMPY_OUT = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}


@functools.lru_cache(maxsize=None)
def torch_dtype_of(dtype: np.dtype) -> torch.dtype:
    """The torch dtype with the same meaning as a native numpy dtype (cached: asked once per chunk copy)."""
    return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype


#: The integer batch dtypes and their names in ``Config.dtype``.
INTEGER_OUTPUTS = {torch.int32: "i32", torch.int64: "i64"}
_FLOAT_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def batch_dtype(requested: torch.dtype | None, source: np.dtype, uri: str, lossy: bool = False,
                ids: bool = False) -> torch.dtype:
    """The batch dtype for ``source`` under the requested output (``None``: native), or the
    :class:`~stoker.errors.DtypeMismatch` that refuses the cast (``lossy``: ``Config.lossy_casts``; ``ids``:
    the array's values are label ids, an OME-Zarr label image's).

    >>> batch_dtype(torch.int64, np.dtype("uint64"), "labels.zarr")
    torch.int64
    >>> batch_dtype(torch.float32, np.dtype("uint64"), "labels.zarr")
    Traceback (most recent call last):
    stoker.errors.DtypeMismatch: labels.zarr: uint64 values cast to f32 may change ...
    """
    if requested is None:
        try:
            return torch_dtype_of(source)
        except TypeError:
            raise DtypeMismatch(f"{uri}: dtype {source} has no torch equivalent", uri=uri) from None
    if source.kind == "c":
        raise DtypeMismatch(
            f"{uri}: complex dtype {source} cannot be cast to {requested}; use dtype='native' "
            "or store real and imaginary parts as separate arrays",
            uri=uri,
        )
    if requested in INTEGER_OUTPUTS:
        if source.kind not in "biu":
            raise DtypeMismatch(
                f"{uri}: dtype {source} cannot be cast to the integer output {INTEGER_OUTPUTS[requested]!r} "
                "(its values would be truncated); use a float dtype ('f32', 'bf16', 'f16') or 'native'",
                uri=uri, dtype=str(source))
        return requested
    if source.kind in "iu" and source.itemsize >= 4 and not lossy:
        name = _FLOAT_NAMES.get(requested, str(requested))
        raise DtypeMismatch(
            f"{uri}: {source} values cast to {name} may change (float32 holds integers exactly only up to "
            f"2**24, bfloat16 and float16 far fewer: label ids would merge); use dtype 'i32', 'i64' or 'native' "
            "for exact values, or Config(lossy_casts=True) to cast them anyway",
            uri=uri, dtype=str(source))
    if ids and source.kind in "iu" and source.itemsize == 2 and requested in HALF_EXACT_UP_TO and not lossy:
        name = _FLOAT_NAMES[requested]
        raise DtypeMismatch(
            f"{uri}: a level of an OME-Zarr label image: its {source} ids cast to {name} would merge ({name} holds "
            f"integers exactly only up to {HALF_EXACT_UP_TO[requested]}); use 'f32', 'i32', 'i64' or 'native' for "
            "its field (Config(dtype={'labels': 'i32', ...})) or the batch, or Config(lossy_casts=True) to cast "
            "them anyway",
            uri=uri, dtype=str(source))
    return requested


#: The 16-bit float batch dtypes and the integer up to which each holds every integer exactly
HALF_EXACT_UP_TO = {torch.bfloat16: 256, torch.float16: 2048}

#: Per float batch dtype, the magnitude from which a finite value rounds to inf (to nearest even: the
#: midpoint between the largest finite value and the next power of two rounds up). bfloat16 is reached
#: through float32 (:func:`copy_cast`), so a float64 source is compared after its float32 rounding.
OVERFLOW_AT = {torch.float16: 65520.0, torch.bfloat16: float.fromhex("0x1.ffp127"),
               torch.float32: float.fromhex("0x1.ffffffp127")}


def unfit_range(src: np.ndarray, dtype: torch.dtype) -> tuple[int, int] | tuple[float, float] | None:
    """``(min, max)`` of ``src`` when one of its values does not fit the integer batch ``dtype``, else None
    (without a pass over ``src`` when its dtype's range fits: uint16 into int32). For a float batch, the
    ``(min, max)`` of the finite values that would become inf in it (:data:`OVERFLOW_AT`), else None.

    >>> unfit_range(np.array([1, 2**40], np.int64), torch.int32)
    (1, 1099511627776)
    >>> unfit_range(np.array([1, 65520, 65535, 7], np.uint16), torch.float16)
    (65520, 65535)
    """
    if dtype in OVERFLOW_AT:
        return _overflow(np.asarray(src), dtype)
    if dtype not in INTEGER_OUTPUTS or src.dtype.kind not in "iu" or src.size == 0:
        return None
    have, room = np.iinfo(src.dtype), torch.iinfo(dtype)
    if have.min >= room.min and have.max <= room.max:
        return None
    lo, hi = int(gil.released(np.min, src)), int(gil.released(np.max, src))
    return (lo, hi) if lo < room.min or hi > room.max else None


def _overflow(src: np.ndarray, dtype: torch.dtype) -> tuple[int, int] | tuple[float, float] | None:
    """:func:`unfit_range` of a float batch: only sources whose dtype reaches :data:`OVERFLOW_AT` are read."""
    at = OVERFLOW_AT[dtype]
    if src.size == 0 or src.dtype.kind not in "iuf":
        return None
    if src.dtype.kind in "iu":
        have = np.iinfo(src.dtype)
        if have.max < at and have.min > -at:
            return None
        lo, hi = int(gil.released(np.min, src)), int(gil.released(np.max, src))
        if lo > -at and hi < at:
            return None
        past = src[(src >= at) | (src <= -at)]
        return int(past.min()), int(past.max())
    if float(np.finfo(src.dtype).max) < at:
        return None
    # two reductions (no temporaries) clear the usual chunk, far inside the range: half of ``at`` leaves room for
    # a float64's rounding to float32 on the way to bfloat16; NaN fails the test, so such a chunk is looked at whole
    lo, hi = float(gil.released(np.min, src)), float(gil.released(np.max, src))
    if -at / 2 < lo and hi < at / 2:
        return None
    with np.errstate(over="ignore"):
        seen = src.astype(np.float32) if dtype == torch.bfloat16 and src.dtype.itemsize > 4 else src
        past = gil.released(lambda: np.isfinite(src) & (np.abs(seen) >= at))
    if not past.any():
        return None
    values = src[past]
    return float(values.min()), float(values.max())


def range_error(uri: str, key: str, source: np.dtype, dtype: torch.dtype,
                span: tuple[int, int] | tuple[float, float] | None = None, cause: str | None = None,
                box=None, subject: str | None = None) -> DtypeMismatch:
    """The error of a chunk (``key``; for a missing one, its fill value) holding a value that does not fit the
    batch ``dtype`` (outside an integer batch's range, or a finite value that would be inf in a float batch);
    ``span``: its values' (min, max) where known (the engine's ST_RANGE says only that one did not fit);
    ``cause``: what made them so when the stored values fit (``"after CF decoding or the transform"``, in a
    work buffer: :mod:`~stoker.engine.rounding`), ``box``: the sample's box that holds them; ``subject``: what
    holds them in place of "chunk ``key`` holds" (:func:`check_fill`: a chunk not stored, or the padding).

    >>> raise range_error("t.zarr", "c/0/1", np.dtype("int16"), torch.float16, (7e4, 7e4), "after CF decoding")
    Traceback (most recent call last):
    stoker.errors.DtypeMismatch: t.zarr: chunk 'c/0/1' holds the value 70000.0 after CF decoding past f16's ...
    """
    held = ("a value" if span is None else f"the value {span[0]}" if span[0] == span[1]
            else f"values in [{span[0]}, {span[1]}]")
    crop = ""
    if box is not None:  # the span is the crop's: the chunk holds one of them at least
        crop = f"; the sample's box {tuple(tuple(int(v) for v in ab) for ab in box)} holds {held} there"
        held = "a value"
    if cause is not None:
        held += f" {cause}"
    what = f"chunk {key!r} holds" if subject is None else subject
    if dtype in OVERFLOW_AT:
        name = _FLOAT_NAMES.get(dtype, str(dtype))
        fits_f32 = dtype != torch.float32 and (
            source.itemsize <= 4 if span is None else max(abs(span[0]), abs(span[1])) < OVERFLOW_AT[torch.float32])
        wider = "use dtype 'f32' or 'native'" if fits_f32 else "use dtype='native'"
        if cause is not None:  # (CF decoding runs before the transform, in float32 at most on a device)
            wider = ("use dtype 'f32'" if fits_f32 else "use dtype 'f32' with a transform that scales them down"
                     if "transform" in cause else "read the stored values with Config(cf=False) and decode them")
        scale = ("or scale the data down before storing it" if cause is None
                 else "or a transform that keeps them in range" if "transform" in cause
                 else "as xarray does, in float64")
        return DtypeMismatch(
            f"{uri}: {what} {held} past {name}'s largest finite value "
            f"{float(torch.finfo(dtype).max):g}, which the cast would make inf (source dtype {source}){crop}; "
            f"{wider} to keep every value, {scale}", uri=uri, key=key, dtype=str(source))
    room = torch.iinfo(dtype)
    wider = "use dtype 'i64' or 'native'" if dtype == torch.int32 else "use dtype='native'"
    return DtypeMismatch(
        f"{uri}: {what} {held} outside {INTEGER_OUTPUTS[dtype]}'s range [{room.min}, {room.max}] "
        f"(source dtype {source}); {wider} to keep every value", uri=uri, key=key, dtype=str(source))


def check_fill(reader, dtype: torch.dtype, key: str) -> None:
    """The :func:`range_error` naming ``reader``'s array and ``key`` (a missing chunk, or the padding) when the
    array's fill value does not fit the batch ``dtype``: it would be written wrapped around, or inf
    (:func:`fill_value_as` casts it unchecked); nothing for a fill value that fits.

    >>> check_fill(stoker.open_array("ids.zarr"), torch.int32, "c/0/1")  # uint32, fill value 2**32 - 1
    Traceback (most recent call last):
    stoker.errors.DtypeMismatch: ids.zarr: chunk 'c/0/1' is not stored and reads as the array's fill value, the
    value 4294967295 outside i32's range ...
    """
    fill = np.asarray(reader.metadata.fill_value)
    if unfit_range(fill.reshape(1), dtype) is not None:
        value = fill.item()
        # say where the value comes from: no chunk file holds it, so "chunk k holds" sends one looking for it
        subject = ("the padding reads as the array's fill value," if key.startswith("<padding")
                   else f"chunk {key!r} is not stored and reads as the array's fill value,")
        raise range_error(reader.uri, key, fill.dtype, dtype, (value, value), subject=subject)


def numpy_view(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of ``t`` when it is in host memory and numpy has its dtype (not bfloat16), else None."""
    if t.device.type != "cpu":
        return None
    try:
        return t.numpy()
    except TypeError:
        return None


def copy_cast(dst: torch.Tensor | np.ndarray, src: np.ndarray, half_next: bool = False) -> None:
    """``dst[...] = src`` with the module's casting rules; ``src`` may be strided or byte-swapped.

    ``dst`` is a numpy view where numpy has the dtype (the fast path: numpy casts
    with one correct rounding), else a torch tensor (bfloat16: via float32).
    ``half_next``: ``dst`` is a float32 work buffer rounded into float16 next (an ``"f16"`` batch made in
    float32 for its CF decoding): a float64 ``src`` goes in as :func:`half_exact` says, so that rounding is
    NumPy's one rounding of ``src`` (rounded to nearest into float32 first, a value just past a float16 tie
    landed on the tie and went to even: 281.125001 became 281.0, not 281.25).
    """
    if not src.dtype.isnative:
        src = src.astype(src.dtype.newbyteorder("="))
    if half_next and src.dtype == np.float64 and dst.dtype in (np.float32, torch.float32):
        src = half_exact(src)
    if isinstance(dst, np.ndarray):
        gil.released(np.copyto, dst, src, casting="unsafe")
    elif dst.dtype in _NUMPY_OUT or dst.dtype == torch_dtype_of(src.dtype):
        gil.released(np.copyto, dst.numpy(), src, casting="unsafe")
    else:
        gil.released(dst.copy_, torch.from_numpy(np.array(src) if src.ndim == 0 else src))  # a 0-d copy stays 0-d
        if dst.dtype == torch.bfloat16 and src.dtype.kind == "f":
            canonical_nans(dst)


def canonical_nans(dst: torch.Tensor) -> None:
    """Every NaN of bfloat16 ``dst`` made 0x7FC0, as the compiled engine writes it (csrc/place.c): torch's
    vectorised float32 cast gives 0xFFFF, so the same data would differ in its bits by the path it took."""
    nan = torch.isnan(dst)
    if bool(nan.any()):
        dst.view(torch.int16).masked_fill_(nan, 0x7FC0)


def fill_value_as(fill: np.ndarray, dtype: torch.dtype, half_next: bool = False) -> torch.Tensor:
    """A 0-d tensor holding ``fill`` converted by the same rules as :func:`copy_cast` (``half_next`` too),
    unchecked: a fill value past ``dtype`` is refused by :func:`check_fill` with a DtypeMismatch, so numpy's
    overflow warning is kept quiet here (under warnings-as-errors it would reach the consumer instead of that
    typed error)."""
    out = torch.empty((), dtype=dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        copy_cast(out, np.asarray(fill), half_next)
    return out


def half_exact(t: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of float64 ``t`` whose rounding into float16 is ``t``'s one rounding, as NumPy casts it:
    ``t``'s float16 itself (exact in float32), except where that is inf and ``t`` finite, which keeps ``t``'s
    float32, so the check of the rounding into float16 after names the value (a DtypeMismatch, never an inf).
    ``out``: a float32 array already holding ``t`` rounded to nearest, made so in place (else a new one). The
    rule of values placed, and on the CPU of values decoded (:func:`stoker.engine.cpu.cf.round_to_odd_`)."""
    with np.errstate(over="ignore"):  # past float16: inf, left out below (past float32: refused before)
        half = t.astype(np.float16)
        if out is None:
            out = t.astype(np.float32)
    np.copyto(out, half, where=np.isfinite(half) | ~np.isfinite(t))
    return out


def staging_dtype(output: torch.dtype | None, sources: set[np.dtype]) -> torch.dtype | None:
    """The dtype a batch is assembled in on the host before it is copied to the GPU and cast there.

    The source dtype when all sources of the batch share one that is narrower than the output (a
    uint16 batch crosses PCIe in half the bytes of float32), else the output dtype (cast on the host).
    Only integer and bool sources of at most 2 bytes are staged: float32 represents them exactly, so
    the device cast rounds once, as the host cast does, and the batch has the same bits either way (into
    "i32"/"i64" the device's widening is exact, and no value of them can be out of range; wider integer
    sources are cast, and checked, on the host).
    ``None`` for ``output=None`` ("native"): the batch is the source dtype either way.
    """
    if output is None or len(sources) != 1:
        return output
    (source,) = sources
    if not source.isnative and source.itemsize > 1:
        return output
    try:
        narrow = torch_dtype_of(source)
    except TypeError:
        return output
    # Integers and bool only: torch's float16 -> float32 quiets signalling NaNs where numpy keeps them.
    if narrow.itemsize < output.itemsize and not narrow.is_floating_point and narrow.itemsize <= 2:
        return narrow
    return output
