"""The demo volume on a file system that does not take it: a StorageError naming the path and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

_WRITE = r"""
import resource, signal, sys
import stoker
from stoker.demo.volume import ensure_volume

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))  # no file may grow past 16 KiB: a full disk
try:
    ensure_volume(sys.argv[1], shape=(32, 128, 128), progress=False)
except stoker.StorageError as exc:
    print(type(exc).__name__, exc.uri, exc.errno)
    print(exc)
"""


def test_a_volume_the_disk_does_not_take_is_a_storage_error(tmp_path):
    where = tmp_path / "cache" / "demo-volume-v2.zarr"
    out = subprocess.run([sys.executable, "-c", _WRITE, str(where)], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    head, message = out.stdout.splitlines()[-2:]
    assert head.split() == ["StorageError", str(where), "27"]  # EFBIG, as the kernel said it
    assert "the disk (or a quota, or a file size limit) is full" in message
    assert "File too large" in message and "set STOKER_CACHE to a folder with room" in message
    assert "up to 1 MiB" in message
    assert not where.exists() and os.listdir(where.parent) == []  # nothing half-written left behind
