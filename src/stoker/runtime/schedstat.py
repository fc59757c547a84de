"""What the OS says of a thread's time: seconds it ran on a core and seconds it was runnable but waited
for one (Linux's ``/proc/self/task/<tid>/schedstat``). A thread busy on its own clocks but waiting in the
run queue shows a machine with more runnable threads than cores. None where the file is not there (other
systems, a kernel without schedstats, a thread that has left).

>>> run_times(tid)            # (on a core, waiting for one), seconds since the thread started
(1.93, 0.04)
"""

from __future__ import annotations

__all__ = ["run_times"]


def run_times(tid: int) -> tuple[float, float] | None:
    """``(seconds on a core, seconds runnable and waiting)`` of thread ``tid`` of this process, or None."""
    if tid <= 0:
        return None
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu) * 1e-9, int(waiting) * 1e-9
    except (OSError, ValueError):
        return None
