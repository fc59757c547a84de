"""Durable renames: flush data, then the directory entries, so a rename never reaches disk before its data.

>>> replace_atomically(Path("stats.json"), lambda f: f.write(b"{}"))   # one file
>>> tmp = make_sibling_dir(final); ...; fsync_tree(tmp); os.replace(tmp, final); fsync_dir(final.parent)

Temporary files and directories get a hidden sibling name, ``.<name>.<kind>-<host>-<pid>-<random>``,
that says who wrote it, so a later writer can remove what a dead one left
(:func:`remove_dead_siblings`). They are created exclusively (``O_CREAT|O_EXCL``,
``mkdir``): whatever already sits at a name, a symlink planted by someone who can
write into a shared folder included, is never opened or written through; another
name is drawn instead. The final rename replaces a symlink at the final name
itself, never its target.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import stat
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Callable, TypeVar

__all__ = ["HOST", "STALE_AFTER_S", "fsync_dir", "fsync_tree", "is_temp_path", "make_owned_dir",
           "make_sibling_dir", "remove_dead_owned_dirs", "remove_dead_siblings", "remove_dead_temp_files",
           "replace_atomically", "sibling_path", "writer_gone"]

#: This machine as it appears in sibling names (path-safe, at most 40 characters).
HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"
#: A sibling left by another machine, whose writer cannot be asked, is removed after this long.
STALE_AFTER_S = 24 * 3600
_OWNER = r"(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-[0-9a-f]{8}"
_SIBLING = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-" + _OWNER)
_LEGACY_TEMP_FILE = re.compile(r"\..+\.tmp-\d+")  # `.<name>.tmp-<pid>`: older stoker versions
_ATTEMPTS = 100  # fresh random names to try when one is taken (by chance, or planted)
_T = TypeVar("_T")


def sibling_path(final: str | os.PathLike, kind: str) -> Path:
    """A fresh hidden sibling name of ``final`` for something being written (``kind="tmp"``) or an old
    directory moved aside (``"old"``): ``.<name>.<kind>-<host>-<pid>-<random>``. Only a name: create it
    with :func:`make_sibling_dir` or :func:`replace_atomically`, which never reuse an existing entry."""
    final = Path(final)
    return final.with_name(f".{final.name}.{kind}-{_owner_tag()}")


def _owner_tag() -> str:
    return f"{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def is_temp_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` is named as :func:`replace_atomically` names its temporary files (or as older
    stoker versions did, ``.<name>.tmp-<pid>``)."""
    name = os.path.basename(path)
    m = _SIBLING.fullmatch(name)
    return (m is not None and m["kind"] == "tmp") or _LEGACY_TEMP_FILE.fullmatch(name) is not None


def _fresh(make_name: Callable[[], Path], create: Callable[[Path], _T]) -> tuple[Path, _T]:
    """``create(name)`` at the first of fresh random names that does not exist yet."""
    for _ in range(_ATTEMPTS):
        path = make_name()
        try:
            return path, create(path)
        except FileExistsError:
            continue  # taken: by chance, or planted there; never reuse what is there
    raise FileExistsError(errno.EEXIST, f"no free name after {_ATTEMPTS} random tries, last", str(path))


def _create_file(path: Path) -> int:
    # O_EXCL: fails on any existing entry, a symlink included (never followed); 0o666 less the umask,
    # as open(path, "w") would give, so a file others read (the statistics sidecar) stays readable.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, 0o666)


def make_sibling_dir(final: str | os.PathLike, kind: str = "tmp") -> Path:
    """Create a new empty hidden sibling directory of ``final`` (see :func:`sibling_path`) and return it.

    ``mkdir`` fails on any existing entry, so nothing planted at the name is ever written into.
    """
    return _fresh(lambda: sibling_path(final, kind), os.mkdir)[0]


def _owned_name(parent: Path, prefix: str) -> Path:
    return parent / f"{prefix}-{_owner_tag()}"


def make_owned_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """Create ``parent/<prefix>-<host>-<pid>-<random>``, private to this user (mode 0o700), and return it.

    The name says who owns it, so :func:`remove_dead_owned_dirs` can remove it once this process is gone.
    """
    parent = Path(parent)
    return _fresh(lambda: _owned_name(parent, prefix), lambda p: os.mkdir(p, 0o700))[0]


def _gone(host: str, pid: int, path: str | os.PathLike) -> bool:
    """Whether process ``pid`` of ``host`` is gone (another machine's: ``path`` older than
    :data:`STALE_AFTER_S`)."""
    if host != HOST:  # cannot ask another machine: rely on age
        try:
            return time.time() - os.lstat(path).st_mtime > STALE_AFTER_S
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


def writer_gone(path: str | os.PathLike) -> bool:
    """Whether the process that named the sibling ``path`` is gone (another machine's: older than
    :data:`STALE_AFTER_S`). False for any other name."""
    m = _SIBLING.fullmatch(os.path.basename(path))
    return m is not None and _gone(m["host"], int(m["pid"]), path)


def _remove_entry(entry: Path) -> bool:
    """Remove a directory tree or a file; a symlink is removed itself, never followed. True when gone."""
    try:
        if stat.S_ISDIR(os.lstat(entry).st_mode):
            shutil.rmtree(entry, ignore_errors=True)  # does not follow symlinks inside (fd-based on Linux)
        else:
            entry.unlink(missing_ok=True)
    except OSError:
        pass
    return not os.path.lexists(entry)


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
        if m is not None and m["name"] == final.name and writer_gone(entry) and _remove_entry(entry):
            removed.append(entry)
    return removed


def remove_dead_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporary files in ``directory`` (any final name) that dead writers left; returns them.

    Only regular files named as :func:`is_temp_path` says are removed: never a directory, never a
    symlink (nor what it points to), never a live writer's file. Files named the old way
    (``.<name>.tmp-<pid>``) come from older stoker versions and are removed whatever their pid.
    """
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not is_temp_path(entry):
            continue
        m = _SIBLING.fullmatch(entry.name)
        try:
            regular = stat.S_ISREG(os.lstat(entry).st_mode)
        except OSError:
            continue
        if regular and (m is None or writer_gone(entry)):
            try:
                entry.unlink()
            except FileNotFoundError:
                continue
            removed.append(entry)
    return removed


def remove_dead_owned_dirs(parent: str | os.PathLike, prefix: str) -> list[Path]:
    """Remove the directories :func:`make_owned_dir` made in ``parent`` under ``prefix`` whose owner
    process is gone; returns what was removed.

    Only real directories (not symlinks) owned by this user and named exactly so are touched.
    """
    pattern = re.compile(re.escape(prefix) + "-" + _OWNER)
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return []
    removed = []
    uid = os.getuid() if hasattr(os, "getuid") else None
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None:
            continue
        try:
            st = os.lstat(entry)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or (uid is not None and st.st_uid != uid):
            continue
        if _gone(m["host"], int(m["pid"]), entry) and _remove_entry(entry):
            removed.append(entry)
    return removed


def replace_atomically(final: Path, write: Callable[[BinaryIO], object]) -> Path:
    """Write ``final`` through a fresh temporary sibling: ``write(f)``, flush, fsync, rename, fsync the directory.

    Readers see the old file or the complete new one, never a part. The temporary file
    is created exclusively under an unpredictable name, so nothing planted next to
    ``final`` is written through; a symlink at ``final`` itself is replaced, not
    followed. On any error the temporary file is removed (when the directory allows)
    and the error propagates.
    """
    final = Path(final)
    tmp, fd = _fresh(lambda: sibling_path(final, "tmp"), _create_file)
    try:
        with os.fdopen(fd, "wb") as f:
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
