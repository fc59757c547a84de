"""Samplers over fields with ``region=`` and ``pad=``: anchors restricted by date on a dataset xarray wrote (the
forecasting layout: input steps and a target at a later offset), index regions on scaled fields, the region
combined exactly with a mask (hypothesis, against a brute-force count over a zarr-python read), rank partition
and resume; padded RandomCrops and TileGrid over fields read through a real Pipeline and held to ``numpy.pad``
of zarr-python reads."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker
from stoker.errors import InvalidArgument

from batch_oracle import padded as _reference  # numpy.pad of the whole array, cut to the box

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(180)

MODES = ("zero", "fill", "edge", "reflect")


def _epoch(src, epoch=0):
    return [src.sample(epoch, i) for i in range(len(src))]


# -- region by date: the forecasting layout ---------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 3])
def era(request, tmp_path_factory):
    """Daily (time, lat, lon) variables for 2000-2001, written by xarray."""
    path = str(tmp_path_factory.mktemp("fregion") / f"era{request.param}.zarr")
    t = pd.date_range("2000-01-01", "2001-12-31", freq="D")
    a = np.arange(len(t) * 6 * 8, dtype="float32").reshape(len(t), 6, 8)
    xr.Dataset({"t2m": (("time", "lat", "lon"), a), "u10": (("time", "lat", "lon"), -a)},
               coords={"time": t, "lat": np.linspace(75, -75, 6), "lon": np.arange(8.0)}).to_zarr(
        path, zarr_format=request.param, consolidated=request.param == 2)
    return path


def _forecast(era, lead=7):
    vars_ = [os.path.join(era, "t2m"), os.path.join(era, "u10")]
    return {"input": stoker.Field(vars_, (2, 6, 8)), "target": stoker.Field(vars_, (1, 6, 8), offset=(lead, 0, 0))}


def test_training_years_by_date_are_xarray_s_sel(era):
    ds = xr.open_zarr(era)
    fields = _forecast(era)
    src = stoker.RandomCrops(fields, seed=3, samples_per_epoch=3000, region={"time": ("2000-01-01", "2000-12-31")})
    picked = np.flatnonzero(np.isin(ds.time.values, ds.time.sel(time=slice("2000-01-01", "2000-12-31")).values))
    starts = {s["input"].aabb[0][0] for s in _epoch(src)}
    assert starts == set(picked.tolist()) == set(range(366))  # every day of 2000 starts an input, no other
    for s in _epoch(src)[:50]:  # the target is 7 steps after the input's first, and may leave the region
        assert s["target"].aabb[0][0] == s["input"].aabb[0][0] + 7 and s["input"].aabb[1:] == ((0, 6), (0, 8))
    # the last year: anchors stop where the target still fits in the array
    late = stoker.RandomCrops(fields, seed=3, samples_per_epoch=2000, region={"time": ("2001-12-01", "2001-12-31")})
    n = len(ds.time)
    assert {s["input"].aabb[0][0] for s in _epoch(late)} == set(range(n - 31, n - 7))
    # a date region and the same index region draw the same samples; the fingerprint holds the anchor range
    by_index = stoker.RandomCrops(fields, seed=3, samples_per_epoch=3000, region={0: (0, 366)})
    assert _epoch(by_index) == _epoch(src) and by_index.fingerprint == src.fingerprint
    whole = stoker.RandomCrops(fields, seed=3, samples_per_epoch=3000)
    other = stoker.RandomCrops(fields, seed=3, samples_per_epoch=3000, region={0: (0, 365)})
    assert len({whole.fingerprint, src.fingerprint, other.fingerprint}) == 3
    with pytest.raises(InvalidArgument, match="another sample list"):
        whole.for_rank(0, 1).load_state_dict(src.for_rank(0, 1).state_dict())
    # the default epoch length counts the region's input crops, not the whole array's
    assert stoker.RandomCrops(fields, region={0: (0, 366)}).samples_per_epoch == 367 // 2


def test_a_resumed_region_run_on_another_world_size_sees_the_epoch_once(era):
    src = stoker.RandomCrops(_forecast(era), seed=5, samples_per_epoch=101,
                             region={"time": ("2001-02", "2001-04")})
    order = _epoch(src)
    shares = [src.for_rank(r, 2) for r in range(2)]
    its = [iter(s) for s in shares]
    seen = [next(it) for _ in range(10) for it in its]
    state = shares[0].state_dict()
    # a position in the epoch's global order, loaded on 3 ranks: the rest once
    rest = []
    for r in range(3):
        mine = src.for_rank(r, 3)
        mine.load_state_dict(state)
        rest += list(mine)
    assert {repr(s) for s in seen + rest} == {repr(s) for s in order}
    assert len(seen) + len(rest) - len(order) < 3  # only the wrap of short ranks repeats


def test_region_on_a_scaled_first_field_restricts_its_box_start(tmp_path):
    coarse = zarr.create_array(str(tmp_path / "coarse.zarr"), shape=(20, 16), chunks=(8, 8), dtype="u2")
    fine = zarr.create_array(str(tmp_path / "fine.zarr"), shape=(40, 32), chunks=(8, 8), dtype="u2")
    fields = {"ctx": stoker.Field(str(tmp_path / "coarse.zarr"), (4, 4), offset=(-2, -2), scale=2),
              "img": stoker.Field(str(tmp_path / "fine.zarr"), (6, 6))}
    del coarse, fine
    src = stoker.RandomCrops(fields, seed=0, samples_per_epoch=4000, region={0: (5, 9), -1: (None, 3)})
    starts = {(s["ctx"].aabb[0][0], s["ctx"].aabb[1][0]) for s in _epoch(src)}
    # ctx's box starts at (anchor - 2) / 2 in its own voxels: the region holds those starts, in its voxels
    assert {a for a, _ in starts} == set(range(5, 9)) and {b for _, b in starts} == {0, 1, 2}
    for s in _epoch(src)[:100]:
        a = [2 * c + 2 for c, _ in s["ctx"].aabb]
        assert [c for c, _ in s["img"].aabb] == a
    with pytest.raises(InvalidArgument, match="region leaves no anchor on axis 0"):
        stoker.RandomCrops(fields, region={0: (18, 20)})  # ctx boxes there would pass img's end


# -- region and mask: exact --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    root = tmp_path_factory.mktemp("regmask")
    for name, shape in (("raw", (32, 24, 20)), ("labels", (32, 24, 20))):
        zarr.create_array(str(root / f"{name}.zarr"), shape=shape, chunks=(8, 8, 8), dtype="u1")
    return root


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), lo=st.integers(0, 14), width=st.integers(1, 14),
       frac=st.sampled_from([0.05, 0.25, 0.5]), pad=st.booleans())
def test_region_and_mask_draw_exactly_the_qualifying_anchors_in_the_region(masked, seed, lo, width, frac, pad):
    """With pad, labels sit 2 voxels before raw's anchor, so at the low border their box passes the mask's start
    (the part outside counts as zero)."""
    rng = np.random.default_rng(seed)
    mask = (rng.random((16, 12, 10)) < 0.3).astype("u1")  # 2x coarser than the fields' arrays
    uri = str(masked / f"mask{seed}.zarr")
    zarr.create_array(uri, shape=mask.shape, chunks=(4, 4, 4), dtype="u1", overwrite=True)[:] = mask
    mask = zarr.open_array(uri, mode="r")[...]
    fields = {"raw": stoker.Field(str(masked / "raw.zarr"), (8, 8, 8)),
              "labels": stoker.Field(str(masked / "labels.zarr"), (4, 4, 4), offset=(-2,) * 3 if pad else (2,) * 3)}
    region = {0: (lo, lo + width)}
    o = -2 if pad else 2
    # brute force: anchors on even voxels (the mask's scale), raw inside its arrays, in the region
    want = set()
    for a in range(0, 32 - 8 + 1, 2):
        if not lo <= a < lo + width:
            continue
        for b in range(0, 24 - 8 + 1, 2):
            for c in range(0, 20 - 8 + 1, 2):
                m = mask[tuple(slice(max(0, (x + o) // 2), max(0, (x + o + 4) // 2)) for x in (a, b, c))]
                if m.sum() / 8 >= frac:
                    want.add((a, b, c))
    make = lambda: stoker.RandomCrops(fields, seed=seed, samples_per_epoch=60 * max(1, len(want)), region=region,
                                      mask=stoker.Mask(uri, frac, field="labels", scale=2),
                                      pad="zero" if pad else None)
    if not want:
        with pytest.raises(InvalidArgument):
            make()
        return
    src = make()
    drawn = {tuple(box[0] for box in s["raw"].aabb) for s in _epoch(src)}
    assert drawn <= want and (len(want) > 20 or drawn == want)
    assert len(src.volumes[0].qualifying) == len(want)
    again = make()
    assert again.fingerprint == src.fingerprint and _epoch(again)[:30] == _epoch(src)[:30]


# -- pad over fields, through a Pipeline --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pyramid(tmp_path_factory):
    """raw (36, 28, 20) u2, a 2x coarser context level, labels (36, 28, 20) i4; fill values set."""
    root = tmp_path_factory.mktemp("fpad")
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 60000, (36, 28, 20), dtype=np.uint16)
    out = {}
    for name, data, fill, chunks in (("raw", raw, 5, (8, 8, 8)), ("context", raw[::2, ::2, ::2], 9, (5, 4, 3)),
                                     ("labels", (raw % 11).astype("i4"), -1, (7, 6, 5))):
        z = zarr.create_array(str(root / f"{name}.zarr"), shape=data.shape, chunks=chunks, dtype=data.dtype,
                              fill_value=fill)
        z[:] = data
        out[name] = (str(root / f"{name}.zarr"), zarr.open_array(str(root / f"{name}.zarr"), mode="r")[...], fill)
    return out


def _pad_fields(p):
    return {"raw": stoker.Field(p["raw"][0], (12, 12, 8)),
            "labels": stoker.Field(p["labels"][0], (6, 6, 4), offset=(3, 3, 2)),
            "context": stoker.Field(p["context"][0], (8, 8, 6), offset=(-10, -10, -8), scale=2)}


def _read_all(samples, batch_size):
    cfg = stoker.Config(batch_size=batch_size, dtype={"raw": "f32", "labels": "native", "context": "native"},
                        device="cpu", n_compute_threads=2, pop_timeout_s=30.0)
    got = []
    with stoker.Pipeline(cfg) as p:
        p.push(samples)
        for batch in p:
            x = {k: torch.from_dlpack(v).clone() for k, v in batch.items()}
            got += [(s, {k: x[k][r] for k in x}) for r, s in enumerate(batch.samples)]
    return got


def _check_padded(pyramid, got, mode):
    outside = 0
    for s, crops in got:
        assert s.pad == mode
        for name, t in crops.items():
            uri, data, fill = pyramid[name]
            box = s[name].aabb
            outside += any(a < 0 or b > n for (a, b), n in zip(box, data.shape))
            want = _reference(data, box, mode, fill)
            want = want.astype(np.float32) if name == "raw" else want
            assert np.array_equal(t.numpy(), want), (name, box)
    return outside


@pytest.mark.parametrize("mode", MODES)
def test_padded_random_crops_over_fields_are_numpy_pad(pyramid, mode):
    fields = _pad_fields(pyramid)
    # without pad the context bounds the anchors from below (its box starts at (anchor - 10) / 2 >= 0)
    assert stoker.RandomCrops(fields).volumes[0].volume.anchor([0] * 3) == (10, 10, 8)
    src = stoker.RandomCrops(fields, seed=2, samples_per_epoch=24, pad=mode)
    vol = src.volumes[0].volume
    # the first field bounds the anchors as without pad: raw inside its arrays, every such anchor drawable
    assert vol.step == (2, 2, 2) and [vol.anchor([0] * 3), vol.anchor([c - 1 for c in vol.counts])] == \
        [(0, 0, 0), (24, 16, 12)]
    samples = _epoch(src)
    for s in samples:
        assert all(0 <= a and b <= n for (a, b), n in zip(s["raw"].aabb, (36, 28, 20)))
    assert _check_padded(pyramid, _read_all(samples, 5), mode) > 0  # some context boxes were padded
    assert src.fingerprint != stoker.RandomCrops(fields, seed=2, samples_per_epoch=24,
                                                 pad="edge" if mode != "edge" else "zero").fingerprint


@pytest.mark.parametrize("mode", ["zero", "reflect"])
def test_padded_tile_grid_over_fields_lays_the_first_field_out_as_sliding_windows(pyramid, mode):
    fields = _pad_fields(pyramid)
    grid = stoker.TileGrid(fields, stride=(8, 8, 4), pad=mode)
    assert grid.complete_epochs
    samples = list(grid)
    assert len(samples) == len(grid) == math.ceil(36 / 8) * math.ceil(28 / 8) * math.ceil(20 / 4)
    # raw's tile centres (the box less (12 - 8) // 2 resp. (8 - 4) // 2 each side) tile its array exactly
    covered = np.zeros((36, 28, 20), dtype=np.int32)
    for s in samples:
        (z0, z1), (y0, y1), (x0, x1) = s["raw"].aabb
        centre = [slice(max(0, a + 2), min(n, b - 2)) for (a, b), n in zip(s["raw"].aabb, covered.shape)]
        covered[tuple(centre)] += 1
        assert (z0, y0, x0) == tuple(c - 2 for c in (z0 + 2, y0 + 2, x0 + 2))
        anchor = [a for a, _ in s["raw"].aabb]
        assert [a for a, _ in s["labels"].aabb] == [a + o for a, o in zip(anchor, (3, 3, 2))]
        assert [a for a, _ in s["context"].aabb] == [(a + o) // 2 for a, o in zip(anchor, (-10, -10, -8))]
    assert (covered == 1).all()
    assert samples[0]["raw"].aabb == ((-2, 10), (-2, 10), (-2, 6))
    _check_padded(pyramid, _read_all(samples, 7), mode)
    with pytest.raises(InvalidArgument, match="exceeds field 'raw'"):
        stoker.TileGrid(fields, stride=(14, 8, 4), pad=mode)
    with pytest.raises(InvalidArgument, match="not a multiple of"):
        stoker.TileGrid(fields, stride=(10, 8, 4), pad=mode)  # margin 1: an odd anchor, context at half voxels


def test_distributed_page_forecasting_example_runs(tmp_path, monkeypatch):
    """docs/distributed.md's forecasting example (fields, region by date) runs as written on a dataset xarray
    wrote, and draws inputs starting on the training days and the validation days whose target fits."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
    block = next(b for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S) if "region=" in b)
    block = "\n".join(line[2:] if line.startswith("  ") else line for line in block.splitlines())
    t = pd.date_range("2000-01-01", "2004-12-31", freq="D")
    a = np.zeros((len(t), 19, 36), "float32")
    xr.Dataset({"t2m": (("time", "lat", "lon"), a), "u10": (("time", "lat", "lon"), a)},
               coords={"time": t, "lat": np.linspace(90, -90, 19), "lon": np.arange(0, 360, 10.0)}).to_zarr(
        str(tmp_path / "era5.zarr"), zarr_format=3, consolidated=False)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs", "stoker": stoker}
    exec(compile(block, str(page), "exec"), namespace)
    train, valid = namespace["train"], namespace["valid"]
    n_train = int((t < np.datetime64("2004-01-01")).sum())
    assert {s["input"].aabb[0][0] for s in _epoch(train)} <= set(range(n_train))
    assert max(s["input"].aabb[0][0] for s in _epoch(valid)) <= len(t) - 8  # the target fits in the array
    assert min(s["input"].aabb[0][0] for s in _epoch(valid)) >= n_train
    assert train.sample(0, 0).shape == {"input": (2, 2, 19, 36), "target": (2, 1, 19, 36)}
