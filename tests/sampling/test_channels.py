"""Multi-array samples: ``Sample([a, b, c], box)`` stacks the same box of each array on a channel axis,
planned as one crop per sample and channel (rows ``b * C + c`` of the batch's ``(B * C, *box)`` view), on
both decode paths; samplers over groups of arrays keep exact rank sharding and resume.

Oracle: numpy stacking of zarr-python reads."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

import stoker
from stoker.reader import coords

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def cube(tmp_path_factory):
    """Three variables on one (20, 30, 26) grid, each in another dtype, chunking and codec (one sharded),
    plus a smaller array and one of another rank."""
    root = tmp_path_factory.mktemp("cube")
    rng = np.random.default_rng(7)
    shape = (20, 30, 26)
    t2m = zarr.create_array(str(root / "t2m.zarr"), shape=shape, chunks=(8, 8, 8), dtype="float32",
                            compressors=ZstdCodec(level=1))
    t2m[:] = rng.normal(280, 10, shape).astype("float32")
    t2m[3:5, 0:4, 0:4] = np.nan
    u10 = zarr.create_array(str(root / "u10.zarr"), shape=shape, chunks=(5, 7, 13), dtype="int16",
                            compressors=BloscCodec(cname="lz4"))
    u10[:] = rng.integers(-300, 300, shape, dtype="int16")
    v10 = zarr.create_array(str(root / "v10.zarr"), shape=shape, chunks=(4, 6, 4), shards=(8, 12, 8),
                            dtype="float64", fill_value=-1.5)
    v10[:16] = rng.normal(0, 3, (16, 30, 26))  # the last shard row is never written: fill value
    small = zarr.create_array(str(root / "small.zarr"), shape=(20, 30, 10), chunks=(8, 8, 8), dtype="float32")
    small[:] = 1
    flat = zarr.create_array(str(root / "flat.zarr"), shape=(30, 26), chunks=(8, 8), dtype="float32")
    flat[:] = 2
    uris = {name: str(root / f"{name}.zarr") for name in ("t2m", "u10", "v10", "small", "flat")}
    data = {name: zarr.open_array(uri, mode="r")[:] for name, uri in uris.items()}
    return uris, data


def _oracle(data, names, box):
    sel = tuple(slice(a, b) for a, b in box)
    return np.stack([data[n][sel].astype(np.float64) for n in names])


def _batches(samples, **cfg):
    base = dict(batch_size=len(samples) if "batch_size" not in cfg else cfg["batch_size"], dtype="f32", device="cpu", n_compute_threads=2, pop_timeout_s=20.0,
                host_buffer_bytes=64 << 20)
    base.update(cfg)
    with stoker.Pipeline(stoker.Config(**base)) as p:
        p.push(samples)
        out = [torch.from_dlpack(b).clone() for b in p]
        return out, p.stats()


def _check(batch, data, names):
    x = torch.from_dlpack(batch)
    for row, s in enumerate(batch.samples):
        assert np.array_equal(x[row].numpy(), _oracle(data, names, s.aabb).astype("f4"), equal_nan=True)
    return list(batch.samples)


BOXES = [[(0, 8), (3, 19), (0, 12)], [(5, 13), (10, 26), (9, 21)], [(12, 20), (14, 30), (14, 26)],
         [(2, 10), (0, 16), (5, 17)]]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_channels_stack_the_same_box_of_each_array(cube, decode_path, dtype):
    uris, data = cube
    names = ["t2m", "u10", "v10", "t2m"]  # an array may be a channel twice
    samples = [stoker.Sample([uris[n] for n in names], box) for box in BOXES]
    (batch,), stats = _batches(samples, dtype=dtype)
    assert batch.shape == (4, 4, 8, 16, 12) and batch.dtype == stoker.Config(dtype=dtype).output_dtype
    want = np.stack([_oracle(data, names, box) for box in BOXES])
    expect = torch.from_numpy(want).to(torch.float32).to(batch.dtype)  # bf16: via float32, as documented
    assert torch.equal(batch, expect) or torch.allclose(batch, expect, equal_nan=True) and \
        torch.equal(batch.isnan(), expect.isnan())
    # counted per channel: every (sample, array) crop is needed; bytes in each array's own dtype
    assert stats.samples == 4
    assert stats.bytes_needed == 4 * 8 * 16 * 12 * (4 + 2 + 8 + 4)
    assert stats.bytes_delivered == batch.numel() * batch.element_size()


def test_one_channel_keeps_a_channel_axis(cube, decode_path):
    uris, data = cube
    (batch,), _ = _batches([stoker.Sample([uris["u10"]], box) for box in BOXES[:2]])
    assert batch.shape == (2, 1, 8, 16, 12)
    assert np.array_equal(batch.numpy(), np.stack([_oracle(data, ["u10"], b) for b in BOXES[:2]]).astype("f4"))


def test_native_dtype_needs_one_source_dtype(cube, decode_path):
    uris, _ = cube
    with pytest.raises(stoker.DtypeMismatch, match="native"):
        _batches([stoker.Sample([uris["t2m"], uris["u10"]], BOXES[0])], dtype="native")
    (same,), _ = _batches([stoker.Sample([uris["t2m"], uris["t2m"]], BOXES[0])], dtype="native")
    assert same.dtype == torch.float32 and same.shape == (1, 2, 8, 16, 12)


def test_each_array_is_checked_for_bounds_and_named(cube, decode_path):
    uris, _ = cube
    with pytest.raises(stoker.OutOfBounds) as err:  # fits t2m, not the narrower second array
        _batches([stoker.Sample([uris["t2m"], uris["small"]], BOXES[0])])
    assert err.value.uri == uris["small"] and uris["small"] in str(err.value)
    with pytest.raises(stoker.RankMismatch) as err:
        _batches([stoker.Sample([uris["t2m"], uris["flat"]], BOXES[0])])
    assert err.value.uri == uris["flat"]


def test_samples_of_a_pipeline_read_one_number_of_arrays(cube, decode_path):
    uris, _ = cube
    two = stoker.Sample([uris["t2m"], uris["u10"]], BOXES[0])
    three = stoker.Sample([uris["t2m"], uris["u10"], uris["v10"]], BOXES[1])
    single = stoker.Sample(uris["t2m"], BOXES[1])
    for other in (three, single):
        with pytest.raises(stoker.InvalidArgument, match="same number of arrays"):
            _batches([two, other])
    # also when the second one comes from a generator (checked as it is pulled)
    with pytest.raises(stoker.InvalidArgument, match="same number of arrays"):
        _batches(iter([two, three]), batch_size=2)
    # and by the planner itself
    from stoker.engine.planning.tables import plan_tables
    with pytest.raises(stoker.InvalidArgument, match="same number of arrays"):
        plan_tables(0, [two, three], stoker.open_array)


def test_sample_api():
    s = stoker.Sample(["a.zarr", "b.zarr"], [(0, 4), (2, 6)])
    assert s.channels == 2 and s.shape == (2, 4, 4) and s.crop_shape == (4, 4) and s.uri == "a.zarr"
    assert s.uris == ("a.zarr", "b.zarr")
    assert pickle.loads(pickle.dumps(s)) == s and hash(s) == hash(stoker.Sample(("a.zarr", "b.zarr"), s.aabb))
    assert s != stoker.Sample(["b.zarr", "a.zarr"], s.aabb)
    one = stoker.Sample("a.zarr", s.aabb)
    assert one.channels is None and one.shape == (4, 4) and one != stoker.Sample(["a.zarr"], s.aabb)
    assert eval(repr(s), {"Sample": stoker.Sample}) == s
    with pytest.raises(stoker.InvalidArgument, match="at least one"):
        stoker.Sample([], [(0, 1)])
    with pytest.raises(stoker.InvalidArgument, match="string or path"):
        stoker.Sample(["a.zarr", 3], [(0, 1)])


# -- samplers over groups --------------------------------------------------------------------------


def test_sampler_groups_are_checked(cube):
    uris, _ = cube
    with pytest.raises(stoker.InvalidArgument, match="same number of arrays"):
        stoker.TileGrid([[uris["t2m"], uris["u10"]], [uris["t2m"]]], (4, 4, 4))
    with pytest.raises(stoker.InvalidArgument, match="same number of arrays"):
        stoker.RandomCrops([[uris["t2m"], uris["u10"]], uris["v10"]], (4, 4, 4))
    with pytest.raises(stoker.InvalidArgument, match="one shape") as err:
        stoker.RandomCrops([[uris["t2m"], uris["small"]]], (4, 4, 4))
    assert err.value.uri == uris["small"]
    with pytest.raises(stoker.InvalidArgument, match="wrap it in a list"):
        stoker.TileGrid(uris["t2m"], (4, 4, 4))


def test_single_array_fingerprints_do_not_change(cube):
    """Groups are new; sources of single arrays keep their identity (saved states still resume)."""
    uris, _ = cube
    a = stoker.TileGrid([uris["t2m"]], (4, 4, 4))
    assert a.arrays == [uris["t2m"]]
    assert a.fingerprint != stoker.TileGrid([[uris["t2m"]]], (4, 4, 4)).fingerprint


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("policy", ["strided", "contiguous"])
def test_tile_grid_of_groups_shards_cover_every_tile_once(cube, world, policy):
    uris, _ = cube
    groups = [[uris["t2m"], uris["u10"], uris["v10"]], [uris["v10"], uris["t2m"], uris["u10"]]]
    src = stoker.TileGrid(groups, (5, 10, 13), shuffle=True, seed=3)
    assert len(src) == 2 * 4 * 3 * 2
    shares = [list(src.for_rank(r, world, policy=policy)) for r in range(world)]
    got = [s for share in shares for s in share]
    # a grid's split never loses a tile: every rank the same count, short ranks repeat from the start
    assert len({len(share) for share in shares}) == 1
    assert len(got) == -(-len(src) // world) * world and len(got) - len(set(got)) == len(got) - len(src)
    everything = set(src.sample(0, i) for i in range(len(src)))
    assert set(got) == everything and len(everything) == len(src)
    assert all(s.channels == 3 and list(s.uris) in groups and s.shape == (3, 5, 10, 13) for s in got)


def test_random_crops_of_groups_resume_exactly_on_another_world_size(cube, decode_path):
    """Two ranks take 3 batches each and save; three ranks finish the epoch from that state: together exactly
    the epoch's samples, once each, and every batch equals the zarr-python oracle."""
    uris, data = cube
    names = ["t2m", "u10", "v10"]
    src = stoker.RandomCrops([[uris[n] for n in names]], (4, 6, 5), seed=11, samples_per_epoch=36)
    cfg = stoker.Config(batch_size=2, dtype="f32", lookahead_batches=3, device="cpu", n_compute_threads=2,
                        host_buffer_bytes=32 << 20)
    seen, states = [], []
    for rank in range(2):
        with stoker.Pipeline(cfg) as p:
            p.push(src.for_rank(rank, 2))
            for _ in range(3):
                with p.pop() as b:
                    assert b.info.shape == (2, 3, 4, 6, 5)
                    seen += _check(b, data, names)
            states.append(p.state_dict()["sources"][0])
    assert states[0]["position"] == states[1]["position"] == 12
    for rank in range(3):
        mine = src.for_rank(rank, 3)
        mine.load_state_dict(states[rank % 2])
        with stoker.Pipeline(cfg) as p:
            p.push(mine)
            batches = 0
            for b in p:
                seen += _check(b, data, names)
                batches += 1
        assert batches == 4  # 24 samples left, 8 a rank, 2 a batch
    assert sorted(map(repr, seen)) == sorted(repr(src.sample(0, i)) for i in range(36))


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_channels_whose_dimensions_come_in_another_order_are_refused(tmp_path, zarr_format):
    """Two variables xarray wrote as (time, y, x) and (time, x, y) on a square grid have one shape, so their
    channels were stacked by axis position: the second transposed against the first, without a word (xarray
    aligns them by name). An InvalidArgument naming both orders now, for plain samples and fields alike;
    arrays that name the same dimensions in the same order, or none, are read as before."""
    xr = pytest.importorskip("xarray")
    a = np.arange(4 * 8 * 8, dtype="f4").reshape(4, 8, 8)
    xr.Dataset({"a": (("time", "y", "x"), a), "b": (("time", "x", "y"), a.transpose(0, 2, 1).copy()),
                "c": (("time", "y", "x"), a + 1)}).to_zarr(str(tmp_path / "d.zarr"), zarr_format=zarr_format)
    uri = {v: str(tmp_path / "d.zarr" / v) for v in "abc"}
    box = [(0, 2), (0, 8), (0, 8)]
    with pytest.raises(stoker.InvalidArgument, match=r"\('time', 'x', 'y'\).*\('time', 'y', 'x'\)") as err:
        _batches([stoker.Sample([uri["a"], uri["b"]], box)])
    assert err.value.uri == uri["b"]
    fields = {"x": stoker.Field([uri["a"], uri["b"]], (2, 8, 8))}
    with pytest.raises(stoker.InvalidArgument, match="field 'x'.*dimensions"):
        _batches(stoker.RandomCrops(fields, seed=0, samples_per_epoch=1).for_rank(0, 1), batch_size=1)
    (same,), _ = _batches([stoker.Sample([uri["a"], uri["c"]], box)])
    np.testing.assert_array_equal(same[0].numpy(), np.stack([a[:2], a[:2] + 1]))


def test_channels_whose_dimension_names_cannot_be_read_are_read_as_before(tmp_path):
    """The dimension-order check of channels is advisory: an array whose ``_ARRAY_DIMENSIONS`` is malformed
    (one name on a 2-d array) is left out of it, and with ``cf=False`` (nothing else reads those names) its
    channels are read as they were before the check, not refused."""
    a = np.arange(64, dtype="f4").reshape(8, 8)
    uris = []
    for name, attrs in (("a", {"_ARRAY_DIMENSIONS": ["y"]}), ("b", {"_ARRAY_DIMENSIONS": ["y", "x"]})):
        z = zarr.create_array(str(tmp_path / f"{name}.zarr"), shape=(8, 8), chunks=(4, 4), dtype="f4",
                              zarr_format=2, attributes=attrs)
        z[:] = a
        uris.append(str(tmp_path / f"{name}.zarr"))
    (got,), _ = _batches([stoker.Sample(uris, [(0, 8), (0, 8)])], cf=False)
    np.testing.assert_array_equal(got[0].numpy(), np.stack([a, a]))



def test_a_malformed_dimension_attribute_is_requested_once(tmp_path):
    """A remote v2 array whose ``_ARRAY_DIMENSIONS`` is malformed, read as a channel in two groups: its
    ``.zattrs`` was requested again at each look (the failed read was not kept: here once per group's
    dimension check, and once more for any other reader of its names), the same bytes and the same error
    each time. The first read's error is kept with the reader now: one request, the same MetadataError."""
    from range_server import RangeServer

    a = np.arange(64, dtype="f4").reshape(8, 8)
    for name, attrs in (("a", {"_ARRAY_DIMENSIONS": ["y"]}), ("b", {"_ARRAY_DIMENSIONS": ["y", "x"]}),
                        ("c", {"_ARRAY_DIMENSIONS": ["y", "x"]})):
        zarr.create_array(str(tmp_path / f"{name}.zarr"), shape=(8, 8), chunks=(4, 4), dtype="f4", zarr_format=2,
                          attributes=attrs)[:] = a
    server = RangeServer(str(tmp_path))
    try:
        uri = {n: f"{server.url}/{n}.zarr" for n in "abc"}
        box = [(0, 8), (0, 8)]
        got, _ = _batches([stoker.Sample([uri["a"], uri["b"]], box), stoker.Sample([uri["a"], uri["c"]], box)],
                          cf=False, batch_size=1)
        for batch in got:
            np.testing.assert_array_equal(batch[0].numpy(), np.stack([a, a]))
        assert server.paths.count("/a.zarr/.zattrs") == 1, server.paths
        reader = stoker.open_array(uri["a"])
        for _ in range(2):
            with pytest.raises(stoker.MetadataError, match=r"dimension names \['y'\] are not 2 names"):
                coords.dimension_names(reader)
        assert server.paths.count("/a.zarr/.zattrs") == 2, server.paths  # the new reader's one
    finally:
        server.shutdown()