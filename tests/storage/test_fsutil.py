"""Durable writes: the hidden siblings a dead writer left are removed, nothing else."""

from __future__ import annotations

import os
import time

import pytest


pytestmark = pytest.mark.timeout(60)


def test_dead_writers_siblings_are_removed_and_nothing_else(tmp_path):
    import subprocess
    import sys

    from stoker.storage import fsutil

    final = tmp_path / "knn"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    mine = fsutil.sibling_path(final, "tmp")  # this process: alive
    dead = tmp_path / f".knn.old-{fsutil.HOST}-{proc.pid}-0123abcd"
    other_host_fresh = tmp_path / ".knn.tmp-elsewhere-1-0123abcd"
    other_host_stale = tmp_path / ".knn.tmp-elsewhere-2-0123abcd"
    other_name = tmp_path / f".knn2.tmp-{fsutil.HOST}-{proc.pid}-0123abcd"
    unrelated = tmp_path / ".knn.tmp-notes"
    for d in (mine, dead, other_host_fresh, other_host_stale, other_name, unrelated):
        d.mkdir()
    old = time.time() - fsutil.STALE_AFTER_S - 60
    os.utime(other_host_stale, (old, old))
    assert mine.name.startswith(f".knn.tmp-{fsutil.HOST}-{os.getpid()}-")
    assert sorted(fsutil.remove_dead_siblings(final)) == sorted([dead, other_host_stale])
    assert all(d.exists() for d in (mine, other_host_fresh, other_name, unrelated))
    assert fsutil.is_temp_path(fsutil.sibling_path(tmp_path / "step-000000001.pt", "tmp"))
    assert fsutil.is_temp_path(tmp_path / ".step-000000001.pt.tmp-999")  # as older versions named them
    assert not fsutil.is_temp_path(tmp_path / "step-000000001.pt")
    assert not fsutil.is_temp_path(dead)  # an old directory moved aside
