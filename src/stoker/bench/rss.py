"""The peak resident memory of the bench's process while a block runs, with no thread waking during it.

>>> with RssSampler() as rss:
...     run_peer()
>>> rss.peak   # bytes

On Linux the peak is the kernel's own high-water mark of the process's resident pages (``VmHWM`` in
/proc/self/status): set back to the resident size of the moment at the block's start (``5`` written to
/proc/self/clear_refs, Linux 4.0 and later) and read at its end. The kernel keeps it as the block runs (it
raises the mark before it unmaps pages: munmap, madvise, a freed arena; reading it takes the larger of the mark
and the resident size now), so an allocation that lives a millisecond is caught, where sampling caught only
what lived across a sample. Before, a thread read /proc/self/statm every 2 ms, taking the GIL each time from
the peer it measured: most of what ``--thread-cpu`` counted as "other". Samplers may nest: before the mark is
set back, every open one takes it as its peak so far. Setting it back also sets back what
``getrusage(RUSAGE_SELF).ru_maxrss`` reports for the process (the same mark), which the bench does not read.
Where the mark cannot be set back (no /proc, clear_refs not writable), a thread samples statm every
:data:`SAMPLE_S` as before.
"""

from __future__ import annotations

import threading

from ..dist.telemetry import host_rss_bytes as rss_bytes

#: How often the fallback thread reads the resident size (where the kernel's mark cannot be set back).
SAMPLE_S = 0.002

_open: list["RssSampler"] = []  # samplers using the kernel's mark, open now
_lock = threading.Lock()


def high_water_bytes() -> int | None:
    """The kernel's high-water mark of this process's resident memory (``VmHWM``), or None without /proc."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _set_back_high_water() -> bool:
    """Set the kernel's mark back to the resident size now; False where it cannot be (then nothing changed)."""
    try:
        with open("/proc/self/clear_refs", "wb", buffering=0) as f:
            f.write(b"5")
    except OSError:
        return False
    return True


class RssSampler:
    """Peak resident memory (``peak``, bytes) of this process while the block runs (see the module docstring)."""

    def __enter__(self) -> "RssSampler":
        self.peak = rss_bytes()
        self._thread: threading.Thread | None = None
        with _lock:
            mark = high_water_bytes()
            if mark is not None:
                for outer in _open:  # their peak so far, before it is set back
                    outer.peak = max(outer.peak, mark)
                if _set_back_high_water():
                    _open.append(self)
                    return self
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stoker-bench-rss", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            with _lock:
                self.peak = max(self.peak, high_water_bytes() or 0)
                _open.remove(self)
        else:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())
