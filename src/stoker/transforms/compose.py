"""Running transforms: what ``Config(transform=...)`` keeps (:func:`as_transform`), several in order
(:class:`Compose`), and one applied to a batch's slot (:func:`apply`, the rules in :mod:`stoker.transforms`).

A transform whose ``takes_keys`` is true (a :class:`Keyed` subclass, or any callable with that attribute)
is called ``t(batch, keys)`` with the batch's per-sample keys (:mod:`.keys`); any other callable ``t(batch)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from ..errors import InvalidArgument

Transform = Callable[..., Any]


class Keyed:
    """Base class of transforms that take the batch's per-sample keys: the pipeline calls ``t(batch, keys)``,
    ``keys`` an int64 array ``(B, 2)`` of ``(epoch, index)`` per sample (see :mod:`stoker.transforms.keys`).
    Random draws made from them (:func:`~stoker.transforms.uniform`) are the same in a resumed run, for a
    slower consumer, in any thread and on any device.

    >>> class Jitter(stoker.transforms.Keyed):
    ...     def __call__(self, x, keys):
    ...         u = stoker.transforms.uniform(keys, seed=5)[:, 0]   # one number per sample
    ...         return x.add_(torch.as_tensor(u, dtype=x.dtype, device=x.device).view(-1, *[1] * (x.dim() - 1)))
    """

    takes_keys = True

    def __call__(self, batch: Any, keys: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(batch, keys)")


def takes_keys(transform: Any) -> bool:
    """Whether ``transform`` is called with the keys (its ``takes_keys`` attribute is true)."""
    return bool(getattr(transform, "takes_keys", False))


class Compose(Keyed):
    """Several transforms, applied in order (``Config(transform=[a, b])`` makes one). It passes the keys on to
    those that take them; ``Compose([...])(batch)`` without keys works when none of them does."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = tuple(transforms)
        for t in self.transforms:
            if not callable(t):
                raise InvalidArgument(f"a transform must be callable (batch -> batch), got {t!r}", knob="transform")
            _not_a_class(t)

    def __call__(self, x: Any, keys: Any = None) -> Any:
        for t in self.transforms:
            x = apply(t, x, keys)
        return x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compose) and self.transforms == other.transforms

    def __hash__(self) -> int:
        return hash(self.transforms)

    def __repr__(self) -> str:
        return f"Compose({list(self.transforms)!r})"


def _not_a_class(value: Any) -> None:
    """InvalidArgument for a class given where a transform is meant (``transform=RandomFlip``, no parentheses):
    callable, it would be called with the batch at the first pop, as ``RandomFlip(batch, keys)``."""
    if isinstance(value, type):
        raise InvalidArgument(f"Config.transform got the class {value.__name__}, not a transform: make one, e.g. "
                              f"{value.__name__}(...) with its arguments", knob="transform")


def as_transform(value: Any) -> Transform | None:
    """What ``Config(transform=...)`` keeps: None, a callable, or a Compose of a list of callables."""
    if value is None or isinstance(value, Compose):
        return value
    if isinstance(value, (list, tuple)):
        return Compose(value)
    if not callable(value):
        raise InvalidArgument(f"Config.transform must be a callable (batch -> batch), a list of them or None, got "
                              f"{value!r}", knob="transform")
    _not_a_class(value)
    return value


def apply(transform: Transform, out: Any, keys: Any = None) -> Any:
    """Run ``transform`` on the batch ``out`` (a tensor, or a mapping of field name to tensor), leaving the
    result in ``out`` (see the module docstring of :mod:`stoker.transforms`); ``keys`` are passed to a
    transform that takes them. A transform on a dict batch may also put new tensors in the dict it got: they
    are copied back into the fields' slots as a returned tensor would be."""
    slots = dict(out) if isinstance(out, Mapping) else None  # the fields' slots, whatever the dict holds after
    result = transform(out, keys) if takes_keys(transform) else transform(out)
    if slots is None:
        return out if result is None or result is out else _settle(transform, result, out, "")
    result = out if result is None else result
    if not isinstance(result, Mapping) or set(result) != set(slots):
        what = f"fields {sorted(result)}" if isinstance(result, Mapping) else type(result).__name__
        raise InvalidArgument(f"transform {transform!r} returned {what}; it must return the batch (fields "
                              f"{sorted(slots)}), best modified in place", knob="transform")
    for name, slot in slots.items():
        _settle(transform, result[name], slot, f"field {name!r} of ")
    if result is out and isinstance(out, dict):
        out.update(slots)  # the dict the caller holds names the slots again
    return out


def _settle(transform: Transform, result: Any, out: torch.Tensor, where: str) -> torch.Tensor:
    """``result`` left in ``out``: as is when it is ``out``, copied back when it is another tensor of its
    shape, dtype and device; InvalidArgument otherwise (``where`` names a field of a dict batch)."""
    if result is out:
        return out
    if not isinstance(result, torch.Tensor) or result.shape != out.shape:
        what = f"shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else type(result).__name__
        raise InvalidArgument(f"transform {transform!r} returned {what} for {where}the batch; it must return the "
                              f"batch (shape {tuple(out.shape)}), best modified in place", knob="transform")
    if result.dtype != out.dtype or result.device != out.device:
        # copying it back would cast silently (an int16 batch divided by 1000.0 truncated to 0 and 1)
        raise InvalidArgument(
            f"transform {transform!r} returned a {result.dtype} tensor on {result.device} for {where}a batch of "
            f"{out.dtype} on {out.device}; a transform keeps the batch's dtype and device. Return a tensor of "
            f"the batch's dtype (best: modify the batch in place), or ask for floating batches with "
            "Config(dtype='f32')", knob="transform")
    if result.data_ptr() != out.data_ptr() or result.stride() != out.stride():
        if result.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            # a view of the batch's own memory (``b.transpose(-2, -1)``): torch refuses to copy a tensor over
            # itself, and a copy element by element would read values it already overwrote
            result = result.clone()
        out.copy_(result)
    return out
