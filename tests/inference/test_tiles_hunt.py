"""TileGrid and TileWriter against an independent oracle, where the other tests do not look: padded tiles whose
cropped boxes are clipped to the same start, ... Tiny volumes, written and read back by zarr-python."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import stoker
from stoker.sampling.sample import box_of

pytestmark = pytest.mark.timeout(120)


def _source(tmp_path, data, fill=0.0):
    uri = str(tmp_path / "in.zarr")
    zarr.create_array(uri, shape=data.shape, chunks=data.shape, dtype=data.dtype, fill_value=fill)[:] = data
    return uri


def _tiles(grid):
    return [grid.sample(0, i) for i in range(len(grid))]


def _write(out, grid, samples, predict, shape, chunks, dtype="f4", batch=2, **kw):
    writer = stoker.TileWriter(out, shape, chunks, dtype, grid=grid, write_threads=0, **kw)
    for i in range(0, len(samples), batch):
        part = samples[i:i + batch]
        writer.write(part, np.stack([predict(s) for s in part]))
    writer.close()
    return zarr.open_array(out, mode="r")[:]


def test_blend_none_ties_between_padded_tiles_do_not_depend_on_their_order(tmp_path):
    """With crop below a padded grid's margin, the kept boxes of the first tiles are clipped to the same start
    (0): which of them wins must not depend on the order they come in (batches, ranks, restarts); the earliest
    tile of the grid does."""
    data = np.arange(5, dtype="f4")
    grid = stoker.TileGrid([_source(tmp_path, data)], (5,), stride=(1,), pad="zero")  # tiles at -2..2
    tiles = _tiles(grid)
    kept = [max(box_of(s)[0][0], 0) for s in tiles]
    assert kept[:3] == [0, 0, 0]  # three tiles whose kept boxes start at voxel 0

    def predict(s):
        return np.full(5, 10 * (box_of(s)[0][0] + 2), "f4")  # each tile its own value

    forward = _write(str(tmp_path / "a.zarr"), grid, tiles, predict, (5,), (5,), blend="none", crop=0)
    backward = _write(str(tmp_path / "b.zarr"), grid, tiles[::-1], predict, (5,), (5,), blend="none", crop=0)
    np.testing.assert_array_equal(forward, backward)
    # the earliest tile covering each voxel wins: -2 (kept 0..3), then -1 (0..4), then 0 (0..5)
    np.testing.assert_array_equal(forward, [0, 0, 0, 10, 20])


@pytest.mark.parametrize("blend", ["none", "hann"])
def test_bfloat16_predictions_are_written_as_their_values(tmp_path, blend):
    """A model run in bfloat16 (Config(dtype="bf16"), autocast) predicts bfloat16, which numpy has no type for:
    the writer takes it as the float32 values it holds, as it takes float16."""
    import torch

    data = np.random.default_rng(1).random((6, 7)).astype("f4")
    grid = stoker.TileGrid([_source(tmp_path, data)], (4, 4), stride=(2, 3))
    tiles = _tiles(grid)

    def predict(s):
        return data[tuple(slice(a, b) for a, b in box_of(s))]

    want = _write(str(tmp_path / "f32.zarr"), grid, tiles, lambda s: torch.from_numpy(predict(s)).bfloat16().float()
                  .numpy(), data.shape, (3, 3), blend=blend)
    writer = stoker.TileWriter(str(tmp_path / "bf16.zarr"), data.shape, (3, 3), "f4", blend=blend, grid=grid,
                               write_threads=0)
    for i in range(0, len(tiles), 3):
        writer.write(tiles[i:i + 3], torch.stack([torch.from_numpy(predict(s)) for s in tiles[i:i + 3]]).bfloat16())
    writer.close()
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "bf16.zarr"), mode="r")[:], want)


def _job(out, grid, data, scale, **kw):
    """A whole job: the tiles still pending predicted (``scale`` times the input) and written."""
    writer = stoker.TileWriter(out, data.shape, (3, 3), "f4", grid=grid, write_threads=0, **kw)
    todo = writer.pending(grid)
    for i in range(len(todo)):
        s = todo.sample(0, i)
        writer.write([s], data[tuple(slice(a, b) for a, b in box_of(s))][None] * scale)
    writer.close()
    return writer, zarr.open_array(out, mode="r")[:]


def test_an_array_removed_to_start_over_is_written_again_whatever_its_old_record(tmp_path):
    """The record beside an array vouches for regions of that array: once the array is removed (to start
    over), a writer that makes it anew writes every region, not none (its old marks would leave the fill
    value without a word)."""
    import shutil

    data = np.random.default_rng(2).random((6, 7)).astype("f4")
    grid = stoker.TileGrid([_source(tmp_path, data)], (4, 4), stride=(2, 3))
    out = str(tmp_path / "out.zarr")
    _, first = _job(out, grid, data, 1.0)
    np.testing.assert_array_equal(first, data)
    shutil.rmtree(out)
    writer, again = _job(out, grid, data, 2.0)
    np.testing.assert_array_equal(again, 2 * data)
    assert writer.written == 2 * 3
    _, resumed = _job(out, grid, data, 3.0)  # the array is there: its regions are written, and skipped
    np.testing.assert_array_equal(resumed, 2 * data)


@pytest.mark.parametrize("pad, crop, hole", [(None, 2, "4..5"), ("zero", 2, "0..0"), (None, (3,), "3..8")])
def test_a_crop_that_leaves_voxels_no_tile_writes_is_refused(tmp_path, pad, crop, hole):
    """Tiles of 6 every 4 keep a centre of 6 - 2 * crop: with crop > (6 - 4) // 2 the centres no longer meet,
    and the voxels between them would keep the fill value without a word. With grid= the writer knows,
    and refuses before it makes anything (a smaller crop is then not refused as other settings)."""
    data = np.arange(1, 13, dtype="f4")
    grid = stoker.TileGrid([_source(tmp_path, data)], (6,), stride=(4,), pad=pad)
    out = str(tmp_path / "out.zarr")
    with pytest.raises(stoker.InvalidArgument, match=f"voxels {hole} of axis 0") as e:
        stoker.TileWriter(out, data.shape, (12,), "f4", crop=crop, grid=grid)
    assert e.value.knob == "crop" and "(sample_shape - stride) // 2 = (1,)" in str(e.value)
    assert not (tmp_path / "out.zarr").exists()

    def predict(s):
        a, b = box_of(s)[0]
        return np.pad(data, (6, 6))[a + 6:b + 6]

    got = _write(out, grid, _tiles(grid), predict, data.shape, (12,), crop=1)  # the centres meet: all written
    np.testing.assert_array_equal(got, data)


def test_a_grid_with_gaps_of_its_own_is_not_refused(tmp_path):
    """A stride past the tile leaves gaps on purpose (TileGrid's docstring): the writer does not refuse the
    crop for voxels no tile covers, and says in a warning which keep the fill value."""
    data = np.arange(1, 13, dtype="f4")
    grid = stoker.TileGrid([_source(tmp_path, data)], (3,), stride=(5,))  # tiles at 0, 5 and 9 (the last shifted)
    with pytest.warns(UserWarning, match=r"voxels 3\.\.4 of axis 0 \(and 1 more on it\) are in no tile"):
        got = _write(str(tmp_path / "out.zarr"), grid, _tiles(grid), lambda s: data[slice(*box_of(s)[0])],
                     data.shape, (12,), crop=0, fill_value=-1)
    np.testing.assert_array_equal(got, np.where(np.isin(np.arange(12), [3, 4, 8]), -1, data))


def test_several_ranks_without_their_process_group_are_refused(tmp_path):
    """A region's parts from other ranks reach its owner through the process group's all_gather: a
    world_size given without a group of that many ranks would drop them, and each rank would write its regions
    with only its own tiles (18 of 42 voxels wrong here before). Refused before anything is made."""
    with pytest.raises(stoker.InvalidArgument, match="world_size=2") as e:
        stoker.TileWriter(str(tmp_path / "out.zarr"), (6, 7), (3, 3), "f4", rank=0, world_size=2)
    assert e.value.knob == "world_size"
    assert not (tmp_path / "out.zarr").exists()
    stoker.TileWriter(str(tmp_path / "out.zarr"), (6, 7), (3, 3), "f4", rank=0, world_size=1).close()


@pytest.mark.parametrize("blend", ["none", "hann"])
@pytest.mark.parametrize("threads", [0, 2])
def test_regions_closed_without_all_their_tiles_are_written_but_not_marked(tmp_path, blend, threads):
    """close() in a finally block after an interrupted loop writes the regions still open, some without all
    their tiles: marked, a restart would skip them and keep them wrong (here 6 of 42 voxels at the fill
    value). With grid= the writer knows which are incomplete, and leaves them to the restart."""
    data = np.random.default_rng(4).random((6, 7)).astype("f4") + 1
    grid = stoker.TileGrid([_source(tmp_path, data)], (4, 4), stride=(2, 3))
    out = str(tmp_path / "out.zarr")

    def run(stop=None):
        writer = stoker.TileWriter(out, data.shape, (3, 3), "f4", blend=blend, grid=grid, write_threads=threads)
        todo = writer.pending(grid)
        try:
            for i in range(len(todo) if stop is None else stop):
                s = todo.sample(0, i)
                writer.write([s], data[tuple(slice(a, b) for a, b in box_of(s))][None])
        finally:
            writer.close()
        return writer

    first = run(stop=3)  # interrupted after 3 of the 4 tiles
    written = zarr.open_array(out, mode="r")[:]
    assert (written == 0).any() and (written == data).any()  # the incomplete regions were written as they are
    assert first.done == first.record.done() and len(first.done) < 2 * 3
    restarted = run()
    assert restarted.written == 2 * 3 - len(first.done)
    np.testing.assert_allclose(zarr.open_array(out, mode="r")[:], data, rtol=2e-7, atol=0)


def test_a_grid_over_fields_is_a_typed_refusal(tmp_path):
    """grid= takes a grid over arrays (its tiles are the predictions' boxes); one over fields has a box per field,
    and was an AttributeError."""
    data = np.zeros((8, 8), "f4")
    raw, labels = _source(tmp_path, data), str(tmp_path / "labels.zarr")
    zarr.create_array(labels, shape=(8, 8), chunks=(8, 8), dtype="u1")
    grid = stoker.TileGrid({"raw": stoker.Field(raw, (6, 6)), "labels": stoker.Field(labels, (4, 4), offset=(1, 1))},
                           stride=(4, 4))
    with pytest.raises(stoker.InvalidArgument, match="over fields") as e:
        stoker.TileWriter(str(tmp_path / "out.zarr"), (8, 8), (4, 4), "f4", grid=grid)
    assert e.value.knob == "grid" and not (tmp_path / "out.zarr").exists()
