"""The weighted mean of overlapping predictions in one compiled pass (``weighted.mean_into``, csrc/blend.c): numpy's
arithmetic bit for bit, whatever the layout (parts covering the output in part, none, one or many; strided views;
float32 and float64 both sides); a grid's weighted blend through it takes no float64 sums; the plans of a grid's
regions are made once per layout."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.inference import weighted
from stoker.inference import writer as writer_module
from stoker.inference.blend import window
from batch_oracle import blend_reference as _reference

pytestmark = pytest.mark.timeout(180)
compiled = pytest.mark.skipif(weighted.native_mean is None, reason="needs the compiled engine")


def _layout(rng, ndim: int, lanes: int, out_dtype, part_dtypes, n_parts: int, strided: bool):
    shape = tuple(int(n) for n in rng.integers(3, 20, ndim))
    base = np.full((lanes,) + tuple(2 * n for n in shape), -7.0, out_dtype)
    out = base[(slice(None),) + tuple(slice(1, 1 + 2 * n, 2) if strided else slice(0, n) for n in shape)]
    parts = []
    for i in range(n_parts):
        lo = [int(rng.integers(0, n)) for n in shape]
        hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, shape)]
        ext = [b - a for a, b in zip(lo, hi)]
        big = (rng.normal(size=(lanes,) + tuple(2 * e + 1 for e in ext)) * 100).astype(part_dtypes[i % len(part_dtypes)])
        values = big[(slice(None),) + tuple(slice(1, 1 + 2 * e, 2) if strided else slice(0, e) for e in ext)]
        tile = [e + int(rng.integers(0, 9)) for e in ext]  # the part: a piece of a larger tile's windows
        starts = [int(rng.integers(0, t - e + 1)) for t, e in zip(tile, ext)]
        windows = tuple(window(rng.choice(["hann", "linear"]), t)[s:s + e] for t, s, e in zip(tile, starts, ext))
        parts.append((values, tuple(lo), windows))
    return out, parts


@compiled
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("out_dtype, part_dtypes", [("f4", ["f4"]), ("f4", ["f8"]), ("f8", ["f4", "f8"]),
                                                    ("f8", ["f8"])])
@pytest.mark.parametrize("strided", [False, True])
def test_the_compiled_mean_is_numpy_s_bit_for_bit(ndim, out_dtype, part_dtypes, strided):
    rng = np.random.default_rng(hash((ndim, out_dtype, tuple(part_dtypes), strided)) % 2 ** 32)
    for trial in range(25):
        lanes = int(rng.integers(1, 3))
        out, parts = _layout(rng, ndim, lanes, np.dtype(out_dtype), [np.dtype(d) for d in part_dtypes],
                             int(rng.integers(0, 6)), strided)
        want = _reference(out, parts)
        assert weighted.mean_into(out, parts)  # lanes first (lead=1)
        assert out.tobytes() == want.tobytes(), f"trial {trial}: {np.argwhere(out != want)[:3].tolist()}"


@compiled
@pytest.mark.parametrize("out_dtype", ["f4", "f8"])
@pytest.mark.parametrize("n_parts", [2, 3, 5])
def test_parts_spanning_whole_rows_are_numpy_s_bit_for_bit(out_dtype, n_parts):
    """Rows that every part meeting them spans whole (a planned overlap's, the usual: blend.c sums them in one
    fused pass, not through the zeroed sums and counts) give numpy's blend bit for bit: signed zeros (0.0 + -0.0
    is +0.0), values of both signs that nearly cancel, rows met by one part only (its value) or by some of the
    parts, and a part whose memory is the output's own (read before the row is written, as the other path does)."""
    rng = np.random.default_rng(n_parts)
    for trial in range(30):
        lanes, rows, n = int(rng.integers(1, 3)), int(rng.integers(1, 9)), int(rng.integers(1, 70))
        out = np.full((lanes, rows, n), -7.0, out_dtype)
        parts = []
        for i in range(n_parts):
            a = int(rng.integers(0, rows))
            b = int(rng.integers(a + 1, rows + 1))
            values = (rng.normal(size=(lanes, b - a, n)) * 10.0 ** int(rng.integers(-3, 4))).astype("f4")
            values[rng.random(values.shape) < 0.1] = -0.0
            values[rng.random(values.shape) < 0.05] = 0.0
            if i and rng.random() < 0.3:  # cancels the part before it where they meet
                values = -parts[-1][0][:, :b - a] if parts[-1][0].shape[1] >= b - a else values
            tile = n + int(rng.integers(0, 9))
            start = int(rng.integers(0, tile - n + 1))
            windows = (window("hann", rows + 2)[a + 1:b + 1], window(rng.choice(["hann", "linear"]), tile)[start:start + n])
            parts.append((np.ascontiguousarray(values), (a, 0), windows))
        want = _reference(out, parts)
        assert weighted.mean_into(out, parts)
        assert out.tobytes() == want.tobytes(), f"trial {trial}: {np.argwhere(out != want)[:3].tolist()}"
    # a part that is the output itself (its own memory, f4): the rows blended as from a copy of it
    out = (rng.normal(size=(1, 4, 16)) * 10).astype("f4")
    other = (rng.normal(size=(1, 4, 16)) * 10).astype("f4")
    win = (window("hann", 4), window("hann", 16))
    want = _reference(out, [(out.copy(), (0, 0), win), (other, (0, 0), win)])
    assert weighted.mean_into(out, [(out, (0, 0), win), (other, (0, 0), win)])
    assert out.tobytes() == want.tobytes()


@compiled
def test_what_it_leaves_to_numpy_and_what_it_refuses():
    out = np.zeros((1, 4, 4), np.float32)
    win = (np.ones(4), np.ones(4))
    assert not weighted.mean_into(np.zeros((1, 4, 4), np.uint8), [(np.ones((1, 4, 4), np.float32), (0, 0), win)])
    assert not weighted.mean_into(out, [(np.ones((1, 4, 4), np.float16), (0, 0), win)])
    # 8 spatial axes (9 with the lanes): more than blend.c takes, numpy's (a TileWriter over 8-D tiles blends)
    wide = (2,) * 8
    assert not weighted.mean_into(np.zeros(wide, np.float32), [(np.ones(wide, np.float32), (0,) * 8, (np.ones(2),) * 8)],
                                  lead=0)
    # 7 spatial axes: the compiled pass takes them
    seven = np.zeros((1,) + (2,) * 7, np.float32)
    assert weighted.mean_into(seven, [(np.ones(seven.shape, np.float32), (0,) * 7, (np.ones(2),) * 7)])
    assert (seven == 1).all()
    with pytest.raises(ValueError, match="outside"):
        weighted.mean_into(out, [(np.ones((1, 4, 4), np.float32), (1, 0), win)])
    with pytest.raises(ValueError, match="window"):
        weighted.mean_into(out, [(np.ones((1, 4, 4), np.float32), (0, 0), (np.ones(3), np.ones(4)))])
    with pytest.raises(ValueError, match="lanes"):
        weighted.mean_into(out, [(np.ones((2, 4, 4), np.float32), (0, 0), win)])
    with pytest.raises(ValueError, match="writable|read-only"):
        ro = np.zeros((1, 4, 4), np.float32)
        ro.flags.writeable = False
        weighted.mean_into(ro, [(np.ones((1, 4, 4), np.float32), (0, 0), win)])


@compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unaligned_buffers_are_numpy_s_or_refused(dtype):
    """Arrays whose elements are not on their alignment (an offset into a buffer, a packed record's field) were
    read and written in place as float and double: undefined behaviour (UBSan: a misaligned store). mean_into
    leaves such an output or part to numpy (False); blend_mean refuses them, and unaligned windows."""
    size = np.dtype(dtype).itemsize
    unaligned = np.frombuffer(bytearray(size * 16 + 1), dtype, offset=1).reshape(1, 4, 4)
    packed = np.zeros((1, 4, 4), [("pad", "u1"), ("v", dtype)])["v"]  # stride size + 1
    win = (np.ones(4), np.ones(4))
    odd_window = np.frombuffer(bytearray(8 * 4 + 1), np.float64, offset=1)
    for bad in (unaligned, packed):
        assert not bad.flags.aligned
        assert not weighted.mean_into(bad, [(np.ones((1, 4, 4), dtype), (0, 0), win)])
        assert not weighted.mean_into(np.zeros((1, 4, 4), dtype), [(bad, (0, 0), win)])
        with pytest.raises(ValueError, match="aligned"):
            weighted.native_mean(bad, [(np.ones((1, 4, 4), dtype), (0, 0), win)])
        with pytest.raises(ValueError, match="aligned"):
            weighted.native_mean(np.zeros((1, 4, 4), dtype), [(bad, (0, 0), win)])
    with pytest.raises(ValueError, match="aligned"):
        weighted.native_mean(np.zeros((1, 4, 4), dtype), [(np.ones((1, 4, 4), dtype), (0, 0), (odd_window, win[1]))])


# the benchmark's layout, small: the last tiles shifted back, so the planned regions' output boxes overlap
SHAPE, TILE, STRIDE, CROP, CHUNKS = (44, 60, 58), (24, 24, 24), (16, 16, 16), 4, (16, 16, 16)


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    data = np.random.default_rng(5).random(SHAPE).astype("f4") * 200
    uri = str(tmp_path_factory.mktemp("weighted") / "in.zarr")
    zarr.create_array(uri, shape=SHAPE, chunks=CHUNKS, dtype="f4")[:] = data
    grid = stoker.TileGrid([uri], TILE, stride=STRIDE)
    cfg = stoker.Config(batch_size=4, dtype="f32", device="cpu", n_compute_threads=1)
    return grid, [(s, x.clone()) for s, x in stoker.CropDataset(grid, cfg, with_samples=True)]


def _write(out, grid, batches, blend, dtype, channels, predict, keep, with_grid=True):
    shape = ((channels,) if channels else ()) + SHAPE
    chunks = ((channels,) if channels else ()) + CHUNKS
    writer = stoker.TileWriter(out, shape, chunks, dtype, blend=blend, crop=CROP, grid=grid if with_grid else None,
                               write_threads=0)
    take, sums = writer._pool.take, []
    writer._pool.take = lambda shape, dt, zero=True: (
        sums.append(shape) if np.dtype(dt) == np.float64 else None, take(shape, dt, zero))[1]
    for samples, x in batches:
        rows = [i for i, s in enumerate(samples) if keep(s)]
        if rows:
            x = predict(x[rows])
            writer.write([samples[i] for i in rows], x if not channels else torch.stack([x, 2 * x - 1], 1))
    writer.close()
    return zarr.open_array(out, mode="r")[:], len(sums)


@compiled
@pytest.mark.parametrize("blend", ["linear", "hann"])
@pytest.mark.parametrize("dtype", ["f4", "f8"])
@pytest.mark.parametrize("channels", [0, 2])
@pytest.mark.parametrize("complete", [True, False])
@pytest.mark.parametrize("predict", ["f4", "f8"])
def test_a_grid_s_blend_is_numpy_s_and_takes_no_float64_sums(batches, tmp_path, monkeypatch, blend, dtype, channels,
                                                             complete, predict):
    """Planned regions and whole-kept ones (no grid), all tiles or some left out (a voxel one part that came
    covers is its value): the compiled pass writes numpy's array bit for bit, and takes no float64 buffers."""
    grid, bs = batches

    def keep(s):
        return complete or (s.aabb[2][0] != 16 and s.aabb[1][0] != 32)

    def cast(x):
        return x.double() / 3.0 if predict == "f8" else x

    for with_grid in (True, False):
        compiled, sums = _write(str(tmp_path / f"c{with_grid}.zarr"), grid, bs, blend, dtype, channels, cast, keep,
                                with_grid)
        with monkeypatch.context() as m:
            m.setattr(weighted, "native_mean", None)
            numpy_, numpy_sums = _write(str(tmp_path / f"n{with_grid}.zarr"), grid, bs, blend, dtype, channels, cast,
                                        keep, with_grid)
        # fewer float64 buffers (the layout has overlaps to blend); none for float32 parts and output, one lane: a
        # float64 output's regions are float64, and a region whose parts outgrow float64 sums is folded into them
        assert sums < numpy_sums
        if (dtype, predict, channels) == ("f4", "f4", 0):
            assert sums == 0
        assert compiled.tobytes() == numpy_.tobytes()


@pytest.mark.parametrize("tile, stride, crop, alike", [(96, 56, 20, False), (80, 64, 4, True)])
def test_a_grid_s_regions_share_the_plans_of_their_layout(tmp_path, tile, stride, crop, alike):
    """The box arithmetic of a region's plan is done once per layout: the next writer of the process (the next
    volume) takes every plan as it is, and where the stride is the chunk's, the interior regions of one volume
    share theirs."""
    shape = (64, 320, 320)
    zarr.create_array(str(tmp_path / "in.zarr"), shape=shape, chunks=(64, 64, 64), dtype="u2")
    grid = stoker.TileGrid([str(tmp_path / "in.zarr")], (tile,) * 3, stride=(stride,) * 3, pad="zero")
    plans = []
    for i in range(2):
        writer = stoker.TileWriter(str(tmp_path / f"o{i}.zarr"), shape, (64, 64, 64), "f4", blend="hann", crop=crop,
                                   grid=grid, write_threads=0)
        plans.append([writer._plan(r, np.dtype("f4")) for r in sorted(writer._boxes)])
    planned = [p for p in plans[0] if p is not None]
    assert len(planned) >= 20
    assert all(a is b for a, b in zip(*plans))  # the next writer takes them as they are
    if alike:
        assert len(planned) > 2 * len({id(p) for p in planned})  # regions of one layout share a plan


@compiled
def test_layouts_of_many_parts_blend_in_one_pass_as_the_pieces_do(tmp_path, monkeypatch):
    """A region of more than PIECEWISE_PARTS parts (kept whole, not planned) goes through the same pass."""
    rng = np.random.default_rng(9)
    data = rng.random((20, 20, 20)).astype("f4")
    zarr.create_array(str(tmp_path / "in.zarr"), shape=data.shape, chunks=(10, 10, 10), dtype="f4")[:] = data
    grid = stoker.TileGrid([str(tmp_path / "in.zarr")], (6, 6, 6), stride=(4, 4, 4))
    cfg = stoker.Config(batch_size=8, dtype="f32", device="cpu", n_compute_threads=1)
    bs = [(s, x.clone()) for s, x in stoker.CropDataset(grid, cfg, with_samples=True)]
    got = {}
    for name, native in (("compiled", weighted.native_mean), ("numpy", None)):
        monkeypatch.setattr(weighted, "native_mean", native)
        w = stoker.TileWriter(str(tmp_path / f"{name}.zarr"), data.shape, (10, 10, 10), "f4", blend="hann",
                              write_threads=0)
        for s, x in bs:
            w.write(s, x / 7.0)  # float32 parts: kept, not folded into float64 sums
        assert max(len(r.parts) for r in w._open.values()) > writer_module.PIECEWISE_PARTS
        w.close()
        got[name] = zarr.open_array(str(tmp_path / f"{name}.zarr"))[:]
    assert got["compiled"].tobytes() == got["numpy"].tobytes()
    np.testing.assert_allclose(got["compiled"], data / 7.0, rtol=1e-6)


def test_every_combination_of_lanes_and_axes_is_read_in_place():
    """Parts of views with lanes first, as the writer hands them (a channel axis or none): no copy made."""
    out = np.zeros((3, 5, 6), np.float32)
    assert weighted.lanes(out, 1) is out
    assert weighted.lanes(out[0], 0).base is out
    assert weighted.lanes(out[None], 2) is None
    for lead, shape in itertools.product([0, 1], [(4,), (4, 5)]):
        x = np.zeros((2,) * lead + shape, np.float32)
        assert np.shares_memory(weighted.lanes(x, lead), x)


def test_a_writer_over_8_d_tiles_blends_with_numpy(tmp_path):
    # more spatial axes than the compiled pass takes: numpy's blend, not blend_mean's ValueError at close()
    shape = (3,) + (2,) * 7
    data = np.random.default_rng(0).random(shape, dtype="f4")
    zarr.create_array(str(tmp_path / "in.zarr"), shape=shape, chunks=shape, dtype="f4")[:] = data
    grid = stoker.TileGrid([str(tmp_path / "in.zarr")], (2,) * 8, stride=(1,) + (2,) * 7)
    w = stoker.TileWriter(str(tmp_path / "out.zarr"), shape, shape, "f4", blend="hann", write_threads=0)
    for i in range(len(grid)):
        s = grid.sample(0, i)
        w.write([s], torch.from_numpy(data[tuple(slice(a, b) for a, b in s.aabb)][None].copy()))
    w.close()
    np.testing.assert_allclose(zarr.open_array(str(tmp_path / "out.zarr"))[:], data, rtol=1e-6)


def _ctypes_floats(shape, ctype):
    """A ctypes array of ``shape``: its buffer gives no strides (NULL: C order), whatever the consumer asks."""
    t = ctype
    for n in reversed(shape):
        t = t * n
    return t()


@compiled
@pytest.mark.parametrize("ctype", [ctypes.c_float, ctypes.c_double])
def test_buffers_that_give_no_strides_blend_as_c_order(ctype):
    """blend_mean read the output's and each part's strides from their buffers: a ctypes array gives none
    (NULL) and was read through that NULL pointer (a segfault). They blend as the same arrays in C order do."""
    rng = np.random.default_rng(11)
    out = _ctypes_floats((2, 5, 6), ctype)
    out_np = np.ctypeslib.as_array(out)  # the same memory, with strides
    out_np[...] = -3
    values = _ctypes_floats((2, 3, 4), ctype)
    np.ctypeslib.as_array(values)[...] = rng.normal(size=(2, 3, 4)) * 10
    windows = (np.hanning(5)[1:4].copy(), np.hanning(6)[1:5].copy())
    parts = [(values, (1, 2), windows),
             (rng.normal(size=(2, 4, 5)).astype(out_np.dtype), (0, 0), (np.linspace(.2, 1, 4), np.linspace(.1, 1, 5)))]
    want = _reference(out_np, [(np.ctypeslib.as_array(v) if not isinstance(v, np.ndarray) else v, o, w)
                               for v, o, w in parts])
    weighted.native_mean(out, parts)
    np.testing.assert_array_equal(out_np, want)


@compiled
@pytest.mark.timeout(60, method="thread")  # (a hang is in C, the GIL released: the signal method never fires)
@pytest.mark.parametrize("shape", [(2**31, 2**31, 0), (2**40, 2**40, 0, 1), (2**31, 0, 2**31)])
def test_an_output_of_no_voxel_returns_at_once(shape):
    """An output with an extent 0 may claim any other extents (ctypes makes (2**31, 2**31, 0) float32: no byte).
    blend_mean walked its rows (the extents before the last: 2**62 of them, a hang with the GIL released) or
    multiplied extents past Py_ssize_t (undefined behaviour) before meeting the 0, or asked for scratch of the
    last extent (64 GiB for 2**31): it has nothing to write."""
    out = _ctypes_floats(shape, ctypes.c_float)
    assert memoryview(out).shape == shape and memoryview(out).nbytes == 0
    assert weighted.native_mean(out, ()) is None


@compiled
@pytest.mark.timeout(60, method="thread")  # (a hang is in C, the GIL released: the signal method never fires)
@pytest.mark.parametrize("shape", [(1, 2**59), (1, 2**58), (2**20, 2**21, 1)])
def test_an_output_whose_elements_share_memory_is_refused(shape):
    """blend_mean took any writable output: one of zero strides claims any extents over a few bytes. Its rows'
    scratch ((1, 2**59): 2**59 x 32 bytes) wrapped size_t, a small allocation then written past its end (a
    segfault); (2**20, 2**21, 1) walked 2**41 rows with the GIL released (a hang). An output whose elements share
    memory (a zero stride, overlapping axes) is refused now, before any of it, and nothing is written."""
    base = np.zeros(4, np.float32)
    out = np.lib.stride_tricks.as_strided(base, shape=shape, strides=(0,) * len(shape))
    spatial = tuple(min(4, e) for e in shape[1:])
    part = (np.ones((shape[0],) + spatial, np.float32), (0,) * len(spatial), tuple(np.ones(e) for e in spatial))
    for parts in ([part], []) if shape[0] == 1 else ([],):
        with pytest.raises(ValueError, match="share memory"):
            weighted.native_mean(out, parts)
    assert not base.any()


@compiled
def test_an_output_of_interleaved_axes_that_do_not_overlap_blends_as_its_copy():
    """An output whose axes interleave without sharing a byte (strides (16, 40) bytes over float64: elements at
    0, 16, 32, 40, 56, 72) is not refused by the check above, and blends as a contiguous copy of it does."""
    base = np.zeros(10, np.float64)
    out = np.lib.stride_tricks.as_strided(base, shape=(1, 3, 2), strides=(0, 16, 40))
    part = (np.arange(1, 7, dtype=np.float64).reshape(1, 3, 2), (0, 0), (np.ones(3), np.ones(2)))
    want = np.zeros((1, 3, 2), np.float64)
    weighted.native_mean(want, [part])
    weighted.native_mean(out, [part])
    assert np.array_equal(out, want) and base.tolist() == [1, 0, 3, 0, 5, 2, 0, 4, 0, 6]
