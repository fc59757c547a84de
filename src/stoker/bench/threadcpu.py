"""Each of a pipeline's threads' CPU time over a bench peer's timed window, by role, per batch
(``stoker bench --thread-cpu``): the serial work of a batch (the coordinator's planning and submitting, the
consumer's pop, the finisher) beside the compiled engine's threads, which is what bounds scaling to many
cores (Amdahl: the Python threads share one GIL, whatever the engine's thread count).

Roles, by thread name: ``coordinator`` (``stoker-coordinator``), ``finisher`` (``stoker-engine-finisher``),
``consumer`` (the thread that marks the window: the bench's loop of pops), ``pools`` (stoker's other Python
threads: I/O, opens, the Python decode path, an object store's loop, the disk cache); ``engine``: the compiled
engine's threads (their own OS count, :attr:`stoker.engine.stats.Stats.workers`); ``other``: the rest of the
process's CPU (threads not named here, or gone before the window ended).

>>> clock = ThreadCPU()
>>> clock.mark(); run_the_timed_batches(); clock.mark()
>>> clock.per_batch(batches=120, engine_s=sum(w.on_cpu for w in stats.workers))
{'coordinator': 0.91, 'finisher': 0.1, 'consumer': 0.42, 'pools': 0.0, 'engine': 10.6, 'other': 0.3, 'process': 12.3}
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..runtime.schedstat import run_times

#: the roles reported, in the table's order (ms of CPU per batch each), then the process's total
ROLES = ("coordinator", "finisher", "consumer", "pools", "engine", "other")
#: the Python threads of the pipeline's serial work per batch: they take turns holding the GIL
SERIAL = ("coordinator", "finisher", "consumer")


def role(name: str) -> str | None:
    """The role of the Python thread called ``name`` (None: not a pipeline thread)."""
    if name == "stoker-coordinator":
        return "coordinator"
    if name == "stoker-engine-finisher":
        return "finisher"
    if name.startswith("stoker-"):
        return "pools"
    return None


class ThreadCPU:
    """Marks of every Python thread's CPU time (the OS's count of its time on a core; Linux only) and the
    process's; the thread that marks is the consumer."""

    def __init__(self) -> None:
        self.marks: list[tuple[dict[int, tuple[str, float | None]], float, int]] = []

    def mark(self) -> None:
        """Read every Python thread's clock now (the window's start, then its end)."""
        threads: dict[int, tuple[str, float | None]] = {}
        me = threading.get_native_id()
        for t in threading.enumerate():
            tid = t.native_id
            if tid is not None and tid != me:
                ran = run_times(tid)
                threads[tid] = (t.name, None if ran is None else ran[0])
        # this thread's own clock last and from the same count as the process's: schedstat's figure for the
        # thread reading it lags by the slice it is running (up to a scheduler tick, a few ms), thread_time's not
        if run_times(me) is not None:
            threads[me] = (threading.current_thread().name, time.thread_time())
        self.marks.append((threads, time.process_time(), me))

    def per_batch(self, batches: int, engine_s: float | None = None, consumer_extra_s: float = 0.0) -> dict[str, Any]:
        """Milliseconds of CPU per batch of each role between the first and last marks, and ``process`` (every
        thread's); None for a role the OS does not count here. ``engine_s``: the engine threads' CPU seconds in
        the window; ``consumer_extra_s``: the consumer's CPU that is not the pipeline's (a busy step)."""
        (start, cpu0, _), (end, cpu1, consumer) = self.marks[0], self.marks[-1]
        seconds: dict[str, float | None] = dict.fromkeys(ROLES, 0.0)
        seconds["engine"] = engine_s
        for tid, (name, now) in end.items():
            kind = "consumer" if tid == consumer else role(name)
            if kind is None:
                continue
            before = start.get(tid, (name, 0.0))[1]  # a thread started in the window: all of its time
            if now is None or before is None:
                seconds[kind] = None
            elif seconds[kind] is not None:
                seconds[kind] += now - before  # type: ignore[operator]
        if seconds["consumer"] is not None:
            seconds["consumer"] = max(0.0, seconds["consumer"] - consumer_extra_s)
        process = cpu1 - cpu0 - consumer_extra_s
        known = [v for k, v in seconds.items() if k != "other"]
        seconds["other"] = None if any(v is None for v in known) else max(0.0, process - sum(known))  # type: ignore[arg-type]
        out: dict[str, Any] = {k: None if v is None else v * 1e3 / batches for k, v in seconds.items()}
        out["process"] = process * 1e3 / batches
        return out


def thread_cpu_table(results: list) -> list[str]:
    """Lines of a table: per stoker peer (bench ``Result`` with ``extra["thread_cpu"]``), each role's CPU per
    batch, the Python threads' serial part (coordinator, finisher, consumer) and the rate it allows, and the
    coordinator's share of one core over the window."""
    rows = [r for r in results if r.extra.get("thread_cpu") and r.extra.get("batches")]
    if not rows:
        return []

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    out = ["CPU per batch by thread (ms; each thread's time on a core in the timed window; serial: the Python "
           "threads of every batch, which share the GIL, and the samples/s their CPU alone allows):",
           f"{'peer':<14}" + "".join(f"{name:>12}" for name in (*ROLES, "process", "serial")) + f"{'serial max/s':>14}"
           f"{'coord cores':>12}"]
    for r in rows:
        t = r.extra["thread_cpu"]
        serial = None if any(t[k] is None for k in SERIAL) else sum(t[k] for k in SERIAL)
        rate = f"{r.samples / r.extra['batches'] * 1e3 / serial:,.0f}" if serial else "-"
        busy = (f"{t['coordinator'] * r.extra['batches'] / 1e3 / r.seconds:.2f}"
                if t["coordinator"] is not None and r.seconds > 0 else "-")
        out.append(f"{r.peer:<14}" + "".join(f"{ms(t[k]):>12}" for k in (*ROLES, "process")) + f"{ms(serial):>12}"
                   f"{rate:>14}{busy:>12}")
    return out
