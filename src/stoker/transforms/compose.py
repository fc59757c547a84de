"""Running transforms: what ``Config(transform=...)`` keeps (:func:`as_transform`), several in order
(:class:`Compose`), and one applied to a batch's slot (:func:`apply`, the rules in :mod:`stoker.transforms`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..errors import InvalidArgument

Transform = Callable[[torch.Tensor], Any]


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
