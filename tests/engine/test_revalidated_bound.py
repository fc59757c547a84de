"""A pipeline's record of chunks known fresh (prefetch.Revalidated) is bounded in memory in all, not per
array (1024 arrays x 16,384 chunks was ~4.4 GiB), and does not keep the readers it was told about alive."""

from __future__ import annotations

import gc
import time
import tracemalloc
import weakref

import numpy as np
import pytest
import zarr

import stoker
from stoker.engine.pipeline.prefetch import REVALIDATED_CHUNKS, REVALIDATED_ENTRIES, Revalidated

pytestmark = pytest.mark.timeout(120)


def _readers(tmp_path, n):
    out = []
    for a in range(n):
        uri = str(tmp_path / f"a{a}.zarr")
        zarr.create_array(uri, shape=(8, 8), chunks=(4, 4), dtype="u1")[:] = np.arange(64, dtype="u1").reshape(8, 8)
        out.append(stoker.open_array(uri))
    return out


def test_the_chunks_kept_are_bounded_in_all(tmp_path):
    readers = _readers(tmp_path, 8)
    asked = Revalidated()
    tracemalloc.start()
    try:
        for a, reader in enumerate(readers):  # 8 arrays of a chunk bound each: 131,072 chunks asked about
            chunks = asked.of(reader)
            for i in range(REVALIDATED_CHUNKS):
                index = (i // 1024, (i // 32) % 32, i % 32)
                asked.keep(chunks, index, [f"bucket/volumes/vol{a:05d}.zarr/0/c/{index[0]}/{index[1]}/{index[2]}",
                                           time.monotonic()])
                assert len(asked) <= REVALIDATED_ENTRIES
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0 < len(asked) <= REVALIDATED_ENTRIES
    assert used < 40 * 2**20, f"{used / 2**20:.1f} MiB kept"  # ~18 MiB at the bound


def test_a_reader_dropped_is_not_kept_alive_and_its_chunks_go_with_it(tmp_path):
    reader, other = _readers(tmp_path, 2)
    asked = Revalidated()
    for r in (reader, other):
        chunks = asked.of(r)
        for i in range(100):
            asked.keep(chunks, (i, 0), [f"k{i}", 0.0])
    assert len(asked) == 200
    ref = weakref.ref(reader)
    del reader, chunks
    gc.collect()
    assert ref() is None  # the pipeline evicted it: not held here
    assert len(asked) == 100 and len(asked.of(other)) == 100


def test_past_the_bound_the_arrays_asked_about_first_are_forgotten_first(tmp_path):
    """Past REVALIDATED_ENTRIES chunks in all, whole arrays are forgotten, those first asked about first, until a
    quarter of the bound is free: the array being asked about keeps every chunk it was told of, and so do the
    latest others (before, every array's chunks were forgotten at once, and all asked about again)."""
    per = REVALIDATED_CHUNKS
    readers = _readers(tmp_path, REVALIDATED_ENTRIES // per + 3)
    asked = Revalidated()
    for a, reader in enumerate(readers):
        chunks = asked.of(reader)
        for i in range(per):
            asked.keep(chunks, (i, a), [f"k{a}/{i}", 0.0])
            assert len(chunks) == i + 1  # the array being asked about loses nothing
            assert len(asked) <= REVALIDATED_ENTRIES
        if a:
            assert len(asked.of(readers[a - 1])) == per  # nor the one asked about just before
    kept = [len(asked.of(r)) for r in readers]
    assert sum(kept) > REVALIDATED_ENTRIES // 2  # forgotten gradually, not all at once
    first_kept = next(a for a, n in enumerate(kept) if n)
    assert all(n == 0 for n in kept[:first_kept]) and all(n == per for n in kept[first_kept:])
