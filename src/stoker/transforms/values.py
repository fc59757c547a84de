"""The built-in value transforms: Normalize (per channel) and FillNaN, both in place."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InvalidArgument


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
    def from_stats(cls, stats: Any, **kwargs: Any) -> "Normalize":
        """From statistics with ``mean`` and ``std`` per channel: a ``FieldStats``, one field of what
        :func:`stoker.records.compute_stats` returns, or what :func:`stoker.compute_stats` returns for an
        array (scalar) or a list of arrays (per channel: the batch's axis 1). Channels whose std is 0
        (constant) are only centred, as :func:`stoker.records.normalize` does. Other keyword arguments go to
        the constructor as they are.

        >>> norm = Normalize.from_stats(stoker.compute_stats([["/d/c0.zarr", "/d/c1.zarr"]])[0])
        """
        if not hasattr(stats, "mean") or not hasattr(stats, "std"):
            raise InvalidArgument(f"Normalize.from_stats takes an object with mean and std (a FieldStats of "
                                  f"compute_stats' result, one field), got {type(stats).__name__}")
        std = _per_channel("std", stats.std)
        return cls(stats.mean, torch.where(std > 0, std, torch.ones_like(std)), **kwargs)

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
