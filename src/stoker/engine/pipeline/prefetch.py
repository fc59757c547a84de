"""Batches planned ahead of their slots, each with its remote chunks prefetched while it waits.

The coordinator plans a batch, then waits for a free slot to submit it; only then would its chunks be
fetched. :class:`Ahead` holds the batches planned and not yet submitted, in order: while the prefetch buffer
(:class:`~stoker.storage.prefetch.PrefetchBuffer`, ``Config.prefetch_bytes`` and ``prefetch_requests``)
has room for another batch like the last, the coordinator plans one more (its shard indexes read by the
planning) and starts the fetch of its remote chunks and ranges into the buffer (:func:`prefetch_plan`);
otherwise it submits the oldest, waiting for its slot. A batch's fetch then finds its bytes in the buffer, or
in flight there. A batch's entries are dropped from the buffer once the slot it was made in is taken again
(the consumer released it: the batch is made). Arrays in local files never prefetch (the page cache is
theirs), so a pipeline of local arrays plans one batch ahead, as without it.

>>> ahead = Ahead(cfg)
>>> ahead.planned(plan, entry, waits=True)   # numbered, its chunks prefetched
>>> ahead.more()                 # room for another batch like it?
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from ...config import Config
from ...storage.prefetch import PrefetchBuffer, PrefetchStore
from ...storage.store import ByteRange
from ..planning.tables import TablePlan

#: Most batches planned ahead of their slots (each holds its plan: a few arrays per chunk).
MAX_AHEAD = 32


class Ahead:
    """The batches planned and waiting for a slot (``queue``: ``(plan or None, entry, number)``, oldest first;
    a batch that could not be planned rides as ``(None, entry, -1)``) and the pipeline's prefetch buffer
    (``buffer``; None when ``Config.prefetch_bytes`` is 0). Used by the coordinator's thread alone."""

    def __init__(self, cfg: Config) -> None:
        self.buffer = PrefetchBuffer(cfg.prefetch_bytes, cfg.prefetch_requests) if cfg.prefetch_bytes else None
        self.queue: collections.deque[tuple[TablePlan | None, Any, int]] = collections.deque()
        self._seq = 0  # planned batches, numbered in order (the order they take slots in)
        self._last = (0, 0)  # what the newest batch planned started: (bytes, values and ranges)

    def planned(self, plan: TablePlan, entry: Any, waits: bool) -> None:
        """Queue a planned batch, and start its prefetch when it ``waits`` for a slot (every slot is taken or
        spoken for: otherwise it is submitted at once and its own fetches, grouped as the decoder groups
        them, start now anyway)."""
        self._seq += 1
        self._last = prefetch_plan(plan, self._seq) if self.buffer is not None and waits else (0, 0)
        self.queue.append((plan, entry, self._seq))

    def failed(self, entry: Any) -> None:
        """Queue an error in a batch's place (no slot, nothing to fetch); no batch is planned past it."""
        self._last = (0, 0)
        self.queue.append((None, entry, -1))

    def more(self) -> bool:
        """Whether to plan another batch before submitting the oldest: the newest one prefetched something,
        and the buffer has room for as much again (or for as much as its bounds allow)."""
        nbytes, n = self._last
        buffer = self.buffer
        # a batch larger than the buffer's bounds is prefetched in part: room for that part is enough
        return buffer is not None and bool(self.queue) and len(self.queue) < MAX_AHEAD and n > 0 and \
            buffer.room(min(nbytes, buffer.max_bytes), min(n, buffer.max_requests))

    def submitted(self, seq: int, n_slots: int) -> None:
        """Batch ``seq`` took a slot: the batch that last held it, ``n_slots`` before, is made, so what only
        it and earlier ones wanted leaves the buffer."""
        if self.buffer is not None and seq > 0:
            self.buffer.retire(seq - n_slots)

    def close(self) -> None:
        self.queue.clear()
        if self.buffer is not None:
            self.buffer.close()


def prefetch_plan(plan: TablePlan, seq: int) -> tuple[int, int]:
    """Start fetching the remote chunks of ``plan`` (whole values and inner chunks' ranges of its arrays in
    stores that prefetch), for batch ``seq``; ``(bytes, values and ranges)`` it needs (those asked already for
    an earlier batch, or past the bounds, included: they are not asked). A step per chunk of such an array."""
    stored = np.nonzero(plan.chunk_file >= 0)[0]
    remote = [isinstance(r.kv, PrefetchStore) for r in plan.sources]
    if not len(stored) or not any(remote):
        return 0, 0
    asks: dict[int, tuple[PrefetchStore, dict, dict]] = {}  # per store: {key: estimate}, {(key, off, len): None}
    nbytes = 0
    files, offsets, lengths = plan.chunk_file[stored], plan.chunk_offset[stored], plan.chunk_length[stored]
    for s, f, offset, length in zip(plan.chunk_source[stored].tolist(), files.tolist(), offsets.tolist(),
                                    lengths.tolist()):
        if not remote[s]:
            continue
        reader = plan.sources[s]
        kv, keys, ranges = asks.setdefault(id(reader.kv), (reader.kv, {}, {}))
        key = reader.key_of(plan.file_path(f))
        if offset < 0:  # a whole value: at most what its codec stores
            if key not in keys:
                keys[key] = reader.metadata.codec.max_stored_nbytes
                nbytes += keys[key]
        elif (key, offset, length) not in ranges:
            ranges[(key, offset, length)] = None
            nbytes += length
    n = 0
    for kv, keys, ranges in asks.values():
        kv.prefetch(list(keys), list(keys.values()), [ByteRange(*r) for r in ranges], seq)
        n += len(keys) + len(ranges)
    return nbytes, n


__all__ = ["Ahead", "MAX_AHEAD", "prefetch_plan"]
