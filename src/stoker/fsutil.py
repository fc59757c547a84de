"""Durable renames: flush data, then the directory entries, so a rename never reaches disk before its data.

>>> replace_atomically(Path("stats.json"), lambda f: f.write(b"{}"))   # one file
>>> tmp = sibling_path(final, "tmp"); ...; fsync_tree(tmp); os.replace(tmp, final); fsync_dir(final.parent)

Directories are written under a hidden sibling name, ``.<name>.<kind>-<host>-<pid>-<random>``,
that says who wrote it, so a later writer can remove what a dead one left
(:func:`remove_dead_siblings`).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["HOST", "STALE_AFTER_S", "fsync_dir", "fsync_tree", "is_temp_path", "remove_dead_siblings",
           "replace_atomically", "sibling_path", "temp_path", "writer_gone"]

#: This machine as it appears in sibling names (path-safe, at most 40 characters).
HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"
#: A sibling left by another machine, whose writer cannot be asked, is removed after this long.
STALE_AFTER_S = 24 * 3600
_SIBLING = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-[0-9a-f]{8}")
_TEMP_FILE = re.compile(r"\..+\.tmp-\d+")


def temp_path(final: Path) -> Path:
    """The hidden temporary name a writer in this process uses for ``final``: ``.<name>.tmp-<pid>``."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def is_temp_path(path: Path) -> bool:
    """Whether ``path`` is named as :func:`temp_path` names temporary files."""
    return _TEMP_FILE.fullmatch(path.name) is not None


def sibling_path(final: str | os.PathLike, kind: str) -> Path:
    """A fresh hidden sibling of ``final`` for a directory being written (``kind="tmp"``) or an old one
    moved aside (``"old"``): ``.<name>.<kind>-<host>-<pid>-<random>``."""
    final = Path(final)
    return final.with_name(f".{final.name}.{kind}-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def writer_gone(path: str | os.PathLike) -> bool:
    """Whether the process that named the sibling ``path`` is gone (another machine's: older than
    :data:`STALE_AFTER_S`). False for any other name."""
    m = _SIBLING.fullmatch(os.path.basename(path))
    if m is None:
        return False
    host, pid = m["host"], int(m["pid"])
    if host != HOST:  # cannot ask another machine: rely on age
        try:
            return time.time() - os.stat(path).st_mtime > STALE_AFTER_S
        except OSError:
            return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (a pid beyond pid_t cannot exist)
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def remove_dead_siblings(final: str | os.PathLike) -> list[Path]:
    """Remove the ``tmp``/``old`` siblings of ``final`` whose writer is gone; returns what was removed."""
    final = Path(final)
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return []
    removed = []
    for entry in entries:
        m = _SIBLING.fullmatch(entry.name)
        if m is not None and m["name"] == final.name and writer_gone(entry):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            if not os.path.lexists(entry):
                removed.append(entry)
    return removed


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
