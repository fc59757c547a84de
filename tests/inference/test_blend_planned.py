"""A weighted blend over a grid (``TileWriter(grid=...)``) knows where every region's parts lie: each part's
voxels that it alone covers go straight into the region's output as the part comes, and only its pieces of
the overlaps are kept. The result is the blend of the parts kept whole (the writer without ``grid``), bit for
bit, and the NumPy reference within float32 rounding (tests/inference/test_writer.py)."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.errors import InvalidArgument

pytestmark = pytest.mark.timeout(180)

# 44, 60 and 58 are no whole number of strides past the first tile: the last tiles of each axis are shifted back,
# and their output boxes (the tile less the crop) overlap their neighbours' inside regions, so the planned
# regions have overlaps to blend (with (40, 56, 56) they had none: test_the_layout_has_planned_overlaps)
SHAPE, TILE, STRIDE, CROP, CHUNKS = (44, 60, 58), (24, 24, 24), (16, 16, 16), 4, (16, 16, 16)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A volume whose last tiles are shifted back at the far borders: their output boxes overlap their
    neighbours'."""
    data = np.random.default_rng(11).random(SHAPE).astype("f4") * 200
    uri = str(tmp_path_factory.mktemp("planned") / "in.zarr")
    zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="f4")[:] = data
    return uri, data


def _batches(uri: str) -> list:
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    return grid, [(s, x.clone()) for s, x in stoker.CropDataset(grid, cfg, with_samples=True)]


def _predict(x: torch.Tensor, channels: int) -> torch.Tensor:
    return x if not channels else torch.stack([x * (c + 1) - c for c in range(channels)], 1)


def _write(out: str, batches, blend: str, dtype: str, channels: int, grid=None, keep=None,
           predict=_predict) -> tuple[np.ndarray, int]:
    """The array written, and the voxels of the float32 buffers the writer took (with a u1 output: the copies of
    the parts it kept)."""
    shape = ((channels,) if channels else ()) + SHAPE
    chunks = ((channels,) if channels else ()) + CHUNKS
    writer = stoker.TileWriter(out, shape, chunks, dtype, blend=blend, crop=CROP, grid=grid, write_threads=0)
    take, taken = writer._pool.take, []
    writer._pool.take = lambda shape, dt, zero=True: (taken.append((shape, np.dtype(dt))), take(shape, dt, zero))[1]
    for samples, x in batches:
        if keep is not None:
            rows = [i for i, s in enumerate(samples) if keep(s)]
            samples, x = [samples[i] for i in rows], x[rows]
            if not samples:
                continue
        writer.write(samples, predict(x, channels))
    writer.close()
    return zarr.open_array(out, mode="r")[:], sum(int(np.prod(s)) for s, dt in taken if dt == np.float32)


@pytest.mark.parametrize("blend", ["linear", "hann"])
@pytest.mark.parametrize("dtype", ["f4", "u1"])
@pytest.mark.parametrize("channels", [0, 2])
def test_a_grid_s_parts_are_placed_as_they_come_and_blend_as_kept_whole(source, tmp_path, blend, dtype, channels):
    uri, _ = source
    grid, batches = _batches(uri)
    # a u1 output takes predictions in its range (others are refused, not wrapped): halved and shifted
    predict = _predict if dtype != "u1" else (lambda x, c: _predict(x / 2, c) + 1)
    planned, kept_planned = _write(str(tmp_path / "planned.zarr"), batches, blend, dtype, channels, grid=grid,
                                   predict=predict)
    whole, kept_whole = _write(str(tmp_path / "whole.zarr"), batches, blend, dtype, channels, predict=predict)
    np.testing.assert_array_equal(planned, whole)
    if dtype == "u1":  # the outputs are no float32 buffers: those are the parts' copies
        # the planned regions keep only the parts' pieces of the overlaps (a few regions here, whose pieces
        # would outgrow float64 sums, keep their parts whole): fewer voxels than the parts
        assert kept_planned < 0.8 * kept_whole, (kept_planned, kept_whole)


def test_a_region_closed_without_all_its_tiles_is_filled_where_none_came(source, tmp_path):
    """Tiles left out (a job stopped early, then closed): the voxels no written tile reached take the fill
    value, the rest is the blend of the tiles that came, as without ``grid``."""
    uri, _ = source
    grid, batches = _batches(uri)

    def keep(s):
        return s.aabb[2][0] != 16  # one column of tiles never written

    planned, _ = _write(str(tmp_path / "planned.zarr"), batches, "hann", "f4", 0, grid=grid, keep=keep)
    whole, _ = _write(str(tmp_path / "whole.zarr"), batches, "hann", "f4", 0, keep=keep)
    np.testing.assert_array_equal(planned, whole)
    assert (whole == 0).any()


def test_the_layout_has_planned_overlaps(source, tmp_path):
    """The tests above run the planned regions' blending of overlaps (not only the copies of once-covered
    voxels): the layout has regions whose parts overlap."""
    uri, _ = source
    grid, _ = _batches(uri)
    writer = stoker.TileWriter(str(tmp_path / "o.zarr"), SHAPE, CHUNKS, "f4", blend="hann", crop=CROP, grid=grid,
                               write_threads=0)
    writer.pending(grid)
    plans = [writer._plan(r, np.dtype("f4")) for r in writer._boxes]
    assert sum(len(p.several) for p in plans if p is not None) > 0


def _column_left_out(s) -> bool:
    return s.aabb[2][0] != 16 and s.aabb[1][0] != 32  # some tiles never written: parts of planned overlaps missing


def _f8(x: torch.Tensor, channels: int) -> torch.Tensor:
    return x.double() / 3.0  # float64 values with full mantissas: w * v / w is an ulp off v for some


def _halves(x: torch.Tensor, channels: int) -> torch.Tensor:
    return torch.floor(x) + 0.5  # every value an exact half: w * v / w rounds the other way for some


@pytest.mark.parametrize("complete", [True, False])
@pytest.mark.parametrize("dtype, predict", [("f8", _f8), ("u1", _halves)])
def test_planned_equals_whole_bit_for_bit_with_tiles_missing(source, tmp_path, complete, dtype, predict):
    """A region closed without all its tiles: a voxel of a planned overlap that one part that came covers is
    that part's value (as the writer without ``grid`` gives it), not the weighted mean of one part."""
    uri, _ = source
    grid, batches = _batches(uri)
    keep = None if complete else _column_left_out
    planned, _ = _write(str(tmp_path / "p.zarr"), batches, "hann", dtype, 0, grid=grid, keep=keep, predict=predict)
    whole, _ = _write(str(tmp_path / "w.zarr"), batches, "hann", dtype, 0, keep=keep, predict=predict)
    np.testing.assert_array_equal(planned, whole)


def _shifted(x: torch.Tensor, samples) -> torch.Tensor:
    """Each tile's prediction differs from its neighbours' (its start added): a tile dropped shows."""
    return x + torch.tensor([float(sum(a for a, _ in s.aabb)) for s in samples]).view(-1, 1, 1, 1)


def _refusing(out: str, grid, batches, bad, world: int = 1, rank: int = 0) -> np.ndarray:
    writer = stoker.TileWriter(out, SHAPE, CHUNKS, "f4", blend="hann", crop=CROP, grid=grid, write_threads=0,
                               rank=rank, world_size=world)
    if bad is not None:
        with pytest.raises(InvalidArgument, match="no tile of the grid"):
            writer.write([batches[0][0][0], bad] if rank == world - 1 else [batches[0][0][0]],
                         batches[0][1][:2] if rank == world - 1 else batches[0][1][:1])
    for i, (samples, x) in enumerate(batches):
        if i % world == rank:
            writer.write(samples, _shifted(x, samples))
        elif world > 1:
            writer.write([], x[:0])  # write() is collective: every rank calls it once per batch
    writer.close()
    return zarr.open_array(out, mode="r")[:]


def test_a_refused_batch_changes_nothing(source, tmp_path):
    """A batch with a prediction for a box the grid has not is refused whole before any of it is taken: a
    caller that goes on gets the array of a clean run (counted, the refused tile finished a region a tile
    early, and its last tile was then dropped as written already)."""
    uri, _ = source
    grid, batches = _batches(uri)
    clean = _refusing(str(tmp_path / "clean.zarr"), grid, batches, None)
    bad = stoker.Sample(uri, [(18, 42), (0, 24), (0, 24)])  # in the first regions, no tile of the grid
    np.testing.assert_array_equal(_refusing(str(tmp_path / "after.zarr"), grid, batches, bad), clean)


def _rank_refusing(rank, world, init, uri, out, result):
    import torch.distributed as dist

    grid, batches = _batches(uri)  # every tile on each rank (a dataset in a process group takes its rank's share)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        bad = stoker.Sample(uri, [(18, 42), (0, 24), (0, 24)])
        _refusing(out, grid, batches, bad, world=world, rank=rank)
        with open(f"{result}-{rank}", "w") as f:
            f.write("ok")
    finally:
        dist.destroy_process_group()


def test_a_batch_one_rank_refuses_is_refused_on_every_rank(source, tmp_path):
    """Rank 1's batch holds a foreign tile: both ranks raise for that write() (rank 0 too, though its own
    batch was good: no rank is left waiting on a collective the other skipped), and both go on to write the
    array of a clean run."""
    uri, _ = source
    grid, batches = _batches(uri)
    clean = _refusing(str(tmp_path / "clean.zarr"), grid, batches, None)
    torch.multiprocessing.spawn(_rank_refusing, args=(2, str(tmp_path / "init"), uri, str(tmp_path / "two.zarr"),
                                                      str(tmp_path / "r")), nprocs=2, join=True)
    assert all((tmp_path / f"r-{r}").read_text() == "ok" for r in range(2))
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "two.zarr"), mode="r")[:], clean)


def test_a_prediction_for_a_tile_of_another_grid_is_refused(source, tmp_path):
    uri, _ = source
    grid, batches = _batches(uri)
    writer = stoker.TileWriter(str(tmp_path / "o.zarr"), SHAPE, CHUNKS, "f4", blend="hann", crop=CROP, grid=grid,
                               write_threads=0)
    other = stoker.Sample(uri, [(3, 27), (0, 24), (0, 24)])
    writer.write([batches[0][0][0]], batches[0][1][:1])
    with pytest.raises(InvalidArgument, match="no tile of the grid"):
        writer.write([other], batches[0][1][:1])


@pytest.mark.parametrize("with_grid", [True, False])
@pytest.mark.parametrize("blend", ["linear", "hann"])
def test_a_weighted_writer_holds_no_whole_tile_s_weights(source, tmp_path, blend, with_grid):
    """Each part's weights are the outer product of the axes' windows over it, which the compiled blend makes
    voxel by voxel: a writer blending float parts into a float output never builds a whole tile's weights
    (``blend.weights``: a 96^3 tile's are 7 MiB of float64, a 256^3 tile's 128 MiB, made by every writer and held
    until it is dropped), and writes the same array."""
    import tracemalloc

    uri, _ = source
    grid, batches = _batches(uri)
    whole_tile = int(np.prod(TILE)) * 8  # float64
    tracemalloc.start(8)
    try:
        writer = stoker.TileWriter(str(tmp_path / "o.zarr"), SHAPE, CHUNKS, "f4", blend=blend, crop=CROP,
                                   grid=grid if with_grid else None, write_threads=0)
        for samples, x in batches:
            writer.write(samples, x)
        # numpy's arrays are traced in a domain of their own; the writer's buffers are region-sized (16^3)
        held = [t for t in tracemalloc.take_snapshot().traces
                if t.domain == np.lib.tracemalloc_domain and t.size >= whole_tile]
        writer.close()
    finally:
        tracemalloc.stop()
    assert not held, [[f"{f.filename}:{f.lineno}" for f in t.traceback if "stoker" in f.filename] for t in held]
    got = zarr.open_array(str(tmp_path / "o.zarr"), mode="r")[:]
    want, _ = _write(str(tmp_path / "ref.zarr"), batches, blend, "f4", 0, grid=grid)
    np.testing.assert_array_equal(got, want)
