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

Write-once artifacts (a dataset, a precomputed array, a checkpoint) that several processes on several
machines may want to write into one shared folder at the same moment go through :func:`write_once`
(a directory) or :func:`write_file_once` (a file)::

    >>> write_once(final, build, is_complete=marker_matches)   # build(tmp) writes the artifact and its marker

A complete artifact is reused without writing anything. Otherwise the writers race for a *claim*, a file
``.<name>.claim`` next to ``final`` created with ``O_CREAT|O_EXCL`` (atomic on local file systems, NFS
v3+, Lustre and GPFS) that names its holder (host, pid, start time, a token). The holder builds into its
own temporary sibling, renames it into place and removes the claim; the others wait for the claim to go
(bounded: :class:`~stoker.errors.ClaimTimeout` names the holder), then find the complete artifact. A
claim whose holder is gone is taken over: on the same machine when its pid is dead, from anywhere once
a waiter has seen its file unchanged for :data:`CLAIM_STALE_S` (the holder refreshes its mtime from a
daemon thread while it works, so a live slow writer on another node is never taken over; the waiter
times that with its own clock, so clocks that disagree between machines do not matter).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, TypeVar

from ..checks import seconds
from ..errors import ClaimTimeout, InvalidArgument, StorageError

__all__ = ["CLAIM_STALE_S", "HOST", "STALE_AFTER_S", "WAIT_S", "Claim", "Claimant", "claim", "claim_path",
           "fsync_dir", "fsync_path", "fsync_tree", "is_temp_path", "make_owned_dir", "make_sibling_dir", "place_dir",
           "remove_dead_owned_dirs", "remove_dead_siblings", "remove_dead_temp_files", "removing_dead_temp_files",
           "replace_atomically", "sibling_path", "try_claim", "write_file_once", "write_once", "writer_gone"]


def _host_tag(name: str) -> str:
    """``name`` made path-safe, at most 40 characters; a longer one keeps a hash of the whole name, so two
    machines whose names differ only past the cut never pass for one (and judge each other's pids)."""
    tag = re.sub(r"[^A-Za-z0-9_]", "_", name)
    if len(tag) > 40:
        tag = f"{tag[:31]}_{zlib.crc32(name.encode()):08x}"
    return tag or "host"


#: This machine as it appears in sibling names (path-safe, at most 40 characters).
HOST = _host_tag(socket.gethostname())
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
    return pid != os.getpid() and _pid_gone(pid)


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
    return [entry for entry, _ in removing_dead_temp_files(directory)]


def removing_dead_temp_files(directory: str | os.PathLike) -> Iterator[tuple[Path, os.stat_result]]:
    """:func:`remove_dead_temp_files`, each file removed given as it goes with its ``lstat`` from just before,
    so a caller keeping count of the disk a folder takes (the disk cache) knows what each freed."""
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return
    for entry in entries:
        if not is_temp_path(entry):
            continue
        m = _SIBLING.fullmatch(entry.name)
        try:
            st = os.lstat(entry)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and (m is None or writer_gone(entry)):
            try:
                entry.unlink()
            except FileNotFoundError:
                continue
            yield entry, st


def remove_dead_owned_dirs(parent: str | os.PathLike, prefix: str) -> list[Path]:
    """Remove the directories :func:`make_owned_dir` made in ``parent`` under ``prefix`` whose owner
    process on this machine is gone; returns what was removed.

    Only real directories (not symlinks) owned by this user and named exactly so are touched, and only
    this machine's: another machine's owner cannot be asked, and a folder's age says nothing of a live
    job's (its files change, its directory entry does not), so those are left to their own machine.
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
        if m["host"] == HOST and _gone(m["host"], int(m["pid"]), entry) and _remove_entry(entry):
            removed.append(entry)
    return removed


def replace_atomically(final: Path, write: Callable[[BinaryIO], object], durable: bool = True) -> Path:
    """Write ``final`` through a fresh temporary sibling: ``write(f)``, flush, fsync, rename, fsync the directory.

    Readers see the old file or the complete new one, never a part. The temporary file
    is created exclusively under an unpredictable name, so nothing planted next to
    ``final`` is written through; a symlink at ``final`` itself is replaced, not
    followed. On any error the temporary file is removed (when the directory allows)
    and the error propagates. ``durable=False`` leaves out both fsyncs: for a file whose
    reader checks it whole (a checksum) and can do without it, as a crash may then leave
    the new name with missing or stale bytes.
    """
    final = Path(final)
    tmp, fd = _fresh(lambda: sibling_path(final, "tmp"), _create_file)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the directory itself is the problem; nothing was left behind in it
        raise
    if durable:
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


def fsync_path(path: str | os.PathLike, missing_ok: bool = False, folder: bool = False) -> None:
    """fsync ``path`` (a folder with ``folder``), raising its errors, unlike :func:`fsync_dir` (what vouches for
    data on the disk must not pass over an EIO): ``missing_ok``, nothing when it is not there; a filesystem that
    cannot fsync a folder (EINVAL, ENOTSUP) is let be (its renames are still atomic).

    >>> fsync_path("out.zarr/c/0/0", missing_ok=True)   # doctest: +SKIP
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (getattr(os, "O_DIRECTORY", 0) if folder else 0))
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if not (folder and exc.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
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


# -- write-once artifacts: claims -----------------------------------------------------------------

#: How long a process waits for another one's write by default; ``STOKER_WRITE_WAIT_S`` overrides it.
WAIT_S = 600.0
#: A claim that a waiter saw unchanged (not refreshed) for this long is stale: its holder is gone (or hung)
#: and the claim may be taken over. Holders refresh theirs every ``CLAIM_STALE_S / 8``.
CLAIM_STALE_S = 120.0
_WAIT_ENV = "STOKER_WRITE_WAIT_S"
_MAX_POLL_S = 0.5  # the longest pause between two looks at a claim (waits start at 10 ms and double)


def claim_path(final: str | os.PathLike) -> Path:
    """The claim file of ``final``: ``.<name>.claim`` next to it."""
    final = Path(final)
    return final.with_name(f".{final.name}.claim")


@dataclass(frozen=True)
class Claimant:
    """Who holds a claim, as its file says (``host`` None: unreadable, e.g. still being written)."""

    host: str | None
    pid: int | None
    started: float | None
    token: str | None

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}" if self.host is not None else "an unknown process"


def _read_claim(path: Path) -> tuple[Claimant, os.stat_result] | None:
    """The claim at ``path`` and its ``lstat``; None when there is none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    doc: object = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            doc = json.loads(os.read(fd, 4096))
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        pass  # a symlink, or a claim whose holder has not written it yet: judged by its refreshes alone
    if not isinstance(doc, dict):
        return Claimant(None, None, None, None), st
    host, pid, started, token = (doc.get(k) for k in ("host", "pid", "started", "token"))
    return Claimant(host if isinstance(host, str) else None, pid if type(pid) is int else None,
                    float(started) if isinstance(started, (int, float)) else None,
                    token if isinstance(token, str) else None), st


def _pid_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this machine."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (a pid beyond pid_t cannot exist)
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


class _Watch:
    """How long one waiter has seen a claim file unchanged, by its own clock: no other machine's time
    (the file's mtime is set by the writer's or the file server's clock) is compared with ours."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.since = 0.0

    def quiet_for(self, st: os.stat_result) -> float:
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        now = time.monotonic()
        if key != self.key:
            self.key, self.since = key, now
        return now - self.since


def _stale(holder: Claimant, st: os.stat_result, watch: _Watch | None) -> str | None:
    """Why the claim may be taken over, or None while its holder may still be at work."""
    if holder.host == HOST and holder.pid is not None and holder.pid != os.getpid() and _pid_gone(holder.pid):
        return "its process is gone"
    age = time.time() - st.st_mtime
    if age > STALE_AFTER_S:  # abandoned long ago, whatever the clocks say
        return f"it was last refreshed {age / 3600:.0f} h ago"
    if watch is None:  # no time to watch it: trust the clocks (another machine's, or the file server's)
        return f"it was last refreshed {age:.0f} s ago" if age > CLAIM_STALE_S else None
    quiet = watch.quiet_for(st)
    if quiet > CLAIM_STALE_S:
        return f"it was not refreshed for {quiet:.0f} s"
    return None


class Claim:
    """This process's claim on writing ``final``; :meth:`release` (or leaving a ``with`` block) gives it up.

    A daemon thread refreshes the claim file's mtime every ``CLAIM_STALE_S / 8`` while it is held.
    """

    def __init__(self, final: Path, path: Path, token: str) -> None:
        self.final, self.path, self.token = final, path, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, args=(CLAIM_STALE_S / 8,), daemon=True,
                                        name=f"stoker-claim-{final.name}")
        self._thread.start()

    def _refresh(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                os.utime(self.path, follow_symlinks=os.utime not in os.supports_follow_symlinks)
            except OSError:
                pass  # taken over or removed: nothing of ours to keep alive

    def release(self) -> None:
        """Stop refreshing and remove the claim file if it is still ours (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5.0)  # a refresh stuck on a hung mount must not hang the writer too
        found = _read_claim(self.path)
        if found is not None and found[0].token == self.token:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Claim({str(self.final)!r})"


def _take_over(final: Path, path: Path, holder: Claimant, st: os.stat_result, why: str) -> None:
    """Remove the stale claim ``(holder, st)`` at ``path``; only one of several takers removes it.

    The claim is renamed to a unique name first: a taker that finds it gone lost the race. One that
    moved a newer claim (made after the stale one left) puts it back.
    """
    aside = sibling_path(final, "old")  # remove_dead_siblings removes it if this process dies right here
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    moved = _read_claim(aside)
    if moved is not None and (moved[1].st_ino, moved[0].token) != (st.st_ino, holder.token):
        try:
            os.link(aside, path)  # fails when yet another claim was made meanwhile: that one stands
        except OSError:
            pass
    else:
        print(f"stoker: taking over {holder}'s claim on {final} ({why})", file=sys.stderr, flush=True)
    _remove_entry(aside)


def _attempt(final: Path, watch: _Watch | None) -> Claim | tuple[Claimant, os.stat_result]:
    """Claim ``final`` now: the claim, or who holds it (after taking over a stale one)."""
    path = claim_path(final)
    for _ in range(_ATTEMPTS):
        try:
            fd = _create_file(path)
        except FileExistsError:
            found = _read_claim(path)
            if found is None:
                continue  # released meanwhile: try again
            why = _stale(*found, watch)
            if why is None:
                return found
            _take_over(final, path, *found, why)
            continue
        token = uuid.uuid4().hex
        record = {"host": HOST, "pid": os.getpid(), "started": time.time(), "token": token, "path": str(final)}
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(record).encode())
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return Claim(final, path, token)
    raise StorageError(f"could not claim {final}: its claim {path} kept changing hands", uri=str(final))


def _wait_bound(wait_s: float | None) -> float:
    if wait_s is not None:
        return seconds("wait_s", wait_s, knob="wait_s")
    raw = os.environ.get(_WAIT_ENV, "").strip()
    if not raw:
        return WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise InvalidArgument(f"{_WAIT_ENV} must be a number of seconds > 0, got {raw!r}", knob=_WAIT_ENV)
    return value


def try_claim(final: str | os.PathLike) -> Claim | None:
    """Claim ``final`` without waiting: the claim, or None while another process holds it. With no time to
    watch a claim of another machine, its mtime is compared with this machine's clock: it is stale when
    older than :data:`CLAIM_STALE_S`."""
    got = _attempt(Path(final), None)
    return got if isinstance(got, Claim) else None


def claim(final: str | os.PathLike, *, until: Callable[[], bool] | None = None, wait_s: float | None = None,
          announce: bool = True) -> Claim | None:
    """Claim ``final``, waiting while another live process holds it; None when ``until()`` says the work is
    done (it is asked once the claim is held, so it sees whatever the previous holder finished).

    Waits at most ``wait_s`` (default :data:`WAIT_S`, or ``$STOKER_WRITE_WAIT_S``), then raises
    :class:`~stoker.errors.ClaimTimeout` naming the holder. ``announce`` prints once that it waits, and for whom.
    Raises ``OSError`` when the claim file cannot be created (a read-only folder, say).
    """
    final = Path(final)
    bound = _wait_bound(wait_s)
    start = time.monotonic()
    pause, told, watch = 0.01, False, _Watch()
    while True:
        got = _attempt(final, watch)
        if isinstance(got, Claim):
            try:
                done = until is not None and until()
            except BaseException:
                got.release()
                raise
            if done:
                got.release()
                return None
            return got
        holder, st = got
        waited = time.monotonic() - start
        if waited >= bound:
            raise ClaimTimeout(
                f"gave up after {waited:.0f} s waiting for {holder} to finish writing {final}: its claim "
                f"{claim_path(final)} is still held by a live writer (one on another machine is taken over once its "
                f"claim stays unrefreshed for {CLAIM_STALE_S:g} s). Wait longer (wait_s, or {_WAIT_ENV}), or "
                "delete the claim if that writer is gone", path=str(final), claimant=str(holder),
                claim=str(claim_path(final)), waited_s=waited, knob=_WAIT_ENV)
        if announce and not told:
            print(f"stoker: waiting for {holder} to finish writing {final} (at most {bound:g} s)", file=sys.stderr,
                  flush=True)
            told = True
        time.sleep(min(pause, bound - waited))
        pause = min(2 * pause, _MAX_POLL_S)


def place_dir(tmp: str | os.PathLike, final: str | os.PathLike, is_complete: Callable[[Path], bool], *,
              replace: bool = False) -> bool:
    """Rename the finished directory ``tmp`` to ``final``; True when it was, False when a complete result
    (another writer's) was kept instead. The caller removes ``tmp`` when it is left.

    ``os.replace`` cannot replace a non-empty directory, so an incomplete or outdated one at ``final`` (with
    ``replace``, whatever is there) is renamed aside first and deleted after: a crash in between leaves no
    result at ``final``, never a mix. A complete one that another writer puts there meanwhile is kept.
    """
    tmp, final = Path(tmp), Path(final)
    old = None
    if os.path.lexists(final):
        if not replace and is_complete(final):
            return False
        old = sibling_path(final, "old")
        try:
            os.replace(final, old)
        except FileNotFoundError:
            old = None  # another writer moved it meanwhile
    try:
        os.replace(tmp, final)
    except OSError as exc:
        # A writer that did not see our claim (an older stoker, say) put its result in first: use it.
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR) or not is_complete(final):
            raise
        placed = False
    else:
        placed = True
        fsync_dir(final.parent)
    if old is not None:
        _remove_entry(old)
    return placed


def write_once(final: str | os.PathLike, build: Callable[[Path], object], *, is_complete: Callable[[Path], bool],
               wait_s: float | None = None, announce: bool = True) -> bool:
    """Make the directory ``final`` once, whoever else tries at the same moment; True when this call wrote it.

    ``is_complete(path)`` checks a complete result at ``path`` (a marker written last, holding what the
    result was made from). When ``final`` is complete nothing is written (nor claimed: read-only folders
    work). Otherwise the claim decides (see the module's text): the winner calls ``build(tmp)`` on a fresh
    empty sibling directory, checks ``is_complete(tmp)``, flushes it and renames it to ``final``
    (:func:`place_dir`); the others wait for it (see :func:`claim`) and use its result. Leftovers of dead
    writers are removed first; on any error the temporary directory and the claim are removed.
    """
    final = Path(final)
    if is_complete(final):
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    held = claim(final, until=lambda: is_complete(final), wait_s=wait_s, announce=announce)
    if held is None:
        return False
    with held:
        remove_dead_siblings(final)
        tmp = make_sibling_dir(final)
        try:
            build(tmp)
            if not is_complete(tmp):
                raise StorageError(f"writing {final}: the finished temporary {tmp} does not check as complete "
                                   "(changed by another process?); nothing was put in place", uri=str(final))
            fsync_tree(tmp)
            return place_dir(tmp, final, is_complete)
        finally:
            if os.path.lexists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)


def write_file_once(final: str | os.PathLike, write: Callable[[BinaryIO], object], *,
                    is_complete: Callable[[Path], bool], wait_s: float | None = None, announce: bool = True) -> bool:
    """:func:`write_once` for a file: ``write(f)`` through :func:`replace_atomically`, unless ``is_complete``
    finds a complete file at ``final`` (before, or after waiting for another writer); True when this call wrote it."""
    final = Path(final)
    if is_complete(final):
        return False
    held = claim(final, until=lambda: is_complete(final), wait_s=wait_s, announce=announce)
    if held is None:
        return False
    with held:
        replace_atomically(final, write)
    return True
