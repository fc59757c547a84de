"""A weighted blend over a grid (``TileWriter(grid=...)``) knows where every region's parts lie: each part's
voxels that it alone covers go straight into the region's output as the part comes, and only its pieces of
the overlaps are kept. The result is the blend of the parts kept whole (the writer without ``grid``), bit for
bit, and the NumPy reference within float32 rounding (tests/inference/test_writer.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.errors import InvalidArgument

pytestmark = pytest.mark.timeout(180)

SHAPE, TILE, STRIDE, CROP, CHUNKS = (40, 56, 56), (24, 24, 24), (16, 16, 16), 4, (16, 16, 16)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A volume whose last tiles are shifted back at the far borders (40 and 56 are no whole number of strides
    past the first tile): their output boxes overlap their neighbours'."""
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


def _write(out: str, batches, blend: str, dtype: str, channels: int, grid=None, keep=None) -> np.ndarray:
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
        writer.write(samples, _predict(x, channels))
    writer.close()
    if keep is None and grid is not None:
        # the caller's copies of the parts: only their pieces of the overlaps (float32 buffers other than the
        # regions' outputs), far fewer voxels than the parts
        parts = sum(int(np.prod(s)) for s, dt in taken if dt == np.float32 and s != chunks)
        assert parts < 0.5 * int(np.prod(shape)), parts
    return zarr.open_array(out, mode="r")[:]


@pytest.mark.parametrize("blend", ["linear", "hann"])
@pytest.mark.parametrize("dtype", ["f4", "u1"])
@pytest.mark.parametrize("channels", [0, 2])
def test_a_grid_s_parts_are_placed_as_they_come_and_blend_as_kept_whole(source, tmp_path, blend, dtype, channels):
    uri, _ = source
    grid, batches = _batches(uri)
    planned = _write(str(tmp_path / "planned.zarr"), batches, blend, dtype, channels, grid=grid)
    whole = _write(str(tmp_path / "whole.zarr"), batches, blend, dtype, channels)
    assert np.array_equal(planned, whole)


def test_a_region_closed_without_all_its_tiles_is_filled_where_none_came(source, tmp_path):
    """Tiles left out (a job stopped early, then closed): the voxels no written tile reached take the fill
    value, the rest is the blend of the tiles that came, as without ``grid``."""
    uri, _ = source
    grid, batches = _batches(uri)

    def keep(s):
        return s.aabb[2][0] != 16  # one column of tiles never written

    planned = _write(str(tmp_path / "planned.zarr"), batches, "hann", "f4", 0, grid=grid, keep=keep)
    whole = _write(str(tmp_path / "whole.zarr"), batches, "hann", "f4", 0, keep=keep)
    np.testing.assert_allclose(planned, whole, rtol=2e-7, atol=0)
    assert np.array_equal(planned == 0, whole == 0) and (whole == 0).any()


def test_a_prediction_for_a_tile_of_another_grid_is_refused(source, tmp_path):
    uri, _ = source
    grid, batches = _batches(uri)
    writer = stoker.TileWriter(str(tmp_path / "o.zarr"), SHAPE, CHUNKS, "f4", blend="hann", crop=CROP, grid=grid,
                               write_threads=0)
    other = stoker.Sample(uri, [(3, 27), (0, 24), (0, 24)])
    writer.write([batches[0][0][0]], batches[0][1][:1])
    with pytest.raises(InvalidArgument, match="no tile of the grid"):
        writer.write([other], batches[0][1][:1])
