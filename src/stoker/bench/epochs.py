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

>>> peers = epoch_peers(2, run)   # {"stoker e1": fn(mark), "stoker e2": fn(mark)}
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Callable

from ..storage.diskcache import disk_cache

#: The bound of the bench's cache: larger than any scenario reads, so an epoch fits.
CACHE_BYTES = 1 << 40
#: tensorstore's ``cache_pool`` in the epoch peers (memory: decoded chunks); an epoch of a scenario fits.
TS_CACHE_POOL_BYTES = 8 << 30
#: The peer whose epochs a second epoch from the cache is compared with.
LOCAL = "stoker local"


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


def epoch_peers(epochs: int, run: Callable) -> dict[str, Callable]:
    """stoker's epochs through a disk cache: ``run(mark, cache_dir)`` runs the stoker peer with the cache at
    ``cache_dir``. The first epoch makes a new empty folder (removing the previous round's)."""

    def fresh(folder: str | None) -> str:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        return tempfile.mkdtemp(prefix="stoker-bench-cache-")

    def epoch(mark: Callable, folder: str, k: int):
        cache = disk_cache(folder, CACHE_BYTES)
        cache.flush(600)  # the previous epoch's entries written before this one starts
        marks: list[int] = []

        def marked() -> None:  # the clock starts or stops: the disk's bytes so far, then the server's
            marks.append(cache.hit_bytes)
            mark()

        result = run(marked, folder)
        batches = max(1, result.extra["batches"])  # timed batches (not samples)
        result.extra["disk_bytes_per_batch"] = (marks[-1] - marks[0]) / batches if marks else 0.0
        return result

    return kept_epochs("stoker", epochs, fresh, epoch)


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


def hit_rate(extra: dict) -> float | None:
    """The share of bytes served from disk in a peer's timed window, or None without a cache."""
    disk = extra.get("disk_bytes_per_batch")
    if disk is None or "bytes_per_batch" not in extra:
        return None
    total = disk + extra["bytes_per_batch"]
    return disk / total if total else 0.0


def epochs_note() -> str:
    """The table header's words on the epoch peers."""
    return (f"epochs: stoker eN through a local disk cache (e1 from an empty folder; each epoch a new pipeline, "
            f"objects revalidated by a listing of each array over S3, by HEAD over HTTP); tensorstore eN: no disk cache, one context's in-memory cache_pool "
            f"({TS_CACHE_POOL_BYTES >> 30} GiB) kept between epochs, arrays reopened each epoch with "
            f"recheck_cached_data='open' (conditional GETs, 304 without body); zarr eN: zarr-python over obstore "
            f"keeps nothing between epochs; {LOCAL}: the same crops from the local files")


def second_epoch_line(by: dict) -> str | None:
    """``stoker e2`` against ``stoker local`` (samples/s and CPU per batch), or None when either is missing."""
    e2, local = by.get("stoker e2"), by.get(LOCAL)
    if e2 is None or local is None or not local.samples_per_s:
        return None

    def cpu(r) -> str:
        n = r.extra.get("batches") or 0
        return f"{r.extra['cpu_s'] / n * 1e3:.2f} ms" if n and "cpu_s" in r.extra else "n/a"

    return (f"second epoch from the disk cache: stoker e2 {e2.samples_per_s:.1f} samples/s = "
            f"{e2.samples_per_s / local.samples_per_s:.2f}x stoker on local files ({local.samples_per_s:.1f}); "
            f"CPU per batch {cpu(e2)} (e2) against {cpu(local)} (local)")
