"""A region's kept parts blended in time linear in their number (a shard-sized region receiving hundreds of
small tiles spent seconds of GIL-holding Python pairing every part with every other), with the results the
piecewise blend gives, bit for bit; and a voxel one tile covers is its prediction also where the parts were
folded into float64 sums."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import zarr

import stoker
from stoker.inference import weighted
from stoker.inference import writer as writer_module
from stoker.inference.blend import weights, window
from stoker.inference.buffers import BufferPool
from stoker.inference.writer import _Region

pytestmark = pytest.mark.timeout(300)


def _parts(region: int, tile: int, stride: int, blend: str = "hann", seed: int = 0) -> list:
    """The parts of a region of ``region``^3 that tiles of ``tile``^3 every ``stride`` leave, with their
    weights, float32 values k + 0.5 (ties for an integer output) and windows."""
    w, win = weights(blend, (tile,) * 3), window(blend, tile)
    rng = np.random.default_rng(seed)
    out = []
    for c in itertools.product(range(-tile + stride, region, stride), repeat=3):
        b = tuple((max(a, 0), min(a + tile, region)) for a in c)
        if all(p < q for p, q in b):
            at = tuple(slice(p - a, q - a) for (p, q), a in zip(b, c))
            values = (rng.integers(0, 200, tuple(q - p for p, q in b)) + 0.5).astype(np.float32)
            out.append((tuple(slice(p, q) for p, q in b), w[at], values, tuple(win[a] for a in at)))
    return out


def _region(parts: list, region: int, pool: BufferPool, blend: str = "hann", channels: int = 0) -> _Region:
    r = _Region(((0, region),) * 3, (channels,) if channels else (), blend, np.dtype("f4"), pool)
    for where, w, v, win in parts:
        v = np.stack([v + k for k in range(channels)]) if channels else v.copy()
        r.parts.append((where, v, win))
        r.part_tiles.append(tuple((s.start, s.stop) for s in where))  # the order they are summed in
        r.parts_bytes += v.nbytes
    assert r.parts_bytes <= r.sums_bytes  # kept, not folded: the blend_parts path
    return r


def test_blend_parts_costs_about_what_summing_cost():
    """343 parts (each voxel covered 1.7 times on average): blending them costs about what float64 sums of
    the region cost (the pairwise blend took 20 times that); the best of three of each, against load."""
    region = 128
    parts = _parts(region, 24, 20)
    new, old = [], []
    for _ in range(3):
        pool = BufferPool(1 << 33)
        r = _region(parts, region, pool)
        out = np.empty((region,) * 3, np.float32)
        t = time.process_time()
        r.blend_parts(out, np.float32(0), pool)
        new.append(time.process_time() - t)
        r = _region(parts, region, pool)
        scratch = np.empty(region ** 3)
        t = time.process_time()
        r.fold(pool, lambda s: scratch[:int(np.prod(s))].reshape(s))  # the sums blend_parts replaced
        np.divide(r.values, r.wsum, out=np.empty_like(out), casting="same_kind")
        old.append(time.process_time() - t)
    assert min(new) <= 3 * min(old) + 0.05, \
        f"{len(parts)} parts: blend_parts {min(new):.2f} s CPU against {min(old):.2f} s summed"


@pytest.mark.parametrize("channels", [0, 2])
@pytest.mark.parametrize("dtype", ["f4", "f2", "u1"])
@pytest.mark.parametrize("blend", ["linear", "hann"])
def test_many_parts_blend_as_the_pieces_do_bit_for_bit(monkeypatch, blend, dtype, channels):
    """Past PIECEWISE_PARTS the parts are summed over the region and copied where one covers: the output is
    the piecewise blend's, every bit (overlaps: float64 sums in arrival order; once covered: the value); and
    so is the compiled pass's (weighted.mean_into: float outputs), which does all of it at once."""
    region = 40
    parts = _parts(region, 12, 9, blend, seed=3)[:-5]  # the last few left out: some voxels no part reaches
    assert len(parts) > writer_module.PIECEWISE_PARTS
    got = {}
    compiled = weighted.native_mean
    for name, limit, native in (("summed", writer_module.PIECEWISE_PARTS, None), ("pieces", 10 ** 6, None),
                                ("compiled", writer_module.PIECEWISE_PARTS, compiled)):
        monkeypatch.setattr(writer_module, "PIECEWISE_PARTS", limit)
        monkeypatch.setattr(weighted, "native_mean", native)
        pool = BufferPool(1 << 30)
        out = np.empty(((channels,) if channels else ()) + (region,) * 3, dtype)
        _region(parts, region, pool, blend, channels).blend_parts(out, np.asarray(7, dtype), pool)
        got[name] = out
    assert (got["pieces"] == 7).any()
    np.testing.assert_array_equal(got["summed"].view(np.uint8), got["pieces"].view(np.uint8))
    np.testing.assert_array_equal(got["compiled"].view(np.uint8), got["pieces"].view(np.uint8))


@pytest.mark.parametrize("blend", ["linear", "hann"])
def test_once_covered_voxels_in_folded_regions(tmp_path, blend):
    """Stride 2: tiles overlap so many times that a region's parts are folded into float64 sums; a voxel one
    tile covers is still its prediction rounded half to even, as blend_parts gives it, not rint(w * v / w)."""
    data = (np.random.default_rng(2).integers(0, 200, (16, 30, 22)) + 0.5).astype("f4")
    zarr.create_array(str(tmp_path / "in.zarr"), shape=data.shape, chunks=(8, 8, 8), dtype=data.dtype)[:] = data
    grid = stoker.TileGrid([str(tmp_path / "in.zarr")], (12, 12, 12), stride=(2, 2, 2))
    writer = stoker.TileWriter(str(tmp_path / "o.zarr"), data.shape, (8, 8, 8), "u1", blend=blend,
                               grid=grid, write_threads=0)
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    for samples, x in stoker.CropDataset(grid, cfg, with_samples=True):
        writer.write(samples, x)
    writer.close()
    got = zarr.open_array(str(tmp_path / "o.zarr"), mode="r")[:].astype(int)
    count = np.zeros(data.shape, dtype=int)
    for i in range(len(grid)):
        count[tuple(slice(a, b) for a, b in grid.sample(0, i).aabb)] += 1
    want = np.rint(data).astype(int)
    once = count == 1
    assert once.any()
    bad = np.argwhere(once & (got != want))
    assert len(bad) == 0, f"{len(bad)} of {once.sum()} once-covered voxels differ, e.g. {bad[:3].tolist()}"
    assert np.abs(got - want)[count >= 2].max() <= 1
