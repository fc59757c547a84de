"""A decoder's memos of the disk-cache entries its stores gave (decode_native._EntryMemos) are bounded in entries
in all its arrays, not per array (65,536 an array before, ~34 MiB each, for up to SHARED_SOURCES arrays a
pipeline: 100 arrays were 3.3 GiB), and an array with more cached chunks than the bound keeps what it holds
rather than forgetting it all whenever full (read in the same order each epoch, that gave no hit at all)."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.engine.cpu import decode_native, native
from stoker.engine.cpu.decode_native import _EntryMemos, _Source

pytestmark = pytest.mark.timeout(120)


def _sources(tmp_path, n: int) -> list[_Source]:
    """``n`` arrays as the engine describes them (each with its own, empty, memo of entries)."""
    out = []
    for a in range(n):
        uri = str(tmp_path / f"a{a}.zarr")
        zarr.create_array(uri, shape=(8, 8), chunks=(4, 4), dtype="u1")[:] = np.arange(64, dtype="u1").reshape(8, 8)
        out.append(_Source(stoker.open_array(uri), torch.float32, native.KIND_F32, 1 << 20))
    return out


def _entry(a: int, i: int) -> tuple[tuple, tuple]:
    """A memo's key and value for chunk ``i`` of array ``a``, shaped as NativeDecoder._memorize keeps them: grid
    coordinates, offset and length; a CachingStore entry's (path, ident), and until when it holds."""
    x, y, z = i // 4096, (i // 64) % 64, i % 64
    offset, length = 16384 + i * 65536, 65536
    ident = (f"s3://bucket/datasets/vol{a:04d}.zarr\nvol{a:04d}.zarr/s0/c/{x}/{y}/{z}\n{offset}\n{length}\n"
             '"0123456789abcdef0123456789abcdef"')
    path = f"/home/user/.cache/stoker/v3/{i % 256:02x}/{a:08x}{i:032x}".encode()
    return (x, y, z, offset, length), ((path, ident.encode()), time.monotonic() + 600.0)


def _held(sources: list[_Source]) -> int:
    return sum(len(s.entries) for s in sources)


def test_the_entries_kept_are_bounded_in_all_arrays(tmp_path):
    sources = _sources(tmp_path, 8)
    memos = _EntryMemos()
    per = decode_native.ENTRY_MEMOS // 2  # 8 arrays of half the bound each: 262,144 entries given
    tracemalloc.start()
    try:
        for a, source in enumerate(sources):
            for i in range(per):
                assert memos.keep(source, *_entry(a, i))  # one array, under the bound: every entry kept
                if i % 1024 == 0:
                    assert _held(sources) <= decode_native.ENTRY_MEMOS
            assert len(source.entries) == per  # the array being kept into loses nothing
            assert _held(sources) <= decode_native.ENTRY_MEMOS
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert _held(sources) > decode_native.ENTRY_MEMOS // 2  # forgotten in part, not all at once
    assert used < 48 * 2**20, f"{used / 2**20:.1f} MiB kept"  # ~34 MiB at the bound (134 MiB before)


def test_past_the_bound_the_arrays_started_first_are_forgotten_first(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_native, "ENTRY_MEMOS", 64)
    per = 16
    sources = _sources(tmp_path, 7)
    memos = _EntryMemos()
    for a, source in enumerate(sources):
        for i in range(per):
            assert memos.keep(source, *_entry(a, i))
            assert len(source.entries) == i + 1 and _held(sources) <= 64
        if a:
            assert len(sources[a - 1].entries) == per  # nor the one kept into just before
    kept = [len(s.entries) for s in sources]
    assert kept == [0, 0, 0, per, per, per, per], kept  # the first started went first, whole
    # a memo emptied (its store's stamp moved on) and started again is the newest: the others go before it
    sources[3].entries = {}
    for i in range(per):
        assert memos.keep(sources[3], *_entry(3, i))
    for i in range(per):
        assert memos.keep(sources[0], *_entry(0, i))
    assert [len(s.entries) for s in sources] == [per, 0, 0, per, 0, per, per]


def test_an_array_past_the_bound_keeps_what_it_holds(tmp_path, monkeypatch):
    # more chunks than the bound, read in the same order each epoch (as _from_memo, then _memorize): the chunks
    # held are hits every epoch (emptied whenever full, none were), and the rest are not taken
    monkeypatch.setattr(decode_native, "ENTRY_MEMOS", 64)
    source, other = _sources(tmp_path, 2)
    memos = _EntryMemos()
    n = 64 + 1
    for epoch in range(3):
        hits = 0
        for i in range(n):
            key, value = _entry(0, i)
            if key in source.entries:
                hits += 1
            else:
                assert memos.keep(source, key, value) == (i < 64)
        assert hits == (0 if epoch == 0 else 64), (epoch, hits)
        assert len(source.entries) == 64 and source.entries_full
    key, value = _entry(0, 3)  # a generation learnt anew: kept in its place, though full
    assert memos.keep(source, key, value) and source.entries[key] is value
    del source.entries[key]  # an entry past its staleness bound, dropped (_from_memo): room for one again
    source.entries_full = False
    assert memos.keep(source, *_entry(0, 64)) and not memos.keep(source, *_entry(0, 65))
    # another array kept into: the full one, started first, is forgotten (it takes new chunks again)
    assert memos.keep(other, *_entry(1, 0))
    assert len(source.entries) == 0 and not source.entries_full and len(other.entries) == 1


class _Memoed:
    """The three fields of a ``_Source`` that ``_EntryMemos`` touches (a real one opens an array: 100,000 here)."""

    def __init__(self) -> None:
        self.entries: dict = {}
        self.entries_full = False


def test_arrays_whose_memo_was_emptied_are_let_go(tmp_path):
    memos = _EntryMemos()
    for a in range(100_000):
        source = _Memoed()
        assert memos.keep(source, *_entry(a % 8, 0))
        source.entries = {}  # what NativeDecoder._memo_of does when the store's stamp moves on
        assert len(memos.arrays) <= 128  # held, each would keep its array and store alive (100,000 before)
    kept = [_Memoed() for _ in range(200)]  # arrays whose memos hold entries stay, however many
    for a, source in enumerate(kept):
        assert memos.keep(source, *_entry(a % 8, 0))
    assert all(memos.arrays.get(id(s)) is s for s in kept)
    assert len(memos.arrays) <= 2 * len(kept)


def test_keep_many_keeps_what_keep_would_one_at_a_time(monkeypatch):
    # _memorize fills each array's memo in one step (keep_many): the same entries kept as one keep each, the
    # bound honoured (a step where there is room for all, else one keep each), full arrays left full
    monkeypatch.setattr(decode_native, "ENTRY_MEMOS", 64)
    one, many = _EntryMemos(), _EntryMemos()
    ones, manys = [_Memoed() for _ in range(7)], [_Memoed() for _ in range(7)]
    for a in range(7):
        items = [_entry(a, i) for i in range(24 if a == 5 else 16)]
        for key, value in items:
            one.keep(ones[a], key, value)
        many.keep_many(manys[a], items)
        assert [set(s.entries) for s in manys] == [set(s.entries) for s in ones], a
        assert [s.entries_full for s in manys] == [s.entries_full for s in ones]
        assert sum(len(s.entries) for s in manys) <= 64 and many.count >= sum(len(s.entries) for s in manys)
    assert any(not s.entries for s in manys) and any(s.entries for s in manys)  # past the bound: forgotten in part
    source = manys[6]
    again = [(key, (None, 0.0)) for key in list(source.entries)[:3]]  # generations learnt anew: replaced in place
    count = many.count
    many.keep_many(source, again)
    assert many.count == count and all(source.entries[key] == value for key, value in again)
