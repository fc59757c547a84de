"""``stoker bench --store ... --epochs N``: every peer's epochs over the same crops, a row per epoch.

- ``stoker e1`` starts from an empty cache folder (a fresh one each round); ``stoker e2``... read the same
  crops again in a new pipeline each (as a new training epoch's pipeline: every object revalidated, by a
  listing of its array over S3, by a HEAD request over HTTP: no body), after the previous epoch's entries are on disk. Each gets, besides the server's
  requests and bytes per batch, the bytes served from disk per batch (``disk_bytes_per_batch``), so the
  hit rate is disk / (disk + the bytes the server sent).
- ``tensorstore e1``... share one ``tensorstore.Context`` whose in-memory ``cache_pool`` holds
  :data:`TS_CACHE_POOL_BYTES` (tensorstore has no disk cache: that pool is what it keeps between epochs);
  each epoch opens the arrays anew with ``recheck_cached_data="open"``, so what was cached before is
  revalidated by conditional GETs (the bench server answers 304, no body, for an unchanged object).
- ``zarr e1``... zarr-python over obstore keeps nothing between epochs (neither has a chunk cache): every
  epoch reads everything again, through the same obstore store.
- ``stoker local`` reads the same crops from the local files the server serves: what a second epoch from
  the cache is measured against (:func:`second_epoch_line`).
- ``stoker e2 (same pipeline)`` (with ``--epochs`` 2 or more) is the second epoch as a training loop makes it
  (``set_epoch`` then ``push``, or ``forever()``): one pipeline reads the crops twice, from an empty cache
  folder of its own, the clock only around the second time (:func:`same_pipeline_peers`). Its objects were
  revalidated when epoch 1 opened their arrays, and are again only once older than ``cache_staleness_s``
  (``--cache-staleness-s``; the library's 60 s by default), then in the background as batches are pulled
  (``revalidate_ahead``): within the bound its second epoch asks the server nothing. ``stoker local (same
  pipeline)`` reads the local files the same way (two epochs in one pipeline, the second timed), so both
  sides pay the same pipeline start and keep the same in-pipeline state: what it is measured against.
- Every stoker epoch runs with a :class:`CachePeak` sampling the cache folder's size (``--cache-bytes``
  bounds it; the default :data:`CACHE_BYTES` holds any scenario's epoch): :func:`cache_peak_line` says
  whether its peak stayed within ``cache_bytes`` plus the largest entry, and how many entries were evicted.

>>> peers = epoch_peers(2, run)   # {"stoker e1": fn(mark), "stoker e2": fn(mark)}
>>> peers.update(same_pipeline_peers(run2, local2))   # {"stoker local (same pipeline)": ..., SAME: ...}
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from typing import Any, Callable

from ..storage.diskcache import DiskCache, disk_cache, folder_usage, running_total

#: The bound of the bench's cache: larger than any scenario reads, so an epoch fits.
CACHE_BYTES = 1 << 40
#: tensorstore's ``cache_pool`` in the epoch peers (memory: decoded chunks); an epoch of a scenario fits.
TS_CACHE_POOL_BYTES = 8 << 30
#: The peer whose epochs a second epoch from the cache is compared with.
LOCAL = "stoker local"
#: The second epoch of one pipeline that read the same crops before, through a disk cache, and from local files.
SAME = "stoker e2 (same pipeline)"
LOCAL_SAME = "stoker local (same pipeline)"
#: The library's ``cache_staleness_s`` when ``--cache-staleness-s`` is not given (``Config``'s None), for the notes.
DEFAULT_STALENESS_S = 60.0
#: How often :class:`CachePeak` reads the folder's running total (seconds).
TOTAL_EVERY_S = 0.002
#: The share of one core :class:`CachePeak`'s full scans of the folder may take (a scan of a few thousand
#: entries costs 10-20 ms of CPU on the 2-core machine: every few ms would take a core from the peers).
SCAN_SHARE = 0.1


class CachePeak:
    """A thread of the bench sampling a :class:`~stoker.storage.diskcache.DiskCache` folder while a block runs:
    the peak of the folder's running total (read every :data:`TOTAL_EVERY_S` while the cache queues, writes
    or evicts entries, the only ways its folder changes in the bench: one ``pread`` of 8 bytes,
    ``diskcache.running_total``), and of the bytes of every file in the folder but that total's (full scans,
    ``diskcache.folder_usage``, as often as :data:`SCAN_SHARE` of a core allows, and one after the block: the
    truth the total is checked against), the largest file seen, the entries evicted meanwhile, and the
    sampler's own CPU seconds (``cpu_s``, to leave out of the peer's). The scans also give the peak of the
    blocks the folder holds (``blocks_peak``: files and folders in whole blocks, as ``du`` counts), which is
    what the cache bounds: its running total counts allocated blocks, folders included.

    A scan is not atomic: one that an eviction overlapped may count an evicted entry beside a later one, bytes
    never on disk together, so a scan during which this process's cache evicted (``DiskCache.evicted``
    changed) is left out (``scans_dropped``); the bench's writes are all this process's.

    >>> with CachePeak(disk_cache(folder, 64 << 20)) as peak:
    ...     run_epoch()
    >>> peak.peak_bytes <= peak.cache_bytes + peak.largest_bytes
    True
    """

    def __init__(self, cache: DiskCache, every_s: float = TOTAL_EVERY_S, scan_share: float = SCAN_SHARE) -> None:
        self.cache, self.every_s, self.scan_share = cache, every_s, scan_share
        self.cache_bytes = cache.cache_bytes
        self.total_peak = self.scan_peak = self.largest_bytes = self.blocks_peak = 0
        self.reads = self.scans = self.scans_dropped = 0
        self.cpu_s = self.wall_s = 0.0
        self._evicted0 = cache.evicted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cachepeak", daemon=True)

    @property
    def peak_bytes(self) -> int:
        """The higher of the two peaks: what the folder held at most, as far as the samples saw."""
        return max(self.total_peak, self.scan_peak)

    @property
    def evicted(self) -> int:
        """Entries this process's cache evicted while sampled."""
        return self.cache.evicted - self._evicted0

    @property
    def blocks_within(self) -> bool:
        """Whether the folder's allocated blocks stayed within ``cache_bytes`` plus the largest entry."""
        return self.blocks_peak <= self.cache_bytes + self.largest_bytes

    @property
    def within(self) -> bool:
        """Whether the peak stayed within ``cache_bytes`` plus the largest entry (the issue's bound)."""
        return self.peak_bytes <= self.cache_bytes + self.largest_bytes

    def __enter__(self) -> "CachePeak":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)  # a scan takes milliseconds; bounded all the same
        self.wall_s = time.monotonic() - self._t0
        self._read_total()  # the folder as the block left it (after the caller's flush: every entry written)
        self._scan()

    def _run(self) -> None:
        next_scan = 0.0
        c0 = time.thread_time()  # the whole loop, its waits between samples included: all of it the bench's
        # the cache's entries queued, written and evicted when the total was last read, and when last scanned
        read: tuple[int, int, int] | None = None
        scanned: tuple[int, int, int] | None = None
        while not self._stop.is_set():
            # The folder changes through this process's cache alone (the bench's writes are all its own): with
            # nothing queued, written or evicted since the last look there is nothing new to see, so an epoch
            # read from disk (all hits) is timed with the sampler idle, not scanning beside the peer it times
            # (a scan holds the GIL for milliseconds). A state not scanned yet is scanned once a scan is due,
            # even if the cache went quiet meanwhile; the scan after the block checks the folder once more.
            now = (self.cache.tickets, self.cache.written, self.cache.evicted)
            if now != read:
                read = now
                self._read_total()
            if now != scanned and time.monotonic() >= next_scan:
                scanned = now
                s0 = time.thread_time()
                self._scan()
                # the next scan after enough idle time that scans take at most scan_share of a core
                next_scan = time.monotonic() + (time.thread_time() - s0) / self.scan_share
            self._stop.wait(self.every_s)
            self.cpu_s = time.thread_time() - c0

    def _read_total(self) -> None:
        total = running_total(self.cache.root)  # None until the folder's first write
        if total is not None:
            self.reads += 1
            self.total_peak = max(self.total_peak, total)

    def _scan(self) -> None:
        evicted = self.cache.evicted
        usage = folder_usage(self.cache.root)
        self.largest_bytes = max(self.largest_bytes, usage.largest)
        if self.cache.evicted != evicted:
            self.scans_dropped += 1
            return
        self.scans += 1
        self.scan_peak = max(self.scan_peak, usage.nbytes)
        self.blocks_peak = max(self.blocks_peak, usage.allocated)


def kept_epochs(peer: str, epochs: int, fresh: Callable[[Any], Any], run: Callable[[Callable, Any, int], Any]
                ) -> dict[str, Callable]:
    """``{"<peer> e<k>": fn(mark)}`` for k in 1..epochs, to be run in that order in every round: epoch 1 makes
    what the epochs keep with ``fresh(previous round's)``; every epoch runs ``run(mark, kept, k)``."""
    state: dict = {"kept": None}

    def epoch(k: int, mark: Callable):
        if k == 1:
            state["kept"] = fresh(state["kept"])
        result = run(mark, state["kept"], k)
        result.peer = f"{peer} e{k}"
        return result

    return {f"{peer} e{k}": (lambda mark, k=k: epoch(k, mark)) for k in range(1, epochs + 1)}


def epoch_peers(epochs: int, run: Callable, cache_bytes: int = CACHE_BYTES, staleness_s: float | None = None
                ) -> dict[str, Callable]:
    """stoker's epochs through a disk cache: ``run(mark, cache_dir)`` runs the stoker peer with the cache at
    ``cache_dir`` (bounded by ``cache_bytes``; ``staleness_s``: the ``cache_staleness_s`` it runs with, None the
    default, noted in each result's ``extra["cache_staleness_s"]``). The first epoch makes a new empty folder (removing the previous
    round's). Each epoch's result gets ``extra["cache_peak"]``: the :class:`CachePeak` of every round's same
    epoch (a list shared by them, so the median round's row tells of the worst)."""

    def fresh(folder: str | None) -> str:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        return tempfile.mkdtemp(prefix="stoker-bench-cache-")

    peaks: dict[int, list[CachePeak]] = {k: [] for k in range(1, epochs + 1)}
    dropped = {"previous": 0}  # the round's epoch before: entries its write queue dropped

    def epoch(mark: Callable, folder: str, k: int):
        disk_cache(folder, cache_bytes).flush(600)  # the previous epoch's entries written before this one starts
        result = _through_cache(lambda marked, _cache: run(marked, folder), folder, cache_bytes, peaks[k], mark,
                                staleness_s)
        if k > 1:
            result.extra["previous_epoch_dropped"] = dropped["previous"]
        dropped["previous"] = result.extra["dropped"]
        if k == epochs:  # the round's last epoch: nothing reads the folder again (the next round makes its own)
            shutil.rmtree(folder, ignore_errors=True)
        return result

    return kept_epochs("stoker", epochs, fresh, epoch)


def _through_cache(run: Callable, folder: str, cache_bytes: int, peaks: list[CachePeak], mark: Callable,
                   staleness_s: float | None):
    """``run(marked, cache)`` (a stoker peer reading through the cache at ``folder``) sampled by a
    :class:`CachePeak` (appended to ``peaks``, which the result's ``extra["cache_peak"]`` gets), its
    ``extra`` given the bytes served from disk per timed batch, its CPU less the sampler's, the entries the
    cache's write queue dropped meanwhile (``dropped``: full, so not cached; a later read fetches them again)
    and ``cache_staleness_s`` (``staleness_s``, or the default's value)."""
    cache = disk_cache(folder, cache_bytes)  # the pipeline's own (one per folder, bound and process)
    dropped = cache.dropped
    marks: list[tuple[int, float]] = []

    def marked() -> None:  # the clock starts or stops: the disk's bytes so far, then the server's
        marks.append((cache.hit_bytes, peak.cpu_s))
        mark()

    with CachePeak(cache) as peak:
        result = run(marked, cache)
        cache.flush(600)  # this epoch's entries on disk while sampled
    batches = max(1, result.extra["batches"])  # timed batches (not samples)
    result.extra["disk_bytes_per_batch"] = (marks[-1][0] - marks[0][0]) / batches if marks else 0.0
    if marks and "cpu_s" in result.extra:  # the sampler's CPU is the bench's, not the pipeline's
        result.extra["cpu_s"] -= marks[-1][1] - marks[0][1]
    peaks.append(peak)
    result.extra["cache_peak"] = peaks
    result.extra["dropped"] = cache.dropped - dropped
    result.extra["cache_staleness_s"] = DEFAULT_STALENESS_S if staleness_s is None else staleness_s
    return result


def same_pipeline_peers(run: Callable, run_local: Callable, cache_bytes: int = CACHE_BYTES,
                        staleness_s: float | None = None) -> dict[str, Callable]:
    """The second epoch in the pipeline that read the first: ``{LOCAL_SAME: fn(mark), SAME: fn(mark)}``.

    ``run(mark, folder, between)`` runs the stoker peer over two epochs of the crops in one pipeline, with
    the cache at ``folder`` (a new empty one each round, removed after), calling ``between()`` after the first:
    here the cache's flush, so the second starts with the first's entries on disk as ``stoker e2`` does. The
    clock (``mark``) runs around the second epoch only; the folder is sampled by a :class:`CachePeak` all
    along; ``staleness_s`` as for :func:`epoch_peers`. ``run_local(mark, between)`` does the same from the
    local files (``between`` does nothing)."""
    peaks: list[CachePeak] = []

    def same(mark: Callable):
        folder = tempfile.mkdtemp(prefix="stoker-bench-cache-")
        dropped: list[int] = []  # the write queue's drops as the first epoch starts, and once it is written

        def two_epochs(marked: Callable, cache: DiskCache):
            def between() -> None:
                cache.flush(600)
                dropped.append(cache.dropped)

            dropped.append(cache.dropped)
            return run(marked, folder, between)

        try:
            result = _through_cache(two_epochs, folder, cache_bytes, peaks, mark, staleness_s)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        result.peer = SAME
        result.extra["previous_epoch_dropped"] = dropped[1] - dropped[0]
        return result

    def local(mark: Callable):
        result = run_local(mark, lambda: None)
        result.peer = LOCAL_SAME
        return result

    return {LOCAL_SAME: local, SAME: same}


def tensorstore_epoch_peers(epochs: int, run: Callable) -> dict[str, Callable]:
    """tensorstore's epochs: ``run(mark, context)`` runs the tensorstore peer with ``context`` (one per
    round, with a ``cache_pool`` of :data:`TS_CACHE_POOL_BYTES`), its arrays opened anew each epoch."""

    def fresh(_previous) -> Any:
        import tensorstore as ts

        return ts.Context({"cache_pool": {"total_bytes_limit": TS_CACHE_POOL_BYTES}})

    return kept_epochs("tensorstore", epochs, fresh, lambda mark, context, k: run(mark, context))


def zarr_epoch_peers(epochs: int, run: Callable) -> dict[str, Callable]:
    """zarr-python's epochs: ``run(mark)`` each time (nothing is kept between them)."""
    return kept_epochs("zarr", epochs, lambda _previous: None, lambda mark, _kept, k: run(mark))


def _size(n: float) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def cache_peak_line(peer: str, extra: dict) -> str | None:
    """A stoker epoch's cache folder against its bound (the worst of its rounds), or None without one:
    ``stoker e2: cache folder peak 63.8 MiB <= cache_bytes 64.0 MiB + largest entry 2.1 MiB ...``, or a line
    starting ``EXCEEDED``."""
    peaks = extra.get("cache_peak")
    if not peaks:
        return None
    worst = max(peaks, key=lambda p: p.peak_bytes - p.cache_bytes - p.largest_bytes)
    within = all(p.within for p in peaks)
    rounds = f" (worst of {len(peaks)} rounds)" if len(peaks) > 1 else ""
    return (f"{'' if within else 'EXCEEDED: '}{peer}: cache folder peak {_size(worst.peak_bytes)} "
            f"{'<=' if within else '>'} cache_bytes {_size(worst.cache_bytes)} + largest entry "
            f"{_size(worst.largest_bytes)}{rounds}; {worst.evicted} entries evicted; running total read "
            f"{worst.reads} times in {worst.wall_s:.2f} s (peak {_size(worst.total_peak)}), {worst.scans} full scans "
            f"(peak {_size(worst.scan_peak)}; {worst.scans_dropped} left out: an eviction ran during them); "
            f"sampler CPU {worst.cpu_s * 1e3:.0f} ms, left out of the peer's; in allocated blocks (as du counts) "
            f"peak {_size(max(p.blocks_peak for p in peaks))}"
            + ("" if all(p.blocks_within for p in peaks) else
               " OVER cache_bytes + largest entry"))


def hit_rate(extra: dict) -> float | None:
    """The share of bytes served from disk in a peer's timed window, or None without a cache."""
    disk = extra.get("disk_bytes_per_batch")
    if disk is None or "bytes_per_batch" not in extra:
        return None
    total = disk + extra["bytes_per_batch"]
    return disk / total if total else 0.0


def _staleness(by: dict) -> str:
    """The ``cache_staleness_s`` the stoker epochs ran with, in words."""
    stale = next((r.extra["cache_staleness_s"] for r in by.values() if "cache_staleness_s" in r.extra), None)
    if stale is None or stale == DEFAULT_STALENESS_S:
        return f"cache_staleness_s {DEFAULT_STALENESS_S:g} s (the default)"
    return f"cache_staleness_s {stale:g} s (--cache-staleness-s)"


def epochs_note(by: dict | None = None) -> str:
    """The table header's words on the epoch peers (``by``: the results by peer, for the same-pipeline rows
    and the staleness bound they ran with)."""
    by = by or {}
    same = (f"; {SAME}: one pipeline reads the crops twice (set_epoch, forever()), from an empty folder, "
            f"timed the second time: objects revalidated when epoch 1 opened their arrays, then only once older "
            f"than {_staleness(by)}, in the background; {LOCAL_SAME}: the same from the local files"
            if SAME in by else "")
    return (f"epochs: stoker eN through a local disk cache (e1 from an empty folder; each epoch a new pipeline, "
            f"as a restarted job's: objects revalidated by a listing of each array over S3, by HEAD over HTTP)"
            f"{same}; tensorstore eN: no disk cache, one context's in-memory cache_pool "
            f"({TS_CACHE_POOL_BYTES >> 30} GiB) kept between epochs, arrays reopened each epoch with "
            f"recheck_cached_data='open' (conditional GETs, 304 without body); zarr eN: zarr-python over obstore "
            f"keeps nothing between epochs; {LOCAL}: the same crops from the local files")


def _cpu(r) -> str:
    n = r.extra.get("batches") or 0
    return f"{r.extra['cpu_s'] / n * 1e3:.2f} ms" if n and "cpu_s" in r.extra else "n/a"


def _served(r) -> str:
    """A cached peer's requests and MB from the server per batch, and its hit rate."""
    if "requests_per_batch" not in r.extra:
        return ""
    rate = hit_rate(r.extra)
    dropped = r.extra.get("previous_epoch_dropped")
    return (f"; {r.extra['requests_per_batch']:.1f} requests and {r.extra['bytes_per_batch'] / 1e6:.2f} MB a batch "
            f"from the server" + ("" if rate is None else f", hit rate {rate:.1%}")
            + ("" if dropped is None else f" (write queue full in the epoch before: {dropped} entries not cached)"))


def second_epoch_lines(by: dict) -> list[str]:
    """Each kind of second epoch from the disk cache against the local read measured the same way: ``stoker
    e2`` (a new pipeline) against ``stoker local``, and ``stoker e2 (same pipeline)`` against ``stoker local
    (same pipeline)`` (samples/s, requests and MB a batch, hit rate, the entries the epoch before could not
    cache, CPU per batch); a line for each pair present.

    >>> second_epoch_lines(by)[1]
    'second epoch from the disk cache, in the same pipeline ...: stoker e2 (same pipeline) 401.0 samples/s = 0.97x ...'
    """
    lines = []
    for e2_name, local_name, kind in (
            ("stoker e2", LOCAL, "a new pipeline, as a restarted job or a new process opens: every object "
                                 "revalidated"),
            (SAME, LOCAL_SAME, f"in the same pipeline, as set_epoch or forever() reads it: revalidated only past "
                               f"{_staleness(by)}")):
        e2, local = by.get(e2_name), by.get(local_name)
        if e2 is None or local is None or not local.samples_per_s:
            continue
        against = "stoker on local files" if local_name == LOCAL else local_name
        if "first_epoch_s" in e2.extra:  # what the staleness bound is measured against
            kind += f"; its epoch 1 and the cache's flush took {e2.extra['first_epoch_s']:.2f} s before it"
        lines.append(f"second epoch from the disk cache: {e2_name} {e2.samples_per_s:.1f} samples/s = "
                     f"{e2.samples_per_s / local.samples_per_s:.2f}x {against} ({local.samples_per_s:.1f}) [{kind}]{_served(e2)}; CPU per batch {_cpu(e2)} (e2) "
                     f"against {_cpu(local)} (local){per_round_ratios(e2.extra, local.extra)}")
    return lines


def per_round_ratios(e2: dict, local: dict) -> str:
    """With 2 or more rounds (interleaved: each round runs the local peer and the e2 peer close in time), the
    e2/local ratio of each round's samples/s and of its CPU per batch (local/e2: above 1, e2 cheaper), and
    their medians: a slow spell of the shared machine moves one round's pair together, so these ratios are
    steadier than the ratio of the two peers' medians (each from another round), which is on the line above.

    >>> per_round_ratios({"rounds": [90, 100, 80]}, {"rounds": [100, 100, 100]})
    '; per round: samples/s e2/local 0.90 1.00 0.80 (median 0.90)'
    """
    a, b = e2.get("rounds") or [], local.get("rounds") or []
    if len(a) < 2 or len(a) != len(b):
        return ""
    out = [_ratios("samples/s e2/local", [x / y if y else None for x, y in zip(a, b)])]
    ca, cb = e2.get("rounds_cpu_ms") or [], local.get("rounds_cpu_ms") or []
    if len(ca) == len(a) and len(cb) == len(b):
        out.append(_ratios("CPU per batch local/e2", [y / x if x and y else None for x, y in zip(ca, cb)]))
    return "; per round: " + "; ".join(r for r in out if r)


def _ratios(what: str, ratios: list) -> str:
    known = sorted(r for r in ratios if r is not None)
    if not known:
        return ""
    return (f"{what} " + " ".join("n/a" if r is None else f"{r:.2f}" for r in ratios)
            + f" (median {known[(len(known) - 1) // 2]:.2f})")
