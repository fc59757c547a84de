"""Per-key maxima of metrics over ranks, in one collective (after one that checks every rank names the same).

Call :func:`reduce_max` on every rank of the group, with the same keys, then let rank 0 alone write the
result::

    from stoker.dist import rank_info, reduce_max

    worst = reduce_max({"pop_wait_s": wait, "rss_bytes": rss})   # all ranks
    if rank_info().rank == 0:
        print(worst)

A pipeline's :class:`~stoker.Stats` are reduced by :func:`stoker.engine.reduce.reduce_stats`.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from typing import Any, Mapping

import torch

from ..errors import InvalidArgument
from .collectives import active_group, all_reduce

__all__ = ["check_number", "check_same_names", "reduce_max"]

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


def _digest(names: list[str]) -> float:
    """A 48-bit digest of ``names`` (in their order), exact as a float64; of their JSON, which no two lists of
    names share (names joined by a separator would: ``["a\\0b", "c"]`` and ``["a", "b\\0c"]``)."""
    raw = hashlib.blake2b(json.dumps(names).encode(), digest_size=6).digest()
    return float(int.from_bytes(raw, "big"))


def check_same_names(names: list[str], group: Any) -> None:
    """InvalidArgument on every rank unless every rank of ``group`` passed the same ``names`` (sorted): one
    small ``all_reduce(MAX)`` of their count and digest, and of their negations (a minimum is -MAX(-x)).

    A reduction packs values by name; ranks with other names would pair one rank's ``"loss"`` with another's
    ``"lr"`` (silently wrong), or run collectives of other lengths (a hang until the group's timeout).
    Collective: every rank calls it, and every rank raises alike, so none is left waiting."""
    n, digest = float(len(names)), _digest(names)
    top_n, low_n, top_d, low_d = all_reduce([n, -n, digest, -digest], "MAX", group)
    if top_n != -low_n or top_d != -low_d:
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        counts = f"{int(-low_n)} to {int(top_n)} names" if top_n != -low_n else \
            f"{len(names)} names each, not the same"
        raise InvalidArgument(
            f"the ranks reduce different metric names ({counts}; this rank: {shown or 'none'}); every rank must "
            "pass the same metric names at every reduction (log a metric a rank has not measured yet as 0)",
            names=tuple(names))


def reduce_max(metrics: Mapping[str, Any], group: Any = None) -> dict[str, Any]:
    """Per-key maximum of ``metrics`` over the ranks of ``group``, in one ``all_reduce(MAX)`` (after
    :func:`check_same_names`).

    Collective: call it on every rank of the group, with the same keys on every rank
    (checked first, in one small collective: different keys are an InvalidArgument on
    every rank, an empty dict included), then gate writing on rank 0. Returns a new
    dict; the input is not changed. Types follow the local value: ``int`` stays ``int``
    (unless the max is another rank's fractional float: that float, never truncated),
    ``bool`` stays ``bool`` (max over ranks is "any rank True"), every other real number
    becomes ``float``. A NaN on any rank is NaN, whichever rank it is on (as ``torch.max``
    has it). With no initialised group, or a group of one, no collective runs and the
    values come back as they are.
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
    check_same_names(keys, group)
    values = [float(metrics[k]) for k in keys]
    # Each value's "is NaN" rides in the same MAX: the backend's MAX keeps a NaN only where it happens to come
    # first (gloo: rank 1's NaN against rank 0's 1.0 is 1.0), where a NaN on any rank must win, as in torch.max.
    got = all_reduce(values + [1.0 if math.isnan(v) else 0.0 for v in values], "MAX", group)
    reduced = {k: math.nan if flag else v for k, v, flag in zip(keys, got, got[len(keys):])}
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
