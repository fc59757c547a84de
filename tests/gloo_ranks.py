"""Real process groups for the tests: ranks spawned with torch.multiprocessing, each a member of a gloo group
on loopback (a file rendezvous in a temporary folder), each leaving what it saw as JSON there.

>>> def _worker(rank, world, tmp, root):      # a module-level function: spawned ranks import it
...     with gloo_group(rank, world, tmp):
...         write_result(tmp, rank, {"n": compute(root)})
>>> results = spawn_ranks(_worker, 2, tmp_path, root)   # rank order
"""

from __future__ import annotations

import datetime
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.multiprocessing as mp


@contextmanager
def gloo_group(rank: int, world: int, tmp: str, timeout_s: float = 60.0) -> Iterator[None]:
    """This process as ``rank`` of a gloo group of ``world`` ranks (rendezvous: the file ``tmp``/init),
    destroyed on leaving. ``LOCAL_RANK`` is dropped first: rank_info must read the group, not a stray
    variable."""
    os.environ.pop("LOCAL_RANK", None)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def write_result(tmp: str, rank: int, out: Any) -> None:
    """What ``rank`` saw, for :func:`spawn_ranks` to read back."""
    with open(os.path.join(tmp, f"result_{rank}.json"), "w") as f:
        json.dump(out, f)


def spawn_ranks(worker: Callable[..., None], world: int, tmp, *args: Any) -> list[Any]:
    """``worker(rank, world, str(tmp), *args)`` in ``world`` spawned processes, joined; each rank's
    :func:`write_result`, in rank order."""
    mp.spawn(worker, args=(world, str(tmp), *args), nprocs=world, join=True)
    return [json.loads((Path(tmp) / f"result_{r}.json").read_text()) for r in range(world)]
