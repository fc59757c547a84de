"""A pipeline's :class:`~stoker.Stats` combined over ranks: sums (each field's counts too), and the worst and
best rank.

Collective: call :func:`reduce_stats` on every rank of the group, then let rank 0 alone write::

    summary = reduce_stats(pipeline.stats(), elapsed_s=time.monotonic() - t0)
    if rank_info().rank == 0:
        print(summary.totals.samples, summary.min_samples_per_s)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Any

from ..checks import seconds
from ..dist.collectives import all_gather_object, all_reduce, world_size
from ..dist.reduce import check_number
from ..errors import InvalidArgument
from .stats import COUNTERS, FIELD_COUNTERS, STAGES, FieldCounts, Metric, Stats

__all__ = ["ReducedStats", "reduce_stats"]

_STAGE_FIELDS = ("seconds", "count", "bytes_in", "bytes_out")


@dataclass(frozen=True)
class ReducedStats:
    """Pipeline :class:`~stoker.Stats` summed over ranks, plus the worst and best rank.

    ``totals`` holds the sums of every counter and of each stage's seconds, counts and
    bytes (``totals.peak_host_bytes`` is the sum of the per-rank peaks, an upper bound
    on the job's host memory), and ``totals.fields`` each field's counts summed over
    the ranks that have them (samples of named fields). Throughputs are samples per second of wall time as each
    rank passed it (``elapsed_s``); None when no rank passed one.
    """

    totals: Stats
    max_pop_wait_s: float
    max_peak_host_bytes: int
    min_samples_per_s: float | None
    max_samples_per_s: float | None
    world_size: int

    @property
    def read_amplification(self) -> float:
        """Encoded bytes read per needed source byte, over all ranks."""
        return self.totals.read_amplification

    @property
    def decode_amplification(self) -> float:
        """Bytes decoded per needed source byte, over all ranks."""
        return self.totals.decode_amplification

    def to_metrics(self) -> dict[str, float | int]:
        """A flat ``name -> number`` dict, e.g. for :class:`stoker.dist.telemetry.TelemetryWriter`."""
        out: dict[str, float | int] = {name: getattr(self.totals, name) for name in COUNTERS}
        for name, m in self.totals.stages.items():
            out[f"{name}_s"] = m.seconds
        out.update(
            gil_s=self.totals.gil_seconds,
            max_pop_wait_s=self.max_pop_wait_s,
            max_peak_host_bytes=self.max_peak_host_bytes,
            read_amplification=self.read_amplification,
            decode_amplification=self.decode_amplification,
            world_size=self.world_size,
        )
        if self.min_samples_per_s is not None:
            out["min_samples_per_s"] = self.min_samples_per_s
        if self.max_samples_per_s is not None:
            out["max_samples_per_s"] = self.max_samples_per_s
        return out


def reduce_stats(stats: Stats, group: Any = None, *, elapsed_s: float | None = None) -> ReducedStats:
    """Combine every rank's ``pipeline.stats()`` in three collectives (the field names gathered, one SUM, one
    MAX).

    Collective: call it on every rank of ``group``. ``elapsed_s`` is this rank's wall
    time for the work ``stats`` covers; each rank's throughput is ``samples / elapsed_s``
    and the result reports the slowest and fastest rank. Without an initialised group
    (or in a group of one) the local values come back. Integer sums stay exact below
    2**53 (about 9 PB).
    """
    if not isinstance(stats, Stats):
        raise InvalidArgument(f"stats must be a stoker.Stats (pipeline.stats()), got {type(stats).__name__}")
    seconds("elapsed_s", elapsed_s, optional=True, finite=True)
    unknown = sorted(set(stats.stages) - set(STAGES))
    if unknown:
        # Every rank must pack the same layout; stages outside STAGES have no agreed slot.
        raise InvalidArgument(f"unknown stages {unknown}; reduce_stats knows {STAGES}")
    pop_wait = stats.stages.get("pop_wait", Metric("pop_wait")).seconds
    for name in COUNTERS + ("peak_host_bytes", "gil_seconds"):
        check_number(name, getattr(stats, name), "counter")
    for field_name, counts in stats.fields.items():
        for name in FIELD_COUNTERS:
            check_number(f"{field_name}.{name}", getattr(counts, name), "field counter")
    # A rank that has popped no batch yet has no fields (or fewer): every rank packs the union of the names,
    # in the order the ranks first name them, with zeros for a field it lacks.
    fields = list(dict.fromkeys(name for names in all_gather_object(list(stats.fields), group) for name in names))

    # One fixed layout on every rank: 4 fields per stage in STAGES order, then COUNTERS, the peak, GIL time,
    # then FIELD_COUNTERS per field.
    sums: list[float] = []
    for name in STAGES:
        m = stats.stages.get(name, Metric(name))
        sums.extend(float(getattr(m, f)) for f in _STAGE_FIELDS)
    sums.extend(float(getattr(stats, name)) for name in COUNTERS)
    sums.append(float(stats.peak_host_bytes))
    sums.append(float(stats.gil_seconds))
    for name in fields:
        counts = stats.fields.get(name, FieldCounts())
        sums.extend(float(getattr(counts, c)) for c in FIELD_COUNTERS)

    # MIN(x) is -MAX(-x), so the minimum rides in the same MAX collective. A rank without
    # elapsed_s packs -inf in both slots and so never wins either.
    rate = stats.samples / elapsed_s if elapsed_s is not None else None
    maxes = [
        float(pop_wait),
        float(stats.peak_host_bytes),
        rate if rate is not None else -math.inf,
        -rate if rate is not None else -math.inf,
    ]

    sums = all_reduce(sums, "SUM", group)
    maxes = all_reduce(maxes, "MAX", group)

    stages = {}
    for i, name in enumerate(STAGES):
        secs, count, b_in, b_out = sums[4 * i: 4 * i + 4]
        stages[name] = Metric(name, secs, int(count), int(b_in), int(b_out))
    off = 4 * len(STAGES)
    counters: dict[str, Any] = {name: int(sums[off + j]) for j, name in enumerate(COUNTERS)}
    off += len(COUNTERS)
    peak, gil_seconds = int(sums[off]), sums[off + 1]
    off += 2
    per_field = {}
    for name in fields:
        per_field[name] = FieldCounts(**{c: int(v) for c, v in zip(FIELD_COUNTERS, sums[off:])})
        off += len(FIELD_COUNTERS)
    totals = Stats(stages=stages, peak_host_bytes=peak, gil_seconds=gil_seconds, fields=per_field, **counters)
    return ReducedStats(
        totals=totals,
        max_pop_wait_s=maxes[0],
        max_peak_host_bytes=int(maxes[1]),
        max_samples_per_s=maxes[2] if maxes[2] != -math.inf else None,
        min_samples_per_s=-maxes[3] if maxes[3] != -math.inf else None,
        world_size=world_size(group),
    )
