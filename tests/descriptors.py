"""Counting this process's open files by where they point, for tests that check nothing is left open."""

from __future__ import annotations

import os


def open_under(root) -> int:
    """This process's descriptors of files under ``root`` (a test's own folder): not a count of all of them,
    which a long test run's process changes meanwhile (an earlier test's HTTP connections closed when idle, its
    files closed by the garbage collector: a full count once fell by 6 during a test, "descriptors leaked")."""
    root, n = os.path.join(str(root), ""), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(root)
        except OSError:  # closed since the listing
            pass
    return n
