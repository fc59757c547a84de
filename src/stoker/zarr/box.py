"""Axis-aligned boxes: parsing user input into ``((start, stop), ...)`` tuples.

A box is half-open per axis. Users may write it as ``(start, stop)`` pairs or as
``slice`` objects (what ``numpy.s_[...]`` produces)::

    >>> parse_box([(0, 4), slice(2, 6)])
    ((0, 4), (2, 6))
    >>> parse_box(numpy.s_[:, 1:3], shape=(10, 10))   # open ends need the shape
    ((0, 10), (1, 3))

Bare integers and slice steps other than 1 are rejected: a crop keeps every axis.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

from ..errors import InvalidArgument, OutOfBounds, RankMismatch

Box = tuple[tuple[int, int], ...]


def _as_int(value: Any, what: str, uri: str | None = None) -> int:
    if isinstance(value, bool):  # an int to Python, but True as a coordinate is a mistake, not 1
        raise _invalid(f"{what} must be an integer, got the bool {value!r}", uri)
    try:
        return operator.index(value)
    except TypeError:
        raise _invalid(f"{what} must be an integer, got {value!r}", uri) from None


def _is_integer(value: Any) -> bool:
    """Whether ``value`` is one integer (numpy's too), not an array or a sequence."""
    if hasattr(value, "__len__") or hasattr(value, "__iter__"):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _invalid(message: str, uri: str | None, **context: Any) -> InvalidArgument:
    """An :class:`InvalidArgument` whose message names the array when it is known."""
    return InvalidArgument(f"{uri}: {message}" if uri else message, uri=uri, **context)


def parse_box(aabb: Any, shape: Sequence[int] | None = None, uri: str | None = None,
              allow_negative: bool = False) -> Box:
    """Normalise ``aabb`` to a tuple of ``(start, stop)`` int pairs.

    With ``shape`` given, open slice ends are resolved and the box is checked
    against it (rank and bounds); without it every end must be explicit. ``allow_negative`` accepts
    starts below 0 (a padded box, which reaches past its array: see :class:`~stoker.Sample`'s ``pad``).
    """
    if shape is None and (type(aabb) is tuple or type(aabb) is list):
        plain = _plain_box(aabb, allow_negative)  # what samplers make: (start, stop) pairs of ints
        if plain is not None:
            return plain
    if isinstance(aabb, (slice, int)) or _is_integer(aabb):
        aabb = (aabb,)  # one axis: checked below (a bare integer is refused there, naming the axis)
    elif not isinstance(aabb, Sequence) and not hasattr(aabb, "__iter__"):  # None, Ellipsis, a float...
        whole = f"; the whole array is {[(0, int(s)) for s in shape]}" if shape is not None else ""
        raise _invalid(f"a box is one (start, stop) pair or slice per axis (numpy.s_[0:4, 2:6] or "
                       f"[(0, 4), (2, 6)]), got {aabb!r}{whole}", uri)
    axes = list(aabb)
    if shape is not None and len(axes) != len(shape):
        where = f" {uri}" if uri else ""
        raise RankMismatch(
            f"box has {len(axes)} axes but the array{where} has {len(shape)} (shape {tuple(shape)})",
            uri=uri, box_rank=len(axes), array_rank=len(shape),
        )
    out = []
    for axis, item in enumerate(axes):
        if isinstance(item, slice):
            if item.step not in (None, 1):
                raise _invalid(f"axis {axis}: slice step must be 1, got {item.step!r}", uri, axis=axis)
            start = 0 if item.start is None else _as_int(item.start, f"axis {axis} start", uri)
            if item.stop is None:
                if shape is None:
                    raise _invalid(
                        f"axis {axis}: open-ended slice {item!r} needs the array shape; give an explicit stop",
                        uri, axis=axis,
                    )
                stop = int(shape[axis])
            else:
                stop = _as_int(item.stop, f"axis {axis} stop", uri)
        elif isinstance(item, (str, bytes)) or not hasattr(item, "__len__"):
            raise _invalid(
                f"axis {axis}: expected a (start, stop) pair or a slice, got {item!r}; "
                "bare integers would drop an axis, write (i, i + 1) instead",
                uri, axis=axis,
            )
        else:
            if len(item) != 2:
                raise _invalid(f"axis {axis}: expected a (start, stop) pair, got {item!r}", uri, axis=axis)
            start = _as_int(item[0], f"axis {axis} start", uri)
            stop = _as_int(item[1], f"axis {axis} stop", uri)
        if (start < 0 and not allow_negative) or stop < start:
            raise _invalid(
                f"axis {axis}: need 0 <= start <= stop, got ({start}, {stop}); negative indices are not supported "
                "(a box that reaches past its array needs pad=: Sample(..., pad='zero'))",
                uri, axis=axis,
            )
        out.append((start, stop))
    box = tuple(out)
    if shape is not None:
        check_in_bounds(box, shape, uri)
    return box


def _plain_box(aabb: list | tuple, allow_negative: bool) -> Box | None:
    """``aabb`` as a box where it is (start, stop) pairs (tuples or lists) of plain ints, each valid; None for
    anything else, which :func:`parse_box`'s general path takes (numpy integers, slices) or refuses, naming
    what is wrong. The general path costs a few microseconds a box in ABC checks; a pipeline's coordinator
    makes every sample of every batch (its samplers' boxes are these), so that cost is on its serial path."""
    out = []
    for item in aabb:
        if (type(item) is not tuple and type(item) is not list) or len(item) != 2:
            return None
        start, stop = item
        if type(start) is not int or type(stop) is not int or stop < start or (start < 0 and not allow_negative):
            return None
        out.append((start, stop))
    return tuple(out)


def check_in_bounds(box: Box, shape: Sequence[int], uri: str | None = None) -> None:
    """Raise :class:`RankMismatch` or :class:`OutOfBounds` unless ``box`` fits in ``shape``."""
    where = f" of {uri}" if uri else ""
    if len(box) != len(shape):
        raise RankMismatch(
            f"box {box} has {len(box)} axes but array{where} has {len(shape)} (shape {tuple(shape)})",
            uri=uri, box=box,
        )
    for axis, ((start, stop), size) in enumerate(zip(box, shape)):
        if stop > size:
            raise OutOfBounds(
                f"box {box} is out of bounds on axis {axis}: stop {stop} > size {size} of array{where} "
                f"(shape {tuple(shape)})",
                uri=uri, box=box, axis=axis,
            )


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the crop a box selects."""
    return tuple(stop - start for start, stop in box)
