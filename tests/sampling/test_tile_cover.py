"""TileGrid covers every voxel: the last tile of an axis ends at the border; a grid's epoch is never cut short
(no tile dropped by a rank split, the last batch at its true size); batches say where their crops came from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import stoker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("cover")
    data = np.arange(13 * 29 * 7, dtype="float32").reshape(13, 29, 7)
    a = zarr.create_array(str(root / "v.zarr"), shape=data.shape, chunks=(5, 8, 7), dtype="float32")
    a[:] = data
    return str(root / "v.zarr"), data


def _covered(grid, shape):
    hits = np.zeros(shape, dtype=np.int64)
    for i in range(len(grid)):
        s = grid.sample(0, i)
        hits[tuple(slice(a, b) for a, b in s.aabb)] += 1
    return hits


@pytest.mark.parametrize("tile,stride", [((6, 8, 7), (4, 5, 7)), ((6, 8, 3), None), ((13, 29, 7), None),
                                         ((4, 4, 4), (3, 4, 2))])
def test_every_voxel_is_covered_and_tiles_stay_in_bounds(volume, tile, stride):
    uri, data = volume
    grid = stoker.TileGrid([uri], tile, stride=stride)
    hits = _covered(grid, data.shape)
    assert hits.min() >= 1  # nothing left out: the old grid left the remainder of each axis out
    st = stride or tile
    for i in range(len(grid)):
        aabb = grid.sample(0, i).aabb
        assert all(0 <= a and b <= n and b - a == t for (a, b), n, t in zip(aabb, data.shape, tile))
        # tiles start every stride, the last one of an axis at the border
        assert all(a % s == 0 or b == n for (a, b), s, n in zip(aabb, st, data.shape))
    assert len(set(grid.sample(0, i) for i in range(len(grid)))) == len(grid)


def test_the_segmentation_case_covers_the_volume(tmp_path):
    """96^3 tiles at stride 56 over 128x256x256: the issue's case, whose windows used to cover 50-66%."""
    uri = str(tmp_path / "big.zarr")
    zarr.create_array(uri, shape=(128, 256, 256), chunks=(64, 128, 128), dtype="u1")
    grid = stoker.TileGrid([uri], (96, 96, 96), stride=(56, 56, 56))
    assert len(grid) == 2 * 4 * 4
    assert _covered(grid, (128, 256, 256)).min() == 1
    starts = sorted({grid.sample(0, i).aabb[1][0] for i in range(len(grid))})
    assert starts == [0, 56, 112, 160]  # the last one shifted back from 168 to end at 256


def test_an_array_shorter_than_the_tile_is_named_not_dropped_silently(volume, tmp_path):
    """A grid over several volumes, one of them shorter than the tile on an axis, gave that volume no tile and
    said nothing: an evaluation or inference run skipped it whole. A warning names it now (and pad= tiles it);
    a grid whose arrays all hold a tile warns nothing."""
    uri, data = volume
    small = str(tmp_path / "small.zarr")
    zarr.create_array(small, shape=(5, 29, 7), chunks=(5, 8, 7), dtype="float32")
    with pytest.warns(UserWarning, match=r"1 of 2 arrays .* no tile.*small\.zarr \(5, 29, 7\).*pad="):
        grid = stoker.TileGrid([uri, small], (6, 8, 7), stride=(4, 5, 7))
    assert {grid.sample(0, i).uri for i in range(len(grid))} == {uri}
    padded = stoker.TileGrid([uri, small], (6, 8, 7), stride=(4, 5, 7), pad="zero")
    assert {padded.sample(0, i).uri for i in range(len(padded))} == {uri, small}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stoker.TileGrid([uri, uri], (6, 8, 7), stride=(4, 5, 7))


def test_a_grid_that_fits_keeps_its_tiles_and_fingerprint_kind(volume):
    uri, _ = volume
    fits = stoker.TileGrid([uri], (13, 29, 7))
    assert "cover-border" not in fits.identity()
    shifted = stoker.TileGrid([uri], (6, 8, 7), stride=(4, 5, 7))
    assert "cover-border" in shifted.identity()  # a state of the old, shorter grid is not resumed into it


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_rank_split_never_loses_a_tile(volume, world):
    uri, _ = volume
    grid = stoker.TileGrid([uri], (6, 8, 7), stride=(4, 5, 7), shuffle=True, seed=2)
    with pytest.raises(stoker.InvalidArgument, match="even='wrap'"):
        grid.for_rank(0, world, even="drop")
    shares = [list(grid.for_rank(r, world)) for r in range(world)]
    assert len({len(s) for s in shares}) == 1
    assert set(s for share in shares for s in share) == set(grid.sample(0, i) for i in range(len(grid)))


def test_the_last_batch_of_a_grid_comes_whole_whatever_drop_last(volume):
    uri, data = volume
    grid = stoker.TileGrid([uri], (6, 8, 7), stride=(4, 5, 7))
    assert len(grid) % 4  # a short last batch
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", drop_last=True, n_compute_threads=1)
    ds = stoker.CropDataset(grid.for_rank(0, 1), cfg, copy=True, with_samples=True)
    assert len(ds) == -(-len(grid) // 4)
    got = list(ds)
    assert [len(s) for s, _ in got][-1] == len(grid) % 4
    seen = [s for samples, _ in got for s in samples]
    assert seen == [grid.sample(0, i) for i in range(len(grid))]
    for samples, x in got:  # each crop is the data of the box its sample names
        for s, crop in zip(samples, x):
            np.testing.assert_array_equal(crop.numpy(), data[tuple(slice(a, b) for a, b in s.aabb)])


@pytest.mark.parametrize("push", ["grid", "rank share", "forever"])
def test_a_bare_pipeline_keeps_a_grids_short_last_batch_whatever_drop_last(volume, push):
    """A Pipeline fed a TileGrid (not through CropDataset) launches the epoch's short last batch under the
    default drop_last=True: it dropped the last tiles without a word. Other sources still drop it."""
    uri, data = volume
    grid = stoker.TileGrid([uri], (6, 8, 7), stride=(4, 5, 7))
    assert len(grid) % 4  # a short last batch
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    assert cfg.drop_last
    source = {"grid": grid, "rank share": grid.for_rank(0, 1), "forever": grid.for_rank(0, 1)}[push]
    with stoker.Pipeline(cfg) as p:
        if push == "forever":  # endless: epochs run on; a batch never ends at an epoch's end, so none is short
            p.push(source.forever())
            batches = [(list(b.samples), torch.from_dlpack(b).numpy().copy()) for b in p.batches(-(-2 * len(grid) // 4))]
        else:
            p.push(source)
            batches = [(list(b.samples), torch.from_dlpack(b).numpy().copy()) for b in p]
    seen = [s for samples, _ in batches for s in samples]
    if push == "forever":
        assert all(len(samples) == 4 for samples, _ in batches)
        assert seen[:len(grid)] == [grid.sample(0, i) for i in range(len(grid))]
    else:
        assert [len(samples) for samples, _ in batches][-1] == len(grid) % 4
        assert seen == [grid.sample(0, i) for i in range(len(grid))]
    for samples, x in batches:
        for s, crop in zip(samples, x):
            np.testing.assert_array_equal(crop, data[tuple(slice(a, b) for a, b in s.aabb)])


def test_a_bare_pipeline_still_drops_a_short_batch_of_other_sources(volume):
    uri, _ = volume
    crops = stoker.RandomCrops([uri], (6, 8, 7), seed=0, samples_per_epoch=9)
    boxes = [stoker.Sample(uri, [(0, 6), (0, 8), (0, 7)])] * 9
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    for source in (crops, crops.for_rank(0, 1), boxes, iter(boxes)):
        with stoker.Pipeline(cfg) as p:
            p.push(source)
            assert [len(b.samples) for b in p] == [4, 4]


def test_crop_batches_yield_samples_with_their_batches(volume):
    uri, data = volume
    grid = stoker.TileGrid([uri], (6, 8, 7), stride=(4, 5, 7))
    cfg = stoker.Config(batch_size=3, dtype="f32", device="cpu", n_compute_threads=1)
    from stoker.train.data import CropBatches

    with CropBatches(grid.for_rank(0, 1), cfg, with_samples=True) as data_:
        it = iter(data_)
        for k in range(3):
            samples, x = next(it)
            assert list(samples) == [grid.sample(0, 3 * k + j) for j in range(3)]
            for s, crop in zip(samples, x):
                np.testing.assert_array_equal(crop.numpy(), data[tuple(slice(a, b) for a, b in s.aabb)])
