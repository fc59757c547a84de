"""CachingStore: an object store's chunk values and byte ranges kept on local disk, revalidated by generation.

>>> kv = CachingStore(ObjectStore("s3://bkt"), disk_cache("/scratch/cache", 50 << 30))
>>> values, parts = kv.get_many(["g.zarr/c/0/0"], [ByteRange("g.zarr/s/0", 0, 4096)])  # misses: fetched, kept
>>> values, parts = kv.get_many(["g.zarr/c/0/0"], [ByteRange("g.zarr/s/0", 0, 4096)])  # hits: no request

A wrapper, as :class:`~stoker.storage.counting.CountingStore` is: the pipeline and ``open_array`` get one
where a cache is configured (:class:`~stoker.storage.locate.Stores`), nothing else knows of it.

What is cached: whole values and ranges read by ``get_many``/``start_get_many``, ``get_each`` and
``get_ranges`` (chunks, inner chunks, shard indexes), each under (store URI, key, range, generation) in a
:class:`~stoker.storage.diskcache.DiskCache`. ``get`` (metadata documents) is never cached.

Generations. A hit needs the object's generation now: it is learnt by a HEAD request (no body; the store's
``versions``) the first time a key is read through this wrapper, and again once it is older than
``staleness_s`` (as tensorstore's staleness bound); every fetched answer also states it. An object rewritten
has another generation, so its old entries are never served (they age out). :meth:`forget` drops what was
learnt, so the next read of every key revalidates (``open_array`` outside a pipeline does it at each open;
a pipeline has its own wrapper, so it revalidates when it starts). A key whose generation the store cannot
state (no ETag, no Last-Modified) is never cached. A key of which nothing was ever kept needs no HEAD (an
empty *marker* entry says which keys have entries), so a cold cache costs the requests an uncached read does.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any, Collection, Sequence

from ..errors import NotFound, ShutdownError
from .diskcache import DiskCache, disk_cache
from .store import ByteRange, Store, by_key, check_key


@dataclass
class CacheCounters:
    """What a :class:`CachingStore` served: bytes from disk (``hit_bytes``) and from the store
    (``miss_bytes``), values and ranges each way, and HEAD requests made to revalidate."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    revalidations: int = 0

    @property
    def hit_rate(self) -> float:
        """The share of bytes served from disk (0 before any read)."""
        total = self.hit_bytes + self.miss_bytes
        return self.hit_bytes / total if total else 0.0


#: A key learnt to be missing, or whose store states no generation: read through, not asked again until stale.
_UNCACHED = object()


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
        self._marked: set[str] = set()  # keys whose marker this wrapper has written
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)

    uri = property(lambda self: self.store.uri)
    supports_ranges = property(lambda self: self.store.supports_ranges)
    supports_list = property(lambda self: self.store.supports_list)
    is_local = property(lambda self: self.store.is_local)

    def __reduce__(self):  # to worker processes: the store rebuilt there, the same folder
        return _rebuild, (self.store, str(self.cache.folder), self.cache.cache_bytes, self.staleness_s,
                          self.read_files)

    def forget(self) -> None:
        """Drop every generation learnt: the next read of each key revalidates it."""
        with self._lock:
            self._known.clear()

    # -- generations -----------------------------------------------------------------------------

    def _generations(self, keys: Collection[str]) -> dict[str, Any]:
        """The generation of each of ``keys`` now (None: unknown, missing or not stated: read uncached)."""
        now = time.monotonic()
        out, stale = self._known_now(keys, now)
        if stale:
            try:
                found = self.store.versions(stale)
            except ShutdownError:
                raise
            except Exception as exc:  # noqa: BLE001 - revalidation failed: read through, the read says what is wrong
                found = [exc] * len(stale)
            self._revalidated(stale, found, now, out)
        return out

    def _known_now(self, keys: Collection[str], now: float) -> tuple[dict[str, Any], list[str]]:
        """``(generations, stale)``: the generation of each of ``keys`` known now (None: read uncached), and
        the keys to revalidate (a HEAD each) before their entries may be served."""
        out: dict[str, Any] = {}
        stale = []
        with self._lock:
            for key in keys:
                known = self._known.get(key)
                if known is not None and now - known[1] < self.staleness_s:
                    out[key] = None if known[0] is _UNCACHED else known[0]
                else:
                    stale.append(key)
        # a key of which nothing was ever kept (no marker) needs no HEAD: its read goes to the store anyway
        # and states the generation; so a cold cache costs the requests an uncached read does
        cold = [key for key in stale if not self.cache.has(self._marker(key))]
        for key in cold:
            out[key] = None
        return out, [key for key in stale if key not in out]

    def _revalidated(self, stale: list[str], found: list, now: float, out: dict[str, Any]) -> None:
        """Learn what revalidating ``stale`` at ``now`` found (a generation, None, or an error, each in its
        key's place), into ``out`` too."""
        with self._lock:
            self.counters.revalidations += len(stale)
        for key, version in zip(stale, found):
            if isinstance(version, NotFound) or version is None:
                # missing, or no generation stated: read through (one request a read, as without a
                # cache), not asked again until stale
                self._learn(key, _UNCACHED, now)
                out[key] = None
            else:  # a generation, or an error of this key's: read through, the read says what is wrong
                out[key] = None if isinstance(version, Exception) else self._learn(key, version, now)

    def _marker(self, key: str) -> str:
        """The ident of the empty entry that says entries of ``key`` may be kept."""
        return f"{self.uri}\n{key}\nkept"

    def _learn(self, key: str, generation: Any, when: float) -> Any:
        """Keep ``generation`` as ``key``'s now (None: nothing learnt); returns it."""
        if generation is not None:
            with self._lock:
                self._known[key] = (generation, when)
        return generation

    # -- reads -----------------------------------------------------------------------------------

    def get(self, key: str):
        """The whole value, from the store (metadata documents are read fresh, never cached)."""
        return self.store.get(key)

    def get_ranges(self, requests: Sequence[ByteRange]) -> list:
        return list(self.get_many([], requests)[1])

    def get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                 lenient: Collection[int] = ()) -> tuple:
        """See :meth:`ObjectStore.get_many <stoker.storage.objectstore.ObjectStore.get_many>`: hits from disk,
        misses in one call to the store."""
        served, miss_keys, miss_parts = self._serve(keys, requests)
        if miss_keys or miss_parts:
            got = self.store.get_many([keys[i] for i in miss_keys], [requests[j] for j in miss_parts], versions=True,
                                      lenient=_lenient(miss_parts, lenient))
            self._merge(served, keys, requests, miss_keys, miss_parts, got)
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
        now = time.monotonic()
        _, stale = self._known_now({*keys, *(r.key for r in requests)}, now)
        start_versions = getattr(self.store, "start_versions", None)
        if not stale or start_versions is None:
            self._submit(keys, requests, versions, lenient, out)
            return out
        # the HEADs first, on the store's event loop (no thread waits for them: a prefetch many batches
        # ahead has its revalidations in flight together, within the store's requests in flight); then the
        # disk, on a reader thread
        try:
            head = start_versions(stale)
        except ShutdownError as exc:
            _settle(out, error=exc)
            return out

        def revalidated(f: concurrent.futures.Future) -> None:
            try:
                found = self.store.result_of(f)
            except ShutdownError as exc:
                _settle(out, error=exc)
                return
            except Exception as exc:  # noqa: BLE001 - revalidation failed: read through, the read says what is wrong
                found = [exc] * len(stale)
            self._revalidated(stale, found, now, {})
            self._submit(keys, requests, versions, lenient, out)

        head.add_done_callback(revalidated)
        return out

    def _submit(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool, lenient: Collection[int],
                out: concurrent.futures.Future) -> None:
        """:meth:`_start` on a reader thread (here when none can be had)."""
        try:
            self.cache.serve(self._start, keys, requests, versions, lenient, out)
        except ShutdownError:
            self._start(keys, requests, versions, lenient, out)

    def _start(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool, lenient: Collection[int],
               out: concurrent.futures.Future) -> None:
        """:meth:`start_get_many`'s work (on a reader thread): the hits, then the store's read of the misses;
        ``out`` gets the result or the error, always."""
        try:
            served, miss_keys, miss_parts = self._serve(keys, requests)
            if not miss_keys and not miss_parts:
                _settle(out, served if versions else served[:2])
                return
            inner = self.store.start_get_many([keys[i] for i in miss_keys], [requests[j] for j in miss_parts],
                                              versions=True, lenient=_lenient(miss_parts, lenient))
        except BaseException as exc:  # noqa: BLE001 - the caller's result_of raises it
            _settle(out, error=exc)
            return

        def done(f: concurrent.futures.Future) -> None:
            try:
                got = self.store.result_of(f)
                self._merge(served, keys, requests, miss_keys, miss_parts, got)
            except BaseException as exc:  # noqa: BLE001 - the caller's result_of raises it
                _settle(out, error=exc)
            else:
                _settle(out, served if versions else served[:2])

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
            got, got_gens = self.store.get_each([requests[j] for j in miss], versions=True)
            now = time.monotonic()
            for j, data, gen in zip(miss, got, got_gens):
                outcomes[j], gens[j] = data, gen
                if not isinstance(data, Exception):
                    self._keep(requests[j].key, requests[j].start, requests[j].length, data, gen, now)
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
               miss_parts: list[int], got: tuple) -> None:
        """Put the store's answer for the misses in place, and queue each to be kept on disk."""
        values, parts, value_versions, part_versions = served
        now = time.monotonic()
        for i, data, gen in zip(miss_keys, got[0], got[2]):
            values[i], value_versions[i] = data, gen
            if data is not None:
                self._keep(keys[i], None, None, data, gen, now)
        for j, data, gen in zip(miss_parts, got[1], got[3]):
            parts[j], part_versions[j] = data, gen
            if not isinstance(data, Exception):
                self._keep(requests[j].key, requests[j].start, requests[j].length, data, gen, now)

    def _keep(self, key: str, start: int | None, length: int | None, data, gen: Any, now: float) -> None:
        n = memoryview(data).nbytes
        with self._lock:
            self.counters.misses += 1
            self.counters.miss_bytes += n
        if gen is None:
            return  # no generation: a later read could not tell it from a rewritten object's
        self._learn(key, gen, now)  # an answer states the object's generation as a HEAD would
        self.cache.put(_ident(self.uri, key, start, length, gen), data)
        with self._lock:
            marked = key in self._marked
            self._marked.add(key)
        if not marked:
            self.cache.put(self._marker(key), b"")

    # -- hits read by the compiled engine ---------------------------------------------------------

    def entry_files(self, keys: Sequence[str], requests: Sequence[ByteRange]) -> list:
        """For the whole values of ``keys``, then the ranges ``requests``: the entry to read from disk
        (:meth:`DiskCache.entry_file <stoker.storage.diskcache.DiskCache.entry_file>`, ``(path, ident)``) where
        its object's generation is known now, else None (read through :meth:`start_get_many`, which
        revalidates). No request and no disk access: the compiled engine reads and checks the entries, and
        what it cannot use (missing, corrupt) is fetched again through :meth:`start_get_many`."""
        now = time.monotonic()
        gens: dict[str, Any] = {}
        with self._lock:
            for key in {*keys, *(r.key for r in requests)}:
                known = self._known.get(key)
                if known is not None and known[0] is not _UNCACHED and now - known[1] < self.staleness_s:
                    gens[key] = known[0]
        uri, entry = self.uri, self.cache.entry_file
        out: list = [None if gens.get(k) is None else entry(_ident(uri, k, None, None, gens[k])) for k in keys]
        out += [None if gens.get(r.key) is None else entry(_ident(uri, r.key, r.start, r.length, gens[r.key]))
                for r in requests]
        return out

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
