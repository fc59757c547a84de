"""Samplers with ``pad=``: TileGrid's sliding-window layout (tile centres tile the array, tiles reach past the
borders), written back by TileWriter with every voxel exactly once; RandomCrops and SampleList carrying
padded samples through the pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.errors import InvalidArgument

pytestmark = pytest.mark.timeout(180)

SHAPE = (13, 29, 7)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("padvol")
    data = np.random.default_rng(3).random(SHAPE).astype("f4")
    a = zarr.create_array(str(root / "v.zarr"), shape=SHAPE, chunks=(5, 8, 4), dtype="f4", fill_value=-2.0)
    a[:] = data
    return str(root / "v.zarr"), data


def _np_pad(data, box, mode, fill=-2.0):
    before = [max(0, -a) for a, _ in box]
    after = [max(0, b - n) for (_, b), n in zip(box, data.shape)]
    named = {"zero": "constant", "fill": "constant"}.get(mode, mode)
    kw = {"constant_values": fill if mode == "fill" else 0} if named == "constant" else {}
    return np.pad(data, list(zip(before, after)), mode=named, **kw)[
        tuple(slice(a + k, b + k) for (a, b), k in zip(box, before))]


@pytest.mark.parametrize("tile,stride", [((6, 8, 7), (4, 6, 3)), ((16, 10, 9), (10, 4, 1)), ((4, 4, 4), (4, 4, 4))])
def test_tile_centres_tile_the_array_exactly(volume, tile, stride):
    uri, _ = volume
    grid = stoker.TileGrid([uri], tile, stride=stride, pad="zero")
    margin = [(t - s) // 2 for t, s in zip(tile, stride)]
    assert len(grid) == np.prod([-(-n // s) for n, s in zip(SHAPE, stride)])
    hits = np.zeros(SHAPE, np.int64)
    for i in range(len(grid)):
        s = grid.sample(0, i)
        assert s.pad == "zero" and s.shape == tile
        assert all((a + m) % st == 0 for (a, _), m, st in zip(s.aabb, margin, stride))  # start every stride
        centre = [(max(a + m, 0), min(b - m, n)) for (a, b), m, n in zip(s.aabb, margin, SHAPE)]
        hits[tuple(slice(a, b) for a, b in centre)] += 1
    assert (hits == 1).all()  # every voxel in exactly one centre (the tile less its margins)
    first, last = grid.sample(0, 0).aabb, grid.sample(0, len(grid) - 1).aabb
    assert [a for a, _ in first] == [-m for m in margin]
    assert all(b - m >= n for (_, b), m, n in zip(last, margin, SHAPE))  # the last centres reach the far border


def test_an_axis_shorter_than_a_tile_gets_tiles(volume):
    uri, _ = volume
    grid = stoker.TileGrid([uri], (20, 8, 10), stride=(16, 8, 6), pad="edge")  # 13 < 20, 7 < 10
    assert stoker.TileGrid([uri], (6, 8, 7), pad=False).pad is None
    assert len(grid) == 1 * 4 * 2
    assert grid.sample(0, 0).aabb == ((-2, 18), (0, 8), (-2, 8))


def test_pad_settings_are_checked(volume):
    uri, _ = volume
    with pytest.raises(InvalidArgument, match="pad must be"):
        stoker.TileGrid([uri], (6, 8, 7), pad=True)
    with pytest.raises(InvalidArgument, match="exceeds the tile") as e:
        stoker.TileGrid([uri], (6, 8, 7), stride=(7, 8, 7), pad="zero")
    assert e.value.knob == "stride"
    plain, padded = stoker.TileGrid([uri], (6, 8, 7)), stoker.TileGrid([uri], (6, 8, 7), pad="reflect")
    assert plain.fingerprint != padded.fingerprint  # a saved position is not resumed into the other


@pytest.mark.parametrize("mode", ["zero", "fill", "reflect", "edge"])
def test_the_identity_model_writes_back_the_array(volume, tmp_path, mode):
    """Padded tiles through the pipeline (each crop numpy.pad's), then TileWriter with crop = the margin and
    blend='none': every voxel written exactly once, by the tile whose centre holds it."""
    uri, data = volume
    tile, stride = (7, 10, 6), (3, 6, 2)  # margins 2, 2, 2
    grid = stoker.TileGrid([uri], tile, stride=stride, pad=mode)
    out = str(tmp_path / "out.zarr")
    writer = stoker.TileWriter(out, SHAPE, (4, 8, 4), "f4", blend="none", crop=2, grid=grid, rank=0,
                               world_size=1, fill_value=np.nan)
    cfg = stoker.Config(batch_size=5, dtype="f32", device="cpu", n_compute_threads=1)
    seen = 0
    for samples, x in stoker.CropDataset(writer.pending(grid), cfg, with_samples=True):
        for s, crop in zip(samples, x):
            np.testing.assert_array_equal(crop.numpy(), _np_pad(data, s.aabb, mode))
        writer.write(samples, x)
        seen += len(samples)
    writer.close()
    assert seen == len(grid)
    np.testing.assert_array_equal(zarr.open_array(out, mode="r")[:], data)  # no NaN left: every voxel
    assert writer.written == len(writer.owned_regions())


def test_a_blended_padded_grid_gives_back_the_array(volume, tmp_path):
    uri, data = volume
    grid = stoker.TileGrid([uri], (8, 8, 6), stride=(4, 4, 2), pad="reflect")
    out = str(tmp_path / "out.zarr")
    writer = stoker.TileWriter(out, SHAPE, (5, 8, 4), "f4", blend="hann", crop=1, grid=grid, rank=0, world_size=1)
    cfg = stoker.Config(batch_size=8, dtype="f32", device="cpu", n_compute_threads=1)
    for samples, x in stoker.CropDataset(writer.pending(grid), cfg, with_samples=True):
        writer.write(samples, x)
    writer.close()
    np.testing.assert_allclose(zarr.open_array(out, mode="r")[:], data, rtol=1e-6)


def test_a_list_of_padded_samples_is_not_the_unpadded_list(volume):
    uri, _ = volume
    inside, past = [(7, 13), (20, 26), (0, 6)], [(-2, 4), (0, 6), (1, 7)]
    plain = stoker.SampleList([stoker.Sample(uri, past, pad="zero"), stoker.Sample(uri, inside)])
    zero = stoker.SampleList([stoker.Sample(uri, b, pad="zero") for b in (past, inside)])
    edge = stoker.SampleList([stoker.Sample(uri, b, pad="edge") for b in (past, inside)])
    assert len({plain.fingerprint, zero.fingerprint, edge.fingerprint}) == 3
    unpadded = stoker.SampleList([stoker.Sample(uri, [(0, 6), (0, 6), (1, 7)])])
    assert unpadded.identity()[0] == [uri, ((0, 6), (0, 6), (1, 7))]  # the identity unpadded lists always had


def test_random_crops_with_pad_reach_past_arrays_shorter_than_the_crop(volume):
    uri, data = volume
    with pytest.raises(InvalidArgument, match="pad= lets them"):
        stoker.RandomCrops([uri], (16, 8, 8))
    src = stoker.RandomCrops([uri], (16, 8, 8), seed=4, samples_per_epoch=64, pad="reflect")
    plain, zero = stoker.RandomCrops([uri], (8, 8, 7)), stoker.RandomCrops([uri], (8, 8, 7), pad="zero")
    assert plain.fingerprint != zero.fingerprint
    samples = [src.sample(0, i) for i in range(64)]
    assert all(s.pad == "reflect" for s in samples)
    z0 = {s.aabb[0][0] for s in samples}
    assert z0 <= set(range(-3, 1)) and len(z0) > 1  # 13 voxels in a 16-long crop: starts -3 .. 0
    assert all(0 <= s.aabb[1][0] <= 21 and -1 <= s.aabb[2][0] <= 0 for s in samples)
    cfg = stoker.Config(batch_size=8, dtype="f32", device="cpu", n_compute_threads=1)
    with stoker.Pipeline(cfg) as p:
        p.push(stoker.SampleList(samples[:8]))
        with p.pop() as batch:
            got = torch.from_dlpack(batch).numpy().copy()
    np.testing.assert_array_equal(got, np.stack([_np_pad(data, s.aabb, "reflect") for s in samples[:8]]))


@pytest.mark.parametrize("tile, stride, crop, chunks, pad", [
    ((8, 12, 5), (5, 7, 3), 1, (4, 8, 3), None), ((8, 12, 5), (5, 7, 3), (1, 2, 1), (4, 8, 3), "reflect"),
    ((13, 29, 7), (13, 29, 7), 0, (13, 29, 7), None), ((6, 6, 6), (2, 3, 4), (2, 0, 1), (5, 4, 7), "edge"),
    ((4, 10, 3), (9, 20, 5), 0, (3, 3, 3), None)])
def test_a_grid_s_tiles_are_cut_into_the_parts_box_arithmetic_gives(volume, tmp_path, tile, stride, crop, chunks, pad):
    """Each tile of a grid is cut once, when the writer is made (a tile's regions, parts' boxes and slices of the
    prediction, and where its output box starts): the cuts are what the box arithmetic of :mod:`.blend` gives
    tile by tile (regions_of, region_box, intersect, local, and numpy's flat index), for tiles cut by a crop,
    padded past the array, cropped away whole or shifted back at the far border."""
    import warnings

    from stoker.inference.blend import intersect, local, region_box, regions_of

    uri, _ = volume
    kw = {} if pad is None else {"pad": pad}
    grid = stoker.TileGrid([uri], tile, stride=stride, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a stride past the tile: gaps are said, not refused
        writer = stoker.TileWriter(str(tmp_path / "o.zarr"), SHAPE, chunks, "f4", crop=crop, grid=grid,
                                   write_threads=0)
    assert writer._cuts
    for (aabb, padded), (start, parts) in writer._cuts.items():
        out = writer._out(aabb, padded)
        inside = all(0 <= a < n for (a, _), n in zip(out, SHAPE))
        assert start == (int(np.ravel_multi_index(tuple(a for a, _ in out), SHAPE)) if inside else -1)
        want = []
        for r in regions_of(out, writer.unit):
            box = intersect(out, region_box(r, writer.unit, SHAPE))
            want.append((r, box, (Ellipsis,) + local(box, aabb)))
        assert list(parts) == want, aabb
    writer.close()


def test_a_grid_padded_on_some_axes_is_written_back_whole(volume, tmp_path):
    """TileGrid(pad_axes=(1, 2)): axis 0 tiled as without pad (inside, overlapping, the last tile shifted
    back), axes 1 and 2 padded (centres tile them). TileWriter(grid=) crops axis 0 as an unpadded grid's
    (the border side of a border tile kept): every voxel written, as zarr-python reads the array."""
    uri, data = volume
    grid = stoker.TileGrid([uri], (6, 10, 6), stride=(4, 6, 2), pad="reflect", pad_axes=(1, 2))
    starts = sorted({s.aabb[0] for s in grid})
    assert starts == [(0, 6), (4, 10), (7, 13)] and min(s.aabb[1][0] for s in grid) == -2
    out = str(tmp_path / "out.zarr")
    writer = stoker.TileWriter(out, SHAPE, (5, 8, 4), "f4", blend="none", crop=(1, 2, 2), grid=grid, rank=0,
                               world_size=1, fill_value=np.nan)
    cfg = stoker.Config(batch_size=6, dtype="f32", device="cpu", n_compute_threads=1)
    for samples, x in stoker.CropDataset(writer.pending(grid), cfg, with_samples=True):
        for s, crop in zip(samples, x):
            np.testing.assert_array_equal(crop.numpy(), _np_pad(data, s.aabb, "reflect"))
        writer.write(samples, x)
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(out, mode="r")[:], data)  # no NaN left: every voxel


def test_samples_carry_their_pad_axes_to_a_writer_without_grid(volume, tmp_path):
    """Without grid=, a padded tile was cropped as padded on every axis: on axis 0 (not in pad_axes) the
    border side of a border tile was cropped away, 406 voxels left NaN without a word. The tiles (of a
    TileGrid and of RandomCrops, pickled too) carry their pad_axes, and the writer crops by them."""
    import pickle

    uri, data = volume
    grid = stoker.TileGrid([uri], (6, 10, 6), stride=(4, 6, 2), pad="reflect", pad_axes=(1, 2))
    tile = grid.sample(0, 0)
    assert tile.pad_axes == (1, 2) and pickle.loads(pickle.dumps(tile)).pad_axes == (1, 2)
    assert stoker.RandomCrops([uri], (4, 4, 4), pad="edge", pad_axes=(2,)).sample(0, 0).pad_axes == (2,)
    assert stoker.TileGrid([uri], (6, 10, 6), stride=(4, 6, 2), pad="reflect").sample(0, 0).pad_axes is None
    out = str(tmp_path / "out.zarr")
    writer = stoker.TileWriter(out, SHAPE, (5, 8, 4), "f4", blend="none", crop=(1, 2, 2), rank=0,
                               world_size=1, fill_value=np.nan)
    cfg = stoker.Config(batch_size=6, dtype="f32", device="cpu", n_compute_threads=1)
    for samples, x in stoker.CropDataset(grid, cfg, with_samples=True):
        writer.write(samples, x)
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(out, mode="r")[:], data)  # no NaN left: every voxel


def test_with_grid_the_grid_s_pad_axes_crop_whatever_the_samples_say(volume, tmp_path):
    """With grid=, the tiles were cut and checked for holes by the grid's pad_axes; samples of its boxes that
    say they are padded on every axis were cropped by their own (406 voxels left at the fill value)."""
    uri, data = volume
    grid = stoker.TileGrid([uri], (6, 10, 6), stride=(4, 6, 2), pad="reflect", pad_axes=(1, 2))
    out = str(tmp_path / "out.zarr")
    writer = stoker.TileWriter(out, SHAPE, (5, 8, 4), "f4", blend="none", crop=(1, 2, 2), rank=0,
                               world_size=1, fill_value=np.nan, grid=grid)
    cfg = stoker.Config(batch_size=6, dtype="f32", device="cpu", n_compute_threads=1)
    for samples, x in stoker.CropDataset(grid, cfg, with_samples=True):
        writer.write([stoker.Sample(s.uri, s.aabb, pad="reflect", pad_axes=(0, 1, 2)) for s in samples], x)
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(out, mode="r")[:], data)
