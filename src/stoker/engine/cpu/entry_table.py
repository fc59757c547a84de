"""EntryTable: the disk-cache entries a decoder was given, looked up a batch at a time with numpy.

A second epoch read from a disk cache asks, for every chunk of every batch, which entry file holds it. Asked of
the store (``CachingStore.entry_rows``: key strings, dict look-ups) or of a Python memo, that is a few
microseconds a chunk on the pipeline's coordinator (scenario 6: 64 chunks a batch, ~0.8 ms of its CPU a batch,
as much as the rest of its work). Here the entries it was given are kept in numpy columns, and a batch's chunks
are found in a constant number of numpy steps, whatever their number.

A chunk's key is four integers: its array's number (``_Source.uid``; 0: never kept), its file's number in the
array's grid of files (C order) and its range in that file (offset and length; -1, -1: the whole file). The
table is set-associative: a key's hash (one matrix product) picks a set of :data:`WAYS` slots, and a look-up
compares the batch's keys with their sets' slots at once. Each slot holds, besides its key:

- the entry (its path and ident, one ``bytes`` each, joined: what the engine reads and checks);
- ``until``: when its object's generation leaves the staleness bound (``CachingStore.known_until``);
- ``ticket``: the disk cache's write ticket (``DiskCache.tickets`` when it was queued; 0: on disk already): the
  entry is on disk once the folder's writer has settled that many writes (``DiskCache.settled``), so an entry
  queued when it was kept (a first epoch's fetch) is found only once it is written, never handed to the engine
  to find missing;
- its store's stamp number when it was given (:meth:`EntryTable.stamp_of`): a store whose ``changes`` (a
  generation replaced or forgotten) or ``losses`` (entries evicted, a write not made) moved on has a new
  number, and every slot given under the old one is stale at once, as the per-array memos it replaces were
  emptied.

A slot is found only where all four hold now, so the table never serves what the store would not: an object
rewritten, an entry lost, one past the staleness bound or one not yet written are all misses, asked of the
store again. Keeping takes a set's empty or expired slots first; a set full of live entries keeps them and
drops the newcomer (more cached chunks than :data:`SLOTS`, read in the same order each epoch: those kept are hits
every epoch, the rest cost what they cost without a table). A batch whose chunks are all hits is found in one
compiled call instead (:meth:`EntryTable.hits`: csrc/py_entries.c reads the same columns and entries list, laid
out as the header's ``ET_*`` columns, and makes the engine's entries rows: 0.4 -> 0.2 ms of the coordinator's
CPU a batch of scenario 6). Bounded: :data:`SLOTS` entries, about 90 bytes a
slot plus its entry's bytes (~24 MiB at most). Thread-safe (the coordinator looks up, compute threads keep what
fetches made).

>>> table = EntryTable()
>>> table.keep(keys, stamps, untils, tickets, paths, idents)        # keys: (n, 4) int64
>>> slots, entries, lengths = table.lookup(keys, stamps, settled, time.monotonic())   # slots: -1, not found
>>> rows, blob = table.hits(plan.files, ..., time.monotonic()) or (None, None)        # None: not all hits
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from . import interface, native

#: Slots in all, and slots a set: 131,072 chunks' entries (scenario 6 has 32,000 chunks).
SLOTS = 1 << 17
#: (a slot's layout is the compiled engine's too: csrc/stoker_native.h's ET_* columns, read by ``entry_hits``)
WAYS = interface.ET_WAYS
#: The key's columns: array number, file number, offset, length.
KEY_COLUMNS = interface.ET_KEY_COLS
#: A slot's row of integers (``EntryTable.rec``): its key, then these columns (``_UNTIL``: a float64's bits).
_STAMP, _TICKET, _PATH_LEN, _IDENT_LEN, _UNTIL = (interface.ET_STAMP, interface.ET_TICKET, interface.ET_PATH_LEN,
                                                  interface.ET_IDENT_LEN, interface.ET_UNTIL)
_REC_COLUMNS = interface.N_ET_COLS

# odd constants combining a key's columns (one matrix product, wrapping modulo 2**64)
_COMBINE = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93], np.uint64)
#: where a key's set is read from its hash: bits 32 and up, which every bit of every column below them moves
#: (the low bits of a sum of products are poor: bit 0 depends on the columns' bits 0 only)
_SET_SHIFT = np.uint64(32)


def _hash(keys: np.ndarray) -> np.ndarray:
    """Each key's 64-bit hash (uint64): one matrix product, what picks its set (its bits from 32 up) and what a
    slot is compared with first (the key itself is compared only in the slot whose hash matched). Distinct keys
    of a batch (small integers: an array's number, a file's, an offset and a length) share a hash only where a
    difference of theirs times the constants sums to 0 modulo 2**64: then the later one is not kept beside the
    first, a miss, never a wrong entry (the key is compared in full). One step, not a mixer's eight: a batch's
    look-up runs on the coordinator, whose every numpy step costs several microseconds in a busy pipeline."""
    return keys.view(np.uint64) @ _COMBINE


class EntryTable:
    """See the module docstring. Empty until the first :meth:`keep` (a pipeline without a disk cache
    allocates nothing)."""

    def __init__(self, slots: int | None = None) -> None:
        slots = SLOTS if slots is None else slots
        if slots < WAYS or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two of at least {WAYS}, not {slots}")
        self.slots = slots
        self._lock = threading.Lock()  # lock rank 4, a leaf (engine/pipeline/facade.py)
        self.keys: np.ndarray | None = None
        self.hash: Any = None  # (an array once kept into, as every column: typed Any, as they are)
        # a slot's integers in one row (key, stamp, ticket, path and ident lengths): a look-up gathers a row a
        # chunk in one step, rather than a step per column (keys, stamp... are views of its columns)
        self.rec: Any = None
        self.until = self.ticket = self.stamp = self.path_len = self.ident_len = None  # type: Any
        # each slot's entry (its path and ident joined, bytes; None: never kept): a list, which the compiled
        # look-up (hits) reads as it is
        self.entry: list = []
        # id(store) -> (the store, its stamp, its number): held, so that an id is not another store's meanwhile
        self._stamps: dict[int, tuple[Any, tuple, int]] = {}
        self._numbers = 0
        self.kept = 0  # entries kept (not dropped: a set full of live entries), for tests and reports

    def stamp_of(self, kv: Any) -> int | None:
        """``kv``'s stamp number now: a new one whenever its ``(changes, losses)`` moved on (None: a store that
        keeps no such counts, whose entries are never kept). Read before asking the store for entries, so a
        change after that is a new number and what was given under the old one is stale."""
        changes = getattr(kv, "changes", None)
        if changes is None:
            return None
        stamp = (changes, kv.losses)
        with self._lock:
            held = self._stamps.get(id(kv))
            if held is not None and held[0] is kv and held[1] == stamp:
                return held[2]
            self._numbers += 1
            if len(self._stamps) >= 4096:  # stores come and go with pipelines' arrays: their slots go stale
                self._stamps.clear()
            self._stamps[id(kv)] = (kv, stamp, self._numbers)
            return self._numbers

    def _live_numbers(self) -> np.ndarray:
        """Under the lock: the stamp numbers current now (a slot of any other is stale)."""
        return np.fromiter((held[2] for held in self._stamps.values()), np.int64, len(self._stamps))

    def _set_of(self, hashes: np.ndarray) -> np.ndarray:
        """The set each hash picks (intp), from its bits 32 and up (see :func:`_hash`)."""
        return ((hashes >> _SET_SHIFT) & np.uint64(self.slots // WAYS - 1)).astype(np.intp)

    def lookup(self, keys: np.ndarray, stamps: Any, settled: Any, now: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(slots, entries, lengths)``: the slot of each of ``keys`` (``(n, 4)`` int64) whose entry may be read
        now, else -1 (see :meth:`find`), and of every key (found or not: pick the found ones) the entry in its
        slot (its path and ident joined, ``bytes`` in an object array) and their lengths (``(n, 2)`` int64,
        path then ident), all read under one hold of the lock: an entry handed on is the one whose key, stamp,
        bound and ticket were checked, never one kept into the slot after the check (a slot expires, and another
        key takes it). A few numpy steps, whatever the number of keys."""
        n = len(keys)
        if self.keys is None or not n:
            return np.full(n, -1, np.int64), np.empty(n, object), np.zeros((n, 2), np.int64)
        h = _hash(keys)
        sets = self._set_of(h)
        entries = np.empty(n, object)
        with self._lock:
            # a key's slot, if any: the one of its hash in its set (a row of WAYS hashes), then checked; its
            # integers gathered in one step, and its entry, so the checks below read copies, after the lock
            slot = sets * WAYS + (self.hash.reshape(-1, WAYS)[sets] == h[:, None]).argmax(axis=1)
            got = self.rec.take(slot, axis=0)
            entries[:] = [self.entry[s] for s in slot.tolist()]
        # a key of array 0 (never kept) matches no slot: a slot whose key is of array 0 was never kept into, and
        # its "until" (0.0) is past; the key is refused here all the same (a step over a batch's keys, ~1 us:
        # what serves a wrong entry must not rest on one invariant of keep)
        ok = (got[:, :KEY_COLUMNS] == keys).all(axis=1) & (keys[:, 0] != 0) & (got[:, _STAMP] == stamps) & \
            (got[:, _UNTIL].view(np.float64) > now) & (got[:, _TICKET] <= settled)
        return np.where(ok, slot, -1), entries, got[:, _PATH_LEN:_IDENT_LEN + 1]

    def find(self, keys: np.ndarray, stamps: np.ndarray, settled: np.ndarray, now: float) -> np.ndarray:
        """The slot of each of ``keys`` (``(n, 4)`` int64) whose entry may be read now, else -1: the same key, kept
        under ``stamps`` (each key's store's number now: :meth:`stamp_of`), within its staleness bound at
        ``now`` and written (its ticket at most ``settled``, each key's disk cache's count). ``stamps`` and
        ``settled`` may each be one number, for keys all of one store. A few numpy steps."""
        return self.lookup(keys, stamps, settled, now)[0]

    def entries(self, slots: np.ndarray) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """The entries at ``slots`` (found by :meth:`find`): each as its path and ident joined, and their lengths."""
        if not len(slots):
            return [], np.zeros(0, np.int64), np.zeros(0, np.int64)
        with self._lock:
            got = self.rec.take(slots, axis=0)  # (take copies a strided view whole first: the whole rows)
            return [self.entry[s] for s in slots.tolist()], got[:, _PATH_LEN], got[:, _IDENT_LEN]

    def hits(self, files: np.ndarray, chunk_file: np.ndarray, chunk_offset: np.ndarray, chunk_length: np.ndarray,
             ids: np.ndarray | None, disk: np.ndarray, store_of: np.ndarray, stamps: Any, settled: Any,
             now: float) -> tuple[bytes, bytes] | None:
        """A batch's chunks ``ids`` (None: all) of a plan (its ``files`` and per-chunk columns) as the engine's
        entries rows and blob, ``(rows, blob)``, where every one is found as :meth:`lookup` finds it (the key
        :func:`..decode_native._entry_keys` makes, with ``disk``: an array's ``_Source.disk_row`` each; its
        store's ``stamps[store_of[array]]`` and ``settled[...]``, int64 buffers; now) and fits the engine's
        tables; else None (any miss: the caller's numpy steps sort them). One compiled call under the lock, in
        place of the ~50 numpy steps of keys, look-up and rows (each several microseconds on a busy coordinator):
        a second epoch's batch. None without the compiled engine, or before anything was kept.

        >>> table.hits(plan.files, plan.chunk_file, plan.chunk_offset, plan.chunk_length, None, disk,
        ...            np.zeros(len(disk), np.intp), array("q", [stamp]), array("q", [settled]), time.monotonic())
        """
        find = native.entry_hits
        if find is None or self.keys is None:
            return None
        with self._lock:
            return find(self.hash, self.rec, self.entry, files, chunk_file, chunk_offset, chunk_length, ids, disk,
                        store_of, stamps, settled, now)

    def keep(self, keys: np.ndarray, stamps: np.ndarray, untils: np.ndarray, tickets: np.ndarray,
             paths: Sequence[bytes], idents: Sequence[bytes], now: float) -> None:
        """Keep the entry ``paths[k]``, ``idents[k]`` of each of ``keys`` given under ``stamps``, good until
        ``untils`` and written at ``tickets`` (see the module docstring); in its set's slot of the same key, else
        an empty, expired or stale one; dropped where the set holds live entries only. A few numpy steps a
        round, a round for each key that shares its set with another of the call."""
        mine = (keys[:, 0] != 0) & (stamps != 0)  # an array numbered 0, a store of no stamp: never kept
        if not mine.all():
            chosen = np.flatnonzero(mine).tolist()
            keys, stamps, untils, tickets = keys[mine], stamps[mine], untils[mine], tickets[mine]
            paths, idents = [paths[k] for k in chosen], [idents[k] for k in chosen]
        n = len(keys)
        if not n:
            return
        blobs = np.empty(n, object)
        blobs[:] = [p + i for p, i in zip(paths, idents)]
        plens = np.fromiter(map(len, paths), np.int64, n)
        ilens = np.fromiter(map(len, idents), np.int64, n)
        hashes = _hash(keys)
        base = self._set_of(hashes).astype(np.int64) * WAYS
        ways = np.arange(WAYS)
        with self._lock:
            if self.keys is None:
                self.rec = np.zeros((self.slots, _REC_COLUMNS), np.int64)
                self.keys = self.rec[:, :KEY_COLUMNS]
                self.stamp, self.ticket = self.rec[:, _STAMP], self.rec[:, _TICKET]
                self.path_len, self.ident_len = self.rec[:, _PATH_LEN], self.rec[:, _IDENT_LEN]
                self.hash = np.zeros(self.slots, np.uint64)
                self.until = self.rec[:, _UNTIL].view(np.float64)  # (0.0: every bit 0)
                self.entry = [None] * self.slots
            live = self._live_numbers()
            todo = np.arange(n)
            while len(todo):
                # one key a set this round (the first of the call's keys in each), the rest in the next rounds
                _, first = np.unique(base[todo], return_index=True)
                take = todo[first]
                cand = base[take][:, None] + ways
                same = (self.hash[cand] == hashes[take][:, None]) & (self.keys[cand] == keys[take][:, None, :]).all(axis=2)
                free = (self.until[cand] <= now) | ~np.isin(self.stamp[cand], live)
                # the same key's slot first, then a free one (the least "until" of them); none: dropped
                score = np.where(same, -2.0, np.where(free, -1.0, np.inf))
                way = score.argmin(axis=1)
                got = np.isfinite(score[np.arange(len(take)), way])
                slot, take = cand[np.arange(len(take)), way][got], take[got]
                self.keys[slot] = keys[take]
                self.hash[slot] = hashes[take]
                self.until[slot] = untils[take]
                self.ticket[slot] = tickets[take]
                self.stamp[slot] = stamps[take]
                self.path_len[slot] = plens[take]
                self.ident_len[slot] = ilens[take]
                for at, blob in zip(slot.tolist(), blobs[take].tolist()):
                    self.entry[at] = blob
                self.kept += len(take)
                todo = np.delete(todo, first)

    def __len__(self) -> int:
        """The slots that hold an entry (live or not)."""
        return 0 if self.keys is None else int((self.keys[:, 0] != 0).sum())


__all__ = ["EntryTable", "SLOTS", "WAYS"]
