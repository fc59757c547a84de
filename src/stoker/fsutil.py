"""Durable renames: flush data, then the directory entries, so a rename never reaches disk before its data.

>>> fsync_tree(tmp_dir); os.replace(tmp_dir, final); fsync_dir(parent_of_final)
"""

from __future__ import annotations

import os

__all__ = ["fsync_dir", "fsync_tree"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (new, renamed or removed names); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # some filesystems do not open directories; renames there are still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass  # e.g. EINVAL on filesystems without directory fsync
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """Flush every file, then every directory, under ``path`` (deepest first)."""
    for dirpath, _, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)
