"""The ``Store`` protocol: values addressed by keys relative to a root, read whole or by byte ranges.

A key is a ``/``-separated relative name (``"zarr.json"``, ``"c/0/1"``), never an OS path: the same
key reads the same value from a directory, a zip archive, an object store bucket or memory. Every
store subclasses :class:`Store`: its methods, and the capabilities it declares as class attributes
(``supports_ranges``, ``supports_list``, ``lists_in_memory``, ``is_local``, ``reports_versions``,
``starts_reads``, ``max_gap``; see :class:`Store`), which callers read and never probe for.

Reads return exactly the asked bytes or raise: a missing key is :class:`~stoker.errors.NotFound`, and
any failure to deliver them, a short body included, is a :class:`~stoker.errors.StorageError` naming
the store's URI, the key and, where there is one, the status and the attempts made. Never fewer bytes.
Reads return ``bytes`` or a ``memoryview`` of a larger buffer (compare with ``bytes(x)``).

Generations. A store that declares ``reports_versions`` also says, for every value and range its ``get_many``
and ``get_each`` read (``versions=True``), the generation of the value the bytes came from: what tells one
version of a value from another (an object store's size and ETag, or Last-Modified; a memory store's write
count; a zip archive's identity), ``None`` where it cannot tell. A reader that keeps what it learnt of a
value (a shard's index) keeps its generation with it, and uses a later range of that value only when it
came from the same generation (:func:`stamp` makes one an int to keep in a table).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from ..errors import InvalidArgument, NotFound, StorageError, as_value

@dataclass(frozen=True)
class ByteRange:
    """``length`` bytes of the value at ``key`` from ``start``; a negative ``start`` (``-length``)
    asks for the value's last ``length`` bytes (:meth:`suffix`, what a shard index needs)."""

    key: str
    start: int
    length: int

    def __post_init__(self) -> None:
        check_key(self.key)
        for name in ("start", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"ByteRange {name} must be an int, got {value!r}", key=self.key)
        if self.length < 0:
            raise InvalidArgument(f"ByteRange length must be >= 0, got {self.length}", key=self.key)
        if self.start < 0 and self.start != -self.length:
            raise InvalidArgument(
                f"ByteRange start {self.start} is negative but not -length ({-self.length}); use "
                "ByteRange.suffix(key, n) for the last n bytes", key=self.key)

    @classmethod
    def suffix(cls, key: str, length: int) -> "ByteRange":
        """The last ``length`` bytes of the value at ``key``."""
        return cls(key, -length, length)

    @property
    def is_suffix(self) -> bool:
        return self.start < 0


class Store:
    """What every store does (see the module docstring for the rules they share): every store subclasses it.

    A store declares what it can do as class attributes (never probed): :attr:`supports_ranges`,
    :attr:`supports_list`, :attr:`lists_in_memory`, :attr:`is_local`, :attr:`reports_versions`,
    :attr:`starts_reads`, :attr:`max_gap`. It implements :meth:`get`, :meth:`get_ranges`, :meth:`size`, :meth:`exists`,
    :meth:`list`, :meth:`list_dir` and :meth:`close`; the bulk reads :meth:`get_many` and :meth:`get_each`
    have defaults built on them, which a store that reads many things at once (an object store) overrides.

    >>> class Dict(Store):
    ...     uri, supports_list = "memory://d", False
    ...     def get(self, key): return b"abc"
    ...     def get_ranges(self, requests): return [self.get(r.key)[r.start:r.start + r.length] for r in requests]
    >>> Dict().get_many(["k"], [ByteRange("k", 1, 2)])
    ([b'abc'], [b'bc'])
    """

    uri: str
    #: :meth:`get_ranges` reads only the asked bytes (otherwise whole values are read and sliced)
    supports_ranges: bool = True
    #: :meth:`list` and :meth:`list_dir` work (plain HTTP servers cannot list)
    supports_list: bool = True
    #: :meth:`list` and :meth:`list_dir` answer from memory, without a request (a zip archive's member list):
    #: a reader may list to learn a layout its metadata does not say (a v2 array's key separator)
    lists_in_memory: bool = False
    #: keys are regular files under the directory :attr:`root` (``store.path(key)`` names one), and each
    #: value's generation is its file's :data:`~stoker.storage.local.Identity`: an engine may read the files
    #: itself by path, checking their identities as :class:`~stoker.storage.local.LocalStore` does
    is_local: bool = False
    #: :meth:`get_many` and :meth:`get_each` say which generation of each value they read (``versions=True``);
    #: otherwise they report None (unknown) for every read
    reports_versions: bool = False
    #: :meth:`start_get_many` starts a :meth:`get_many` without a waiting thread (an object store's requests
    #: run on its event loop): its future's :meth:`result_of` is the result
    starts_reads: bool = False
    #: ranges of one value at most this many bytes apart are read as one (the gap read too); 0: none merged
    max_gap: int = 0
    #: the directory holding the values of an ``is_local`` store (None for others)
    root: str | None = None

    def get(self, key: str) -> bytes | memoryview:
        """The whole value at ``key``."""
        raise NotImplementedError

    def get_ranges(self, requests: Sequence[ByteRange]) -> list[bytes | memoryview]:
        """The bytes of every range, in order: one call for many ranges of one or several keys, so a
        store can merge and overlap them."""
        raise NotImplementedError

    def get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                 lenient: Collection[int] = ()) -> tuple:
        """Whole values of ``keys`` (None for a missing key) and the bytes of ``requests``, in one call (here one
        after the other; a store that can, many at once). With ``versions``, also each value's and range's
        generation (None where the store reports none): ``(values, parts, value_versions, part_versions)``.
        The requests numbered in ``lenient`` get, when their value is gone or shorter than the range, that
        error in place of their bytes (a caller that located a range in an older version reads anew)."""
        values, parts = read_values(self, keys), ranges_in_place(self.get_ranges, requests, lenient)
        return (values, parts, [None] * len(values), [None] * len(parts)) if versions else (values, parts)

    def get_each(self, requests: Sequence[ByteRange], versions: bool = False) -> Any:
        """The bytes of each range, or the error that range alone met (:class:`NotFound` for a missing key,
        a short read...), in one call: for readers whose ranges are independent (shard indexes), one failure
        costs nobody else their bytes. Here all in one :meth:`get_ranges` call and, only if it fails, each
        range alone. With ``versions``: ``(outcomes, generations)``."""
        out = each_alone(self, requests)
        return (out, [None] * len(out)) if versions else out

    def start_get_many(self, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
                       lenient: Collection[int] = ()) -> Any:
        """A future of :meth:`get_many` (a store that declares :attr:`starts_reads`)."""
        raise NotImplementedError(f"{type(self).__name__} does not start reads (starts_reads is False)")

    def result_of(self, future: Any) -> Any:
        """What the future of :meth:`start_get_many` holds (its error raised)."""
        raise NotImplementedError(f"{type(self).__name__} does not start reads (starts_reads is False)")

    def size(self, key: str) -> int:
        """The value's length in bytes."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        """Whether a value is stored at ``key``."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (a ``/``-separated directory; ``""``: all), sorted."""
        raise NotImplementedError

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """One level under ``prefix``: ``(keys, folders)``, the keys directly in it and the folders
        (full key prefixes, no trailing ``/``) holding keys further down, both sorted. Never the keys
        under those folders: an object store answers it with a delimiter listing, a page of 1,000
        entries per request, so finding the groups of a hierarchy reads none of their chunk keys."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the store holds (descriptors, connections); reads after it may fail."""


def check_key(key: str) -> str:
    """``key`` when it is a valid relative key: ``/``-separated, no empty, ``.`` or ``..`` segment, no
    backslash or NUL; :class:`InvalidArgument` otherwise (keys never leave the store's root)."""
    if not isinstance(key, str):
        raise InvalidArgument(f"a store key must be a string, got {type(key).__name__}")
    parts = key.split("/")  # tested as a list (no generator per part: a batch checks every chunk's key)
    if not key or "\\" in key or "\0" in key or "" in parts or "." in parts or ".." in parts:
        raise InvalidArgument(
            f"store key {key!r} is not a relative key ('/'-separated names, no empty, '.' or '..' part, "
            "no backslash): keys are relative to the store's root", key=key)
    return key


def check_prefix(prefix: str) -> str:
    """A listing prefix as a directory: ``""`` or a valid key, without trailing ``/``."""
    prefix = prefix.rstrip("/") if isinstance(prefix, str) else prefix
    return "" if prefix == "" else check_key(prefix)


def under(keys, prefix: str) -> list[str]:
    """The sorted keys of ``keys`` under the directory ``prefix`` (already checked)."""
    if not prefix:
        return sorted(keys)
    head = prefix + "/"
    return sorted(k for k in keys if k.startswith(head))


def one_level(keys, prefix: str) -> tuple[list[str], list[str]]:
    """:meth:`Store.list_dir` of a store that holds its key names (``prefix`` already checked)."""
    head = prefix + "/" if prefix else ""
    direct, folders = set(), set()
    for key in keys:
        if key.startswith(head):
            name, slash, _ = key[len(head):].partition("/")
            (folders if slash else direct).add(head + name)
    return sorted(direct), sorted(folders)


def by_key(requests: Sequence[ByteRange]) -> dict[str, list[int]]:
    """Request numbers grouped by key, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        if not isinstance(r, ByteRange):
            raise InvalidArgument(f"get_ranges takes ByteRange requests, got {type(r).__name__} at {i}")
        groups.setdefault(r.key, []).append(i)
    return groups


def slice_value(value, r: ByteRange, uri: str) -> memoryview:
    """The bytes of ``r`` from a whole value (memoryview, no copy); short: :func:`short_read`."""
    view = memoryview(value)
    start = len(view) - r.length if r.is_suffix else r.start
    if start < 0 or start + r.length > len(view):
        raise short_read(uri, r, max(0, min(len(view) - max(start, 0), r.length)), size=len(view))
    return view[start:start + r.length]


def short_read(uri: str, r: ByteRange, got: int, size: int | None = None, attempts: int = 1,
               below: int | None = None) -> StorageError:
    """The error for fewer bytes than a range asked (past the end of the value, or a short body); its
    ``value_size`` is the value's size where the store knows it (None for a short body), ``value_below`` a
    bound the size is known to be under where only that is known (a range past the end: HTTP 416)."""
    where = f"last {r.length} bytes" if r.is_suffix else f"bytes {r.start}..{r.start + r.length}"
    of = f" of a {size}-byte value" if size is not None else ""
    return StorageError(
        f"{uri}: read of {where}{of} at key {r.key!r} got {got} bytes, not {r.length}; the value is shorter "
        "than the read expects (truncated or rewritten) or the server sent a short body",
        uri=uri, key=r.key, status=None, attempts=attempts, value_size=size, value_below=below)


def denied(exc: BaseException) -> bool:
    """Whether ``exc`` is a store refusing access (HTTP 403). S3 answers 403, not 404, for a missing key to a
    client without ``s3:ListBucket`` permission, so an optional key (a probe) reads a refusal as absent;
    a required key keeps the error (its message says a 403 may be a missing key)."""
    return isinstance(exc, StorageError) and exc.context.get("status") == 403


def not_found(uri: str, key: str) -> NotFound:
    return NotFound(f"{uri}: no value at key {key!r}", uri=uri, key=key)


def missing_bucket(uri: str, key: str, what: str = "read") -> NotFound:
    """NotFound for ``key`` of the store at ``uri`` (``s3://bucket/...``) whose bucket the server says does not
    exist (answering the ``what`` of the key: a read, a listing). Its context says so (``missing="bucket"``, see
    :func:`bucket_missing`): readers that take a missing optional document as none raise it on, since nothing
    under the bucket can be read and "no array at ..." would send one looking for a wrong path where the
    bucket's name, endpoint or region is what is wrong."""
    bucket = uri.split("://", 1)[-1].split("/", 1)[0]
    return NotFound(f"{uri}: bucket {bucket!r} does not exist (the server said so to a {what} of key {key!r}); "
                    "check the bucket's name in the URI, and the endpoint and region (storage_options or the "
                    "environment)",
                    uri=uri, key=key, bucket=bucket, missing="bucket")


def bucket_missing(exc: BaseException) -> bool:
    """Whether ``exc`` is :func:`missing_bucket`'s NotFound (a missing bucket, not a missing key)."""
    return isinstance(exc, NotFound) and exc.context.get("missing") == "bucket"


@functools.lru_cache(maxsize=4096)  # the parts of one object share its generation: a fingerprint each, not per part
def stamp(generation: Any) -> int:
    """A value's generation as a nonzero int of 62 bits (a fingerprint of it), 0 for None (unknown): what a
    table of int64s keeps of it. Two generations that differ get stamps that differ (but for a chance of
    one in 2**62).

    >>> stamp(None), stamp((1024, '"abc"')) == stamp((1024, '"abc"'))
    (0, True)
    """
    if generation is None:
        return 0
    digest = hashlib.blake2b(repr(generation).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 2) or 1


def gone_or_shorter(exc: BaseException) -> bool:
    """Whether ``exc`` says a range's value is missing, or ends before the range does."""
    return isinstance(exc, NotFound) or (isinstance(exc, StorageError) and "value_size" in exc.context)


def ranges_in_place(get_ranges: Callable, requests: Sequence[ByteRange], lenient: Collection[int] = ()) -> list:
    """``get_ranges(requests)``; with ``lenient``, the requests numbered there whose value is gone or shorter
    than the range get that error in place of their bytes (each range then read alone), any other error
    raised."""
    if not requests:
        return []
    try:
        return list(get_ranges(requests))
    except (NotFound, StorageError) as exc:
        if not lenient or not gone_or_shorter(exc):
            raise
    out: list = []
    for i, r in enumerate(requests):
        try:
            out.append(get_ranges([r])[0])
        except (NotFound, StorageError) as exc:
            if i not in lenient or not gone_or_shorter(exc):
                raise
            out.append(as_value(exc))
    return out


def read_values(store: Store, keys: Sequence[str]) -> list[bytes | memoryview | None]:
    """The whole value of each key, None for a missing one, one after the other."""
    values: list = []
    for key in keys:
        try:
            values.append(store.get(key))
        except NotFound:
            values.append(None)
    return values


def get_many(store: Store, keys: Sequence[str], requests: Sequence[ByteRange], versions: bool = False,
             lenient: Collection[int] = ()) -> tuple:
    """``store.get_many(...)`` (see :meth:`Store.get_many`)."""
    return store.get_many(keys, requests, versions=versions, lenient=lenient)


def get_each(store: Store, requests: Sequence[ByteRange], versions: bool = False) -> Any:
    """``store.get_each(...)`` (see :meth:`Store.get_each`)."""
    return store.get_each(requests, versions=versions)


def each_alone(store: Store, requests: Sequence[ByteRange]) -> list[bytes | memoryview | Exception]:
    """:func:`get_each` of a store without one of its own."""
    if not requests:
        return []
    try:
        return list(store.get_ranges(requests))
    except Exception as exc:  # noqa: BLE001 - whose it is is found below
        if len(requests) == 1:
            return [as_value(exc)]
    out: list = []
    for r in requests:
        try:
            out.append(store.get_ranges([r])[0])
        except Exception as exc:  # noqa: BLE001 - this range's own error, returned in its place
            out.append(as_value(exc))
    return out
