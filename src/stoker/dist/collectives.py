"""Rank discovery and the small collectives every rank calls.

``rank_info`` and ``resolve_rank`` say where this process sits. The collectives ``all_reduce``,
``all_gather``, ``all_gather_object``, ``broadcast_object``, ``barrier`` and ``group_position`` are called on
every rank of the group; without an initialised process group (or in a group of one) nothing is communicated
and the local value comes back, so single-process code needs no special case. The record statistics,
precompute, the Trainer and the reductions (:mod:`stoker.dist.reduce`, :mod:`stoker.engine.reduce`) use them::

    from stoker.dist import all_reduce, rank_info

    total, = all_reduce([float(n_seen)], "SUM", group=None)   # every rank
    if rank_info().rank == 0:
        print(total)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..checks import env_int, rank_in_world
from ..errors import InvalidArgument

__all__ = ["RankInfo", "active_group", "all_gather", "all_gather_object", "all_reduce", "barrier", "broadcast_object", "group_position",
           "rank_info", "resolve_rank", "world_size"]

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


def active_group(group: Any) -> Any:
    """``torch.distributed`` when a collective over ``group`` would involve other ranks, else None."""
    dist = _dist()
    if dist is None:
        return None
    if dist.get_rank(group) < 0:
        raise InvalidArgument("this process is not a member of the given process group")
    return dist if dist.get_world_size(group) > 1 else None


def world_size(group: Any) -> int:
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
    dist = active_group(group)
    if dist is None or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device_for(dist, group))
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
    return t.cpu().tolist()


def all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype on all ranks), in rank order; ``[t]`` when no other rank
    takes part."""
    dist = active_group(group)
    if dist is None:
        return [t]
    t = t.to(_device_for(dist, group))
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.cpu() for o in out]


#: A rank's status in :func:`status_header`: went well; failed (its error is raised on it, an error
#: naming the failed ranks on the others); found something every rank raises alike (non-finite values).
STATUS_OK, STATUS_FAILED, STATUS_FOUND = 0, 1, 2


def status_header(error: BaseException | None, found: bool, values: Sequence[int], group: Any,
                  failure: Callable[[list[int]], BaseException]) -> list[torch.Tensor]:
    """Every rank's header ``[status, *values]`` (int64), in rank order, gathered before a collective that
    a failed rank would never reach: so when any rank failed, all raise rather than the others waiting for
    ever. A failed rank raises its ``error``, the others ``failure(failed ranks)`` (a StokerError that says
    the cause is raised there). The status is STATUS_FAILED with an ``error``, else STATUS_FOUND when
    ``found``, else STATUS_OK; ``values`` (as many on every rank) say what each rank saw."""
    status = STATUS_FAILED if error is not None else STATUS_FOUND if found else STATUS_OK
    headers = all_gather(torch.tensor([status, *values], dtype=torch.int64), group)
    failed = [r for r, h in enumerate(headers) if int(h[0]) == STATUS_FAILED]
    if error is not None:
        raise error
    if failed:
        raise failure(failed)
    return headers


def all_gather_object(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable; any size), in rank order; ``[obj]`` when no other rank takes part.

    >>> names = all_gather_object(("raw", "labels"), None)   # every rank
    """
    dist = active_group(group)
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def group_position(group: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in collectives over ``group``; ``(0, 1)`` when alone."""
    dist = active_group(group)
    return (dist.get_rank(group), dist.get_world_size(group)) if dist is not None else (0, 1)


def broadcast_object(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` (picklable) on every rank of ``group``; ``obj`` when no other rank takes part."""
    dist = active_group(group)
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def barrier(group: Any) -> None:
    """Wait for every rank of ``group`` (nothing to wait for when no other rank takes part)."""
    dist = active_group(group)
    if dist is not None:
        dist.barrier(group=group)
