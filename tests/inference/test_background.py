"""The TileWriter's background writes: real threads, real zarr arrays. A failed write surfaces typed at the
next call and at close, close waits for the writes (and gives up after its timeout), the bytes waiting are
bounded, and the blend is the same whatever the threads and the bound."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zarr

import stoker
from stoker.inference.background import BackgroundWriter
from stoker.sampling.sample import box_of

from .test_writer import reference, run

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _fail():
    raise stoker.StorageError("disk full", uri="/x", key=None, status=None, attempts=None)


def test_a_failed_write_is_raised_typed_at_the_next_submit_and_at_close():
    bw = BackgroundWriter("/x", threads=2, max_bytes=MIB, timeout_s=10)
    bw.submit("region (0,)", 10, _fail)
    _until(lambda: bw.in_flight_bytes == 0)
    ran = []
    with pytest.raises(stoker.StorageError, match="disk full"):
        bw.submit("region (1,)", 10, lambda: ran.append(1))
    with pytest.raises(stoker.StorageError, match="disk full"):
        bw.close()
    assert ran == []  # nothing is queued after a failure


def test_close_waits_for_the_queued_writes():
    bw = BackgroundWriter("/x", threads=1, max_bytes=MIB, timeout_s=10)
    done = []
    for i in range(3):
        bw.submit(f"region ({i},)", 10, lambda i=i: (time.sleep(0.1), done.append(i)))
    bw.close()
    assert sorted(done) == [0, 1, 2] and bw.in_flight_bytes == 0
    threads = bw._pool.threads
    assert threads and not any(t.is_alive() for t in threads)  # and its threads are gone


def test_close_gives_up_on_a_hung_write_after_its_timeout():
    release = threading.Event()
    bw = BackgroundWriter("/x", threads=1, max_bytes=MIB, timeout_s=0.5)
    bw.submit("region (0,)", 10, lambda: release.wait(30))
    t0 = time.monotonic()
    with pytest.raises(stoker.StorageError, match=r"did not finish within write_timeout_s=0.5"):
        bw.close()
    assert time.monotonic() - t0 < 5
    release.set()


def test_the_bytes_in_flight_are_bounded():
    release = threading.Event()
    bw = BackgroundWriter("/x", threads=2, max_bytes=3 * MIB, timeout_s=30)
    for i in range(3):  # two running, one queued: 3 MiB
        bw.submit(f"region ({i},)", MIB, lambda: release.wait(30))
    fourth = threading.Thread(target=bw.submit, args=("region (3,)", MIB, lambda: None))
    fourth.start()
    time.sleep(0.3)
    assert fourth.is_alive() and bw.in_flight_bytes == 3 * MIB  # the fourth waits for room
    release.set()
    fourth.join(10)
    assert not fourth.is_alive()
    bw.close()
    assert bw.in_flight_bytes == 0


def test_waiting_for_room_has_a_timeout():
    release = threading.Event()
    bw = BackgroundWriter("/x", threads=1, max_bytes=MIB, timeout_s=0.3)
    bw.submit("region (0,)", MIB, lambda: release.wait(30))  # one region is always let through
    with pytest.raises(stoker.StorageError, match=r"room to queue region \(1,\)"):
        bw.submit("region (1,)", MIB, lambda: None)
    release.set()
    bw.close()


def test_a_tilewriter_raises_a_failed_background_write_at_the_next_write(tmp_path):
    data = np.random.default_rng(1).random((8, 8)).astype("f4")
    src = tmp_path / "in.zarr"
    zarr.create_array(str(src), shape=(8, 8), chunks=(4, 4), dtype="f4")[:] = data
    grid = stoker.TileGrid([str(src)], (4, 4), stride=(4, 4))
    out = tmp_path / "o.zarr"
    w = stoker.TileWriter(str(out), (8, 8), (4, 4), "f4", grid=grid, write_threads=1)
    (out / "c").write_bytes(b"")  # a file where the chunks' folder goes: every chunk write fails
    tiles = [grid.sample(0, i) for i in range(len(grid))]
    w.write(tiles[:1], data[None, :4, :4])  # region (0, 0) is complete: queued, and its write fails
    _until(lambda: w._background.in_flight_bytes == 0)
    # handed to a write thread but never written: not done, and a job asking what is left still gets its tile
    assert (0, 0) not in w.done
    assert [box_of(t) for t in w.pending(grid)] == [box_of(t) for t in tiles]
    with pytest.raises(stoker.StorageError, match=r"o.zarr: writing region \(0, 0\)"):
        w.write(tiles[1:2], data[None, :4, 4:])
    with pytest.raises(stoker.StorageError, match=r"o.zarr: writing region \(0, 0\)"):
        w.close()
    assert w.record.done() == set()  # never marked: it was not written


@pytest.mark.parametrize("threads, nbytes", [(0, 0), (1, 0), (3, 1), (2, 64 * 1024)])
def test_the_blend_is_the_same_whatever_the_threads_and_the_bound(volume, tmp_path, threads, nbytes):
    uri, data = volume
    out = str(tmp_path / "out.zarr")
    writer, _ = run(uri, out, "hann", 2, write_threads=threads, write_bytes=nbytes)
    np.testing.assert_allclose(zarr.open_array(out, mode="r")[:], reference(data, "hann", 2), rtol=2e-7, atol=0)
    assert writer.written == len(writer.record.done()) == 4 * 4 * 3



def _tile_writer(tmp_path, **kw):
    data = np.random.default_rng(1).random((8, 8)).astype("f4")
    src = tmp_path / "in.zarr"
    zarr.create_array(str(src), shape=(8, 8), chunks=(4, 4), dtype="f4")[:] = data
    grid = stoker.TileGrid([str(src)], (4, 4), stride=(4, 4))
    w = stoker.TileWriter(str(tmp_path / "o.zarr"), (8, 8), (4, 4), "f4", grid=grid, **kw)
    return w, data, [grid.sample(0, i) for i in range(len(grid))]


def test_an_error_in_a_with_block_lets_the_queued_writes_finish_and_is_the_one_raised(tmp_path):
    w, data, tiles = _tile_writer(tmp_path, write_threads=2)
    with pytest.raises(KeyError, match="the model failed"):
        with w:
            w.write(tiles[:2], np.stack([data[:4, :4], data[:4, 4:]]))  # regions (0, 0) and (0, 1) complete
            raise KeyError("the model failed")
    assert w.record.done() == {(0, 0), (0, 1)} and w.written == 2
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "o.zarr"))[:4], data[:4])
    assert not any(t.is_alive() for t in w._background._pool.threads)


def test_a_writer_dropped_without_close_does_not_leave_its_threads(tmp_path):
    import gc

    w, data, tiles = _tile_writer(tmp_path, write_threads=3)
    w.write(tiles, np.stack([data[:4, :4], data[:4, 4:], data[4:, :4], data[4:, 4:]]))  # 4 regions to write
    deadline = time.monotonic() + 10  # no closure over w: it is dropped below
    while w.written < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    threads = list(w._background._pool.threads) + w._marks.threads  # the write threads and the sync thread
    assert len(w._marks.threads) == 1 and all(t.is_alive() for t in threads)
    del w
    gc.collect()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
