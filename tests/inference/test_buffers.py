"""The TileWriter's recycled buffers and its kept parts: the pool hands written regions' buffers out again,
zeroed, holding at most its bound; weighted parts are copies (the caller may reuse its batch at once), and a
region whose parts would outgrow float64 sums is folded into them; every way gives the reference's blend."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import stoker
from stoker.inference.buffers import BufferPool

from .test_writer import SHAPE, STRIDE, TILE, model, reference

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def test_a_buffer_given_back_is_taken_again_zeroed():
    pool = BufferPool(max_bytes=4 * MIB)
    a = pool.take((8, 16), np.float64)
    assert not a.any()
    a[:] = 7
    pool.give(a)
    assert pool.held_bytes == a.nbytes
    b = pool.take((8, 16), np.float64)
    assert b is a and not b.any() and pool.held_bytes == 0
    b[:] = 5
    pool.give(b)
    assert pool.take((8, 16), np.float32) is not b  # another dtype: another kind
    c = pool.take((8, 16), np.float64, zero=False)
    assert c is b and (c == 5).all()  # not zeroed when the caller overwrites it all


def test_the_pool_holds_at_most_max_bytes_and_never_a_view():
    pool = BufferPool(max_bytes=2 * MIB)
    bufs = [np.ones(MIB, dtype=np.uint8) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert pool.held_bytes == 2 * MIB  # the third is dropped
    taken = [pool.take((MIB,), np.uint8) for _ in range(3)]
    assert sum(any(t is b for b in bufs) for t in taken) == 2 and pool.held_bytes == 0
    pool.give(taken[0][1:])  # a view: its memory is another array's
    pool.give(np.ones((4, 4))[:, :2].copy().T)  # not C-contiguous
    assert pool.held_bytes == 0


def _writer(uri_out, blend, channels, crop, **kw):
    shape = ((channels,) if channels else ()) + SHAPE
    chunks = ((channels,) if channels else ()) + (4, 8, 8)
    return stoker.TileWriter(uri_out, shape, chunks, "f4", blend=blend, crop=crop, **kw)


def test_the_caller_may_overwrite_its_predictions_after_write(volume, tmp_path):
    """Weighted parts are kept until their region is finished: as copies, so a batch reused at once (as the
    pipeline reuses its slots) changes nothing."""
    uri, data = volume
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    out = str(tmp_path / "out.zarr")
    writer = _writer(out, "hann", 0, 2, grid=grid, write_threads=0)
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    kept = 0
    for samples, x in stoker.CropDataset(grid, cfg, with_samples=True):
        y = model(x, 0).numpy()
        writer.write(samples, y)
        kept += sum(len(r.parts) for r in writer._open.values())
        y[:] = 1e9  # the caller's buffer, reused
    writer.close()
    assert kept > 0  # parts were kept across writes
    np.testing.assert_allclose(zarr.open_array(out, mode="r")[:], reference(data, "hann", 0), rtol=2e-7, atol=0)


@pytest.mark.parametrize("blend", ["linear", "hann"])
@pytest.mark.parametrize("channels", [0, 2])
@pytest.mark.parametrize("threads", [0, 2])
def test_heavy_overlap_folds_parts_into_sums(volume, tmp_path, blend, channels, threads):
    """Without a crop the tiles overlap up to 8 times: a region's parts would outgrow its float64 sums, so
    they are folded into them, and a region never holds more than its sums."""
    uri, data = volume
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    out = str(tmp_path / "out.zarr")
    writer = _writer(out, blend, channels, 0, grid=grid, write_threads=threads)
    cfg = stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1)
    folded = 0
    for samples, x in stoker.CropDataset(grid, cfg, with_samples=True):
        writer.write(samples, model(x, channels))
        for region in writer._open.values():
            folded += region.wsum is not None
            assert 0 < region.nbytes <= region.sums_bytes
    writer.close()
    assert folded > 0
    want = reference(data, blend, channels, crop=0)
    np.testing.assert_allclose(zarr.open_array(out, mode="r")[:], want, rtol=2e-7, atol=0)


def test_a_writer_recycles_its_buffers_within_its_bound(volume, tmp_path):
    uri, data = volume
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    out = str(tmp_path / "out.zarr")
    writer = _writer(out, "hann", 2, 2, grid=grid, write_threads=1)
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    for samples, x in stoker.CropDataset(grid, cfg, with_samples=True):
        writer.write(samples, model(x, 2))
    pool = writer._pool
    close = pool.release
    held = []
    pool.release = lambda: (held.append(pool.held_bytes), close())  # what it held when the writer closed
    writer.close()
    assert 0 < held[0] <= pool.max_bytes and pool.held_bytes == 0  # handed over to buffers.SPARE
    # one region per write thread and one more: sums, scratch, output and frames of a 2 x 4 x 8 x 8 region
    assert pool.max_bytes == 2 * (2 * 4 * 8 * 8) * (3 * 8 + 2 * 4)
    np.testing.assert_allclose(zarr.open_array(out, mode="r")[:], reference(data, "hann", 2), rtol=2e-7, atol=0)


def test_a_released_pool_feeds_the_next_within_the_spare_bound():
    spare = BufferPool(max_bytes=3 * MIB)
    first, second = BufferPool(8 * MIB, spare=spare), BufferPool(8 * MIB, spare=spare)
    bufs = [first.take((MIB,), np.uint8) for _ in range(4)]
    for b in bufs:
        b[:] = 3
        first.give(b)
    first.release()
    assert first.held_bytes == 0 and spare.held_bytes == 3 * MIB  # the fourth did not fit the spare
    taken = second.take((MIB,), np.uint8)
    assert any(taken is b for b in bufs) and not taken.any() and spare.held_bytes == 2 * MIB


def test_a_buffer_past_the_bound_goes_to_the_spare_pool_not_the_kernel():
    """More regions open at once than the pool's bound (a grid's regions wait for several rows of tiles): what
    does not fit the pool is handed to its spare, and taken from there again, not dropped to come back as
    new memory for the next region."""
    spare = BufferPool(max_bytes=4 * MIB)
    pool = BufferPool(max_bytes=1 * MIB, spare=spare)
    bufs = [pool.take((MIB,), np.uint8, zero=False) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert pool.held_bytes == MIB and spare.held_bytes == 2 * MIB  # the pool's bound still holds
    again = [pool.take((MIB,), np.uint8, zero=False) for _ in range(3)]
    assert all(any(a is b for b in bufs) for a in again) and spare.held_bytes == 0


def _grid_batches(uri):
    """The tile grid of ``uri`` and its batches as ``(samples, tile tensor)`` pairs, read once."""
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    return grid, [(s, x.clone()) for s, x in stoker.CropDataset(grid, cfg, with_samples=True)]


@pytest.mark.parametrize("blend", ["none", "hann"])
def test_a_writer_with_many_regions_open_makes_no_new_buffers_for_the_next_volume(volume, tmp_path, monkeypatch,
                                                                                    blend):
    """A grid's tiles keep many regions open at once, more than a pool of one region per write thread holds:
    the buffers past its bound go to the spare pool, so a second volume in the process takes every buffer
    from the first's (none allocated: fresh memory faults in page by page), and its array is the reference's.
    Without write threads, so which buffer is back when the next region takes one does not depend on timing."""
    import stoker.inference.writer as writer_module

    class Counting(BufferPool):
        made = 0

        def take(self, shape, dtype, zero=True):
            key = (tuple(int(s) for s in shape), np.dtype(dtype).str)
            buf = self._pop(key)
            if buf is None:
                Counting.made += 1
                return np.zeros(key[0], dtype) if zero else np.empty(key[0], dtype)
            if zero:
                buf.fill(0)
            return buf

    monkeypatch.setattr(writer_module, "BufferPool", Counting)
    monkeypatch.setattr(writer_module, "SPARE", BufferPool(max_bytes=64 * MIB))
    uri, data = volume
    grid, batches = _grid_batches(uri)
    made = []
    for i in range(2):
        out = str(tmp_path / f"out{i}.zarr")
        writer = _writer(out, blend, 2, 2, grid=grid, write_threads=0)
        assert len(writer._expected) > 2  # regions: more than the one the pool's bound is sized for
        for samples, x in batches:
            writer.write(samples, model(x, 2))
        writer.close()
        made.append(Counting.made)
        np.testing.assert_allclose(zarr.open_array(out, mode="r")[:], reference(data, blend, 2), rtol=2e-7, atol=0)
    assert made[0] > 0 and made[1] == made[0]  # the second volume allocated nothing (before: half as many again)


@pytest.mark.parametrize("blend", ["none", "hann"])
def test_the_next_writer_takes_a_closed_writers_buffers(volume, tmp_path, monkeypatch, blend):
    """Volume after volume in one process: the second writer's regions are the first's buffers, not new
    memory (which faults in page by page), and its array is still the reference's."""
    import stoker.inference.writer as writer_module

    class Counting(BufferPool):
        hits = 0

        def _pop(self, key):
            buf = super()._pop(key)
            self.hits += buf is not None
            return buf

    spare = Counting(max_bytes=64 * MIB)
    monkeypatch.setattr(writer_module, "SPARE", spare)
    uri, data = volume
    grid, batches = _grid_batches(uri)
    hits = []
    for i in range(2):
        out = str(tmp_path / f"out{i}.zarr")
        writer = _writer(out, blend, 2, 2, grid=grid, write_threads=1)
        for samples, x in batches:
            writer.write(samples, model(x, 2))
        writer.close()
        hits.append(spare.hits)
        np.testing.assert_allclose(zarr.open_array(out, mode="r")[:], reference(data, blend, 2), rtol=2e-7, atol=0)
        assert 0 < spare.held_bytes <= spare.max_bytes  # the writer's buffers, kept for the next
    assert hits[1] > hits[0]  # the second took the first's (the first only what it gave past its own bound)


def test_weighted_parts_are_copied_into_recycled_buffers(volume, tmp_path):
    """A kept part is a copy of the caller's batch in a buffer from the pool, handed back once summed, so
    the parts of later regions reuse those of earlier ones instead of new memory."""
    uri, data = volume
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    writer = _writer(str(tmp_path / "out.zarr"), "hann", 0, 2, grid=grid, write_threads=0)
    take, seen = writer._pool.take, []

    def counting(shape, dtype, zero=True):
        buf = take(shape, dtype, zero)
        if np.dtype(dtype) == np.float32 and not zero:
            seen.append(id(buf))
        return buf

    writer._pool.take = counting
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    parts = []
    for samples, x in stoker.CropDataset(grid, cfg, with_samples=True):
        writer.write(samples, model(x, 0))
        parts += [id(values) for r in writer._open.values() for _, values, _ in r.parts]
    writer.close()
    assert parts and set(parts) <= set(seen)  # every part kept is a buffer from the pool
    assert len(set(seen)) < len(seen)  # and they came back and served again
    np.testing.assert_allclose(zarr.open_array(str(tmp_path / "out.zarr"), mode="r")[:], reference(data, "hann", 0),
                               rtol=2e-7, atol=0)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_child_forked_while_the_spare_pool_is_locked_takes_from_it_at_once():
    """A process forked while a write thread is inside SPARE (a writer closing: release, give) must not
    inherit its lock held (the child's first take would wait for ever), nor the parent's buffers."""
    from stoker.inference import buffers

    from forking import fork_child, held_by_another_thread, verdict

    buffers.SPARE.give(np.empty((8, 8), np.float64))  # something the child must not get
    with held_by_another_thread(buffers.SPARE._lock):
        pid = fork_child(lambda: buffers.SPARE.held_bytes == 0 and buffers.SPARE.take((8, 8), np.float64) is not None)
    assert verdict(pid) == "exit 0"  # "hung": on SPARE's lock, inherited held
