"""Storage that blocks: a file that never answers must never hang stoker, nor keep the process alive.

A FIFO where a chunk, metadata, shard, statistics or checkpoint file should be stands in for a hung
mount: a blocking open of it waits for a writer forever. stoker opens every file non-blocking and
refuses anything but a regular file with a StorageError naming it. A read that truly hangs (a hung
NFS mount: simulated by an ``os.open`` that never returns) cannot be refused; the pipeline then
raises PoolStarved, and the process can still exit, because no thread of stoker's is joined at exit.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import stoker
from stoker.engine.cpu import native
import native_testing
from stoker.records import ZarrRecords, compute_stats
from stoker.records import sidecar
from stoker.storage import LocalStore
from stoker.train import Checkpoints

pytestmark = pytest.mark.timeout(60)

FIFO = "is a FIFO, not a regular file"


@pytest.fixture
def fifo():
    """``fifo(path)`` puts a FIFO at ``path``. At teardown any reader still blocked opening one is released
    (so a regression fails its test instead of leaving a thread stuck)."""
    made = []

    def make(path) -> str:
        path = str(path)
        if os.path.lexists(path):
            os.unlink(path)
        os.mkfifo(path)
        made.append(path)
        return path

    yield make
    for path in made:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: nobody is waiting
        except OSError:
            pass


def _cfg(**kw):
    base = dict(batch_size=2, dtype="f32", host_buffer_bytes=16 << 20, n_io_threads=1, n_compute_threads=2,
                pop_timeout_s=10.0, device="cpu")
    base.update(kw)
    return stoker.Config(**base)


def _array(path, fmt=3, shards=None):
    zstd = ZstdCodec(level=1) if fmt == 3 else numcodecs.Zstd(level=1)
    z = zarr.create_array(str(path), shape=(8, 8), chunks=(4, 4) if shards is None else (2, 2), shards=shards,
                          dtype="uint16", compressors=zstd, zarr_format=fmt)
    z[...] = np.arange(64, dtype="uint16").reshape(8, 8) + 1
    return str(path)


def _pipeline_raises(uri, match=FIFO):
    samples = [stoker.Sample(uri, [(0, 4), (0, 4)]), stoker.Sample(uri, [(4, 8), (4, 8)])]
    with stoker.Pipeline(_cfg()) as p:
        p.push(samples)
        with pytest.raises(stoker.StorageError, match=match):
            p.pop()


def test_fifo_as_chunk_file(tmp_path, fifo, decode_path):
    uri = _array(tmp_path / "a.zarr")
    path = fifo(tmp_path / "a.zarr" / "c" / "0" / "0")
    with pytest.raises(stoker.StorageError, match=FIFO) as info:
        stoker.open_array(uri, store=LocalStore()).read(np.s_[0:4, 0:4])
    assert info.value.path == path
    _pipeline_raises(uri)  # the compiled reader's own open refuses it too


@pytest.mark.parametrize("shards", [None, (4, 4)], ids=["chunk", "shard"])
def test_directory_as_chunk_file_is_refused_by_every_reader(tmp_path, decode_path, shards):
    """Not blocking, but the same rule: a store reads a directory at a key as no value (as zarr-python does),
    yet a directory where a chunk (or shard) file should be is damage, never the fill value: the reader (and
    the records read through it) raises the engine's StorageError naming it, as the pipeline does."""
    uri = _array(tmp_path / "a.zarr", shards=shards)
    path = tmp_path / "a.zarr" / "c" / "0" / "0"
    path.unlink()
    path.mkdir()
    for box in (np.s_[0:4, 0:4], np.s_[0:8, 0:8]):  # the chunk alone (encoded_chunk), and among others
        with pytest.raises(stoker.StorageError, match="is a directory, not a regular file") as info:
            stoker.open_array(uri, store=LocalStore()).read(box)
        assert info.value.path == str(path)
    _pipeline_raises(uri, match="is a directory, not a regular file")
    path.rmdir()  # nothing there: the fill value, as zarr-python reads it
    np.testing.assert_array_equal(stoker.open_array(uri, store=LocalStore()).read(np.s_[0:8, 0:8]),
                                  zarr.open_array(uri, mode="r")[...])


def test_directory_as_chunk_file_in_records(tmp_path):
    root = _records(tmp_path / "d")
    ds = ZarrRecords(root, store=LocalStore())
    os.unlink(tmp_path / "d" / "rec_1.zarr" / "x" / "c" / "0" / "0")
    os.mkdir(tmp_path / "d" / "rec_1.zarr" / "x" / "c" / "0" / "0")
    assert float(ds[0]["x"][0, 0]) == 0.0
    with pytest.raises(stoker.StorageError, match="is a directory, not a regular file"):
        ds[1]


@pytest.mark.parametrize("fmt,name", [(3, "zarr.json"), (2, ".zarray")])
def test_fifo_as_metadata(tmp_path, fifo, fmt, name):
    uri = _array(tmp_path / "a.zarr", fmt=fmt)
    fifo(tmp_path / "a.zarr" / name)
    with pytest.raises(stoker.StorageError, match=FIFO):
        stoker.open_array(uri, store=LocalStore())
    _pipeline_raises(uri)


def test_fifo_as_shard_file(tmp_path, fifo, decode_path):
    uri = _array(tmp_path / "a.zarr", shards=(4, 4))
    fifo(tmp_path / "a.zarr" / "c" / "0" / "0")
    with pytest.raises(stoker.StorageError, match=FIFO):
        stoker.open_array(uri, store=LocalStore()).read(np.s_[0:4, 0:4])
    _pipeline_raises(uri)


def test_compiled_reader_refuses_a_fifo_as_chunk_file_and_as_shard(tmp_path, fifo):
    if native_testing.decode_files is None:
        pytest.skip("stoker._native (and stoker._testing) is not available")
    path = fifo(tmp_path / "chunk")
    regions = [(-1, 0, 0, 64), (0, 16, 0, 64)]  # a whole chunk file, an inner chunk of a shard
    results = native_testing.decode_files(native.CODEC_ZSTD, [path, path], regions, np.empty(4096, "uint8"),
                                          [np.empty(64, "uint8") for _ in regions], 64, None, None)
    assert [r[0] for r in results] == [native.ST_NOT_REGULAR] * 2
    assert [r[2] for r in results] == [stat.S_IFIFO] * 2


def _records(root):
    for i in range(2):
        g = zarr.open_group(str(root / f"rec_{i}.zarr"), mode="w", zarr_format=3)
        g.create_array("x", data=np.arange(24, dtype="float32").reshape(8, 3) + i, chunks=(4, 3))
    return str(root)


def test_fifo_in_records(tmp_path, fifo):
    root = _records(tmp_path / "d")
    ds = ZarrRecords(root, store=LocalStore())
    fifo(tmp_path / "d" / "rec_1.zarr" / "x" / "c" / "0" / "0")
    with pytest.raises(stoker.StorageError, match=FIFO):
        ds[1]
    fifo(tmp_path / "d" / "rec_1.zarr" / "x" / "zarr.json")
    with pytest.raises(stoker.StorageError, match=FIFO):
        ZarrRecords(root)


def test_fifo_as_statistics_sidecar_is_ignored_with_a_warning(tmp_path, fifo):
    """An unreadable statistics file is ignored with a warning and replaced (the sidecar's rule): a FIFO
    is unreadable, said so at once rather than waited on."""
    root = _records(tmp_path / "d")
    path = fifo(sidecar.path_for(root))
    with pytest.warns(RuntimeWarning, match=FIFO):
        stats = compute_stats(ZarrRecords(root), ["x"])
    assert stats["x"].count.sum() > 0
    assert stat.S_ISREG(os.lstat(path).st_mode)  # written anew as a regular file


@pytest.mark.parametrize("content", ["huge", "deep"])
def test_a_huge_or_deeply_nested_sidecar_is_ignored_with_a_warning(tmp_path, content):
    """A statistics file larger than any stoker writes is refused unread, and JSON nested too deep for the
    parser is unreadable like any other damage: both are warned about and replaced."""
    root = _records(tmp_path / "d")
    path = sidecar.path_for(root)
    if content == "huge":
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # sparse: no disk used
        words = "more than the"
    else:
        with open(path, "w") as f:
            f.write("[" * 100_000 + "]" * 100_000)
        words = "unreadable statistics file"
    with pytest.warns(RuntimeWarning, match=words):
        stats = compute_stats(ZarrRecords(root), ["x"])
    assert stats["x"].count.sum() > 0 and os.path.getsize(path) < 1 << 20


def test_fifo_as_checkpoint(tmp_path, fifo):
    ckpts = Checkpoints(tmp_path)
    path = fifo(ckpts.path_for(5))
    with pytest.raises(stoker.CheckpointError, match=FIFO):
        ckpts.load(path)


_CHILD = textwrap.dedent("""
    import os, sys, threading
    import stoker
    from stoker.records import Loader, ZarrRecords

    array, records = sys.argv[1], sys.argv[2]
    hung = (os.path.join(array, "c") + os.sep, os.path.join(records, "rec_0.zarr", "x", "c") + os.sep)
    never = threading.Event()
    real_open = os.open

    def open_on_a_hung_mount(path, *args, **kwargs):
        if os.fspath(path).startswith(hung):
            never.wait()  # as a read from a hung NFS mount: it never returns
        return real_open(path, *args, **kwargs)

    os.open = open_on_a_hung_mount
    cfg = stoker.Config(batch_size=1, dtype="f32", host_buffer_bytes=16 << 20, n_io_threads=1, n_compute_threads=1,
                        pop_timeout_s=1.0, device="cpu")
    p = stoker.Pipeline(cfg)
    p.push([stoker.Sample(array, [(0, 4), (0, 4)])])
    try:
        p.pop()
    except stoker.PoolStarved:
        print("PoolStarved", flush=True)
    loader = Loader(ZarrRecords(records), batch_size=1, shuffle=False, n_threads=1, timeout_s=1.0, device="cpu")
    try:
        next(iter(loader))
    except stoker.StokerError as exc:
        print(type(exc).__name__, flush=True)
    # no close(): the process ends with stoker's threads stuck in open()
""")


def test_reads_stuck_forever_starve_the_pipeline_and_the_process_still_exits(tmp_path):
    array = _array(tmp_path / "a.zarr")
    records = _records(tmp_path / "d")
    env = {**os.environ, "STOKER_NATIVE": "0"}  # the Python read path, where os.open is the one patched
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, array, records], env=env, capture_output=True,
                              text=True, timeout=40)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process did not exit: a thread stuck in a read kept it alive\n{exc.stdout}{exc.stderr}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["PoolStarved", "LoaderTimeout"], proc.stderr


def test_daemon_pool_runs_tasks_drops_queued_ones_at_shutdown_and_stops_idle_threads():
    import threading

    from stoker.runtime.workers import DaemonPool

    pool = DaemonPool(2, "stoker-test")
    gate, ran = threading.Event(), []
    for i in range(2):
        pool.submit(gate.wait, 10)  # both threads busy
    for i in range(5):
        pool.submit(ran.append, i)  # queued behind them
    assert len(pool.threads) == 2 and all(t.daemon for t in pool.threads)
    pool.shutdown()
    gate.set()
    for t in pool.threads:
        t.join(10)
    assert ran == [] and not any(t.is_alive() for t in pool.threads)
    with pytest.raises(stoker.ShutdownError):
        pool.submit(ran.append, 0)


def test_a_thread_the_system_refuses_leaves_the_pool_whole(monkeypatch):
    """A failed thread start (no threads left) is the system's error, not 'closed', and leaves neither a
    phantom thread nor an orphaned task behind: the next submit starts a thread and runs."""
    import threading

    from stoker.runtime.workers import DaemonPool

    pool = DaemonPool(1, "stoker-test")
    real = threading.Thread.start

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread") as info:
        pool.submit(print, "never")
    assert not isinstance(info.value, stoker.ShutdownError) and pool.threads == []
    monkeypatch.setattr(threading.Thread, "start", real)
    done = threading.Event()
    pool.submit(done.set)
    assert done.wait(10) and len(pool.threads) == 1
    pool.shutdown()
