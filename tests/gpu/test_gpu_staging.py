"""The GPU decode's staging reads: the read threads (ReadPool) and several ranges of one file read with one
identity check (LocalStore.read_ranges_into)."""

from __future__ import annotations

import os
import threading

import pytest

from stoker.engine.gpu.staging import ReadPool
from stoker.errors import ShutdownError
from stoker.storage import FileChanged
from stoker.storage.local import LocalStore

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_the_read_threads_give_every_result_in_order(threads):
    pool = ReadPool(threads)
    seen = set()
    try:
        for n in (0, 1, 3, 17):
            assert pool.map(lambda x: (seen.add(threading.get_ident()), x * x)[1], list(range(n))) == \
                [x * x for x in range(n)]
    finally:
        pool.close()
    assert len(seen) <= threads


def test_a_read_that_fails_fails_the_map_once_every_slice_is_done():
    pool = ReadPool(3)
    done = []

    def read(x):
        if x == 4:
            raise OSError("disk gone")
        done.append(x)
        return x

    try:
        with pytest.raises(OSError, match="disk gone"):
            pool.map(read, list(range(9)))
    finally:
        pool.close()
    assert 4 not in done and {0, 1, 2, 3, 6, 7, 8} <= set(done)  # the other slices ran to their end


def test_close_ends_a_wait_for_a_blocked_read():
    pool = ReadPool(2)
    release = threading.Event()

    def read(x):
        if x == 0:  # the pool thread's slice blocks; the caller's slice returns at once
            release.wait(20.0)
        return x

    closer = threading.Timer(0.3, pool.close)
    closer.start()
    try:
        with pytest.raises(ShutdownError, match="closed while chunks were being read"):
            pool.map(read, [0, 1])
    finally:
        release.set()
        closer.cancel()


def test_ranges_of_one_file_are_read_with_one_identity_check(tmp_path, monkeypatch):
    path = tmp_path / "shard"
    path.write_bytes(bytes(range(256)) * 4)
    store = LocalStore()
    _, ident = store.read_current(str(path), lambda size: (0, 1))  # as a shard's index is read
    bufs = [bytearray(3), bytearray(5), bytearray(2)]
    stats = []
    real_stat, real_fstat = os.stat, os.fstat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (stats.append(p), real_stat(p, *a, **k))[1])
    monkeypatch.setattr(os, "fstat", lambda fd: (stats.append(fd), real_fstat(fd))[1])
    got = store.read_ranges_into(str(path), [0, 100, 1022], [memoryview(b) for b in bufs], ident)
    monkeypatch.undo()
    assert got == [3, 5, 2]
    assert len(stats) == 3, stats  # the path and the descriptor before the reads, the descriptor after
    assert bytes(bufs[0]) == bytes([0, 1, 2]) and bytes(bufs[1]) == bytes(range(100, 105))
    assert bytes(bufs[2]) == bytes([254, 255])
    assert store.read_ranges_into(str(tmp_path / "gone"), [0], [memoryview(bytearray(1))]) is None


def test_ranges_of_a_file_replaced_since_its_index_was_read_are_refused(tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(b"a" * 64)
    store = LocalStore()
    data, ident = store.read_current(str(path), lambda size: (0, 8))
    assert data == b"a" * 8
    fresh = tmp_path / "new"
    fresh.write_bytes(b"b" * 64)
    os.replace(fresh, path)  # a writer renames a new shard over the old one
    with pytest.raises(FileChanged):
        store.read_ranges_into(str(path), [0, 8], [memoryview(bytearray(8)), memoryview(bytearray(8))], ident)
    assert store.read_ranges_into(str(path), [0], [memoryview(bytearray(8))]) == [8]  # no identity asked: read


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-reads", "python-reads"])
def test_chunks_of_a_shard_rewritten_since_planning_are_read_again_or_filled(tmp_path, monkeypatch, compiled):
    """A shard rewritten after its batch was planned (its index read): its inner chunks are fetched again through
    the reader, each staged with its new bytes, and one the new index leaves empty is filled (it was once
    neither placed nor filled: the batch kept whatever its slot held)."""
    import numpy as np
    import torch
    import zarr
    from zarr.codecs import ZstdCodec

    import stoker
    from stoker.engine.gpu import fallback as gpu_fallback, native_reads
    from stoker.engine.gpu.sources import describe
    from stoker.engine.gpu.staging import Group, Stager, plan_reads
    from stoker.engine.planning.tables import plan_tables
    from stoker.engine.stats import StatsRecorder

    if compiled and not native_reads.available():
        pytest.skip("stoker._native is not built")
    if not compiled:
        monkeypatch.setattr(native_reads, "available", lambda: False)
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(8, 16, 16), chunks=(4, 8, 8), shards=(8, 16, 16), dtype="uint16",
                          fill_value=3, compressors=ZstdCodec(level=1))
    z[:] = np.arange(8 * 16 * 16, dtype=np.uint16).reshape(8, 16, 16) % 1000 + 10
    reader = stoker.open_array(uri)
    plan = plan_tables(0, [stoker.Sample(uri, [(0, 8), (0, 16), (0, 16)])], lambda u: reader)
    z[0:4, 0:8, 0:8] = 3  # zarr-python writes a new shard; that inner chunk holds only the fill: not stored
    z[4:8, 8:16, 8:16] = 11
    sources = [describe(r, torch.float32) for r in plan.sources]
    reads = plan_reads(plan, sources)
    stager = Stager(LocalStore(), StatsRecorder(), 2)
    threads = set()
    fetch = gpu_fallback.fetch
    monkeypatch.setattr(gpu_fallback, "fetch", lambda *a: (threads.add(threading.get_ident()), fetch(*a))[1])
    try:
        buf, group, counts = np.zeros(1 << 20, np.uint8), Group(), {"bytes_read": 0}
        fills, again = stager.read(plan, sources, reads, 0, len(reads), buf, group, {}, counts)
    finally:
        stager.close()
    assert len(threads) == 2  # fetched again together, on both read threads
    index = {tuple(int(v) for v in plan.chunk_index[c]): c for c in range(plan.n_chunks)}
    assert fills == [index[(0, 0, 0)]] and group.rows == 0
    assert sorted(p.cid for p in again) == sorted(set(range(plan.n_chunks)) - {index[(0, 0, 0)]})
    codec = reader.metadata.codec
    for p in again:  # each chunk's bytes as the rewritten shard stores them
        key = plan.key(p.cid)
        want = z[tuple(slice(4 * i, 4 * i + 4) if a == 0 else slice(8 * i, 8 * i + 8)
                       for a, i in enumerate(plan.chunk_index[p.cid].tolist()))]
        assert np.array_equal(codec.decode(p.data.tobytes(), key).reshape(want.shape), want)
    assert counts["bytes_read"] == sum(len(p.data) for p in again)


def test_runs_the_compiled_read_failed_on_are_read_again_together(tmp_path, monkeypatch):
    """Runs of shards the compiled read could not read (an error it leaves to the store to word, here as if the
    system had no descriptor left for a moment) are read again the Python way, all of them in one round on the
    read threads (once one after the other on the caller's), each into its place."""
    import numpy as np
    import torch
    import zarr
    from zarr.codecs import ZstdCodec

    import stoker
    from stoker.engine.cpu import native
    from stoker.engine.gpu import native_reads
    from stoker.engine.gpu.sources import describe
    from stoker.engine.gpu.staging import Group, Stager, plan_reads
    from stoker.engine.planning.tables import plan_tables
    from stoker.engine.stats import StatsRecorder

    if not native_reads.available():
        pytest.skip("stoker._native is not built")
    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(32, 16, 16), chunks=(4, 8, 8), shards=(8, 16, 16), dtype="uint16",
                          compressors=ZstdCodec(level=1))
    z[:] = np.arange(32 * 16 * 16, dtype=np.uint16).reshape(32, 16, 16) % 1000  # four shards: four runs
    reader = stoker.open_array(uri)
    plan = plan_tables(0, [stoker.Sample(uri, [(0, 32), (0, 16), (0, 16)])], lambda u: reader)
    sources = [describe(r, torch.float32) for r in plan.sources]
    reads = plan_reads(plan, sources)
    real = native.stage_read

    def failing(buf, paths, files, table, out, whole_base, threads, **kw):
        counted = real(buf, paths, files, table, out, whole_base, threads, **kw)
        out[:, native_reads.STATUS] = native.ST_OS_ERROR  # (the bytes it read are read again over them)
        out[:, native_reads.DETAIL] = 24  # EMFILE
        return counted

    threads = set()
    store = LocalStore()
    read_ranges = store.read_ranges_into
    monkeypatch.setattr(native, "stage_read", failing)
    monkeypatch.setattr(store, "read_ranges_into",
                        lambda *a: (threads.add(threading.get_ident()), read_ranges(*a))[1])
    stager = Stager(store, StatsRecorder(), 2)
    try:
        buf, group, counts = np.zeros(1 << 20, np.uint8), Group(), {"bytes_read": 0}
        fills, again = stager.read(plan, sources, reads, 0, len(reads), buf, group, {}, counts)
    finally:
        stager.close()
    assert fills == [] and again == [] and group.rows == plan.n_chunks
    assert len(threads) == 2  # the four runs read again on both read threads
    cid, _, at, size, _ = group.table()
    for c, a, n in zip(cid.tolist(), at.tolist(), size.tolist()):
        want = reader.encoded_chunk(tuple(int(v) for v in plan.chunk_index[c]))[1]
        assert bytes(buf[a:a + n]) == bytes(want)


def test_a_fetch_of_absent_chunks_only_records_no_read(tmp_path):
    """Stager.fetch of chunks none of which is stored (every one the fill value) reads nothing: it counts no
    io event and no bytes, as the CPU path counts none for an absent chunk file; a fetch that reads counts one."""
    import torch
    import zarr

    import stoker
    from stoker.engine.gpu.sources import describe
    from stoker.engine.gpu.staging import Stager
    from stoker.engine.planning.tables import plan_tables
    from stoker.engine.stats import StatsRecorder

    uri = str(tmp_path / "a.zarr")
    z = zarr.create_array(uri, shape=(8, 16), chunks=(4, 8), dtype="uint16", fill_value=5)
    z[4:8, 8:16] = 9  # one chunk stored, three absent
    reader = stoker.open_array(uri)
    plan = plan_tables(0, [stoker.Sample(uri, [(0, 8), (0, 16)])], lambda u: reader)
    sources = [describe(r, torch.float32) for r in plan.sources]
    stored = [c for c in range(plan.n_chunks) if tuple(plan.chunk_index[c].tolist()) == (1, 1)]
    absent = [c for c in range(plan.n_chunks) if c not in stored]
    stats = StatsRecorder()
    stager = Stager(LocalStore(), stats, 2)
    try:
        counts = {"bytes_read": 0}
        fills, items = stager.fetch(plan, sources, absent, {}, counts)
        assert sorted(fills) == sorted(absent) and items == []
        io = stats.snapshot().stages["io"]
        assert (io.count, io.bytes_out, counts["bytes_read"]) == (0, 0, 0)
        fills, items = stager.fetch(plan, sources, stored, {}, counts)
        assert fills == [] and [p.cid for p in items] == stored
        io = stats.snapshot().stages["io"]
        assert io.count == 1 and io.bytes_out == counts["bytes_read"] == len(items[0].data) > 0
    finally:
        stager.close()
