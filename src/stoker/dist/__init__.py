"""Across ranks: rank discovery, the small collectives, metric reductions, telemetry.

>>> from stoker.dist import all_reduce, rank_info, reduce_max
>>> worst = reduce_max({"pop_wait_s": 0.2})          # every rank calls it
>>> rank_info().rank
0

Modules: :mod:`~stoker.dist.collectives` (rank_info, resolve_rank, all_reduce, all_gather,
all_gather_object, broadcast_object, barrier, group_position), :mod:`~stoker.dist.reduce` (reduce_max),
:mod:`~stoker.dist.telemetry` (memory_report, TelemetryWriter). A pipeline's ``Stats`` are reduced by
:func:`stoker.engine.reduce.reduce_stats` (also ``stoker.reduce_stats``).
"""

from .collectives import (RankInfo, all_gather, all_reduce, barrier, broadcast_object, group_position, rank_info,
                          resolve_rank)
from .reduce import reduce_max

__all__ = ["RankInfo", "all_gather", "all_reduce", "barrier", "broadcast_object", "group_position", "rank_info",
           "reduce_max", "resolve_rank"]
