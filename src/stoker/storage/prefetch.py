"""Prefetch: values and ranges of batches not yet made, fetched ahead into a bounded buffer in memory.

>>> buffer = PrefetchBuffer(max_bytes=64 << 20, max_requests=32)
>>> kv = PrefetchStore(ObjectStore("s3://bkt"), buffer)
>>> kv.prefetch(["g.zarr/c/0/0"], [1 << 20], [ByteRange("g.zarr/s/0", 0, 4096)], seq=7)  # started, not waited for
>>> values, parts = kv.get_many(["g.zarr/c/0/0"], [ByteRange("g.zarr/s/0", 0, 4096)])  # served from the buffer

A wrapper, as :class:`~stoker.storage.cachingstore.CachingStore` is: a pipeline's
:class:`~stoker.storage.locate.Stores` wraps each remote store in one when the pipeline prefetches
(``Config.prefetch_bytes``), so every fetch path (the compiled engine's, the Python decoders', the GPU
staging) consults the buffer first, knowing nothing of it; nothing else does.

Bounds. The buffer holds at most ``max_bytes``: a request is started only when its bytes fit (a range's
length; a whole value's most its codec stores, the estimate the caller gives), counted from start to
:meth:`PrefetchBuffer.retire` (or :meth:`~PrefetchBuffer.close`), and at most ``max_requests`` values and
ranges are asked at once (those that do not fit are not prefetched: the batch fetches them itself).
:attr:`PrefetchBuffer.counters` says what is held, and the peaks. A batch's asks go out in calls of the
store's ``max_in_flight`` requests, side by side, and ranges of one object a gap apart in different calls,
so the store never reads a gap's bytes for them (:func:`_calls`).

Sharing. A value or range asked for a queued batch that a later queued batch also needs is asked once:
the later batch is one more use of it, when it was asked after every push of the later batch's samples
(``pushed`` and ``mark`` count pushes). And once a batch is submitted (:meth:`PrefetchBuffer.fresh_from`)
nothing asked before its pushes is served to any read. So no batch gets bytes read before its samples
were pushed: a batch pushed after an object was rewritten reads the new one, as without prefetch.

Generations. A prefetched value or range is served with the generation it was read at, so a reader's
checks (a shard index against its inner chunks' ranges) see exactly what a fetch at that moment would have
seen: a shard rewritten in between is found stale and read anew, as without prefetch. A prefetch that
failed (an error, a missing value, a short read, the store closed) is served by fetching again, so its
error, if any, surfaces then, typed, from the batch's own fetch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from ..errors import InvalidArgument, ShutdownError, StorageError
from .store import ByteRange, check_key

#: keys whose generations a PrefetchBuffer remembers (and as many rewritten keys): bounded memory over epochs
MAX_KNOWN_KEYS = 1 << 16

#: Longest a synchronous read (``get_many``) waits for a prefetch still in flight before reading itself.
WAIT_S = 60.0


@dataclass
class PrefetchCounters:
    """What a :class:`PrefetchBuffer` holds and did: bytes held (asked or arrived, never above its
    ``max_bytes``) and their peak, requests in flight and their peak, values and ranges started, served to a
    batch (``used``, once per batch that read one), asked again by a later batch and shared with it
    (``shared``), failed, and not started (``skipped``: no room, or asked before the batch's push); and
    ``errors``: the prefetch's own steps that raised (keeping what arrived, the late look-up of kept entries),
    each a bug, warned of once a buffer; the batches concerned fetch what they need themselves."""

    held_bytes: int = 0
    peak_bytes: int = 0
    requests_in_flight: int = 0
    peak_requests: int = 0
    started: int = 0
    used: int = 0
    shared: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0


@dataclass(frozen=True)
class Asked:
    """What :meth:`PrefetchBuffer.ask` did: values and ranges ``started``, and those ``shared`` with an
    earlier batch's request (``shared_bytes`` of them)."""

    started: int
    shared: int
    shared_bytes: int


class _Entry:
    """One value or range asked ahead: its bytes counted (``nbytes``), the newest batch that wants it
    (``seq``), the reads it may still serve (``uses``: one per batch that asked), the pushes made before it
    was asked (``mark``: it serves only batches of those), and its outcome (``got``: ``(data, generation)``,
    or None when it failed), set before ``future`` is done. ``future`` is its request's: the entries asked in
    one call of the store share one (a coordinator asks tens a batch, and a Future, with its lock and
    condition, per entry was most of what asking cost it)."""

    __slots__ = ("nbytes", "seq", "uses", "mark", "future", "read", "got")

    def __init__(self, nbytes: int, seq: int, mark: int) -> None:
        self.nbytes, self.seq, self.uses, self.mark = nbytes, seq, 1, mark
        self.read = False  # taken by its last reader while in flight: delivered to it, no longer held here
        self.future: Any = None  # its call's: set under the buffer's lock before any reader can see it (ask)
        self.got: tuple[Any, Any] | None = None

    def outcome(self) -> tuple[Any, Any] | None:
        return self.got if self.future.done() else None


class PrefetchBuffer:
    """The values and ranges fetched ahead for one pipeline, from any of its stores; thread-safe.

    ``max_bytes`` (>= 1) and ``max_requests`` (>= 1) bound it (see the module docstring). An entry serves
    one read per batch that asked for it, then leaves: a value or range already asked for an earlier batch
    is shared by a later one (no second request, the same bytes and generation) when it was asked after
    every push of the later batch's samples, so no batch gets bytes read before its samples were pushed;
    otherwise the later batch reads it itself when its turn comes. What no read took leaves when
    :meth:`retire` says its batches are made."""

    def __init__(self, max_bytes: int, max_requests: int) -> None:
        if max_bytes < 1 or max_requests < 1:
            raise InvalidArgument(f"PrefetchBuffer needs max_bytes >= 1 and max_requests >= 1, got {max_bytes} "
                                  f"and {max_requests}", knob="prefetch_bytes")
        self.max_bytes, self.max_requests = max_bytes, max_requests
        self.counters = PrefetchCounters()
        self._entries: dict[tuple, _Entry] = {}  # (store, key, start, length): start None for a whole value
        # (store, key): the generation its reads have stated, the MAX_KNOWN_KEYS most recent (a dataset's
        # every key would grow without bound over epochs); an entry served carries its own generation, which
        # the readers' stale-shard checks compare, so forgetting an old key only loses this early refusal
        self._generations: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        # (store, key) seen at two generations: never prefetched again (as many, the most recent)
        self._changed: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        # the pushes of the newest batch submitted (fresh_from): entries asked before them serve nobody, as
        # any batch fetching now may be of those pushes
        self._fresh = 0
        self.on_room: Callable[[], None] | None = None  # told when requests end (the coordinator may plan)
        self._begun = 0  # the newest batch that took its slot (see begun)
        self._warned = False  # an error of the prefetch's own was warned of (see report_error)

    def room(self, nbytes: int = 1, requests: int = 1) -> bool:
        """Whether ``nbytes`` and ``requests`` more would fit now."""
        c = self.counters
        with self._lock:
            return not self._closed and c.held_bytes + nbytes <= self.max_bytes and \
                c.requests_in_flight + requests <= self.max_requests

    def start(self, store: Any, keys: Sequence[str], estimates: Sequence[int], requests: Sequence[ByteRange],
              seq: int, pushed: int = 0, mark: int = 0) -> int:
        """How many of these were started: see :meth:`ask`."""
        return self.ask(store, keys, estimates, requests, seq, pushed, mark).started

    def ask(self, store: Any, keys: Sequence[str], estimates: Sequence[int], requests: Sequence[ByteRange],
            seq: int, pushed: int = 0, mark: int = 0) -> "Asked":
        """Start fetching, through ``store``'s ``start_get_many``, the whole values of ``keys`` (each at most
        ``estimates[i]`` bytes) and the ``requests``, for the batch numbered ``seq`` (``pushed``: the pushes
        its samples came in, counted; ``mark``: the pushes made so far, at most what the store will see), as
        far as they fit. One asked already for an earlier batch, with a ``mark`` of at least ``pushed``
        (asked once this batch's samples were pushed), is shared: this batch is one more use of it. Returns
        what was started and shared (never waits)."""
        sid = id(store)
        asked: list[tuple[tuple, Any, _Entry]] = []
        shared = shared_bytes = 0
        with self._lock:
            if self._closed:
                return Asked(0, 0, 0)
            c = self.counters
            held, n = c.held_bytes, c.requests_in_flight
            wanted = [((sid, k, None, None), k, int(e)) for k, e in zip(keys, estimates)] + \
                     [((sid, r.key, r.start, r.length), r, r.length) for r in requests]
            for ident, what, nbytes in wanted:
                entry = self._entries.get(ident)
                if ident[:2] in self._changed:
                    c.skipped += 1
                elif entry is not None:
                    if entry.mark >= pushed and entry.seq < seq and _usable(entry, True):  # same bytes, one request
                        entry.uses += 1
                        entry.seq = seq
                        c.shared += 1
                        shared, shared_bytes = shared + 1, shared_bytes + nbytes
                    else:  # asked before this batch's samples were pushed (maybe before a rewrite it must
                        c.skipped += 1  # see), or failed: fetched by its batch at its turn
                elif held + nbytes > self.max_bytes or n + 1 > self.max_requests:
                    c.skipped += 1
                else:
                    entry = self._entries[ident] = _Entry(nbytes, seq, mark)
                    asked.append((ident, what, entry))
                    held, n = held + nbytes, n + 1
            if not asked:
                return Asked(0, shared, shared_bytes)
            c.held_bytes, c.requests_in_flight = held, n
            c.peak_bytes, c.peak_requests = max(c.peak_bytes, held), max(c.peak_requests, n)
            c.started += len(asked)
            groups = _calls(asked, getattr(store, "max_in_flight", len(asked)))
            for group in groups:  # one future a call, shared by its entries, there before a reader sees them
                future: concurrent.futures.Future = concurrent.futures.Future()
                for _, _, entry in group:
                    entry.future = future
        for group in groups:
            self._call(store, group)
        return Asked(len(asked), shared, shared_bytes)

    def _call(self, store: Any, asked: list) -> None:
        """One ``start_get_many`` for ``asked`` (entries counted in flight already, sharing one future)."""
        whole = [a for a in asked if a[0][2] is None]
        ranged = [a for a in asked if a[0][2] is not None]
        try:
            future = store.start_get_many([a[1] for a in whole], [a[1] for a in ranged], versions=True,
                                          lenient=range(len(ranged)))
        except Exception:  # noqa: BLE001 - the store refused at once (closed...): the batches fetch themselves
            self._arrived(store, whole + ranged, None)
            return
        future.add_done_callback(lambda f: self._arrived(store, whole + ranged, f))

    def _arrived(self, store: Any, asked: list, future: Any) -> None:
        """Keep what a prefetch brought (each with its generation); drop what failed or would not fit. Every
        entry's future is settled, kept or not, whatever raised here, so a batch waiting on one goes on
        (fetching it itself); an error of this step's own is counted and warned of (:meth:`report_error`)."""
        got: list = [None] * len(asked)
        if future is not None:
            try:
                values, parts, value_versions, part_versions = store.result_of(future)
                got = list(zip(values, value_versions)) + list(zip(parts, part_versions))
            except BaseException:  # noqa: BLE001 - a failed prefetch: its batch fetches itself, and sees why
                pass
        results = []
        on_room, error = None, None
        try:
            with self._lock:
                c = self.counters
                c.requests_in_flight -= len(asked)
                on_room = None if self._closed else self.on_room
                for (ident, _, entry), outcome in zip(asked, got):
                    try:
                        results.append((entry, self._kept(ident, entry, outcome)))
                    except Exception as exc:  # noqa: BLE001 - dropped as failed, the rest kept; warned below
                        error = error or exc
                        if self._entries.get(ident) is entry:
                            del self._entries[ident]
                            c.held_bytes -= entry.nbytes
                            c.failed += 1
            for entry, result in results:
                entry.got = result
        finally:  # after every entry's outcome is set (None where none was): a reader woken finds them all
            for flight in {id(a[2].future): a[2].future for a in asked}.values():
                if not flight.done():
                    flight.set_result(None)
        try:
            if error is not None:  # its warning raises where warnings are errors: the coordinator is woken still
                self.report_error(store, f"keeping the {len(asked)} values and ranges a prefetch brought", error)
        finally:
            if on_room is not None:
                on_room()

    def _kept(self, ident: tuple, entry: _Entry, outcome: tuple | None) -> tuple | None:
        """Under the lock: what ``entry`` (``ident``) serves of what its request brought (``outcome``:
        ``(data, generation)``, None if it failed), its bytes counted; None where it serves nothing."""
        c = self.counters
        data = None if outcome is None else outcome[0]
        ok = data is not None and not isinstance(data, BaseException)
        size = memoryview(data).nbytes if ok else 0
        settled = ok and self._observe(ident[0], ident[1], outcome[1])
        if self._entries.get(ident) is not entry:  # taken, retired or closed: bytes given back then
            return (data, outcome[1]) if ok and entry.read else None
        if not settled or size > entry.nbytes:  # failed, changed, or larger than its estimate
            del self._entries[ident]
            c.held_bytes -= entry.nbytes
            c.failed += 1
            return None
        c.held_bytes -= entry.nbytes - size
        entry.nbytes = size
        return data, outcome[1]

    def report_error(self, store: Any, what: str, exc: BaseException) -> None:
        """A step of the prefetch's own (``what``) raised ``exc``: counted (``counters.errors``) and warned of
        once a buffer, naming the store and the error. Nothing fails: the batches concerned fetch what they
        need themselves, as without prefetch. Warned before counted, so whoever sees the count has the warning;
        counted even where warnings are errors (the warning then raises, after the count)."""
        with self._lock:
            warn, self._warned = not self._warned, True
        try:
            if warn:
                warnings.warn(f"stoker's prefetch from {getattr(store, 'uri', store)}: {what} failed "
                              f"({type(exc).__name__}: {exc}); those batches fetch their values themselves, not "
                              "ahead (PrefetchCounters.errors counts each time). A bug in stoker: please report it "
                              "with this message", RuntimeWarning, stacklevel=2)
        finally:
            with self._lock:
                self.counters.errors += 1

    def seen(self, store: Any, keys: Sequence[str], generations: Sequence[Any]) -> None:
        """Note the generations a read through ``store`` stated for ``keys`` (see :meth:`_observe`)."""
        with self._lock:
            for key, generation in zip(keys, generations):
                self._observe(id(store), key, generation)

    def _observe(self, sid: int, key: str, generation: Any) -> bool:
        """Under the lock: whether ``key`` has shown one generation only, ``generation`` now included. A key
        seen at two (its object rewritten) loses its entries and is never prefetched again: an entry read at
        the old generation must not answer a reader that re-read the shard index at the new one (its retry
        expects a fresh read), and generations have no order to tell which is newer."""
        if generation is None:
            return True
        name = (sid, key)
        if name in self._changed:
            self._changed.move_to_end(name)
            return False
        known = self._generations.setdefault(name, generation)
        self._generations.move_to_end(name)
        if len(self._generations) > MAX_KNOWN_KEYS:
            self._generations.popitem(last=False)
        if known == generation:
            return True
        self._changed[name] = None
        if len(self._changed) > MAX_KNOWN_KEYS:
            self._changed.popitem(last=False)
        del self._generations[name]
        for ident in [i for i in self._entries if i[:2] == name]:
            self.counters.held_bytes -= self._entries.pop(ident).nbytes
        return False

    def claim(self, store: Any, keys: Sequence[str], requests: Sequence[ByteRange], wait: bool) -> tuple[dict, dict]:
        """What the buffer holds of ``keys`` (whole values) and ``requests`` read through ``store``:
        ``({key number: entry}, {request number: (entry, cut)})``, ``cut`` taking the entry's data to the
        request's bytes (a range of a whole value prefetched is cut from it). ``wait``: entries still in
        flight too (their futures say when they arrive), else only those arrived."""
        with self._lock:
            values, parts, taken = self._servable(id(store), keys, requests, wait)
            for ident, entry in taken.items():
                entry.uses -= 1
                if entry.uses <= 0:  # read by every batch that asked: its bytes are the readers' now
                    entry.read = True
                    del self._entries[ident]
                    self.counters.held_bytes -= entry.nbytes
        return values, parts

    def held(self, store: Any, keys: Sequence[str], requests: Sequence[ByteRange]) -> tuple[set, set]:
        """The numbers of ``keys`` (whole values) and of ``requests`` that :meth:`claim` would serve now
        (arrived or in flight), claiming nothing."""
        with self._lock:
            values, parts, _ = self._servable(id(store), keys, requests, True)
        return set(values), set(parts)

    def _servable(self, sid: int, keys: Sequence[str], requests: Sequence[ByteRange],
                  wait: bool) -> tuple[dict, dict, dict]:
        """Under the lock: the entries that may serve ``keys`` and ``requests`` read through store ``sid`` now
        (arrived, or in flight too with ``wait``; asked after the fresh mark; their key not rewritten):
        ``({key number: entry}, {request number: (entry, cut)}, {ident: entry})``, a range served by its own
        entry or cut from its object's whole value. What :meth:`claim` takes and :meth:`held` reports."""
        values: dict[int, _Entry] = {}
        parts: dict[int, tuple[_Entry, Callable]] = {}
        found: dict[tuple, _Entry] = {}  # each entry once, however many of the call's ranges it serves
        if self._closed or not self._entries:
            return values, parts, found
        fresh = self._fresh

        def serving(ident: tuple) -> _Entry | None:
            entry = self._entries.get(ident)
            return entry if entry is not None and entry.mark >= fresh and _usable(entry, wait) else None

        for i, key in enumerate(keys):
            ident = (sid, key, None, None)
            if ident[:2] not in self._changed and (entry := serving(ident)) is not None:
                values[i] = found[ident] = entry
        for j, r in enumerate(requests):
            if (sid, r.key) in self._changed:
                continue
            for ident, cut in (((sid, r.key, r.start, r.length), _whole), ((sid, r.key, None, None), _cutter(r))):
                if (entry := serving(ident)) is not None:
                    parts[j] = (entry, cut)
                    found[ident] = entry
                    break
        return values, parts, found

    def begun(self, seq: int) -> None:
        """Batch ``seq`` took its slot: its fetches start now, so nothing is asked for it or earlier batches
        later (:meth:`awaited`)."""
        with self._lock:
            self._begun = max(self._begun, seq)

    def awaited(self, seq: int) -> bool:
        """Whether batch ``seq`` has yet to take its slot (see :meth:`begun`): what is asked for it now may still
        serve it rather than be fetched twice."""
        with self._lock:
            return not self._closed and seq > self._begun

    def fresh_from(self, pushed: int) -> None:
        """A batch of the first ``pushed`` pushes is being submitted: from now on no entry asked before those
        pushes is served (any batch fetching may be of them, and must see what was stored when they were
        made). Called before the batch's fetches start; the mark only grows."""
        with self._lock:
            self._fresh = max(self._fresh, pushed)

    def used(self, n: int) -> None:
        with self._lock:
            self.counters.used += n

    def retire(self, seq: int) -> None:
        """Drop what only batches numbered ``seq`` or lower wanted (they are made): its bytes given back."""
        with self._lock:
            gone = [ident for ident, entry in self._entries.items() if entry.seq <= seq]
            for ident in gone:
                self.counters.held_bytes -= self._entries.pop(ident).nbytes

    def close(self) -> None:
        """Drop everything held; nothing is started or served from now on (requests in flight end with
        their store, which the pipeline closes)."""
        with self._lock:
            self._closed = True
            self._entries.clear()
            self._generations.clear()
            self.counters.held_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def _calls(asked: list, per_call: int) -> list[list]:
    """``asked`` cut into calls of at most ``per_call`` requests (a store's ``max_in_flight``: the most one
    call has open at once, so one call of a batch's 64 values would take four round trips where four calls
    side by side take one; the pipeline's ``requests_in_flight`` still caps them together). Ranges of one
    object that touch stay in one call (the store reads them as one); ranges of one object a gap apart go to
    different calls, so the store never merges them across the gap: its bytes would be read and thrown away
    (a later batch asks those chunks by their own ranges), and with requests side by side a merge saves no
    round trip. Whole values are one request each."""
    runs: list[tuple[str, list]] = []  # (key, asked entries read as one request)
    ends: dict[str, int] = {}
    for a in sorted(asked, key=lambda a: (a[0][1], -1 if a[0][2] is None else a[0][2])):
        key, start, length = a[0][1], a[0][2], a[0][3]
        if start is not None and runs and runs[-1][0] == key and ends.get(key, -1) >= start >= 0:
            runs[-1][1].append(a)
            ends[key] = max(ends[key], start + length)
            continue
        runs.append((key, [a]))
        ends[key] = -1 if start is None or start < 0 else start + length
    calls: list[tuple[set, list]] = []  # (keys in the call, its entries)
    for key, group in runs:
        # the first call with room and no other run of this object (else a new one)
        home = next((c for c in calls if key not in c[0] and len(c[0]) < max(1, per_call)), None)
        if home is None:
            home = (set(), [])
            calls.append(home)
        home[0].add(key)
        home[1].extend(group)
    return [entries for _, entries in calls]


def _usable(entry: _Entry, wait: bool) -> bool:
    """Whether ``entry`` may serve a read now: arrived with its bytes, or still in flight when the read may
    ``wait`` for it."""
    if not entry.future.done():
        return wait
    return entry.got is not None



def _whole(data):
    return data


def _cutter(r: ByteRange) -> Callable:
    """The bytes of ``r`` cut from a whole value (None when the value is shorter: read again)."""

    def cut(data):
        view = memoryview(data)
        start = len(view) - r.length if r.is_suffix else r.start
        return None if start < 0 or start + r.length > len(view) else view[start:start + r.length]

    return cut


class PrefetchStore:
    """``store`` (a remote store that ``starts_reads``) whose reads are served from ``buffer`` first; see the
    module docstring. Thread-safe; everything else is the store's."""

    def __init__(self, store: Any, buffer: PrefetchBuffer) -> None:
        self.store = store
        self.buffer = buffer

    uri = property(lambda self: self.store.uri)
    supports_ranges = property(lambda self: self.store.supports_ranges)
    supports_list = property(lambda self: self.store.supports_list)
    is_local = property(lambda self: self.store.is_local)
    reports_versions = property(lambda self: self.store.reports_versions)
    starts_reads = property(lambda self: self.store.starts_reads)
    max_gap = property(lambda self: self.store.max_gap)
    root = property(lambda self: getattr(self.store, "root", None))
    # the disk cache's, read by the coordinator every batch (Ahead._lost, the decoder's table of entries,
    # revalidate_ahead): a property each, not __getattr__'s fallback, which comes after an AttributeError raised
    # and caught (2-5 us each on a loaded machine: 7 a batch). One the store lacks raises AttributeError as before
    fetched = property(lambda self: self.store.fetched)
    cache = property(lambda self: self.store.cache)
    changes = property(lambda self: self.store.changes)
    settled = property(lambda self: self.store.settled)
    revalidate = property(lambda self: self.store.revalidate)
    fresh_until = property(lambda self: self.store.fresh_until)
    listed = property(lambda self: self.store.listed)
    lists_any = property(lambda self: self.store.lists_any)

    @property
    def losses(self) -> int:
        """The store's disk cache's losses (:attr:`CachingStore.losses
        <stoker.storage.cachingstore.CachingStore.losses>`; 0 where it has none): what ``Ahead`` compares."""
        return getattr(self.store, "losses", 0)

    def __reduce__(self):  # to worker processes: the store alone (a buffer is one pipeline's, in memory)
        return _unwrapped, (self.store,)

    def prefetch(self, keys: Sequence[str], estimates: Sequence[int], requests: Sequence[ByteRange],
                 seq: int, pushed: int = 0, mark: int = 0) -> int:
        """Start fetching these ahead for the batch numbered ``seq`` (see :meth:`PrefetchBuffer.start` and
        :meth:`ask`)."""
        return self.ask(keys, estimates, requests, seq, pushed, mark).started

    def ask(self, keys: Sequence[str], estimates: Sequence[int], requests: Sequence[ByteRange], seq: int,
            pushed: int = 0, mark: int = 0) -> Asked:
        """As :meth:`prefetch`, saying what was started and what shared (:meth:`PrefetchBuffer.ask`). Whole
        values the store's disk cache keeps (:meth:`_local`) are revalidated, not fetched ahead."""
        for key in keys:
            check_key(key)
        keys, estimates = self._local(keys, estimates, seq, pushed, mark)
        return self.buffer.ask(self.store, keys, estimates, requests, seq, pushed, mark)

    def _local(self, keys: Sequence[str], estimates: Sequence[int], seq: int = 0, pushed: int = 0,
               mark: int = 0) -> tuple[Sequence[str], Sequence[int]]:
        """``keys`` (and their ``estimates``) less the whole values whose entries the store's disk cache holds at
        the generation known now (``kept_on_disk``, then ``kept_entries``); those kept whose generation is not
        known are asked now (``when_revalidated``: a HEAD each over HTTP, shared with any read) and fetched
        ahead then if their entry is gone (:meth:`_later`). Their bytes are local: fetched ahead they were read from disk in Python into the
        buffer (the cache's reader threads, a batch's every chunk), where the batch's own read, once the
        generation is known, has the compiled engine read the entry file (``entry_files``). A range is
        asked as before: a kept object need not hold the range's entry (another range of a shard was kept)."""
        kept_on_disk = getattr(self.store, "kept_on_disk", None)
        if kept_on_disk is None or not keys:
            return keys, estimates
        kept = kept_on_disk(keys)
        if not any(kept):
            return keys, estimates
        # a marker outlives the entries it speaks for (evicted, or another generation's): skipped only where
        # the entry itself is on disk at the generation known now; where none is known yet, looked at again
        # once it is (_later), and what is not on disk then is fetched ahead
        marked = [i for i, on_disk in enumerate(kept) if on_disk]
        where = dict(zip(marked, self.store.kept_entries([keys[i] for i in marked])))
        unknown = [i for i in marked if where[i] is None]
        if unknown:
            self._later([keys[i] for i in unknown], [estimates[i] for i in unknown], seq, pushed, mark)
        rest = [i for i in range(len(keys)) if not kept[i] or where[i] is False]
        return [keys[i] for i in rest], [estimates[i] for i in rest]

    def _later(self, keys: list[str], estimates: list[int], seq: int, pushed: int, mark: int) -> None:
        """Revalidate ``keys`` (kept, generations not known now); once known, fetch ahead those whose entry is
        not on disk (:meth:`_local`), unless batch ``seq`` took its slot meanwhile (it fetches them itself:
        :meth:`PrefetchBuffer.awaited`). On a disk cache reader thread (a ``stat`` a key at most)."""
        def check() -> None:
            try:
                if not self.buffer.awaited(seq):
                    return
                where = self.store.kept_entries(keys)
                rest = [i for i, on_disk in enumerate(where) if on_disk is False]
                if rest:
                    self.buffer.ask(self.store, [keys[i] for i in rest], [estimates[i] for i in rest], [], seq,
                                    pushed, mark)
            except ShutdownError:  # closing: nothing more to ask
                pass
            except Exception as exc:  # noqa: BLE001 - must not fail anything (the batch fetches), but is a bug
                self.buffer.report_error(self.store, f"looking up the disk cache's entries of {len(keys)} kept "
                                                     "values once revalidated", exc)

        self.store.when_revalidated(keys, check)

    @property
    def entry_files(self) -> Callable | None:
        """The store's ``entry_files`` (a disk cache's entries the compiled engine reads itself; None where the
        store has no disk cache), but None for what the buffer holds or is fetching: that is read from here,
        and not asked of the store."""
        return self._unbuffered("entry_files")

    @property
    def entry_rows(self) -> Callable | None:
        """The store's ``entry_rows`` (the same entries with what a decoder's table keeps of them), but None for
        what the buffer holds or is fetching, as :attr:`entry_files`."""
        return self._unbuffered("entry_rows")

    def _unbuffered(self, name: str) -> Callable | None:
        """The store's method ``name`` (``entry_files`` or ``entry_rows``) asked only of what the buffer neither
        holds nor is fetching (None in their place)."""
        inner = getattr(self.store, name, None)
        if inner is None:
            return None

        def entry_files(keys: Sequence[str], requests: Sequence[ByteRange]) -> list:
            values, parts = self.buffer.held(self.store, keys, requests)
            if not values and not parts:
                return inner(keys, requests)
            # only the rest asked of the store (a batch's prefetched chunks are asked again when it is made)
            rest_k = [i for i in range(len(keys)) if i not in values]
            rest_p = [j for j in range(len(requests)) if j not in parts]
            found: list = [None] * (len(keys) + len(requests))
            for n, entry in zip([*rest_k, *(len(keys) + j for j in rest_p)],
                                inner([keys[i] for i in rest_k], [requests[j] for j in rest_p])):
                found[n] = entry
            return found

        return entry_files

    def start_get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                       lenient: Collection[int] = ()) -> concurrent.futures.Future:
        """The store's ``start_get_many``, served from the buffer where it holds (or is fetching) a value or
        range; the rest, and what the buffer failed to bring, fetched from the store."""
        values, parts = self.buffer.claim(self.store, keys, requests, wait=True)
        if not values and not parts:
            inner = self.store.start_get_many(keys, requests, versions=versions, lenient=lenient)
            if versions:  # the generations it states are noted (a rewritten object stops being prefetched)
                names = [*keys, *(r.key for r in requests)]
                inner.add_done_callback(lambda f: self._seen(names, f))
            return inner
        future: concurrent.futures.Future = concurrent.futures.Future()
        _Combined(self, keys, requests, versions, lenient, values, parts, future)
        return future

    def get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                 lenient: Collection[int] = ()) -> tuple:
        """The store's ``get_many``, served from the buffer where a value or range has arrived."""
        values, parts = self.buffer.claim(self.store, keys, requests, wait=False)
        if not values and not parts:
            return self.store.get_many(keys, requests, versions=versions, lenient=lenient)
        future: concurrent.futures.Future = concurrent.futures.Future()
        _Combined(self, keys, requests, versions, lenient, values, parts, future)
        try:
            return future.result(timeout=WAIT_S)
        except concurrent.futures.TimeoutError:
            raise StorageError(f"{self.uri}: a read served partly from the prefetch buffer did not finish within "
                               f"{WAIT_S:.0f} s; the store or the network is stalled", uri=self.uri) from None

    def _seen(self, names: list[str], future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            got = future.result()
            self.buffer.seen(self.store, names, [*got[2], *got[3]])

    def result_of(self, future: concurrent.futures.Future):
        """The result of a finished future of :meth:`start_get_many` (the store's rules: cancelled means
        closed)."""
        return self.store.result_of(future)

    def get_ranges(self, requests: Sequence[ByteRange]) -> list:
        return list(self.get_many([], requests)[1])

    def get(self, key: str):
        return self.store.get(key)

    def get_each(self, requests: Sequence[ByteRange], versions: bool = False) -> Any:
        """The store's ``get_each`` (shard indexes): the generations it states are noted."""
        out, generations = self.store.get_each(requests, versions=True)
        self.buffer.seen(self.store, [r.key for r in requests], generations)
        return (out, generations) if versions else out

    def size(self, key: str) -> int:
        return self.store.size(key)

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.store.list(prefix)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        return self.store.list_dir(prefix)

    def close(self) -> None:
        self.store.close()

    def __getattr__(self, name: str):  # the store's extras (forget, versions, counters...) stay reachable
        if name in ("store", "buffer"):
            raise AttributeError(name)
        return getattr(self.store, name)

    def __repr__(self) -> str:
        return f"PrefetchStore({self.store!r})"


class _Combined:
    """One ``start_get_many`` answered partly from the buffer: the store's part started at once, the buffer's
    awaited; once all are in, what the buffer failed to bring is fetched from the store, then the answer is
    put together in the caller's order and set on ``future``."""

    def __init__(self, kv: PrefetchStore, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool,
                 lenient: Collection[int], values: dict, parts: dict, future: concurrent.futures.Future) -> None:
        self.kv, self.keys, self.requests, self.versions = kv, keys, requests, versions
        self.lenient = set(lenient)
        self.values, self.parts = values, parts
        self.out: tuple = ([None] * len(keys), [None] * len(requests), [None] * len(keys), [None] * len(requests))
        self.future: concurrent.futures.Future | None = future
        miss_k = [i for i in range(len(keys)) if i not in values]
        miss_p = [j for j in range(len(requests)) if j not in parts]
        # each request's future once, however many of its entries this read takes
        flights = {id(e.future): e.future for e in values.values()} | \
            {id(e.future): e.future for e, _ in parts.values()}
        self._left = len(flights) + 1
        self._lock = threading.Lock()
        inner = self._fetch(miss_k, miss_p)  # may raise (store closed): the caller's error, as without prefetch
        for flight in flights.values():
            flight.add_done_callback(self._one_done)
        if inner is None:
            self._one_done(None)
        else:
            inner.add_done_callback(lambda f: self._one_done(f, miss_k, miss_p))

    def _fetch(self, miss_k: list[int], miss_p: list[int]):
        if not miss_k and not miss_p:
            return None
        lenient = [n for n, j in enumerate(miss_p) if j in self.lenient]
        return self.kv.store.start_get_many([self.keys[i] for i in miss_k], [self.requests[j] for j in miss_p],
                                            versions=True, lenient=lenient)

    def _one_done(self, inner, miss_k: list[int] | None = None, miss_p: list[int] | None = None) -> None:
        try:
            if inner is not None and miss_k is not None:
                self._put(miss_k, miss_p or [], self.kv.store.result_of(inner))
            with self._lock:
                self._left -= 1
                if self._left:
                    return
            self._settle()
        except BaseException as exc:  # noqa: BLE001 - the caller's result_of raises it
            self._answer(exc)

    def _answer(self, outcome: Any) -> None:
        """Settle the caller's future (once), then let go of it: the buffer's entries keep their futures'
        callbacks (this object's) until retired, and the caller's callbacks hold its batch (a view of its
        slot), which must not outlive the batch."""
        future, self.future, self.out = self.future, None, ()
        if future is None:
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def _put(self, ks: list[int], ps: list[int], got: tuple) -> None:
        self.kv.buffer.seen(self.kv.store, [self.keys[i] for i in ks] + [self.requests[j].key for j in ps],
                            [*got[2], *got[3]])
        values, parts, value_versions, part_versions = self.out
        for i, data, gen in zip(ks, got[0], got[2]):
            values[i], value_versions[i] = data, gen
        for j, data, gen in zip(ps, got[1], got[3]):
            parts[j], part_versions[j] = data, gen

    def _settle(self) -> None:
        """Everything is in: the buffer's part put in place; what it failed to bring fetched now."""
        if self.future is None:
            return
        values, parts, value_versions, part_versions = self.out
        again_k, again_p = [], []
        for i, entry in self.values.items():
            got = entry.outcome()
            if got is None:
                again_k.append(i)
            else:
                values[i], value_versions[i] = got
        for j, (entry, cut) in self.parts.items():
            got = entry.outcome()
            data = None if got is None else cut(got[0])
            if data is None:
                again_p.append(j)
            else:
                parts[j], part_versions[j] = data, got[1]
        self.kv.buffer.used(len(self.values) + len(self.parts) - len(again_k) - len(again_p))
        if not again_k and not again_p:
            self._answer(self.out if self.versions else self.out[:2])
            return
        self.values = self.parts = {}
        with self._lock:
            self._left = 1
        inner = self._fetch(again_k, again_p)
        inner.add_done_callback(lambda f: self._one_done(f, again_k, again_p))


def _unwrapped(store: Any) -> Any:
    return store


__all__ = ["Asked", "PrefetchBuffer", "PrefetchCounters", "PrefetchStore", "WAIT_S"]
