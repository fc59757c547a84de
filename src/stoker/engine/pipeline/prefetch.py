"""Batches planned ahead of their slots, each with its remote chunks prefetched while it waits.

The coordinator plans a batch, then waits for a free slot to submit it; only then would its chunks be
fetched. :class:`Ahead` holds the batches planned and not yet submitted, in order: while the prefetch buffer
(:class:`~stoker.storage.prefetch.PrefetchBuffer`, ``Config.prefetch_bytes`` and ``prefetch_requests``)
has room for another batch like the last (and fewer than :data:`QUIET_AFTER` batches in a row found all
their remote chunks on disk: a cached epoch has no latency to hide), the coordinator plans one more (its shard indexes read by the
planning) and starts the fetch of its remote chunks and ranges into the buffer (:func:`prefetch_plan`);
a chunk or range an earlier queued batch asked for after this batch's samples were pushed is shared (one
request, served to each in turn). Otherwise it submits the oldest, waiting for its slot; while no slot is
free and only the buffer's room stops planning, it waits for either (:meth:`Ahead.blocked`), so planning
resumes as requests end. A batch's fetch then finds its bytes in the buffer, or in flight there. A batch's
entries are dropped from the buffer once the slot it was made in is taken again (the consumer released it:
the batch is made). Arrays in local files never prefetch (the page cache is theirs), so a pipeline of local
arrays plans one batch ahead, as without it.

>>> ahead = Ahead(cfg)
>>> ahead.planned(plan, entry, waits=True, pushed=1, mark=1)   # numbered, its chunks prefetched
>>> ahead.more()                 # room for another batch like it?
"""

from __future__ import annotations

import collections
import itertools
import math
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from ...config import Config

from ...reader.array import start_shard_entries
from ...runtime.memo import remember
from ...storage.prefetch import PrefetchBuffer, PrefetchStore
from ...storage.store import ByteRange
from ..planning.tables import TablePlan

#: Most batches planned ahead of their slots (each holds its plan: a few arrays per chunk).
MAX_AHEAD = 32
#: Batches planned in a row that found every remote chunk on disk (nothing to fetch, see :meth:`Ahead.planned`)
#: after which no more are planned ahead of their slots, until one needs a fetch again: a second epoch read
#: from the disk cache has no latency to hide. Not after one: in a cold epoch of sharded arrays, a batch whose
#: inner chunks came with earlier batches' shards is found whole on disk, and the batches after it need fetches.
QUIET_AFTER = 8


class Ahead:
    """The batches planned and waiting for a slot (``queue``: ``(plan or None, entry, number)``, oldest first;
    a batch that could not be planned rides as ``(None, entry, -1)``) and the pipeline's prefetch buffer
    (``buffer``; None when ``Config.prefetch_bytes`` is 0). Used by the coordinator's thread alone;
    ``wake`` is called (from any thread, never blocking) when requests of the buffer end."""

    def __init__(self, cfg: Config, wake: Callable[[], None] | None = None) -> None:
        # prefetches never take more than three quarters of the pipeline's requests: the batches being made
        # (what was not prefetched, what failed) keep a quarter of requests_in_flight for their own fetches
        requests = min(cfg.prefetch_requests, max(1, cfg.requests_in_flight * 3 // 4))
        self.buffer = PrefetchBuffer(cfg.prefetch_bytes, requests) if cfg.prefetch_bytes else None
        if self.buffer is not None:
            self.buffer.on_room = wake
        self.queue: collections.deque[tuple[TablePlan | None, Any, int]] = collections.deque()
        self._seq = 0  # planned batches, numbered in order (the order they take slots in)
        # what the newest batch planned needs started anew (bytes, values and ranges: those it shared with an
        # earlier batch's requests left out), and whether it prefetched anything
        self._last = (0, 0, False)
        # batches planned ahead in a row whose remote chunks were all on disk (see QUIET_AFTER)
        self.quiet = 0
        self.remote = False  # the newest batch planned reads arrays in stores that prefetch
        # each disk cache's losses when the newest batch reading it was planned, by id (see _lost)
        self._losses: dict[int, tuple[Any, int]] = {}
        # each store's values and ranges fetched when the newest batch reading it was planned, by id (see _lost)
        self._fetched: dict[int, tuple[Any, int]] = {}
        # the chunks of the pipeline's arrays known fresh when revalidated ahead (see revalidate_ahead)
        self.revalidated = Revalidated()

    def planned(self, plan: TablePlan, entry: Any, waits: bool, pushed: int = 0, mark: int = 0) -> None:
        """Queue a planned batch, and start its prefetch when it ``waits`` for a slot (every slot is taken or
        spoken for: otherwise it is submitted at once and its own fetches, grouped as the decoder groups
        them, start now anyway) and batches are not quiet (:data:`QUIET_AFTER`; see :meth:`_lost`). ``pushed``: the pushes its samples came in; ``mark``: the pushes so far
        (see :meth:`PrefetchBuffer.ask`)."""
        self._seq += 1
        # asked once a batch: a batch of local arrays alone (no store that prefetches) has nothing lost or to
        # prefetch (_lost and prefetch_plan look at such stores only), so it skips both
        prefetches = self.buffer is not None and any(isinstance(r.kv, PrefetchStore) for r in plan.sources)
        if prefetches and self._lost(plan):  # entries found on disk before may be gone: look again
            self.quiet = 0
        # quiet (batches found whole on disk): not looked up ahead (the decoder looks up its entries itself, once)
        # until a store fetches again (_lost), so a cached epoch runs no per-chunk loop here
        nbytes, n, remote, fetches = prefetch_plan(plan, self._seq, pushed, mark) \
            if prefetches and waits and self.quiet < QUIET_AFTER else (0, 0, False, 0)
        self._last = (nbytes, n, remote)
        if remote:  # it reads remote chunks: all found on disk, or some to fetch
            self.quiet = 0 if fetches else self.quiet + 1
        self.queue.append((plan, entry, self._seq))
        self.remote = prefetches

    def _lost(self, plan: TablePlan) -> bool:
        """Whether the disk caches of ``plan``'s remote stores lost entries since the last batch planned (their
        ``losses``: evictions, writes not made, entries the engine found missing), or those stores fetched
        values or ranges since (their ``fetched``: a batch read chunks not on disk): batches found whole on
        disk (:data:`QUIET_AFTER`) may need fetches again, so looking up and planning ahead resume. A step
        per store."""
        lost = False
        stores = {id(r.kv): r.kv for r in plan.sources}  # each store once (a batch of many arrays of one bucket)
        for kv in stores.values():
            if not isinstance(kv, PrefetchStore):
                continue
            fetched = getattr(kv, "fetched", None)
            if fetched is not None:  # one count per store (a CachingStore's; not one per array reading it)
                seen = self._fetched.get(id(kv))
                if seen is None or seen[1] != fetched:
                    self._fetched[id(kv)] = (kv, fetched)  # the store held, so its id is not another's
                    lost = lost or fetched != (0 if seen is None else seen[1])
            # one count per disk cache, however many of the plan's arrays (or stores) share it: a sum over the
            # arrays differed between batches reading different numbers of them, with nothing lost between
            cache = getattr(kv, "cache", kv)
            losses = getattr(kv, "losses", 0)
            seen = self._losses.get(id(cache))
            if seen is None or seen[1] != losses:
                self._losses[id(cache)] = (cache, losses)  # the cache held, so its id is not another's
                lost = lost or losses != (0 if seen is None else seen[1])
        return lost

    def failed(self, entry: Any) -> None:
        """Queue an error in a batch's place (no slot, nothing to fetch); no batch is planned past it."""
        self._last = (0, 0, False)
        self.queue.append((None, entry, -1))

    def _may_plan(self) -> bool:
        return self.buffer is not None and bool(self.queue) and len(self.queue) < MAX_AHEAD and self._last[2] \
            and self.quiet < QUIET_AFTER and self.queue[-1][0] is not None

    def _room(self) -> bool:
        nbytes, n, _ = self._last
        buffer = self.buffer
        assert buffer is not None
        # a batch larger than the buffer's bounds is prefetched in part: room for that part is enough
        return buffer.room(min(max(nbytes, 1), buffer.max_bytes), min(max(n, 1), buffer.max_requests))

    def more(self) -> bool:
        """Whether to plan another batch before submitting the oldest: the newest one reads remote chunks, fewer
        than :data:`QUIET_AFTER` batches in a row found all theirs on disk, and the buffer has room for as much
        again as the newest asked anew (or for as much as its bounds allow)."""
        return self._may_plan() and self._room()

    def blocked(self) -> bool:
        """Whether only the buffer's room keeps another batch from being planned (requests still in flight
        end soon, and free it)."""
        return self._may_plan() and not self._room()

    def fresh(self, pushed: int) -> None:
        """A batch of the first ``pushed`` pushes is about to fetch: nothing asked before them serves it
        (:meth:`PrefetchBuffer.fresh_from`)."""
        if self.buffer is not None:
            self.buffer.fresh_from(pushed)

    def submitted(self, seq: int, n_slots: int) -> None:
        """Batch ``seq`` took a slot: the batch that last held it, ``n_slots`` before, is made, so what only
        it and earlier ones wanted leaves the buffer."""
        if self.buffer is not None and seq > 0:
            self.buffer.begun(seq)
            self.buffer.retire(seq - n_slots)

    def close(self) -> None:
        self.queue.clear()
        if self.buffer is not None:
            self.buffer.close()


def cells_touched(aabb, shape, cell) -> list[range]:
    """Per axis, the range of grid cells (chunks or shards of size ``cell``) a box ``aabb`` (``(lo, hi)`` per
    axis) touches inside an array of ``shape``; an empty range on an axis the box misses (a padded box may
    reach past the array).

    >>> cells_touched([(-4, 10), (40, 50)], (64, 32), (8, 8))
    [range(0, 2), range(0, 0)]
    """
    spans = []
    for (lo, hi), size, n in zip(aabb, shape, cell):
        lo, hi = max(0, lo), min(size, hi)
        spans.append(range(lo // n, (hi - 1) // n + 1) if hi > lo else range(0))
    return spans


def prefetch_plan(plan: TablePlan, seq: int, pushed: int = 0, mark: int = 0) -> tuple[int, int, bool, int]:
    """Start fetching the remote chunks of ``plan`` (whole values and inner chunks' ranges of its arrays in
    stores that prefetch), for batch ``seq`` (``pushed``, ``mark``: see :meth:`PrefetchBuffer.ask`);
    ``(bytes, values and ranges, any, fetches)``: what it needs asked anew (all but those shared with an
    earlier batch's requests; those past the bounds included: they are not asked), whether it needs any
    remote chunk at all, and the values and ranges it fetches (shared ones included; 0: all on disk). Chunks a disk cache holds at a generation known now are not asked (:func:`_on_disk`):
    their entries are kept in ``plan.disk_entries`` for the decoder, which reads them from disk without
    asking the cache again. A step per chunk of such an array."""
    stored = np.nonzero(plan.chunk_file >= 0)[0]
    remote = [isinstance(r.kv, PrefetchStore) for r in plan.sources]
    if not len(stored) or not any(remote):
        return 0, 0, False, 0
    # per store: {key: estimate}, {(key, off, len): None}, [(chunk, key or (key, off, len))]
    asks: dict[int, tuple[PrefetchStore, dict, dict, list]] = {}
    nbytes = 0
    files, offsets, lengths = plan.chunk_file[stored], plan.chunk_offset[stored], plan.chunk_length[stored]
    for c, s, f, offset, length in zip(stored.tolist(), plan.chunk_source[stored].tolist(), files.tolist(),
                                       offsets.tolist(), lengths.tolist()):
        if not remote[s]:
            continue
        reader = plan.sources[s]
        kv, keys, ranges, chunks = asks.setdefault(id(reader.kv), (reader.kv, {}, {}, []))
        key = reader.key_of(plan.file_path(f))
        if offset < 0:  # a whole value: at most what its codec stores
            chunks.append((c, key))
            if key not in keys:
                keys[key] = reader.metadata.codec.max_stored_nbytes
                nbytes += keys[key]
        else:
            chunks.append((c, (key, offset, length)))
            if (key, offset, length) not in ranges:
                ranges[(key, offset, length)] = None
                nbytes += length
    n = fetches = 0
    entries: dict[int, tuple[bytes, bytes]] = {}
    for kv, keys, ranges, chunks in asks.values():
        dropped, found = _on_disk(kv, keys, ranges)
        nbytes -= dropped
        if found:
            entries.update((c, found[what]) for c, what in chunks if what in found)
        fetches += len(keys) + len(ranges)
        if not (keys or ranges):  # every one on disk: nothing to ask
            continue
        asked = kv.ask(list(keys), list(keys.values()), [ByteRange(*r) for r in ranges], seq, pushed, mark)
        n += len(keys) + len(ranges) - asked.shared
        nbytes -= asked.shared_bytes
    plan.disk_entries = entries
    return nbytes, n, bool(asks), fetches


#: Most shard indexes one call of :func:`indexes_ahead` starts reading (a huge box's are read by its planning).
MAX_INDEXES_AHEAD = 4096


def indexes_ahead(samples: Sequence[Any], reader_of: Callable[[str], Any],
                  run: Callable[[Callable[[], None]], None]) -> int:
    """Start reading the shard indexes that the boxes of ``samples`` (a batch pulled and not yet planned)
    touch in sharded arrays in stores, those neither cached nor being read already
    (:func:`~stoker.reader.array.start_shard_entries`: one round trip per store, on the thread ``run(fn)``
    gives), so that the batch's planning finds them cached, or waits for that read, rather than waiting a
    round trip of its own on the coordinator, after the batches before it were planned, one batch after
    another. ``reader_of(uri)``: the open array, or None (not open: skipped). Returns the indexes started (at
    most :data:`MAX_INDEXES_AHEAD`); never waits.

    >>> indexes_ahead(pulled_samples, lambda uri: readers.get(uri), pool.submit)
    3
    """
    wanted: dict[tuple[int, str], tuple[Any, str]] = {}
    # one loop over every (part, array), so that the cap leaves it at once
    touched = ((part, uri) for sample in samples for part in (sample.fields.values() if sample.fields else (sample,))
               if part.aabb is not None for uri in part.uris)
    for part, uri in touched:
        reader = reader_of(uri)
        if reader is None:
            continue
        meta = reader.metadata
        # an array without shards first (the usual one: every sample of every batch of it comes here), before
        # asking its store whether it is local (a property through each store wrapping another)
        if meta.sharding is None or reader.kv.is_local:
            continue
        spans = cells_touched(part.aabb, meta.shape, meta.chunk_shape)
        if not all(spans):
            continue
        grid = reader.shard_grid
        numbers = [int(np.ravel_multi_index(index, grid)) for index in
                   itertools.islice(itertools.product(*spans), MAX_INDEXES_AHEAD - len(wanted))]
        for key in reader.shard_keys(numbers):
            wanted.setdefault((id(reader), key), (reader, key))
        if len(wanted) >= MAX_INDEXES_AHEAD:
            break
    return start_shard_entries(list(wanted.values()), run)


def _box(aabb, shape, cell) -> tuple:
    """The runs of grid cells a box ``aabb`` touches, ``(start, stop)`` an axis: the starts and stops of
    :func:`cells_touched`'s ranges (``(0, 0)`` on an axis the box misses), built without making the ranges.

    >>> _box([(-4, 10), (40, 50)], (64, 32), (8, 8))
    ((0, 2), (0, 0))
    """
    runs = []
    for (lo, hi), size, n in zip(aabb, shape, cell):
        if lo < 0:
            lo = 0
        if hi > size:
            hi = size
        runs.append((lo // n, (hi - 1) // n + 1) if hi > lo else (0, 0))
    return tuple(runs)


#: Most objects one call of :func:`revalidate_ahead` asks about (a huge box is revalidated by its own reads).
MAX_REVALIDATE = 4096


def revalidate_ahead(samples: Sequence[Any], reader_of: Callable[[str], Any],
                     asked: "Revalidated | None" = None) -> int:
    """Start revalidating the generations of the objects (chunks, or shards) that the boxes of ``samples``
    touch, in the disk cache of each remote array's store (its ``revalidate``: HEAD requests on the store's
    event loop, within ``requests_in_flight``, each shared with any read of its object), for batches pulled
    and not yet planned: their reads then find what the disk holds known to be current, instead of waiting a
    round trip for it. ``reader_of(uri)``: the open array, or None (not open: skipped). Returns the objects
    asked about (at most :data:`MAX_REVALIDATE`); never waits. An array whose store holds a current,
    complete listing of it builds no key (:func:`listed_whole`); any other has its objects asked (a key
    still in a listing page in flight is not HEADed, one whose listing is half stale starts the next), but
    those its store said lately were known and younger than half the staleness bound (``asked``, a
    pipeline's :class:`Revalidated`): until then asking does nothing, so their keys are not even built (a
    second epoch read within the bound asks about none: a look-up per box whose chunks were all found so
    before, else per chunk, not a key built and checked). A box seen before (an epoch before) keeps its chunks'
    keys: once its record is out of date, its store says in one look-up (``fresh_until``) whether they are all
    fresh, before any is asked chunk by chunk (a second epoch in the pipeline that read the first, whose reads
    learnt every generation: a look-up per box, where the chunks' own record, asked about before their reads,
    says nothing).

    >>> revalidate_ahead(pulled_samples, lambda uri: readers.get(uri), ahead.revalidated)
    """
    asks: dict[int, tuple[Any, dict]] = {}
    skip: dict[int, bool] = {}  # per reader: a current, complete listing holds it, so nothing to ask
    # per store (many arrays share one): its revalidate, fresh_until and listed, looked up once a call; listed
    # None where the store holds no listing at all (lists_any: HTTP, or arrays opened on a cold cache, as a
    # pipeline's second epoch after a first from an empty folder): it would say False of every array
    methods: dict[int, tuple[Any, Any, Any]] = {}
    n = 0
    now = time.monotonic()
    for sample in samples:
        for part in (sample.fields.values() if sample.fields else (sample,)):
            if part.aabb is None:
                continue
            for uri in part.uris:
                reader = reader_of(uri)
                if reader is None:
                    continue
                got = methods.get(id(reader.kv))
                if got is None:
                    kv = reader.kv  # (a PrefetchStore reaches these through its __getattr__: once a call)
                    lists_any = getattr(kv, "lists_any", None)
                    listed_of = getattr(kv, "listed", None) if lists_any is None or lists_any() else None
                    got = methods[id(kv)] = (getattr(kv, "revalidate", None), getattr(kv, "fresh_until", None),
                                             listed_of)
                revalidate, fresh_until, listed_of = got
                if revalidate is None:
                    continue
                if listed_of is not None:
                    listed = skip.get(id(reader))
                    if listed is None:  # once a call and array (see listed_whole)
                        listed = skip[id(reader)] = bool(listed_of(reader.path))
                    if listed:
                        continue
                meta = reader.metadata
                chunks = asked.of(reader) if asked is not None else None
                box = boxed = None
                if chunks is not None and meta.shape:  # (a 0-d array's one chunk is its box: no box record)
                    # the box's chunks all known fresh until then, when last looked at: one look-up, not one a
                    # chunk (a second epoch's crops, many to an array, cover few distinct runs of chunks). The
                    # box built straight from the crop (a second epoch's every box, every batch: a step per
                    # sample on the coordinator), its ranges only where its chunks are looked at
                    box = _box(part.aabb, meta.shape, meta.chunk_shape)
                    boxed = chunks.get(box)
                    if boxed is not None and boxed[1] > now:
                        continue
                if boxed is not None and boxed[0] is not None and fresh_until is not None:
                    # its chunks' keys, kept when first seen (an epoch before, read since): the store says in one
                    # look-up whether all are fresh now, the chunks' own record not consulted (nor its ranges made)
                    until = fresh_until(boxed[0])
                    if until > now:
                        boxed[1] = until
                        continue
                spans = cells_touched(part.aabb, meta.shape, meta.chunk_shape)
                keys = asks.setdefault(id(reader.kv), (revalidate, {}))[1]
                soonest, whole = math.inf, True  # the box's chunks' earliest "until", and whether all are fresh
                # its keys kept with it when first seen, for a box of at most BOX_KEYS chunks (the bound in memory)
                box_keys: list | None = [] if box is not None and (boxed is None or boxed[0] is None) and \
                    math.prod(len(r) for r in spans) <= BOX_KEYS else None
                for index in itertools.product(*spans):
                    held = chunks.get(index) if chunks is not None else None
                    if held is not None and held[1] > now:
                        soonest = min(soonest, held[1])
                        if box_keys is not None:
                            box_keys.append(held[0])
                        continue  # known and younger than half the bound when asked last: nothing to do
                    whole = False
                    if n >= MAX_REVALIDATE:
                        box_keys = None  # (its keys not all built: the box is kept without them)
                        break
                    if held is None:
                        key = reader.key_of(reader.file_path(meta.chunk_key(index)))
                        if chunks is not None:
                            held = asked.keep(chunks, index, [key, 0.0])  # type: ignore[union-attr]
                    else:
                        key = held[0]
                    if box_keys is not None:
                        box_keys.append(key)
                    if key not in keys:
                        keys[key] = held
                        n += 1
                if box is None:
                    continue
                until = soonest if whole and soonest != math.inf else 0.0
                if boxed is None:
                    if box_keys is not None or until:
                        kept = None if box_keys is None else tuple(box_keys)
                        asked.keep(chunks, box, [kept, until])  # type: ignore[union-attr]
                else:
                    boxed[1] = until
                    if box_keys is not None:
                        boxed[0] = tuple(box_keys)
    for revalidate, keys in asks.values():
        if keys:
            try:
                fresh = revalidate(list(keys))
            except Exception:  # noqa: BLE001 - the store closed: the batches' own reads say so
                continue
            if asked is not None and fresh:
                asked.learnt(keys, fresh)
    return n


class Revalidated:
    """Per open array (an ``ArrayReader``), its chunks (grid indices) asked about: ``[key, until]``, the key of
    the chunk's object (built once) and until when (``time.monotonic()``; 0: not known when last asked) its
    store said it is known and younger than half the staleness bound: what :func:`revalidate_ahead` skips;
    and boxes (a ``(start, stop)`` run of chunks an axis): ``[the keys of its chunks (None where not all
    were built, or it covers more than :data:`BOX_KEYS`), until]``, until when all its chunks were so (the
    earliest of theirs; 0: not all were), the box skipped whole till then, and after that its store asked
    about its keys in one look-up. A pipeline's (:attr:`Ahead.revalidated`); at most
    :data:`REVALIDATED_ENTRIES` chunks and boxes in all (about 280 bytes each, a box's keys up to ~0.5 KiB
    more: ~18-34 MiB), :data:`REVALIDATED_CHUNKS` an array and :data:`REVALIDATED_ARRAYS` arrays, past
    which forgotten (built and asked again): past the bound in all, whole arrays', those first asked about
    first, until a quarter of it is free. Readers are held weakly: an array the pipeline closed or evicted
    is dropped with its chunks, not kept alive here. Read and written by whichever thread revalidates a batch
    (single dict and list steps). Only ever skips asking ahead: a read still judges its objects' generations
    itself (an object the store forgot since, or lost from the disk, is revalidated, or fetched, by its read).

    >>> ahead.revalidated.of(reader)    # {(0, 1, 2): ["a.zarr/c/0/1/2", 1234.5], ...}
    """

    def __init__(self) -> None:
        # id(reader) -> (a weak reference to it, its chunks); the reference's callback drops the entry
        self._arrays: dict[int, tuple[weakref.ref, dict]] = {}
        self._entries = 0  # chunks kept in all, counted as kept (recounted exactly before forgetting)

    def of(self, reader: Any) -> dict:
        """The chunks of ``reader`` known fresh (made on first use; dropped when the reader is)."""
        held = self._arrays.get(id(reader))
        if held is None or held[0]() is not reader:
            key = id(reader)
            arrays = self._arrays

            def dropped(ref: weakref.ref, key: int = key) -> None:  # the reader is gone: its chunks with it
                entry = arrays.get(key)
                if entry is not None and entry[0] is ref:
                    del arrays[key]

            held = remember(self._arrays, key, (weakref.ref(reader, dropped), {}), REVALIDATED_ARRAYS)
        return held[1]

    def keep(self, chunks: dict, index: tuple[int, ...], value: list) -> list:
        """``chunks[index] = value`` (``chunks``: one of :meth:`of`), within the bounds: past
        :data:`REVALIDATED_ENTRIES` chunks in all, other arrays' chunks are forgotten first, those first asked
        about first, until a quarter of the bound is free (:meth:`_forget_some`); returns ``value``."""
        if index not in chunks:
            self._entries += 1
            if self._entries > REVALIDATED_ENTRIES:
                self._entries = sum(len(c) for _, c in list(self._arrays.values())) + 1  # the readers dropped
                if self._entries > REVALIDATED_ENTRIES:
                    self._forget_some(chunks)
        return remember(chunks, index, value, REVALIDATED_CHUNKS)

    def _forget_some(self, keeping: dict) -> None:
        """Forget whole arrays' chunks, the arrays first asked about first, until at most three quarters of
        :data:`REVALIDATED_ENTRIES` are kept (with the one about to be kept): the arrays a pipeline reads now
        keep theirs, rather than every array asking about every chunk again at once. ``keeping`` (the array
        being kept into) goes last, should the others not free enough."""
        target = REVALIDATED_ENTRIES * 3 // 4
        held = [c for _, c in list(self._arrays.values()) if c is not keeping] + [keeping]
        for c in held:
            if self._entries <= target:
                break
            self._entries -= len(c)
            c.clear()

    def __len__(self) -> int:
        """The chunks kept, in all arrays."""
        return sum(len(c) for _, c in list(self._arrays.values()))

    @staticmethod
    def learnt(keys: dict, fresh: dict) -> None:
        """What a store's ``revalidate`` said (``fresh``: key -> until) of ``keys`` (key -> its chunk's
        ``[key, until]`` here, or None), kept."""
        for key, until in fresh.items():
            held = keys[key]
            if held is not None:
                held[1] = until


#: Arrays, chunks an array, and chunks in all that :class:`Revalidated` keeps at most (an entry: a key string,
#: its list and index, about 280 bytes: 65,536 of them ~18 MiB, against 1024 x 16,384 ~4.4 GiB before).
REVALIDATED_ARRAYS = 1024
REVALIDATED_CHUNKS = 1 << 14
REVALIDATED_ENTRIES = 1 << 16
#: The most chunks a box may cover for :class:`Revalidated` to keep their keys with it (a reference each, 8
#: bytes: a box's entry at most ~0.5 KiB more, 65,536 of them ~34 MiB); a larger box is asked chunk by chunk,
#: its look-ups few beside its reads.
BOX_KEYS = 64


def listed_whole(reader: Any) -> bool:
    """Whether every object ``reader`` (an open array) may have in its disk cache has its generation known now
    from a listing (its store's ``listed``: :meth:`CachingStore.listed
    <stoker.storage.cachingstore.CachingStore.listed>`, complete, not failed, younger than half the
    staleness bound): then :func:`revalidate_ahead` asks nothing of it. Not where the store cannot list
    (HTTP), the open listed nothing (a cold cache), the listing failed or stopped at ``LIST_KEYS`` (a larger
    array: the objects past it are revalidated by a HEAD each), or is half stale (asking starts the next)."""
    listed = getattr(reader.kv, "listed", None)
    return listed is not None and bool(listed(reader.path))


def _on_disk(kv: PrefetchStore, keys: dict, ranges: dict) -> tuple[int, dict]:
    """Drop from ``keys`` and ``ranges`` what ``kv``'s disk cache holds at a generation known now (its
    ``entry_files``): a local read, with no latency to hide, which the compiled engine makes itself
    (engine/cpu/decode_native.py); returns their bytes, and their entries by key or ``(key, off, len)``."""
    entry_files = getattr(kv, "entry_files", None)
    if entry_files is None or not (keys or ranges):
        return 0, {}
    found = entry_files(list(keys), [ByteRange(*r) for r in ranges])
    dropped = 0
    kept: dict = {}
    for key, entry in zip(list(keys), found):
        if entry is not None:
            dropped += keys.pop(key)
            kept[key] = entry
    for r, entry in zip(list(ranges), found[len(found) - len(ranges):]):
        if entry is not None:
            del ranges[r]
            dropped += r[2]
            kept[r] = entry
    return dropped, kept


__all__ = ["Ahead", "BOX_KEYS", "MAX_AHEAD", "MAX_INDEXES_AHEAD", "MAX_REVALIDATE", "QUIET_AFTER",
           "REVALIDATED_ARRAYS", "REVALIDATED_CHUNKS", "REVALIDATED_ENTRIES", "Revalidated", "indexes_ahead",
           "listed_whole", "prefetch_plan", "revalidate_ahead"]
