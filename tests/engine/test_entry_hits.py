"""A second epoch's batch found in a decoder's table of entries by one compiled call (EntryTable.hits, csrc's
entry_hits): for every batch it hands on exactly what the numpy steps of NativeDecoder._from_disk make
(_entry_keys, EntryTable.lookup, the engine's entries rows and blob), and None wherever any chunk is not a hit
that may be read now (never kept, another key in its slot, a stale stamp, past its bound, not yet written, an
array not read from entries or numbered 0, a file outside its grid, an entry too long for the engine's
tables); malformed arguments are refused, never read past."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import numpy as np
import pytest

from stoker.engine.cpu import entry_table, native
from stoker.engine.cpu.decode_native import DISK_GRID, DISK_ROOM, DISK_UID, _entry_keys
from stoker.engine.cpu.entry_table import EntryTable

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(native.entry_hits is None, reason="no compiled engine")]

NOW = 1000.0
RANK = 2


def _world(rng: random.Random, n_sources: int = 3, n_files: int = 12, n_chunks: int = 20):
    """A plan of ``n_chunks`` chunks in ``n_files`` files of ``n_sources`` arrays (each of a grid of files and an
    array number), and each array's disk row and store."""
    grids = [[rng.randint(1, 5) for _ in range(RANK)] for _ in range(n_sources)]
    disk = np.zeros((n_sources, DISK_GRID + 2 * RANK), np.int64)
    for s, grid in enumerate(grids):
        disk[s, DISK_ROOM], disk[s, DISK_UID] = 1, 10 + s
        disk[s, DISK_GRID:DISK_GRID + RANK] = grid
        disk[s, DISK_GRID + RANK:] = [int(np.prod(grid[a + 1:])) for a in range(RANK)]
    files = np.zeros((n_files, native.F_COORDS + RANK), np.int64)
    for f in range(n_files):
        s = rng.randrange(n_sources)
        files[f, native.F_SOURCE] = s
        files[f, native.F_COORDS:] = [rng.randrange(g) for g in grids[s]]
    chunk_file = np.array([rng.randrange(n_files) for _ in range(n_chunks)], np.int64)
    ranged = np.array([rng.random() < 0.3 for _ in range(n_chunks)])
    # the plan's columns as views of one wider table (strided), as a plan may hold them
    table = np.zeros((n_chunks, 3), np.int64)
    table[:, 0] = chunk_file
    table[:, 1] = np.where(ranged, np.arange(n_chunks) * 4096, -1)
    table[:, 2] = np.where(ranged, 512, -1)
    plan = SimpleNamespace(files=files, chunk_file=table[:, 0], chunk_offset=table[:, 1], chunk_length=table[:, 2],
                           n_chunks=n_chunks)
    store_of = np.array([s % 2 for s in range(n_sources)], np.intp)
    return plan, disk, store_of


def _expected(table: EntryTable, plan, disk, store_of, ids, stamps, settled, now):
    """What _from_disk's numpy steps make of the chunks ``ids`` (None: all): (rows, blob), or None."""
    every = ids is None
    asked = np.arange(plan.n_chunks) if every else ids
    keys = _entry_keys(plan, asked, SimpleNamespace(disk=disk), every=every)
    if not (disk[plan.files[plan.chunk_file[asked], native.F_SOURCE], DISK_ROOM] != 0).all():
        return None
    owner = store_of[plan.files[plan.chunk_file[asked], native.F_SOURCE]]
    slots, blobs, lens = table.lookup(keys, np.array(stamps, np.int64)[owner], np.array(settled, np.int64)[owner], now)
    if not (slots >= 0).all() or (lens[:, 0] >= native.PATH_CAP).any() or (lens[:, 1] > native.ENTRY_IDENT_CAP).any():
        return None
    flat = lens.reshape(-1)
    starts = np.cumsum(flat) - flat
    rows = np.empty((len(asked), native.N_ENTRY_COLS), np.int64)
    rows[:, native.E_PATH_START] = starts[0::2]
    rows[:, native.E_PATH_LEN] = lens[:, 0]
    rows[:, native.E_IDENT_START] = starts[1::2]
    rows[:, native.E_IDENT_LEN] = lens[:, 1]
    return rows.tobytes(), b"".join(blobs)


def _hits(table: EntryTable, plan, disk, store_of, ids, stamps, settled, now):
    return table.hits(plan.files, plan.chunk_file, plan.chunk_offset, plan.chunk_length, ids, disk, store_of,
                      array("q", stamps), array("q", settled), now)


def _kept(table: EntryTable, plan, disk, store_of, stamps, rng: random.Random, long_path: bool = False) -> None:
    """Every chunk's entry kept (under its store's stamp, written, good for a minute), with paths and idents of
    several lengths."""
    keys = _entry_keys(plan, np.arange(plan.n_chunks), SimpleNamespace(disk=disk), every=True)
    owner = store_of[plan.files[plan.chunk_file, native.F_SOURCE]]
    n = len(keys)
    paths = [f"/cache/{k[0]}/{k[1]}/{k[2]}".encode() + b"p" * rng.randrange(40) for k in keys.tolist()]
    if long_path:
        chosen = keys[rng.randrange(n)]
        for k in np.flatnonzero((keys == chosen).all(axis=1)).tolist():  # (a key kept twice keeps its last entry)
            paths[k] = b"/" + b"d" * native.PATH_CAP
    idents = [f"id {k}".encode() + b"i" * rng.randrange(40) for k in keys.tolist()]
    table.keep(keys, np.array(stamps, np.int64)[owner], np.full(n, NOW + 60), np.zeros(n, np.int64), paths, idents,
               NOW)


def test_a_batch_all_kept_is_handed_on_as_the_numpy_steps_make_it():
    rng = random.Random(1)
    for _ in range(20):
        table = EntryTable()
        plan, disk, store_of = _world(rng)
        stamps, settled = [3, 4], [0, 0]
        _kept(table, plan, disk, store_of, stamps, rng)
        want = _expected(table, plan, disk, store_of, None, stamps, settled, NOW)
        assert want is not None  # (a chunk repeated in the plan is the same key: one slot, found twice)
        assert _hits(table, plan, disk, store_of, None, stamps, settled, NOW) == want
        ids = np.array(sorted(rng.sample(range(plan.n_chunks), 7)), np.int64)
        assert _hits(table, plan, disk, store_of, ids, stamps, settled, NOW) == \
            _expected(table, plan, disk, store_of, ids, stamps, settled, NOW)


def _spoiled(rng: random.Random, how: str):
    """A table and a plan where the chunk ``c`` (or its store, or its array) is spoiled ``how``; and the
    arguments of the look-up."""
    table = EntryTable()
    plan, disk, store_of = _world(rng)
    stamps, settled, now = [3, 4], [0, 0], NOW
    _kept(table, plan, disk, store_of, stamps, rng, long_path=how == "long path")
    c = rng.randrange(plan.n_chunks)
    s = int(plan.files[plan.chunk_file[c], native.F_SOURCE])
    if how == "stale stamp":
        stamps[store_of[s]] += 1
    elif how == "past its bound":
        now = NOW + 60
    elif how == "not written":
        keys = _entry_keys(plan, np.array([c]), SimpleNamespace(disk=disk))
        table.keep(keys, np.array([stamps[store_of[s]]], np.int64), np.full(1, NOW + 60), np.full(1, 5, np.int64),
                   [b"/cache/queued"], [b"id queued"], NOW)
        settled[store_of[s]] = 4
    elif how == "never kept":
        plan.chunk_offset[c], plan.chunk_length[c] = 7, 9  # another range of its file
    elif how == "array not read from entries":
        disk[s, DISK_ROOM] = 0
    elif how == "array numbered 0":
        disk[s, DISK_UID] = 0
    elif how == "outside its grid":
        plan.files[plan.chunk_file[c], native.F_COORDS] = -1
    elif how == "not stored":
        plan.chunk_file[c] = -1
    elif how == "another key in its slot":
        keys = _entry_keys(plan, np.array([c]), SimpleNamespace(disk=disk))
        slot = int(table.find(keys, np.array([stamps[store_of[s]]]), np.zeros(1, np.int64), NOW)[0])
        table.rec[slot, entry_table.KEY_COLUMNS - 1] += 1  # its key's length changed, its hash not
    return table, plan, disk, store_of, stamps, settled, now


@pytest.mark.parametrize("how", ["stale stamp", "past its bound", "not written", "never kept",
                                 "array not read from entries", "array numbered 0", "outside its grid", "not stored",
                                 "another key in its slot", "long path"])
def test_any_chunk_not_a_hit_now_hands_on_nothing(how):
    rng = random.Random(how)
    for _ in range(10):
        table, plan, disk, store_of, stamps, settled, now = _spoiled(rng, how)
        assert _hits(table, plan, disk, store_of, None, stamps, settled, now) is None
        if how != "not stored":  # (the numpy steps take only stored chunks)
            assert _expected(table, plan, disk, store_of, None, stamps, settled, now) is None


def test_malformed_arguments_are_refused():
    rng = random.Random(2)
    table = EntryTable()
    plan, disk, store_of = _world(rng)
    stamps, settled = [3, 4], [0, 0]
    _kept(table, plan, disk, store_of, stamps, rng)
    find = native.entry_hits
    args = [table.hash, table.rec, table.entry, plan.files, plan.chunk_file, plan.chunk_offset, plan.chunk_length,
            None, disk, store_of, array("q", stamps), array("q", settled), NOW]

    def refused(at: int, value) -> None:
        bad = list(args)
        bad[at] = value
        with pytest.raises((ValueError, TypeError)):
            find(*bad)

    refused(7, np.array([plan.n_chunks], np.int64))  # a chunk past the plan's
    refused(7, np.array([-1], np.int64))
    refused(0, table.hash[:-8])  # the table's parts disagree
    refused(1, table.rec[:-1])
    refused(2, table.entry[:-1])
    refused(2, tuple(table.entry))
    refused(3, plan.files[:, :-1])  # another rank than the disk rows'
    refused(3, plan.files.ravel())
    refused(5, plan.chunk_offset[:-1])  # columns of other lengths
    refused(5, plan.chunk_offset.astype(np.int32))
    refused(5, np.broadcast_to(np.int64(-1), plan.n_chunks))  # elements sharing memory
    refused(8, disk[:-1])  # fewer disk rows than arrays' stores
    refused(9, np.full(len(disk), 2, np.intp))  # a store past the stores
    refused(10, array("q", [3]))  # stamps and settled of other lengths
    files = plan.files.copy()
    files[plan.chunk_file[0], native.F_SOURCE] = len(disk)  # an array past the disk rows
    refused(3, files)
    chunk_file = plan.chunk_file.copy()
    chunk_file[0] = len(plan.files)  # a file past the plan's
    refused(4, chunk_file)
    assert find(*args) is not None
