"""Durable renames: flush data, then the directory entries, so a rename never reaches disk before its data.

>>> replace_atomically(Path("stats.json"), lambda f: f.write(b"{}"))   # one file
>>> fsync_tree(tmp_dir); os.replace(tmp_dir, final); fsync_dir(parent_of_final)   # a directory
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["fsync_dir", "fsync_tree", "replace_atomically", "temp_path"]


def temp_path(final: Path) -> Path:
    """The hidden temporary name a writer in this process uses for ``final``: ``.<name>.tmp-<pid>``."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def replace_atomically(final: Path, write: Callable[[BinaryIO], object]) -> Path:
    """Write ``final`` through :func:`temp_path`: ``write(f)``, flush, fsync, rename, fsync the directory.

    Readers see the old file or the complete new one, never a part. On any error the
    temporary file is removed (when the directory allows) and the error propagates.
    """
    tmp = temp_path(final)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the directory itself is the problem; nothing was left behind in it
        raise
    fsync_dir(final.parent)
    return final


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
