"""CF decoding of a batch (``Config(cf=True)``, the default): each row decoded as its array's attributes say.

A batch's rows (``b * C + c``: sample ``b``, channel ``c``) may each come from another array, and the plan
knows which; :func:`row_decoder` makes the batch's decoder from it, which the job's completion hook runs
on the batch in its slot after the cast to the float output and before ``Config.transform`` (on a CUDA
device on the side stream, after the cast there; in the GPU-decode executor on its stream, once the batch is
placed and padded). Per run of rows of one coding (a piece of at most
:data:`PIECE_ELEMENTS` at a time): values equal to a fill become NaN (compared in the batch's float dtype,
exact for 8- and 16-bit integer and float32 sources), and ``x * scale_factor + add_offset`` is computed in
float64 and rounded once to the batch's dtype, as xarray computes it (the attributes of a Zarr array are
float64; a finite result past the batch's dtype is refused, never inf: :meth:`RowDecode.error`), so a float32 batch equals xarray's values cast to float32 (in ``CFCoding.arithmetic``: a float32
or float16 variable whose fills are all NaN is scaled in its own dtype, as xarray does). Packed arrays whose stored values float32
does not hold (:func:`needs_float64`) are decoded in float64 work slots (the CPU executor's) and rounded into the
output after (:func:`~stoker.engine.rounding.round_into`), else refused (:func:`check_output`); so are arrays
of such dtypes with fills (:func:`masks_wide`: their fills compared exactly) on the CPU executor. The other
executors compare those in float32 (a value within one float32 rounding of a fill is masked too).
A float32 work slot of an ``"f16"`` batch without a transform takes the float64 results as float32 values
whose rounding into float16 after is the float64 value's one rounding, as NumPy casts it (:func:`round_to_odd_`;
rounded to nearest twice, 281.125001 went to 281.0 instead of 281.25).

>>> decode = row_decoder(plan, cf=True)     # None: nothing to decode in this batch
>>> decode(batch)                           # in place
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...errors import DtypeMismatch
from ...reader.array import ArrayReader
from ..cast import half_exact
from ..rounding import RoundingProbe, fits, value_bound
from ...reader.coords import coding
from ...sampling.sample import parts
from ...zarr.cf import CFCoding

#: Elements decoded through one float64 temporary at most (32 MiB of it).
PIECE_ELEMENTS = 1 << 22
_ARITHMETIC = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16}


class RowDecode:
    """The CF decoding of one batch: ``runs`` of consecutive rows ``[start, stop)`` of one coding, each with the
    bound of its decoded values (:func:`~stoker.engine.rounding.value_bound`: a run whose values the batch's
    dtype holds is not checked)."""

    def __init__(self, runs: list[tuple[int, int, CFCoding, float]], channels: int | None,
                 odd: bool = False) -> None:
        self.runs = runs
        self.channels = channels
        self.odd = odd  # the batch is rounded to float16 after: float64 results go in as round_to_odd_ says
        self.probes: list[RoundingProbe] = []  # the last call's checks of its float64 results' rounding

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        flat = out.flatten(0, 1) if self.channels is not None else out
        rows = flat.view(flat.shape[0], -1)  # a view: the slot is contiguous
        per_piece = max(1, PIECE_ELEMENTS // max(1, rows.shape[1]))
        self.probes = []
        for start, stop, code, bound in self.runs:
            for a in range(start, min(stop, rows.shape[0]), per_piece):
                probe = decode_(rows[a:min(stop, a + per_piece)], code, a, bound, self.odd)
                if probe is not None:
                    self.probes.append(probe)
        return out

    def error(self, plan) -> DtypeMismatch | None:
        """The DtypeMismatch of the first value the last call decoded finite, in float64, and its batch's dtype
        holds as inf (past float32's largest: an int16 of 30000 with scale_factor 1e35), else None. On a device,
        read it only once the stream is past the decoding (the batch's event)."""
        for probe in self.probes:
            error = probe.error(plan)
            if error is not None:
                return error
        return None

    def then(self, transform):
        """This decoding, then ``transform`` (None: nothing), as one transform, keyed (it passes a batch's keys
        on to ``transform`` when that takes them)."""
        if transform is None:
            return self
        from ...transforms import Keyed, apply

        decode = self

        class DecodeThen(Keyed):
            def __call__(self, x, keys=None):
                return apply(transform, decode(x), keys)

        return DecodeThen()


def decode_(v: torch.Tensor, code: CFCoding, first_row: int = 0, bound: float = float("inf"),
            odd: bool = False) -> RoundingProbe | None:
    """Decode ``v`` (floating; rows from the batch's ``first_row``) in place; the check of its rounding from
    the float64 arithmetic (:class:`~stoker.engine.rounding.RoundingProbe`: read it after the decoding) when
    there is one: none when ``v``'s dtype holds every value of magnitude ``bound`` (the decoded values'
    :func:`~stoker.engine.rounding.value_bound`; inf: unknown), as for int16 packed with scale_factor 0.01.
    ``odd``: a float32 ``v`` is rounded to float16 next (:func:`round_to_odd_`)."""
    mask, t = None, None
    for fill in code.fills:
        hit = v == fill  # in v's dtype, as numpy compares an array with a Python float
        mask = hit if mask is None else mask | hit
    if code.scale is not None or code.offset is not None:
        work = _ARITHMETIC[code.arithmetic]
        t = v.to(work)
        # the attributes in the arithmetic's dtype first, as numpy takes a Python float into a float32 array's
        # product: torch would multiply a half by the float32 of it instead
        if code.scale is not None:
            t.mul_(float(np.dtype(code.arithmetic).type(code.scale)))
        if code.offset is not None:
            t.add_(float(np.dtype(code.arithmetic).type(code.offset)))
        v.copy_(t)
        if odd and v.dtype == torch.float32 and t.dtype == torch.float64:
            round_to_odd_(v, t)
    if mask is not None:
        v.masked_fill_(mask, float("nan"))
    if t is not None and t.dtype != v.dtype and not fits(bound, v.dtype):  # a finite float64 result past v's
        # dtype is inf there: checked (on a device, its reductions and the wait for them: only where it can be)
        return RoundingProbe(v, t, None, first_row, "after CF decoding")  # (after the mask: NaN is no inf)
    return None


def round_to_odd_(v: torch.Tensor, t: torch.Tensor) -> None:
    """``v`` (float32, ``t`` rounded to nearest) becomes a float32 whose rounding to float16 is ``t``'s one
    rounding to nearest (rounded to nearest twice, a ``t`` just past a float16 tie that float32 rounds onto the
    tie went to even, the wrong way). On a device: ``t`` rounded to odd, the one of its two float32 neighbours
    whose last bit is 1 where ``t`` is not a float32 (float16 keeps 13 bits fewer, so rounding that to nearest
    is rounding ``t`` once), queued on the stream with no test on the host. On the CPU ``t``'s float16 itself
    (NumPy's cast, a third of the cost of the rounding to odd there), except where that is inf and ``t`` is
    finite: ``v`` keeps ``t``'s float32 there, so the rounding's check after names the value. NaN stays NaN."""
    if v.device.type == "cpu":
        half_exact(t.numpy(), out=v.numpy())
        return
    to_odd_(v, t)


def to_odd_(v: torch.Tensor, t: torch.Tensor) -> None:
    """``v`` (float32, ``t`` rounded to nearest) becomes ``t`` rounded to odd (:func:`round_to_odd_`, a device's
    way), on ``v``'s device with no test on the host."""
    near = v.double()
    moved = (near != t) & ((v.view(torch.int32) & 1) == 0) & torch.isfinite(v)
    toward = torch.where(t > near, float("inf"), float("-inf")).to(v.dtype)
    v.copy_(torch.where(moved, torch.nextafter(v, toward), v))


def row_decoder(sources: Sequence[ArrayReader], samples, channels: int | None, cf: bool,
                into: torch.dtype | None = None) -> RowDecode | None:
    """The decoder of a batch of ``samples`` planned over ``sources`` (a plan's: in the order of their first
    crop), or None when ``cf`` is off or no row has a coding. ``into``: the dtype the decoded batch is rounded
    to next, untransformed (None: unknown, or transformed first); float16 makes its float32 results odd."""
    if not cf:
        return None
    codes = [coding(r) for r in sources]
    if not any(c is not None for c in codes):
        return None
    bounds = [value_bound(r.dtype, c) for r, c in zip(sources, codes)]
    order: dict[str, int] = {}
    runs: list[tuple[int, int, CFCoding, float]] = []
    for row, (uri, _) in enumerate(parts(samples)):
        at = order.setdefault(uri, len(order))
        code, bound = codes[at], bounds[at]
        if code is None:
            continue
        if runs and runs[-1][1] == row and runs[-1][2] == code and runs[-1][3] == bound:
            runs[-1] = (runs[-1][0], row + 1, code, bound)
        else:
            runs.append((row, row + 1, code, bound))
    return RowDecode(runs, channels, odd=into == torch.float16)


def plan_decoder(plan, cf: bool, into: torch.dtype | None = None) -> RowDecode | None:
    """:func:`row_decoder` of a :class:`~stoker.engine.planning.tables.TablePlan`."""
    return row_decoder(plan.sources, plan.samples, plan.channels, cf, into)


def packed(reader: ArrayReader) -> bool:
    """True when ``reader``'s array has a ``scale_factor`` or ``add_offset``: its decoded values are floats
    computed from the stored ones (so the label-id rule of 32- and 64-bit integers does not apply)."""
    code = coding(reader)
    return code is not None and (code.scale is not None or code.offset is not None)


def _wide(dt: np.dtype) -> bool:
    """Whether float32 does not hold every value of ``dt`` (32- and 64-bit integers, float64)."""
    return dt.kind in "iu" and dt.itemsize >= 4 or dt.kind == "f" and dt.itemsize > 4


def needs_float64(reader: ArrayReader) -> bool:
    """True when ``reader``'s array is :func:`packed` and float32 does not hold its stored values exactly (32-
    and 64-bit integers, float64): it is decoded right only from the stored values, in float64."""
    return _wide(reader.dtype) and packed(reader)


def masks_wide(reader: ArrayReader) -> bool:
    """True when ``reader``'s array has fill values (``_FillValue``, ``missing_value``) and float32 does not hold
    its stored values exactly: compared in float32, a value one rounding from a fill would be masked too (a
    float64 -9999.0000001 next to the fill -9999.0), or a fill missed; float64 compares them as xarray does
    (exactly, for integers up to 2**53), so the CPU executor decodes such arrays in float64 work slots."""
    code = coding(reader)
    return code is not None and bool(code.fills) and _wide(reader.dtype)


def rounds_once(reader: ArrayReader, half_next: bool) -> bool:
    """Whether ``reader``'s float64 values (and fill value) go into a float32 work slot rounded into float16 next
    (``half_next``, :attr:`~stoker.engine.executor.Job.half_next`) as :func:`~stoker.engine.cast.half_exact`
    says, so that batch holds their one rounding: every array but one with fill values float32 does not hold
    exactly (:func:`masks_wide`), whose values are compared with its fills after placing (in float32 on the
    executors without float64 work): pre-rounded, -9999.0 became -10000.0 and no longer matched its fill
    (-9999.0), so missing values came out as numbers. Such an array keeps its float32 rounding (rounded twice
    into ``"f16"``, one float16 step off at some ties; ``device="cpu"`` decodes it in float64, rounded once)."""
    return half_next and not masks_wide(reader)


def check_output(readers: Sequence[ArrayReader], dtype: torch.dtype, work: torch.dtype, cf: bool,
                 exact: bool = False) -> None:
    """DtypeMismatch when arrays with CF attributes would be read into a batch that cannot hold decoded values
    (an integer dtype: ``dtype='native'`` of an integer array), or decoded in a 16-bit ``work`` dtype, or a
    packed array float32 does not hold exactly (:func:`needs_float64`) decoded in a float32 one; ``exact``
    (an executor with float64 work slots, whose first batch read none of them): an array with fills float32
    does not hold exactly (:func:`masks_wide`) too."""
    if not cf:
        return
    coded = [(r.uri, c) for r in readers if (c := coding(r)) is not None]
    if not coded:
        return
    uri, code = coded[0]
    if not dtype.is_floating_point:
        raise DtypeMismatch(
            f"{uri}: its CF attributes ({code.describe()}) make its values floats (as xarray decodes them), but the "
            f"batch dtype is {dtype}; ask for a float dtype (Config(dtype='f32')), or read the stored values with "
            "Config(cf=False)", uri=uri, knob="cf")
    if work.itemsize < 4:
        raise DtypeMismatch(
            f"{uri}: its CF attributes ({code.describe()}) would be decoded in {work}, which loses the values (a "
            "16-bit output is decoded in float32 work buffers when the pipeline's first batch reads such an array, "
            "and rounded once after); ask for Config(dtype='f32'), put such an array in the first batch, or read the "
            "stored values with Config(cf=False)", uri=uri, knob="cf")
    wide = [r for r in readers if needs_float64(r) or exact and masks_wide(r)] if work.itemsize < 8 else []
    if wide and not packed(wide[0]):
        r = wide[0]
        raise DtypeMismatch(
            f"{r.uri}: its fill values ({coding(r).describe()}) are compared with its stored {r.dtype} values by "
            f"xarray, but this batch would compare their {work} rounding, which masks values next to a fill too; "
            "put such an array in the pipeline's first batch (the CPU executor then decodes in float64 work "
            "slots), or read the stored values with Config(cf=False)", uri=r.uri, knob="cf")
    if wide:
        r = wide[0]
        raise DtypeMismatch(
            f"{r.uri}: its CF attributes ({coding(r).describe()}) are applied in float64 to its stored {r.dtype} "
            f"values by xarray, but this batch would decode them from their {work} rounding, which is off by far "
            "more than one rounding where add_offset cancels most of the value; make the batches on the CPU "
            "(Config(device='cpu'), which decodes such arrays in float64 work slots when the pipeline's first "
            "batch reads one), or read the stored values with Config(cf=False)", uri=r.uri, knob="cf")
