"""Rank discovery and cheap cross-rank reductions of metrics and pipeline stats.

Every reduction here is a *collective*: call it on every rank of the group, with
the same keys, then let rank 0 alone write the result::

    from stoker.distributed import rank_info, reduce_max, reduce_stats

    worst = reduce_max({"pop_wait_s": wait, "rss_bytes": rss})   # all ranks
    summary = reduce_stats(pipeline.stats(), elapsed_s=time.monotonic() - t0)
    if rank_info().rank == 0:
        print(worst, summary.totals.samples, summary.min_samples_per_s)

Without an initialised process group (or in a group of one) nothing is
communicated and the local values come back, so single-process code needs no
special case.

The small collectives ``all_reduce``, ``all_gather``, ``broadcast_object``,
``barrier`` and ``group_position`` follow the same rule (every rank calls them;
alone they return the local value); the record statistics, precompute and the
Trainer use them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .engine.stats import COUNTERS, STAGES, Metric, Stats
from .checks import env_int, rank_in_world, seconds
from .errors import InvalidArgument

__all__ = ["RankInfo", "ReducedStats", "all_gather", "all_reduce", "barrier", "broadcast_object", "group_position",
           "rank_info", "reduce_max", "reduce_stats"]

# float64 holds every integer up to 2**53 exactly; past that a round trip would silently change ints.
_MAX_EXACT_INT = 2**53
_STAGE_FIELDS = ("seconds", "count", "bytes_in", "bytes_out")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits: global (or group) rank, world size, rank on its node."""

    rank: int
    world_size: int
    local_rank: int


def _dist() -> Any:
    """``torch.distributed`` when it is built in and initialised, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def rank_info(group: Any = None) -> RankInfo:
    """Rank and world size from the initialised process group (``group`` or the default one).

    Falls back to the ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` variables torchrun sets, then
    to ``RankInfo(0, 1, 0)``. ``local_rank`` is ``LOCAL_RANK`` when set, else the global
    rank (right for single-node launches such as ``torch.multiprocessing.spawn``).
    """
    dist = _dist()
    if dist is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise InvalidArgument("this process is not a member of the given process group")
        # A group knows nothing of nodes; the global rank is the local one on a single node.
        return RankInfo(rank, world, env_int("LOCAL_RANK", dist.get_rank()))
    rank = env_int("RANK", 0)
    world = env_int("WORLD_SIZE", 1)
    if world < 1 or not 0 <= rank < world:
        raise InvalidArgument(f"RANK={rank} and WORLD_SIZE={world} are inconsistent; need 0 <= RANK < WORLD_SIZE")
    return RankInfo(rank, world, env_int("LOCAL_RANK", rank))


def resolve_rank(rank: Any = None, world_size: Any = None) -> tuple[int, int]:
    """``(rank, world_size)``: the values given, the missing ones from :func:`rank_info`; checked.

    >>> resolve_rank(1, 4)
    (1, 4)
    """
    if rank is None or world_size is None:
        info = rank_info()
        rank = info.rank if rank is None else rank
        world_size = info.world_size if world_size is None else world_size
    return rank_in_world(rank, world_size)


def _active_group(group: Any) -> Any:
    """``torch.distributed`` when a collective over ``group`` would involve other ranks, else None."""
    dist = _dist()
    if dist is None:
        return None
    if dist.get_rank(group) < 0:
        raise InvalidArgument("this process is not a member of the given process group")
    return dist if dist.get_world_size(group) > 1 else None


def _world_size(group: Any) -> int:
    """How many ranks a collective over ``group`` spans right now (1 without a process group)."""
    dist = _dist()
    return dist.get_world_size(group) if dist is not None else 1


def _device_for(dist: Any, group: Any) -> torch.device:
    """The device the group's backend reduces on: NCCL only takes CUDA tensors, gloo/MPI take CPU ones."""
    backend = str(dist.get_backend(group)).lower()
    # "cpu:gloo,cuda:nccl" style groups take CPU tensors through gloo, so prefer the CPU when offered.
    if "gloo" in backend or "mpi" in backend or "ucc" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in backend:
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def all_reduce(values: list[float], op: str, group: Any) -> list[float]:
    """One all_reduce of ``values`` packed as float64; the identity when no other rank takes part."""
    dist = _active_group(group)
    if dist is None or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device_for(dist, group))
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
    return t.cpu().tolist()


def all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype on all ranks), in rank order; ``[t]`` when no other rank
    takes part."""
    dist = _active_group(group)
    if dist is None:
        return [t]
    t = t.to(_device_for(dist, group))
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.cpu() for o in out]


def group_position(group: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in collectives over ``group``; ``(0, 1)`` when alone."""
    dist = _active_group(group)
    return (dist.get_rank(group), dist.get_world_size(group)) if dist is not None else (0, 1)


def broadcast_object(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` (picklable) on every rank of ``group``; ``obj`` when no other rank takes part."""
    dist = _active_group(group)
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def barrier(group: Any) -> None:
    """Wait for every rank of ``group`` (nothing to wait for when no other rank takes part)."""
    dist = _active_group(group)
    if dist is not None:
        dist.barrier(group=group)


def _check_number(key: str, value: Any, what: str) -> None:
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
    value: ``int`` stays ``int``, ``bool`` stays ``bool`` (max over ranks is "any rank
    True"), every other real number becomes ``float``. NaN handling is the backend's.
    With an empty dict, no initialised group, or a group of one, no collective runs
    and the values come back as they are.
    """
    if not isinstance(metrics, Mapping):
        raise InvalidArgument(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"metric names must be strings, got {key!r}", key=key)
        _check_number(key, value, "metric")
    if _active_group(group) is None:
        return dict(metrics)
    # Sorted keys: every rank packs the same order whatever order its dict was built in.
    keys = sorted(metrics)
    reduced = dict(zip(keys, all_reduce([float(metrics[k]) for k in keys], "MAX", group)))
    out: dict[str, Any] = {}
    for key, local in metrics.items():  # the caller's order, as in the no-op path
        value = reduced[key]
        if isinstance(local, bool):
            out[key] = value != 0.0
        elif isinstance(local, numbers.Integral) and math.isfinite(value):
            out[key] = int(value)  # exact: ints up to 2**53 survive the float64 round trip
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class ReducedStats:
    """Pipeline :class:`~stoker.Stats` summed over ranks, plus the worst and best rank.

    ``totals`` holds the sums of every counter and of each stage's seconds, counts and
    bytes (``totals.peak_host_bytes`` is the sum of the per-rank peaks, an upper bound
    on the job's host memory). Throughputs are samples per second of wall time as each
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
        """A flat ``name -> number`` dict, e.g. for :class:`stoker.telemetry.TelemetryWriter`."""
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
    """Combine every rank's ``pipeline.stats()`` in two collectives (one SUM, one MAX).

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
        _check_number(name, getattr(stats, name), "counter")

    # One fixed layout on every rank: 4 fields per stage in STAGES order, then COUNTERS, the peak, GIL time.
    sums: list[float] = []
    for name in STAGES:
        m = stats.stages.get(name, Metric(name))
        sums.extend(float(getattr(m, f)) for f in _STAGE_FIELDS)
    sums.extend(float(getattr(stats, name)) for name in COUNTERS)
    sums.append(float(stats.peak_host_bytes))
    sums.append(float(stats.gil_seconds))

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
    counters = {name: int(sums[off + j]) for j, name in enumerate(COUNTERS)}
    totals = Stats(stages=stages, peak_host_bytes=int(sums[-2]), gil_seconds=sums[-1], **counters)
    return ReducedStats(
        totals=totals,
        max_pop_wait_s=maxes[0],
        max_peak_host_bytes=int(maxes[1]),
        max_samples_per_s=maxes[2] if maxes[2] != -math.inf else None,
        min_samples_per_s=-maxes[3] if maxes[3] != -math.inf else None,
        world_size=_world_size(group),
    )
