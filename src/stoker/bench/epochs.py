"""``stoker bench --store ... --epochs N``: stoker reading through a local disk cache, one peer per epoch.

Peer ``stoker e1`` starts from an empty cache folder (a fresh one each round), ``stoker e2``... read the
same crops again in a new pipeline each (as a new training epoch's pipeline: every object revalidated
with a HEAD request, no body), after the previous epoch's entries are on disk. Each gets, besides the
server's requests and bytes per batch, the bytes served from disk per batch (``disk_bytes_per_batch``),
so the hit rate is disk / (disk + the bytes the server sent).

>>> peers = epoch_peers(2, run)   # {"stoker e1": fn(mark), "stoker e2": fn(mark)}
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Callable

from ..storage.diskcache import disk_cache

#: The bound of the bench's cache: larger than any scenario reads, so an epoch fits.
CACHE_BYTES = 1 << 40


def epoch_peers(epochs: int, run: Callable) -> dict[str, Callable]:
    """``{"stoker e<k>": fn(mark)}`` for k in 1..epochs, to be run in that order in every round: ``run(mark,
    cache_dir)`` runs the stoker peer with the cache at ``cache_dir``. The first makes a new empty folder
    (removing the previous round's)."""
    state: dict = {"folder": None}

    def epoch(k: int, mark: Callable):
        if k == 1:
            if state["folder"] is not None:
                shutil.rmtree(state["folder"], ignore_errors=True)
            state["folder"] = tempfile.mkdtemp(prefix="stoker-bench-cache-")
        cache = disk_cache(state["folder"], CACHE_BYTES)
        cache.flush(600)  # the previous epoch's entries written before this one starts
        marks: list[int] = []

        def marked() -> None:  # the clock starts or stops: the disk's bytes so far, then the server's
            marks.append(cache.hit_bytes)
            mark()

        result = run(marked, state["folder"])
        batches = max(1, result.samples // max(1, result.extra.get("batch_size", 1)))
        result.peer = f"stoker e{k}"
        result.extra["disk_bytes_per_batch"] = (marks[-1] - marks[0]) / batches if marks else 0.0
        return result

    return {f"stoker e{k}": (lambda mark, k=k: epoch(k, mark)) for k in range(1, epochs + 1)}


def hit_rate(extra: dict) -> float | None:
    """The share of bytes served from disk in a peer's timed window, or None without a cache."""
    disk = extra.get("disk_bytes_per_batch")
    if disk is None or "bytes_per_batch" not in extra:
        return None
    total = disk + extra["bytes_per_batch"]
    return disk / total if total else 0.0
