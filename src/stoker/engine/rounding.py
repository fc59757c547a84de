"""The one rounding of a work buffer into a 16-bit batch, checked: a finite value there that the output holds
as inf (decoded by CF attributes, or transformed, past its largest finite value) is a
:class:`~stoker.errors.DtypeMismatch` naming the array, the chunk and the sample's box, never an inf the data
did not hold. Every executor that computes in a work buffer rounds through here: the CPU executor's float64
and float32 work slots (:func:`round_into`, at once), the CUDA transfer's and the GPU-decode executor's
float32 device work buffers (:class:`RoundingProbe`: its reductions are queued on the stream after the
rounding and copied to pinned host memory, and read once the batch's event is done; the GPU-decode
executor's submitter looks at that event between waves, and waits for it only with nothing to queue; the CUDA
executor's compute thread waits for it).

No probe is made where no value can reach inf, decided from the metadata alone: :func:`value_bound` (the
stored dtype's range through the CF coding, ``|scale| * max|stored| + |offset|`` with a margin for float64's
roundings), :func:`batch_bound` over a plan's arrays, :func:`fits` under the output's
:data:`~stoker.engine.cast.OVERFLOW_AT`. So the CF decoding of the usual packed int16 (scale_factor 0.01) is
never checked, nor is the 16-bit rounding of a work buffer without a transform whose arrays' bounds fit;
with a transform the bound is unknown, and the probe stays.

>>> probe = RoundingProbe(out, work, channels=None)   # queued on the current stream, after out.copy_(work)
>>> probe.error(plan)                                 # after the batch's event: None, or the DtypeMismatch
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from .cast import OVERFLOW_AT, range_error
from ..reader.coords import coding
from ..sampling.sample import parts

if TYPE_CHECKING:
    from ..errors import DtypeMismatch
    from ..zarr.cf import CFCoding

#: Elements looked at by one step of the check at most (its temporaries: a mask and a copy of that many).
PIECE_ELEMENTS = 1 << 22
#: What made the values the output cannot hold, in its messages.
CAUSE = "after CF decoding or the transform"
#: Relative room a bound leaves for the roundings of the float64 arithmetic (far more than its two add).
MARGIN = 1e-6


def value_bound(stored: np.dtype, code: CFCoding | None = None) -> float:
    """The largest magnitude of a finite value that an array of ``stored`` dtype puts in a batch, decoded by
    its CF ``code`` (None: as stored): ``|scale| * max|stored| + |offset|`` with a little room for the float64
    arithmetic's roundings (fills and padding are stored values too); inf when unknown (another kind).

    >>> value_bound(np.dtype("int16"), CFCoding(0.01, 280.0, ()))    # 327.68 + 280, and a margin
    607.6806...
    """
    dt = np.dtype(stored)
    if dt.kind == "b":
        most = 1.0
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        most = float(max(-int(info.min), int(info.max)))
    elif dt.kind == "f":
        most = float(np.finfo(dt).max)
    else:
        return math.inf
    if code is None:
        return most
    scale = 1.0 if code.scale is None else abs(code.scale)
    bound = (scale * most + abs(code.offset or 0.0)) * (1 + MARGIN)
    # (float32 or float16 arithmetic: its finite results are that dtype's at most)
    return min(bound, float(np.finfo(np.dtype(code.arithmetic)).max))


def batch_bound(sources, cf: bool) -> float:
    """:func:`value_bound` of every array of a plan's ``sources`` (CF-decoded when ``cf``): what its batch
    holds before a transform."""
    return max((value_bound(r.dtype, coding(r) if cf else None) for r in sources), default=0.0)


def needs_probe(plan, cfg, dtype: torch.dtype) -> bool:
    """Whether the rounding of ``plan``'s work buffer into a batch of ``dtype`` must be checked
    (:class:`RoundingProbe`): with ``cfg.transform`` (its values unbounded), or where the plan's arrays,
    CF-decoded when ``cfg.cf``, may hold a value past ``dtype`` (:func:`batch_bound`, :func:`fits`)."""
    return cfg.transform is not None or not fits(batch_bound(plan.sources, cfg.cf), dtype)


def fits(bound: float, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds every finite value of magnitude ``bound`` at most as a finite value: then no
    :class:`RoundingProbe` of a rounding into it is needed (a NaN bound: unknown, it does not fit)."""
    return dtype not in OVERFLOW_AT or bound < OVERFLOW_AT[dtype]


class RoundingProbe:
    """Which crops of a batch hold a finite value of ``work`` that ``out`` (its rounding, written already) holds
    as inf, where the first of each is, and each crop's (min, max) of them: reductions queued on ``work``'s device
    (on the current stream), read by :meth:`error` once they are done. ``channels``: the plan's (rows are
    crops ``b * C + c``, as in :class:`~stoker.engine.cpu.cf.RowDecode`); ``offset``: the batch's crop that
    ``out``'s first is (a piece of it); ``cause``: what made the values, for the message."""

    def __init__(self, out: torch.Tensor, work: torch.Tensor, channels: int | None, offset: int = 0,
                 cause: str = CAUSE) -> None:
        self.dtype, self.offset, self.cause = out.dtype, offset, cause
        self.hit: torch.Tensor | None = None
        if out.dtype not in OVERFLOW_AT or out.dtype == work.dtype:  # no rounding to inf (or none at all)
            return
        if out.device.type == "cpu" and not bool(torch.isinf(out).any()):  # (the usual batch: one look; on a
            return  # device that look would wait for the stream, so the reductions are queued instead)
        flat_o = out.flatten(0, 1) if channels is not None else out
        flat_w = work.flatten(0, 1) if channels is not None else work
        crops = flat_w.shape[0]
        o, w = flat_o.reshape(crops, -1), flat_w.reshape(crops, -1)
        dev = work.device
        self.hit = torch.zeros(crops, dtype=torch.bool, device=dev)
        self.first = torch.zeros(crops, dtype=torch.int64, device=dev)
        self.lo = torch.empty(crops, dtype=work.dtype, device=dev)
        self.hi = torch.empty(crops, dtype=work.dtype, device=dev)
        per = max(1, PIECE_ELEMENTS // max(1, w.shape[1]))
        for a in range(0, crops, per):
            b = min(crops, a + per)
            past = torch.isinf(o[a:b]) & torch.isfinite(w[a:b])
            self.hit[a:b] = past.any(1)
            self.first[a:b] = past.to(torch.uint8).argmax(1)  # (the first of the largest: the first past)
            self.lo[a:b] = torch.where(past, w[a:b], math.inf).amin(1)
            self.hi[a:b] = torch.where(past, w[a:b], -math.inf).amax(1)
        if dev.type == "cuda":  # copied to pinned host memory behind them, so :meth:`error` reads them without
            # a copy on the current stream, which would wait for all queued on it since (the next waves)
            self.hit, self.first, self.lo, self.hi = (_to_host(t) for t in (self.hit, self.first, self.lo, self.hi))

    def error(self, plan) -> DtypeMismatch | None:
        """The DtypeMismatch of the first crop of ``plan`` (the batch's) holding such a value, else None. Reads
        the reductions: only once the stream is past them (the batch's event)."""
        if self.hit is None or not bool(self.hit.any()):
            return None
        crop = int(torch.nonzero(self.hit)[0, 0])
        lo, hi = float(self.lo[crop]), float(self.hi[crop])
        return overflow_error(plan, self.dtype, self.offset + crop, int(self.first[crop]), (lo, hi), self.cause)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``t``, queued on the current stream (read it once the stream is past it)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def round_into(dst: torch.Tensor, work: torch.Tensor, plan, checked: bool = True) -> None:
    """``dst[...] = work``: a work slot's batch (host memory) rounded once into the output (float64 into float16
    as NumPy casts it, into bfloat16 through float32: the cast rules of :mod:`~stoker.engine.cast`), then
    checked (:class:`RoundingProbe`; ``checked=False``: no value can be past the output, :func:`fits`): the
    DtypeMismatch of a value the output would hold as inf."""
    if work.dtype == torch.float64 and dst.dtype == torch.float16:
        np.copyto(dst.numpy(), work.numpy(), casting="unsafe")
    elif work.dtype == torch.float64 and dst.dtype == torch.bfloat16:
        dst.copy_(work.to(torch.float32))
    else:
        dst.copy_(work)
    if not checked:
        return
    error = RoundingProbe(dst, work, plan.channels).error(plan)
    if error is not None:
        raise error


def overflow_error(plan, dtype: torch.dtype, crop: int, at: int, span: tuple[float, float],
                   cause: str = CAUSE) -> DtypeMismatch:
    """:func:`~stoker.engine.cast.range_error` (the batch ``dtype``'s) of crop ``crop`` of ``plan`` (in the
    order of its rows, channels folded in) whose element ``at`` (flat, C order) is the first past the output's
    range (``cause``: after CF decoding or the transform): naming its array, the chunk holding that element (or
    the padding, for one past the array), the crop's box and its such values' ``span``."""
    uri, box = parts(plan.samples)[crop]
    reader = next(r for r in plan.sources if r.uri == uri)
    where = np.unravel_index(at, tuple(b - a for a, b in box))
    coord = tuple(a + int(i) for (a, _), i in zip(box, where))
    return range_error(uri, chunk_key_at(reader, coord), reader.dtype, dtype, span, cause=cause,
                       box=box)


def chunk_key_at(reader, coord: tuple[int, ...]) -> str:
    """The key of the chunk of ``reader``'s array holding element ``coord`` (an inner chunk of a shard as
    ``key[n]``, as the engine names it), or ``"padding"`` for an element past the array."""
    if any(c < 0 or c >= s for c, s in zip(coord, reader.shape)):
        return "padding"
    index = tuple(c // k for c, k in zip(coord, reader.chunks))
    meta = reader.metadata
    if meta.sharding is None:
        return meta.chunk_key(index)
    shard, inner = meta.sharding.inner_position(index)
    return f"{meta.chunk_key(shard)}[{inner}]"
