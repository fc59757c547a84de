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
