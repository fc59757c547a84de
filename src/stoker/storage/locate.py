"""Where an array URI lives: a local directory (the fast path), or a key prefix inside a store.

==================================================  ======================  ===========================
array URI                                           store                   key prefix
==================================================  ======================  ===========================
``/data/a.zarr``, ``a.zarr``, ``file:///data/a.zarr``  none: local files       (the directory)
``s3://bucket/g.zarr/a`` (``gs://``, ``az://``...)  ``s3://bucket``         ``g.zarr/a``
``https://host:8080/g.zarr/a``                      ``https://host:8080``   ``g.zarr/a``
``https://s3.<region>.amazonaws.com/bkt/g.zarr/a``  ``https://.../bkt``      ``g.zarr/a``
``/data/d.zip/g.zarr/a``, ``zip:///data/d.zip!/g.zarr/a``  ``ZipStore(/data/d.zip)``  ``g.zarr/a``
==================================================  ======================  ===========================

One store per bucket, container or host (per storage options), so arrays of one hierarchy share its
connections and its consolidated metadata. A zip archive is named by its path followed by the path
inside it; the ``zip://`` form may mark the archive's end with ``!`` (without one, the archive is the
first existing ``.zip`` file along the path, as for a plain path).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlparse

from ..errors import InvalidArgument, ShutdownError
from .diskcache import CacheSettings, cache_settings
from .store import Store, check_key
from .uri import REMOTE_SCHEMES, check_remote_url, store_root

#: ObjectStore settings that may be given among ``storage_options`` (stoker's, not obstore's keys).
SETTING_KEYS = frozenset({"timeout_s", "connect_timeout_s", "retries", "retry_timeout_s", "backoff_s",
                          "max_backoff_s", "max_in_flight", "max_gap", "max_length", "queue_timeout_s",
                          "max_value_bytes"})
#: The disk cache's settings that may be given among ``storage_options`` (see :mod:`.cachingstore`).
CACHE_KEYS = frozenset({"cache_dir", "cache_bytes", "cache_staleness_s"})


@dataclass(frozen=True)
class Location:
    """``root`` is the store's URI (``None``: a local directory at ``path``); ``prefix`` the node's key."""

    uri: str
    root: str | None
    prefix: str
    path: str | None = None
    archive: bool = False  # root is a local zip archive

    @property
    def is_local(self) -> bool:
        return self.root is None


def _prefix(uri: str, path: str) -> str:
    path = path.strip("/")
    if not path:
        return ""
    try:
        return check_key(path)
    except InvalidArgument:
        raise InvalidArgument(f"{uri}: the path inside the store, {path!r}, is not a relative key ('/'-separated "
                              "names, no empty, '.' or '..' part)", uri=uri) from None


def locate(uri: str | os.PathLike) -> Location:
    """The :class:`Location` of ``uri`` (see the module docstring); local paths stay paths."""
    if type(uri) is str and uri[:1] == "/" and "://" not in uri and ".zip" not in uri.lower():
        return _absolute_location(uri)
    if type(uri) is str and "://" in uri:
        remote = _remote_location(uri)
        if remote is not None:
            return remote
    if not isinstance(uri, (str, os.PathLike)):
        raise InvalidArgument(f"an array URI must be a string or path, got {type(uri).__name__}")
    uri = os.fspath(uri)
    scheme = urlparse(uri).scheme.lower() if "://" in uri else ""
    if scheme in REMOTE_SCHEMES:
        return _remote_location(uri)  # type: ignore[return-value]  # remote: never None
    if scheme == "zip":
        archive, bang, inner = uri[len("zip://"):].partition("!")
        if not archive:
            raise InvalidArgument(f"{uri}: names no archive; write zip:///path/to/data.zip!/path/inside", uri=uri)
        archive = os.path.abspath(archive)
        zipped = None if bang else _split_archive(archive)  # without "!": the archive is found along the path
        if zipped is not None:
            archive, inner = zipped
        return Location(uri, archive, _prefix(uri, inner), archive=True)
    from . import resolve_local_path

    path = resolve_local_path(uri)
    zipped = _split_archive(path)
    if zipped is not None:
        return Location(uri, zipped[0], _prefix(uri, zipped[1]), archive=True)
    return Location(uri, None, "", path)


@functools.lru_cache(maxsize=16384)
def _absolute_location(uri: str) -> Location:
    """The Location of an absolute path naming no zip archive: a function of the string alone (no working
    folder, no file looked at), kept because a pipeline opens each of its arrays afresh and this took about
    a third of opening one whose metadata the process had parsed before."""
    return Location(uri, None, "", os.path.normpath(uri))


@functools.lru_cache(maxsize=16384)
def _remote_location(uri: str) -> Location | None:
    """The Location of a remote URI (None: ``uri`` is not one): a function of the string alone (no working
    folder, no file looked at; a URI refused raises every time, as nothing is kept of it), kept because a
    pipeline asks it three times at each open of an array (its open, its attributes, whether it has local
    metadata files to watch), and a new pipeline opens each of its arrays afresh."""
    scheme = urlparse(uri).scheme.lower()
    if scheme not in REMOTE_SCHEMES:
        return None
    check_remote_url(uri)  # before any message of ours can print it
    parsed = urlparse(uri)
    if not parsed.netloc:
        raise InvalidArgument(f"{uri}: names no bucket, container or host (expected {scheme}://name/path)",
                              uri=uri)
    root, inside = store_root(uri)
    return Location(uri, root, _prefix(uri, inside))


def _split_archive(path: str) -> tuple[str, str] | None:
    """``(archive, path inside)`` when a part of ``path`` ending in ``.zip`` is a file, else None."""
    if ".zip" not in path.lower():
        return None
    parts = path.split(os.sep)
    for i in range(1, len(parts) + 1):
        head = os.sep.join(parts[:i]) or os.sep
        if head.lower().endswith(".zip") and os.path.isfile(head):
            return head, "/".join(parts[i:])
    return None


def options_for(by_prefix: Mapping[str, dict] | None, uri: str) -> dict | None:
    """The storage options of the longest prefix of ``uri`` in ``by_prefix`` (``Config.storage_options``)."""
    if not by_prefix:
        return None
    best = max((p for p in by_prefix if _under(uri, p)), key=len, default=None)
    return None if best is None else by_prefix[best]


def _under(uri: str, prefix: str) -> bool:
    """Whether ``prefix`` names ``uri`` or a folder above it: it ends at a ``/`` of ``uri`` or at its end, so
    ``https://host`` is no prefix of ``https://host.evil.com/...`` nor ``s3://data`` of ``s3://data-public``."""
    return uri.startswith(prefix) and (len(uri) == len(prefix) or prefix.endswith("/") or uri[len(prefix)] == "/")


def check_options_by_prefix(value: Any, what: str) -> dict[str, dict] | None:
    """``value`` as a ``{uri prefix: storage options}`` dict, or InvalidArgument saying what is wrong."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{what} must be a dict of URI prefix -> storage options dict (e.g. "
                              f"{{'s3://bucket/': {{'region': 'eu-west-1'}}}}), got {type(value).__name__}",
                              knob="storage_options")
    out = {}
    for prefix, options in value.items():
        if not isinstance(prefix, str) or "://" not in prefix or \
                urlparse(prefix).scheme.lower() not in REMOTE_SCHEMES:
            raise InvalidArgument(f"{what}: key {prefix!r} is not a remote URI prefix (s3://, gs://, az://, "
                                  "http(s)://...); options apply to remote stores only", knob="storage_options")
        if not isinstance(options, Mapping):
            raise InvalidArgument(f"{what}[{prefix!r}] must be a dict of options, got {type(options).__name__}",
                                  knob="storage_options")
        out[prefix] = dict(options)
    return out


#: Options dicts whose spelling :func:`_spelled` keeps (a pipeline's few; bounded for a caller that varies them).
SPELLINGS_KEPT = 256
_spellings: OrderedDict[tuple, str] = OrderedDict()
_spellings_lock = threading.Lock()
#: The value types whose options :func:`_spelled` keeps (hashable, and the type alone says the JSON spelling).
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _spelled(options: dict, default: Any = None) -> str:
    """``json.dumps(options, sort_keys=True, default=default)``, what a store's identity is keyed on, kept for
    options seen before: :meth:`Stores.get` runs for every array a pipeline opens (several times an open), and
    spelling the same options anew each time was most of its cost. Keyed on each value's type and value, so
    that options the JSON spells differently (1 and 1.0, True and 1) stay different stores. Only options of
    scalar values (str, int, float, bool, None) are kept: a nested value (a tuple, a frozenset, a dict of
    headers) is spelled each time, as its items' types are not in the key ((1, 2) == (True, 2), yet the JSON
    spells them apart), and neither is ``default``, which scalars never reach."""
    if not options:
        return "{}"
    try:
        key = tuple(sorted((k, type(v), v) for k, v in options.items()))
    except TypeError:  # keys that do not sort: spelled each time
        return json.dumps(options, sort_keys=True, default=default)
    if not all(type(v) in _SCALARS for _, v in options.items()):  # nested: spelled each time
        return json.dumps(options, sort_keys=True, default=default)
    with _spellings_lock:
        spelled = _spellings.get(key)
        if spelled is not None:
            _spellings.move_to_end(key)
            return spelled
    spelled = json.dumps(options, sort_keys=True, default=default)
    with _spellings_lock:
        _spellings[key] = spelled
        if len(_spellings) > SPELLINGS_KEPT:
            _spellings.popitem(last=False)
    return spelled


#: The longest an open waits for another thread's build of the same store before building its own.
BUILD_WAIT_S = 60.0


class Stores:
    """The stores opened for array URIs, one per root and options, shared by the arrays under them, with
    each store's consolidated metadata (:class:`~stoker.storage.hierarchy.Hierarchy`). A pipeline owns
    one and closes it with itself (cancelling requests in flight): each of its arrays is opened once, so
    what was read is kept. :func:`default_stores` serves ``open_array`` calls outside a pipeline, which
    see data rewritten between them as local files do (``revalidate``)."""

    def __init__(self, requests_in_flight: int | None = None, *, revalidate: bool = False,
                 max_stores: int | None = None, cache: CacheSettings | None = None, prefetch: Any = None,
                 read_files: Any = None) -> None:
        """``requests_in_flight``: the most requests the object stores opened here have open at once, all
        of them together (None: each store's ``max_in_flight`` per call only). ``revalidate``: every
        :meth:`get` reopens a zip archive changed since it was opened (its file identity) and gives a
        fresh :class:`~stoker.storage.hierarchy.Hierarchy` (metadata read again). ``max_stores``: the
        most stores kept (least recently used dropped first; None: no bound). ``cache``: the disk cache of
        the object stores' chunks (:class:`~stoker.storage.cachingstore.CachingStore`; None: the one
        ``$STOKER_CACHE_DIR`` names, if any); ``storage_options`` may override it per store. ``prefetch``: a
        :class:`~stoker.storage.prefetch.PrefetchBuffer` the object stores' reads consult first (each store
        wrapped in a :class:`~stoker.storage.prefetch.PrefetchStore`; None: no prefetch). ``read_files``: how the
        disk cache reads its hits (the compiled engine's ``read_files``, which a pipeline passes; None: in
        Python, an entry at a time)."""
        # the semaphore that caps the object stores' requests together: made with the first of them (see
        # _remote_gate); used only on the stores' one event loop thread (it binds to a loop when first waited on)
        self._requests = requests_in_flight
        self._gate: Any = None
        self._granted = 0  # the requests runtime.openfiles granted the gate, given back at close
        self._stores: OrderedDict[tuple, tuple[Store, Any]] = OrderedDict()
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self._closed = False
        self._revalidate, self._max_stores = revalidate, max_stores
        self._cache = cache
        self._prefetch = prefetch
        self._read_files = read_files
        self._building: dict[tuple, concurrent.futures.Future] = {}  # ident -> its build in flight (see _build)

    def get(self, loc: Location, storage_options: dict | None = None) -> tuple[Store, Any]:
        """``(store, hierarchy)`` for ``loc`` (not a local directory)."""
        from .hierarchy import Hierarchy

        options = dict(storage_options or {})
        settings = {k: options.pop(k) for k in list(options) if k in SETTING_KEYS}
        caching = {k: options.pop(k) for k in list(options) if k in CACHE_KEYS}
        if not loc.archive:
            check_remote_url(loc.uri)  # the array's URI is in its messages and ArrayReader.uri
        if loc.archive and (options or settings or caching):
            raise InvalidArgument(f"{loc.uri}: storage_options apply to remote stores only, not to zip archives",
                                  uri=loc.uri)
        cache = None if loc.archive else self._cache_of(caching)
        ident = (loc.root, _spelled(options, repr), _spelled(settings), cache)
        with self._lock:
            self._check_open(loc)
            held = self._stores.get(ident)
        if held is not None and self._revalidate and loc.archive and held[0].changed():
            # Rewritten or replaced: dropped, not closed (arrays opened from it keep reading what they saw).
            with self._lock:
                if self._stores.get(ident) is held:
                    del self._stores[ident]
            held = None
        if held is not None and self._revalidate and hasattr(held[0], "forget"):
            held[0].forget(loc.prefix)  # a disk cache revalidates the array's objects as it is opened
        if held is None:
            held = self._build(loc, ident, options, settings, cache)
        with self._lock:
            if ident in self._stores:
                self._stores.move_to_end(ident)
            while self._max_stores is not None and len(self._stores) > self._max_stores:
                # Dropped, not closed: arrays opened from a store still read through it; a zip archive's
                # descriptor is closed when the last of them is gone (ZipStore's finalizer).
                self._stores.popitem(last=False)
        return (held[0], Hierarchy(held[0])) if self._revalidate else held

    def forget_changed_archives(self) -> list[Store]:
        """Drop the zip archives' stores whose file changed since they were opened (rewritten, or a new archive
        renamed over it), so the next :meth:`get` opens the archive there now; returns the stores dropped.
        Dropped, not closed: arrays opened from them still read what they opened. For a pipeline kept from one
        epoch to the next (:meth:`~stoker.Pipeline.drop_used_up`), which otherwise reads its first archive's
        bytes for ever."""
        with self._lock:
            held = list(self._stores.items())
        gone = [(ident, h) for ident, h in held if callable(getattr(h[0], "changed", None)) and h[0].changed()]
        with self._lock:
            for ident, h in gone:
                if self._stores.get(ident) is h:
                    del self._stores[ident]
        return [h[0] for _, h in gone]

    def _build(self, loc: Location, ident: tuple, options: dict, settings: dict, cache: Any) -> tuple[Store, Any]:
        """The store of ``ident`` made and kept (or the one another thread made meanwhile). Threads opening
        arrays of one root at once (a pipeline's opener threads) wait for the first one's build rather than
        each building a store (10-20 ms of CPU for an object store) that :meth:`get` then throws away: the
        first to come puts its build in flight, the others wait for it (bounded by :data:`BUILD_WAIT_S`, so
        a build that hangs, a stuck credential provider, does not hang every other open with it) and take
        its store; if it failed, one of them builds next and the rest wait for that one."""
        deadline = time.monotonic() + BUILD_WAIT_S
        mine: concurrent.futures.Future | None = None  # this thread's build, once put in flight
        held: tuple[Store, Any] | None = None
        error: BaseException | None = None
        try:  # from before the build is put in flight: whatever ends it (an interrupt too) settles it below
            while True:
                with self._lock:
                    self._check_open(loc)
                    held = self._stores.get(ident)
                    if held is not None:  # another thread built it meanwhile
                        return held
                    flight = self._building.get(ident)
                    if flight is None or flight.done():  # this thread builds; the others wait for it (a
                        # settled one left here by an interrupted clean-up is no build in flight)
                        mine = flight = self._building[ident] = concurrent.futures.Future()
                        break
                try:
                    held = flight.result(timeout=max(0.0, deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    if not flight.done():  # it hangs: this one builds its own
                        return self._make(loc, ident, options, settings, cache)
                    continue  # it failed (its thread raises why): built by one of the waiters now
                except BaseException:
                    if not flight.done():  # this thread was interrupted
                        raise
                    continue
                with self._lock:
                    self._check_open(loc)
                return held
            held = self._make(loc, ident, options, settings, cache)
            return held
        except BaseException as exc:
            error = exc
            raise
        finally:
            if mine is not None:
                # Settled first, with no call of stoker's before it: an interrupt (KeyboardInterrupt lands
                # where Python checks for signals, at calls) must not leave the waiters waiting BUILD_WAIT_S
                # for a build that ended. A failure wakes them to build in its place.
                if error is None:
                    mine.set_result(held)
                else:
                    mine.set_exception(error)
                with self._lock:
                    if self._building.get(ident) is mine:  # (if cut short: a settled build, replaced by the next)
                        del self._building[ident]

    def _remote_gate(self) -> Any:
        """The semaphore of ``requests_in_flight`` (None without one), made with the first object store: as
        many requests as the process's open-file limit holds (:func:`~stoker.runtime.openfiles.requests_that_fit`,
        which raises the soft limit where it can), and the prefetch buffer's share of them within three
        quarters of those. A pipeline of local arrays never touches the limit."""
        if not self._requests:
            return None
        if self._gate is None:
            import asyncio

            from ..runtime.openfiles import requests_that_fit

            fit = requests_that_fit(self._requests)  # outside the lock, a leaf: it takes its own
            with self._lock:
                if self._gate is None and not self._closed:
                    if self._prefetch is not None:
                        self._prefetch.max_requests = min(self._prefetch.max_requests, max(1, fit * 3 // 4))
                    self._gate, self._granted, fit = asyncio.Semaphore(fit), fit, 0
            if fit:  # another thread made the gate meanwhile, or the stores closed: not this one's to keep
                from ..runtime.openfiles import release

                release(fit)
        return self._gate

    def _make(self, loc: Location, ident: tuple, options: dict, settings: dict, cache: Any) -> tuple[Store, Any]:
        """The store of ``ident`` built and kept, unless another thread kept one first (then that one)."""
        from .hierarchy import Hierarchy

        store: Any
        if loc.archive:
            from .zipstore import ZipStore

            store = ZipStore(loc.root)
        else:
            from .objectstore import ObjectStore

            store = ObjectStore(loc.root, options, gate=self._remote_gate(), **settings)
            if cache is not None and cache.enabled:
                from .cachingstore import CachingStore
                from .diskcache import disk_cache

                store = CachingStore(store, disk_cache(str(cache.folder), cache.cache_bytes), cache.staleness_s,
                                     read_files=self._read_files)
            if self._prefetch is not None:
                from .prefetch import PrefetchStore

                store = PrefetchStore(store, self._prefetch)
        with self._lock:
            held = None if self._closed else self._stores.setdefault(ident, (store, Hierarchy(store)))
        if held is None or held[0] is not store:
            store.close()
        if held is None:  # closed while the store was being opened: no one else would close it
            self._check_open(loc)
        assert held is not None
        return held

    def opening(self, uri: str, storage_options: dict | None = None) -> None:
        """The remote array at ``uri`` is about to be opened: where its store has a disk cache, the listing
        that revalidates its objects (and its ``zarr.json``: :meth:`CachingStore.opened
        <stoker.storage.cachingstore.CachingStore.opened>`) is started now, without waiting, so that arrays
        opened a few at a time find their listings answered together, not one round trip a few. Not with
        ``revalidate`` (its :meth:`get` forgets at each open, which would drop that listing). Never raises:
        the open itself says what is wrong.

        >>> stores.opening("s3://bkt/g.zarr/a", options)   # then open_array(..., stores=stores)
        """
        if self._revalidate:
            return
        try:
            loc = locate(uri)
            if loc.is_local or loc.archive:
                return
            opened = getattr(self.get(loc, storage_options)[0], "opened", None)
            if opened is not None:
                opened(loc.prefix)
        except Exception:  # noqa: BLE001 - a bad URI or option, a closed store: raised by the open
            pass

    def _cache_of(self, given: dict) -> CacheSettings:
        """This store's disk cache settings: the Stores' (or ``$STOKER_CACHE_DIR``'s), with ``given``
        (``storage_options`` keys) over them."""
        base = self._cache if self._cache is not None else cache_settings()
        if not given:
            return base
        return cache_settings(given.get("cache_dir", base.folder), given.get("cache_bytes", base.cache_bytes),
                              given.get("cache_staleness_s", base.staleness_s), what="storage_options")

    def _check_open(self, loc: Location) -> None:
        if self._closed:
            raise ShutdownError(f"{loc.uri}: the stores were closed (the pipeline that owns them was closed); "
                                "open the array in a pipeline that is still open", uri=loc.uri)

    def close(self) -> None:
        """Close every store (an object store cancels its requests in flight); :meth:`get` raises
        :class:`~stoker.errors.ShutdownError` from now on, so no store opened later goes unclosed."""
        with self._lock:
            self._closed = True
            held, self._stores = list(self._stores.values()), OrderedDict()
            granted, self._granted = self._granted, 0
        if granted:
            from ..runtime.openfiles import release

            release(granted)
        for store, _ in held:
            store.close()


#: Stores kept for ``open_array`` calls outside a pipeline.
DEFAULT_MAX_STORES = 64

_default = Stores(revalidate=True, max_stores=DEFAULT_MAX_STORES)


def default_stores() -> Stores:
    """The process-wide :class:`Stores` of ``open_array`` calls outside a pipeline (never closed): each
    open sees archives and metadata as they are now (``revalidate``), at most ``DEFAULT_MAX_STORES``
    stores kept."""
    return _default
