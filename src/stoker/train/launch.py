"""``launch``: run a function once per rank, under torchrun or by spawning the ranks itself.

>>> def main(ctx: stoker.train.RankContext, data: str) -> float:
...     model = Net().to(ctx.device)           # ctx.device is already the current device
...     ...
...     return final_loss                        # rank 0's return value comes back from launch
>>> if __name__ == "__main__":
...     stoker.train.launch(main, "/data/volume.zarr")   # or: torchrun --nproc_per_node=2 train.py

Three ways in, one per-rank setup:

- under ``torchrun`` (its ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` environment
  is present) this process is one rank: ``launch`` runs ``fn`` here and returns its value;
- run directly with GPUs, it spawns one process per GPU (``nprocs`` to choose fewer);
- run directly without GPUs, it spawns ``nprocs`` CPU processes (default 2) over gloo.

Every rank binds its GPU (``torch.cuda.set_device(local_rank)``) before anything
touches CUDA, then joins the process group with a finite timeout. On the way out,
normal or not, it closes what ``ctx.manage`` was given (pipelines, loaders) and
destroys the process group. When a spawned rank raises, the others are stopped and
:class:`~stoker.RankFailed` carries the failing rank and its traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..checks import integer, seconds
from ..config import usable_cpus
from ..errors import InvalidArgument, RankFailed
from ..storage.fsutil import make_owned_dir, remove_dead_owned_dirs
from . import heartbeat

__all__ = ["RankContext", "launch", "under_torchrun"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_DEFAULT_CPU_RANKS = 2
_WORKDIR_PREFIX = "stoker-launch"  # + "-<host>-<pid>-<random>": says which launcher owns the folder


@dataclass
class RankContext:
    """What a rank knows about itself; passed as the first argument of the launched function.

    ``rank`` and ``world_size`` are global (every rank of every node); ``local_rank`` and
    ``local_world_size`` count the ranks of this node; ``node_rank`` and ``nnodes`` the nodes
    (torchrun's ``GROUP_RANK`` and ``GROUP_WORLD_SIZE``); ``restarts`` how often torchrun restarted
    the job's workers (``TORCHELASTIC_RESTART_COUNT``; a restarted job resumes from its checkpoint).
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    node_rank: int = 0
    nnodes: int = 1
    local_world_size: int = 1
    restarts: int = 0
    _managed: list = field(default_factory=list, repr=False)

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0: one rank per node (e.g. for work on node-local disks)."""
        return self.local_rank == 0

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes checkpoints, logs and summaries."""
        return self.rank == 0

    def manage(self, obj: Any) -> Any:
        """Close ``obj`` (anything with ``close()``) when the rank ends, also on errors; returns ``obj``."""
        if not callable(getattr(obj, "close", None)):
            raise InvalidArgument(f"ctx.manage needs an object with close(), got {type(obj).__name__}")
        self._managed.append(obj)
        return obj

    def mark(self, step: int, phase: str) -> None:
        """Tell this rank's heartbeat where a training loop of one's own is (the Trainer does this itself):
        ``phase`` is one of ``heartbeat.PHASES`` ("data", "forward", "backward", "optimizer", "sync",
        "checkpoint", "idle"), ``step`` the optimizer steps done. A rank left behind while its peers wait in
        a collective is then named within ``launch(stall_timeout_s=...)``."""
        if phase not in heartbeat.PHASES:
            raise InvalidArgument(f"phase must be one of {heartbeat.PHASES}, got {phase!r}")
        heartbeat.mark(int(step), phase)

    def barrier(self) -> None:
        """Wait for every rank (a no-op in a group of one)."""
        if self.world_size > 1:
            dist.barrier()

    def _close_managed(self) -> None:
        while self._managed:
            obj = self._managed.pop()
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - teardown must reach the process group whatever happens
                pass


def under_torchrun() -> bool:
    """True when torchrun (or another launcher exporting the same variables) started this process."""
    return all(os.environ.get(name) for name in _TORCHRUN_VARS)


def _check_nprocs(nprocs: Any) -> int | None:
    return integer("nprocs", nprocs, 1, optional=True)


def _check_backend(backend: Any, cuda: bool) -> str:
    if backend is None:
        return "nccl" if cuda else "gloo"
    if backend not in ("gloo", "nccl"):
        raise InvalidArgument(f"backend must be 'gloo', 'nccl' or None (chosen from the devices), got {backend!r}")
    if backend == "nccl" and not cuda:
        raise InvalidArgument("backend='nccl' needs CUDA GPUs, and torch sees none; use backend='gloo'")
    return backend


def launch(fn: Callable[..., Any], *args: Any, nprocs: int | None = None, backend: str | None = None,
           timeout_s: float = 600.0, use_cuda: bool | None = None, stall_timeout_s: float | None = None) -> Any:
    """Run ``fn(ctx, *args)`` on every rank; return rank 0's result.

    ``fn`` and ``args`` must be picklable when ranks are spawned (define ``fn`` at
    module level). ``nprocs`` (spawned launches only) defaults to the number of GPUs,
    or 2 CPU ranks without one; ``use_cuda=False`` forces CPU ranks on a GPU machine.
    ``timeout_s`` bounds joining the group and every collective, so a rank that dies
    inside a collective cannot leave the others waiting for ever. ``stall_timeout_s``
    (default: half of ``timeout_s``, at most 300 s; below ``timeout_s``) is how long a rank
    may wait in a collective before the heartbeat names the rank holding it up (one left
    behind, or one that stopped answering) and ends the job with that rank's name.
    """
    nprocs = _check_nprocs(nprocs)
    timeout_s = seconds("timeout_s", timeout_s, finite=True)
    stall_s = _check_stall(stall_timeout_s, timeout_s)
    cuda = torch.cuda.is_available() if use_cuda is None else bool(use_cuda)
    if cuda and not torch.cuda.is_available():
        raise InvalidArgument("use_cuda=True but torch sees no CUDA device")
    backend = _check_backend(backend, cuda)
    if dist.is_available() and dist.is_initialized():
        raise InvalidArgument("a process group is already initialised in this process; call fn directly, "
                              "or let launch create the group")

    if under_torchrun():
        # torchrun owns the processes; this one is a rank. nprocs does not apply.
        return _run_rank(fn, args, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                         int(os.environ["WORLD_SIZE"]), backend, cuda, float(timeout_s), threads=None,
                         stall_s=stall_s)

    n = nprocs or (torch.cuda.device_count() if cuda else _DEFAULT_CPU_RANKS)
    if cuda and n > torch.cuda.device_count():
        raise InvalidArgument(f"nprocs={n} but only {torch.cuda.device_count()} GPUs are visible; one rank per "
                              "GPU (pass use_cuda=False for CPU ranks)")
    # CPU ranks share the cores: without this each would start a thread per core and they would thrash.
    # The spawned ranks inherit this process's CPUs (its affinity mask), so they split those.
    threads = None if cuda else max(1, usable_cpus() // n)
    env = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
    if n == 1:
        with _workdir() as workdir, _environment({**env, "RANK": "0", "LOCAL_RANK": "0"}):
            return _run_rank(fn, args, 0, 0, 1, backend, cuda, float(timeout_s), threads=None,
                             init_method=_file_store(workdir))
    return _spawn(fn, args, n, env, backend, cuda, float(timeout_s), threads, stall_s)


def _check_stall(stall_timeout_s: Any, timeout_s: float) -> float:
    if stall_timeout_s is None:
        return min(300.0, timeout_s / 2)
    stall = seconds("stall_timeout_s", stall_timeout_s, finite=True)
    if stall >= timeout_s:
        raise InvalidArgument(f"stall_timeout_s={stall:g} must be below timeout_s={timeout_s:g}: the collectives "
                              "would time out before the heartbeat could name the rank that holds them up")
    return stall


@contextlib.contextmanager
def _workdir() -> Iterator[str]:
    """A private folder for this launch's rendezvous, results and errors, removed afterwards.

    Its name says which process owns it, so a launch first removes the folders of launchers that
    died without cleaning up (``kill -9``): only this user's, only real folders named so.
    """
    parent = tempfile.gettempdir()
    remove_dead_owned_dirs(parent, _WORKDIR_PREFIX)
    path = make_owned_dir(parent, _WORKDIR_PREFIX)
    try:
        yield str(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _file_store(workdir: str) -> str:
    # Rendezvous through a file private to this launch: a free TCP port picked here could be taken by
    # another job before rank 0 binds it, and ranks of two jobs would then meet each other.
    return "file://" + os.path.join(workdir, "rendezvous")


class _environment:
    """Set environment variables for a block and restore them afterwards."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_rank(fn: Callable[..., Any], args: tuple, rank: int, local_rank: int, world_size: int, backend: str,
              cuda: bool, timeout_s: float, threads: int | None, error_file: str | None = None,
              init_method: str | None = None, stall_s: float | None = None) -> Any:
    """Set up this rank, run ``fn``, and always tear down (managed objects, then the process group).

    With ``error_file``, a failure is recorded there (time, type, traceback) *before* the
    teardown: closing the group makes the other ranks fail too, and the launcher needs
    the times to tell the first failure (the cause) from its echoes.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    if cuda:
        visible = torch.cuda.device_count()
        if local_rank >= visible:  # torchrun with more ranks per node than GPUs: say so, not "invalid ordinal"
            raise InvalidArgument(f"local rank {local_rank} has no GPU: {visible} visible on this node, one rank "
                                  f"per GPU (torchrun --nproc_per_node={visible}), or use_cuda=False for CPU ranks")
        # Before the process group or any tensor: otherwise every rank's context lands on GPU 0.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    ctx = RankContext(rank, local_rank, world_size, device, backend, **_topology(world_size))
    beat = _start_heartbeat(rank, world_size, stall_s, error_file)
    try:
        result = fn(ctx, *args)
    except BaseException as exc:
        if error_file is not None:
            _record_error(error_file, rank, exc)
        if beat is not None:
            beat.close()
        ctx._close_managed()
        # No barrier here: the other ranks may never reach one. Under gloo, destroying the group makes
        # their pending collectives fail at once; under NCCL they wait for the launcher (which stops
        # them when this process exits) or the group's timeout.
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if beat is not None:
        beat.close()
    ctx._close_managed()
    # Objects made by fn (a DDP module's reducer, pending work) hold the process group; free them while
    # the group is intact, and let every rank finish its last collective before any rank tears down.
    gc.collect()
    if world_size > 1:
        dist.barrier()
    dist.destroy_process_group()
    return result


def _topology(world_size: int) -> dict[str, int]:
    """Nodes and restarts as the launcher's environment states them (torchrun sets them all; a spawned
    launch is one node that never restarts)."""
    env = os.environ
    return {"node_rank": int(env.get("GROUP_RANK", 0)), "nnodes": int(env.get("GROUP_WORLD_SIZE", 1)),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", world_size)),
            "restarts": int(env.get("TORCHELASTIC_RESTART_COUNT", 0))}


def _start_heartbeat(rank: int, world_size: int, stall_s: float | None,
                     error_file: str | None) -> heartbeat.Heartbeat | None:
    """This rank's heartbeat on the process group's store (None alone, or where torch has no such store)."""
    if world_size == 1 or stall_s is None:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a torch without it: the collectives' timeout still applies
        return None
    return heartbeat.Heartbeat(store, rank, world_size, stall_s, on_stall=_stalled(rank, error_file)).start()


def _stalled(rank: int, error_file: str | None) -> Callable[[heartbeat.Stall], None]:
    """What a rank does when its heartbeat names the ranks holding it up: say so, record it for the
    launcher (which reports it as the cause), and leave: a rank blocked in a collective has no other way out."""
    def report(stall: heartbeat.Stall) -> None:
        print(f"stoker: rank {rank}: {stall.message}", file=sys.stderr, flush=True)
        if error_file is not None:
            record = {"rank": stall.ranks[0], "time": time.time(), "error": f"stalled: {stall.message}",
                      "traceback": "", "elsewhere": False, "stalled": list(stall.ranks), "reported_by": rank}
            try:
                with open(error_file, "w", encoding="utf-8") as f:
                    json.dump(record, f)
            except OSError:
                pass
        os._exit(1)
    return report


def _record_error(path: str, rank: int, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    # `elsewhere`: the error only reports another rank's failure (stoker's agreed failures say so).
    record = {"rank": rank, "time": time.time(), "error": f"{type(exc).__name__}: {exc}", "traceback": text,
              "elsewhere": bool(getattr(exc, "elsewhere", False))}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError:
        pass  # the launcher falls back to torch's report


def _spawned_entry(local_rank: int, fn: Callable[..., Any], args: tuple, env: dict[str, str], backend: str,
                   cuda: bool, timeout_s: float, threads: int | None, workdir: str, stall_s: float) -> None:
    """Body of a spawned rank: environment, the rank itself, and rank 0's result into a file."""
    # A rank killed by a fatal signal (abort in native code, segfault) prints every thread's stack.
    faulthandler.enable(all_threads=True)
    os.environ.update(env)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    result = _run_rank(fn, args, local_rank, local_rank, int(env["WORLD_SIZE"]), backend, cuda, timeout_s, threads,
                       error_file=os.path.join(workdir, f"error-rank{local_rank}.json"),
                       init_method=_file_store(workdir), stall_s=stall_s)
    if local_rank == 0:
        torch.save(result, os.path.join(workdir, "rank0-result.pt"))
    # Leave without interpreter finalization: native threads of torch's gloo backend that outlive the
    # group can abort a process while the interpreter is torn down ("terminate called without an active
    # exception", pytorch/pytorch#179291), turning a finished rank into a failed one. The atexit handlers
    # still run first (multiprocessing's unlink the semaphores tqdm made, or the tracker reports leaks),
    # after the user's non-daemon threads finished, as a normal exit would wait for them.
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn: Callable[..., Any], args: tuple, n: int, env: dict[str, str], backend: str, cuda: bool,
           timeout_s: float, threads: int | None, stall_s: float) -> Any:
    import multiprocessing.connection

    import torch.multiprocessing as mp

    with _workdir() as workdir:
        context = mp.start_processes(_spawned_entry,
                                     args=(fn, args, env, backend, cuda, timeout_s, threads, workdir, stall_s),
                                     nprocs=n, join=False, start_method="spawn")
        # Who had died when the first failure showed: torch's join then stops the others (SIGTERM),
        # and may report one of those, or an echo of the first failure, as the cause.
        dead_at_failure = _wait_for_first_failure(context.processes, multiprocessing.connection.wait)
        try:
            while not context.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise _diagnose(workdir, exc, dead_at_failure) from None
        result_path = os.path.join(workdir, "rank0-result.pt")
        if not os.path.exists(result_path):
            return None
        return torch.load(result_path, weights_only=False)


def _wait_for_first_failure(processes: list, wait: Callable[..., Any]) -> dict[int, int]:
    """Block until every process ended well or one failed; then the exit codes of those already ended."""
    while True:
        codes = {i: p.exitcode for i, p in enumerate(processes) if p.exitcode is not None}
        if any(code != 0 for code in codes.values()) or len(codes) == len(processes):
            return codes
        wait([p.sentinel for i, p in enumerate(processes) if i not in codes], timeout=1.0)


def _diagnose(workdir: str, exc: Exception, dead_at_failure: dict[int, int]) -> RankFailed:
    """The rank that failed first: one killed by a signal without a Python error (OOM killer, segfault)
    before the launcher stopped anyone, else the earliest recorded Python error."""
    recorded = {r["rank"] for r in _error_records(workdir)}
    for rank, code in sorted(dead_at_failure.items()):
        if code < 0 and rank not in recorded:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return _rank_died(workdir, rank, f"rank {rank} was killed by signal {name} without a Python error "
                                             "(out of memory, or killed); the other ranks were stopped")
    index = getattr(exc, "error_index", 0)
    return _rank_failed(workdir, index, str(exc))


def _error_records(workdir: str) -> list[dict]:
    """The failures ranks recorded: causes before reports of another rank's failure, then earliest first."""
    records = []
    for name in os.listdir(workdir):
        if name.startswith("error-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(workdir, name), encoding="utf-8") as f:
                    records.append(json.load(f))
            except (OSError, ValueError):
                continue
    return sorted(records, key=lambda r: (r.get("elsewhere", False), r["time"]))


def _echoes(records: list[dict]) -> str:
    return "".join(f"\n  rank {r['rank']} then failed with {r['error'].splitlines()[0][:200]}" for r in records)


def _rank_died(workdir: str, rank: int, detail: str) -> RankFailed:
    """A rank vanished without a Python error (signal, OOM killer): it is the cause, whatever the others say."""
    others = [r for r in _error_records(workdir) if r["rank"] != rank]
    return RankFailed(detail + _echoes(others), rank=rank, traceback="")


def _rank_failed(workdir: str, reported_rank: int, reported: str) -> RankFailed:
    """RankFailed for the rank that failed *first*: when one rank dies, its peers fail in their
    collectives a moment later, and torch may report one of those echoes instead of the cause."""
    records = _error_records(workdir)
    if not records:
        return RankFailed(f"rank {reported_rank} failed; the other ranks were stopped.\n\n{reported.strip()}",
                          rank=reported_rank, traceback=reported.strip())
    first = records[0]
    later = _echoes(records[1:])
    if first.get("stalled"):  # a heartbeat's verdict: no traceback, the ranks it names
        return RankFailed(f"rank {first['rank']} held the job up: {first['error']}\n(the other ranks were stopped)"
                          f"{later}", rank=first["rank"], traceback="", error=first["error"],
                          stalled=first["stalled"])
    return RankFailed(f"rank {first['rank']} failed: {first['error']}\n(the other ranks were stopped){later}\n\n"
                      f"traceback of rank {first['rank']}:\n{first['traceback'].strip()}",
                      rank=first["rank"], traceback=first["traceback"], error=first["error"])
