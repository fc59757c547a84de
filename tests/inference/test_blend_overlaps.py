"""The weighted blends multiply weights only where tiles overlap: a voxel one tile covers is that tile's
prediction (its weighted mean), taken as it is; the overlaps are blended in float64 as the NumPy reference
does (tests/inference/test_writer.py checks every blend against it)."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import stoker
from stoker.inference.blend import coverage

pytestmark = pytest.mark.timeout(120)


def test_coverage_splits_the_union_by_how_many_boxes_cover_it():
    """The pieces are disjoint, non-empty, and cover the union: the first kind where exactly one box does
    (the one named), the second where two or more do."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        def box():
            return tuple(tuple(sorted(rng.choice(11, 2, replace=False).tolist())) for _ in range(3))
        boxes = [box() for _ in range(int(rng.integers(0, 6)))]
        count = np.zeros((11, 11, 11), dtype=int)
        owner = np.full((11, 11, 11), -1)
        for i, b in enumerate(boxes):
            count[tuple(slice(x, y) for x, y in b)] += 1
            owner[tuple(slice(x, y) for x, y in b)] = i
        once, several = coverage(boxes)
        got_once, got_several = np.zeros_like(count), np.zeros_like(count)
        for i, p in once:
            assert all(x < y for x, y in p)
            got_once[tuple(slice(x, y) for x, y in p)] += 1
            assert (owner[tuple(slice(x, y) for x, y in p)] == i).all()
        for p in several:
            assert all(x < y for x, y in p)
            got_several[tuple(slice(x, y) for x, y in p)] += 1
        np.testing.assert_array_equal(got_once, count == 1)
        np.testing.assert_array_equal(got_several, count >= 2)


def _tiles(tmp_path, data, tile, stride):
    zarr.create_array(str(tmp_path / "in.zarr"), shape=data.shape, chunks=(8, 8, 8), dtype=data.dtype)[:] = data
    return stoker.TileGrid([str(tmp_path / "in.zarr")], tile, stride=stride)


@pytest.mark.parametrize("blend", ["linear", "hann"])
def test_regions_without_overlaps_take_no_float64_sums(tmp_path, blend):
    """With ``crop`` the kept centres of a grid's tiles abut (stride = tile - 2 * crop; no tile shifted back
    at the far border): the regions are written from their parts without float64 sums, and its voxels are the predictions bit for
    bit (an identity model)."""
    data = np.random.default_rng(1).random((20, 28, 28)).astype("f4")
    grid = _tiles(tmp_path, data, (12, 12, 12), (8, 8, 8))  # 20 = 12 + 8, 28 = 12 + 2 * 8: no tile shifted back
    writer = stoker.TileWriter(str(tmp_path / "o.zarr"), data.shape, (8, 8, 8), "f4", blend=blend, crop=2,
                               grid=grid, write_threads=0)
    take, sums = writer._pool.take, []
    writer._pool.take = lambda shape, dtype, zero=True: (sums.append(shape) if np.dtype(dtype) == np.float64
                                                         else None, take(shape, dtype, zero))[1]
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    for samples, x in stoker.CropDataset(grid, cfg, with_samples=True):
        writer.write(samples, x)
    writer.close()
    assert writer.written == len(writer.owned_regions()) and sums == []
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "o.zarr"), mode="r")[:], data)


@pytest.mark.parametrize("blend", ["linear", "hann"])
def test_a_voxel_one_tile_covers_is_its_prediction_rounded_half_to_even(tmp_path, blend):
    """An integer output of predictions k + 0.5: where one tile covers a voxel the value is the prediction
    rounded half to even (np.rint), exactly, not a float64 weight product divided by the weight (a hair off
    k + 0.5, which rounds the other way)."""
    data = (np.random.default_rng(2).integers(0, 200, (16, 29, 21)) + 0.5).astype("f4")
    grid = _tiles(tmp_path, data, (12, 12, 12), (8, 8, 8))  # 29 and 21: the last tiles shifted back, overlapping
    writer = stoker.TileWriter(str(tmp_path / "o.zarr"), data.shape, (8, 8, 8), "u1", blend=blend, crop=2,
                               grid=grid, write_threads=0)
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    for samples, x in stoker.CropDataset(grid, cfg, with_samples=True):
        writer.write(samples, x)
    writer.close()
    got = zarr.open_array(str(tmp_path / "o.zarr"), mode="r")[:].astype(int)
    count = np.zeros(data.shape, dtype=int)  # how many tiles' kept boxes cover each voxel (the crop rule)
    for i in range(len(grid)):
        kept = [(a if a == 0 else a + 2, b if b == n else b - 2) for (a, b), n in zip(grid.sample(0, i).aabb,
                                                                                         data.shape)]
        count[tuple(slice(a, b) for a, b in kept)] += 1
    want = np.rint(data).astype(int)
    assert (count == 1).any() and (count >= 2).any() and (count >= 1).all()
    np.testing.assert_array_equal(got[count == 1], want[count == 1])
    assert np.abs(got - want)[count >= 2].max() <= 1  # float64 sums of k + 0.5 may land a hair off the tie
