"""stoker.compute_stats of Zarr arrays: against numpy over zarr-python's reads, over real gloo ranks, cached.

Arrays written by zarr-python (v2 and v3, plain and sharded, float with NaN and integer dtypes); the
expected statistics are numpy's over zarr-python's read of the same region. The cache is watched through
the LocalStore's read counters; two real gloo process groups (1 and 2 ranks) compute the same statistics.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

import stoker
from stoker.arraystats import compute as compute_mod
from stoker.arraystats.compute import Units, blocks
from stoker.errors import InvalidArgument, NonFiniteData, OutOfBounds
from stoker.records import sidecar
from stoker.storage import LocalStore
from stoker.transforms import Normalize

from gloo_ranks import gloo_group, spawn_ranks, write_result

pytestmark = pytest.mark.timeout(120)


def write(path, data, chunks, shards=None, zarr_format=3, compressor="zstd"):
    if zarr_format == 2:
        z = zarr.create_array(str(path), shape=data.shape, chunks=chunks, dtype=data.dtype, zarr_format=2,
                              fill_value=0)
    else:
        comp = {"zstd": ZstdCodec(level=1), "blosc": BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")}[compressor]
        z = zarr.create_array(str(path), shape=data.shape, chunks=chunks, shards=shards, dtype=data.dtype,
                              compressors=comp, fill_value=0)
    z[...] = data
    return str(path)


def truth(uri, region=None, channel_axis=None):
    """numpy's statistics of zarr-python's read of the region (float64; NaN and infinities left out)."""
    a = zarr.open_array(uri, mode="r")
    sel = [slice(None)] * a.ndim
    for axis, (start, stop) in (region or {}).items():
        sel[axis] = slice(start, stop)
    x = np.asarray(a[tuple(sel)]).astype(np.float64)
    if channel_axis is None:
        x = x.reshape(-1, 1)
    else:
        x = np.moveaxis(x, channel_axis, -1).reshape(-1, x.shape[channel_axis])
    finite = np.isfinite(x)
    y = np.where(finite, x, np.nan)
    out = {"count": x.shape[0], "skipped": (~finite).sum(0), "mean": np.nanmean(y, 0), "std": np.nanstd(y, 0),
           "min": np.nanmin(y, 0), "max": np.nanmax(y, 0)}
    if channel_axis is None:
        out = {k: (v[0] if isinstance(v, np.ndarray) else v) for k, v in out.items()}
    return out


def assert_matches(st, want, rtol=1e-12):
    assert int(st.count) == want["count"]
    np.testing.assert_array_equal(st.skipped.numpy(), want["skipped"])
    for key in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(getattr(st, key).numpy(), want[key], rtol=rtol, atol=1e-9, err_msg=key)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arrays")
    rng = np.random.default_rng(7)
    f = rng.normal(1e4, 3.0, size=(20, 37, 45)).astype(np.float32)  # a large mean next to the spread
    f[rng.random(f.shape) < 0.01] = np.nan
    f[0, 0, 0] = np.inf
    i16 = rng.integers(-30000, 30000, size=(20, 37, 45)).astype(np.int16)
    u8 = rng.integers(0, 256, size=(3, 30, 41)).astype(np.uint8)  # (C, Y, X)
    return {
        "float_nan": write(tmp / "f.zarr", f, (8, 16, 16), compressor="blosc"),
        "int16_sharded": write(tmp / "i.zarr", i16, (4, 8, 16), shards=(8, 16, 32)),
        "uint8_channels": write(tmp / "u.zarr", u8, (1, 16, 16)),
        "float_v2": write(tmp / "v2.zarr", f, (5, 10, 45), zarr_format=2),
        "float_other": write(tmp / "g.zarr", (f * 0.5 + 3).astype(np.float32), (8, 16, 16)),
    }


@pytest.mark.parametrize("name,region,channel_axis", [
    ("float_nan", None, None),
    ("float_nan", {0: (3, 17), -1: (5, 40)}, None),
    ("int16_sharded", None, None),
    ("int16_sharded", {1: (7, 30), 2: (None, 20)}, None),  # across shard and inner chunk borders
    ("int16_sharded", {0: (2, 19)}, 0),
    ("uint8_channels", None, 0),
    ("uint8_channels", {0: (1, 3), 2: (10, 41)}, 0),
    ("float_v2", {1: (0, 11)}, None),
    ("float_nan", None, 2),  # channels on a chunked axis: each unit spans every channel
])
def test_statistics_equal_numpy(arrays, name, region, channel_axis):
    uri = arrays[name]
    st = stoker.compute_stats(uri, region, channel_axis=channel_axis, cache=False, threads=3)
    assert_matches(st, truth(uri, region, channel_axis))


def test_blocks_depend_on_the_unit_count_alone(monkeypatch, arrays):
    """Units tile the region exactly once; blocks cut them in order; with fewer blocks than units (forced
    small) the statistics are still numpy's."""
    u = Units(((3, 17), (0, 37), (5, 40)), (8, 16, 16))
    seen = np.zeros((20, 37, 45), dtype=int)
    for i in range(len(u)):
        seen[tuple(slice(a, b) for a, b in u[i])] += 1
    assert len(u) == 3 * 3 * 3 and seen[3:17, :, 5:40].min() == 1 and seen.sum() == 14 * 37 * 35
    assert [list(b) for b in blocks(5)] == [[0], [1], [2], [3], [4]]
    monkeypatch.setattr(compute_mod, "MAX_BLOCKS", 4)
    assert [len(b) for b in blocks(18)] == [4, 5, 4, 5]
    assert [u for b in blocks(18) for u in b] == list(range(18))
    uri = arrays["float_nan"]
    assert_matches(stoker.compute_stats(uri, cache=False), truth(uri))


def test_lists_channels_and_fields(arrays):
    f, g, i = arrays["float_nan"], arrays["float_other"], arrays["int16_sharded"]

    class Field:  # what stoker.Field is to compute_stats: an object naming its arrays
        def __init__(self, arrays):
            self.arrays = arrays

    listed = stoker.compute_stats([f, [f, g], i], cache=False)
    assert len(listed) == 3 and listed[0].mean.shape == () and listed[1].mean.shape == (2,)
    assert_matches(listed[0], truth(f))
    assert_matches(listed[2], truth(i))
    for c, uri in enumerate((f, g)):
        want = truth(uri)
        assert int(listed[1].count) == want["count"] and int(listed[1].skipped[c]) == want["skipped"]
        np.testing.assert_allclose(listed[1].mean[c].item(), want["mean"], rtol=1e-12)
        np.testing.assert_allclose(listed[1].std[c].item(), want["std"], rtol=1e-12)
    fields = stoker.compute_stats({"raw": Field([f, g]), "labels": Field(i), "plain": [g]}, cache=False)
    assert list(fields) == ["raw", "labels", "plain"]
    assert torch.equal(fields["raw"].mean, listed[1].mean) and torch.equal(fields["labels"].std, listed[2].std)
    assert fields["plain"].mean.shape == (1,)
    one = stoker.compute_stats(Field([f, g]), cache=False)
    assert torch.equal(one.mean, listed[1].mean)


def test_argument_errors_name_what_is_wrong(arrays):
    f, u = arrays["float_nan"], arrays["uint8_channels"]
    with pytest.raises(OutOfBounds, match=r"region\[0\] = \(0, 99\).*f\.zarr"):
        stoker.compute_stats(f, {0: (0, 99)}, cache=False)
    with pytest.raises(InvalidArgument, match="names the dimension 'time', but the array's dimensions are not named"):
        stoker.compute_stats(f, {"time": (0, 3)}, cache=False)
    with pytest.raises(InvalidArgument, match="different shapes"):
        stoker.compute_stats([[f, u]], cache=False)
    with pytest.raises(InvalidArgument, match="channel_axis=5 does not exist"):
        stoker.compute_stats(f, channel_axis=5, cache=False)
    with pytest.raises(InvalidArgument, match="one or the other"):
        stoker.compute_stats([[f, f]], channel_axis=0, cache=False)
    with pytest.raises(InvalidArgument, match="nonfinite"):
        stoker.compute_stats(f, nonfinite="zero", cache=False)
    with pytest.raises(InvalidArgument, match="empty"):
        stoker.compute_stats([], cache=False)
    # cf="False" (from a config file) was truthy: the decoded values' statistics, not the stored ones asked for
    with pytest.raises(InvalidArgument, match="cf must be True") as info:
        stoker.compute_stats(f, cf="False", cache=False)
    assert info.value.knob == "cf"
    with pytest.raises(InvalidArgument, match="timeout_s must be a number of seconds") as info:
        stoker.compute_stats(f, timeout_s="10", cache=False)  # was a TypeError from the comparison
    assert info.value.knob == "timeout_s"


def test_numpy_integers_are_ints_for_channel_axis_and_threads(arrays):
    """channel_axis=np.int64(0) (what numpy's own lookups return) was refused as "must be an int", though region
    bounds take numpy integers; it is the int it holds."""
    u = arrays["uint8_channels"]
    st = stoker.compute_stats(u, channel_axis=np.int64(0), threads=np.int32(2), cache=False)
    assert_matches(st, truth(u, channel_axis=0))


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e300])
def test_an_unbounded_read_timeout_waits_instead_of_overflowing(arrays, timeout_s):
    """timeout_s=inf (no limit) or a huge number: an OverflowError from the wait ("timestamp out of range for
    platform time_t") before any statistics; now the wait is capped at what the platform can wait."""
    f = arrays["float_nan"]
    assert_matches(stoker.compute_stats(f, timeout_s=timeout_s, cache=False, threads=2), truth(f))


def test_nonfinite_raise_names_the_array_and_box(arrays, tmp_path):
    f = arrays["float_nan"]
    with pytest.raises(NonFiniteData, match=r"f\.zarr: the box \[\(0, 8\), \(0, 16\), \(0, 16\)\] holds") as info:
        stoker.compute_stats(f, nonfinite="raise", cache=False, threads=2)
    assert info.value.uri == f
    i = arrays["int16_sharded"]  # integers hold none: "raise" changes nothing
    assert_matches(stoker.compute_stats(i, nonfinite="raise", cache=False), truth(i))
    nan = write(tmp_path / "nan.zarr", np.full((4, 4), np.nan, dtype=np.float32), (2, 2))
    with pytest.raises(NonFiniteData, match="no finite value"):
        stoker.compute_stats(nan, cache=False)
    # per channel: the count is the empty channel's (10), not every channel's non-finite values (14)
    part = np.ones((3, 10), dtype=np.float32)
    part[1] = np.nan
    part[2, :4] = np.inf
    part_uri = write(tmp_path / "part.zarr", part, (1, 5))
    with pytest.raises(NonFiniteData, match=r"no finite value in channel\(s\) \[1\], only 10 non-finite") as info:
        stoker.compute_stats(part_uri, channel_axis=0, cache=False)
    assert info.value.count == 10


def test_a_statistics_file_of_the_version_before_is_not_used(tmp_path):
    """Version 2 of the statistics files came with exact merges of the means (Moments.mean_lo): a version 1
    file, whose stds could be a percent off, is computed again, not read."""
    data = np.random.default_rng(4).normal(0, 1, size=(8, 16, 16))
    uri = write(tmp_path / "v.zarr", data, (4, 8, 8))
    fresh = stoker.compute_stats(uri)
    path = sidecar.path_for(uri)
    doc = json.loads(open(path).read())
    assert doc["version"] == sidecar.VERSION == 2
    doc["version"] = 1  # as the code before wrote it, with a std that is not this array's
    for entry in doc["entries"].values():
        entry["stats"]["array"]["std"] = 7.0
    with open(path, "w") as f:
        json.dump(doc, f)
    again = stoker.compute_stats(uri)
    assert torch.equal(again.std, fresh.std) and not torch.equal(again.std, torch.full_like(fresh.std, 7.0))


def test_cache_hit_reads_no_chunk_and_a_write_invalidates(tmp_path):
    rng = np.random.default_rng(3)
    data = rng.normal(0, 1, size=(16, 40, 40)).astype(np.float32)
    uri = write(tmp_path / "c.zarr", data, (4, 8, 8), shards=(8, 16, 16))
    meta_only = LocalStore()
    stoker.open_array(uri, store=meta_only)  # what opening the array costs: its metadata, no chunk
    opened = meta_only.counters.reads

    first_store = LocalStore()
    first = stoker.compute_stats(uri, {0: (2, 14)}, store=first_store)
    assert first_store.counters.reads > opened + 10  # the chunks were read
    path = sidecar.path_for(uri)
    assert os.path.isfile(path)
    st = os.stat(path)

    again_store = LocalStore()
    again = stoker.compute_stats(uri, {0: (2, 14)}, store=again_store)
    assert again_store.counters.reads == opened  # the cache: no chunk read
    assert (os.stat(path).st_ino, os.stat(path).st_mtime_ns) == (st.st_ino, st.st_mtime_ns)  # not rewritten
    for key in ("count", "mean", "std", "min", "max", "skipped"):
        assert torch.equal(getattr(first, key), getattr(again, key)), key

    other = stoker.compute_stats(uri, {0: (0, 14)}, store=LocalStore())  # another region: another entry
    assert_matches(other, truth(uri, {0: (0, 14)}))
    assert len(json.loads(open(path).read())["entries"]) == 2

    z = zarr.open_array(uri, mode="r+")  # zarr-python rewrites one chunk (one shard)
    z[5, 3, 3] = 1000.0
    after_store = LocalStore()
    after = stoker.compute_stats(uri, {0: (2, 14)}, store=after_store)
    assert after_store.counters.reads > opened + 10
    assert after.max.item() == 1000.0 and not torch.equal(after.mean, first.mean)
    assert_matches(after, truth(uri, {0: (2, 14)}))


def test_unwritable_folder_only_warns(tmp_path, monkeypatch):
    uri = write(tmp_path / "ro.zarr", np.arange(64, dtype=np.float32).reshape(8, 8), (4, 4))

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(sidecar, "write", refuse)
    monkeypatch.setattr(sidecar, "claim_computation", refuse)
    with pytest.warns(RuntimeWarning, match="could not write"):
        st = stoker.compute_stats(uri)
    assert_matches(st, truth(uri))


def test_normalize_from_stats_on_a_pipeline_batch(tmp_path):
    """Per-channel statistics of two arrays (channels of one sample) normalise a batch of tiles that cover
    the region exactly to mean 0, std 1 per channel."""
    rng = np.random.default_rng(11)
    a = write(tmp_path / "a.zarr", rng.integers(0, 4000, size=(24, 32, 32)).astype(np.uint16), (8, 8, 16))
    b = write(tmp_path / "b.zarr", rng.normal(-50, 7, size=(24, 32, 32)).astype(np.float32), (6, 16, 16),
              shards=(12, 32, 32))
    region = {0: (8, 24)}
    st = stoker.compute_stats([[a, b]], region, cache=False)[0]
    tiles = [stoker.Sample([a, b], [(z, z + 8), (y, y + 16), (0, 32)]) for z in (8, 16) for y in (0, 16)]
    cfg = stoker.Config(batch_size=4, dtype="f32", host_buffer_bytes=32 << 20, n_io_threads=2,
                        n_compute_threads=2, pop_timeout_s=20.0, device="cpu", transform=Normalize.from_stats(st))
    with stoker.Pipeline(cfg) as p:
        p.push(tiles)
        for batch in p.batches(1):  # a batch is released when the next is asked for: copy it out
            x = torch.from_dlpack(batch).double()
    assert x.shape == (4, 2, 8, 16, 32)
    per_channel = x.transpose(0, 1).reshape(2, -1)
    np.testing.assert_allclose(per_channel.mean(1).numpy(), [0, 0], atol=1e-5)
    np.testing.assert_allclose(per_channel.std(1, unbiased=False).numpy(), [1, 1], rtol=1e-5)


def _channels_last(tmp_path, shape, channel_axis):
    """A uint16 array whose channels (on ``channel_axis``) differ by orders of magnitude in mean and spread."""
    rng = np.random.default_rng(5)
    c = shape[channel_axis]
    centre = (1000.0 * 4 ** np.arange(c)).reshape([c if a == channel_axis % len(shape) else 1
                                                    for a in range(len(shape))])
    data = np.clip(rng.normal(centre, centre / 10, size=shape), 0, 65535).astype(np.uint16)
    return write(tmp_path / "c.zarr", data, (2, 4, 4, 4)), data


@pytest.mark.parametrize("shape,channel_axis", [((4, 8, 8, 4), -1), ((4, 8, 8, 4), 3), ((4, 4, 8, 8), 0)])
def test_from_stats_normalises_the_axis_the_statistics_were_computed_along(tmp_path, shape, channel_axis):
    """Statistics per index of an array axis normalise that axis of a (B, *box) batch: with channel_axis=-1 on a
    (4, 8, 8, 4) array, Normalize.from_stats normalised batch axis 1 (Z, of size 4 too), silently, leaving
    per-channel stds of [0.48, 4.6, 53, 586]."""
    uri, data = _channels_last(tmp_path, shape, channel_axis)
    st = stoker.compute_stats(uri, channel_axis=channel_axis, progress=False)
    hit = stoker.compute_stats(uri, channel_axis=channel_axis, progress=False)  # from the cache: the same axis
    assert (st.channel_axis, st.ndim) == (hit.channel_axis, hit.ndim) == (channel_axis % 4 - 4, 4)
    box = [(0, n) for n in shape]
    cfg = stoker.Config(batch_size=2, dtype="f32", host_buffer_bytes=16 << 20, n_io_threads=2,
                        n_compute_threads=2, pop_timeout_s=20.0, device="cpu", transform=Normalize.from_stats(st))
    with stoker.Pipeline(cfg) as p:
        p.push([stoker.Sample(uri, box), stoker.Sample(uri, box)])
        for batch in p.batches(1):
            x = torch.from_dlpack(batch).double().numpy().copy()
    assert x.shape == (2, *shape)
    axis = channel_axis + 1 if channel_axis >= 0 else channel_axis  # the batch axis of the array's channels
    per_channel = np.moveaxis(x, axis, 0).reshape(shape[channel_axis], -1)
    np.testing.assert_allclose(per_channel.mean(1), 0, atol=1e-5)
    np.testing.assert_allclose(per_channel.std(1), 1, rtol=1e-5)
    # numpy's own normalisation of the stored values, element by element
    mean = np.moveaxis(data.astype(np.float64), channel_axis, -1).reshape(-1, shape[channel_axis]).mean(0)
    std = np.moveaxis(data.astype(np.float64), channel_axis, -1).reshape(-1, shape[channel_axis]).std(0)
    want = (np.moveaxis(data.astype(np.float64), channel_axis, -1) - mean) / std
    np.testing.assert_allclose(np.moveaxis(x[0], channel_axis, -1), want, atol=1e-5)


def test_per_array_channel_statistics_on_a_batch_of_several_arrays_are_refused(tmp_path):
    """Statistics computed along an axis of one array describe that array: on a (B, A, *box) batch of two
    arrays they would normalise both with one's numbers, so that is an InvalidArgument saying what to pass."""
    uri, _ = _channels_last(tmp_path, (4, 8, 8, 4), -1)
    st = stoker.compute_stats(uri, channel_axis=-1, cache=False, progress=False)
    assert st.channel_axis == -1
    box = [(0, 4), (0, 8), (0, 8), (0, 4)]
    cfg = stoker.Config(batch_size=1, dtype="f32", host_buffer_bytes=16 << 20, n_compute_threads=2,
                        pop_timeout_s=20.0, device="cpu", transform=Normalize.from_stats(st))
    with pytest.raises(InvalidArgument, match=r"one array.*axis=-1"):
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample([uri, uri], box)])
            with p.pop():
                pass


def _push_fields(fields, transform):
    cfg = stoker.Config(batch_size=2, dtype="f32", host_buffer_bytes=16 << 20, n_compute_threads=2,
                        pop_timeout_s=20.0, device="cpu", transform=transform)
    with stoker.Pipeline(cfg) as p:
        p.push(stoker.TileGrid(fields, stride=(4, 8, 8)))
        with p.pop() as batch:
            return {k: torch.from_dlpack(v).double().numpy().copy() for k, v in batch.items()}


def test_one_array_s_scalar_statistics_on_a_field_of_channels_are_refused(tmp_path):
    """compute_stats of one array (a scalar mean and std) given to a field of three arrays stacked as channels
    (t2m near 280, u10 near 0, msl near 101300) normalised every channel with t2m's numbers, silently: the
    pipeline now refuses it, naming the field and its channels; shared=True does it on purpose, numpy's way."""
    rng = np.random.default_rng(3)
    datas = {n: rng.normal(m, s, size=(8, 8, 8)).astype(np.float32)
             for n, m, s in (("t2m", 280, 5), ("u10", 0, 3), ("msl", 101300, 800))}
    uris = [write(tmp_path / f"{n}.zarr", d, (4, 8, 8)) for n, d in datas.items()]
    t2m = stoker.compute_stats(uris[0], cache=False, progress=False)
    assert t2m.mean.dim() == 0 and t2m.ndim == 3
    fields = {"x": stoker.Field(uris, (4, 8, 8)), "one": stoker.Field(uris[0], (4, 8, 8))}
    with pytest.raises(InvalidArgument, match=r"field 'x' of the batch has shape \(2, 3, 4, 8, 8\): 3 channels.*"
                                              r"channel_axis=k.*shared=True") as err:
        _push_fields(fields, Normalize.from_stats(t2m, field="x"))
    assert err.value.context.get("field") == "x" and err.value.context.get("channels") == 3
    # the same statistics on the field of that one array (B, *box) are right, as numpy normalises it
    got = _push_fields(fields, Normalize.from_stats(t2m, field="one"))
    d = datas["t2m"].astype(np.float64)
    np.testing.assert_allclose(got["one"][0], ((d - d.mean()) / d.std())[:4], atol=1e-5)
    # on purpose: one mean and std for every channel
    got = _push_fields(fields, Normalize.from_stats(t2m, field="x", shared=True))
    np.testing.assert_allclose(got["x"][0], [((v[:4].astype(np.float64) - d.mean()) / d.std())
                                             for v in datas.values()], rtol=1e-5, atol=1e-3)
    # per-channel statistics of the field: every channel to mean 0, std 1 over the whole arrays, as numpy's
    per = stoker.compute_stats({"x": fields["x"]}, cache=False, progress=False)["x"]
    np.testing.assert_allclose(per.mean.numpy(), [v.astype(np.float64).mean() for v in datas.values()], rtol=1e-9)
    got = _push_fields(fields, Normalize.from_stats(per, field="x"))
    want = [(v[:4].astype(np.float64) - v.astype(np.float64).mean()) / v.astype(np.float64).std()
            for v in datas.values()]
    np.testing.assert_allclose(got["x"][0], want, atol=1e-4)
    with pytest.raises(InvalidArgument, match="one per channel"):
        Normalize.from_stats(per, shared=True)


def test_one_array_s_scalar_statistics_on_an_array_with_a_channel_axis_are_refused(tmp_path):
    """A 3-d array's scalar statistics on the crops of a 4-d array (a channel axis first) are refused too."""
    rng = np.random.default_rng(4)
    plain = write(tmp_path / "p.zarr", rng.normal(0, 1, size=(8, 8, 8)).astype(np.float32), (4, 8, 8))
    chans = write(tmp_path / "c.zarr", rng.normal(0, 1, size=(3, 8, 8, 8)).astype(np.float32), (3, 4, 8, 8))
    st = stoker.compute_stats(plain, cache=False, progress=False)
    cfg = stoker.Config(batch_size=1, dtype="f32", host_buffer_bytes=16 << 20, n_compute_threads=2,
                        pop_timeout_s=20.0, device="cpu", transform=Normalize.from_stats(st))
    with pytest.raises(InvalidArgument, match=r"\(1, 3, 4, 8, 8\): 3 channels on axis 1"):
        with stoker.Pipeline(cfg) as p:
            p.push([stoker.Sample(chans, [(0, 3), (0, 4), (0, 8), (0, 8)])])
            with p.pop():
                pass


def test_one_array_s_scalar_statistics_on_squeezed_crops_need_shared(tmp_path):
    """A batch of fewer axes than the array's crops cannot tell a squeezed slice of the array from squeezed
    crops of several arrays stacked as channels: a 4-D (T, Z, Y, X) array's statistics on (B, 2, 8, 8) of two
    variables normalised the second with the first's mean and std. Refused, naming shared=True and the order;
    shared=True normalises as numpy does, and Normalize before the squeeze, on (B, 1, H, W), is accepted."""
    rng = np.random.default_rng(5)
    data = rng.normal(3, 2, size=(4, 8, 8)).astype(np.float32)
    vol = write(tmp_path / "v.zarr", data, (2, 8, 8))
    st = stoker.compute_stats(vol, cache=False, progress=False)
    temp = rng.normal(15, 4, size=(3, 2, 8, 8)).astype(np.float32)
    st4 = stoker.compute_stats(write(tmp_path / "t.zarr", temp, (1, 2, 8, 8)), cache=False, progress=False)
    stacked = torch.from_numpy(np.stack([temp[0], rng.normal(35, 0.5, (2, 8, 8)).astype(np.float32)], 1).copy())
    for stats, batch in ((st4, stacked), (st, torch.from_numpy(data[:2].copy()))):
        with pytest.raises(InvalidArgument, match=r"fewer axes.*Put Normalize before the transform that squeezes.*"
                                                  r"shared=True"):
            Normalize.from_stats(stats)(batch.clone())
    want = (data[:2] - float(st.mean)) / float(st.std)
    out = Normalize.from_stats(st, shared=True)(torch.from_numpy(data[:2].copy()))  # on purpose
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6)
    out = Normalize.from_stats(st)(torch.from_numpy(data[:2, None].copy()))  # before the squeeze: (B, 1, H, W)
    np.testing.assert_allclose(out[:, 0].numpy(), want, rtol=1e-6, atol=1e-6)


def test_from_stats_passes_keywords_to_the_constructor(arrays):
    class Named(Normalize):  # a Normalize that takes one more keyword (as field= is for named fields)
        def __init__(self, mean, std, field=None):
            super().__init__(mean, std)
            self.field = field

    st = stoker.compute_stats([[arrays["float_nan"], arrays["float_other"]]], cache=False)[0]
    n = Named.from_stats(st, field="raw")
    assert n.field == "raw" and n.channels == 2
    assert torch.equal(n.mean, st.mean)


def test_records_still_go_to_the_records_statistics(tmp_path):
    from stoker.records import ZarrRecords

    root = tmp_path / "recs"
    for k in range(2):
        g = zarr.open_group(str(root / f"r{k}"), mode="w")
        g.create_array("x", data=np.arange(6, dtype=np.float32).reshape(2, 3) + k)
    st = stoker.compute_stats(ZarrRecords(str(root), fields={"x": ("N", 3)}), ["x"], cache=False)
    np.testing.assert_allclose(st["x"].mean.numpy(), [2.0, 3.0, 4.0])


# -- over real gloo ranks ----------------------------------------------------------------------------------


def _hexes(st) -> dict:
    return {k: [float(v).hex() for v in getattr(st, k).reshape(-1).tolist()]
            for k in ("count", "mean", "std", "min", "max", "skipped")}


def _worker(rank: int, world: int, tmp: str, uris: dict) -> None:
    with gloo_group(rank, world, tmp):
        out: dict = {}
        got = stoker.compute_stats({"f": uris["f"], "ch": [uris["f"], uris["g"]], "i": uris["i"]},
                                   {1: (3, 35)}, cache=False, threads=2)
        out["plain"] = {k: _hexes(v) for k, v in got.items()}
        out["axis"] = _hexes(stoker.compute_stats(uris["u"], channel_axis=0, cache=False))
        store = LocalStore()
        first = stoker.compute_stats(uris["i"], store=store)
        out["first_reads"] = store.counters.reads
        store = LocalStore()
        second = stoker.compute_stats(uris["i"], store=store)
        out["second_reads"] = store.counters.reads
        out["cached"] = [_hexes(first), _hexes(second)]
        try:  # ranks that see different data refuse together, before reading
            stoker.compute_stats(uris["f"] if rank == 0 else uris["g"], cache=True)
        except InvalidArgument as exc:
            out["different"] = str(exc)
        try:  # a failure on one rank is raised on every rank instead of leaving the others waiting
            stoker.compute_stats(uris["f"], nonfinite="raise", cache=False)
        except NonFiniteData as exc:
            out["nonfinite"] = str(exc)
        from stoker.reader.array import ArrayReader

        real = ArrayReader.read
        if rank == world - 1:  # the last rank's reads fail (a broken disk on its node)
            def broken(self, aabb):
                raise OSError(f"disk error reading {self.uri}")

            ArrayReader.read = broken  # type: ignore[method-assign]
        try:
            stoker.compute_stats(uris["g"], cache=False)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            out["failed"] = [type(exc).__name__, str(exc)]
        finally:
            ArrayReader.read = real  # type: ignore[method-assign]
        try:  # the last rank cannot open the array (its node lacks the path): every rank raises, none waits
            stoker.compute_stats(uris["f"] if rank < world - 1 else os.path.join(tmp, "absent.zarr"), cache=False)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            out["unopened"] = [type(exc).__name__, str(exc)]
        write_result(tmp, rank, out)
        dist.barrier()


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    """The same statistics over 1 and 2 gloo ranks (each its own copy of the data: the cache starts empty)."""
    runs = {}
    for world in (1, 2):
        tmp = tmp_path_factory.mktemp(f"world{world}")
        rng = np.random.default_rng(5)
        f = rng.normal(3, 2, size=(30, 40, 33)).astype(np.float32)
        f[rng.random(f.shape) < 0.02] = np.nan
        uris = {"f": write(tmp / "f.zarr", f, (4, 8, 8), compressor="blosc"),
                "g": write(tmp / "g.zarr", (f * 3).astype(np.float32), (7, 9, 33)),
                "i": write(tmp / "i.zarr", rng.integers(0, 1 << 30, size=(30, 40, 33)).astype(np.int64),
                           (4, 8, 11), shards=(8, 16, 33)),
                "u": write(tmp / "u.zarr", rng.integers(0, 255, size=(3, 40, 33)).astype(np.uint8), (1, 8, 8))}
        runs[world] = (uris, spawn_ranks(_worker, world, tmp, uris))
    return runs


def _unhex(h: dict) -> dict:
    return {k: np.array([float.fromhex(v) for v in vals]) for k, vals in h.items()}


@pytest.mark.timeout(300)
def test_one_and_two_ranks_give_the_same_statistics(ranked):
    uris1, one = ranked[1]
    uris2, two = ranked[2]
    assert two[0]["plain"] == two[1]["plain"] and two[0]["axis"] == two[1]["axis"]  # every rank, same bits
    for key in ("f", "ch", "i"):
        a, b = _unhex(one[0]["plain"][key]), _unhex(two[0]["plain"][key])
        for stat in a:  # within float rounding (the merge order is the same by construction: assert equal)
            np.testing.assert_allclose(a[stat], b[stat], rtol=1e-13, err_msg=f"{key}.{stat}")
        assert one[0]["plain"][key] == two[0]["plain"][key], key
    want = truth(uris2["i"], {1: (3, 35)})
    got = _unhex(two[0]["plain"]["i"])
    np.testing.assert_allclose(got["mean"][0], want["mean"], rtol=1e-12)
    np.testing.assert_allclose(got["std"][0], want["std"], rtol=1e-12)
    want = truth(uris2["u"], channel_axis=0)
    np.testing.assert_allclose(_unhex(two[1]["axis"])["mean"], want["mean"], rtol=1e-12)
    assert one[0]["axis"] == two[0]["axis"]


@pytest.mark.timeout(300)
def test_cache_over_ranks_and_errors_on_every_rank(ranked):
    for world, (uris, results) in ranked.items():
        for res in results:
            assert res["cached"][0] == res["cached"][1] == results[0]["cached"][0]
            assert res["second_reads"] < res["first_reads"]
            assert "f.zarr: the box" in res["nonfinite"]  # the same error, whichever rank read the box
        entries = json.loads(open(sidecar.path_for(uris["i"])).read())["entries"]
        assert len(entries) == 1 and next(iter(entries.values()))["world_size"] == world
        # a rank whose reads fail raises its error, and every other rank a StokerError naming it
        assert results[-1]["failed"] == ["OSError", f"disk error reading {uris['g']}"]
        for res in results[:-1]:
            assert res["failed"][0] == "StokerError" and f"rank(s) [{world - 1}]" in res["failed"][1]
        # a rank that cannot open the array raises why; the others a StokerError naming it, at once
        assert results[-1]["unopened"][0] == "NotFound"
        for res in results[:-1]:
            assert res["unopened"][0] == "StokerError" and f"rank(s) [{world - 1}]" in res["unopened"][1]
            assert "f.zarr" in res["unopened"][1]
        if world == 2:
            assert all("ranks see different data" in res["different"] for res in results)
        else:
            assert "different" not in results[0]


# -- arrays in stores: cached in $STOKER_CACHE, keyed by object versions / the archive ------------------------


def _spy_reads(monkeypatch) -> list:
    """Every ``ArrayReader.read`` call (the real method runs): how many boxes a call read."""
    from stoker.reader.array import ArrayReader

    calls: list = []
    real = ArrayReader.read

    def read(self, aabb):
        calls.append(self.uri)
        return real(self, aabb)

    monkeypatch.setattr(ArrayReader, "read", read)
    return calls


@pytest.mark.timeout(180)
def test_arrays_in_stores_cache_in_the_local_cache_and_see_rewrites(tmp_path, monkeypatch):
    from store_fixtures import BUCKET, MotoS3, read_tree, write_zip

    from range_server import RangeServer
    from stoker.storage.artifacts import dataset_dir

    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(9)
    data = rng.normal(0, 1, size=(24, 30)).astype(np.float32)
    root = tmp_path / "tree"
    local = write(root / "a.zarr", data, (8, 10))
    values = read_tree(str(root))
    s3 = MotoS3(values, "arraystats")
    http = RangeServer(str(root))
    try:
        write_zip(str(tmp_path / "d.zip"), values)
        where = {"s3": (f"s3://{BUCKET}/arraystats/a.zarr", s3.options), "zip": (str(tmp_path / "d.zip/a.zarr"), None)}
        for kind, (uri, options) in where.items():
            calls = _spy_reads(monkeypatch)
            st = stoker.compute_stats(uri, storage_options=options)
            assert_matches(st, truth(local))
            assert len(calls) == 9  # 3 x 3 chunks
            assert os.path.isfile(sidecar.path_for(str(dataset_dir(uri, options)))), kind
            again = stoker.compute_stats(uri, storage_options=options)
            assert len(calls) == 9 and torch.equal(again.mean, st.mean), kind  # the cache: no chunk read
        # rewrite one chunk: in the bucket (a new ETag), and the whole archive
        zarr.open_array(local, mode="r+")[0, 0] = 500.0
        changed = read_tree(str(root))
        key = next(k for k in changed if changed[k] != values[k])
        s3.client.put_object(Bucket=BUCKET, Key=f"arraystats/{key}", Body=changed[key])
        write_zip(str(tmp_path / "d.zip"), changed)
        for kind, (uri, options) in where.items():
            calls = _spy_reads(monkeypatch)
            st = stoker.compute_stats(uri, storage_options=options)
            assert len(calls) == 9 and st.max.item() == 500.0, kind
            assert_matches(st, truth(local))
        # HTTP cannot list: nothing identifies its data, so nothing is cached and every call reads
        calls = _spy_reads(monkeypatch)
        for _ in range(2):
            assert_matches(stoker.compute_stats(f"{http.url}/a.zarr"), truth(local))
        assert len(calls) == 18
    finally:
        http.stop()
        s3.stop()


@pytest.mark.timeout(180)
def test_the_samplers_storage_options_serve_arrays_in_a_store_beside_local_ones(tmp_path, monkeypatch):
    """Config's and the samplers' {URI prefix: options} work here too: each array gets its prefix's options (a
    local one none), so channels from a bucket and a local disk, and cfg.storage_options, need no other dict."""
    from store_fixtures import BUCKET, MotoS3, read_tree

    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(4)
    a = write(tmp_path / "tree" / "a.zarr", rng.normal(3, 2, size=(20, 12)).astype(np.float32), (7, 5))
    b = write(tmp_path / "b.zarr", rng.normal(-1, 5, size=(20, 12)).astype(np.float32), (6, 6))
    s3 = MotoS3(read_tree(str(tmp_path / "tree")), "prefixed")
    try:
        remote = f"s3://{BUCKET}/prefixed/a.zarr"
        cfg = stoker.Config(batch_size=2, storage_options={f"s3://{BUCKET}/": s3.options})
        st = stoker.compute_stats([[remote, b]], storage_options=cfg.storage_options, cache=False)[0]
        for c, uri in enumerate((a, b)):
            want = truth(uri)
            np.testing.assert_allclose(st.mean[c].item(), want["mean"], rtol=1e-12)
            np.testing.assert_allclose(st.std[c].item(), want["std"], rtol=1e-12)
        # one URI's options, as before
        assert_matches(stoker.compute_stats(remote, storage_options=s3.options, cache=False), truth(a))
        with pytest.raises(InvalidArgument, match="remote URI prefix"):  # a mix of the two forms is neither
            stoker.compute_stats(remote, storage_options={f"s3://{BUCKET}/": s3.options, "region": "x"})
    finally:
        s3.stop()


def test_dataloader_page_example_runs(tmp_path, monkeypatch):
    """docs/dataloader.md's "Statistics of arrays" example runs as written and says what it shows."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "dataloader.md"
    section = page.read_text().split("## Statistics of arrays", 1)[1]
    block = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "docs"}
    exec(compile(block, str(page), "exec"), ns)
    image = ns["image"]
    assert image.mean.shape == (2,) and image.skipped.tolist() == [4, 4]
    for c, name in enumerate(("red.zarr", "green.zarr")):
        assert (tmp_path / name / ".stoker-stats.json").is_file()
        want = truth(str(tmp_path / name), {0: (0, 12)})
        np.testing.assert_allclose(image.mean[c].item(), want["mean"], rtol=1e-12)
    assert ns["x"].shape == (2, 2, 4, 64, 64)
    assert ns["per_channel"].mean(1).abs().max() < 0.05
    assert (ns["per_channel"].std(1) - 1).abs().max() < 0.05


# -- the threads: order, a stuck read, the progress bar ----------------------------------------------------


def test_ordered_map_keeps_order_bounds_work_and_raises_in_place():
    import threading
    import time

    from stoker.arraystats.ordered import ordered_map

    rng = np.random.default_rng(2)
    delays = rng.random(40) * 0.01
    running, peak, lock = [0], [0], threading.Lock()

    def slow(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(delays[i])  # later items often finish first
        with lock:
            running[0] -= 1
        return i * i

    assert list(ordered_map(slow, list(range(40)), threads=4, timeout_s=10, what="t")) == [i * i for i in range(40)]
    assert 1 < peak[0] <= 4

    def boom(i):
        if i == 7:
            raise ValueError("item 7")
        return i

    out = []
    with pytest.raises(ValueError, match="item 7"):
        for v in ordered_map(boom, list(range(20)), threads=3, timeout_s=10, what="t"):
            out.append(v)
    assert out == list(range(7))


def test_a_stuck_read_is_an_error_not_a_hang(arrays, monkeypatch):
    import threading
    import time

    from stoker.errors import StorageError
    from stoker.reader.array import ArrayReader

    release = threading.Event()
    real = ArrayReader.read

    def stuck(self, aabb):
        if tuple(aabb)[0] == (8, 16):  # one chunk row never comes back (a hung mount)
            release.wait(30)
        return real(self, aabb)

    monkeypatch.setattr(ArrayReader, "read", stuck)
    start = time.monotonic()
    try:
        with pytest.raises(StorageError, match=r"f\.zarr: reading .*took more than 0\.5 s"):
            stoker.compute_stats(arrays["float_nan"], cache=False, threads=2, timeout_s=0.5)
    finally:
        release.set()
    assert time.monotonic() - start < 10


def test_progress_bar_on_long_work_only(arrays, monkeypatch, capfd):
    import time

    from stoker.reader.array import ArrayReader

    uri = arrays["int16_sharded"]  # 5 x 5 x 3 = 75 chunks
    stoker.compute_stats(uri, cache=False)  # quick: no bar
    assert "statistics of" not in capfd.readouterr().err
    real = ArrayReader.read

    def slow(self, aabb):
        time.sleep(0.03)
        return real(self, aabb)

    monkeypatch.setattr(ArrayReader, "read", slow)
    stoker.compute_stats(uri, cache=False, threads=1)
    err = capfd.readouterr().err
    assert f"statistics of {uri}" in err and "75/75" in err
    stoker.compute_stats(uri, cache=False, threads=1, progress=False)
    assert "statistics of" not in capfd.readouterr().err


def test_bits_do_not_depend_on_torch_threads(tmp_path):
    """torchrun runs several ranks per node with one torch thread each, a lone process with every core: the
    statistics must not change with that (torch's reductions split over its threads; numpy's do not)."""
    rng = np.random.default_rng(4)
    # one chunk of 4M values: torch splits a reduction that large over its threads
    uri = write(tmp_path / "big.zarr", (rng.normal(0, 1e3, size=(1, 2048, 2048)) + 1e6).astype(np.float64),
                (1, 2048, 2048))
    before = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            got.append(_hexes(stoker.compute_stats(uri, cache=False, threads=1, progress=False)))
    finally:
        torch.set_num_threads(before)
    assert got[0] == got[1] == got[2]


def test_threads_the_system_refuses_name_compute_stats_threads(arrays):
    import threading

    from stoker.errors import ThreadStartError

    threading.stack_size(1 << 40)  # no system maps a 1 TiB stack: Python's "can't start new thread"
    try:
        with pytest.raises(ThreadStartError, match=r"Lower compute_stats\.threads") as info:
            # no bar: tqdm would give up its monitor thread for the rest of the process
            stoker.compute_stats(arrays["int16_sharded"], cache=False, threads=2, progress=False)
    finally:
        threading.stack_size(0)
    assert info.value.knob == "threads"
    assert_matches(stoker.compute_stats(arrays["int16_sharded"], cache=False, threads=2),
                   truth(arrays["int16_sharded"]))  # threads again: it works


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_cf_packed_variables_give_the_statistics_of_what_batches_hold(tmp_path, zarr_format):
    """A variable xarray packed as int16 (scale_factor, add_offset, _FillValue): the statistics are those of the
    decoded values (xarray's, fills left out as NaN), which a Config(cf=True) batch holds; cf=False those of the
    stored integers. The two are cached apart."""
    xr = pytest.importorskip("xarray")
    rng = np.random.default_rng(3)
    t2m = (280 + 5 * rng.normal(0, 1, (12, 8, 16))).astype("float32")
    t2m[2, :3, :3] = np.nan
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), t2m)})
    path = str(tmp_path / "era.zarr")
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, consolidated=False, encoding={
        "t2m": {"dtype": "int16", "scale_factor": 0.01, "add_offset": 280.0, "_FillValue": -32768,
                "chunks": (4, 8, 16)}})
    decoded = xr.open_zarr(path, consolidated=False)["t2m"].values[1:9].astype(np.float64)
    st = stoker.compute_stats(path + "/t2m", region={0: (np.int64(1), np.int64(9))}, progress=False)
    assert int(st.skipped) == 9 and int(st.count) == decoded.size
    np.testing.assert_allclose(float(st.mean), np.nanmean(decoded), rtol=1e-6)
    np.testing.assert_allclose(float(st.std), np.nanstd(decoded), rtol=1e-4)
    assert float(st.min) == pytest.approx(np.nanmin(decoded), abs=0.006)  # xarray rounds to float32
    stored = zarr.open_array(path + "/t2m", mode="r")[1:9].astype(np.float64)
    raw = stoker.compute_stats(path + "/t2m", region={0: (1, 9)}, cf=False, progress=False)
    assert int(raw.skipped) == 0 and float(raw.min) == stored.min() == -32768
    np.testing.assert_allclose(float(raw.mean), stored.mean(), rtol=1e-12)
    again = stoker.compute_stats(path + "/t2m", region={0: (1, 9)}, progress=False)  # the cache keeps both apart
    assert float(again.mean) == float(st.mean)


@pytest.mark.parametrize("channel_axis", [None, 1])
def test_a_spread_near_the_mean_s_resolution_keeps_every_digit(tmp_path, channel_axis):
    """float64 values 1e12 + noise of 1e-3 (float64 resolves 1.2e-4 there) in chunks of a few elements: each
    chunk's mean rounded to one float64 is off by a tenth of the noise, and merging the rounded means made the
    std 0.7 % too large. Against exact rational arithmetic over zarr-python's read, NaN left out."""
    from fractions import Fraction

    rng = np.random.default_rng(11)
    data = 1e12 + rng.normal(0, 1e-3, size=(3000, 2))
    data[7, 1] = np.nan
    uri = write(tmp_path / "a.zarr", data, (5, 2))
    values = np.asarray(zarr.open_array(uri, mode="r")[...])
    st = stoker.compute_stats(uri, channel_axis=channel_axis, cache=False, progress=False)
    columns = [values.reshape(-1)] if channel_axis is None else [values[:, 0], values[:, 1]]
    for c, col in enumerate(columns):
        xs = [Fraction(float(v)) for v in col if np.isfinite(v)]
        mean = sum(xs) / len(xs)
        std = float(sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5
        got = (st.mean, st.std) if channel_axis is None else (st.mean[c], st.std[c])
        assert float(got[0]) == pytest.approx(float(mean), rel=1e-15, abs=0)
        assert float(got[1]) == pytest.approx(std, rel=1e-9, abs=0)


def test_64_bit_integers_past_2_53_warn_that_the_float64_statistics_are_rounded(tmp_path):
    """uint64 ids up to 2**64 - 1: float64 cannot hold them, so the max came back as 2**64 (no uint64 at all) and
    nothing said so. The statistics are still float64 (what Normalize takes), with a RuntimeWarning naming the
    array and what is exact; cached or not. Values within 2**53 warn nothing."""
    ids = np.array([3, 2**53 + 1, 2**64 - 1, 17], dtype=np.uint64)
    uri = write(tmp_path / "ids.zarr", ids, (2,))
    for _ in range(2):  # computed, then from the cache
        with pytest.warns(RuntimeWarning, match=r"ids\.zarr.*2\*\*53") as got:
            st = stoker.compute_stats(uri, progress=False)
        assert "max" in str(got[0].message)
    assert float(st.max) == float(zarr.open_array(uri, mode="r")[...].max())  # rounded, as the warning says
    small = write(tmp_path / "small.zarr", np.array([-(2**53 - 1), 2**53 - 1, 5], dtype=np.int64), (2,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st = stoker.compute_stats(small, progress=False)
    assert float(st.min) == -(2**53 - 1) and float(st.max) == 2**53 - 1


def test_memory_does_not_grow_with_the_number_of_chunks(tmp_path):
    """The docs promise a few chunks in memory whatever the array's size, but each rank listed the index of every
    unit it would read before reading one: 36 bytes a chunk, 140 MB for these 4 million. Measured with tracemalloc
    up to the first NaN chunk, where nonfinite="raise" stops the pass (the chunks are never written: NaN fill)."""
    import tracemalloc

    uri = str(tmp_path / "many.zarr")
    zarr.create_array(uri, shape=(4_000_000,), chunks=(1,), dtype="float32", fill_value=np.nan)
    tracemalloc.start()
    try:
        with pytest.raises(NonFiniteData, match=r"the box \[\(0, 1\)\]"):
            stoker.compute_stats(uri, nonfinite="raise", cache=False, threads=2, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, f"{peak / 2**20:.0f} MiB for 4 million unwritten chunks"
