"""Checks of caller-supplied numbers, worded the same way across the public API.

Every error is an :class:`~stoker.errors.InvalidArgument` that names the argument, the
accepted range and the value received, so the caller knows what to change.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Literal, overload

from .errors import InvalidArgument


@overload
def integer(name: str, value: Any, low: int, *, optional: Literal[False] = ..., **context: Any) -> int: ...
@overload
def integer(name: str, value: Any, low: int, *, optional: bool, **context: Any) -> int | None: ...


def integer(name: str, value: Any, low: int, *, optional: bool = False, **context: Any) -> int | None:
    """``value`` as an ``int`` when it is an integer ``>= low`` (or ``None`` when ``optional``).

    Booleans are refused although Python counts them as integers; numpy integers are accepted.
    ``context`` is attached to the error.

    >>> integer("batch_size", 8, 1)
    8
    >>> integer("batch_size", 0, 1)
    Traceback (most recent call last):
    stoker.errors.InvalidArgument: batch_size must be an integer >= 1, got 0
    """
    if value is None and optional:
        return None
    if not _integral(value) or value < low:
        allowed = f"an integer >= {low}" + (" or None" if optional else "")
        raise InvalidArgument(f"{name} must be {allowed}, got {value!r}", **context)
    return int(value)


def int64(name: str, value: Any, **context: Any) -> int:
    """``value`` as an ``int`` when it is an integer in int64's range (a seed or salt numpy hashes as one),
    as :func:`integer` counts integers: a float would be truncated (seed 0.5 drawing what 0 draws), one
    past int64 is numpy's OverflowError. ``context`` is attached to the error.

    >>> int64("seed", 2**63)
    Traceback (most recent call last):
    stoker.errors.InvalidArgument: seed must be an int64 integer, got 9223372036854775808
    """
    if not _integral(value) or not -2**63 <= value < 2**63:
        raise InvalidArgument(f"{name} must be an int64 integer, got {value!r}", **context)
    return int(value)


def _integral(value: Any) -> bool:
    """An integer, numpy's too; not a bool, which Python counts as one."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def integers(name: str, values: Any, low: int | None, **context: Any) -> tuple[int, ...]:
    """``values`` (a sequence: a shape, a stride, a scale per axis) as a tuple of ints, each a whole number
    ``>= low`` (None: any, as an offset): numpy integers and whole floats (``64 / 2``) are the integers they hold;
    a fraction, a bool or a string is refused, never truncated into another shape than asked. ``context`` is
    attached to the error.

    >>> integers("sample_shape", (4, 8.0), 1)
    (4, 8)
    >>> integers("sample_shape", (2.5, 4), 1)
    Traceback (most recent call last):
    stoker.errors.InvalidArgument: sample_shape must be a sequence of integers >= 1, got (2.5, 4)
    """
    try:
        items = list(values) if not isinstance(values, (str, bytes)) else None
    except TypeError:
        items = None
    if items is None or not all(_whole(v) and (low is None or v >= low) for v in items):
        bound = "" if low is None else f" >= {low}"
        raise InvalidArgument(f"{name} must be a sequence of integers{bound}, got {values!r}", **context)
    return tuple(int(v) for v in items)


def _whole(value: Any) -> bool:
    """An integer (numpy's too) or a float holding one; not a bool."""
    if isinstance(value, bool):
        return False
    return _integral(value) or (isinstance(value, numbers.Real) and float(value).is_integer())


@overload
def seconds(name: str, value: Any, *, optional: Literal[False] = ..., finite: bool = ..., **context: Any) -> float: ...
@overload
def seconds(name: str, value: Any, *, optional: bool, finite: bool = ..., **context: Any) -> float | None: ...


def seconds(name: str, value: Any, *, optional: bool = False, finite: bool = False, **context: Any) -> float | None:
    """``value`` as a ``float`` when it is a number of seconds ``> 0`` (infinity too unless ``finite``).

    >>> seconds("timeout_s", 2)
    2.0
    """
    if value is None and optional:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0
            or (finite and not math.isfinite(value))):
        allowed = ("a finite number" if finite else "a number") + " of seconds > 0" + (" or None" if optional else "")
        raise InvalidArgument(f"{name} must be {allowed}, got {value!r}", **context)
    return float(value)


def rank_in_world(rank: Any, world_size: Any) -> tuple[int, int]:
    """``(rank, world_size)`` as ints when ``world_size >= 1`` and ``0 <= rank < world_size``.

    >>> rank_in_world(1, 4)
    (1, 4)
    """
    world = integer("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world:
        raise InvalidArgument(f"rank must be an integer in [0, {world}), got {rank!r}", rank=rank, world_size=world)
    return int(rank), world


def env_int(name: str, default: int) -> int:
    """The environment variable ``name`` as an int, ``default`` when unset or blank."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"environment variable {name} must be an integer, got {raw!r}", knob=name) from None
