"""A decoder's table of disk-cache entries (engine/cpu/entry_table.py): a batch's chunks found in bulk, and only
where the entry may be read now (the same key, its store's stamp unchanged, within the staleness bound,
written); bounded in slots, a set full of live entries keeping them (read in the same order each epoch, the
chunks kept are hits every epoch); a key kept again takes its own slot, never a second one."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.engine.cpu import entry_table
from stoker.engine.cpu.entry_table import WAYS, EntryTable

pytestmark = pytest.mark.timeout(60)

NOW = 1000.0


def _keys(uid: int, files, offset: int = -1, length: int = -1) -> np.ndarray:
    """Keys of the files ``files`` of array ``uid`` (whole, or one range each)."""
    files = np.asarray(files, np.int64)
    return np.stack([np.full(len(files), uid), files, np.full(len(files), offset), np.full(len(files), length)],
                    axis=1).astype(np.int64)


def _keep(table: EntryTable, keys: np.ndarray, stamp: int = 1, until: float = NOW + 60, ticket: int = 0,
          now: float = NOW) -> None:
    n = len(keys)
    table.keep(keys, np.full(n, stamp, np.int64), np.full(n, until), np.full(n, ticket, np.int64),
               [f"/cache/{k[0]}/{k[1]}/{k[2]}".encode() for k in keys.tolist()],
               [f"id {k[0]} {k[1]} {k[2]} {k[3]}".encode() for k in keys.tolist()], now)


def _find(table: EntryTable, keys: np.ndarray, stamp: int = 1, settled: int = 0, now: float = NOW) -> np.ndarray:
    n = len(keys)
    return table.find(keys, np.full(n, stamp, np.int64), np.full(n, settled, np.int64), now)


class _Store:
    """What stamp_of reads of a store: its counts of changes and losses."""

    def __init__(self) -> None:
        self.changes = self.losses = 0


def test_a_batch_of_entries_is_found_with_its_own_bytes():
    table = EntryTable()
    store = _Store()
    stamp = table.stamp_of(store)
    whole, ranged = _keys(3, range(100)), _keys(3, [7, 7, 8], 4096, 512)
    ranged[1, 2] = 8192  # two ranges of file 7
    _keep(table, np.concatenate([whole, ranged]), stamp)
    asked = np.concatenate([ranged, whole[::-1], _keys(4, [1, 2]), _keys(3, [7], 0, 512)])
    slots = _find(table, asked, stamp)
    assert (slots[:103] >= 0).all() and (slots[103:] == -1).all()  # another array, another range: not found
    assert len(set(slots[:103].tolist())) == 103
    blobs, plens, ilens = table.entries(slots[:103])
    for key, blob, plen, ilen in zip(asked[:103].tolist(), blobs, plens.tolist(), ilens.tolist()):
        assert blob[:plen] == f"/cache/{key[0]}/{key[1]}/{key[2]}".encode()
        assert blob[plen:] == f"id {key[0]} {key[1]} {key[2]} {key[3]}".encode() and len(blob) == plen + ilen


def test_an_entry_is_found_only_while_it_may_be_read():
    table = EntryTable()
    store = _Store()
    stamp = table.stamp_of(store)
    assert table.stamp_of(store) == stamp  # unchanged counts: the same number
    keys = _keys(1, range(4))
    _keep(table, keys[:2], stamp, ticket=0)
    _keep(table, keys[2:], stamp, ticket=5)  # queued for writing when kept (a fetch's): on disk once settled
    assert (_find(table, keys, stamp, settled=4) >= 0).tolist() == [True, True, False, False]
    assert (_find(table, keys, stamp, settled=5) >= 0).all()
    assert (_find(table, keys, stamp, settled=5, now=NOW + 60) == -1).all()  # past the staleness bound
    for count in ("changes", "losses"):  # a generation replaced or forgotten; entries lost
        setattr(store, count, getattr(store, count) + 1)
        new = table.stamp_of(store)
        assert new != stamp
        assert (_find(table, keys, new, settled=5) == -1).all()
        stamp = new
    assert table.stamp_of(object()) is None  # a store that keeps no such counts


def test_an_array_numbered_0_or_a_store_stamped_0_is_never_kept():
    table, stamp, _ = _stamped()
    _keep(table, _keys(0, range(4)), stamp)
    _keep(table, _keys(1, range(4)), 0)
    assert len(table) == 0 and table.kept == 0
    assert (_find(table, _keys(0, range(4)), stamp) == -1).all()


def test_a_key_of_array_0_is_never_found_not_even_in_a_slot_never_kept_into():
    # a slot never kept into holds the key (0, 0, 0, 0), whose hash is 0, as the slot's is: asked for that key
    # (and any other of array 0) under a store stamped 0, it is still not found (its "until" is long past)
    table, stamp, _ = _stamped()
    _keep(table, _keys(1, range(4)), stamp)
    zero = np.zeros((1, 4), np.int64)
    assert (entry_table._hash(zero) == 0).all() and (table.hash == 0).sum() > 0
    for s in (0, stamp):
        assert (_find(table, zero, s, settled=10 ** 9) == -1).all()
        assert (_find(table, _keys(0, range(4)), s, settled=10 ** 9) == -1).all()
    assert (_find(table, _keys(1, range(4)), stamp) >= 0).all()


def _stamped() -> tuple[EntryTable, int, _Store]:
    """A table, and the stamp number of a store it knows (a slot of a number it does not know is stale)."""
    table, store = EntryTable(), _Store()
    return table, table.stamp_of(store), store


def test_a_key_kept_again_takes_its_own_slot(monkeypatch):
    monkeypatch.setattr(entry_table, "SLOTS", WAYS)  # one set
    table, stamp, _ = _stamped()
    keys = _keys(1, range(WAYS))
    _keep(table, keys, stamp, until=NOW + 10)
    _keep(table, np.concatenate([keys, keys]), stamp, until=NOW + 60)  # twice in one call: rounds, the same slot
    assert len(table) == WAYS
    assert (_find(table, keys, stamp, now=NOW + 30) >= 0).all()  # the newer bound


def test_a_full_set_keeps_its_live_entries_and_drops_newcomers(monkeypatch):
    monkeypatch.setattr(entry_table, "SLOTS", WAYS)  # one set: 12 chunks, 8 slots
    table, stamp, store = _stamped()
    keys = _keys(1, range(12))
    for _ in range(3):  # read in the same order each epoch: the first 8 found every time
        found = _find(table, keys, stamp) >= 0
        assert found.sum() in (0, WAYS)
        _keep(table, keys[~found], stamp)
        assert (_find(table, keys, stamp) >= 0).tolist() == [True] * WAYS + [False] * 4
    # expired, a slot is free again: a newcomer takes it
    _keep(table, keys[WAYS:], stamp, until=NOW + 120)
    assert not (_find(table, keys[WAYS:], stamp) >= 0).any()
    _keep(table, keys[WAYS:], stamp, until=NOW + 120, now=NOW + 61)
    assert (_find(table, keys[WAYS:], stamp, now=NOW + 61) >= 0).all()
    # of a stamp no longer current (its store's entries stale), a slot is free again too
    store.losses += 1
    stamp = table.stamp_of(store)
    _keep(table, keys[:WAYS], stamp, until=NOW + 120, now=NOW + 61)
    assert (_find(table, keys[:WAYS], stamp, now=NOW + 61) >= 0).all()


def test_the_table_is_bounded_in_slots(monkeypatch):
    monkeypatch.setattr(entry_table, "SLOTS", 1 << 10)
    table, stamp, _ = _stamped()
    for uid in range(1, 21):  # 20 arrays of 1,000 chunks: 20 x the slots
        # each array's kept once the one before it expired
        _keep(table, _keys(uid, range(1000)), stamp, until=NOW + uid, now=NOW + uid - 1)
        assert len(table) <= 1 << 10
    # the newest array, kept last into sets the others' expired entries freed, is the one mostly found
    found = (_find(table, _keys(20, range(1000)), stamp, now=NOW + 19.5) >= 0).mean()
    assert found > 0.5, found


def test_a_key_kept_again_is_found_with_its_new_entry_and_stamp_only():
    """A slot's integers (key, stamp, ticket, lengths) are gathered in one step and checked after the lock: what
    a look-up returns is the entry last kept for the key, with that entry's own lengths, under its own stamp
    (a store whose counts moved on gives the slot a new number; the old one no longer finds it)."""
    table, stamp, store = _stamped()
    keys = _keys(5, range(3))
    _keep(table, keys, stamp, ticket=2)
    store.changes += 1  # an object rewritten: its entry is kept again under the store's new number
    new = table.stamp_of(store)
    table.keep(keys[1:2], np.full(1, new, np.int64), np.full(1, NOW + 60), np.zeros(1, np.int64),
               [b"/cache/a/much/longer/path/of/the/new/entry"], [b"new ident"], NOW)
    assert (_find(table, keys, stamp, settled=2) >= 0).tolist() == [True, False, True]
    slots = _find(table, keys, new, settled=0)
    assert (slots >= 0).tolist() == [False, True, False]  # the others: under the old number only (and unsettled)
    blobs, plens, ilens = table.entries(slots[1:2])
    assert blobs == [b"/cache/a/much/longer/path/of/the/new/entry" + b"new ident"]
    assert (plens.tolist(), ilens.tolist()) == ([len(b"/cache/a/much/longer/path/of/the/new/entry")], [9])


def test_a_look_up_hands_on_the_entries_it_checked_whatever_is_kept_after(monkeypatch):
    """lookup reads a slot's key, stamp, bound and ticket and its entry under one hold of the lock: the entry it
    hands on is the one checked, even when the slot expires right after and another key takes it (find, then
    entries, read the slot twice: the second read would hand on the newcomer's entry for the chunk found)."""
    monkeypatch.setattr(entry_table, "SLOTS", WAYS)  # one set: a newcomer can only take a slot of the first keys
    table, stamp, _ = _stamped()
    keys = _keys(1, range(WAYS))
    _keep(table, keys, stamp, until=NOW + 1)
    slots, blobs, lens = table.lookup(keys, stamp, 0, NOW)
    assert (slots >= 0).all()
    _keep(table, _keys(2, range(WAYS)), stamp, until=NOW + 60, now=NOW + 2)  # every slot expired: all retaken
    assert (_find(table, keys, stamp, now=NOW) == -1).all()
    for key, blob, (plen, ilen) in zip(keys.tolist(), blobs.tolist(), lens.tolist()):
        assert blob[:plen] == f"/cache/{key[0]}/{key[1]}/{key[2]}".encode()
        assert blob[plen:] == f"id {key[0]} {key[1]} {key[2]} {key[3]}".encode() and len(blob) == plen + ilen


def test_a_second_epoch_of_many_small_arrays_finds_every_chunk_kept():
    """Scenario 6's chunks (1,000 arrays of 32 files each, 32,000 keys in 131,072 slots) are all kept and all
    found: a key dropped because its set was full is asked of its store every batch, a step per chunk."""
    table, stamp, _ = _stamped()
    keys = np.concatenate([_keys(uid, range(32)) for uid in range(1, 1001)])
    _keep(table, keys, stamp)
    assert table.kept == len(keys)
    assert (_find(table, keys, stamp) >= 0).all()
