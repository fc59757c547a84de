"""Signal masks of this process's threads, read from /proc (tests/engine/test_native_engine.py,
tests/gpu/test_gpu_native_reads.py): the compiled engine's threads block the process's signals, so that
none cuts a read short (EINTR); the thread that started them still takes them."""

from __future__ import annotations

import signal
import threading

#: the signals meant for the process: Ctrl-C, a launcher's SIGTERM, timers, children
PROCESS_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGCHLD)


def blocked(tid) -> int:
    """Thread ``tid``'s blocked signals (its ``SigBlk`` mask: bit ``n - 1`` for signal ``n``)."""
    with open(f"/proc/self/task/{tid}/status") as f:
        return int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)


def assert_block_process_signals(tids) -> None:
    """Each of ``tids`` blocks every signal of :data:`PROCESS_SIGNALS`; the calling thread does not block
    SIGINT."""
    for tid in tids:
        mask = blocked(tid)
        for sig in PROCESS_SIGNALS:
            assert mask >> (sig - 1) & 1, (tid, hex(mask), sig)
    assert not blocked(threading.get_native_id()) >> (signal.SIGINT - 1) & 1
