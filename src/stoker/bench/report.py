"""``stoker bench --json``: the numbers of a bench run as one JSON document (``plots.plot_bench`` draws it).

The document: ``{"title", "stoker", "python", "torch", "cores", "suite", "device", "scenarios": [...]}``;
each scenario ``{"number", "title", "batch_size", "timed_batches", "step_ms", "compression_ratio", "peers": [...]}``
(``compression_ratio``: the dataset's decoded bytes over its stored bytes; null where not measured); each peer
``{"peer", "samples_per_s", "mb_per_s", "peak_rss_bytes", "seconds", "samples", "rounds"}`` (``rounds``:
samples/s of every interleaved round; the peer's numbers are its median round's), and for stoker's peers
``read_amplification``, ``decode_amplification`` and, where the CPU time was measured, ``breakdown``
(CPU ms per batch, by stage), and ``workers`` (:func:`worker_breakdown`: where each compiled-engine
thread's time went and the coordinator's CPU per batch). With ``--store``, every peer's ``requests_per_batch`` and ``bytes_per_batch``
(as the server counted them while the peer was timed).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from .. import __version__

__all__ = ["document", "peer_record", "scenario_record", "stage_breakdown", "worker_breakdown", "write"]


def stage_breakdown(stats: Any, cpu_s: float, batches: int, wall_s: float, gc_s: float = 0.0) -> dict[str, Any]:
    """stoker's CPU time per timed batch (ms) and its split by stage: decode, read, cast, plan (the
    coordinator's CPU planning), and other (the rest: Python bookkeeping, the consumer); GIL-held time and the
    garbage collections in it. Decode, read and cast are thread time, waits for a core included; plan is the
    coordinator's CPU time alone (thread CPU), and its waits are apart. Apart from the CPU,
    ``plan_wait_ms_per_batch``: the coordinator's wall time planning that was no CPU (waits for arrays' opens
    and shard indexes from a store, for a core, the GIL)."""
    stages = {"decode": stats.stages["decode"].seconds, "read": stats.stages["io"].seconds,
              "cast": stats.stages["assemble"].seconds, "plan": stats.stages["plan"].seconds}
    stages["other"] = cpu_s - sum(stages.values())
    per = 1e3 / batches if batches > 0 else 0.0
    return {"cpu_ms_per_batch": cpu_s * per, "cores_busy": cpu_s / wall_s if wall_s > 0 else 0.0,
            "cpu_s": cpu_s, "stages_ms_per_batch": {k: v * per for k, v in stages.items()},
            "gil_ms_per_batch": stats.gil_seconds * per, "gc_ms_per_batch": gc_s * per,
            "plan_wait_ms_per_batch": (stats.stages["plan_wait"].seconds if "plan_wait" in stats.stages else 0.0) * per}


def worker_breakdown(stats: Any, batches: int, wall_s: float) -> dict[str, Any]:
    """Where the compiled engine's threads spent the timed window (``Stats.workers``) and what the
    coordinator cost: ``threads``; ``busy_share`` (mean over threads, and its ``busy_min`` / ``busy_max``:
    not waiting for a lock, for work or for the budget); ``shares``: each of ``WORKER_TIMES`` as a share of
    the threads' wall time; ``on_cpu_share`` / ``run_queue_share``: the OS's view of the same wall time
    (None off Linux); ``us_per_chunk``: each time per chunk (read, decode, copy, and busy: all the work),
    and ``cpu_us_per_chunk`` the threads' CPU time per chunk (the OS's; None off Linux);
    ``coordinator_ms_per_batch`` (its CPU), ``coordinator_cores`` (that CPU over the window's wall time)
    and ``coordinator_run_queue_ms_per_batch`` (runnable, waiting for a core); ``per_thread``: each thread's seconds."""
    from ..engine.stats import WORKER_TIMES

    workers = list(stats.workers)
    wall = sum(w.wall for w in workers)
    chunks = sum(w.chunks for w in workers)

    def share(values: list) -> float | None:
        return None if not workers or wall <= 0 or any(v is None for v in values) else sum(values) / wall

    busy = [w.busy_share for w in workers]
    return {
        "threads": len(workers),
        "busy_share": share([w.busy for w in workers]) or 0.0,
        "busy_min": min(busy, default=0.0), "busy_max": max(busy, default=0.0),
        "shares": {name: share([getattr(w, name) for w in workers]) or 0.0 for name in WORKER_TIMES},
        "on_cpu_share": share([w.on_cpu for w in workers]),
        "run_queue_share": share([w.run_queue for w in workers]),
        "us_per_chunk": {name: (sum(getattr(w, name) for w in workers) / chunks * 1e6 if chunks else 0.0)
                         for name in ("read", "decode", "copy", "busy")},
        # the OS's CPU time per chunk: the work alone, whatever time the threads spent off a core
        "cpu_us_per_chunk": (None if not chunks or any(w.on_cpu is None for w in workers) else
                             sum(w.on_cpu for w in workers) / chunks * 1e6),
        "chunks": chunks,
        "coordinator_ms_per_batch": stats.coordinator_seconds * 1e3 / batches if batches > 0 else 0.0,
        "coordinator_cores": stats.coordinator_seconds / wall_s if wall_s > 0 else 0.0,
        "coordinator_run_queue_ms_per_batch": (None if stats.coordinator_run_queue is None or batches <= 0 else
                                               stats.coordinator_run_queue * 1e3 / batches),
        "per_thread": [{**{name: getattr(w, name) for name in WORKER_TIMES}, "wall": w.wall, "chunks": w.chunks,
                        "on_cpu": w.on_cpu, "run_queue": w.run_queue} for w in workers],
    }


def peer_record(r: Any) -> dict[str, Any]:
    """One peer's result (a ``bench.runner.Result``) as plain numbers."""
    out: dict[str, Any] = {"peer": r.peer, "samples_per_s": r.samples_per_s, "mb_per_s": r.mb_per_s,
                           "peak_rss_bytes": r.peak_rss, "seconds": r.seconds, "samples": r.samples,
                           "rounds": list(r.extra.get("rounds") or [r.samples_per_s])}
    stats = r.extra.get("stats")
    if stats is not None:
        out["read_amplification"] = _number(stats.read_amplification)
        out["decode_amplification"] = _number(stats.decode_amplification)
    if "cpu_s" in r.extra and r.extra.get("batches"):
        out["breakdown"] = stage_breakdown(stats, r.extra["cpu_s"], r.extra["batches"], r.seconds,
                                           r.extra.get("gc_s", 0.0))
    if stats is not None and r.extra.get("batches") and hasattr(stats, "workers"):
        out["workers"] = worker_breakdown(stats, r.extra["batches"], r.seconds)
    for key in ("first_batch_s", "host_buffer_bytes", "pinned_bytes", "requests_per_batch", "bytes_per_batch",
                "thread_cpu"):
        if key in r.extra:
            out[key] = r.extra[key]
    alone = r.extra.get("alone")
    if alone:
        out["alone"] = {k: v for k, v in alone.items() if isinstance(v, (int, float))}
    return out


def scenario_record(sc: Any, results: list[Any], timed_batches: int, batch_size: int | None = None,
                    step_s: float | None = None, compression: float | None = None) -> dict[str, Any]:
    """A scenario's results: what ran, its dataset's compression ratio and every peer's numbers."""
    return {"number": sc.number, "title": sc.title, "batch_size": batch_size, "timed_batches": timed_batches,
            "step_ms": None if step_s is None else step_s * 1e3, "compression_ratio": compression,
            "peers": [peer_record(r) for r in results]}


def document(scenarios: list[dict[str, Any]], *, suite: str, device: str, title: str) -> dict[str, Any]:
    import torch

    return {"title": title, "stoker": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "cores": os.cpu_count(), "suite": suite, "device": device, "scenarios": scenarios}


def write(path: str | os.PathLike, doc: dict[str, Any]) -> Path:
    """Write ``doc`` as JSON (strict: non-finite numbers become null), replacing ``path`` whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(_strict(doc), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _number(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def _strict(value: Any) -> Any:
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value
