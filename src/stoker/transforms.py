"""Batch transforms: ``Config(transform=...)`` runs one on every batch, on the batch's device, before the
consumer sees it.

>>> from stoker.transforms import FillNaN, Normalize
>>> cfg = stoker.Config(batch_size=8, dtype="f32",
...                     transform=[FillNaN(0.0), Normalize(mean=[280.0, 0.0, 0.0], std=[12.0, 5.0, 5.0])])

A transform is any callable ``batch -> batch`` on a tensor of shape ``(B, *sample_shape)`` (``(B, C, *box)``
for samples of several arrays). It runs after the cast to the output dtype, in the batch's slot: on the CPU
on the pipeline thread that finished the batch, on a GPU on the pipeline's side stream before the event the
consumer waits on. With ``dtype='bf16'`` or ``'f16'`` the batch is made and transformed in float32 and
rounded to the 16-bit output once, after the transform (a float32 work slot per batch in flight, counted
in ``host_buffer_bytes``; on a GPU a float32 work buffer in ``device_buffer_bytes``), so ``Normalize`` near
a large mean loses nothing to an early rounding.

It should work in place and return its argument (the built-ins do: no extra batch-sized buffer); a new
tensor of the batch's shape, dtype and device it returns is copied back into the slot (one batch copy); any
other result (another shape, dtype or device: never cast back silently) is an
:class:`~stoker.errors.InvalidArgument` naming the transform. Its errors reach the consumer at ``pop``, like
a read error of that batch.

On the CPU, transforms of different batches may run at the same time on several pipeline threads, in no
particular batch order: a transform must be thread-safe, and one that draws random numbers should not
rely on the order of its calls. The built-ins are both.

Its time is the ``transform`` stage of ``Pipeline.stats()``: on the CPU the transform and the rounding to
a 16-bit output; on a GPU the time to enqueue it (the kernels run on the side stream, with the copy).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from .errors import InvalidArgument

Transform = Callable[[torch.Tensor], Any]


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


class Normalize:
    """``(x - mean) / std`` per channel, in place, in the batch's dtype.

    ``mean`` and ``std`` are numbers (every element) or sequences/tensors of one value per channel: the
    batch's axis 1, i.e. ``(B, C, *box)`` batches of multi-array samples. A channel count other than the
    batch's is an InvalidArgument at the first batch. ``std`` must be > 0.
    """

    def __init__(self, mean: Any, std: Any) -> None:
        self.mean = _per_channel("mean", mean)
        self.std = _per_channel("std", std)
        if self.mean.shape != self.std.shape and self.mean.dim() and self.std.dim():
            raise InvalidArgument(f"Normalize: mean has {self.mean.numel()} channels, std {self.std.numel()}")
        if not (self.std > 0).all():
            raise InvalidArgument(f"Normalize: std must be > 0 on every channel, got {self.std.tolist()}")
        self._cache: dict[tuple, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def from_stats(cls, stats: Any) -> "Normalize":
        """From statistics with ``mean`` and ``std`` per channel, e.g. one field of what
        :func:`stoker.records.compute_stats` returns (a ``FieldStats``). Channels whose std is 0 (constant)
        are only centred, as :func:`stoker.records.normalize` does."""
        if not hasattr(stats, "mean") or not hasattr(stats, "std"):
            raise InvalidArgument(f"Normalize.from_stats takes an object with mean and std (a FieldStats of "
                                  f"compute_stats' result, one field), got {type(stats).__name__}")
        std = _per_channel("std", stats.std)
        return cls(stats.mean, torch.where(std > 0, std, torch.ones_like(std)))

    @property
    def channels(self) -> int | None:
        """Channels it expects, or None for scalars (any batch)."""
        n = max(self.mean.dim() and self.mean.numel(), self.std.dim() and self.std.numel())
        return n or None

    def _scale(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = (x.device, x.dtype, x.dim())
        held = self._cache.get(key)
        if held is None:
            shape = (1, -1) + (1,) * (x.dim() - 2) if self.channels else ()
            held = self._cache[key] = tuple(v.to(dtype=x.dtype).reshape(shape).to(x.device)
                                            for v in (self.mean, self.std))
        return held

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            raise InvalidArgument(f"Normalize needs a floating batch, got {x.dtype}; use Config(dtype='f32', 'bf16' "
                                  "or 'f16')", knob="transform")
        c = self.channels
        if c is not None and (x.dim() < 2 or x.shape[1] != c):
            have = f"{x.shape[1]} channels" if x.dim() >= 2 else "no channel axis"
            raise InvalidArgument(
                f"Normalize has {c} channels (mean {self.mean.tolist()}, std {self.std.tolist()}) but the batch of "
                f"shape {tuple(x.shape)} has {have} on axis 1; give one mean and std per array of the samples",
                knob="transform")
        mean, std = self._scale(x)
        return x.sub_(mean).div_(std)

    def __getstate__(self) -> dict:
        return {"mean": self.mean, "std": self.std, "_cache": {}}

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.tolist()}, std={self.std.tolist()})"


class FillNaN:
    """Replace NaN with ``value``, in place (infinities stay). Batches of integer dtypes have no NaN: as is."""

    def __init__(self, value: float = 0.0) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise InvalidArgument(f"FillNaN: value must be a number other than NaN, got {value!r}")
        self.value = float(value)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        return x.nan_to_num_(nan=self.value, posinf=math.inf, neginf=-math.inf)

    def __repr__(self) -> str:
        return f"FillNaN({self.value!r})"


class Compose:
    """Several transforms, applied in order (``Config(transform=[a, b])`` makes one)."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = tuple(transforms)
        for t in self.transforms:
            if not callable(t):
                raise InvalidArgument(f"a transform must be callable (batch -> batch), got {t!r}", knob="transform")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for t in self.transforms:
            x = apply(t, x)
        return x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compose) and self.transforms == other.transforms

    def __hash__(self) -> int:
        return hash(self.transforms)

    def __repr__(self) -> str:
        return f"Compose({list(self.transforms)!r})"


def as_transform(value: Any) -> Transform | None:
    """What ``Config(transform=...)`` keeps: None, a callable, or a Compose of a list of callables."""
    if value is None or isinstance(value, Compose):
        return value
    if isinstance(value, (list, tuple)):
        return Compose(value)
    if not callable(value):
        raise InvalidArgument(f"Config.transform must be a callable (batch -> batch), a list of them or None, got "
                              f"{value!r}", knob="transform")
    return value


def apply(transform: Transform, out: torch.Tensor) -> torch.Tensor:
    """Run ``transform`` on the batch ``out``, leaving the result in ``out`` (see the module docstring)."""
    result = transform(out)
    if result is None or result is out:
        return out
    if not isinstance(result, torch.Tensor) or result.shape != out.shape:
        what = f"shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else type(result).__name__
        raise InvalidArgument(f"transform {transform!r} returned {what}; it must return the batch (shape "
                              f"{tuple(out.shape)}), best modified in place", knob="transform")
    if result.dtype != out.dtype or result.device != out.device:
        # copying it back would cast silently (an int16 batch divided by 1000.0 truncated to 0 and 1)
        raise InvalidArgument(
            f"transform {transform!r} returned a {result.dtype} tensor on {result.device} for a batch of "
            f"{out.dtype} on {out.device}; a transform keeps the batch's dtype and device. Return a tensor of "
            f"the batch's dtype (best: modify the batch in place), or ask for floating batches with "
            "Config(dtype='f32')", knob="transform")
    if result.data_ptr() != out.data_ptr() or result.stride() != out.stride():
        out.copy_(result)
    return out
