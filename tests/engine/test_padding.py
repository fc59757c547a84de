"""Padded boxes (``Sample(..., pad=...)``): filled while placing, held to ``numpy.pad`` of a zarr-python read.

Every mode on both CPU decode paths (the compiled engine and the Python path), on the GPU-decode executor run on
CPU tensors, and on a CUDA pipeline where a GPU is there: boxes past the low and the high border on several
axes, boxes that miss the array on one axis, channels, sharded arrays, dtypes, casts and fill values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import stoker
from stoker.engine.gpu.executor import GpuDecodeExecutor
from stoker.engine.planning.padding import axis_map, pad_crop
from stoker.engine.pipeline import facade as pipelines
from stoker.errors import BudgetExceeded, OutOfBounds, RankMismatch

from batch_oracle import padded as _reference  # numpy.pad of the whole array, cut to the box

pytestmark = pytest.mark.timeout(120)

MODES = ("zero", "fill", "edge", "reflect")

SHAPE = (12, 16, 9)
BOXES = [  # boxes of (10, 14, 8)
    [(-3, 7), (4, 18), (0, 8)],  # past the low border on one axis, the high one on another
    [(5, 15), (-5, 9), (-2, 6)],  # past a border on every axis
    [(-30, -20), (0, 14), (1, 9)],  # misses the array on one axis (below)
    [(2, 12), (20, 34), (0, 8)],  # misses it above
    [(-1, 9), (-1, 13), (3, 11)],  # one voxel past each border
    [(1, 11), (2, 16), (0, 8)],  # inside: a padded sample that reads as any other
]


def _array(path, shape=SHAPE, chunks=(5, 3, 4), dtype="u2", fill=7, shards=None, seed=0, skip_last=True):
    z = zarr.create_array(str(path), shape=shape, chunks=chunks, shards=shards, dtype=dtype, fill_value=fill)
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        data = rng.normal(0, 100, size=shape).astype(dtype)
    else:
        data = rng.integers(0, min(np.iinfo(dtype).max, 60000), size=shape, endpoint=True).astype(dtype)
    if skip_last:  # the last chunks along axis 0 are never written: read as the fill value
        z[: chunks[0] * (shape[0] // chunks[0])] = data[: chunks[0] * (shape[0] // chunks[0])]
    else:
        z[...] = data
    return str(path), zarr.open_array(str(path), mode="r")[...]


def _batches(samples, dtype="f32", batch_size=None):
    cfg = stoker.Config(batch_size=batch_size or len(samples), dtype=dtype, device="cpu", n_compute_threads=2,
                        pop_timeout_s=30.0)
    out = []
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        for _ in range(len(samples) // cfg.batch_size):
            with p.pop() as batch:
                out.append(torch.from_dlpack(batch).clone())
    return torch.cat(out)


def _expect(refs, dtype):
    stacked = torch.from_numpy(np.stack(refs))
    return stacked if dtype == "native" else stacked.to(torch.float32).to(
        {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype])


def test_axis_maps_are_numpy_pads_of_the_indices():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        n, before, after = int(rng.integers(1, 8)), int(rng.integers(0, 25)), int(rng.integers(0, 25))
        for mode in ("edge", "reflect"):
            want = np.pad(np.arange(n), (before, after), mode=mode)
            assert axis_map(-before, n + after, n, mode).tolist() == want.tolist(), (n, before, after, mode)
        want = np.pad(np.arange(n), (before, after), mode="constant", constant_values=-1)
        assert axis_map(-before, n + after, n, "zero").tolist() == want.tolist()


def test_a_read_box_is_never_larger_than_its_crop():
    rng = np.random.default_rng(1)
    for _ in range(500):
        n = int(rng.integers(1, 10))
        start = int(rng.integers(-30, 30))
        stop = start + int(rng.integers(1, 30))
        for mode in MODES:
            pc = pad_crop(0, 0, ((start, stop),), (n,), mode)
            (lo, hi), = pc.read
            assert 0 <= lo <= hi <= n and (hi - lo) <= stop - start
            assert 0 <= pc.offset[0] <= (stop - start) - (hi - lo)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["f32", "native"])
def test_every_mode_matches_numpy_pad(tmp_path, decode_path, mode, dtype):
    uri, data = _array(tmp_path / "a.zarr")
    got = _batches([stoker.Sample(uri, box, pad=mode) for box in BOXES], dtype)
    want = _expect([_reference(data, box, mode, 7) for box in BOXES], dtype)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,fill,out", [("i2", -5, "f32"), ("f4", float("nan"), "f32"), ("f8", 2.5, "bf16"),
                                            ("u1", 200, "native"), ("f4", -1.5, "f16")])
def test_dtypes_casts_and_fill_values(tmp_path, decode_path, mode, dtype, fill, out):
    uri, data = _array(tmp_path / "a.zarr", dtype=dtype, fill=fill)
    boxes = BOXES[:3]
    got = _batches([stoker.Sample(uri, box, pad=mode) for box in boxes], out)
    want = _expect([_reference(data, box, mode, np.array(fill, dtype)) for box in boxes], out)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("mode", MODES)
def test_channels_of_arrays_with_their_own_fill_values(tmp_path, decode_path, mode):
    a, da = _array(tmp_path / "a.zarr", fill=7, seed=1)
    b, db = _array(tmp_path / "b.zarr", fill=300, chunks=(3, 5, 2), seed=2)
    boxes = BOXES[:4]
    got = _batches([stoker.Sample([a, b], box, pad=mode) for box in boxes])
    want = torch.from_numpy(np.stack([np.stack([_reference(da, box, mode, 7), _reference(db, box, mode, 300)])
                                      for box in boxes]).astype(np.float32))
    assert got.shape == (4, 2, *want.shape[2:])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_sharded_arrays(tmp_path, decode_path, mode):
    uri, data = _array(tmp_path / "s.zarr", shape=(16, 12, 10), chunks=(4, 3, 5), shards=(8, 6, 10))
    boxes = [[(-5, 7), (8, 16), (-3, 9)], [(10, 22), (-8, 0), (2, 14)], [(14, 26), (-4, 4), (9, 21)]]
    got = _batches([stoker.Sample(uri, box, pad=mode) for box in boxes])
    torch.testing.assert_close(got, _expect([_reference(data, box, mode, 7) for box in boxes], "f32"),
                               rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_axes_of_one_voxel(tmp_path, decode_path, mode):
    uri, data = _array(tmp_path / "t.zarr", shape=(1, 5), chunks=(1, 2), skip_last=False)
    boxes = [[(-3, 4), (-2, 8)], [(0, 7), (3, 13)]]
    got = _batches([stoker.Sample(uri, box, pad=mode) for box in boxes])
    torch.testing.assert_close(got, _expect([_reference(data, box, mode, 7) for box in boxes], "f32"),
                               rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_boxes_longer_than_the_array(tmp_path, decode_path, mode):
    """Reflected more than once (and edge, constant) where a box is longer than its array on every axis."""
    uri, data = _array(tmp_path / "s.zarr", shape=(3, 4, 2), chunks=(2, 3, 1), skip_last=False)
    boxes = [[(-4, 6), (-5, 9), (-3, 5)], [(-10, 0), (2, 16), (1, 9)], [(2, 12), (-14, 0), (-8, 0)]]
    got = _batches([stoker.Sample(uri, box, pad=mode) for box in boxes])
    torch.testing.assert_close(got, _expect([_reference(data, box, mode, 7) for box in boxes], "f32"),
                               rtol=0, atol=0)


@pytest.mark.parametrize("out", ["f32", "bf16"])
def test_a_transform_sees_the_padded_batch(tmp_path, decode_path, out):
    """Padding is filled before the transform runs (bf16: in the float32 work slot, rounded once after it)."""
    uri, data = _array(tmp_path / "a.zarr")
    cfg = stoker.Config(batch_size=3, dtype=out, device="cpu", n_compute_threads=2, pop_timeout_s=30.0,
                        transform=lambda x: x.sub_(100.0).mul_(0.5))
    boxes = BOXES[:3]
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, box, pad="fill") for box in boxes])
        with p.pop() as batch:
            got = torch.from_dlpack(batch).clone()
    want = (torch.from_numpy(np.stack([_reference(data, box, "fill", 7) for box in boxes]).astype(np.float32))
            .sub_(100.0).mul_(0.5)).to(got.dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_padded_and_unpadded_samples_share_a_batch(tmp_path, decode_path):
    uri, data = _array(tmp_path / "a.zarr")
    inside = [(1, 9), (2, 8), (0, 6)]
    samples = [stoker.Sample(uri, inside), stoker.Sample(uri, [(-2, 6), (5, 11), (1, 7)], pad="reflect"),
               stoker.Sample(uri, [(3, 11), (-4, 2), (-1, 5)], pad="edge")]
    want = [data[tuple(slice(a, b) for a, b in inside)]] + [_reference(data, box_of_s, s.pad, 7)
                                                           for s, box_of_s in ((s, s.aabb) for s in samples[1:])]
    torch.testing.assert_close(_batches(samples), _expect(want, "f32"), rtol=0, atol=0)


def test_a_box_past_the_array_without_pad_is_still_out_of_bounds(tmp_path, decode_path):
    uri, _ = _array(tmp_path / "a.zarr")
    cfg = stoker.Config(batch_size=2, dtype="f32", device="cpu", pop_timeout_s=30.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, [(-2, 6), (0, 6), (0, 6)], pad="zero"),
                stoker.Sample(uri, [(8, 16), (0, 6), (0, 6)])])
        with pytest.raises(OutOfBounds, match="stop 16 > size 12"):
            p.pop()


def test_a_padded_box_too_large_for_the_budget_is_a_budget_error(tmp_path):
    """Not OutOfBounds: when the budget refuses a batch, unpadded boxes past their arrays are named first,
    and a padded one may reach past its array."""
    uri, _ = _array(tmp_path / "a.zarr")
    cfg = stoker.Config(batch_size=1, dtype="f32", device="cpu", host_buffer_bytes=1 << 20, pop_timeout_s=30.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, [(-200, 200), (-200, 200), (0, 9)], pad="zero")])
        with pytest.raises(BudgetExceeded):
            p.pop()


def test_a_padded_crop_before_an_array_of_another_rank_leaves_it_the_error(tmp_path, decode_path):
    flat = str(tmp_path / "flat.zarr")
    zarr.create_array(flat, shape=(6, 6), chunks=(3, 3), dtype="u1")[:] = 1
    deep, _ = _array(tmp_path / "deep.zarr")
    cfg = stoker.Config(batch_size=2, dtype="f32", device="cpu", pop_timeout_s=30.0)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(flat, [(-2, 4), (3, 9)], pad="edge"), stoker.Sample(deep, [(0, 6), (0, 6)])])
        with pytest.raises(RankMismatch, match="deep.zarr"):
            p.pop()


def test_the_gpu_decode_executor_pads_on_the_device(tmp_path, monkeypatch):
    """The GPU-decode executor (run on CPU tensors), also for a batch of which no crop reads a chunk."""
    monkeypatch.setattr(pipelines, "make_executor",
                        lambda cfg, device, stats, store: GpuDecodeExecutor.on_host(cfg, stats, store))
    uri, data = _array(tmp_path / "a.zarr", chunks=(4, 4, 3))
    for mode in MODES:
        got = _batches([stoker.Sample(uri, box, pad=mode) for box in BOXES], batch_size=2)
        torch.testing.assert_close(got, _expect([_reference(data, box, mode, 7) for box in BOXES], "f32"),
                                   rtol=0, atol=0)
    outside = [[(-30, -20), (0, 4), (1, 7)], [(2, 12), (20, 24), (0, 6)]]  # a batch that reads no chunk
    got = _batches([stoker.Sample(uri, box, pad="fill") for box in outside])
    assert (got == 7).all()


@pytest.mark.parametrize("decode_on", [pytest.param("cpu", marks=pytest.mark.cuda),
                                       pytest.param("gpu", marks=pytest.mark.cuda),
                                       pytest.param("hybrid", marks=pytest.mark.cuda), "host", "hybrid-host"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_batches_are_padded(tmp_path, mode, decode_on, monkeypatch):
    """On a GPU, every decode path; "host" and "hybrid-host": the GPU-decode and hybrid executors' logic on CPU
    tensors, the same batch."""
    from stoker.engine.hybrid.executor import HybridExecutor

    if decode_on in ("gpu", "hybrid"):
        from stoker.engine.gpu import nvcomp

        if not nvcomp.available():
            pytest.skip("nvCOMP is not installed")
    on_host = decode_on.endswith("host")
    if on_host:
        kind = HybridExecutor if decode_on == "hybrid-host" else GpuDecodeExecutor
        monkeypatch.setattr(pipelines, "make_executor",
                            lambda cfg, device, stats, store: kind.on_host(cfg, stats, store))
    uri, data = _array(tmp_path / "a.zarr")
    cfg = stoker.Config(batch_size=len(BOXES), dtype="f32", device="cpu" if on_host else "cuda",
                        decode_on="gpu" if on_host else decode_on, pop_timeout_s=30.0,
                        device_buffer_bytes=64 << 20)
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, box, pad=mode) for box in BOXES])
        with p.pop() as batch:
            got = torch.from_dlpack(batch).cpu()
    torch.testing.assert_close(got, _expect([_reference(data, box, mode, 7) for box in BOXES], "f32"),
                               rtol=0, atol=0)


def test_a_fill_value_that_does_not_fit_an_integer_batch_is_refused(tmp_path, decode_path):
    """pad="fill" into "i32" of a uint32 array whose fill value is 2**32 - 1: a DtypeMismatch naming the array,
    never -1 in the padded voxels (the chunks' own fill values are checked the same way)."""
    z = zarr.create_array(str(tmp_path / "ids.zarr"), shape=(8, 8), chunks=(4, 4), dtype="u4",
                          fill_value=2**32 - 1)
    z[...] = np.arange(64, dtype="u4").reshape(8, 8)
    uri = str(tmp_path / "ids.zarr")
    with pytest.raises(stoker.DtypeMismatch, match="ids.zarr") as got:
        _batches([stoker.Sample(uri, [(-2, 6), (0, 8)], pad="fill")], dtype="i32")
    assert "4294967295" in str(got.value) and "the padding reads as the array's fill value" in str(got.value)
    # zeros fit: the same box with pad="zero" reads, and equals numpy.pad
    x = _batches([stoker.Sample(uri, [(-2, 6), (0, 8)], pad="zero")], dtype="i32")
    want = np.pad(np.arange(64).reshape(8, 8), ((2, 0), (0, 0)))[:8]
    assert (x[0].numpy() == want).all()
