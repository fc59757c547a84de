"""CachingStore: an object store's chunk values and byte ranges kept on local disk, revalidated by generation.

>>> kv = CachingStore(ObjectStore("s3://bkt"), disk_cache("/scratch/cache", 50 << 30))
>>> values, parts = kv.get_many(["g.zarr/c/0/0"], [ByteRange("g.zarr/s/0", 0, 4096)])  # misses: fetched, kept
>>> values, parts = kv.get_many(["g.zarr/c/0/0"], [ByteRange("g.zarr/s/0", 0, 4096)])  # hits: no request

A wrapper, as :class:`~stoker.storage.counting.CountingStore` is: the pipeline and ``open_array`` get one
where a cache is configured (:class:`~stoker.storage.locate.Stores`), nothing else knows of it.

What is cached: whole values and ranges read by ``get_many``/``start_get_many``, ``get_each`` and
``get_ranges`` (chunks, inner chunks, shard indexes), each under (store URI, key, range, generation) in a
:class:`~stoker.storage.diskcache.DiskCache`; and, read by ``get``, the metadata documents of the arrays opened
(:data:`DOCUMENTS`), revalidated as their chunks are: an array's listing states its ``zarr.json``'s ETag too,
so opening an array cached before costs one LIST and no GET. Other ``get`` reads (groups' documents) go
to the store.

Generations. A hit needs the object's generation now. Where the store lists (S3, GCS, Azure), they are learnt
in bulk when an array is opened (:meth:`CachingStore.opened`: a listing of its prefix, 1,000 keys with their
ETags a request, up to :data:`LIST_KEYS`; made again once older than half of ``staleness_s``); otherwise, and
for keys past those, by a HEAD request (no body; the store's ``start_versions``) the first time a key is read
through this wrapper or asked ahead (:meth:`CachingStore.revalidate`), one in flight per key whatever asks;
again once older than ``staleness_s`` (as tensorstore's staleness bound: where the store lists, by listing
the key's opened array again, also one its open did not list, as on a cold cache); every fetched answer also
states it. Stale is judged as of when a read (or :meth:`~CachingStore.revalidate`) began: the listing or HEAD
it waits for serves it, so a call lists an array once at most, however short the bound (a call that serves
no read waits for a listing in flight rather than start another). An object rewritten
has another generation, so its old entries are never served (they age out). :meth:`forget` drops what was
learnt, so the next read of every key revalidates; what was asked before it (a listing page, a HEAD) and
answered after is not learnt, as it may predate a rewrite. A read waits for one listing page at most: a
key whose page is further is asked by HEAD, not after every page before its own (the listing goes on).
A key whose generation the store cannot state (no ETag, no Last-Modified) is never cached, nor one versioned by a
Last-Modified second still running when it was asked (see :func:`_settled`). A key of which
nothing was ever kept needs no HEAD (an empty *marker* file, :meth:`DiskCache.mark
<stoker.storage.diskcache.DiskCache.mark>`, says which keys have entries: a name, no block on disk), so a
cold cache costs the requests an uncached read does.

Opens (issue 47: revalidated when a pipeline or reader opens its array, and at most every ``staleness_s``
after). A pipeline has its own wrapper, so it revalidates when it starts. ``open_array`` outside a pipeline
revalidates at each open (``forget(prefix)``, then :meth:`opened`): every read after an open uses a
generation learnt after it. Only how differs: an array is listed at most once in half of ``staleness_s``;
opened again sooner (a Dataset that opens the array for each item), its objects are revalidated by a HEAD
each as they are first read after that open, not by listing up to ten pages again at each open.
"""

from __future__ import annotations

import concurrent.futures
import operator
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Sequence

from ..errors import NotFound, ShutdownError
from ..runtime.memo import remember
from ..runtime.workers import when_all_done
from .diskcache import DiskCache, disk_cache
from .keytree import KeyTree
from .objectstore import modified_at
from .store import ByteRange, Store, by_key, check_key, check_prefix, not_found


@dataclass
class CacheCounters:
    """What a :class:`CachingStore` served: bytes from disk (``hit_bytes``) and from the store
    (``miss_bytes``), values and ranges each way, those the store was asked for and did not have (``absent``:
    a chunk never written, read as its fill value; a request each read, nothing kept), and HEAD requests made
    to revalidate (``revalidations``, one a key) and listing pages asked (``listings``)."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    revalidations: int = 0
    listings: int = 0
    absent: int = 0

    @property
    def hit_rate(self) -> float:
        """The share of bytes served from disk (0 before any read)."""
        total = self.hit_bytes + self.miss_bytes
        return self.hit_bytes / total if total else 0.0


#: A key learnt to be missing, or whose store states no generation: read through, not asked again until stale.
_UNCACHED = object()


#: How long after the start of its Last-Modified second an answer must have been asked for its bytes to be kept
#: (see _settled): that second, plus this much difference between the server's clock and ours.
SETTLED_S = 1.0 + 2.0


#: What a ``_known`` value was learnt at (its second item).
_WHEN = operator.itemgetter(1)


def _settled(generation: Any, asked: float) -> bool:
    """Whether the bytes of an answer asked at ``asked`` (monotonic) may be kept under ``generation``. A server
    without ETags versions an object by its size and Last-Modified time, in whole seconds: an object answered
    while its second was still running may be rewritten within that second at the same size (an uncompressed
    chunk always has its size) and keep that version, and its entry would then be served for ever, however
    long after the rewrite. So such an answer is kept only if it was asked :data:`SETTLED_S` after its second
    began; one asked sooner is read through (the next read after that keeps it). An ETag changes with every
    rewrite: always kept."""
    modified = modified_at(generation)
    return modified is None or time.time() - (time.monotonic() - asked) >= modified + SETTLED_S


def _ident(uri: str, key: str, start: int | None, length: int | None, generation: Any) -> str:
    where = "all" if start is None else f"{start}:{length}"
    return f"{uri}\n{key}\n{where}\n{generation!r}"


class CachingStore:
    """``store`` (an object store: ``versions``, ``get_many``, ``start_get_many``, ``get_each``) read through
    ``cache``; see the module docstring. Thread-safe."""

    reports_versions = True

    def __init__(self, store: Any, cache: DiskCache, staleness_s: float = 60.0, read_files: Any = None) -> None:
        self.store = store
        self.cache = cache
        self.staleness_s = staleness_s
        self.read_files = read_files  # how hits are read (see DiskCache.get_many; None: in Python)
        self.counters = CacheCounters()
        self._known: dict[str, tuple[Any, float]] = {}  # key -> (generation, when learnt: monotonic)
        self._known_keys = KeyTree()  # the keys of _known by folder: forget(prefix) finds them without a scan
        # how often a generation known was replaced by another, or forgotten: what a memo of entries made at
        # the generations known (the decoder's, engine/cpu/decode_native.py) compares to learn it is stale
        self.changes = 0
        # (key, start, length) -> (generation, ident, entry): what entry_files made for that generation
        self._entry_files: dict[tuple, tuple[Any, str, tuple[bytes, bytes]]] = {}
        # the cache's losses when _entry_files, _marked and _found were last checked against them (see _unmade)
        self._losses = cache.losses
        # keys (and opened prefixes, with their "/") whose marker this wrapper wrote (MARKERS_FOUND at most)
        self._marked: dict[str, None] = {}
        self._found: dict[str, None] = {}  # keys whose marker was found on disk (see _has_marker; MARKERS_FOUND at most)
        self._opened: set[str] = set()  # prefixes of the arrays opened (see opened)
        self._listings: dict[str, _Listing] = {}  # prefix -> its newest listing
        self._heads: dict[str, concurrent.futures.Future] = {}  # key -> the flight of its HEAD in flight
        self._listed_at: dict[str, float] = {}  # prefix -> when opened() last listed it (see opened)
        self._forgot: dict[str, float] = {}  # prefix ("" for all) -> when forget() dropped what was under it
        self._local = threading.local()  # gens: the generations _start resolved for the _serve it calls
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        # whether the store lists with generations (S3, GCS, Azure; not an HTTP server): see opened
        self._lists = bool(getattr(store, "supports_list", False)) and hasattr(store, "start_list_versions")

    uri = property(lambda self: self.store.uri)
    supports_ranges = property(lambda self: self.store.supports_ranges)
    supports_list = property(lambda self: self.store.supports_list)
    lists_in_memory = property(lambda self: self.store.lists_in_memory)
    is_local = property(lambda self: self.store.is_local)

    def __reduce__(self):  # to worker processes: the store rebuilt there, the same folder
        return _rebuild, (self.store, str(self.cache.folder), self.cache.cache_bytes, self.staleness_s,
                          self.read_files)

    def forget(self, prefix: str | None = None) -> None:
        """Drop every generation learnt and every listing: the next read of each key revalidates it. With
        ``prefix`` (the array at ``prefix`` is opened again: what ``open_array`` calls), only what was learnt
        under it, and the listings of the folders above it (so a folder inside a listed array is revalidated
        by HEAD, not by what that array's listing says or has yet to say). Listings and HEADs in flight are
        not learnt when they answer (they may predate a rewrite).

        >>> kv.forget("g.zarr/a")   # keys under g.zarr/a/ revalidated by their next read (or the next opened)
        """
        if prefix is not None:
            prefix = check_prefix(prefix)
            under = prefix + "/" if prefix else ""
            with self._lock:
                self._forgot[prefix] = time.monotonic()  # answers to reads started before now: not learnt
                gone = self._known_keys.pop_under(prefix)
                # generations forgotten: memos of entries made at them are stale (none learnt under prefix, as
                # when a new array is opened on a held store: the other arrays' memos stay good)
                self.changes += bool(gone)
                for key in gone:
                    del self._known[key]
                for key in [k for k in self._heads if k.startswith(under)]:  # in flight: answers not learnt
                    del self._heads[key]
                for folder in [p for p in self._listings if p == prefix or p.startswith(under)]:
                    del self._listings[folder]  # its pages in flight are not learnt (see _listed)
                # listings of folders above (an array's, ``prefix`` a folder in it): their pages to come would
                # teach keys under ``prefix`` as of before now, and a key under it they do not name would
                # count as missing; dropped, so those keys are revalidated by HEAD (what they taught stays)
                while under and (above := self._listing_of(under)) is not None:
                    del self._listings[above.prefix]
            return
        with self._lock:
            self.changes += 1
            self._forgot = {"": time.monotonic()}
            self._listed_at.clear()
            self._found.clear()
            self._known.clear()
            self._known_keys.clear()
            self._listings.clear()  # pages of a listing no longer here are not learnt (see _listed)
            self._heads.clear()  # nor HEADs started before now (see _headed): asked again by the next read

    # -- generations -----------------------------------------------------------------------------

    def opened(self, prefix: str) -> None:
        """An array at ``prefix`` is being opened: its objects' generations are revalidated now, in bulk where
        the store lists (S3, GCS, Azure): one page of 1,000 keys with their ETags a request, pages fetched as
        they come (at most :data:`LIST_KEYS` keys), while the array's metadata is read and its first batches
        planned; a read that needs a key not listed yet waits for its page, and a key listed nowhere is read
        through (missing, or written since). Nothing is listed where nothing under ``prefix`` was ever kept
        (a cold cache costs the requests an uncached read does), and an HTTP server, which cannot list, has
        each object revalidated by a HEAD as a read (or :meth:`revalidate`) first needs it.

        >>> kv.opened("g.zarr/a")   # a LIST started; reads of g.zarr/a/c/... then find their generations known
        """
        prefix = check_prefix(prefix)
        with self._lock:
            self._opened.add(prefix)
        if not self._lists:
            return
        now = time.monotonic()
        with self._lock:
            listed = self._listed_at.get(prefix)
        if listed is not None and now - listed < self.staleness_s / 2:
            return  # opened again soon after it was listed: its objects revalidated by a HEAD each as read
        if not self._has_marker(prefix + "/"):
            return
        with self._lock:
            self._listed_at[prefix] = now
        self._relist(prefix, now)

    def listed(self, prefix: str) -> bool:
        """Whether a listing holds the generation of every object under ``prefix`` now: one of ``prefix`` (or a
        folder above) that came whole (every page, none failed, within :data:`LIST_KEYS` keys) less than half
        of ``staleness_s`` ago. Then nothing under it needs asking ahead; after that half, the next read or
        :meth:`revalidate` of a key under it starts the next listing (so asking then keeps reads from waiting).
        False where nothing was listed: a store that cannot list, an open that found nothing kept (a cold
        cache), an array opened again soon after its listing (then forgotten), a listing still coming.

        >>> kv.opened("g.zarr/a"); kv.listed("g.zarr/a")   # False until its last page came
        """
        # checked first, listed or not: a bad prefix is the caller's error whatever the store has listed (a
        # split and a scan: cheap enough for a call per array of every batch)
        prefix = check_prefix(prefix)
        if not self._listings:  # nothing listed (HTTP; a cold cache's opens): asked per array of every batch
            return False
        now = time.monotonic()
        with self._lock:
            listing = self._listing_of(prefix + "/")
            return listing is not None and listing.complete and now - listing.started < self.staleness_s / 2

    def lists_any(self) -> bool:
        """Whether any listing is held: where none is (HTTP; arrays opened on a cold cache), :meth:`listed` is
        False for every prefix, so a caller with many arrays of this store to ask about looks once, not once an
        array (it says nothing of any prefix otherwise).

        >>> kv.lists_any()   # False before any open found something kept to list
        False
        """
        return bool(self._listings)

    def revalidate(self, keys: Collection[str]) -> dict[str, float]:
        """Start revalidating the generations of ``keys`` that are stale, without waiting (a listing or HEAD
        requests on the store's event loop, one per key at most however many reads ask): what a pipeline
        calls for the objects of batches planned ahead, so that their reads find the generations known.
        Returns, for the keys whose generation is known now and younger than half of ``staleness_s`` (asking
        about them does nothing: no HEAD, and no listing, which starts again only past that half), until when
        (``time.monotonic()``) that holds: a caller asking often (a batch at a time) skips them until then; a
        key past that half that no listing covers, until the bound itself (asking does nothing before a HEAD
        is due: :meth:`_idle_until`).

        >>> until = kv.revalidate(["g.zarr/a/c/0/0"])   # {} on the first ask; then {key: learnt + bound / 2}
        """
        now = time.monotonic()
        half = self.staleness_s / 2
        try:
            with self._lock:
                known = list(map(self._known.get, keys))
        except TypeError:  # an unhashable key: check_key says what is wrong with it
            for key in keys:
                check_key(key)
            raise
        # asked for every chunk of every batch a pipeline plans (a second epoch's, each known): a step a key
        fresh = {key: got[1] + half for key, got in zip(keys, known) if got is not None and now - got[1] < half}
        if len(fresh) == len(keys):
            return fresh
        self._idle_until(keys, known, fresh, now)
        if len(fresh) == len(keys):
            return fresh
        rest = set(keys).difference(fresh)
        for key in rest:  # what is known was read (or listed) under a checked key; the rest asks the store
            check_key(key)
        self._resolve(rest, lambda gens: None, patient=True)
        return fresh

    def fresh_until(self, keys: Sequence[str]) -> float:
        """Until when (``time.monotonic()``) asking about every one of ``keys`` does nothing (each known and younger
        than half of ``staleness_s``, or within it where no listing covers it): the earliest of what
        :meth:`revalidate` would return for them; 0.0 unless it would
        return them all (asking about them then does nothing). One look-up for many keys, asking nothing: what a
        pipeline checks for a box of chunks it kept the keys of, a second epoch's, before asking chunk by chunk.

        >>> kv.fresh_until(["g.zarr/a/c/0/0", "g.zarr/a/c/0/1"])   # doctest: +SKIP
        4711.5
        """
        if not keys:
            return 0.0
        with self._lock:
            known = list(map(self._known.get, keys))
        if None in known:
            return 0.0
        half = self.staleness_s / 2
        oldest = min(map(_WHEN, known))
        now = time.monotonic()
        if now - oldest < half:
            return oldest + half
        # some past half the bound: those no listing covers stay idle until the bound (see _idle_until)
        young = {key: got[1] + half for key, got in zip(keys, known) if now - got[1] < half}
        self._idle_until(keys, known, young, now)
        return min(young.values()) if len(young) == len(keys) else 0.0

    def _idle_until(self, keys: Sequence[str], known: list, fresh: dict[str, float], now: float) -> None:
        """Add to ``fresh`` (key -> until, those younger than half the bound) the keys among ``keys`` (their
        ``known`` generations, as looked up) that are past half of ``staleness_s`` but within it and that no
        listing covers: asking about one does nothing until the bound (no listing starts again for it, and a
        HEAD only once it is stale: :meth:`_known_now`), so until then, ``learnt + staleness_s``. Without this,
        a second epoch begun past half the bound (a first epoch longer than that, on a loaded machine) had its
        pipeline ask about each of them chunk by chunk, every batch, for nothing, as no answer could be kept.
        A key a listing covers is asked at half the bound (its listing starts again then), as before."""
        staleness = self.staleness_s
        idle = [(key, got) for key, got in zip(keys, known)
                if got is not None and key not in fresh and now - got[1] < staleness]
        if not idle:
            return
        if not self._listings:  # nothing listed (HTTP; arrays opened on a cold cache): none is covered
            fresh.update((key, got[1] + staleness) for key, got in idle)
            return
        with self._lock:
            fresh.update((key, got[1] + staleness) for key, got in idle if self._listing_of(key) is None)

    def _relist(self, prefix: str, now: float) -> "_Listing":
        """A new listing of ``prefix`` (its first page started), in place of the one before."""
        begin: list[_Listing] = []
        with self._lock:
            listing = self._registered(prefix, now, begin)
        self._next_page(listing, None, listing.future)
        return listing

    def _registered(self, prefix: str, now: float, begin: list) -> "_Listing":
        """Under the lock: a new listing of ``prefix`` in place of the one before, its first page to come
        (``future``), appended to ``begin``: the caller starts that page (:meth:`_next_page`) after the lock.
        Registered first, so that a read looking meanwhile waits for its page rather than asking again."""
        listing = _Listing(prefix, now)
        listing.future = concurrent.futures.Future()
        self._listings[prefix] = listing
        begin.append(listing)
        return listing

    def _list_unlisted(self, key: str, now: float, begin: list, since: float) -> "_Listing | None":
        """Under the lock: for a stale ``key`` that no listing covers, a listing of the opened array it is under
        (registered: see :meth:`_registered`), where the store lists and that array was not listed in the last
        half of ``staleness_s`` (see :meth:`opened`); else None (the key is asked by HEAD). An array opened on
        a cold cache was not listed (nothing kept then); once its objects are past the bound, one listing of
        1,000 keys a request revalidates them, not a HEAD each. Not again for a call (begun at ``since``) that
        listed it already (its listing forgotten since): a HEAD then."""
        if not self._lists:
            return None
        folder = self._opened_of(key)
        if folder is None or folder == "/":  # not under an opened array, or the whole bucket: not listed
            return None
        prefix = folder[:-1]
        listed = self._listed_at.get(prefix)
        if listed is not None and (now - listed < self.staleness_s / 2 or listed >= since):
            return None  # listed (or opened again) lately: a HEAD each, as opened() decides
        self._listed_at[prefix] = now
        return self._registered(prefix, now, begin)

    def _next_page(self, listing: "_Listing", offset: str | None, page: concurrent.futures.Future) -> None:
        """Ask the page after ``offset``; ``page`` (``listing.future`` already, set under the lock by the caller,
        so that a reader never finds a finished page there while the next is being asked) is settled once it
        came and what it holds is learnt."""
        try:
            future = self.store.start_list_versions(listing.prefix, offset, LIST_PAGE)
        except Exception:  # noqa: BLE001 - closed, or the store refused: keys under it are revalidated by HEAD
            with self._lock:
                if listing.future is page:
                    listing.future = None
            _settle(page)
            return
        with self._lock:
            self.counters.listings += 1
        future.add_done_callback(lambda f: self._listed(listing, f, page))

    def _listed(self, listing: "_Listing", future: concurrent.futures.Future, page: concurrent.futures.Future) -> None:
        """A page of ``listing`` came (on the store's event loop): its keys' generations learnt as of when the
        listing started (conservative: a key changed since is revalidated no later than the bound), and the
        next page started while it may hold keys within :data:`LIST_KEYS`. A listing no longer the newest of
        its prefix (another started since, or :meth:`forget`) learns nothing: it may predate a rewrite that
        the newer one was started to see. ``page`` is settled last, after the next page's is in its place."""
        try:
            pairs, more = self.store.result_of(future)
        except BaseException:  # noqa: BLE001 - a failed listing: its keys are revalidated by HEAD each
            pairs, more = None, False
        following = None
        try:
            with self._lock:
                self._learn_page(listing, pairs, more)
                go_on = self._listings.get(listing.prefix) is listing and pairs is not None and more and \
                    listing.listed < LIST_KEYS
                listing.future = following = concurrent.futures.Future() if go_on else None
        finally:
            _settle(page)  # its waiters look again: the keys learnt, or the next page in flight
        if following is not None:
            self._next_page(listing, listing.upto, following)

    def _learn_page(self, listing: "_Listing", pairs: list | None, more: bool) -> None:
        """Under the lock: what a page of ``listing`` states, learnt (nothing if another listing replaced it)."""
        if pairs is not None and self._listings.get(listing.prefix) is listing:
            self._set_known_many(pairs, listing.started, newer_stays=True)
            listing.listed += len(pairs)
            if pairs:
                listing.upto = pairs[-1][0]
            listing.complete = not more

    def _listing_of(self, key: str) -> "_Listing | None":
        """Under the lock: the listing of the nearest folder above ``key`` that was listed, if any."""
        end = len(key)
        while self._listings:
            end = key.rfind("/", 0, end)
            if end <= 0:
                return self._listings.get("")
            found = self._listings.get(key[:end])
            if found is not None:
                return found
        return None

    def _generations(self, keys: Collection[str]) -> dict[str, Any]:
        """The generation of each of ``keys`` now (None: unknown, missing or not stated: read uncached): those
        :meth:`_start` resolved already, or resolved here, waiting (bounded) for listings and HEADs."""
        given = getattr(self._local, "gens", None)
        if given is not None:
            return given
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._resolve(set(keys), lambda found: _settle(done, found))
        try:
            found = done.result(timeout=self._wait_s())
        except concurrent.futures.TimeoutError:  # the store stalled: read through, the read says what is wrong
            return {}
        if isinstance(found, BaseException):
            raise found
        return found

    def _wait_s(self) -> float:
        """The longest a read waits for revalidation: a listing page, then a round of HEADs, each as long as one
        store request can take with its retries (an ObjectStore's own bound), with slack."""
        store = self.store
        one = sum(getattr(store, name, 30.0) for name in ("retry_timeout_s", "max_backoff_s", "timeout_s",
                                                           "connect_timeout_s"))
        return 2 * one + 10

    def _resolve(self, names: set[str], then: Callable[[Any], None], checked: bool = False,
                 patient: bool = False, waited: bool = False, since: float | None = None) -> None:
        """Call ``then(generations)`` once the generation of each of ``names`` is known now (None: read it
        uncached), waiting for nothing: listing pages in flight are awaited by callback, stale keys' HEADs
        started (one in flight per key, shared by every read that needs it), side by side. ``then`` runs on
        this thread or on the store's event loop, and gets a ShutdownError (or whatever error the
        revalidation met) in place of the dict, always once. A read waits for one listing page at most: a
        key not on the page that came (``waited``) is asked by HEAD, not after the pages before its own, one
        after the other (``patient``: :meth:`revalidate`, which no read waits for, waits for its page).
        ``checked``: see :meth:`_known_now`. ``since``: when the call began (None: now), kept as it looks again
        after each page, so that what is fresh for it is judged as of then (see :meth:`_fresh`): a call starts
        one listing of an array at most, whatever the bound."""
        now = time.monotonic()
        since = now if since is None else since
        got, head, waits, since = self._known_now(names, now, checked, patient or not waited, since, patient,
                                                  refresh=not waited)
        if not waits and not head:
            then(got)
            return
        join = _Join(int(bool(waits)) + int(bool(head)), got, then)
        if waits:  # then again for the keys the pages may hold (which have entries: checked)
            rest = names - got.keys() - set(head)
            when_all_done(waits, lambda: self._resolve(rest, join.add, True, patient, True, since), join.add)
        if head:
            self._head(head, join.add, since)

    def _fresh(self, learnt: float, since: float) -> bool:
        """Whether a generation learnt at ``learnt`` (when the listing or HEAD that stated it was asked) may
        serve a call that began at ``since``: learnt less than ``staleness_s`` before the call began, as
        tensorstore's staleness bound (data no older than the bound at the time of the request), so a listing
        or HEAD the call waited for serves it, whatever the bound. Judged as of now, a bound shorter than a
        listing page's round trip found each page's keys stale as they came (dated from the listing's start),
        and the call listed the array again, a chain of LIST requests that only close ended."""
        return since - learnt < self.staleness_s

    def _head(self, keys: list[str], then: Callable[[Any], None], since: float) -> None:
        """``then({key: generation or None})`` once the HEADs of ``keys`` (started here, or in flight already
        for another read) have answered and what they found is learnt; ``since``: when the call began."""
        try:
            flights = self._heads_for(keys)
        except ShutdownError as exc:
            then(exc)
            return

        def headed() -> None:  # after _headed (called back first, in the order callbacks were added)
            out = {}
            with self._lock:
                for key in keys:
                    known = self._known.get(key)
                    fresh = known is not None and known[0] is not _UNCACHED and self._fresh(known[1], since)
                    out[key] = known[0] if fresh else None  # failed, missing or no generation: read through
            then(out)

        when_all_done(flights, headed, then)

    def _heads_for(self, keys: list[str]) -> set[concurrent.futures.Future]:
        """The flights of the HEAD requests of ``keys``: those in flight already for another read, and one
        ``start_versions`` call for the rest, started now. A flight's future is settled once what its
        requests found is learnt."""
        with self._lock:
            flights = {self._heads[k] for k in keys if k in self._heads}
            new = [k for k in keys if k not in self._heads]
            if new:
                flight: concurrent.futures.Future = concurrent.futures.Future()
                for key in new:
                    self._heads[key] = flight
                flights.add(flight)
                self.counters.revalidations += len(new)
        if new:
            now = time.monotonic()
            try:
                started = self._start_versions(new)
            except BaseException:
                self._headed(new, None, now, flight)
                raise
            started.add_done_callback(lambda f: self._headed(new, f, now, flight))
        return flights

    def _start_versions(self, keys: list[str]) -> concurrent.futures.Future:
        """The store's HEADs of ``keys`` started (a store that cannot start them: asked here)."""
        start = getattr(self.store, "start_versions", None)
        if start is not None:
            return start(keys)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(self.store.versions(keys))
        except ShutdownError:
            raise
        except Exception as exc:  # noqa: BLE001 - every key's revalidation failed: read through
            future.set_exception(exc)
        return future

    def _headed(self, keys: list[str], future: concurrent.futures.Future | None, now: float,
                flight: concurrent.futures.Future) -> None:
        """What the HEADs of ``keys`` started at ``now`` found (``future``; None: they never started), learnt
        where no newer answer is known (a listing started after them may have seen a rewrite they predate, as
        :meth:`_learn_page` keeps a newer read's answer); then ``flight`` settled, no longer in flight."""
        try:
            found = [None] * len(keys) if future is None else self.store.result_of(future)
            failed = future is None
        except BaseException:  # noqa: BLE001 - every key's revalidation failed: learnt nothing, read through
            found, failed = [None] * len(keys), True
        with self._lock:
            for key, version in zip(keys, found):
                if self._heads.get(key) is not flight:
                    continue  # forgotten while in flight (see forget): it may predate a rewrite
                del self._heads[key]
                known = self._known.get(key)
                if known is not None and known[1] > now:
                    continue  # a newer answer stays (a listing asked after these HEADs)
                if isinstance(version, NotFound) or (version is None and not failed):
                    # missing, or no generation stated: read through (one request a read, as without a
                    # cache), not asked again until stale
                    self._set_known(key, _UNCACHED, now)
                elif version is not None and not isinstance(version, BaseException):
                    self._set_known(key, version, now)
                # an error of this key's: learnt nothing; its reads go through, and say what is wrong
        flight.set_result(None)

    def _known_now(self, keys: Collection[str], now: float, checked: bool = False,
                   wait_pages: bool = True, since: float | None = None,
                   ahead: bool = False, refresh: bool = True) -> tuple[dict[str, Any], list[str], set, float]:
        """``(generations, stale, pages, since)``: the generation of each of ``keys`` known now (None: read
        uncached), the keys to revalidate by HEAD before their entries may be served, the listing pages in
        flight that may hold the rest (all of ``keys`` are in one of the three), and ``since`` for the call's
        next look (see ``ahead``). A listing older than half the
        staleness bound is started again here, so that a steady reader never waits for one. ``checked``: every
        one of ``keys`` is known to have entries (no disk look-up, which the store's event loop must not do).
        ``wait_pages`` False: a key whose page has not come is asked by HEAD (see :meth:`_resolve`). ``since``:
        when the call began (None: ``now``): what was learnt less than the bound before it is fresh for the call
        (:meth:`_fresh`), so a listing it started or waited for is never started again for it.
        ``ahead``: the call serves no read (:meth:`revalidate`), so a listing in flight that has yet to reach a
        key does for it, however old (``since`` given back as that listing's start): a pipeline asks ahead for
        each batch it plans, and under a bound shorter than a page's round trip each ask replaced the listing
        before its first page came, so none was ever learnt. ``refresh`` False (a call looking again after the
        page it waited for): no listing started ahead, the one it waited for is as new as it needs."""
        since = now if since is None else since
        out: dict[str, Any] = {}
        stale = []
        again: dict[str, _Listing] = {}
        with self._lock:
            for key in keys:
                known = self._known.get(key)
                if known is not None and self._fresh(known[1], since):
                    out[key] = None if known[0] is _UNCACHED else known[0]
                    if refresh and self._listings and now - known[1] >= self.staleness_s / 2:
                        listing = self._listing_of(key)
                        if listing is not None and listing.future is None and listing.started < since and \
                                now - listing.started >= self.staleness_s / 2:
                            again[listing.prefix] = listing
                else:
                    stale.append(key)
        for prefix in again:
            self._relist(prefix, now)
        if not stale:
            return out, [], set(), since
        # a key of which nothing was ever kept (no marker) needs no HEAD: its read goes to the store anyway
        # and states the generation; so a cold cache costs the requests an uncached read does
        kept = stale if checked else [key for key in stale if self._has_marker(key)]
        for key in stale:
            out[key] = None
        head: list[str] = []
        pending: list[str] = []
        pages: set = set()
        begin: list[_Listing] = []  # listings registered here, their first pages started after the lock
        with self._lock:
            for key in kept:
                known = self._known.get(key)
                if known is not None and self._fresh(known[1], since):  # learnt meanwhile
                    out[key] = None if known[0] is _UNCACHED else known[0]
                    continue
                listing = self._listing_of(key)
                if listing is None:  # its array opened without a listing (a cold cache), or forgotten
                    listing = self._list_unlisted(key, now, begin, since)
                elif not self._fresh(listing.started, since):  # listed too long before the call began
                    if ahead and listing.future is not None and not listing.covers(key):
                        since = listing.started  # its page to come does for a call that serves no read
                    else:
                        listing = self._registered(listing.prefix, now, begin)  # listed again
                if listing is None:
                    head.append(key)
                elif listing.covers(key):  # listed nowhere: missing (or written since): read through
                    self._set_known(key, _UNCACHED, listing.started)
                elif wait_pages and listing.future is not None and not listing.future.done():  # its page to come
                    pages.add(listing.future)  # (a finished page is never there: see _next_page)
                    pending.append(key)
                else:  # beyond the keys a listing takes, or the listing failed
                    head.append(key)
        for listing in begin:
            self._next_page(listing, None, listing.future)
        for key in (*head, *pending):
            del out[key]
        return out, head, pages, since

    def kept_on_disk(self, keys: Sequence[str]) -> list[bool]:
        """Whether entries of each of ``keys`` may be on disk (its marker: :meth:`_has_marker`; a look-up on disk
        at most per key, remembered). What a prefetch asks before fetching a whole value ahead: one kept here
        is local, its read needs only its generation (:meth:`revalidate`), not its bytes fetched ahead."""
        return [self._has_marker(key) for key in keys]

    def kept_entries(self, keys: Sequence[str]) -> list[bool | None]:
        """Whether the whole value of each of ``keys`` is on disk now: True where its entry is on disk (or queued
        for writing) at the generation known now (:meth:`entry_files`), False where that generation is known
        (or the key is read uncached) and no entry is there (evicted, never written), None where no
        generation is known now (:meth:`revalidate` first). What a prefetch asks of a key whose marker
        (:meth:`kept_on_disk`) says entries may be kept: a marker outlives the entries it speaks for."""
        now, staleness = time.monotonic(), self.staleness_s
        with self._lock:
            known = [self._known.get(key) for key in keys]
        fresh = [i for i, got in enumerate(known) if got is not None and now - got[1] < staleness]
        found: list = [None] * len(keys)
        for i, entry in zip(fresh, self.entry_files([keys[i] for i in fresh], []) if fresh else ()):
            found[i] = entry
        out: list[bool | None] = []
        for key, entry, got in zip(keys, found, known):
            if entry is not None:
                out.append(True)
            elif got is None or now - got[1] >= staleness:
                out.append(None)
            elif got[0] is _UNCACHED:
                out.append(False)
            else:  # queued (entry_files says None for it): local, served from the queue
                out.append(self.cache.queued(_ident(self.uri, key, None, None, got[0])))
        return out

    def when_revalidated(self, keys: Collection[str], then: Callable[[], None]) -> None:
        """As :meth:`revalidate`, and ``then()`` on one of the disk cache's reader threads once the generations
        of ``keys`` are known (or their revalidation failed): never on the store's event loop, which must
        not look on disk. Nothing when no thread can take it (closing)."""
        for key in keys:
            check_key(key)

        def resolved(_generations: Any) -> None:
            try:
                self.cache.serve(then)
            except ShutdownError:
                pass

        self._resolve(set(keys), resolved, patient=True)

    def _has_marker(self, key: str) -> bool:
        """Whether entries of ``key`` may be kept (its marker is on disk). A marker found is remembered (apart
        from those this wrapper wrote: :meth:`_keep` still marks the key's array when it keeps the key; at
        most :data:`MARKERS_FOUND`, then forgotten all at once), and a key whose HEAD is in flight had one:
        a key revalidated ahead and then read (or read by several batches) costs the caller one look-up on
        disk (a hash and a syscall, on the coordinator's thread for a pipeline), not one per ask."""
        self._after_losses()
        if key in self._marked or key in self._found or key in self._heads:
            return True
        if not self.cache.has(self._marker(key)):
            return False
        with self._lock:
            remember(self._found, key, None, MARKERS_FOUND)
        return True

    def _after_losses(self) -> None:
        """Forget the markers this wrapper wrote or found once the disk cache lost entries (:meth:`_unmade`:
        markers may be among them, as :meth:`DiskCache.has <stoker.storage.diskcache.DiskCache.has>` forgets
        them): a key kept again is marked again, so another wrapper of the folder (another pipeline, rank or
        ``open_array``) finds its entries, not a key it reads uncached. One int compared a call."""
        if self.cache.losses != self._losses:
            self._unmade()

    def _marker(self, key: str) -> str:
        """The ident of the empty marker file that says entries of ``key`` may be kept."""
        return f"{self.uri}\n{key}\nkept"

    def _learn(self, key: str, generation: Any, when: float) -> Any:
        """Keep ``generation`` as ``key``'s now (None: nothing learnt), unless a :meth:`forget` of the key came
        after ``when`` (the read that stated it was asked before: it may predate a rewrite) or an answer asked
        after ``when`` is known (a listing or HEAD that may have seen a rewrite this read predates, as
        :meth:`_headed` and :meth:`_learn_page` keep a newer answer); returns it."""
        if generation is not None:
            with self._lock:
                known = self._known.get(key)
                if not self._forgot_since(key, when) and (known is None or known[1] <= when):
                    self._set_known(key, generation, when)
        return generation

    def _set_known(self, key: str, generation: Any, when: float) -> None:
        """Under the lock: ``key``'s generation is ``generation`` as of ``when``; see :meth:`_set_known_many`."""
        self._set_known_many(((key, generation),), when)

    def _set_known_many(self, pairs: Iterable[tuple[str, Any]], when: float, newer_stays: bool = False) -> None:
        """Under the lock: of each ``(key, generation)`` of ``pairs``, ``key``'s generation is ``generation``
        as of ``when`` (None: read through, :data:`_UNCACHED`); another generation than the one known counts a
        change (see :attr:`changes`). ``newer_stays``: a key whose answer known is newer than ``when`` keeps it
        (a listing page's: a read asked after the listing may have seen a rewrite it predates). One loop for
        a listing page's 1,000 keys (a listing per array opened), the new keys filed in one
        :meth:`KeyTree.add_many`."""
        known_map, new, changes = self._known, [], 0
        get = known_map.get
        for key, generation in pairs:
            was = get(key)
            if generation is None:
                generation = _UNCACHED
            if was is None:
                new.append(key)
            elif newer_stays and was[1] > when:
                continue
            elif was[0] is not generation and was[0] != generation:
                changes += 1
            known_map[key] = (generation, when)
        self._known_keys.add_many(new)
        self.changes += changes

    def known_until(self, keys: Sequence[str]) -> list[float]:
        """For each of ``keys``, until when (``time.monotonic()``) the generation known now stays within the
        staleness bound, as :meth:`entry_files` judges it (0.0: none known, or one read through). What a memo
        of the entries :meth:`entry_files` gave may trust them for, while :attr:`changes` and :attr:`losses`
        stay as they were.

        >>> kv.known_until(["g.zarr/a/c/0/0", "g.zarr/a/c/9/9"])   # doctest: +SKIP
        [4711.5, 0.0]
        """
        staleness = self.staleness_s
        with self._lock:
            known = [self._known.get(key) for key in keys]
        return [0.0 if got is None or got[0] is _UNCACHED else got[1] + staleness for got in known]

    def _forgot_since(self, key: str, when: float) -> bool:
        """Under the lock: whether ``key`` was forgotten (itself or a folder above it) after ``when``."""
        if not self._forgot:
            return False
        parts = key.split("/")
        return any(self._forgot.get("/".join(parts[:n]), -1.0) > when for n in range(len(parts) + 1))

    # -- reads -----------------------------------------------------------------------------------

    def get(self, key: str):
        """The whole value of ``key``. A document of an opened array (its ``zarr.json``, ``.zarray``, ``.zattrs``:
        :data:`DOCUMENTS`) is read as a chunk is, from disk at the generation its array's listing states (so
        opening an array cached before costs that one LIST, not a GET more), else from the store and kept;
        a rewritten document has another generation and is read anew. Anything else (a group's documents,
        a key outside the arrays opened) is read from the store, as without the cache."""
        check_key(key)
        with self._lock:
            under = key.rsplit("/", 1)[-1] in DOCUMENTS and self._opened_of(key) is not None
        if not under:
            return self.store.get(key)
        value = self.get_many([key], [])[0][0]
        if value is None:
            raise not_found(self.uri, key)
        return value

    def get_ranges(self, requests: Sequence[ByteRange]) -> list:
        return list(self.get_many([], requests)[1])

    def get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                 lenient: Collection[int] = ()) -> tuple:
        """See :meth:`ObjectStore.get_many <stoker.storage.objectstore.ObjectStore.get_many>`: hits from disk,
        misses in one call to the store."""
        served, miss_keys, miss_parts = self._serve(keys, requests)
        if miss_keys or miss_parts:
            asked = time.monotonic()
            got = self.store.get_many([keys[i] for i in miss_keys], [requests[j] for j in miss_parts], versions=True,
                                      lenient=_lenient(miss_parts, lenient))
            self._merge(served, keys, requests, miss_keys, miss_parts, got, asked)
        return served if versions else served[:2]

    def start_get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                       lenient: Collection[int] = ()) -> concurrent.futures.Future:
        """:meth:`get_many` without waiting, neither for the disk nor for the store: a future. Stale generations
        are revalidated by the store's ``start_versions`` (HEAD requests no thread waits for), then the hits
        are read on the cache's reader threads (:meth:`DiskCache.serve
        <stoker.storage.diskcache.DiskCache.serve>`), not on the caller's: a pipeline's coordinator starts
        prefetches this way, and a batch's disk reads or HEAD requests on it would hold up every batch
        behind them. The misses then complete on the store's event loop (only lists are filled there;
        entries are written by the cache's own thread)."""
        for key in keys:
            check_key(key)
        by_key(requests)  # checks them, here: a malformed request is the caller's error, raised at once
        out: concurrent.futures.Future = concurrent.futures.Future()

        def resolved(gens: Any) -> None:
            if isinstance(gens, BaseException):
                _settle(out, error=gens)
                return
            try:
                self._submit(keys, requests, versions, lenient, out, gens)
            except BaseException as exc:  # noqa: BLE001 - never a read left unsettled
                _settle(out, error=exc)

        self._resolve({*keys, *(r.key for r in requests)}, resolved)
        return out

    def _submit(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool, lenient: Collection[int],
                out: concurrent.futures.Future, gens: dict[str, Any]) -> None:
        """:meth:`_start` on a reader thread (here when none can be had)."""
        try:
            self.cache.serve(self._start, keys, requests, versions, lenient, out, gens)
        except ShutdownError:
            self._start(keys, requests, versions, lenient, out, gens)

    def _start(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool, lenient: Collection[int],
               out: concurrent.futures.Future, gens: dict[str, Any]) -> None:
        """:meth:`start_get_many`'s work (on a reader thread): the hits at the generations resolved (``gens``:
        not resolved again, so a key whose HEAD failed is read through, not asked again), then the store's
        read of the misses; ``out`` gets the result or the error, always."""
        try:
            self._local.gens = gens
            try:
                served, miss_keys, miss_parts = self._serve(keys, requests)
            finally:
                self._local.gens = None
            if not miss_keys and not miss_parts:
                _settle(out, served if versions else served[:2])
                return
            asked = time.monotonic()
            inner = self.store.start_get_many([keys[i] for i in miss_keys], [requests[j] for j in miss_parts],
                                              versions=True, lenient=_lenient(miss_parts, lenient))
        except BaseException as exc:  # noqa: BLE001 - the caller's result_of raises it
            _settle(out, error=exc)
            return

        def finish(f: concurrent.futures.Future, wait: bool) -> None:
            try:
                got = self.store.result_of(f)
                self._merge(served, keys, requests, miss_keys, miss_parts, got, asked, wait)
            except BaseException as exc:  # noqa: BLE001 - the caller's result_of raises it
                _settle(out, error=exc)
            else:
                _settle(out, served if versions else served[:2])

        def done(f: concurrent.futures.Future) -> None:
            # on the store's event loop, which must never wait for the disk: where the cache's writer is behind,
            # the answer is kept (and the read settled) from a reader thread, which waits for room in its queue,
            # so prefetches slow to the writer's pace instead of their entries being dropped
            if self.cache.backlogged:
                try:
                    self.cache.serve(finish, f, True)
                    return
                except ShutdownError:
                    pass
            finish(f, False)

        inner.add_done_callback(done)

    def result_of(self, future: concurrent.futures.Future):
        """The result of a finished future of :meth:`start_get_many` (raising its error)."""
        if future.cancelled():
            raise ShutdownError(f"{self.uri}: the store was closed while a read was in flight", uri=self.uri)
        return future.result()

    def get_each(self, requests: Sequence[ByteRange], versions: bool = False) -> Any:
        """See :func:`~stoker.storage.store.get_each`: hits from disk, misses each its own request."""
        served, _, miss = self._serve([], requests)
        outcomes, gens = list(served[1]), list(served[3])
        if miss:
            now = time.monotonic()  # when asked: a forget after it is not undone by the answer (see _learn)
            got, got_gens = self.store.get_each([requests[j] for j in miss], versions=True)
            absent = 0
            for j, data, gen in zip(miss, got, got_gens):
                outcomes[j], gens[j] = data, gen
                if not isinstance(data, Exception):
                    self._keep(requests[j].key, requests[j].start, requests[j].length, data, gen, now)
                elif isinstance(data, NotFound):
                    absent += 1
            self._absent(absent)
        return (outcomes, gens) if versions else outcomes

    def _serve(self, keys: Sequence[str], requests: Sequence[ByteRange]) -> tuple[tuple, list[int], list[int]]:
        """``((values, parts, value_versions, part_versions), value misses, part misses)``: hits filled in."""
        for key in keys:
            check_key(key)
        by_key(requests)  # checks them
        gens = self._generations({*keys, *(r.key for r in requests)})
        values: list = [None] * len(keys)
        parts: list = [None] * len(requests)
        value_versions: list = [None] * len(keys)
        part_versions: list = [None] * len(requests)
        miss_keys, miss_parts = [], []
        hits = hit_bytes = 0
        # every entry of the call read in one go (with the engine's read_files, one GIL release for them all)
        uri, asked, idents = self.uri, [], []
        for i, key in enumerate(keys):
            gen = gens.get(key)
            if gen is not None:
                asked.append((False, i, gen))
                idents.append(_ident(uri, key, None, None, gen))
        for j, r in enumerate(requests):
            gen = gens.get(r.key)
            if gen is not None:
                asked.append((True, j, gen))
                idents.append(_ident(uri, r.key, r.start, r.length, gen))
        got = dict(zip(((part, n) for part, n, _ in asked), zip(self.cache.get_many(idents, self.read_files),
                                                                 (gen for _, _, gen in asked))))
        for i in range(len(keys)):
            data, gen = got.get((False, i), (None, None))
            if data is None:
                miss_keys.append(i)
            else:
                values[i], value_versions[i] = data, gen
                hits, hit_bytes = hits + 1, hit_bytes + data.nbytes
        # whole values this call read already are cut from, not read again
        read = {keys[i]: got[(False, i)][0] for i in range(len(keys)) if got.get((False, i), (None,))[0] is not None}
        whole = self._from_whole_values(requests, gens, [j for j in range(len(requests))
                                                          if got.get((True, j), (None,))[0] is None], read)
        for j in range(len(requests)):
            data, gen = got.get((True, j), (None, None))
            if data is None and j in whole:
                data, gen = whole[j], gens.get(requests[j].key)
            if data is None:
                miss_parts.append(j)
            else:
                parts[j], part_versions[j] = data, gen
                hits, hit_bytes = hits + 1, hit_bytes + data.nbytes
        with self._lock:
            self.counters.hits += hits
            self.counters.hit_bytes += hit_bytes
        return (values, parts, value_versions, part_versions), miss_keys, miss_parts

    def _from_whole_values(self, requests: Sequence[ByteRange], gens: dict[str, Any], missed: list[int],
                           read: dict | None = None) -> dict:
        """The ranges ``missed`` (numbers in ``requests``) cut from their objects' whole values where those are
        kept at the generation known now (a copy each, so a range does not hold its whole value's buffer):
        a blosc chunk read whole in one epoch is asked again as the blocks a crop needs in the next, and
        those spans depend on what the pipeline learnt first. ``read``: whole values the caller read already
        at those generations, by key (not read again)."""
        read = read or {}
        wanted = {requests[j].key for j in missed if gens.get(requests[j].key) is not None}
        keys = sorted(wanted - read.keys())
        values = {k: read[k] for k in wanted & read.keys()}
        if not keys and not values:
            return {}
        if keys:
            values.update(zip(keys, self.cache.get_many([_ident(self.uri, k, None, None, gens[k]) for k in keys],
                                                        self.read_files)))
        out = {}
        for j in missed:
            r, value = requests[j], values.get(requests[j].key)
            if value is None or r.length > value.nbytes or (not r.is_suffix and r.start + r.length > value.nbytes):
                continue  # not kept, or a range past its end: the store says what it says
            lo = value.nbytes - r.length if r.is_suffix else r.start
            out[j] = memoryview(bytes(value[lo:lo + r.length]))
        return out

    def _merge(self, served: tuple, keys: Sequence[str], requests: Sequence[ByteRange], miss_keys: list[int],
               miss_parts: list[int], got: tuple, asked: float, wait: bool = True) -> None:
        """Put the store's answer for the misses in place, and queue each to be kept on disk; ``asked``: when
        the store was asked (the generations it states are learnt as of then, unless forgotten since); ``wait``:
        whether a full write queue is waited on for room (see :meth:`DiskCache.put
        <stoker.storage.diskcache.DiskCache.put>`)."""
        values, parts, value_versions, part_versions = served
        now = asked
        absent = 0
        for i, data, gen in zip(miss_keys, got[0], got[2]):
            values[i], value_versions[i] = data, gen
            if data is not None:
                self._keep(keys[i], None, None, data, gen, now, wait)
            else:
                absent += 1
        for j, data, gen in zip(miss_parts, got[1], got[3]):
            parts[j], part_versions[j] = data, gen
            if not isinstance(data, Exception):
                self._keep(requests[j].key, requests[j].start, requests[j].length, data, gen, now, wait)
            elif isinstance(data, NotFound):
                absent += 1
        self._absent(absent)

    def _absent(self, n: int) -> None:
        """``n`` values or ranges were asked of the store (a round trip each) and were not there: counted as
        fetched all the same (see :attr:`fetched`)."""
        if n:
            with self._lock:
                self.counters.absent += n

    def _keep(self, key: str, start: int | None, length: int | None, data, gen: Any, now: float,
              wait: bool = True) -> None:
        n = memoryview(data).nbytes
        with self._lock:
            self.counters.misses += 1
            self.counters.miss_bytes += n
        if gen is None:
            return  # no generation: a later read could not tell it from a rewritten object's
        self._learn(key, gen, now)  # an answer states the object's generation as a HEAD would
        if not _settled(gen, now):
            return  # a rewrite within its Last-Modified second would keep this generation: read through
        ident = _ident(self.uri, key, start, length, gen)
        losses = self.cache.losses  # before the write is queued: a loss after it may be this entry's
        self.cache.put(ident, data, wait)
        if self.cache.queued(ident):  # to be written (not refused: too big, a read-only folder, a full queue)
            # its entry once written: what entry_files gives for it (the next epoch's look-up, without a stat);
            # the cache's tickets read after the put: at least this entry's own (see DiskCache.tickets)
            self._made(key, start, length, gen, ident, (os.fsencode(self.cache.path(ident)),
                                                        ident.encode("utf-8", "surrogatepass")), self.cache.tickets)
            self._unmade_if_lost(key, start, length, losses)
        self._after_losses()
        with self._lock:
            marked = key in self._marked
            remember(self._marked, key, None, MARKERS_FOUND)  # as _found: a key marked again costs a look-up
            folder = self._opened_of(key)  # whether or not the key was marked (before its array was opened)
            if folder is not None and folder in self._marked:
                folder = None
            if folder is not None:
                remember(self._marked, folder, None, MARKERS_FOUND)
        if not marked:  # an empty file: no block on disk (DiskCache.mark)
            self.cache.mark(self._marker(key))
        if folder is not None:  # entries of its array kept: its next open lists it (see opened)
            self.cache.mark(self._marker(folder))

    def _opened_of(self, key: str) -> str | None:
        """Under the lock: the opened prefix ``key`` is under, with its "/" (None: none)."""
        end = len(key)
        while self._opened:
            end = key.rfind("/", 0, end)
            if end <= 0:
                return "/" if "" in self._opened else None
            if key[:end] in self._opened:
                return key[:end] + "/"
        return None

    # -- hits read by the compiled engine ---------------------------------------------------------

    def entry_files(self, keys: Sequence[str], requests: Sequence[ByteRange]) -> list:
        """For the whole values of ``keys``, then the ranges ``requests``: the entry to read from disk
        (:meth:`DiskCache.entry_file <stoker.storage.diskcache.DiskCache.entry_file>`, ``(path, ident)``) where
        its object's generation is known now and the entry is on disk, else None (read through
        :meth:`start_get_many`, which revalidates; and what a prefetch asks for). No request and nothing read:
        the compiled engine reads and checks the entries, and what it cannot use (evicted since, corrupt) is
        fetched again through :meth:`start_get_many`.

        A generation known says nothing of which of the object's values and ranges were kept (a shard whose
        index was read, an array listed whole that an earlier epoch read in part): an entry not known here is
        looked for on disk (a ``stat``), so that what was never kept is fetched (prefetched, when planned
        ahead) rather than handed to the engine to find missing. Asked for every chunk of every batch a
        second epoch reads from disk, so an entry found, or written here (:meth:`_keep`), is kept with its
        generation (:data:`ENTRY_FILES_KEPT` at most): asked again at that generation, only whether it is
        queued for writing (not on disk yet: None) is asked anew."""
        queued = self.cache.queued
        return [None if found is None or found[3] is not None and queued(found[3]) else found[0]
                for found in self._entries_known(keys, requests)]

    def entry_rows(self, keys: Sequence[str], requests: Sequence[ByteRange]) -> list:
        """As :meth:`entry_files`, with what a table of entries keeps (the compiled decoder's,
        engine/cpu/entry_table.py): for the whole values of ``keys``, then the ranges ``requests``, ``(path,
        ident, until, ticket)`` where the object's generation is known now and its entry was made here (written,
        or queued: ``ticket``, the cache's :attr:`~stoker.storage.diskcache.DiskCache.tickets` when it was
        queued; the entry is on disk once the cache's ``settled`` reaches it) or found on disk (``ticket`` 0);
        ``until``: as :meth:`known_until`. Else None. No request; a ``stat`` for an entry neither made nor
        found before. What a decoder asks of the chunks a fetch brought (their entries just queued), so the
        next epoch finds them in its table, not here."""
        return [None if found is None else (*found[0], found[1], found[2])
                for found in self._entries_known(keys, requests)]

    def _entries_known(self, keys: Sequence[str], requests: Sequence[ByteRange]) -> list:
        """What :meth:`entry_files` and :meth:`entry_rows` answer from: for the whole values of ``keys``, then
        the ranges ``requests``, ``(entry, until, ticket, ident)`` where the object's generation is known now
        and its entry was made here (``ident``: the entry's, whose write may still be queued; ``ticket`` its
        write's) or is found on disk (``ident`` None, ``ticket`` 0), else None."""
        now = time.monotonic()
        staleness = self.staleness_s
        if self.cache.losses != self._losses:  # entries may be gone since they were remembered
            self._unmade()
        made, uri = self._entry_files, self.uri
        wanted = [(k, None, None) for k in keys] + [(r.key, r.start, r.length) for r in requests]
        with self._lock:
            known = [self._known.get(key) for key, _, _ in wanted]
        out: list = []
        for (key, start, length), got in zip(wanted, known):
            if got is None or got[0] is _UNCACHED or now - got[1] >= staleness:
                out.append(None)
                continue
            until = got[1] + staleness
            kept = made.get((key, start, length))
            if kept is not None and kept[0] == got[0]:  # made (or found) for this generation
                out.append((kept[2], until, kept[3], kept[1]))
                continue
            ident = _ident(uri, key, start, length, got[0])
            entry = self.cache.entry_file(ident)
            if entry is not None and not os.path.exists(entry[0]):  # never kept (or evicted): to fetch
                entry = None
            if entry is not None:
                self._made(key, start, length, got[0], ident, entry)
                out.append((entry, until, 0, None))
            else:
                out.append(None)
        return out

    #: What a decoder asks after a fetch (the entries its values and ranges were just queued as): the same rows,
    #: under a name a prefetch buffer passes through (``PrefetchStore.entry_rows`` leaves out what it holds).
    entries_made = entry_rows

    @property
    def settled(self) -> int:
        """The disk cache's writes settled (see :meth:`entry_rows`)."""
        return self.cache.settled

    def _made(self, key: str, start: int | None, length: int | None, gen: Any, ident: str,
              entry: tuple[bytes, bytes], ticket: int = 0) -> None:
        """Keep ``entry`` (on disk, or queued for writing at ``ticket``) as the one of ``key``'s value or range at
        ``gen`` (see :meth:`entry_files`)."""
        remember(self._entry_files, (key, start, length), (gen, ident, entry, ticket), ENTRY_FILES_KEPT)

    def _unmade(self) -> None:
        """The disk cache lost entries (:meth:`DiskCache.lost <stoker.storage.diskcache.DiskCache.lost>`: an
        eviction, a write not made, an entry a reader found missing): every entry :meth:`entry_files`
        remembered is looked for on disk again (a ``stat`` each, once), so what is gone is fetched, and
        prefetched when planned ahead, rather than handed to the engine to find missing; and the markers
        written or found are forgotten (see :meth:`_after_losses`). Both memos follow the one count."""
        with self._lock:
            self._losses = self.cache.losses
            self._entry_files = {}
            self._marked.clear()
            self._found.clear()

    def _unmade_if_lost(self, key: str, start: int | None, length: int | None, losses: int) -> None:
        """:meth:`_keep` remembered an entry queued when the cache's losses were ``losses``: forgotten again if
        the cache lost any since (its write may be the one not made; :meth:`entry_files` may have checked
        the losses between, and would not look again)."""
        if self.cache.losses != losses:
            with self._lock:
                self._entry_files.pop((key, start, length), None)

    @property
    def losses(self) -> int:
        """How often the disk cache lost entries this process counted on (:meth:`_unmade`): what a planner
        compares to learn that batches found whole on disk may need fetches again."""
        return self.cache.losses

    @property
    def fetched(self) -> int:
        """How many values and ranges this wrapper asked the store for (not found on disk: its counters'
        ``misses``, and ``absent``: chunks never written, which cost a request each read and are never kept):
        what a planner that stopped looking up batches ahead (each found whole on disk) compares to learn
        that batches need fetches again, so a batch reading an absent chunk is prefetched, not waited for."""
        return self.counters.misses + self.counters.absent

    def entries_missed(self, n: int) -> None:
        """The compiled engine found ``n`` entries :meth:`entry_files` gave missing or unsound (evicted by
        another process sharing the folder, or corrupt): a loss (:meth:`_unmade`), so the next look-ups look
        on disk and what else is gone is fetched (and prefetched) rather than handed to the engine."""
        if n:
            self.cache.lost()

    def served_from_disk(self, n: int, nbytes: int) -> None:
        """Count ``n`` values or ranges of ``nbytes`` that the compiled engine read from :meth:`entry_files`."""
        with self._lock:
            self.counters.hits += n
            self.counters.hit_bytes += nbytes
        self.cache.count_hits(n, nbytes)

    # -- the rest, passed through ----------------------------------------------------------------

    def size(self, key: str) -> int:
        return self.store.size(key)

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        return self.store.list_dir(prefix)

    def list(self, prefix: str = "") -> list[str]:
        return self.store.list(prefix)

    def close(self) -> None:
        self.store.close()

    def __getattr__(self, name: str):  # the store's extras (storage_options, versions...) stay reachable
        if name in ("store", "cache"):
            raise AttributeError(name)
        return getattr(self.store, name)

    def __repr__(self) -> str:
        return f"CachingStore({self.store!r}, {str(self.cache.folder)!r})"


#: The documents of an array that :meth:`CachingStore.get` keeps on disk, revalidated by its array's listing.
DOCUMENTS = frozenset({"zarr.json", ".zarray", ".zattrs"})
#: Values and ranges whose entry (path and ident) :meth:`CachingStore.entry_files` keeps; past it, all forgotten.
ENTRY_FILES_KEPT = 1 << 14
#: Keys whose marker a :class:`CachingStore` remembers finding on disk (one look-up a key), and those it
#: remembers marking (one marker written a key); past it, forgotten.
MARKERS_FOUND = 1 << 16
#: Keys one page of a listing names (S3's most).
LIST_PAGE = 1000
#: Keys a listing of an opened array learns at most (ten pages, fetched one after the other as they come); an
#: array of more objects has those past them revalidated by a HEAD each, as its reads need them, which costs
#: fewer requests than listing every page of an array of which a pipeline reads a part.
LIST_KEYS = 10 * LIST_PAGE


class _Listing:
    """The listing of an opened array's ``prefix``: when it ``started`` (monotonic; what it learns is as old as
    that), the keys ``listed`` so far, the last of them (``upto``: keys come in order, so one before it that
    was not listed is missing), whether the last page came (``complete``), and the page in flight
    (``future``; None once it stopped)."""

    __slots__ = ("prefix", "started", "listed", "upto", "complete", "future")

    def __init__(self, prefix: str, started: float) -> None:
        self.prefix, self.started = prefix, started
        self.listed, self.upto, self.complete = 0, None, False
        self.future: concurrent.futures.Future | None = None

    def covers(self, key: str) -> bool:
        """Whether ``key`` would have been listed by now if it existed when the listing started."""
        return self.complete or (self.upto is not None and key <= self.upto)


class _Join:
    """``then`` of the merged dicts once ``n`` parts came (``add``), or of the first error among them."""

    def __init__(self, n: int, merged: dict, then: Callable[[Any], None]) -> None:
        self.n, self.merged, self.then, self.error = n, merged, then, None
        self.lock = threading.Lock()

    def add(self, part: Any) -> None:
        with self.lock:
            if self.n <= 0:
                return  # an error reported after its part came (see when_all_done): settled already
            if isinstance(part, BaseException):
                self.error = self.error or part
            else:
                self.merged.update(part)
            self.n -= 1
            last = self.n == 0
        if last:
            self.then(self.error if self.error is not None else self.merged)


def _settle(out: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Give ``out`` its result or error (nothing if its caller cancelled it meanwhile)."""
    try:
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _lenient(miss_parts: list[int], lenient: Collection[int]) -> list[int]:
    """The numbers in the store's call of the parts numbered ``lenient`` in the caller's."""
    wanted = set(lenient)
    return [n for n, j in enumerate(miss_parts) if j in wanted]


def _rebuild(store: Store, folder: str, cache_bytes: int, staleness_s: float, read_files: Any = None) -> CachingStore:
    return CachingStore(store, disk_cache(folder, cache_bytes), staleness_s, read_files)


__all__ = ["CacheCounters", "CachingStore"]
