"""TileWriter: blended tile predictions written back to Zarr, checked against a NumPy reference of the same
blend; one rank and two (a real gloo group) give the same array; a killed job restarts to the same array."""

from __future__ import annotations

import datetime
import json
import re
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.inference.record import CompletionRecord
from stoker.inference.writer import WEIGHTED_EXACT
from stoker.sampling.sample import box_of

pytestmark = pytest.mark.timeout(180)

SHAPE = (13, 29, 17)
TILE, STRIDE, CROP = (8, 10, 9), (4, 6, 5), 2


def model(x: torch.Tensor, channels: int) -> torch.Tensor:
    """A tiny 'model' whose output differs per tile position, so blending has something to mix."""
    corner = x[(slice(None),) + (slice(0, 1),) * (x.dim() - 1)]  # elementwise only: the same in any batch size
    y = torch.sin(3 * x) + corner
    return y if channels == 0 else torch.stack([y * (c + 1) for c in range(channels)], dim=1)


# -- the reference: written from the documented rules, independent of stoker.inference ------------------

def _window(blend, n):
    k = np.arange(n, dtype=np.float64)
    if blend == "linear":
        return np.minimum(k + 1, n - k)
    if blend == "hann":
        return 0.5 - 0.5 * np.cos(2 * np.pi * (k + 1) / (n + 1))
    return np.ones(n)


def reference(data, blend, channels, dtype="f4", crop=CROP):
    """Every tile of the grid predicted on the whole array, its margins cropped except on the array's border,
    blended with the documented weights ('none': the tile whose kept box starts first wins)."""
    grid = [(z, y, x) for z in _starts(SHAPE[0], TILE[0], STRIDE[0]) for y in _starts(SHAPE[1], TILE[1], STRIDE[1])
            for x in _starts(SHAPE[2], TILE[2], STRIDE[2])]
    lead = (channels,) if channels else ()
    acc = np.zeros(lead + SHAPE, np.float64)
    wsum = np.zeros(SHAPE, np.float64)
    out = np.zeros(lead + SHAPE, dtype)
    key = np.full(SHAPE, np.inf)
    for corner in grid:
        box = [(c, c + t) for c, t in zip(corner, TILE)]
        pred = model(torch.from_numpy(data[tuple(slice(a, b) for a, b in box)][None]), channels)[0].numpy()
        kept = [(a if a == 0 else a + crop, b if b == n else b - crop) for (a, b), n in zip(box, SHAPE)]
        dst = tuple(slice(a, b) for a, b in kept)
        src = (Ellipsis,) + tuple(slice(k0 - a, k1 - a) for (k0, k1), (a, _) in zip(kept, box))
        if blend == "none":
            start = np.ravel_multi_index([k for k, _ in kept], SHAPE)
            win = key[dst] > start
            key[dst][win] = start
            view = out[(Ellipsis,) + dst]
            view[..., win] = pred[src].astype(dtype)[..., win]
        else:
            w = np.multiply.outer(np.multiply.outer(_window(blend, TILE[0]), _window(blend, TILE[1])),
                                  _window(blend, TILE[2]))[src[1:]]
            acc[(Ellipsis,) + dst] += w * pred[src]
            wsum[dst] += w
    return out if blend == "none" else (acc / wsum).astype(dtype)


def _starts(n, t, s):
    return sorted({min(i * s, n - t) for i in range(-(-(n - t) // s) + 1)})


def run(uri_in, out, blend, channels, world=1, rank=0, stop_after=None, crop=CROP, dtype="f4", **kw):
    grid = stoker.TileGrid([uri_in], TILE, stride=STRIDE)
    shape = ((channels,) if channels else ()) + SHAPE
    chunks = ((channels,) if channels else ()) + (4, 8, 8)
    writer = stoker.TileWriter(out, shape, chunks, dtype, blend=blend, crop=crop, rank=rank, world_size=world,
                               grid=grid, **kw)
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    todo = writer.pending(grid)
    done = 0
    for samples, x in stoker.CropDataset(todo.for_rank(rank, world), cfg, with_samples=True):
        writer.write(samples, model(x, channels))
        done += 1
        if stop_after is not None and done == stop_after:
            # killed mid-way, once the regions finished so far are written and recorded (the background
            # threads write behind, and the sync thread marks them once their chunks are on the disk); nothing
            # more is flushed
            if writer._background is not None:
                writer._background.drain()
            writer._marks.drain()
            assert writer.record.done() == writer.done
            os._exit(3)
    writer.close()
    return writer, len(todo)


@pytest.mark.parametrize("blend", ["none", "linear", "hann"])
@pytest.mark.parametrize("channels", [0, 2])
def test_the_blend_equals_the_numpy_reference(volume, tmp_path, blend, channels):
    uri, data = volume
    writer, _ = run(uri, str(tmp_path / "out.zarr"), blend, channels)
    got = zarr.open_array(str(tmp_path / "out.zarr"), mode="r")[:]
    want = reference(data, blend, channels)
    if blend == "none":
        np.testing.assert_array_equal(got, want)  # bit for bit
    else:
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    assert writer.written == len(writer.owned_regions()) == 4 * 4 * 3  # every region once, all of them


@pytest.mark.parametrize("layout", [dict(zarr_format=2), dict(shards=(8, 16, 16))])
def test_v2_and_sharded_arrays(volume, tmp_path, layout):
    uri, data = volume
    writer, _ = run(uri, str(tmp_path / "out.zarr"), "hann", 0, **layout)
    got = zarr.open_array(str(tmp_path / "out.zarr"), mode="r")
    assert got.metadata.zarr_format == layout.get("zarr_format", 3)
    np.testing.assert_allclose(got[:], reference(data, "hann", 0), rtol=2e-7, atol=0)
    if "shards" in layout:  # a region is a shard: no two writes of one shard
        assert writer.written == 2 * 2 * 2


@pytest.mark.parametrize("with_grid", [True, False])
def test_repeated_tiles_count_once(volume, tmp_path, with_grid):
    """A short rank's wrap-around repeats tiles; a repeat must not weigh twice. The repeats come before the
    regions they touch are finished (a shuffled grid's, or a writer without grid= whose regions all wait for
    close()): repeats after a region is written are skipped as written, not as seen."""
    uri, data = volume
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    w = stoker.TileWriter(str(tmp_path / "o.zarr"), SHAPE, (4, 8, 8), "f4", blend="linear", crop=CROP,
                          grid=grid if with_grid else None)
    tiles = [grid.sample(0, i) for i in range(len(grid))]
    # tiles[1] ahead of its region's other tiles: its kept box overlaps tiles[2]'s (the last of the x axis, shifted
    # back to the border), which comes once, so a repeat weighing twice moves the blend there
    for s in tiles[1:2] + tiles + tiles[:3]:
        w.write([s], model(torch.from_numpy(data[tuple(slice(a, b) for a, b in s.aabb)][None]), 0))
    w.close()
    np.testing.assert_allclose(zarr.open_array(str(tmp_path / "o.zarr"))[:], reference(data, "linear", 0),
                               rtol=2e-7, atol=0)


def test_arguments_are_checked(volume, tmp_path):
    uri, _ = volume
    with pytest.raises(stoker.InvalidArgument, match="blend"):
        stoker.TileWriter(str(tmp_path / "a.zarr"), SHAPE, (4, 8, 8), "f4", blend="gauss")
    w = stoker.TileWriter(str(tmp_path / "b.zarr"), SHAPE, (4, 8, 8), "f4")
    with pytest.raises(stoker.InvalidArgument, match=r"expected \(8, 10, 9\)"):
        w.write([stoker.Sample(uri, [(0, 8), (0, 10), (0, 9)])], np.zeros((1, 2, 8, 10, 9), "f4"))
    with pytest.raises(stoker.InvalidArgument, match="shape"):
        stoker.TileWriter(str(tmp_path / "b.zarr"), (13, 29, 18), (4, 8, 8), "f4")
    with pytest.raises(stoker.InvalidArgument, match="a grid and a writer per array"):
        stoker.TileWriter(str(tmp_path / "c.zarr"), SHAPE, (4, 8, 8), "f4", grid=stoker.TileGrid([uri, uri], TILE))
    with pytest.raises(stoker.InvalidArgument, match="other settings"):
        stoker.TileWriter(str(tmp_path / "b.zarr"), SHAPE, (4, 8, 8), "f4", blend="hann")


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_existing_array_of_other_chunks_or_shards_is_refused(tmp_path, zarr_format):
    """TileWriter(uri, shape, chunks=(4, 8, 8)) over an existing array chunked (8, 8, 8) wrote with the existing
    chunks and said nothing: the caller who asked for other chunks (other regions, other write units) got what
    was there. It is refused now, naming the chunks the array has; the chunks it has are accepted."""
    out = str(tmp_path / "o.zarr")
    zarr.create_array(out, shape=SHAPE, chunks=(8, 8, 8), dtype="f4", zarr_format=zarr_format)
    with pytest.raises(stoker.InvalidArgument, match=r"chunks \(8, 8, 8\), not \(4, 8, 8\)") as err:
        stoker.TileWriter(out, SHAPE, (4, 8, 8), "f4", zarr_format=zarr_format)
    assert err.value.uri == out
    with pytest.raises(stoker.InvalidArgument, match=r"dtype float32, not uint8"):
        stoker.TileWriter(out, SHAPE, (8, 8, 8), "u1", zarr_format=zarr_format)
    stoker.TileWriter(out, SHAPE, (8, 8, 8), "f4", zarr_format=zarr_format).close()
    if zarr_format == 3:  # a sharded array: its inner chunks and its shards are both the caller's to match
        sharded = str(tmp_path / "s.zarr")
        zarr.create_array(sharded, shape=SHAPE, chunks=(4, 8, 8), shards=(8, 16, 16), dtype="f4")
        with pytest.raises(stoker.InvalidArgument, match=r"shards \(8, 16, 16\), not \(4, 16, 16\)"):
            stoker.TileWriter(sharded, SHAPE, (4, 8, 8), "f4", shards=(4, 16, 16))
        stoker.TileWriter(sharded, SHAPE, (4, 8, 8), "f4", shards=(8, 16, 16)).close()


def test_a_group_at_the_uri_is_an_invalid_argument(volume, tmp_path):
    """TileWriter over an OME-Zarr image's root (a group: the user meant a label array inside it) raised
    zarr-python's NodeTypeValidationError, none of stoker's errors; an InvalidArgument naming the URI now, and
    the group is left as it was."""
    root = str(tmp_path / "img.ome.zarr")
    zarr.open_group(root, mode="w").attrs["keep"] = 1
    with pytest.raises(stoker.InvalidArgument, match="img.ome.zarr is a Zarr group") as err:
        stoker.TileWriter(root, SHAPE, (4, 8, 8), "u8")
    assert err.value.uri == root
    assert dict(zarr.open_group(root, mode="r").attrs) == {"keep": 1}


def test_a_shape_the_grid_refuses_makes_no_array(volume, tmp_path):
    """TileWriter(shape=(13, 29), grid=<a 3-d grid>) was refused only after it had made the array, so the call
    with the shape corrected was refused again ("the array there has shape (13, 29)... remove it"); it is
    refused before anything is made now."""
    uri, _ = volume
    out = tmp_path / "o.zarr"
    grid = stoker.TileGrid([uri], TILE)
    with pytest.raises(stoker.InvalidArgument, match="neither the 3-d volume"):
        stoker.TileWriter(str(out), SHAPE[:2], (4, 8), "f4", grid=grid)
    assert not out.exists()
    stoker.TileWriter(str(out), SHAPE, (4, 8, 8), "f4", grid=grid).close()


@pytest.mark.parametrize("shape", [(13, 29, 20), (2, 13, 29, 20), (13, 20, 17)])
def test_a_shape_other_than_the_tiled_arrays_is_refused(volume, tmp_path, shape):
    """TileWriter(shape=...) one voxel wider than the array the grid tiles was taken: the regions past it
    kept the fill value with a warning that blamed the stride ("longer than its tile", which it was not); a
    narrower shape failed only at the first tile past it. Both are refused before anything is made now, as is
    a sharded v2 output (zarr-python's ValueError before)."""
    uri, _ = volume
    out = tmp_path / "o.zarr"
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    with pytest.raises(stoker.InvalidArgument, match=f"grid tiles .* of shape {re.escape(str(SHAPE))}"):
        stoker.TileWriter(str(out), shape, (4, 8, 8)[-len(shape):] if len(shape) == 3 else (2, 4, 8, 8), "f4",
                          grid=grid)
    assert not out.exists()
    with pytest.raises(stoker.InvalidArgument, match="v2 has no shards"):
        stoker.TileWriter(str(out), SHAPE, (4, 8, 8), "f4", shards=(8, 16, 16), zarr_format=2)
    assert not out.exists()
    stoker.TileWriter(str(out), (2,) + SHAPE, (2, 4, 8, 8), "f4", grid=grid).close()


@pytest.mark.parametrize("with_grid", [True, False])
def test_a_fractional_crop_is_refused_not_truncated(volume, tmp_path, with_grid):
    """crop=(1.7, 1, 1) was truncated to (1, 1, 1) and written without a word, and crop=1.5 (or 2.0) failed with a
    TypeError from inside the writer; a fraction is an InvalidArgument naming crop now, before anything is made,
    and a whole float is the int it holds."""
    uri, data = volume
    tiled = stoker.TileGrid([uri], TILE, stride=STRIDE)
    grid = tiled if with_grid else None
    out = tmp_path / "o.zarr"
    for crop in (1.5, (1.7, 1, 1), -1, "2"):
        with pytest.raises(stoker.InvalidArgument, match="crop") as err:
            stoker.TileWriter(str(out), SHAPE, (4, 8, 8), "f4", crop=crop, grid=grid)
        assert getattr(err.value, "knob", "crop") == "crop"
        assert not out.exists()
    for crop, said in ((1.5, "got the float 1.5"), (True, "not a bool"), (-1, "got the int -1")):
        with pytest.raises(stoker.InvalidArgument, match="crop must be an integer >= 0") as err:  # a scalar's
            stoker.TileWriter(str(out), SHAPE, (4, 8, 8), "f4", crop=crop, grid=grid)
        assert said in str(err.value) and "sequence of integers >= 0, got (" not in str(err.value)
    w = stoker.TileWriter(str(out), SHAPE, (4, 8, 8), "f4", crop=2.0, grid=grid, write_threads=0)
    for tile in w.pending(tiled):
        w.write([tile], data[tuple(slice(a, b) for a, b in tile.aabb)][None])
    w.close()  # an identity model whose kept centres (crop 2 = (TILE - STRIDE) // 2) tile the volume
    np.testing.assert_array_equal(zarr.open_array(str(out), mode="r")[:], data)


def test_a_restart_with_another_grid_is_refused(volume, tmp_path):
    # The regions a writer marked hold its grid's tiles blended: a restart over another stride (or tile, or pad)
    # would keep them beside regions of the new grid, a mix no single run makes. Refused as other settings.
    uri, data = volume
    out = str(tmp_path / "o.zarr")
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    w = stoker.TileWriter(out, SHAPE, (4, 8, 8), "f4", blend="linear", crop=CROP, grid=grid)
    s = grid.sample(0, 0)
    w.write([s], model(torch.from_numpy(data[tuple(slice(a, b) for a, b in s.aabb)][None]), 0))
    w.close()
    other = stoker.TileGrid([uri], TILE, stride=tuple(st - 1 for st in STRIDE))
    with pytest.raises(stoker.InvalidArgument, match="other settings"):
        stoker.TileWriter(out, SHAPE, (4, 8, 8), "f4", blend="linear", crop=CROP, grid=other)
    same = stoker.TileWriter(out, SHAPE, (4, 8, 8), "f4", blend="linear", crop=CROP, grid=grid)  # resumes
    same.close()


# -- two ranks, and a restart ------------------------------------------------------------------

def _rank_main(rank, world, init, uri, out, blend, result, dtype="f4"):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        writer, _ = run(uri, out, blend, 2, world=world, rank=rank, dtype=dtype)
        with open(f"{result}-{rank}.json", "w") as f:
            json.dump({"written": writer.written, "owned": [list(r) for r in writer.owned_regions()]}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("blend,dtype", [("none", "f4"), ("hann", "f4"), ("hann", "f8")])
def test_two_ranks_give_the_one_rank_array(volume, tmp_path, blend, dtype):
    uri, data = volume
    one, _ = run(uri, str(tmp_path / "one.zarr"), blend, 2, dtype=dtype)
    torch.multiprocessing.spawn(_rank_main, args=(2, str(tmp_path / "init"), uri, str(tmp_path / "two.zarr"), blend,
                                                  str(tmp_path / "r"), dtype), nprocs=2, join=True)
    a = zarr.open_array(str(tmp_path / "one.zarr"))[:]
    b = zarr.open_array(str(tmp_path / "two.zarr"))[:]
    # bit for bit, float64 output too: a region's parts are summed in the order of their tiles, not as they came
    np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))
    np.testing.assert_allclose(b, reference(data, blend, 2, dtype=dtype), rtol=2e-7, atol=0)
    ranks = [json.loads((tmp_path / f"r-{r}.json").read_text()) for r in range(2)]
    owned = [tuple(x) for r in ranks for x in r["owned"]]
    assert len(owned) == len(set(owned)) == 48  # each region has one owner
    assert all(r["written"] == len(r["owned"]) > 0 for r in ranks)  # and its owner wrote it, once


_KILLED = """
import sys
sys.path.insert(0, {tests!r})
from inference.test_writer import run
run({uri!r}, {out!r}, "hann", 0, stop_after=10, dtype={dtype!r})
"""


@pytest.mark.parametrize("dtype", ["f4", "f8"])
def test_a_killed_job_restarts_to_the_same_array(volume, tmp_path, dtype):
    uri, data = volume
    out = str(tmp_path / "out.zarr")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(tests, "..", "src"), tests])}
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED.format(tests=tests, uri=uri, out=out, dtype=dtype))],
                       env=env, timeout=120)
    assert p.returncode == 3
    done = CompletionRecord(out).done()
    assert 0 < len(done) < 48  # killed mid-way: some regions written, some not
    writer, todo = run(uri, out, "hann", 0, dtype=dtype)
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    assert todo < len(grid)  # the restart predicts only the tiles of regions still to write
    assert writer.written == 48 - len(done)
    got = zarr.open_array(out)[:]
    np.testing.assert_allclose(got, reference(data, "hann", 0, dtype=dtype), rtol=2e-7, atol=0)
    run(uri, str(tmp_path / "whole.zarr"), "hann", 0, dtype=dtype)  # the same job, never killed: the same bits
    whole = zarr.open_array(str(tmp_path / "whole.zarr"))[:]
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), whole.view(f"u{whole.itemsize}"))


def test_without_a_grid_every_region_waits_for_close(volume, tmp_path):
    uri, data = volume
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    out = str(tmp_path / "o.zarr")
    w = stoker.TileWriter(out, SHAPE, (4, 8, 8), "f4", blend="hann", crop=CROP, fill_value=-1)
    for i in range(len(grid)):
        s = grid.sample(0, i)
        w.write([s], model(torch.from_numpy(data[tuple(slice(a, b) for a, b in s.aabb)][None]), 0))
    assert w.written == 0 and (zarr.open_array(out)[:] == -1).all()  # it cannot know a region is complete
    w.close()
    assert w.written == 48
    np.testing.assert_allclose(zarr.open_array(out)[:], reference(data, "hann", 0), rtol=2e-7, atol=0)


@pytest.mark.parametrize("dtype", ["i4", "u1", "i8"])
def test_every_blend_rounds_a_float_prediction_into_an_integer_output(tmp_path, dtype):
    """Float predictions into an integer array are rounded to the nearest by every blend: ``none`` did
    ``astype`` (2.9999998 -> 2, 0.7 -> 0) where ``linear`` and ``hann`` give a voxel one tile covers
    ``np.rint`` of its value, so the blend changed the labels written."""
    values = np.array([2.9999998, 0.7, 1.5, 2.5, 0.49999997, 3.2], np.float32)
    if dtype != "u1":
        values = np.concatenate([values, np.array([-0.7, -2.9999998], np.float32)])
    pred = np.resize(values, (6, 10, 8)).astype(np.float32)
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=(6, 10, 8), chunks=(6, 10, 8), dtype="f4")
    got = {}
    for blend in ("none", "linear", "hann"):
        out = str(tmp_path / f"{blend}.zarr")
        w = stoker.TileWriter(out, (6, 10, 8), (3, 5, 4), dtype, blend=blend, write_threads=0)
        w.write([stoker.Sample(src, [(0, 6), (0, 10), (0, 8)])], pred[None])
        w.close()
        got[blend] = zarr.open_array(out, mode="r")[:]
    want = np.rint(pred).astype(dtype)
    for blend, array in got.items():
        np.testing.assert_array_equal(array, want, err_msg=blend)


@pytest.mark.parametrize("blend", ["none", "hann"])
@pytest.mark.parametrize("dtype,bad", [("f4", 2**40 + 7), ("f2", 2049), ("f8", 2**60 + 12345), ("f4", -(2**24) - 1)])
def test_integer_predictions_a_float_output_would_round_are_refused(tmp_path, blend, dtype, bad):
    """Label ids (int64 predictions) into a float32 array were written rounded without a word: 2**40 + 7 and
    2**40 + 14 became one id, as the pipeline refuses a lossy cast of them. A DtypeMismatch now, the batch not
    taken; integers the float holds exactly (up to 2**24 in float32) are written as they are."""
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=(4, 6), chunks=(4, 6), dtype="f4")
    out = str(tmp_path / "o.zarr")
    w = stoker.TileWriter(out, (4, 6), (2, 3), dtype, blend=blend, write_threads=0)
    sample = stoker.Sample(src, [(0, 4), (0, 6)])
    pred = np.zeros((1, 4, 6), np.int64)
    pred[0, 1, 2] = bad
    with pytest.raises(stoker.DtypeMismatch, match=f"{np.dtype(dtype)}.*integer dtype"):
        w.write([sample], pred)
    exact = 2 ** (np.finfo(dtype).nmant + 1)
    good = np.zeros((1, 4, 6), np.int64)
    good[0, 0, 0], good[0, 3, 5] = exact, -exact
    w.write([sample], good)
    w.close()
    np.testing.assert_array_equal(zarr.open_array(out, mode="r")[:], good[0].astype(dtype))


@pytest.mark.parametrize("out", ["i8", "u8"])
@pytest.mark.parametrize("blend", ["linear", "hann"])
def test_integer_predictions_a_weighted_blend_would_round_are_refused(tmp_path, blend, out):
    """Label ids of 2**50 + 3 (int64 predictions) into an int64 or uint64 array with a weighted blend were
    written one to three off where tiles overlap, without a word: the float64 weighted mean of equal ids,
    rounded, is not the id past about 2**50. A DtypeMismatch now, the batch not taken; ids up to WEIGHTED_EXACT (2**32)
    come back exactly through the same overlaps, and blend='none' keeps every id."""
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=(24, 24), chunks=(24, 24), dtype="u1")
    grid = stoker.TileGrid([src], (9, 11), stride=(2, 3))  # every voxel inside is in several tiles
    for ids, fits in ((2**50 + 3, False), (WEIGHTED_EXACT - 1, True), (WEIGHTED_EXACT, True)):
        path = str(tmp_path / f"o{ids}.zarr")
        w = stoker.TileWriter(path, (24, 24), (8, 8), out, blend=blend, grid=grid, write_threads=0)
        tiles = list(w.pending(grid))
        pred = np.full((1, 9, 11), ids, np.int64)
        if not fits:
            with pytest.raises(stoker.DtypeMismatch, match=f"{blend}.*2\\*\\*32.*blend='none'"):
                w.write(tiles[:1], pred)
            w.close()
            continue
        for tile in tiles:
            w.write([tile], pred)
        w.close()
        np.testing.assert_array_equal(zarr.open_array(path, mode="r")[:], np.full((24, 24), ids, out))
    path = str(tmp_path / "none.zarr")  # the same grid and ids without blending: every id kept
    w = stoker.TileWriter(path, (24, 24), (8, 8), "i8", blend="none", grid=grid, write_threads=0)
    for tile in w.pending(grid):
        w.write([tile], np.full((1, 9, 11), 2**50 + 3, np.int64))
    w.close()
    np.testing.assert_array_equal(zarr.open_array(path, mode="r")[:], np.full((24, 24), 2**50 + 3, np.int64))


@pytest.mark.parametrize("blend", ["none", "hann"])
@pytest.mark.parametrize("dtype,pdtype,bad", [("f2", "f4", 70000.0), ("f2", "f4", -65520.0), ("f2", "f8", 1e300),
                                              ("f4", "f8", 1e39), ("f2", "bf16", 2.0**20)])
def test_finite_predictions_a_narrower_float_output_would_make_infinite_are_refused(tmp_path, blend, dtype, pdtype,
                                                                                     bad):
    """A finite prediction past a narrower float output's largest value (70000.0 into float16, 1e39 into float32)
    was written as infinity, with only numpy's RuntimeWarning, where the pipeline refuses such a cast on reading:
    a DtypeMismatch now, the batch not taken. The largest values that round to a finite one (65519 into float16:
    65504), NaN and infinities are written as they are."""
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=(4, 6), chunks=(4, 6), dtype="f4")
    out = str(tmp_path / "o.zarr")
    w = stoker.TileWriter(out, (4, 6), (2, 3), dtype, blend=blend, write_threads=0)
    sample = stoker.Sample(src, [(0, 4), (0, 6)])
    as_torch = {"bf16": torch.bfloat16, "f4": torch.float32, "f8": torch.float64}[pdtype]
    pred = torch.zeros((1, 4, 6), dtype=as_torch)
    pred[0, 1, 2] = bad
    with pytest.raises(stoker.DtypeMismatch, match=f"infinity in .*{np.dtype(dtype)}"):
        w.write([sample], pred)
    top = float(np.finfo(dtype).max)
    largest = 65519.0 if dtype == "f2" else float(np.nextafter(np.float64(float.fromhex("0x1.ffffffp127")), 0))
    good = torch.zeros((1, 4, 6), dtype=torch.float64)
    good[0, 0, 0], good[0, 0, 1], good[0, 1, 1] = largest, -largest, top
    good[0, 2, 2], good[0, 3, 3], good[0, 3, 4] = float("nan"), float("inf"), -float("inf")
    w.write([sample], good)
    w.close()
    got = zarr.open_array(out, mode="r")[:]
    np.testing.assert_array_equal(got, good[0].numpy().astype(dtype))
    assert got[0, 0] == top and got[0, 1] == -top and np.isfinite(got[0, :2]).all()


@pytest.mark.parametrize("blend", ["none", "hann"])
@pytest.mark.parametrize("dtype,bad", [("u1", 300.0), ("u1", -1.0), ("i4", float("nan")), ("i2", 1e6),
                                       ("i8", float("inf")), ("i8", 2.0**63), ("u1", 255.5), ("u1", 256)])
def test_a_prediction_an_integer_output_cannot_hold_is_refused(tmp_path, blend, dtype, bad):
    """A value that an integer output cannot take once rounded (NaN, infinity, out of range) was written
    wrapped (300.0 into uint8 as 44, NaN into int32 as -2**31): a DtypeMismatch now, the batch not taken, and
    the writer still usable; the extremes that fit are written as they are."""
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=(4, 6), chunks=(4, 6), dtype="f4")
    out = str(tmp_path / "o.zarr")
    w = stoker.TileWriter(out, (4, 6), (2, 3), dtype, blend=blend, write_threads=0)
    sample = stoker.Sample(src, [(0, 4), (0, 6)])
    pred = np.zeros((1, 4, 6), np.float64 if isinstance(bad, float) else np.int64)
    pred[0, 1, 2] = bad
    with pytest.raises(stoker.DtypeMismatch, match=f"do not fit .*{np.dtype(dtype)}"):
        w.write([sample], pred)
    room = np.iinfo(dtype)
    good = np.zeros((1, 4, 6), np.float64)
    good[0, 0, 0], good[0, 3, 5] = room.min, float(room.max) if room.bits < 64 else 2.0**62
    good[0, 2, 2] = room.max + 0.49 if room.bits < 32 else 7.4
    w.write([sample], good)
    w.close()
    np.testing.assert_array_equal(zarr.open_array(out, mode="r")[:], np.rint(good[0]).astype(dtype))


@pytest.mark.parametrize("blend", ["none", "hann"])
@pytest.mark.parametrize("dtype,fill", [("f4", -1.5), ("u1", 255)])
def test_voxels_no_tile_reaches_keep_the_fill_value(volume, tmp_path, blend, dtype, fill):
    """A stride longer than the tile leaves gaps: there the array keeps its fill value, elsewhere the
    predictions (an identity model: its blend is its input, rounded for integers)."""
    uri, data = volume
    grid = stoker.TileGrid([uri], (4, 5, 5), stride=(6, 8, 7))
    out = str(tmp_path / "o.zarr")
    with pytest.warns(UserWarning, match="are in no tile: they keep the fill value"):
        w = stoker.TileWriter(out, SHAPE, (4, 8, 8), dtype, blend=blend, grid=grid, fill_value=fill)
    want = np.full(SHAPE, fill, dtype)
    for i in range(len(grid)):
        s = grid.sample(0, i)
        box = tuple(slice(a, b) for a, b in s.aabb)
        tile = data[box] * 100
        # every tile's values at a voxel are the same (overlaps agree); both blends round to integers
        want[box] = (np.rint(tile) if dtype == "u1" else tile).astype(dtype)
        w.write([s], tile[None])
    w.close()
    got = zarr.open_array(out, mode="r")[:]
    assert (got == fill).any() and (got != fill).any()  # gaps and tiles both
    if dtype == "f4" and blend == "hann":
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


def test_a_region_that_cannot_be_written_is_a_storage_error_and_stays_unmarked(volume, tmp_path):
    uri, data = volume
    out = tmp_path / "o.zarr"
    w = stoker.TileWriter(str(out), SHAPE, (4, 8, 8), "f4")
    (out / "c").write_bytes(b"")  # a file where the chunks' folder goes: every chunk write fails (root too)
    s = stoker.Sample(uri, [(0, 4), (0, 8), (0, 8)])
    w.write([s], data[None, :4, :8, :8])
    with pytest.raises(stoker.StorageError, match=r"o.zarr: writing region \(0, 0, 0\) \(voxels"):
        w.close()
    assert w.record.done() == set() and w.written == 0


@pytest.mark.parametrize("order", ["grid", "reversed", "shuffled"])
def test_blend_none_overlapping_tiles_in_any_order(volume, tmp_path, order):
    """crop 0 and a stride under half the tile: up to 8 tiles overlap a voxel; the tile whose box starts first
    wins it, whatever order the tiles come in (the reference keeps a per-voxel start, the writer boxes)."""
    uri, data = volume
    grid = stoker.TileGrid([uri], TILE, stride=(3, 4, 4))
    samples = [grid.sample(0, i) for i in range(len(grid))]
    if order != "grid":
        samples = samples[::-1] if order == "reversed" else \
            [samples[i] for i in np.random.default_rng(3).permutation(len(samples))]
    out = str(tmp_path / "o.zarr")
    w = stoker.TileWriter(out, SHAPE, (4, 8, 8), "f4", blend="none", fill_value=-1)
    want = np.full(SHAPE, -1, "f4")
    key = np.full(SHAPE, np.iinfo(np.int64).max)
    for i in range(0, len(samples), 5):
        batch = samples[i:i + 5]
        preds = np.stack([data[tuple(slice(a, b) for a, b in box_of(s))] + 1000 * j
                          for j, s in enumerate(batch, start=i)])  # every tile a different value
        w.write(batch, preds)
        for s, p in zip(batch, preds):
            dst = tuple(slice(a, b) for a, b in box_of(s))
            start = np.ravel_multi_index([a for a, _ in box_of(s)], SHAPE)
            win = key[dst] > start
            key[dst][win] = start
            want[dst][win] = p[win]
    w.close()
    np.testing.assert_array_equal(zarr.open_array(out)[:], want)


def test_pending_orders_tiles_so_regions_are_written_from_the_first_batches(tmp_path):
    """The benchmark's shape in small: two tiles deep, every region needs both. In the grid's order no region
    is finished before the second half of the tiles; in pending()'s order regions finish from the first
    batch, so the write threads work beside the reads all along. The array is the same either way."""
    shape = (16, 32, 32)
    data = np.random.default_rng(3).random(shape).astype("f4")
    zarr.create_array(str(tmp_path / "in.zarr"), shape=shape, chunks=(8, 8, 8), dtype="f4")[:] = data
    grid = stoker.TileGrid([str(tmp_path / "in.zarr")], (12, 12, 12), stride=(8, 8, 8))
    writer = stoker.TileWriter(str(tmp_path / "out.zarr"), shape, (8, 8, 8), "f4", crop=2, grid=grid,
                               write_threads=0)
    todo = writer.pending(grid)
    assert sorted(box_of(s) for s in todo) == sorted(box_of(grid.sample(0, i)) for i in range(len(grid)))
    written = []
    cfg = stoker.Config(batch_size=2, dtype="f32", device="cpu", n_compute_threads=1)
    for samples, x in stoker.CropDataset(todo, cfg, with_samples=True):
        writer.write(samples, x)
        written.append(writer.written)
    writer.close()
    half = len(written) // 2
    assert written[0] > 0 and written[half - 1] >= len(writer.owned_regions()) // 3, written
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "out.zarr"), mode="r")[:], data)


def test_pending_gives_each_tile_with_the_first_region_it_touches(tmp_path):
    """pending()'s documented order: regions in C order, each tile with the first region its kept box touches,
    the grid's order within a region. Tiles whose kept boxes span 2 or 3 regions, so grouping them by their last
    region (or any other) gives another order."""
    shape = (16, 32, 32)
    zarr.create_array(str(tmp_path / "in.zarr"), shape=shape, chunks=(8, 8, 8), dtype="f4")
    grid = stoker.TileGrid([str(tmp_path / "in.zarr")], (12, 12, 12), stride=(6, 6, 6))
    writer = stoker.TileWriter(str(tmp_path / "out.zarr"), shape, (8, 8, 8), "f4", crop=0, grid=grid,
                               write_threads=0)
    tiles = [grid.sample(0, i) for i in range(len(grid))]
    order = sorted(range(len(tiles)), key=lambda i: (tuple(a // 8 for a, _ in box_of(tiles[i])), i))
    assert order != sorted(range(len(tiles)), key=lambda i: (tuple((b - 1) // 8 for _, b in box_of(tiles[i])), i))
    assert [box_of(s) for s in writer.pending(grid)] == [box_of(tiles[i]) for i in order]
    writer.close()


def test_subtract_leaves_disjoint_boxes_covering_the_rest():
    """``blend="none"`` copies a part as its box less the boxes that win over it: the pieces are disjoint and
    cover exactly the voxels no other box covers."""
    from stoker.inference.blend import subtract

    rng = np.random.default_rng(5)
    for _ in range(200):
        def box():
            return tuple(tuple(sorted(rng.choice(13, 2, replace=False).tolist())) for _ in range(3))
        b, others = box(), [box() for _ in range(int(rng.integers(0, 4)))]
        want = np.zeros((13, 13, 13), dtype=int)
        want[tuple(slice(x, y) for x, y in b)] = 1
        for o in others:
            want[tuple(slice(x, y) for x, y in o)] = 0
        got = np.zeros_like(want)
        for p in subtract(b, others):
            assert all(x < y for x, y in p)
            got[tuple(slice(x, y) for x, y in p)] += 1
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("blend", ["linear", "hann"])
def test_a_negative_zero_fill_is_kept_where_no_tile_reached(tmp_path, blend):
    """-0.0 is falsy: the weighted blends' unreached voxels of a written chunk keep the fill's sign bit."""
    data = np.random.default_rng(0).random((8, 8, 8)).astype("f4")
    zarr.create_array(str(tmp_path / "in.zarr"), shape=(8, 8, 8), chunks=(8, 8, 8), dtype="f4")[:] = data
    w = stoker.TileWriter(str(tmp_path / "o.zarr"), (8, 8, 8), (4, 8, 8), "f4", blend=blend, fill_value=-0.0,
                          write_threads=0)
    w.write([stoker.Sample(str(tmp_path / "in.zarr"), [(0, 4), (0, 8), (0, 4)])], data[None, :4, :, :4] + 1)
    w.close()
    got = zarr.open_array(str(tmp_path / "o.zarr"))[:4, :, 4:]  # in a written chunk, reached by no tile
    assert np.signbit(got).all(), np.unique(got.view("u4"))


@pytest.mark.parametrize("native", [True, False])
def test_the_blend_does_not_depend_on_the_order_tiles_come(volume, tmp_path, monkeypatch, native):
    # without a grid (parts kept until close), compiled and numpy: float64 sums of the parts in the order of
    # their tiles, so any batching or rank split gives the same bits (float32 parts: each region keeps its parts
    # until it finishes; a region folded into running sums, whose parts outgrew them, sums as they come)
    from stoker.inference import weighted

    if not native:
        monkeypatch.setattr(weighted, "native_mean", None)
    uri, data = volume
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    tiles = [grid.sample(0, i) for i in range(len(grid))]
    order = list(np.random.default_rng(3).permutation(len(tiles)))
    arrays = []
    for name, seq, batch in (("fwd", list(range(len(tiles))), 4), ("shuffled", order, 3)):
        out = str(tmp_path / f"{name}.zarr")
        w = stoker.TileWriter(out, SHAPE, (4, 8, 8), "f8", blend="hann", crop=CROP, write_threads=0)
        for i in range(0, len(seq), batch):
            sel = [tiles[j] for j in seq[i:i + batch]]
            x = torch.stack([torch.from_numpy(data[tuple(slice(a, b) for a, b in s.aabb)]) for s in sel])
            w.write(sel, (torch.sin(x * 1.37) * 1e3 + x / 3).float())  # into float64 output: the sums round
        w.close()
        arrays.append(zarr.open_array(out)[:])
    np.testing.assert_array_equal(arrays[0].view("u8"), arrays[1].view("u8"))


def test_shards_that_are_not_whole_chunks_are_an_invalid_argument(tmp_path):
    """TileWriter(chunks=(4, 8, 8), shards=(6, 16, 16)) raised zarr-python's ValueError, none of stoker's errors,
    and on rank 0 only (the one that makes the array); now an InvalidArgument naming shards on every rank before
    anything is made, and the same writer with whole shards then makes the array zarr-python reads back."""
    out = str(tmp_path / "o.zarr")
    with pytest.raises(stoker.InvalidArgument, match="whole number of chunks") as err:
        stoker.TileWriter(out, SHAPE, (4, 8, 8), "f4", shards=(6, 16, 16))
    assert err.value.knob == "shards" and not os.path.exists(out)
    with pytest.raises(stoker.InvalidArgument, match="one integer >= 1 per axis") as err:
        stoker.TileWriter(out, SHAPE, (4, 8), "f4")
    assert err.value.knob == "chunks" and not os.path.exists(out)
    stoker.TileWriter(out, SHAPE, (4, 8, 8), "f4", shards=(8, 16, 16)).close()
    arr = zarr.open_array(out, mode="r")
    assert arr.shards == (8, 16, 16) and arr.chunks == (4, 8, 8)


def test_a_tile_cropped_away_whole_is_an_invalid_argument(volume, tmp_path):
    """Without grid=, a crop of half the tile or more cropped an inner tile away whole and write() went on
    silently: its voxels kept the fill value (a 13x29x17 volume of 8x10x9 tiles, crop 4 on axis 0: nothing
    written). Now the batch is refused (InvalidArgument, knob crop) before any of it is taken; a tile on both
    borders of an axis keeps that axis whole, and is still written."""
    uri, data = volume
    out = str(tmp_path / "o.zarr")
    inner = stoker.Sample(uri, [(4, 12), (10, 20), (4, 13)])
    writer = stoker.TileWriter(out, SHAPE, (4, 8, 8), "f4", crop=(4, 2, 2))
    with pytest.raises(stoker.InvalidArgument, match=r"crop leaves nothing of the sample .* on axis 0 its box "
                       r"\(4, 12\) less the crop 4 is \(8, 8\).*use a crop of at most 3 on axis 0") as err:
        writer.write([inner], np.ones((1,) + TILE, "f4"))
    assert err.value.knob == "crop"
    whole = stoker.Sample(uri, [(0, 13), (10, 20), (4, 13)])  # spans axis 0: its border sides are kept
    writer.write([whole], np.ones((1, 13, 10, 9), "f4"))
    writer.close()
    got = zarr.open_array(out, mode="r")[:]
    expect = np.zeros(SHAPE, "f4")
    expect[0:13, 12:18, 6:11] = 1
    np.testing.assert_array_equal(got, expect)



def test_a_padded_tile_cropped_out_of_the_array_says_which_crop_keeps_it(tmp_path):
    """A padded tile mostly past the array, its crop under half the tile: the advice to crop under half the
    tile was wrong for it. The refusal says what the crop leaves of it (nothing inside the array), with the
    numbers, and the largest crop that keeps some of it; with that crop it is written."""
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=(100, 100), chunks=(50, 50), dtype="f4")[:] = 1
    out = str(tmp_path / "o.zarr")
    s = stoker.Sample(src, [(-20, 10), (0, 30)], pad="reflect")  # 30 voxels, 10 of them inside the array
    writer = stoker.TileWriter(out, (100, 100), (50, 50), "f4", crop=12)
    with pytest.raises(stoker.InvalidArgument, match=r"crop leaves nothing of the sample .* inside the array .* "
                       r"on axis 0 its box \(-20, 10\) less the crop 12 is \(-8, -2\), and the array spans "
                       r"\(0, 100\).*use a crop of at most 9 on axis 0") as err:
        writer.write([s], np.ones((1, 30, 30), "f4"))
    assert err.value.knob == "crop"
    writer.close()
    with stoker.TileWriter(str(tmp_path / "o9.zarr"), (100, 100), (50, 50), "f4", crop=9) as w:
        w.write([s], np.full((1, 30, 30), 2, "f4"))
    got = zarr.open_array(str(tmp_path / "o9.zarr"), mode="r")[:]
    assert (got[:1, 9:21] == 2).all() and (got[1:] == 0).all() and (got[:, 21:] == 0).all()

def test_an_unreachable_object_store_is_a_storage_error(tmp_path):
    """TileWriter("s3://...") whose endpoint does not answer raised obstore's GenericError from opening the
    array, none of stoker's errors (the writes after it are StorageErrors); a StorageError naming the URI now.
    The endpoint is a loopback port nobody listens on: every request is refused at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections to it are refused
    options = {"endpoint": f"http://127.0.0.1:{port}", "allow_http": True, "region": "us-east-1",
               "access_key_id": "x", "secret_access_key": "y", "retries": 0, "timeout_s": 5}
    with pytest.raises(stoker.StorageError, match="reading the array's metadata") as err:
        stoker.TileWriter("s3://bkt/o.zarr", SHAPE, (4, 8, 8), "f4", storage_options=options)
    assert err.value.uri == "s3://bkt/o.zarr"
