"""The built-in value transforms: Normalize (per channel) and FillNaN, both in place, on a batch tensor or,
with ``field=``, on one field of a dict batch."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgument

_HALF = (torch.float16, torch.bfloat16)


def _check_field(who: str, field: Any) -> str | None:
    if field is not None and not isinstance(field, str):
        raise InvalidArgument(f"{who}: field must be a field name (str) or None, got {field!r}", knob="field")
    return field


def _target(who: str, field: str | None, batch: Any) -> torch.Tensor:
    """The tensor ``who`` acts on: the batch, or its field ``field`` (typed errors when they do not match)."""
    if isinstance(batch, Mapping):
        if field is None:
            raise InvalidArgument(f"{who} got a batch of fields {sorted(batch)}; say which one it acts on with "
                                  f"field=, e.g. {who}(..., field={next(iter(batch), 'raw')!r})", knob="field")
        if field not in batch:
            raise InvalidArgument(f"{who}: the batch has no field {field!r}; its fields are {sorted(batch)}",
                                  knob="field")
        return batch[field]
    if field is not None:
        raise InvalidArgument(f"{who}: field={field!r} names a field, but the batch is a single tensor, not a dict "
                              "of fields; leave field out (None)", knob="field")
    return batch


def _per_channel(name: str, values: Any) -> torch.Tensor:
    try:
        t = torch.as_tensor(values, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise InvalidArgument(f"Normalize: {name} must be a number or a sequence of numbers (one per channel), "
                              f"got {values!r}") from None
    if t.dim() > 1 or t.numel() == 0:
        raise InvalidArgument(f"Normalize: {name} must be a number or a 1-d sequence (one per channel), got shape "
                              f"{tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise InvalidArgument(f"Normalize: {name} must be finite, got {t.tolist()}")
    return t


def _check_axis(axis: Any) -> int:
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or axis == 0:
        raise InvalidArgument(f"Normalize: axis must be the batch axis that holds the channels, an int other than 0 "
                              f"(the batch's samples; negative counts from the end), got {axis!r}", knob="axis")
    return int(axis)


class Normalize:
    """``(x - mean) / std`` per channel, in place, in the batch's dtype; a 16-bit tensor (a field of a dict
    batch, or ``dtype='native'``) in float32, rounded once (a float16 result past 65504: InvalidArgument).

    ``mean`` and ``std`` are numbers (every element) or sequences/tensors of one value per channel, the
    channels being the batch's axis ``axis``: 1 (the default) for the ``(B, C, *box)`` batches of
    multi-array samples, -1 for the ``(B, Z, Y, X, C)`` crops of a channel-last array (negative counts from
    the end). A channel count other than the batch's there is an InvalidArgument at the first batch.
    ``std`` must be > 0. ``field`` names the field it acts on in a dict batch (``{name: tensor}``); None for
    a batch tensor. :meth:`from_stats` takes the axis from the statistics.

    >>> Normalize(mean=[280.0], std=[12.0], field="raw")   # the raw field of a dict batch, labels left alone
    >>> Normalize(mean=[0.4, 0.5, 0.6], std=[0.2, 0.2, 0.2], axis=-1)   # RGB last: (B, Y, X, 3) crops
    """

    def __init__(self, mean: Any, std: Any, field: str | None = None, axis: int = 1) -> None:
        self.field = _check_field("Normalize", field)
        self.axis = _check_axis(axis)
        self.mean = _per_channel("mean", mean)
        self.std = _per_channel("std", std)
        if self.mean.shape != self.std.shape and self.mean.dim() and self.std.dim():
            raise InvalidArgument(f"Normalize: mean has {self.mean.numel()} channels, std {self.std.numel()}")
        if not (self.std > 0).all():
            hint = ("; a std of 0 is a constant channel (or field): give it 1.0 to centre it only, as "
                    "Normalize.from_stats does" if (self.std == 0).any() else "")
            raise InvalidArgument(f"Normalize: std must be > 0 on every channel, got {self.std.tolist()}{hint}")
        # from_stats of one array's channels: the axes of that array (its crops' batch has one more), else None
        self._array_ndim: int | None = None
        self._cache: dict[tuple, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def from_stats(cls, stats: Any, shared: bool = False, **kwargs: Any) -> "Normalize":
        """From statistics with ``mean`` and ``std`` per channel: a ``FieldStats``, one field of what
        :func:`stoker.records.compute_stats` returns (channels last: ``axis=-1``), or what
        :func:`stoker.compute_stats` returns for an array (scalar, or per index of its ``channel_axis``: that
        axis of a ``(B, *box)`` batch of its crops) or a list of arrays (per channel: the batch's axis 1).
        Channels whose std is 0 (constant) are only centred, as :func:`stoker.records.normalize` does. Other
        keyword arguments go to the constructor as they are (``field=`` for one field of a dict batch;
        ``axis=`` overrides the statistics' axis).

        Statistics along an axis of one array fit the ``(B, *box)`` batches of its crops: a batch with
        another number of axes (a sample of several arrays, ``(B, A, *box)``, which they would normalise
        all alike with one array's numbers) is an InvalidArgument unless ``axis=`` is given. Scalar statistics
        of one array likewise fit the batches of its crops only: a batch of another number of axes (a field of
        several arrays stacked as channels, or an array with a channel axis) is an InvalidArgument naming the
        field and its channels, unless ``shared=True`` (one mean and std for every channel, on purpose); so is
        a batch of fewer axes (crops squeezed before Normalize, which may hold several arrays stacked):
        normalise before the squeeze, or pass ``shared=True``.

        >>> norm = Normalize.from_stats(stoker.compute_stats([["/d/c0.zarr", "/d/c1.zarr"]])[0])
        >>> norm = Normalize.from_stats(stoker.compute_stats("/d/rgb.zarr", channel_axis=-1))  # (B, Y, X, 3)
        """
        if not hasattr(stats, "mean") or not hasattr(stats, "std"):
            raise InvalidArgument(f"Normalize.from_stats takes an object with mean and std (a FieldStats of "
                                  f"compute_stats' result, one field), got {type(stats).__name__}")
        std = _per_channel("std", stats.std)
        if not isinstance(shared, (bool, np.bool_)):
            raise InvalidArgument(f"Normalize.from_stats: shared must be True or False, got {shared!r}", knob="shared")
        scalar = std.dim() == 0 and _per_channel("mean", stats.mean).dim() == 0
        if shared and not scalar:
            raise InvalidArgument(f"Normalize.from_stats(shared=True) shares one mean and std among every channel, "
                                  f"but these statistics have one per channel ({std.numel()}); leave shared out",
                                  knob="shared")
        along = getattr(stats, "channel_axis", None)
        checked = along is not None and "axis" not in kwargs  # an axis given by hand is the caller's choice
        if checked:  # only then: a subclass whose constructor takes no axis still works for the rest
            kwargs["axis"] = along
        norm = cls(stats.mean, torch.where(std > 0, std, torch.ones_like(std)), **kwargs)
        if checked or (scalar and not shared):  # scalar: checked against the batch at the first call
            norm._array_ndim = getattr(stats, "ndim", None)
        return norm

    @property
    def channels(self) -> int | None:
        """Channels it expects, or None for scalars (any batch)."""
        n = max(self.mean.dim() and self.mean.numel(), self.std.dim() and self.std.numel())
        return n or None

    def _scale(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        key = (x.device, dtype, x.dim())
        held = self._cache.get(key)
        if held is None:
            shape: tuple[int, ...] = ()
            if self.channels:  # one value per channel along self.axis (checked to exist by __call__)
                shape = tuple(-1 if a == self.axis % x.dim() else 1 for a in range(x.dim()))
            held = self._cache[key] = tuple(v.to(dtype=dtype).reshape(shape).to(x.device)
                                            for v in (self.mean, self.std))
        return held

    def __call__(self, batch: Any) -> Any:
        x = _target("Normalize", self.field, batch)
        where = "" if self.field is None else f"field {self.field!r} of "
        if not x.is_floating_point():
            raise InvalidArgument(f"Normalize needs a floating batch, got {x.dtype} for {where}the batch; use "
                                  "Config(dtype='f32', 'bf16' or 'f16')", knob="transform")
        c = self.channels
        if c is not None:
            self._check_channels(x, c, where)
        elif self._array_ndim is not None:
            self._check_one_array(x, self._array_ndim, where)
        if x.dtype not in _HALF:
            mean, std = self._scale(x, x.dtype)
            x.sub_(mean).div_(std)
            return batch
        # a 16-bit tensor (a field of a dict batch, or dtype='native'; a batch tensor is made in float32): in
        # float32, rounded once. In its own dtype the mean itself was rounded (283.7 to 284 in bfloat16), and
        # every value came out shifted by the same amount, a bias rather than noise
        mean, std = self._scale(x, torch.float32)
        y = x.float().sub_(mean).div_(std)
        if x.dtype == torch.float16:
            most = torch.finfo(torch.float16).max
            if bool(((y.abs() > most) & torch.isfinite(y)).any()):
                raise InvalidArgument(
                    f"{self!r}: {where}the batch is torch.float16, whose largest finite value is {most:g}, and "
                    "normalised values pass it (they would be infinities); check mean and std, or ask for "
                    "'bf16' or 'f32' for it", knob="transform")
        x.copy_(y)
        return batch

    def _check_one_array(self, x: torch.Tensor, n: int, where: str) -> None:
        """A typed error unless ``x`` is a batch of crops of an array of ``n`` axes (or of a list of one such
        array), which scalar statistics of one array of ``n`` axes fit: another batch has channels (several
        arrays stacked, or a channel axis of another array) that one array's mean and std would all shift
        alike, silently. Fewer axes are refused too: the batch alone cannot tell a squeezed slice of the array
        ``(B, Z, Y, X)`` of a 4-D one from squeezed crops of several arrays stacked, ``(B, A, Y, X)``; the
        error says to normalise before the squeeze, or to pass ``shared=True``."""
        if x.dim() == n + 1 or (x.dim() == n + 2 and x.shape[1] == 1):
            return
        if x.dim() < n + 1:
            raise InvalidArgument(
                f"Normalize.from_stats has one mean and std ({self.mean.item():.6g}, {self.std.item():.6g}) of one "
                f"array of {n} axes, which fit a batch of its crops, (B, *box) with {n + 1} axes; {where}the batch "
                f"has shape {tuple(x.shape)}, fewer axes: squeezed crops, which may be slices of that one array or "
                "crops of several arrays stacked as channels (each of which would be normalised with that one "
                "array's statistics), and the batch does not say which. Put Normalize before the transform that "
                "squeezes the crops (it then sees (B, *box)), or pass shared=True to from_stats to normalise "
                "the whole batch with these statistics on purpose",
                knob="transform", field=self.field)
        channels = (f"{x.shape[1]} channels on axis 1 (several arrays stacked as channels, or an array with a "
                    "channel axis)" if x.dim() == n + 2 else
                    f"{x.dim() - 1} axes per sample (an array of another rank, or with channel axes)")
        raise InvalidArgument(
            f"Normalize.from_stats has one mean and std ({self.mean.item():.6g}, {self.std.item():.6g}) of one array "
            f"of {n} axes, which fit a batch of its crops, (B, *box) with {n + 1} axes; {where}the batch has shape "
            f"{tuple(x.shape)}: {channels}, which would all be normalised with that one array's statistics. Give "
            "statistics per channel: stoker.compute_stats of the field (or of its arrays as a list, [[a, b, ...]]: "
            "one mean and std per array), or compute_stats(uri, channel_axis=k) for an array with a channel axis; "
            "or pass shared=True to from_stats to normalise every channel alike on purpose",
            knob="transform", field=self.field, channels=x.shape[1] if x.dim() == n + 2 else None)

    def _check_channels(self, x: torch.Tensor, c: int, where: str) -> None:
        """A typed error unless ``x`` holds ``c`` channels on ``self.axis`` (and, from one array's statistics,
        has the axes of a batch of its crops): a batch axis that merely has ``c`` entries is no proof."""
        n, axis = self._array_ndim, self.axis
        if n is not None and x.dim() != n + 1:
            several = (f" (B, A, *box): samples of several arrays, which one array's statistics would all "
                       f"normalise alike; pass axis={axis} to from_stats to do that anyway, or compute the "
                       "statistics of the arrays as a list (one channel each)" if x.dim() == n + 2 else "")
            raise InvalidArgument(
                f"Normalize.from_stats has statistics of one array of {n} axes, per channel along its axis {axis}, "
                f"which fit a batch of its crops, (B, *box) with {n + 1} axes; {where}the batch has shape "
                f"{tuple(x.shape)}{several}", knob="transform")
        if not (-x.dim() <= axis < x.dim()) or axis % x.dim() == 0 or x.shape[axis] != c:
            have = (f"has {x.shape[axis]} channels on axis {axis}" if -x.dim() <= axis < x.dim() and axis % x.dim()
                    else f"has no axis {axis} (besides the samples' axis 0)")
            raise InvalidArgument(
                f"Normalize has {c} channels (mean {self.mean.tolist()}, std {self.std.tolist()}) but {where}the "
                f"batch of shape {tuple(x.shape)} {have}; give one mean and std per channel (per array of the "
                "samples on axis 1), or the batch axis that holds them with axis=", knob="transform")

    def __getstate__(self) -> dict:
        return {"mean": self.mean, "std": self.std, "field": self.field, "axis": self.axis,
                "_array_ndim": self._array_ndim, "_cache": {}}

    def __setstate__(self, state: dict) -> None:
        # pickled before field= and axis= existed: the batch tensor, channels on axis 1
        self.__dict__.update({"field": None, "axis": 1, "_array_ndim": None, **state})

    def __repr__(self) -> str:
        field = "" if self.field is None else f", field={self.field!r}"
        axis = "" if self.axis == 1 else f", axis={self.axis}"
        return f"Normalize(mean={self.mean.tolist()}, std={self.std.tolist()}{field}{axis})"


class FillNaN:
    """Replace NaN with ``value``, in place (infinities stay). Batches of integer dtypes have no NaN: as is.
    A finite ``value`` past the batch's float dtype (-99999.0 in a float16 field) is an InvalidArgument, never
    an infinity. ``field`` names the field it acts on in a dict batch; None for a batch tensor.

    >>> FillNaN(0.0, field="raw")
    """

    def __init__(self, value: float = 0.0, field: str | None = None) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise InvalidArgument(f"FillNaN: value must be a number other than NaN, got {value!r}")
        self.value = float(value)
        self.field = _check_field("FillNaN", field)

    def __call__(self, batch: Any) -> Any:
        x = _target("FillNaN", self.field, batch)
        if x.is_floating_point():
            most = torch.finfo(x.dtype).max
            if math.isfinite(self.value) and abs(self.value) > most:
                # float16 rounds it to an infinity: the NaN would become a value the data never held
                where = "" if self.field is None else f"field {self.field!r} of "
                raise InvalidArgument(
                    f"{self!r}: {where}the batch is {x.dtype}, whose largest finite value is {most:g}, so the fill "
                    "would be an infinity; fill with a value it holds, or ask for 'f32' for it", knob="transform")
            x.nan_to_num_(nan=self.value, posinf=math.inf, neginf=-math.inf)
        return batch

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"field": None, **state})

    def __repr__(self) -> str:
        return f"FillNaN({self.value!r}{'' if self.field is None else f', field={self.field!r}'})"
