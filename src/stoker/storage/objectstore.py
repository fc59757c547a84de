"""ObjectStore: S3, Google Cloud Storage, Azure and HTTP(S) through obstore.

``s3://bucket/root``, ``gs://bucket/root`` (or ``gcs://``), ``az://container/root`` (and the other spellings obstore
takes) and ``http(s)://host/root``. Credentials, regions and endpoints come from the standard
environment (``AWS_*`` including ``AWS_ENDPOINT_URL`` and ``AWS_ALLOW_HTTP``, ``GOOGLE_*``, ``AZURE_*``),
read by obstore, and from ``storage_options`` (obstore's configuration keys, e.g. ``endpoint``,
``region``, ``skip_signature=True`` for anonymous access to public buckets; HTTP client keys such as
``allow_http`` or ``proxy_url`` go to the client). Options override the environment.

Requests run on one event loop thread shared by every ObjectStore of the process, many at once
(``max_in_flight`` per call, run as that many lanes, each a task taking the call's next request, so that a
request costs that thread little more than its own await; ``gate``, a semaphore several stores share, caps them together: a
pipeline's ``Config.requests_in_flight``). Waiting for a free request slot is bounded too: by the
call's own bound (below), or sooner by ``queue_timeout_s``; then a StorageError names the key and says
it waited for a slot. Ranges of one object are merged by
:func:`~stoker.storage.ranges.coalesce` (gaps up to ``max_gap``, reads up to ``max_length``), so one
call costs few requests.

Faults. Each request has a time limit (``timeout_s``, connecting ``connect_timeout_s``); a call, as many
of them as its rounds of ``max_in_flight`` requests could take with every try and backoff. A request
that fails for a reason that may pass (HTTP 5xx, 408, 429, a timeout, a refused or dropped
connection, a short body) is tried again after an exponential backoff with jitter, at most
``retries`` more times and not after ``retry_timeout_s``; then, as for any other failure, a
:class:`~stoker.errors.StorageError` names the URI, key, status and attempts. A missing key is
:class:`~stoker.errors.NotFound` at once. obstore's own retries are off: it does not report how many
attempts it made or which status ended them, so this module retries itself.

Versions. Every answer names the version of the object it came from (:data:`Version`: its size and ETag,
or its Last-Modified time where the server sends no ETag; an ETag written one way, quoted and not weak,
whichever answer stated it); ``get_many`` and ``get_each`` report them with
``versions=True``, which is how a reader tells a shard rewritten since its index was read (see
:mod:`stoker.storage.store`, "Generations"). They are compared after the read, not sent as ``If-Match``:
the version an answer names is that of the object whose bytes it carries.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import os
import random
import re
import threading
import time
from datetime import datetime, timedelta
from typing import Any, Awaitable, Callable, NamedTuple, Sequence
from urllib.parse import urlparse

from .. import checks
from ..errors import InternalError, InvalidArgument, NotFound, ShutdownError, StorageError, UnsupportedFormat, as_value
from ..runtime import lifetime
from ..runtime.faults import serve
from ..runtime.loopexit import EXIT_WAIT_S, GRACE_S, cancel_pending
from .ranges import coalesce
from .store import (ByteRange, Store, by_key, check_key, check_prefix, gone_or_shorter, missing_bucket, not_found,
                    short_read)
from .urls import check_remote_url

#: obstore's HTTP client options (``ClientConfig``): these ``storage_options`` go to the client.
CLIENT_KEYS = frozenset({
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type", "default_headers",
    "http1_only", "http2_keep_alive_interval", "http2_keep_alive_timeout", "http2_keep_alive_while_idle",
    "http2_only", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url", "proxy_ca_certificate",
    "proxy_excludes", "root_certificate", "randomize_addresses", "read_timeout", "timeout", "user_agent",
})
#: The environment variables' prefix of each kind of obstore store.
_ENV_PREFIX = {"S3Store": "AWS", "GCSStore": "GOOGLE", "AzureStore": "AZURE"}
_STATUS = re.compile(r"status code: (\d{3})")
# Failures without a status that may pass: timeouts, connections refused or dropped, bodies cut short.
# Matched in obstore's first message line (its debug dump names timeouts of every request).
_TRANSIENT = ("error sending request", "body error", "timed out", "connection reset", "connection closed",
              "incomplete")


#: obstore's message (lower case) for a ranged read answered with the whole value (a server without range support)
_NO_RANGES = "range request not supported"
#: The error code of S3's 404 for a bucket that does not exist (S3-compatible servers' too), in the body obstore
#: quotes in its error: no request more tells it from a missing key
_NO_BUCKET = "<Code>NoSuchBucket</Code>"


#: When the call this task serves must be done (the loop's clock): the most any of its requests waits for a
#: free request slot. Set by ObjectStore._bounded; tasks a call starts copy it with their context.
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("stoker_objectstore_deadline",
                                                                         default=None)
#: What a call's wait is allowed past its deadline, so that a request gives up on a slot (naming its key)
#: before the call as a whole does.
_SLACK_S = 5.0


def _unsatisfiable(uri: str, r: ByteRange, attempts: int) -> StorageError:
    """The error for a range the server answered 416 (not satisfiable): a suffix, or a range from byte 0, is
    unsatisfiable only for an empty value (RFC 9110, 14.1.1), so its size is known then; any other range only
    when the value ends at or before its first byte, so its size is under ``start + 1``."""
    empty = r.is_suffix or r.start == 0
    return short_read(uri, r, 0, attempts=attempts, size=0 if empty else None, below=None if empty else r.start + 1)


class _ShortBody(Exception):
    """Fewer bytes than the server said it sends (retried like a dropped connection)."""


#: the process that first ran obstore (its Rust runtime starts threads there), or None
_obstore_pid: int | None = None


def _check_not_forked(uri: str) -> None:
    """StorageError in a child forked from a process that had used obstore: its runtime's threads did not
    survive the fork, and any request there would wait until its timeout (or for ever) instead of running."""
    global _obstore_pid
    pid = os.getpid()
    if _obstore_pid is None:
        _obstore_pid = pid
    elif _obstore_pid != pid:
        raise StorageError(
            f"{uri}: this process was forked from one that had already read through obstore, whose runtime does "
            "not survive a fork; start worker processes with multiprocessing_context='forkserver' or 'spawn' "
            "(e.g. DataLoader(..., multiprocessing_context='spawn')), or read before forking only what needs no "
            "remote store", uri=uri)


#: what follows the event loop thread's fault (see _Loop.failed)
_LOOP_STOPS = "No remote store can be read in this process any more: start another process"


class _Loop:
    """The event loop thread that runs every ObjectStore's requests (one per process).

    Should its loop raise (a bug: asyncio hands a callback's error to its exception handler, so only what
    escapes that does), the thread ends and the fault is kept (:meth:`failed`): every request pending fails
    with it at once, and so does every later one (:meth:`start`), rather than wait to its timeout for a loop
    that no longer runs and blame the store.

    At interpreter exit (:func:`_at_exit`, registered with the process's first loop) :meth:`settle` ends its
    requests and stops it: an obstore request ending while the interpreter finalises aborts the process
    (runtime/loopexit.py)."""

    _lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
    _current: "_Loop | None" = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.fault: InternalError | None = None
        self._futures: set[concurrent.futures.Future] = set()  # started and not done (failed by a fault)
        self._futures_lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self.stopped = False  # by settle(): no request starts any more
        self.thread = threading.Thread(target=serve, args=(self.loop.run_forever, self.failed, _LOOP_STOPS),
                                       name="stoker-objectstore", daemon=True)
        self.thread.start()

    def start(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the loop (its future); the loop's fault (InternalError) once it has one, and
        ShutdownError once :meth:`settle` stopped it (the interpreter exits)."""
        with self._futures_lock:
            fault: Exception | None = self.fault
            if fault is None and self.stopped:
                fault = ShutdownError("the interpreter is exiting: no remote store can be read any more")
            if fault is None:
                future = asyncio.run_coroutine_threadsafe(coro, self.loop)
                self._futures.add(future)
        if fault is not None:
            coro.close()
            raise fault
        future.add_done_callback(self._futures.discard)
        return future

    def failed(self, fault: InternalError) -> None:
        """The loop raised (``fault``; its thread ends): kept, and every request started and pending fails
        with it (its caller raises it), as later ones do (:meth:`start`)."""
        with self._futures_lock:
            self.fault = fault
            pending, self._futures = list(self._futures), set()  # (each one's discard then finds it gone)
        for future in pending:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # done meanwhile
                future.set_exception(fault)

    def settle(self, wait_s: float = EXIT_WAIT_S) -> int:
        """Stop the loop for good: cancel its requests (their callers get ShutdownError) and wait up to
        ``wait_s`` for them to end, stop it and wait as long for its thread, then :data:`GRACE_S` with the GIL
        released. The count cancelled. The exit hook's work; it never raises."""
        with self._futures_lock:
            if self.stopped or self.fault is not None:  # settled before, or its thread is gone
                return 0
            self.stopped = True
        count = cancel_pending(self.loop, wait_s)
        with contextlib.suppress(RuntimeError):  # closed: nothing to stop
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(wait_s)
        # Not skipped with none pending: a script exits just after its last read, whose tokio thread may still
        # hold the GIL it took to hand the result over, or wait to take it back to release it.
        time.sleep(GRACE_S)
        return count

    @classmethod
    def get(cls) -> "_Loop":
        global _hooked_pid
        with cls._lock:
            if cls._current is None or cls._current.pid != os.getpid():  # a forked child starts its own
                cls._current = cls()
                if _hooked_pid != os.getpid():  # a process that never reads a remote store has no hook
                    atexit.register(_at_exit)
                    _hooked_pid = os.getpid()
            return cls._current


#: the process whose _Loop.get registered _at_exit (a forked child registers its own)
_hooked_pid: int | None = None


def _at_exit() -> None:
    """The exit hook: the objects with threads of their own (pipelines) are closed first, while their requests
    can still end as they do on close, then the loop of this process settles (:meth:`_Loop.settle`)."""
    lifetime.close_all()  # idempotent: a no-op where its own hook ran first
    current = _Loop._current
    if current is not None and current.pid == os.getpid():
        current.settle()


class ObjectStore(Store):
    """A bucket, container or HTTP(S) root read as a store (see the module docstring); thread-safe."""

    supports_ranges = True
    is_local = False
    #: start_get_many runs a get_many on the store's event loop, with no thread waiting for it
    starts_reads = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, timeout_s: float = 30.0,
                 connect_timeout_s: float = 5.0, retries: int = 5, retry_timeout_s: float = 60.0,
                 backoff_s: float = 0.1, max_backoff_s: float = 5.0, max_in_flight: int = 16,
                 max_gap: int = 1 << 20, max_length: int = 16 << 20, queue_timeout_s: float | None = None,
                 max_value_bytes: int = 2 << 30, gate: asyncio.Semaphore | None = None) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise InvalidArgument(f"ObjectStore takes a URL such as s3://bucket/root, got {url!r}", uri=url)
        check_remote_url(url)  # no credentials in a URI that every message names
        if storage_options is not None and not isinstance(storage_options, dict):
            raise InvalidArgument(f"storage_options must be a dict, got {type(storage_options).__name__}", uri=url)
        self.uri = url.rstrip("/")
        scheme, rest = self.uri.split("://", 1)
        self._url = f"gs://{rest}" if scheme.lower() == "gcs" else self.uri  # obstore spells it gs://
        self.storage_options = dict(storage_options or {})
        self.timeout_s = checks.seconds("timeout_s", timeout_s, finite=True, uri=url)
        self.connect_timeout_s = checks.seconds("connect_timeout_s", connect_timeout_s, finite=True, uri=url)
        self.retries = checks.integer("retries", retries, 0, uri=url)
        self.retry_timeout_s = checks.seconds("retry_timeout_s", retry_timeout_s, finite=True, uri=url)
        self.backoff_s = checks.seconds("backoff_s", backoff_s, finite=True, uri=url)
        self.max_backoff_s = checks.seconds("max_backoff_s", max_backoff_s, finite=True, uri=url)
        self.max_in_flight = checks.integer("max_in_flight", max_in_flight, 1, uri=url)
        self.max_gap = checks.integer("max_gap", max_gap, 0, uri=url)
        self.max_length = checks.integer("max_length", max_length, 1, uri=url)
        self.queue_timeout_s = checks.seconds("queue_timeout_s", queue_timeout_s, optional=True, uri=url)
        self.max_value_bytes = checks.integer("max_value_bytes", max_value_bytes, 1, uri=url)
        self._gate = gate  # shared with other stores (a pipeline's): caps their requests at once together
        self._closed = False
        self._pending: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        _check_not_forked(self.uri)
        self._store = self._build()
        self._pid = os.getpid()
        self.supports_list = type(self._store).__name__ != "HTTPStore"  # plain HTTP servers cannot list

    def _settings(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (
            "timeout_s", "connect_timeout_s", "retries", "retry_timeout_s", "backoff_s", "max_backoff_s",
            "max_in_flight", "max_gap", "max_length", "queue_timeout_s", "max_value_bytes")}

    def __reduce__(self):  # for worker processes: rebuilt there (its own connections and loop)
        return _rebuild, (self.uri, self.storage_options, self._settings())

    # -- the obstore store ----------------------------------------------------------------------

    def _build(self, retrying: bool = False):
        try:
            from obstore.store import from_url
        except ImportError:
            raise UnsupportedFormat(
                f"{self.uri}: reading remote stores needs the obstore package; install it with "
                "pip install 'stoker[remote]'", uri=self.uri) from None
        config: dict[str, Any] = {}
        client: dict[str, Any] = {}
        for key, value in self.storage_options.items():
            name = key.lower()
            if name in ("timeout", "connect_timeout"):
                raise InvalidArgument(f"{self.uri}: set the {name} of requests with ObjectStore's {name}_s= (also an "
                                      "open_store keyword), not in storage_options", uri=self.uri)
            if name in CLIENT_KEYS:
                client[name] = value
            else:
                config[key] = value
        # obstore reads the environment's client settings (AWS_ALLOW_HTTP...) only when it is given no
        # client options at all: read them here, for the prefix of the kind of store the URL opens.
        prefix = _ENV_PREFIX.get(type(self._open(from_url, config, None, None)).__name__)
        if prefix:
            for name in CLIENT_KEYS - {"timeout", "connect_timeout"} - set(client):
                value = os.environ.get(f"{prefix}_{name.upper()}")
                if value is not None:
                    client[name] = value
        if urlparse(self._url).scheme == "http":
            client["allow_http"] = True  # asked for by the URL itself
        client["timeout"] = timedelta(seconds=self.timeout_s)
        client["connect_timeout"] = timedelta(seconds=self.connect_timeout_s)
        retry: dict[str, Any] = {"max_retries": 0, "retry_timeout": timedelta(seconds=self.retry_timeout_s)}
        if retrying:
            retry["max_retries"] = self.retries
            retry["backoff"] = {"init_backoff": timedelta(seconds=self.backoff_s),
                                "max_backoff": timedelta(seconds=self.max_backoff_s), "base": 2}
        return self._open(from_url, config, client, retry)

    def writable_obstore(self) -> Any:
        """A new obstore store of this URL with this store's options and time limits, for writers that talk to
        obstore themselves (zarr-python's ``zarr.storage.ObjectStore``, which does not retry): obstore retries
        what may pass itself, ``retries`` times with this store's backoff, within ``retry_timeout_s``.

        >>> store = ObjectStore("s3://bucket/out.zarr", {"region": "eu-west-1"})
        >>> zarr.create_array(zarr.storage.ObjectStore(store.writable_obstore()), shape=(8,), dtype="u1")
        """
        _check_not_forked(self.uri)
        return self._build(retrying=True)

    def _open(self, from_url, config: dict, client: dict | None, retry: dict | None):
        try:
            return from_url(self._url, client_options=client, retry_config=retry, **config)
        except Exception as exc:  # obstore raises its own errors and ValueError for bad keys or URLs
            keys = ", ".join(sorted(self.storage_options)) or "none"
            raise InvalidArgument(
                f"{self.uri}: obstore cannot open this URL with storage_options keys ({keys}): "
                f"{_first_line(exc)}; see obstore's S3Config, GCSConfig, AzureConfig and ClientConfig for the keys",
                uri=self.uri) from None

    def _obstore(self):
        _check_not_forked(self.uri)
        if self._pid != os.getpid():  # a store unpickled in a spawned process: its own connections
            self._store, self._pid = self._build(), os.getpid()
        return self._store

    # -- running requests -----------------------------------------------------------------------

    def _run(self, coro, rounds: int = 1):
        """Run ``coro`` on the shared loop and wait for it, no longer than ``rounds`` requests one after the
        other could take with every attempt and backoff."""
        return self._wait(self._start(coro, rounds))

    def _wait(self, future: concurrent.futures.Future):
        """Wait for a future of :meth:`_start`: bounded on the loop, and here too (a loop that stalled)."""
        try:
            return future.result(timeout=future.bound_s + 5)
        except concurrent.futures.CancelledError:
            raise self._closed_mid_read() from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise StorageError(f"{self.uri}: no answer in {future.bound_s:.0f} s", uri=self.uri, key=None,
                               status=None, attempts=None) from None

    def _start(self, coro, rounds: int = 1) -> concurrent.futures.Future:
        """Start ``coro`` on the shared loop, bounded by what ``rounds`` requests one after the other could
        take with every attempt and backoff (then a StorageError); :meth:`close` cancels it."""
        if self._closed:
            coro.close()
            raise ShutdownError(f"{self.uri}: the store is closed", uri=self.uri)
        try:
            _check_not_forked(self.uri)
        except StorageError:
            coro.close()
            raise
        bound = rounds * (self.retry_timeout_s + self.max_backoff_s + self._per_attempt())
        try:
            future = _Loop.get().start(self._bounded(coro, bound))
        except (InternalError, ShutdownError):  # the loop's thread failed (a bug), or the interpreter exits
            coro.close()
            raise
        future.bound_s = bound + _SLACK_S  # type: ignore[attr-defined]
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._settled)
        if self._closed:  # closed meanwhile: close() may not have seen it
            future.cancel()
        return future

    def _settled(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(future)

    async def _bounded(self, coro, bound: float):
        """``coro``'s result; its requests wait for slots until ``bound`` (see :meth:`_slot`), the whole of
        it a little longer."""
        _deadline.set(asyncio.get_running_loop().time() + bound)
        try:
            return await _within(lambda: coro, bound + _SLACK_S)  # no task of its own (see _within)
        except asyncio.TimeoutError:
            raise StorageError(f"{self.uri}: no answer in {bound + _SLACK_S:.0f} s", uri=self.uri, key=None,
                               status=None, attempts=None) from None

    def _slot(self, key: str, what: str, tried: int = 0) -> "_Slot":
        """``async with``: hold a request slot of the shared ``gate`` (None: no cap), waiting at most until the
        call's deadline or ``queue_timeout_s``, whichever comes first; then a StorageError naming ``key`` (a
        saturated store or server otherwise keeps a request queued for as long as the requests ahead of it
        take). ``tried``: the key's tries so far (the error's ``attempts``)."""
        return _Slot(self, key, what, tried)

    async def _queue(self, gate: asyncio.Semaphore, key: str, what: str, tried: int) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:  # asyncio.timeout where there is one: wait_for would make a task of each queued request
            await _within(gate.acquire, self._slot_wait(started))
        except asyncio.TimeoutError:
            raise self._slot_error(key, what, _GATE_SLOTS, tried, loop.time() - started) from None

    def _slot_wait(self, started: float) -> float | None:
        """How long a request queued at ``started`` (the loop's clock) may wait for a slot: until the call's
        deadline or for ``queue_timeout_s``, whichever comes first (None: no bound)."""
        deadline = _deadline.get()
        limits = [t for t in (None if deadline is None else deadline - started, self.queue_timeout_s)
                  if t is not None]
        return max(0.0, min(limits)) if limits else None

    def _slot_error(self, key: str, what: str, whose: str, tried: int, waited: float) -> StorageError:
        return StorageError(
            f"{self.uri}: {what} of key {key!r} waited {waited:.1f} s for a free request slot ({whose}) and "
            "gave up: the requests ahead of it did not finish (a saturated or stalled store or server). "
            "Allow more requests at once (requests_in_flight, max_in_flight), lower the load, or raise "
            "queue_timeout_s / timeout_s", uri=self.uri, key=key, status=None, attempts=tried, waited_s=waited)

    async def _lanes(self, jobs: list[_Job], in_place: Callable[[_Job, StorageError], None] | None = None) -> None:
        """Run every job (``await job.run()``), at most ``max_in_flight`` at once: that many
        lanes, each a task that takes the next job once its last is done. Not a task per request queued on a
        semaphore: every request of every store runs on the one event loop thread, and a task, a semaphore
        waiter and a timer each per request cost that thread more than the request's own await. A job not
        started by the call's deadline or ``queue_timeout_s`` (one timer for the call) gets the slot error
        naming its key: ``in_place(job, error)``, or without ``in_place`` the call fails with it. One lane's
        error stops the others (see :meth:`_gather`)."""
        if not jobs:
            return
        loop = asyncio.get_running_loop()
        todo = collections.deque(jobs)

        async def lane() -> None:
            while todo:
                await todo.popleft().run()

        tasks = [asyncio.ensure_future(lane()) for _ in range(min(self.max_in_flight, len(jobs)))]
        timer, failed = None, []
        if todo and len(tasks) < len(jobs):
            started = loop.time()
            wait = self._slot_wait(started)

            def give_up() -> None:  # on the loop: the jobs still queued never start
                waited = loop.time() - started
                errors = [(job, self._slot_error(job.key, job.what, self._call_slots(), 0, waited)) for job in todo]
                todo.clear()
                if in_place is not None:
                    for job, error in errors:
                        in_place(job, error)
                elif errors:
                    failed.append(errors[0][1])
                    for task in tasks:
                        task.cancel()

            if wait is not None:
                timer = loop.call_at(started + wait, give_up)
        try:
            await self._gather(tasks)
        except asyncio.CancelledError:
            if failed:
                raise failed[0] from None
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _call_slots(self) -> str:
        return f"one of this call's max_in_flight={self.max_in_flight}"

    def _closed_mid_read(self) -> ShutdownError:
        return ShutdownError(f"{self.uri}: the store was closed while a read was in flight", uri=self.uri)

    def _per_attempt(self) -> float:
        return self.timeout_s + self.connect_timeout_s + 1  # obstore's own limits, plus slack

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with equal jitter: half the step fixed, half random."""
        step = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return step / 2 + random.uniform(0, step / 2)

    async def _attempts(self, key: str, what: str, op: Callable, short: Callable[[int], StorageError] | None = None):
        """``await op()``, tried again on failures that may pass (see the module docstring)."""
        started = time.monotonic()
        attempt = 0
        per_attempt = self._per_attempt()
        while True:
            attempt += 1
            # a slot of the shared gate per try, not held through the backoff; waiting for one is no try
            async with self._slot(key, what, tried=attempt - 1):
                try:
                    return await _within(op, per_attempt)
                except Exception as exc:
                    error = self._failed(key, what, exc, attempt, started, short)
            if error is not None:
                raise error from None
            await asyncio.sleep(self._backoff(attempt))

    def _failed(self, key: str, what: str, exc: BaseException, attempt: int, started: float,
                short: Callable[[int], StorageError] | None = None) -> BaseException | None:
        """What the ``attempt``-th try of ``what`` of ``key`` (the first made at ``started``, monotonic) failing
        with ``exc`` means: None to try again after a backoff (it may pass, and tries and time are left), else
        the error to raise (NotFound for a missing key; a StorageError naming the key, status and tries)."""
        if _NO_BUCKET in str(exc):  # a GET's 404 body (a HEAD's has none: read as a missing key); a listing's
            return missing_bucket(self.uri, key, what)  # comes as obstore's generic error, not FileNotFoundError
        if isinstance(exc, FileNotFoundError):
            return not_found(self.uri, key)
        if isinstance(exc, StorageError):  # permanent, raised by op (a range past the end of the value)
            exc.attempts = exc.context["attempts"] = attempt
            return exc
        status, transient, text = _classify(exc)
        if transient and attempt <= self.retries and time.monotonic() - started < self.retry_timeout_s:
            return None
        if short is not None and status == 416:
            return short(attempt)
        gave_up = f"after {attempt} attempt" + ("s" if attempt > 1 else "")
        if _NO_RANGES in text.lower():  # obstore refused a 200 with the whole value as the answer to a range
            hint = ("the server ignores byte ranges (it answers a ranged read with the whole value, status 200): "
                    "a shard's index and inner chunks are ranges; serve the data from a server that supports "
                    "HTTP Range requests")
        else:
            hint = ("the server kept failing: check it, or raise retries= / timeout_s=" if transient else
                    "check the URL, credentials (environment or storage_options) and permissions")
        if status == 403:
            hint += ("; a 403 may also be a missing key: S3 answers 403, not 404, for a key that does not "
                     "exist when the credentials lack s3:ListBucket permission on the bucket")
        return StorageError(
            f"{self.uri}: {what} of key {key!r} failed {gave_up}"
            + (f" (HTTP status {status})" if status else "") + f": {text}; {hint}",
            uri=self.uri, key=key, status=status, attempts=attempt)

    # -- reads ----------------------------------------------------------------------------------

    #: get_many and start_get_many can say which version of each object they read (``versions=True``)
    reports_versions = True

    def get(self, key: str) -> memoryview:
        check_key(key)
        return self._run(self._attempts(key, "read", lambda: self._get_whole(key)))[0]

    async def _get_whole(self, key: str) -> tuple[memoryview, Version | None]:
        """The value of ``key`` and the version of the object that gave it."""
        import obstore

        result = await obstore.get_async(self._obstore(), key)
        size = result.meta["size"]
        if size > self.max_value_bytes:  # obstore would reserve the announced size at once: a lie aborts us
            raise StorageError(f"{self.uri}: key {key!r} is {size:,} bytes as the server announces it, more than "
                               f"the {self.max_value_bytes:,} stoker reads as one value (a chunk or a metadata "
                               "document); if that size is right, raise the storage option max_value_bytes",
                               uri=self.uri, key=key, announced_size=size)
        data = memoryview(await result.bytes_async())
        if len(data) != size:
            raise _ShortBody(f"got {len(data)} bytes of a {size}-byte value")
        return data, _version(result.meta)

    async def _get_range(self, r: ByteRange, start: int, length: int) -> tuple[memoryview, Version | None]:
        """``length`` bytes at ``start`` of ``r.key`` (``start`` < 0: the last ``length`` bytes), and the version
        of the object that gave them."""
        import obstore

        asked = {"suffix": length} if start < 0 else (start, start + length)
        if length == 0:
            # a zero-length range of a missing key is missing
            return memoryview(b""), _version(await obstore.head_async(self._obstore(), r.key))
        result = await obstore.get_async(self._obstore(), r.key, options={"range": asked})
        first, end = result.range
        size = result.meta["size"]
        want = (max(0, size - length), size) if start < 0 else (start, start + length)
        if (first, end) != want or want[1] > size or want[1] - want[0] != length:
            if want[1] > size or want[1] - want[0] != length:  # the value is shorter: no retry mends that
                raise short_read(self.uri, r, max(0, min(size, want[1]) - want[0]), size=size)
            raise _ShortBody(f"asked bytes {want[0]}..{want[1]}, the server sent {first}..{end}")
        data = memoryview(await result.bytes_async())
        if len(data) != length:
            raise _ShortBody(f"got {len(data)} of {length} bytes")
        return data, _version(result.meta)

    def get_ranges(self, requests: Sequence[ByteRange]) -> list[memoryview]:
        reads = self._plan_reads(requests)
        rounds = -(-len(reads) // self.max_in_flight)
        return self._run(self._get_ranges(len(requests), reads), rounds=max(1, rounds))

    def _plan_reads(self, requests: Sequence[ByteRange]) -> list:
        reads = []  # (range named in errors, start (< 0: suffix), length, [(request number, slice of the read)])
        for key, numbers in by_key(requests).items():
            plain = [i for i in numbers if not requests[i].is_suffix]
            for i in numbers:
                if requests[i].is_suffix:
                    reads.append((requests[i], -requests[i].length, requests[i].length, [(i, slice(None))]))
            for read in coalesce([(requests[i].start, requests[i].length) for i in plain], self.max_gap,
                                 self.max_length):
                named = requests[plain[read.parts[0][0]]] if len(read.parts) == 1 else \
                    ByteRange(key, read.offset, read.length)
                reads.append((named, read.offset, read.length, [(plain[j], s) for j, s in read.slices()]))
        return reads

    async def _get_ranges(self, n: int, reads: list) -> list[memoryview]:
        out, _, jobs = self._range_jobs(n, reads)
        await self._lanes(jobs)
        return out

    def _range_jobs(self, n: int, reads: list, lenient: frozenset = frozenset()) -> tuple[list, list, list]:
        """``(out, versions, jobs)``: the lists the jobs (see :meth:`_lanes`) of ``reads`` fill in."""
        out: list = [None] * n
        versions: list = [None] * n

        async def one(r: ByteRange, start: int, length: int, serve: list[tuple[int, slice]]) -> None:
            try:
                data, version = await self._attempts(r.key, "ranged read", lambda: self._get_range(r, start, length),
                                                     short=lambda k: _unsatisfiable(self.uri, r, k))
            except (NotFound, StorageError) as exc:
                if not gone_or_shorter(exc) or any(i not in lenient for i, _ in serve):
                    raise
                # the caller asked for this error in place of the bytes; without its traceback, whose frame
                # holds ``out`` (a cycle that would keep every part of the call alive until a collection)
                exc = as_value(exc)
                for i, _ in serve:
                    out[i] = exc
                return
            for i, part in serve:
                out[i] = data[part]
                versions[i] = version

        return out, versions, [_Job(read[0].key, "ranged read", functools.partial(one, *read)) for read in reads]

    @staticmethod
    async def _gather(tasks: list) -> None:
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one failed: stop the others rather than leave them running
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # and collect what they raised
            raise

    def get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                 lenient: Sequence[int] = ()) -> tuple:
        """Whole values of ``keys`` (None for a missing one) and the bytes of ``requests`` (ranges of one
        object merged as :meth:`get_ranges` merges them), all in one call, at most ``max_in_flight``
        requests at once. With ``versions``, also the :data:`Version` of the object each value and each
        range came from (``(values, parts, value_versions, part_versions)``): a caller that keeps what it
        learnt of an object checks a later read against it. The requests numbered in ``lenient`` get, when
        their object is gone or shorter than the range, that error in place of their bytes (a caller that
        guessed a range from an older version reads the value whole instead); any other error fails the call."""
        return self._wait(self.start_get_many(keys, requests, versions, lenient))

    def start_get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                       lenient: Sequence[int] = ()) -> concurrent.futures.Future:
        """:meth:`get_many` without waiting: its future (a thread waits for no network). Its result or
        exception is :meth:`get_many`'s; cancelled when the store is closed (:meth:`result_of` says
        :class:`ShutdownError`)."""
        for key in keys:
            check_key(key)
        reads = self._plan_reads(requests)
        rounds = -(-(len(reads) + len(keys)) // self.max_in_flight)
        return self._start(self._get_many(list(keys), len(requests), reads, versions, frozenset(lenient)),
                           rounds=max(1, rounds))

    def result_of(self, future: concurrent.futures.Future):
        """The result of a finished future of :meth:`start_get_many` (raising its error; a cancelled one:
        :class:`ShutdownError`)."""
        if future.cancelled():
            raise self._closed_mid_read()
        return future.result()

    async def _get_many(self, keys: list[str], n: int, reads: list, versions: bool = False,
                        lenient: frozenset = frozenset()) -> tuple:
        values: list = [None] * len(keys)
        value_versions: list = [None] * len(keys)

        async def whole(i: int, key: str) -> None:
            try:
                values[i], value_versions[i] = await self._attempts(key, "read", lambda: self._get_whole(key))
            except NotFound:
                values[i] = None

        out, part_versions, jobs = self._range_jobs(n, reads, lenient)
        jobs += [_Job(key, "read", functools.partial(whole, i, key)) for i, key in enumerate(keys)]
        await self._lanes(jobs)
        return (values, out, value_versions, part_versions) if versions else (values, out)

    def get_each(self, requests: Sequence[ByteRange], versions: bool = False) -> Any:
        """The bytes of each range, or the error that range alone met (see
        :func:`~stoker.storage.store.get_each`), in one call: each range its own request (retried on its
        own), at most ``max_in_flight`` at once; one failure does not stop the others. With ``versions``,
        ``(outcomes, versions)``: the :data:`Version` each range came from (None for an error)."""
        by_key(requests)  # checks them
        rounds = -(-len(requests) // self.max_in_flight)
        got = self._run(self._get_each(list(requests)), rounds=max(1, rounds)) if requests else []
        out = [g if isinstance(g, Exception) else g[0] for g in got]
        return (out, [None if isinstance(g, Exception) else g[1] for g in got]) if versions else out

    async def _get_each(self, requests: list[ByteRange]) -> list:
        def one(j: int) -> Awaitable:
            r = requests[j]
            return self._attempts(r.key, "ranged read", lambda: self._get_range(r, r.start, r.length),
                                  short=lambda k: _unsatisfiable(self.uri, r, k))

        return await self._each([r.key for r in requests], "ranged read", one)

    async def _each(self, keys: list[str], what: str, one: Callable[[int], Awaitable]) -> list:
        """``await one(i)`` for each of ``keys`` (the ``what`` of ``keys[i]``), at most ``max_in_flight`` at
        once (see :meth:`_lanes`): what each gave, or the error it alone met, in its place (as a value, see
        :func:`~stoker.errors.as_value`); one failure does not stop the others."""
        out: list = [None] * len(keys)

        async def run(i: int) -> None:
            try:
                out[i] = await one(i)
            except Exception as exc:  # noqa: BLE001 - this key's own error, in its place
                out[i] = as_value(exc)

        def in_place(job: _Job, error: StorageError) -> None:  # no free slot in time: its error in its place
            out[job.at] = as_value(error)

        # one lane per slot (not a task per key): a batch's requests cost the shared loop thread little past
        # their own awaits
        await self._lanes([_Job(key, what, functools.partial(run, i), i) for i, key in enumerate(keys)], in_place)
        return out

    def versions(self, keys: Sequence[str]) -> list:
        """The :data:`Version` of each object now (None where the server states none), or the error that key
        alone met (:class:`NotFound` for a missing one), in its place: one HEAD request each (no body), at
        most ``max_in_flight`` at once. What a cache of this store's bytes revalidates its entries with."""
        for key in keys:
            check_key(key)
        rounds = -(-len(keys) // self.max_in_flight)
        return self._run(self._versions(list(keys)), rounds=max(1, rounds)) if keys else []

    def start_versions(self, keys: Sequence[str]) -> concurrent.futures.Future:
        """:meth:`versions` without waiting: its future (:meth:`result_of` gives the list, or raises
        :class:`ShutdownError` when the store was closed)."""
        for key in keys:
            check_key(key)
        return self._start(self._versions(list(keys)), rounds=max(1, -(-len(keys) // self.max_in_flight)))

    async def _versions(self, keys: list[str]) -> list:
        import obstore

        return await _Heads(self, keys, obstore.head_async).run()

    async def _head(self, key: str) -> dict:
        import obstore

        return await obstore.head_async(self._obstore(), key)

    def size(self, key: str) -> int:
        check_key(key)
        return int(self._run(self._attempts(key, "size", lambda: self._head(key)))["size"])

    def exists(self, key: str) -> bool:
        check_key(key)
        try:
            self._run(self._attempts(key, "existence check", lambda: self._head(key)))
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        prefix = check_prefix(prefix)
        if not self.supports_list:
            raise UnsupportedFormat(f"{self.uri}: an HTTP server cannot list its keys; read known keys (or "
                                    "consolidated metadata) instead", uri=self.uri)
        metas = self._run(self._attempts(prefix or "/", "listing", lambda: self._list(prefix)))
        return sorted(m["path"] for m in metas)

    def list_versions(self, prefix: str = "") -> list[tuple[str, Version | None]]:
        """``(key, version)`` of every key under ``prefix``, sorted: the listing already carries each object's
        size and ETag (or Last-Modified), so this costs what :meth:`list` costs, no request per key. What the
        array statistics key their cache on (a rewritten chunk changes its version)."""
        prefix = check_prefix(prefix)
        if not self.supports_list:
            raise UnsupportedFormat(f"{self.uri}: an HTTP server cannot list its keys", uri=self.uri)
        metas = self._run(self._attempts(prefix or "/", "listing", lambda: self._list(prefix)))
        return sorted(((m["path"], _version(m)) for m in metas), key=lambda kv: kv[0])

    def start_list_versions(self, prefix: str = "", offset: str | None = None,
                            max_keys: int = 1000) -> concurrent.futures.Future:
        """One page of :meth:`list_versions` without waiting: a future of ``(pairs, more)``, the ``(key,
        version)`` of at most ``max_keys`` keys under ``prefix`` after ``offset`` (in key order, as S3, GCS and
        Azure list), and whether more may follow (the next page: ``offset`` the last key). A page of S3's
        1,000 keys is one request. What a disk cache revalidates an array's objects with, in bulk.

        >>> pairs, more = store.result_of(store.start_list_versions("g.zarr/a"))  # [("g.zarr/a/c/0", (812, '"9b2..."'))...]
        """
        prefix = check_prefix(prefix)
        if not self.supports_list:
            raise UnsupportedFormat(f"{self.uri}: an HTTP server cannot list its keys", uri=self.uri)
        max_keys = checks.integer("max_keys", max_keys, 1, uri=self.uri)
        return self._start(self._attempts(prefix or "/", "listing", lambda: self._list_page(prefix, offset, max_keys)))

    async def _list_page(self, prefix: str, offset: str | None, max_keys: int) -> tuple[list, bool]:
        import obstore

        # the stream's first chunk of max_keys: its pages are requested as it is read, so one page is one request
        async for chunk in obstore.list(self._obstore(), prefix or None, offset=offset, chunk_size=max_keys):
            return _listed_versions(chunk), len(chunk) >= max_keys
        return [], False

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """One delimiter listing (obstore follows its pages, 1,000 entries each): the keys directly under
        ``prefix`` and its folders, none of the keys below them."""
        prefix = check_prefix(prefix)
        if not self.supports_list:
            raise UnsupportedFormat(f"{self.uri}: an HTTP server cannot list its keys; read known keys (or "
                                    "consolidated metadata) instead", uri=self.uri)
        found = self._run(self._attempts(prefix or "/", "listing", lambda: self._list_dir(prefix)))
        return (sorted(m["path"] for m in found["objects"]),
                sorted(p.rstrip("/") for p in found["common_prefixes"]))

    def put(self, key: str, value: bytes) -> None:
        """Write ``value`` at ``key`` in one request (a reader sees the old value or the new one, never a part),
        retried as reads are. For small objects beside an array (a writer's completion marks); arrays
        themselves are written through zarr-python (:meth:`writable_obstore`)."""
        check_key(key)
        self._run(self._attempts(key, "write", lambda: self._put(key, value)))

    async def _put(self, key: str, value: bytes) -> None:
        import obstore

        await obstore.put_async(self._obstore(), key, value)

    async def _list_dir(self, prefix: str) -> dict:
        import obstore

        return await obstore.list_with_delimiter_async(self._obstore(), prefix or None)

    async def _list(self, prefix: str) -> list:
        import obstore

        return await obstore.list(self._obstore(), prefix or None, chunk_size=1000).collect_async()

    def close(self) -> None:
        """Cancel this store's requests in flight (their callers get :class:`ShutdownError`); later
        calls raise :class:`ShutdownError` too."""
        self._closed = True
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.cancel()

    def __repr__(self) -> str:
        return f"ObjectStore({self.uri!r})"


class _Job(NamedTuple):
    """One request of a call, run by :meth:`ObjectStore._lanes` (``await run()``): its slot error names ``key``
    and ``what``; ``at``: its place in the call's answer (what ``in_place`` fills)."""

    key: str
    what: str
    run: Callable[[], Awaitable[None]]
    at: int = -1


#: whose request slots a request of a store with a ``gate`` waits for (named in its slot error)
_GATE_SLOTS = "requests_in_flight, shared with other stores"


class _Slot:
    """:meth:`ObjectStore._slot`'s context. A class rather than ``contextlib.asynccontextmanager``: every
    request enters one, on the event loop thread every store shares, and a generator-based one costs that
    thread several more steps each."""

    __slots__ = ("store", "gate", "key", "what", "tried")

    def __init__(self, store: ObjectStore, key: str, what: str, tried: int) -> None:
        self.store, self.gate, self.key, self.what, self.tried = store, store._gate, key, what, tried

    async def __aenter__(self) -> None:
        gate = self.gate
        if gate is None:  # a store of its own, no gate shared with others: no cap but its calls' max_in_flight
            return
        if gate.locked():
            await self.store._queue(gate, self.key, self.what, self.tried)
        else:
            await gate.acquire()  # a free slot: taken at once, no timer

    async def __aexit__(self, *exc: object) -> bool:
        if self.gate is not None:
            self.gate.release()
        return False


class _Heads:
    """The HEAD requests of one :meth:`ObjectStore.versions` call, run by the call's own task: no task, coroutine
    chain or timer per request. A revalidation burst is tens of HEADs a batch, each answered in a fraction of
    a millisecond of the server's time, and every one of them costs the event loop thread every store shares:
    as lanes (:meth:`ObjectStore._lanes`) a HEAD took a task step, five coroutines, a slot object and a
    per-try timer, about 110 Python calls. Here a request is obstore's future with one done callback that
    releases its slot and queues it; the task wakes once for every answer that came in the same turn of the
    loop, takes them all, and starts what may start. What lanes keep is kept: at most ``max_in_flight`` of
    the call at once and one ``gate`` slot each (released as the answer lands); a try bounded by
    :meth:`ObjectStore._per_attempt` (one timer for the call, set at the oldest try's limit); failures that
    may pass tried again after the backoff (:meth:`ObjectStore._failed` decides, as for every request); a
    key never started by the call's deadline or ``queue_timeout_s`` gets the slot error naming it, in its
    place; each key's outcome (its :data:`Version`, or its own error as a value) in its place. Cancelled
    (the call's bound, :meth:`ObjectStore.close`): the requests in flight are cancelled."""

    __slots__ = ("store", "keys", "head", "out", "left", "todo", "tries", "first", "flying", "landed", "expired",
                 "waiter", "timer")

    def __init__(self, store: ObjectStore, keys: list[str], head: Callable) -> None:
        self.store, self.keys, self.head = store, keys, head
        self.out: list = [None] * len(keys)
        self.left = len(keys)  # keys without an outcome yet
        self.todo = collections.deque(range(len(keys)))  # to start: never started, or due again after a backoff
        self.tries = [0] * len(keys)
        self.first = [0.0] * len(keys)  # each key's first try (monotonic): retry_timeout_s counts from it
        self.flying: dict[Any, tuple[int, float]] = {}  # request -> (key number, its try's limit on the loop clock)
        self.landed: collections.deque = collections.deque()  # requests answered, not yet taken
        self.expired: set = set()  # requests cancelled at their try's limit
        self.waiter: asyncio.Future | None = None
        self.timer: asyncio.TimerHandle | None = None

    async def run(self) -> list:
        store, loop = self.store, asyncio.get_running_loop()
        gate, limit, per_attempt = store._gate, store.max_in_flight, store._per_attempt()
        obs = store._obstore()
        queued = None  # the timer that gives up on keys never started (only when some must queue)
        if len(self.keys) > limit:
            started = loop.time()
            wait = store._slot_wait(started)
            if wait is not None:
                queued = loop.call_at(started + wait, self._give_up, started)
        try:
            while self.left:
                while self.landed:
                    self._take(self.landed.popleft(), loop)
                while self.todo and len(self.flying) < limit:
                    i = self.todo.popleft()
                    if self.tries[i] == 0:
                        self.first[i] = time.monotonic()
                    if gate is not None:
                        try:
                            if gate.locked():
                                await store._queue(gate, self.keys[i], "revalidation", self.tries[i])
                            else:
                                await gate.acquire()  # a free slot: taken at once, no timer
                        except StorageError as exc:  # no slot in time: this key's error, in its place
                            self._settle(i, as_value(exc))
                            continue
                    self.tries[i] += 1
                    try:
                        request = self.head(obs, self.keys[i])
                    except Exception as exc:  # noqa: BLE001 - refused at once: a failed try, as any other
                        request = loop.create_future()
                        request.set_exception(exc)
                    self.flying[request] = (i, loop.time() + per_attempt)
                    request.add_done_callback(self._landed)
                    if self.timer is None:  # armed as the request starts, not after the loop: the next key may
                        # wait for a shared gate slot, and a try that never answers must time out meanwhile
                        # (its slot is what that key waits for)
                        self.timer = loop.call_at(self.flying[request][1], self._expire, loop)
                if self.left and not self.landed:
                    self.waiter = loop.create_future()
                    await self.waiter
            return self.out
        finally:
            for handle in (queued, self.timer):
                if handle is not None:
                    handle.cancel()
            for request in self.flying:  # cut short (the call's bound, a close): their slots come back as they end
                request.cancel()

    def _landed(self, request) -> None:
        """A request's done callback: its slot given back at once (a queued request may take it), the answer
        queued for the task, which is woken (once for every answer of this turn of the loop)."""
        if self.store._gate is not None:
            self.store._gate.release()
        self.landed.append(request)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _take(self, request, loop) -> None:
        i, _ = self.flying.pop(request)
        if request in self.expired:
            self.expired.discard(request)
            exc: BaseException | None = asyncio.TimeoutError()
        elif request.cancelled():
            exc = asyncio.CancelledError()
        else:
            exc = request.exception()
        if exc is None:
            try:
                version = _version(request.result())
            except Exception as bad:  # noqa: BLE001 - an answer we cannot read: this key's error, in its place
                version = as_value(bad)
            self._settle(i, version)
            return
        if isinstance(exc, asyncio.CancelledError):  # cancelled from outside (obstore's runtime going away)
            exc = StorageError(f"{self.store.uri}: revalidation of key {self.keys[i]!r} was cancelled",
                               uri=self.store.uri, key=self.keys[i], status=None, attempts=self.tries[i])
        error = self.store._failed(self.keys[i], "revalidation", exc, self.tries[i], self.first[i])
        if error is not None:
            self._settle(i, as_value(error))
        else:
            loop.call_later(self.store._backoff(self.tries[i]), self._again, i)

    def _settle(self, i: int, outcome: Any) -> None:
        self.out[i] = outcome
        self.left -= 1

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _again(self, i: int) -> None:
        """A key's backoff is over: queued to be tried again."""
        self.todo.append(i)
        self._wake()

    def _expire(self, loop) -> None:
        """The oldest tries' limit came: those past it cancelled (each a try that timed out); the timer is set
        again here, at the oldest limit left (the task may be waiting for a gate slot, not looking)."""
        self.timer = None
        now = loop.time()
        for request, (_, limit) in self.flying.items():  # in start order: limits ascend
            if limit > now:
                self.timer = loop.call_at(limit, self._expire, loop)
                break
            if not request.done():
                self.expired.add(request)
                request.cancel()
        self._wake()

    def _give_up(self, started: float) -> None:
        """The call's deadline or ``queue_timeout_s`` came: keys never started get the slot error naming them."""
        store = self.store
        waited = asyncio.get_running_loop().time() - started
        never = [i for i in self.todo if self.tries[i] == 0]
        for i in never:
            self._settle(i, as_value(store._slot_error(self.keys[i], "revalidation", store._call_slots(), 0, waited)))
        self.todo = collections.deque(i for i in self.todo if self.tries[i] > 0)
        self._wake()


#: What identifies one version of an object: its size and ETag (a rewritten object gets a new ETag), or where
#: the server sends none its size and Last-Modified time (see :func:`_version`).
Version = tuple[int, str]


def _version(meta: dict) -> Version | None:
    """The :data:`Version` an answer's metadata states: its size and ETag; where the server sends no ETag, its
    size and Last-Modified time (whole seconds: a rewrite in the same second keeps it); None where it sends
    neither (obstore then reports the epoch): nothing learnt of the object can be checked against a later
    read."""
    e_tag = meta.get("e_tag")
    if e_tag:
        return int(meta["size"]), _etag(str(e_tag))
    modified = meta.get("last_modified")
    if modified is None or getattr(modified, "timestamp", lambda: 0)() == 0:
        return None
    return int(meta["size"]), f"{_MODIFIED}{modified.isoformat()}"


def _listed_versions(metas: list) -> list[tuple[str, Version | None]]:
    """``(key, version)`` of each object of a listing page, each as :func:`_version` states it. A disk cache
    lists every array it opens (1,000 keys a page, a new pipeline's 1,000 arrays of 33 objects each), so an ETag
    already written as :func:`_etag` writes it (quoted, not weak: as S3 lists them) is taken as it comes, with
    no call per key; any other goes through :func:`_version`."""
    out = []
    append = out.append
    for meta in metas:
        e_tag = meta.get("e_tag")
        size = meta["size"] if e_tag else None
        if type(e_tag) is str and type(size) is int and len(e_tag) > 2 and e_tag[0] == '"' == e_tag[-1] \
                and e_tag[1] != '"' != e_tag[-2]:
            append((meta["path"], (size, e_tag)))
        else:
            append((meta["path"], _version(meta)))
    return out


#: what starts the second field of a :data:`Version` made of a Last-Modified time, not an ETag
_MODIFIED = "last-modified:"


def _etag(e_tag: str) -> str:
    """``e_tag`` written one way whatever answer stated it: quoted, without a weak ``W/`` prefix. Azure lists
    ETags unquoted (``<Etag>0x8D..</Etag>``) while its HEAD and GET headers quote them, and a server may
    mark one weak in one answer and not in another: the same object must have one generation, or a listing
    would never confirm what a read kept. Quoted, as S3 states them, so that entries kept before stay keyed
    the same."""
    bare = e_tag.strip()
    if bare[:2] in ("W/", "w/"):
        bare = bare[2:]
    return f'"{bare.strip(chr(34))}"'


def modified_at(version: Any) -> float | None:
    """The Last-Modified time (seconds since the epoch) that ``version`` is made of, where the server sent no
    ETag (see :func:`_version`); None for an ETag, no version, or another store's generation. Such a version
    tells a rewrite of the same size apart only once its second is over: what the disk cache asks before it
    keeps an answer (:mod:`stoker.storage.cachingstore`)."""
    if isinstance(version, tuple) and len(version) == 2 and isinstance(version[1], str) and \
            version[1].startswith(_MODIFIED):
        try:
            return datetime.fromisoformat(version[1][len(_MODIFIED):]).timestamp()
        except ValueError:
            return None
    return None


def etag_version(version: Any) -> Version | None:
    """``version`` when it holds an ETag (which changes with every rewrite), else None: a Last-Modified
    time in whole seconds is too coarse for what must never mix (blosc frame tables, see
    :mod:`stoker.engine.cpu.frame_spans`)."""
    if isinstance(version, tuple) and len(version) == 2 and isinstance(version[1], str) and \
            not version[1].startswith(_MODIFIED):
        return version
    return None  # none, a Last-Modified time, or another store's generation


async def _within(op: Callable, seconds: float):
    """``await op()``, cancelled after ``seconds`` (then a TimeoutError). ``asyncio.timeout`` (Python 3.11+)
    runs it in the caller's task; ``wait_for`` (3.10) wraps it in a task of its own, which costs the event
    loop thread, shared by every request, a few more steps per request."""
    if _TIMEOUT is None:
        return await asyncio.wait_for(op(), seconds)
    async with _TIMEOUT(seconds):
        return await op()


_TIMEOUT = getattr(asyncio, "timeout", None)


def _rebuild(uri: str, storage_options: dict, settings: dict) -> ObjectStore:
    return ObjectStore(uri, storage_options, **settings)


def _first_line(exc: BaseException) -> str:
    """obstore's message without its debug dump."""
    return str(exc).split("\n\nDebug source")[0].strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _classify(exc: BaseException) -> tuple[int | None, bool, str]:
    """``(HTTP status or None, may pass, message)`` of a failed request."""
    text = _first_line(exc)
    if isinstance(exc, _ShortBody):
        return None, True, f"short body: {text}"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return None, True, "timed out"
    if re.search(r"requested \S+, got ", text, re.IGNORECASE):  # obstore's check of a ranged answer
        return None, True, f"short body: {text}"
    m = _STATUS.search(text)
    status = int(m.group(1)) if m else None
    if status is not None:
        return status, status in (408, 429) or 500 <= status < 600, text
    name = type(exc).__name__
    if name in ("PermissionDeniedError", "UnauthenticatedError", "InvalidPathError", "NotSupportedError"):
        return None, False, text
    lowered = text.lower()
    return None, any(marker in lowered for marker in _TRANSIENT), text
