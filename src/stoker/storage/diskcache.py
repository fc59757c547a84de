"""DiskCache: a bounded folder of checksummed byte entries, shared by every process of a node.

>>> cache = disk_cache("/scratch/stoker-cache", cache_bytes=50 << 30)
>>> cache.put("s3://bkt|c/0/1|0:-1|(123, '\"e\"')", data); cache.get("s3://bkt|c/0/1|0:-1|(123, '\"e\"')")

An entry is a file named by a hash of its *ident* (the caller's string: store, key, range, generation), under
``<folder>/v1/<2 hex>/<32 hex>``. It holds a header (magic, crc32c, lengths), the ident (so a hash collision
is never served) and the bytes. Rules that make one folder safe for many processes without a daemon:

- **Written once, never seen partial**: written to a temporary sibling named as
  :func:`~stoker.storage.fsutil.replace_atomically` names them (created exclusively, never through a link)
  and renamed; readers open the final name only. Not fsynced: an entry a crash left short or stale fails its
  checksum (below) and is fetched again.
- **Bounded, as the disk counts**: every write takes the folder's lock (``fcntl.flock`` on ``v1/.index``,
  bounded wait), makes room, writes and adds what it took to the total kept in that file, so the folder
  never takes more than ``cache_bytes`` of disk. The total counts *allocated* space (``st_blocks``, as ``du``
  and a full disk see it): every entry in whole blocks (a 100-byte entry takes 4 KiB), the subfolders, the
  ``.index`` file. A write reserves its entry's size rounded up to the block plus :data:`DIR_SLACK_BLOCKS`
  blocks (its subfolder made or grown; a batch reserves those per subfolder it writes into, and a block more
  for each further entry there) before it writes, then counts what the files and folders it touched grew by.
  Making room scans the folder and unlinks the least recently used entries (by mtime, which a hit
  refreshes) down to 90% of the bound, so scans are rare (the compiled engine's scan, csrc/evict.c, with the
  GIL released once: :func:`use_entry_evictor`; :func:`evict_entries`, its Python twin, without it); a
  subfolder it empties is removed (its block freed; subfolders are made only under the lock). Each process scans once before its first write, so a
  total left wrong by a crash (or by an older stoker, which counted bytes) is corrected, and dead writers'
  temporary files removed.
- **Markers are empty files** (:meth:`DiskCache.mark`): a name that only says "something was kept" (what
  :class:`~stoker.storage.cachingstore.CachingStore` asks before a HEAD) takes no block, only a name in its
  subfolder (counted as the subfolder grows). :meth:`DiskCache.has` looks at either kind (a regular file: a
  folder or link put at its name is neither); a marker of an older stoker (a full entry with no payload) is
  still one. What ``has`` found or ``mark`` queued is remembered for :data:`SEEN_S` (no look on disk, no mark
  queued again; its mtime refreshed that often, by the folder's writer thread: a utime is a round trip on a
  network file system, kept off the readers' threads).
- **Eviction never breaks a read**: it unlinks; a reader that opened the file keeps reading it, one that
  comes after finds no entry (a miss).
- **Corruption is a miss**: a short file, a bad header or a checksum mismatch is removed (a loss, as an
  eviction: :meth:`DiskCache.lost`) and reported as absent; the caller fetches again. The compiled engine
  reads hits itself (:meth:`DiskCache.entry_file`, csrc/entries.c) with the same checks; what it finds
  unsound is fetched again through :meth:`get_many`. It checks a payload's crc once a process: a later read
  of the same file, unchanged since and during the read (inode, size, mtime, ctime: any write through the
  file system moves the ctime), on a local file system, skips it (``STOKER_CHECK_EVERY_READ=1``: never
  skipped; docs/remote.md says what it cannot see).
- **Failure is a miss**: a folder that cannot be created or written (read-only, full disk), or an entry
  larger than ``cache_bytes``, makes writes stop (one ``RuntimeWarning``); reads go on uncached.

Writes are queued to one daemon thread per folder (it leaves when idle for :data:`WRITER_IDLE_S`, the reader
threads as theirs do), so a fetch never waits for a disk write. It writes what is
queued in batches (:data:`BATCH_ENTRIES`; :data:`BATCH_BYTES` and a tenth of ``cache_bytes`` reserved): one
hold of the lock, one reservation and one count for them all, and their files made by the compiled engine's
``write_entries`` (csrc/entries.c) with the GIL released once for the batch (:func:`use_entry_writer`;
:func:`write_entries`, its Python twin, without the engine). Every system call gives the GIL up and, on a busy
pipeline, waits to get it back: written one at a time in Python (a dozen calls an entry), the writer fell behind
a first epoch's fetches. The queue stays bounded (:data:`QUEUE_BYTES`: its bytes are memory): a put into a full
queue waits for room, so an epoch read faster than the disk writes (loopback, a fast network) slows to the
writer's pace and keeps every entry; but never long (:data:`QUEUE_WAIT_S`: a disk that is stalled must not stall
the fetches), after which the entry is dropped (``dropped`` counts it; it is cached on a later read). The store's
event loop never waits here: what it would put into a backlogged queue is put from a reader thread instead
(:class:`~stoker.storage.cachingstore.CachingStore`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import random
import re
import stat
import struct
import threading
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import crc32c

from .. import checks
from ..errors import InternalError, InvalidArgument, ShutdownError, ThreadStartError
from ..runtime.faults import serve
from ..runtime.memo import remember
from ..runtime.workers import IDLE_RETIRE_S, DaemonPool
from .fsutil import HOST, removing_dead_temp_files

#: The entry header: magic, crc32c of ident + payload, ident length, payload length.
HEADER = struct.Struct("<6sHIIQ")
MAGIC = b"STKC1\n"
#: Bytes of entries queued for writing, at most, per folder (more wait for room, then are dropped: cached on a
#: later read).
QUEUE_BYTES = 256 << 20
#: How long a put waits for room in a full queue (a writer behind a first epoch read at loopback speed) before
#: its entry is dropped: a batch or two of writes, so a writer that is only slower than the network keeps every
#: entry (the epoch slows to its pace), while a stalled disk costs a fetch no more than this.
QUEUE_WAIT_S = 1.0
#: Entries written per hold of the folder's lock, at most (one reservation and one count for them all), and
#: their bytes: a batch of the largest takes some 100 ms, which another process's write may wait.
BATCH_ENTRIES = 256
BATCH_BYTES = 64 << 20
#: A queue with less room than this is *backlogged* (:attr:`DiskCache.backlogged`): what a thread that must not
#: wait (the store's event loop) would put is handed to a reader thread first, whose put may wait for room.
QUEUE_ROOM = BATCH_BYTES
#: The most a write waits for the folder's lock (another process evicting); then that entry is not written.
LOCK_WAIT_S = 10.0
#: Making room evicts down to this share of ``cache_bytes``, so a scan serves many writes.
LOW_WATER = 0.9
#: Blocks a write reserves beyond its entry's: a subfolder made (one) and grown (ext4 turns a directory past one
#: block into an indexed one of three), so what it adds never passes what it made room for. A batch reserves
#: them once per subfolder, and one block for each further entry in it (:func:`_reserve`).
DIR_SLACK_BLOCKS = 3
_ENTRY = re.compile(r"[0-9a-f]{32}")
_LAYOUT = "v1"
#: Threads per folder and process that read hits for CachingStore.start_get_many (its HEADs are not waited for
#: here but on the store's event loop; only a key gone stale in between is revalidated on one of these).
READ_THREADS = 4
#: How long the writer thread waits for work before it leaves (started again by the next put): a cache whose
#: pipelines are all closed keeps no thread waking for ever.
WRITER_IDLE_S = IDLE_RETIRE_S
#: The environment variable naming the default cache folder.
CACHE_DIR_ENV = "STOKER_CACHE_DIR"
#: The bound of a cache whose folder is given without ``cache_bytes``.
DEFAULT_CACHE_BYTES = 10 << 30
#: How long what :meth:`DiskCache.has` found (or :meth:`DiskCache.mark` queued) is taken as still there without
#: a look on disk, and so how stale its mtime (the LRU's clock) may grow.
SEEN_S = 60.0
#: a hit touches its entry (the LRU clock) only when its mtime is this old, as csrc/entries.c's TOUCH_AFTER_S
TOUCH_AFTER_S = 60
#: Idents a :class:`DiskCache` remembers so, at most; past it, forgotten all at once.
SEEN_IDENTS = 1 << 16
#: What the writer thread does with a queued ident: write it; refresh a marker's mtime, or make it where it is
#: gone (:meth:`DiskCache.mark` of one seen before); only refresh it (:meth:`DiskCache.has`; gone: a loss).
_WRITE, _REFRESH, _TOUCH = 0, 1, 2


@dataclass(frozen=True)
class CacheSettings:
    """Where and how much: ``folder`` (None: no cache), ``cache_bytes`` (0: no cache), and how long a
    revalidated generation is trusted (``staleness_s``)."""

    folder: str | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES
    staleness_s: float = 60.0

    @property
    def enabled(self) -> bool:
        return self.folder is not None and self.cache_bytes > 0


def cache_settings(cache_dir=None, cache_bytes=None, cache_staleness_s=None, *, what: str = "Config") -> CacheSettings:
    """The :class:`CacheSettings` of the three knobs, checked (``InvalidArgument`` names the knob):
    ``cache_dir`` a folder (None: ``$STOKER_CACHE_DIR``, else no cache), ``cache_bytes`` an int >= 0
    (None: :data:`DEFAULT_CACHE_BYTES`; 0: no cache), ``cache_staleness_s`` seconds > 0 (None: 60)."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_DIR_ENV) or None
    elif not isinstance(cache_dir, (str, os.PathLike)) or not os.fspath(cache_dir):
        raise InvalidArgument(f"{what}.cache_dir must be a folder path (str or PathLike) or None, got {cache_dir!r}",
                              knob="cache_dir")
    folder = None if cache_dir is None else os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))
    size = DEFAULT_CACHE_BYTES if cache_bytes is None else \
        checks.integer(f"{what}.cache_bytes", cache_bytes, 0, knob="cache_bytes")
    stale = 60.0 if cache_staleness_s is None else \
        checks.seconds(f"{what}.cache_staleness_s", cache_staleness_s, knob="cache_staleness_s")
    return CacheSettings(folder, size, stale)


#: what follows the writer thread's fault (see DiskCache._writer_failed)
_WRITER_STOPS = "The disk cache stops caching in this process; reads go on, uncached"


class DiskCache:
    """One cache folder as this process sees it (see the module docstring); thread-safe. Get one with
    :func:`disk_cache`, which shares it between the stores of a process."""

    def __init__(self, folder: str, cache_bytes: int) -> None:
        self.folder = Path(folder)
        self.cache_bytes = cache_bytes
        self.root = self.folder / _LAYOUT
        self._root = str(self.root)
        self.writable = True
        # the writer's loop died on a bug (_writer_failed): nothing is queued from then on. Checked under _cond,
        # where `writable` is read before it: a put that passed that check as the writer died queues nothing
        self._dead = False
        # what this process did (statistics: ``evicted`` counts the entries its evictions unlinked); what a memo
        # of entries compares is ``losses`` alone (see lost)
        self.hits = self.misses = self.corrupt = self.written = self.dropped = self.evicted = self.hit_bytes = 0
        self._scanned = False  # this process has scanned before writing (fixes a total a crash left wrong)
        # (ident, data, what it counts in _queued, how: _WRITE, _REFRESH or _TOUCH)
        self._queue: deque[tuple[str, bytes | None, int, int]] = deque()
        self._queued = 0
        # idents queued or being written -> their data (None: a marker): not on disk yet, served from here
        self._pending: dict[str, bytes | None] = {}
        # markers queued only to be refreshed (has(): _TOUCH), apart from _pending: one may be gone, so being
        # queued so says nothing of its being there (see _trusted)
        self._touching: set[str] = set()
        self._cond = threading.Condition()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._busy = False
        self._warned: set[str] = set()
        self._thread: threading.Thread | None = None
        self._readers: DaemonPool | None = None
        self._block = 0  # the file system's allocation unit (statvfs f_frsize), learnt at the first write
        # the folder's lock file while the writer has it open (a forked child closes its copy: see _after_fork)
        self._lock_fd: int | None = None
        self._seen: dict[str, float] = {}  # ident -> when has() found it or mark() queued it (monotonic; see has)
        # when this process last lost entries (see lost): what _seen holds from before is looked for on disk again
        self._floor = float("-inf")
        # grows whenever entries this process counted on may be gone (see lost): what a memo of entries checks
        self.losses = 0
        # items ever queued, and items the writer finished with (written, found there, or not written: a loss),
        # in queue order: an entry queued when ``tickets`` was T is on disk (or lost) once ``settled`` >= T
        # (what a decoder's table of entries checks, a number a batch: engine/cpu/entry_table.py)
        self.tickets = 0
        self.settled = 0
        _CACHES.add(self)  # a forked child starts its own writer (see _after_fork)

    # -- reading ---------------------------------------------------------------------------------

    def path(self, ident: str) -> Path:
        return Path(self._path(ident))

    def _path(self, ident: str) -> str:
        name = hashlib.blake2b(ident.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
        return f"{self._root}/{name[:2]}/{name}"

    def has(self, ident: str) -> bool:
        """Whether an entry is stored under ``ident`` (its bytes unread and unchecked); a use for the LRU. One
        found (or queued by :meth:`mark`) less than :data:`SEEN_S` ago is taken as still there without a look
        on disk: a pipeline opening hundreds of arrays asks for their markers on its opener threads, where a
        system call gives the GIL up and waits for it back. So its mtime, the LRU's clock, is refreshed at most
        every :data:`SEEN_S` (and one evicted meanwhile costs its key a revalidation request, no wrong read). The
        look is an lstat; the refresh, where the mtime is :data:`TOUCH_AFTER_S` old, a utime on the folder's
        writer thread (on a network file system each is a round trip to the server: not two on the caller's)."""
        now = time.monotonic()
        if self._trusted(ident, now):
            return True
        try:
            st = os.lstat(self._path(ident))
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False  # a folder or link planted at its name: no entry (see _there_already)
        remember(self._seen, ident, now, SEEN_IDENTS)
        if self.writable and _to_touch(st):
            self._enqueue(ident, None, len(ident), how=_TOUCH)
        return True

    def _trusted(self, ident: str, now: float) -> bool:
        """Whether what :meth:`has` found or :meth:`mark` queued of ``ident`` is taken as there without a look on
        disk: seen less than :data:`SEEN_S` ago and since the last loss (:meth:`lost`), or queued now by
        :meth:`mark` (made after any eviction that made room for it, or where found gone). A refresh :meth:`has`
        queued is no such thing (it only touches what may be gone since): kept apart, in ``_touching``."""
        seen = self._seen.get(ident)
        if seen is None or now - seen >= SEEN_S:
            return False
        return seen >= self._floor or self.queued(ident)

    def _touch(self, ident: str) -> bool:
        """Refresh the mtime (the LRU's clock) of the entry or marker stored under ``ident``; whether it is there:
        a regular file, as :func:`_there_already` says (a folder or link planted at its name is not: a mark's
        refresh then writes it, which fails with one warning). On the writer thread (:meth:`_drain`), never a
        reader's."""
        path = self._path(ident)
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        try:
            os.utime(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:  # a read-only folder: there, only not refreshed
            pass
        return True

    def entry_file(self, ident: str) -> tuple[bytes, bytes] | None:
        """``(path, ident)`` of the entry stored under ``ident``, both encoded: what the compiled engine reads
        and checks itself (csrc/entries.c: the header, the ident, the crc32c, the payload bounded by the
        chunk's codec), a hit costing what a local file's read costs. Nothing is read here; the engine
        reports a missing or unsound entry, and its chunk is fetched again (:meth:`get_many`'s rules then).
        None while this process has the entry queued for writing: not on disk yet, so the caller reads it
        through :meth:`get_many`, which serves it from the queue, rather than have the engine miss it."""
        if self.queued(ident):
            return None
        return os.fsencode(self._path(ident)), ident.encode("utf-8", "surrogatepass")

    def queued(self, ident: str) -> bool:
        """Whether this process has ``ident`` queued for writing (not on disk yet: :meth:`entry_file` says None)."""
        return bool(self._pending) and ident in self._pending

    def count_hits(self, n: int, nbytes: int) -> None:
        """Count ``n`` hits of ``nbytes`` payload bytes read by someone else (the compiled engine)."""
        with self._cond:
            self.hits += n
            self.hit_bytes += nbytes

    def get(self, ident: str) -> memoryview | None:
        """The bytes stored under ``ident``, or None (never written, evicted, or corrupt: then removed)."""
        return self.get_many([ident])[0]

    def get_many(self, idents: Sequence[str], read_files: Callable | None = None) -> list[memoryview | None]:
        """:meth:`get` of each of ``idents``; one this process has queued for writing is served from the queue
        (not on disk yet: fetched again, it was queued again, a second copy of its bytes in memory).
        ``read_files(paths, max_bytes, idents)``: reads the entries' files whole, judges each as its ident's
        entry and touches the sound ones (the compiled engine's, which releases the GIL once for many files
        rather than for every system call, as a batch's hits are many): a payload, False (unsound) or None
        each; None: :func:`read_file`, one at a time. An unsound entry is removed, a loss (:meth:`lost`)."""
        with self._cond:  # queued for writing: served from memory (not on disk yet, and not fetched again)
            queued = [self._pending.get(ident) if self._pending else None for ident in idents]
        on_disk = [ident for ident, data in zip(idents, queued) if data is None]
        if read_files is not None:  # judged there (an entry's payload, False: unsound), only a good one touched
            raws = read_files([self._path(ident) for ident in on_disk], self.cache_bytes,
                              [ident.encode("utf-8", "surrogatepass") for ident in on_disk])
            # (what was read, its payload): None, no file; False, an unsound one, no payload; else the payload,
            # an empty view too (an entry of no bytes): compared with False by identity, never by truth
            judged = iter([(raw, None if raw is False else raw) for raw in raws])
        else:  # judged as read: only a good entry is touched
            judged = iter([self._read_one(ident) for ident in on_disk])
        out: list[memoryview | None] = []
        unsound = 0
        for ident, data in zip(idents, queued):
            if data is not None:
                payload = _byte_view(data)
                self.hits += 1
                self.hit_bytes += payload.nbytes
                out.append(payload)
                continue
            path, (raw, payload) = self._path(ident), next(judged)
            if payload is None:
                self.misses += 1
                if raw is not None:  # corrupt: a later write puts a good one there (the total: at the next scan)
                    self.corrupt += 1
                    unsound += 1
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            else:
                self.hits += 1
                self.hit_bytes += payload.nbytes
            out.append(payload)
        if unsound:  # removed: a loss (a memo of entries on disk, as the engine's, may hold their paths)
            self.lost()
        return out

    def _read_one(self, ident: str) -> tuple[bytes | None, memoryview | None]:
        """``ident``'s entry file read (None: none) and its payload (None: none, or not a good entry)."""
        payload: list[memoryview | None] = [None]

        def check(raw: bytes) -> bool:
            payload[0] = self._check(raw, ident)
            return payload[0] is not None

        raw = read_file(self._path(ident), self.cache_bytes, check)
        return raw, payload[0] if raw is not None else None

    @staticmethod
    def _check(raw: bytes, ident: str) -> memoryview | None:
        if len(raw) < HEADER.size:
            return None
        magic, _, crc, ident_len, length = HEADER.unpack_from(raw)
        body = memoryview(raw)[HEADER.size:]
        if magic != MAGIC or len(body) != ident_len + length or crc32c.crc32c(body) != crc:
            return None
        if bytes(body[:ident_len]) != ident.encode("utf-8", "surrogatepass"):
            return None  # another ident hashing to the same name
        return body[ident_len:]

    def serve(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on one of the folder's reader threads (:data:`READ_THREADS`, started as work
        comes): a :class:`~stoker.storage.cachingstore.CachingStore`'s reads of hits, off the thread that
        asked. :class:`~stoker.errors.ShutdownError` when no thread can take it."""
        with self._cond:
            if self._readers is None:
                self._readers = DaemonPool(READ_THREADS, "stoker-diskcache-read", knob="cache_dir")
            readers = self._readers
        try:
            readers.submit(fn, *args)
        except ThreadStartError as exc:  # the system gives no thread: the caller serves it itself
            raise ShutdownError(str(exc)) from exc

    # -- writing ---------------------------------------------------------------------------------

    def put(self, ident: str, data, wait: bool = True) -> None:
        """Queue ``data`` to be stored under ``ident`` (written by the folder's writer thread); nothing when
        ``ident`` is queued already (the same bytes: an ident names its object's generation). ``bytes`` are
        queued as they are, as are views of them or of obstore's ``Bytes`` (what the object stores return); any
        other buffer (a bytearray, an array) is copied, so that the caller may reuse it at once and what is
        served from the queue and written is what was put. A full queue is waited on for room at most
        :data:`QUEUE_WAIT_S` (``wait``; else, and after it, the entry is dropped: ``dropped`` counts it)."""
        n = memoryview(data).nbytes
        if not self.writable:
            return
        block = self._block or 4096
        if -(-(HEADER.size + len(ident) * 4 + n) // block) * block + DIR_SLACK_BLOCKS * block > self.cache_bytes:
            self._warn("big", f"stoker's disk cache {self.folder}: an entry of {n:,} bytes takes more disk than "
                              f"cache_bytes={self.cache_bytes:,} (in whole blocks of {block:,} bytes, and "
                              f"{DIR_SLACK_BLOCKS} for its subfolder); such values are read uncached (raise "
                              "cache_bytes)")
            return
        if not _immutable(data):
            data = _byte_view(data).tobytes()  # immutable: not changed by its producer, nor by a reader served it
        self._enqueue(ident, data, n, wait=wait)

    @property
    def backlogged(self) -> bool:
        """Whether the write queue has less than :data:`QUEUE_ROOM` left: a put now may wait for the writer."""
        return self._queued > QUEUE_BYTES - QUEUE_ROOM

    def mark(self, ident: str) -> None:
        """Queue an empty *marker* file to be made under ``ident``: no bytes, so no block on disk, only its
        name; :meth:`has` finds it (and ``get`` never serves it). What a caller keeps to remember that some
        entries of a thing may be stored, where their idents cannot be known in advance.

        >>> cache.mark("s3://bkt\nc/0/1\nkept"); cache.flush(); cache.has("s3://bkt\nc/0/1\nkept")
        True
        """
        if not self.writable:
            return
        now = time.monotonic()
        if self._trusted(ident, now):
            return  # there, or queued, a moment ago: not queued again (every pipeline marks what it keeps)
        # seen before a loss (or SEEN_S ago): the writer thread refreshes its mtime where it is still there (a
        # utime there, not on the caller's thread: on a network file system a round trip), makes it where not
        how = _REFRESH if ident in self._seen else _WRITE
        self._enqueue(ident, None, len(ident), now, how)  # its queue cost: the ident it holds

    def _enqueue(self, ident: str, data: bytes | None, n: int, seen: float | None = None, how: int = 0,
                 wait: bool = False) -> None:
        """Queue ``ident`` for writing (``data`` None: a marker); ``seen``: when :meth:`mark` queued it, recorded in
        ``_seen`` here, under the lock, so a loss after (a batch not written: :meth:`lost`) comes after it too.
        ``how``: :data:`_WRITE`, or a marker's refresh (:data:`_REFRESH`, made where gone; :data:`_TOUCH`, only
        refreshed: its loss where gone), which a full queue drops uncounted (a refresh later, or none). A touch is
        kept in ``_touching``, not ``_pending``: a mark's refresh of one queued so is queued too (made where gone).
        ``wait``: a full queue is waited on for room, at most :data:`QUEUE_WAIT_S` (a write only)."""
        with self._cond:
            if wait and how == _WRITE and self._queued + n > QUEUE_BYTES >= n:
                # the writer is behind: the fetch waits for it (notified after each batch it writes), so a first
                # epoch faster than the disk slows to the disk's pace rather than leave its entries out
                deadline = time.monotonic() + QUEUE_WAIT_S
                while self._queued + n > QUEUE_BYTES and not self._dead:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            if self._dead:  # the writer died (after the caller's check of `writable`): nobody would write it
                return
            if ident in self._pending or (how == _TOUCH and ident in self._touching):
                return  # queued already: the same bytes (the ident names the object's generation)
            if self._queued + n > QUEUE_BYTES:
                self.dropped += how == _WRITE
                return
            self._queue.append((ident, data, n, how))
            self.tickets += 1
            self._queued += n
            if how == _TOUCH:
                self._touching.add(ident)
            else:
                self._pending[ident] = data
            if seen is not None:  # has() finds it while queued, before the writer made it
                remember(self._seen, ident, seen, SEEN_IDENTS)
            if self._thread is None and not self._start_writer(ident, n, how):
                return
            self._cond.notify_all()  # the writer, which may wait beside puts waiting for room

    def _start_writer(self, ident: str, n: int, how: int) -> bool:
        """Start the writer thread for the entry just queued (under the lock); where the system gives none (no
        thread left, the interpreter shutting down) the entry is taken back, settled as a loss, with one
        warning: its read is served uncached, never failed, and the next put tries again (``_thread`` None)."""
        # a bug escaping its loop turns the cache off, rather than leave the queue for ever (see _writer_failed)
        thread = threading.Thread(target=serve, args=(self._drain, self._writer_failed, _WRITER_STOPS),
                                  name="stoker-diskcache", daemon=True)
        try:
            thread.start()  # (not runtime.workers.start_thread: its error names a Config knob; none sets this one)
        except Exception as exc:  # noqa: BLE001 - RuntimeError "can't start new thread", or at shutdown
            self._queue.pop()  # the entry just appended: no writer was running, so nothing took it
            self._queued -= n
            if how == _TOUCH:
                self._touching.discard(ident)
            else:
                self._pending.pop(ident, None)
            self.settled += 1
            self.lost()  # a marker queued as seen is looked for on disk again
            self._warn("thread", f"stoker's disk cache {self.folder}: no writer thread could be started "
                                 f"({type(exc).__name__}: {exc}); values are read uncached until one can be")
            return False
        self._thread = thread
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued entry is written (or dropped); False if that took longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def _drain(self) -> None:
        while True:
            with self._cond:
                idle_since = time.monotonic()
                while not self._queue:
                    left = WRITER_IDLE_S - (time.monotonic() - idle_since)
                    if left <= 0:  # idle that long (every pipeline of the cache closed?): the thread leaves, and
                        self._thread = None  # the next put starts another (both under the lock: none is missed)
                        return
                    self._cond.wait(min(left, 1.0))
                batch = self._take()
                self._busy = True
            unwritten = True
            try:
                # markers' refreshes first, here (never on a reader's thread), and without the folder's lock: one
                # still there is refreshed (its mtime now), one gone made again (_REFRESH) or lost (_TOUCH)
                there = {ident for ident, _, _, how in batch if how != _WRITE and self._touch(ident)}
                gone = any(how == _TOUCH and ident not in there for ident, _, _, how in batch)
                todo = [(ident, data) for ident, data, _, how in batch if how != _TOUCH and ident not in there]
                # False: queued entries not stored (no room, the lock not had, a failed write); one found there
                # already (written by another process, or queued again after this one's write) is stored
                # the batch is written even where a marker was lost (no short circuit: its puts stay pending)
                wrote = self._write_batch(todo) if todo else []
                unwritten = gone or not all(wrote)
            except Exception as exc:  # noqa: BLE001 - a cache write failing must never fail a read
                self._disable(exc)
            finally:
                with self._cond:
                    for ident, _, n, how in batch:
                        self._queued -= n  # what _enqueue added
                        if how == _TOUCH:
                            self._touching.discard(ident)
                        else:
                            self._pending.pop(ident, None)
                    if unwritten:  # once no longer pending: their markers are not taken as seen (see lost)
                        self.lost()
                    self.settled += len(batch)  # after the loss: a ticket settled unwritten is a loss already
                    self._busy = False
                    self._cond.notify_all()

    def _writer_failed(self, fault: InternalError) -> None:
        """The writer's loop raised (a bug, ``fault``; its thread ends): the cache stops caching in this process,
        as after a failed write, with a warning that names the fault; what was queued is dropped (its markers
        no longer taken as seen: :meth:`lost`), so :meth:`flush` returns at once rather than after its timeout,
        and reads go on uncached. A cache write failing must never fail a read."""
        self.writable = False
        # the queue first: a warning made an error (python -W error) must not leave flush() waiting on it
        with self._cond:
            self._dead = True
            self._queue.clear()
            self._pending, self._touching, self._queued, self._busy = {}, set(), 0, False
            self.lost()
            self.settled = self.tickets
            self._cond.notify_all()
        # its own kind: a write that failed earlier ("off") does not hide that a bug stopped the writer
        self._warn("fault", f"stoker's disk cache {self.folder}: {fault}")

    def _after_fork(self) -> None:
        """In a forked child, where none of the parent's threads runs: a new lock (one of them may have held the
        parent's at the fork, for ever here), no writer nor reader threads (started again as work comes), and the
        queue as it was (written here too: one there already is stored). A batch the parent's writer had taken
        is the parent's to write: its idents are no longer pending here (else queued() said so for ever). The
        folder's lock file the parent's writer had open is closed here: an flock belongs to the open file, which
        this copy would keep locked for this process's life (every write of the node's processes, this one's
        too, waiting LOCK_WAIT_S and not made)."""
        held, self._lock_fd = self._lock_fd, None
        if held is not None:
            try:
                os.close(held)
            except OSError:
                pass
        self._cond = threading.Condition()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._thread = None
        self._readers = None
        self._busy = False
        queued = {ident for ident, _, _, how in self._queue if how != _TOUCH}
        self._pending = {ident: data for ident, data in self._pending.items() if ident in queued}
        self._touching = {ident for ident, _, _, how in self._queue if how == _TOUCH}
        self._queued = sum(n for _, _, n, _ in self._queue)
        # the batch the parent's writer had taken is the parent's: settled here (the engine reads its entries,
        # or finds them missing and fetches them again)
        self.settled = self.tickets - len(self._queue)

    def _take(self) -> list[tuple[str, bytes | None, int, int]]:
        """The queue's first entries, as many as one hold of the lock writes (holding ``_cond``): at most
        :data:`BATCH_ENTRIES`, and (the first excepted) what :meth:`_write_batch` reserves for them at most
        :data:`BATCH_BYTES` and a tenth of ``cache_bytes``. Making room for a batch then evicts down to the low
        water mark, as making room for one entry does, and no lower (:meth:`_evict`)."""
        block = self._block or 4096
        room = min(BATCH_BYTES, self.cache_bytes // 10)
        batch: list[tuple[str, bytes | None, int, int]] = []
        seen: set[str] = set()
        need = 0
        while self._queue and len(batch) < BATCH_ENTRIES:
            ident, data, _, _ = self._queue[0]
            need += _reserve(_entry_bytes(ident, data), self._path(ident), seen, block)
            if batch and need > room:
                break
            batch.append(self._queue.popleft())
        return batch

    def write(self, ident: str, data) -> bool:
        """Store ``data`` under ``ident`` now (see the module docstring); True when stored (written now, or
        found there already)."""
        return self._write_batch([(ident, data)])[0]

    def write_marker(self, ident: str) -> bool:
        """Make the empty marker file of ``ident`` now (see :meth:`mark`); True when made (or there already)."""
        return self._write_batch([(ident, None)])[0]

    def _write_batch(self, batch: Sequence[tuple[str, Any]]) -> list[bool]:
        """Under one hold of the folder's lock: make room for the entries (``(ident, data)``; data None: a
        marker) in whole blocks and the growth of their subfolders, write them all (the compiled engine's
        writer, the GIL released once, where loaded: :func:`use_entry_writer`), and count what the disk gave
        them. Which are stored: written now, or there already (the writer's 0 before any failure: another
        process wrote it, or it was queued again after this process wrote it; not a loss)."""
        done = [False] * len(batch)
        if not self.writable:
            return done
        lock = self._open_lock()
        if lock is None:
            return done
        self._lock_fd = lock
        try:
            if not _lock(lock, LOCK_WAIT_S):
                return done  # a process holds it that long (a hung disk?): these entries stay unwritten
            block = self._block
            todo = []  # (index in batch, path, ident, payload or None, what it reserves)
            seen: set[str] = set()  # the subfolders of the entries in todo
            for i, (ident, data) in enumerate(batch):
                payload = None if data is None else _byte_view(data)
                size, path = _entry_bytes(ident, payload), self._path(ident)
                if _reserve(size, path, set(), block) <= self.cache_bytes:  # alone, as the first of a batch
                    todo.append((i, os.fsencode(path), ident.encode("utf-8", "surrogatepass"), payload,
                                 _reserve(size, path, seen, block)))
            need = sum(item[4] for item in todo)
            if not todo:
                return done
            total = self._total(lock)
            if not self._scanned or total + need > self.cache_bytes:
                total = self._evict(need)
                self._scanned = True
                while todo and total + need > self.cache_bytes:  # what cannot be evicted (the folders) leaves
                    # no room for them all: the last wait for a later read to queue them (popped from the end,
                    # so each subfolder's slack leaves with the first of its entries, the last to go)
                    need -= todo.pop()[4]
                if not todo:  # not even the first: a bound the folder's own blocks fill (or nearly)
                    self._warn("big", f"stoker's disk cache {self.folder}: cache_bytes={self.cache_bytes:,} leaves "
                                      f"no room for an entry beside what the folder takes ({total:,} bytes in "
                                      "whole blocks: its folders, its total's file, writes in progress); values "
                                      "are read uncached (raise cache_bytes)")
                    _store_total(lock, total)
                    return done
            _store_total(lock, total + need)  # counted before the files exist: a crash can only over-count
            writer = _entry_writer[0] or write_entries
            results, _, grown = writer([(path, name, payload) for _, path, name, payload, _ in todo],
                                      f"{HOST}-{os.getpid()}", int.from_bytes(os.urandom(8), "little"))
            # what the disk gave, measured: at most the reservation on ext4 and xfs, the truth elsewhere too
            _store_total(lock, total + max(0, grown))
            for (i, path, _, payload, _), result in zip(todo, results):
                if result == -errno.ENOENT and payload is None:
                    break  # a marker removed as fast as made (MARKER_TRIES): not made, a loss, no failure
                if result < 0:  # the rest of the batch was not tried (their 0: not there already)
                    why = _NOT_REGULAR if result == -errno.EEXIST else os.strerror(-result)
                    self._disable(OSError(-result, why, os.fsdecode(path)))
                    break
                done[i] = True  # 1 written, 0 there already
                self.written += result
            return done
        finally:
            self._lock_fd = None  # before the close: a child forked after it never closes another file
            os.close(lock)  # releases the flock

    def _open_lock(self) -> int | None:
        """The folder's lock file (``v1/.index``, holding the total) opened, the folder made where it is not
        (only then: not at every write); None when that fails (then writes stop, one warning)."""
        path = f"{self._root}/.index"
        # never through a link planted at its name: the total's 8 bytes were written into the link's target
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            try:
                lock = os.open(path, flags, 0o666)
            except FileNotFoundError:
                os.makedirs(self._root, exist_ok=True)
                lock = os.open(path, flags, 0o666)
        except OSError as exc:
            self._disable(exc)
            return None
        if not self._block:
            try:
                self._block = max(512, os.statvfs(self._root).f_frsize or 4096)
            except OSError:
                self._block = 4096
        return lock

    def _total(self, lock: int) -> int:
        return _read_total(lock) or 0

    def _evict(self, incoming: int) -> int:
        """Scan the folder (under the lock); where ``incoming`` more bytes do not fit, unlink least recently used
        entries down to the low water mark (or lower, as far as ``incoming`` needs, where it is more than the
        rest of the bound); remove the subfolders that leaves empty and dead writers' temporary files. Returns
        the space the folder takes then, allocated (entries, temporary files, folders, ``.index``). The scan is
        the compiled engine's where loaded (:func:`use_entry_evictor`: the GIL released once for it), else
        :func:`evict_entries`. One scan: temporary files count as the disk they take while it evicts, and the
        dead writers' ones among them are removed after it, in the subfolders it names, what they took taken off
        its total (so a crash's leftovers may make one eviction unlink that much more; a live writer's file,
        or another machine's kept :data:`~stoker.storage.fsutil.STALE_AFTER_S`, costs nothing more). Both scans
        sum exactly (the compiled one in 128 bits), so a sparse file claiming near 2^63 bytes, taken off after
        the scan, leaves the disk the folder takes, never less than nothing."""
        # the folder's own target, not that less incoming: a batch's need taken off it too evicted twice its
        # room (or everything) where one entry's took a block or two off
        target = min(int(self.cache_bytes * LOW_WATER), self.cache_bytes - incoming)
        scan = _entry_evictor[0] or evict_entries
        total, evicted, temp = scan(self._root, self.cache_bytes, target, incoming, self._block)
        for name in temp:
            for _, st in removing_dead_temp_files(os.path.join(self._root, os.fsdecode(name))):
                total -= _allocated_of(st)
        self.evicted += evicted
        if evicted:
            self.lost()
        return total

    def lost(self) -> None:
        """Entries this process counted on may be gone: it evicted some, a queued write was not made, or a
        reader found one missing or unsound (another process evicted it): :attr:`losses` grows, so a memo of
        entries or markers on disk (:meth:`CachingStore.entry_files
        <stoker.storage.cachingstore.CachingStore.entry_files>`, the markers a wrapper wrote or found) compares
        one int a call to know it must look on disk again; and what :meth:`has` found or :meth:`mark` queued
        before now is looked for on disk again (markers may be among what is gone), but the markers still queued
        (not on disk yet: a marker is written after the eviction that made room). O(1): a floor time, not a
        sweep of what was seen (up to :data:`SEEN_IDENTS`, under the lock every reader and writer takes)."""
        with self._cond:
            self.losses += 1
            self._floor = time.monotonic()

    def _disable(self, exc: BaseException) -> None:
        self.writable = False
        full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        why = "the disk is full" if full else str(exc)
        self._warn("off", f"stoker's disk cache {self.folder} stops caching in this process ({why}); remote reads "
                          "go on uncached. Free space or pick a writable folder (cache_dir, $STOKER_CACHE_DIR)")

    def _warn(self, kind: str, message: str) -> None:
        """Warn once a process per ``kind``: "big" (``cache_bytes`` too small for an entry, or for any beside the
        folder's own blocks), "off" (writes stopped: a failure), "fault" (the writer's loop died on a bug), "thread"
        (no writer thread could be started)."""
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def allocated(self) -> int:
        """The disk the folder's ``v1`` takes now in allocated blocks, folders included (a scan, as ``du``):
        what ``cache_bytes`` bounds."""
        return allocated_on_disk(self._root)

    def size_on_disk(self) -> int:
        """The bytes of every entry and temporary file in the folder now (a scan; for checks and tests; the
        bound is on :meth:`allocated`, which is more)."""
        total = 0
        for folder, _, names in os.walk(self.root):
            for name in names:
                if name != ".index":
                    try:
                        total += os.lstat(os.path.join(folder, name)).st_size
                    except OSError:
                        pass
        return total


def allocated_on_disk(root: str | os.PathLike) -> int:
    """The disk ``root`` and everything under it takes, in allocated blocks as ``du`` counts them (for checks
    and tests; what :class:`DiskCache` keeps within ``cache_bytes`` for its ``root``)."""
    total = _allocated(os.fspath(root))
    for folder, dirs, names in os.walk(root):
        for name in (*dirs, *names):
            try:
                total += _allocated_of(os.lstat(os.path.join(folder, name)))
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class FolderUsage:
    """A cache folder's ``root`` as one scan found it (:func:`folder_usage`): ``allocated``, the disk it takes in
    whole blocks, folders included (as :func:`allocated_on_disk`); ``nbytes``, the bytes of its files but
    ``.index`` (entries, markers, temporary files: as :meth:`DiskCache.size_on_disk`); ``largest``, the
    largest of those files."""

    allocated: int
    nbytes: int
    largest: int


def folder_usage(root: str | os.PathLike) -> FolderUsage:
    """The :class:`FolderUsage` of ``root`` (a :class:`DiskCache`'s ``root``) now, in one scan; what a sampler
    of a folder being written calls (bench/epochs.py's CachePeak). Not atomic: files evicted or renamed while
    it runs are counted or not.

    >>> usage = folder_usage(cache.root); usage.allocated <= cache.cache_bytes
    True
    """
    top = os.fspath(root)
    allocated, nbytes, largest = _allocated(top), 0, 0
    stack = [top]
    while stack:
        try:
            listing = os.scandir(stack.pop())
        except OSError:  # not made yet, or removed (an emptied subfolder) since listed
            continue
        with listing:
            for entry in listing:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # evicted, or a temporary file renamed, since listed
                    continue
                allocated += _allocated_of(st)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
                elif entry.name != ".index":  # the accounting, not cached bytes
                    nbytes += st.st_size
                    largest = max(largest, st.st_size)
    return FolderUsage(allocated, nbytes, largest)


def running_total(root: str | os.PathLike) -> int | None:
    """The total a cache folder's writers keep in ``<root>/.index``: the disk they counted, which every write
    adds to under the folder's lock before its entry appears (one 8-byte read, no lock); None before the
    folder's first write.

    >>> running_total(cache.root) <= cache.cache_bytes
    True
    """
    try:
        fd = os.open(os.path.join(os.fspath(root), ".index"), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return _read_total(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_total(fd: int) -> int | None:
    """The total ``.index`` (open as ``fd``) holds: 8 bytes, little-endian; None before the folder's first write."""
    raw = os.pread(fd, 8, 0)
    return struct.unpack("<Q", raw)[0] if len(raw) == 8 else None


def _allocated_of(st: os.stat_result) -> int:
    """What a file or folder takes on disk: its blocks, or its size where a file system reports fewer blocks
    than bytes (some FUSE and network ones report none), so a bound in blocks is never one in nothing."""
    return max(st.st_blocks * 512, st.st_size if not stat.S_ISDIR(st.st_mode) else 0)


def _allocated(path: str | int) -> int:
    """:func:`_allocated_of` a path (or an open descriptor); 0 when it is not there."""
    try:
        return _allocated_of(os.fstat(path) if isinstance(path, int) else _again(os.lstat, path))
    except OSError:
        return 0


def _entry_bytes(ident: str, data) -> int:
    """The bytes of the entry file of ``ident`` holding ``data`` (None: a marker, an empty file)."""
    return 0 if data is None else HEADER.size + len(ident.encode("utf-8", "surrogatepass")) + memoryview(data).nbytes


def _reserve(size: int, path: str, seen: set[str], block: int) -> int:
    """What a batch reserves for one more entry file of ``size`` bytes at ``path`` before it is written, in
    blocks of ``block`` bytes: its file's whole blocks; for its subfolder, :data:`DIR_SLACK_BLOCKS` where it is
    the batch's first entry there (the folder made, or grown into an indexed one) and one more block for each
    later one (its name can split a full block of names). ``seen``: the subfolders of the batch's entries so
    far, which gains this one's."""
    folder = path.rpartition("/")[0]
    slack = 1 if folder in seen else DIR_SLACK_BLOCKS
    seen.add(folder)
    return -(-size // block) * block + slack * block


#: The types whose buffers never change (module, name): Python's bytes, obstore's (Rust's ``bytes::Bytes``).
_IMMUTABLE = {("builtins", "bytes"), ("obstore", "Bytes")}


def _immutable(data) -> bool:
    """Whether the bytes of the buffer ``data`` can never change: a bytes or obstore ``Bytes``, or a view of one
    (which the view's ``obj`` names)."""
    if isinstance(data, bytes):
        return True
    owner = memoryview(data).obj
    return isinstance(owner, bytes) or (type(owner).__module__, type(owner).__qualname__) in _IMMUTABLE


def _byte_view(data) -> memoryview:
    """``data`` (any buffer) as a flat view of its bytes (a copy where it is not contiguous)."""
    view = memoryview(data)
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def use_entry_writer(write: Callable | None) -> Callable | None:
    """Have every :class:`DiskCache` of this process write its entries with ``write`` (None: Python's,
    :func:`write_entries`); returns the one used before. ``stoker.engine.cpu.native`` hands over the compiled
    engine's (csrc/entries.c), which releases the GIL once for a batch rather than at each of its system calls.

    >>> previous = use_entry_writer(None)   # the Python writer, e.g. to compare the two
    """
    previous = _entry_writer[0]
    _entry_writer[0] = write
    return previous


#: The writer :func:`use_entry_writer` set (one slot: read by each batch, so the latest setting holds).
_entry_writer: list[Callable | None] = [None]


def use_entry_evictor(evict: Callable | None) -> Callable | None:
    """Have every :class:`DiskCache` of this process scan its folder for eviction with ``evict`` (None: Python's,
    :func:`evict_entries`); returns the one used before. ``stoker.engine.cpu.native`` hands over the compiled
    engine's (csrc/evict.c), which releases the GIL once for the scan rather than at each of its system calls.

    >>> previous = use_entry_evictor(None)   # the Python scan, e.g. to compare the two
    """
    previous = _entry_evictor[0]
    _entry_evictor[0] = evict
    return previous


#: The eviction scan :func:`use_entry_evictor` set (one slot: read at each scan, so the latest setting holds).
_entry_evictor: list[Callable | None] = [None]


def evict_entries(root: str, bound: int, target: int, incoming: int, block: int) -> tuple[int, int, list[bytes]]:
    """Python's twin of the compiled engine's ``evict_entries`` (csrc/evict.c; the same answers): list the
    subfolders of the cache folder ``root`` and measure every file in them (allocated blocks; ``.index`` at least
    ``block``); where ``total + incoming > bound``, unlink the entries (names of 32 lowercase hex digits) least
    recently used first (by mtime, which a hit refreshes) until the total is at most ``target``, removing each
    subfolder that leaves empty. The caller holds the folder's lock. Returns ``(total, evicted, temp)``: the
    disk the folder takes after, the entries unlinked, the names of the subfolders holding a file named like a
    temporary one (counted as any file; the caller removes the dead writers' ones and takes them off).

    >>> total, evicted, temp = evict_entries("/scratch/cache/v1", 50 << 30, 45 << 30, 1 << 20, 4096)
    """
    entries: list[tuple[int, int, str, str]] = []
    total = _allocated(root)
    folders: dict[str, list[int]] = {}  # subfolder -> [its own allocation, names in it, st_dev, st_ino]
    try:
        listing = list(os.scandir(root))
    except OSError:
        listing = []
    for e in listing:
        try:
            if e.is_dir(follow_symlinks=False):
                folders[e.name] = [0, 0, -1, -1]
            elif e.name == ".index":  # its block, even before its first write gives it one
                total += max(_allocated_of(e.stat(follow_symlinks=False)), block)
            else:
                total += _allocated_of(e.stat(follow_symlinks=False))  # anything else kept here
        except OSError:
            continue
    temp: list[bytes] = []
    for name, counts in folders.items():
        folder = os.path.join(root, name)
        try:
            st = os.lstat(folder)
            names = list(os.scandir(folder))
        except OSError:
            continue
        counts[0], counts[2], counts[3] = _allocated_of(st), st.st_dev, st.st_ino
        total += counts[0]
        held_temp = False
        for e in names:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            counts[1] += 1
            held = _allocated_of(st)
            total += held  # entries, markers (none), live writers' temporary files, anything else
            if e.name.startswith(".") and ".tmp-" in e.name:
                held_temp = True
            if _ENTRY.fullmatch(e.name):
                entries.append((st.st_mtime_ns, held, name, e.name))  # sorted as csrc/evict.c sorts
        if held_temp:
            temp.append(os.fsencode(name))
    evicted = 0
    if total + incoming > bound:
        entries.sort()
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return total, evicted, temp
        dir_fd, dir_of, dir_gone = -1, "", False  # the subfolder last unlinked in, open (or gone)
        try:
            for _, held, name, entry in entries:
                if total <= target:
                    break
                counts = folders[name]
                if dir_of != name:
                    # through the subfolder listed, never a link put at its name since (which would unlink a
                    # file of an entry's name outside the cache): opened not following one, still the same
                    if dir_fd >= 0:
                        os.close(dir_fd)
                    dir_fd, dir_of, dir_gone = -1, name, False
                    try:
                        dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
                        ds = os.fstat(dir_fd)
                        if (ds.st_dev, ds.st_ino) != (counts[2], counts[3]):
                            os.close(dir_fd)
                            dir_fd = -1
                    except FileNotFoundError:
                        dir_gone = True  # its entries gone with it, as an unlink's ENOENT
                    except OSError:
                        if dir_fd >= 0:
                            os.close(dir_fd)
                        dir_fd = -1
                if dir_fd < 0 and not dir_gone:
                    continue  # replaced since listed (a link, another folder): its names are not this scan's
                if dir_fd >= 0:
                    try:
                        os.unlink(entry, dir_fd=dir_fd)  # a reader that opened it reads on; later ones miss
                    except FileNotFoundError:
                        pass
                    except OSError:
                        continue
                total -= held
                evicted += 1
                counts[1] -= 1
                if counts[1] == 0:
                    try:
                        os.rmdir(name, dir_fd=root_fd)  # emptied: its block freed (a write makes it again)
                        total -= counts[0]
                    except OSError:
                        pass  # something came into it: it stays, and stays counted
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
            os.close(root_fd)
    return total, evicted, temp


def write_entries(items: Sequence[tuple[bytes, bytes, Any]], tag: str, seed: int) -> tuple[list[int], list[int], int]:
    """Python's twin of the compiled engine's ``write_entries`` (csrc/entries.c; the same files, the same
    answers): make each ``(path, ident, payload)`` (payload None: a marker, an empty file) at ``path``, a
    ``<root>/<subfolder>/<name>``, through a temporary sibling ``.<name>.tmp-<tag>-<8 hex>`` (drawn from
    ``seed``) created exclusively and never through a link, and renamed onto it; a missing subfolder is made.
    The caller holds the folder's lock. Stops at the first failure. Returns ``(results, allocated, grown)``:
    each 1 written, 0 there already (left as it is) or not tried, -errno failed; the disk each file took; what
    the disk gave the batch (the files, their subfolders' growth, the root's where subfolders were made).

    >>> write_entries([(b"/c/v1/ab/ab12", b"ident", b"bytes")], "host-12", 7)  # the subfolder made too
    ([1], [4096], 8192)
    """
    draw = random.Random(seed)
    results, allocated = [0] * len(items), [0] * len(items)
    folders: dict[bytes, int] = {}  # each subfolder touched -> what it took before
    root, root_before, grown = None, 0, 0
    for i, (path, ident, payload) in enumerate(items):
        parent, _, name = path.rpartition(b"/")
        up, slash, sub = parent.rpartition(b"/")
        if not (name and up and slash and sub):
            results[i] = -errno.EINVAL
            break
        try:
            if parent not in folders:
                try:
                    st = _again(os.lstat, parent)
                except FileNotFoundError:
                    if root is None:  # the root grows by the subfolders made: measured before the first
                        root, root_before = up, _allocated(up)
                    try:
                        _again(os.mkdir, parent)  # only under the folder's lock: eviction may remove an empty one
                    except FileExistsError:
                        pass
                    folders[parent] = 0
                else:
                    if not stat.S_ISDIR(st.st_mode):  # a link or a file planted there: never written through
                        results[i] = -errno.ENOTDIR
                        break
                    folders[parent] = _allocated_of(st)
            if _there_already(path):
                continue  # another process wrote it meanwhile (or it came twice in this batch)
            made = _write_one(path, parent, name, ident, payload, tag, draw)
        except OSError as exc:
            results[i] = -(exc.errno or errno.EIO)
            break
        if made is not None:
            results[i], allocated[i] = 1, made
            grown += made
    grown += sum(_allocated(folder) - before for folder, before in folders.items())
    if root is not None:
        grown += _allocated(root) - root_before
    return results, allocated, grown


def _write_one(path: bytes, parent: bytes, name: bytes, ident: bytes, payload: Any, tag: str,
               draw: random.Random) -> int | None:
    """One file of :func:`write_entries`: the disk it took, or None (a marker made meanwhile)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    if payload is None:  # a marker: an empty file made at its name in one step
        for _ in range(MARKER_TRIES):
            try:
                fd = os.open(path, flags, 0o666)
                break
            except FileExistsError:
                if _there_already(path):
                    return None  # made meanwhile: the same marker
                # gone again before the lstat (an outside cleaner): tried again, never "not a regular file"
        else:
            raise FileNotFoundError(errno.ENOENT, _MARKER_GONE, os.fsdecode(path))
        try:
            return _allocated_of(os.fstat(fd))
        finally:
            _close(fd)
    for _ in range(100):  # as fsutil's replace_atomically: never reuse what sits at a name
        tmp = b"%s/.%s.tmp-%s-%08x" % (parent, name, tag.encode(), draw.getrandbits(32))
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name after 100 tries", os.fsdecode(path))
    try:
        try:
            header = HEADER.pack(MAGIC, 0, crc32c.crc32c(payload, crc32c.crc32c(ident)), len(ident), len(payload))
            parts = [memoryview(header), memoryview(ident), memoryview(payload)]
            while parts:
                wrote = os.writev(fd, parts)
                while parts and wrote >= parts[0].nbytes:
                    wrote -= parts.pop(0).nbytes
                if parts:
                    parts[0] = parts[0][wrote:]
            made = _allocated_of(os.fstat(fd))
        finally:
            _close(fd)
        _again(os.rename, tmp, path)
    except BaseException:
        try:
            _again(os.unlink, tmp)
        except OSError:
            pass
        raise
    return made


def _again(call: Callable, *args: Any) -> Any:
    """``call(*args)``, made again while a signal interrupts it (EINTR), as the compiled writer's calls are: Python
    does so itself for ``os.open``, ``os.fstat`` and ``os.writev`` (PEP 475), not for lstat, mkdir, rename and
    unlink, which a signal interrupts on a FUSE or network file system."""
    while True:
        try:
            return call(*args)
        except InterruptedError:
            continue


#: How often a marker's O_EXCL open is tried where it failed EEXIST and the lstat then found nothing; after that a
#: writer's -ENOENT: the marker not made, a loss, not a failure (as entries.c's MARKER_TRIES).
MARKER_TRIES = 3
_MARKER_GONE = "a marker removed each time it was made elsewhere (an outside cleaner): not made"

#: Every DiskCache of this process (weakly): a forked child gives each a writer of its own (_after_fork_in_child).
_CACHES: weakref.WeakSet[DiskCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cache in list(_CACHES):
        cache._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: What a writer's -EEXIST means: something not a regular file sits at an entry's name (see _there_already).
_NOT_REGULAR = "not a regular file (something else was put at an entry's name)"


def _there_already(path: bytes) -> bool:
    """Whether an entry (or marker) is at ``path``: a regular file, False where nothing is. Anything else there (a
    folder, a link, a FIFO planted at its name) is no entry a reader takes (they open regular files only, never
    through a link) and nothing to remove or write through: ``FileExistsError``, a failed write (one warning, the
    cache off in this process), never "there already", which left its key fetched at every read unsaid. Other
    lstat failures raise too; a signal is no failure (:func:`_again`)."""
    try:
        st = _again(os.lstat, path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise FileExistsError(errno.EEXIST, _NOT_REGULAR, os.fsdecode(path))
    return True


def _close(fd: int) -> None:
    """``os.close``, never made again: Linux releases the descriptor even when a signal interrupts it (EINTR), and
    another thread may have been given the number since; EINTR counts as closed (as in csrc/entries.c)."""
    try:
        os.close(fd)
    except InterruptedError:
        pass


def read_file(path: str, max_bytes: int, check: Callable[[bytes], bool] | None = None) -> bytes | None:
    """The whole of the regular file ``path`` (None: missing, a link, not a regular file, larger than
    ``max_bytes``, or unreadable), read and touched as the compiled engine reads entries (csrc/entries.c): made
    blocking once if a read says EAGAIN, and touched (its mtime now: the LRU clock) where allowed, only when
    ``check(bytes)`` says it is a good entry (None: any whole file), and only when its mtime is
    :data:`TOUCH_AFTER_S` old or more."""
    # O_NONBLOCK: a FIFO planted at an entry's name must not hang the open (it is no regular file)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        try:
            raw = os.pread(fd, st.st_size, 0)
        except BlockingIOError:  # a file system that honours O_NONBLOCK (some FUSE and network ones): once
            os.set_blocking(fd, True)
            raw = os.pread(fd, st.st_size, 0)
        if len(raw) != st.st_size:
            return None
        if (check is None or check(raw)) and _to_touch(st):
            try:
                os.utime(fd)  # the LRU clock: a hit is a use
            except OSError:
                pass  # a read-only folder: still a hit
        return raw
    except OSError:
        return None
    finally:
        os.close(fd)


def _to_touch(st: os.stat_result) -> bool:
    """Whether an entry last changed at ``st``'s mtime is to be touched now, as csrc/entries.c's to_touch: a
    minute old or more, or dated in the future (another host's clock)."""
    age = time.time() - st.st_mtime
    return age >= TOUCH_AFTER_S or age < 0


def _lock(fd: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _store_total(fd: int, total: int) -> None:
    """Store ``total`` in ``.index`` (held within 8 bytes: sparse files may claim past 2^64 between them)."""
    os.pwrite(fd, struct.pack("<Q", min(max(0, total), (1 << 64) - 1)), 0)


_caches: dict[tuple[str, int, int], DiskCache] = {}
_caches_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)


def disk_cache(folder: str, cache_bytes: int) -> DiskCache:
    """The process's :class:`DiskCache` of ``folder`` with bound ``cache_bytes`` (one writer thread each)."""
    ident = (folder, cache_bytes, os.getpid())  # a forked child gets its own (its writer thread did not survive)
    with _caches_lock:
        cache = _caches.get(ident)
        if cache is None:
            cache = _caches[ident] = DiskCache(folder, cache_bytes)
        return cache
