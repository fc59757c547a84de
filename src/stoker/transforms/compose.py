"""Running transforms: what ``Config(transform=...)`` keeps (:func:`as_transform`), several in order
(:class:`Compose`), and one applied to a batch's slot (:func:`apply`, the rules in :mod:`stoker.transforms`)."""

from __future__ import annotations

from collections.abc import Mapping
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


def apply(transform: Transform, out: Any) -> Any:
    """Run ``transform`` on the batch ``out``, leaving the result in ``out`` (see the module docstring). A batch
    of samples of named fields is a dict ``{name: tensor}``: the transform gets the dict, and each field's
    result is left in that field's tensor by the same rules."""
    if isinstance(out, dict):
        return _apply_fields(transform, out)
    return _keep(transform, out, transform(out))


def _keep(transform: Transform, out: torch.Tensor, result: Any) -> torch.Tensor:
    """``result`` of ``transform`` on ``out`` left in ``out`` (see :func:`apply`)."""
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


def _apply_fields(transform: Transform, out: dict) -> dict:
    """:func:`apply` on a dict of field batches: ``transform(out)`` may change the tensors in place, put new
    ones in the dict, or return a mapping of the same names; each field's result is left in its own tensor
    by :func:`apply`'s rules (so a dict entry replaced by ``x["raw"] = x["raw"] * 2`` reaches the batch)."""
    slots = dict(out)
    result = transform(out)  # type: ignore[arg-type]  # a transform of fields takes the dict
    if result is None:
        result = out
    if not isinstance(result, Mapping) or set(result) != set(slots):
        what = f"a mapping of {sorted(result)}" if isinstance(result, Mapping) else type(result).__name__
        raise InvalidArgument(f"transform {transform!r} returned {what} for a batch of fields {sorted(slots)}; it "
                              "must return the dict it got (best modified in place)", knob="transform")
    for name, tensor in slots.items():
        _keep(transform, tensor, result[name])
    out.clear()
    out.update(slots)
    return out
