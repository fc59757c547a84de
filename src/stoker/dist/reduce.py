"""Per-key maxima of metrics over ranks, in one collective.

Call :func:`reduce_max` on every rank of the group, with the same keys, then let rank 0 alone write the
result::

    from stoker.dist import rank_info, reduce_max

    worst = reduce_max({"pop_wait_s": wait, "rss_bytes": rss})   # all ranks
    if rank_info().rank == 0:
        print(worst)

A pipeline's :class:`~stoker.Stats` are reduced by :func:`stoker.engine.reduce.reduce_stats`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import torch

from ..errors import InvalidArgument
from .collectives import active_group, all_reduce

__all__ = ["check_number", "reduce_max"]

# float64 holds every integer up to 2**53 exactly; past that a round trip would silently change ints.
_MAX_EXACT_INT = 2**53


def check_number(key: str, value: Any, what: str) -> None:
    """Refuse what an all_reduce in float64 cannot carry exactly: non-numbers and integers past 2**53."""
    if isinstance(value, bool):
        return
    if isinstance(value, numbers.Integral):
        if abs(int(value)) > _MAX_EXACT_INT:
            raise InvalidArgument(
                f"{what} {key!r} = {value} is beyond 2**53 and cannot be reduced exactly as float64", key=key
            )
        return
    if not isinstance(value, numbers.Real):
        hint = " (call .item() first)" if isinstance(value, torch.Tensor) else ""
        raise InvalidArgument(f"{what} {key!r} must be a real number, got {type(value).__name__}{hint}", key=key)


def reduce_max(metrics: Mapping[str, Any], group: Any = None) -> dict[str, Any]:
    """Per-key maximum of ``metrics`` over the ranks of ``group``, in one ``all_reduce(MAX)``.

    Collective: call it on every rank of the group, with the same keys on every rank
    (not checked: different keys pair up wrong values or hang), then gate writing on
    rank 0. Returns a new dict; the input is not changed. Types follow the local
    value: ``int`` stays ``int`` (unless the max is another rank's fractional float: that
    float, never truncated), ``bool`` stays ``bool`` (max over ranks is "any rank
    True"), every other real number becomes ``float``. NaN handling is the backend's.
    With an empty dict, no initialised group, or a group of one, no collective runs
    and the values come back as they are.
    """
    if not isinstance(metrics, Mapping):
        raise InvalidArgument(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"metric names must be strings, got {key!r}", key=key)
        check_number(key, value, "metric")
    if active_group(group) is None:
        return dict(metrics)
    # Sorted keys: every rank packs the same order whatever order its dict was built in.
    keys = sorted(metrics)
    reduced = dict(zip(keys, all_reduce([float(metrics[k]) for k in keys], "MAX", group)))
    out: dict[str, Any] = {}
    for key, local in metrics.items():  # the caller's order, as in the no-op path
        value = reduced[key]
        if isinstance(local, bool):
            out[key] = value != 0.0
        elif isinstance(local, numbers.Integral) and math.isfinite(value) and value.is_integer():
            out[key] = int(value)  # exact: ints up to 2**53 survive the float64 round trip
        else:  # a float; also a local int's max that is another rank's fraction (an int 0 on a rank that has
            out[key] = value  # not measured yet, 0.75 on another), which int() truncated on the rank that writes
    return out
