"""Samplers over named fields (stoker.Field): scales from OME-Zarr pyramids, boxes inside and aligned, offsets
and coarse context at one anchor, TileGrid over fields, and the mask sampler (stoker.Mask): coverage against
zarr-python reads of the mask, determinism, rank partition and resume across world sizes, bounded memory.

ome-zarr-py is not installed here: the pyramids are written with zarr-python, with the ``multiscales``
metadata exactly as ome-zarr-py's ``write_multiscales_metadata`` writes it (0.4 in a v2 group's ``.zattrs``,
0.5 under ``attributes["ome"]`` of a v3 group; one ``scale`` transform per dataset, level 0's all ones).
"""

from __future__ import annotations

import collections
import math
import tracemalloc

import numpy as np
import pytest
import zarr
from hypothesis import event, given, settings
from hypothesis import strategies as st

import stoker
from stoker.reader.ome import level_scale
from stoker.sampling import partition

pytestmark = pytest.mark.timeout(180)

SHAPE = (96, 128, 112)  # level 0 of the pyramid: a whole number of level-2 voxels on every axis


def _pyramid(root, name: str, data: np.ndarray, factors: list[tuple[int, ...]], fmt: int,
             chunks=(16, 32, 32)) -> str:
    """An OME-Zarr image at root/name: level i is ``data`` strided by ``factors[i]``, metadata as ome-zarr-py."""
    path = str(root / name)
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    datasets = []
    for i, f in enumerate(factors):
        level = data[tuple(slice(None, None, s) for s in f)]
        a = g.create_array(str(i), shape=level.shape, chunks=tuple(min(c, s) for c, s in zip(chunks, level.shape)),
                           dtype=level.dtype)
        a[:] = level
        datasets.append({"path": str(i), "coordinateTransformations": [{"type": "scale",
                                                                        "scale": [float(s) for s in f]}]})
    axes = [{"name": n, "type": "space"} for n in "zyx"]
    if fmt == 2:  # OME-Zarr 0.4
        g.attrs["multiscales"] = [{"axes": axes, "datasets": datasets, "name": "/", "version": "0.4"}]
    else:  # OME-Zarr 0.5
        g.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": datasets, "name": "/"}]}
    return path


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """raw (a pyramid, levels 0-2 at scales 1, 2, 4), labels = raw % 7 (uint32), a 4x coarser mask."""
    root = tmp_path_factory.mktemp("fields")
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 60000, SHAPE, dtype=np.uint16)
    image = _pyramid(root, "raw.ome.zarr", raw, [(1, 1, 1), (2, 2, 2), (4, 4, 4)], fmt=3)
    labels = zarr.create_array(str(root / "labels.zarr"), shape=SHAPE, chunks=(16, 32, 32), dtype="uint32")
    labels[:] = raw % 7
    mask = np.zeros(tuple(s // 4 for s in SHAPE), dtype=np.uint8)  # (24, 32, 28): blobs of foreground
    mask[2:7, 3:10, 4:9] = 1
    mask[14:22, 14:26, 10:22] = 1
    mask[9:12, 20:30, 2:5] = 1
    mask[20, 2, 2] = 1  # a lone voxel: covers too little for any box
    m = zarr.create_array(str(root / "mask.zarr"), shape=mask.shape, chunks=(8, 8, 8), dtype="uint8")
    m[:] = mask
    return {"root": root, "image": image, "raw": raw, "labels": str(root / "labels.zarr"),
            "mask": str(root / "mask.zarr"), "mask_data": mask}


def _fields(v, labels_shape=(16, 16, 16), labels_offset=(8, 8, 8)):
    return {"raw": stoker.Field(v["image"] + "/0", (32, 32, 32)),
            "labels": stoker.Field(v["labels"], labels_shape, offset=labels_offset),
            "context": stoker.Field(v["image"] + "/2", (16, 16, 16), offset=(-16, -16, -16))}


def _epoch(src, epoch=0):
    return [src.sample(epoch, i) for i in range(len(src))]


def _anchor(s):
    return tuple(a for a, _ in s["raw"].aabb)  # raw: scale 1, offset 0


# -- OME-Zarr scales ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("factors", [[(1, 1, 1), (2, 2, 2), (4, 4, 4)], [(1, 1, 1), (1, 2, 2), (1, 4, 4)]],
                         ids=["isotropic", "yx-only"])  # yx-only: ome-zarr-py's default Scaler
def test_field_scale_from_ome_zarr_levels(tmp_path, fmt, factors):
    data = np.arange(math.prod(SHAPE), dtype=np.uint16).reshape(SHAPE)
    image = _pyramid(tmp_path, "img.ome.zarr", data, factors, fmt)
    assert level_scale(image + "/0") is None  # level 0 is the reference
    assert level_scale(image + "/1") == factors[1] and level_scale(image + "/2") == factors[2]
    src = stoker.RandomCrops({"a": stoker.Field(image + "/0", (8, 8, 8)), "b": stoker.Field(image + "/2", (4, 4, 4))},
                             seed=0, samples_per_epoch=50)
    vol = src.volumes[0].volume
    assert vol.scales == {"a": (1, 1, 1), "b": factors[2]} and vol.step == factors[2]
    level2 = zarr.open_array(image + "/2", mode="r")[:]
    for s in _epoch(src):  # the coarse level at the same anchor: level 0 strided by its scale
        a, b = s["a"].aabb, s["b"].aabb
        assert all(lo * f == alo for (lo, _), (alo, _), f in zip(b, a, factors[2]))
        np.testing.assert_array_equal(level2[tuple(slice(*p) for p in b)],
                                      data[tuple(slice(lo * f, (lo + 4) * f, f) for (lo, _), f in zip(b, factors[2]))])
    assert level_scale(str(tmp_path / "plain.zarr")) is None


def test_field_scale_given_wins_and_fractional_ome_scale_is_refused(tmp_path):
    data = np.zeros(SHAPE, dtype=np.uint8)
    image = _pyramid(tmp_path, "img.ome.zarr", data, [(1, 1, 1), (2, 2, 2)], fmt=2)
    g = zarr.open_group(image, mode="r+")
    ms = g.attrs["multiscales"]
    ms[0]["datasets"][1]["coordinateTransformations"][0]["scale"] = [1.5, 2.0, 2.0]
    g.attrs["multiscales"] = ms
    with pytest.raises(stoker.MetadataError, match="1.5 level-0 voxels on axis 0.*scale explicitly"):
        stoker.RandomCrops({"a": stoker.Field(image + "/1", (4, 4, 4))}, seed=0)
    src = stoker.RandomCrops({"a": stoker.Field(image + "/1", (4, 4, 4), scale=(2, 2, 2))}, seed=0)
    assert src.volumes[0].volume.scales["a"] == (2, 2, 2)


def _translate(image: str, translations: list[list[float]], scales: list[list[float]] | None = None) -> None:
    """Give the datasets of ``image`` (an OME-Zarr 0.4 group) these translation (and scale) transforms."""
    g = zarr.open_group(image, mode="r+")
    ms = g.attrs["multiscales"]
    for i, (d, t) in enumerate(zip(ms[0]["datasets"], translations)):
        scale = scales[i] if scales else d["coordinateTransformations"][0]["scale"]
        d["coordinateTransformations"] = [{"type": "scale", "scale": scale}, {"type": "translation", "translation": t}]
    g.attrs["multiscales"] = ms


def test_level_translations_that_keep_voxels_aligned_are_accepted(tmp_path):
    """ome-zarr-py's half-voxel shift ((r - 1) / 2 level-0 voxels), no shift, and one shift of the whole image
    (in physical units of 0.5 per level-0 voxel) all place voxel i of a level of scale r over [i*r, (i+1)*r)."""
    image = _pyramid(tmp_path, "img.ome.zarr", np.zeros(SHAPE, np.uint8), [(1, 1, 1), (2, 2, 2), (4, 4, 4)], fmt=2)
    _translate(image, [[0.0] * 3, [0.5] * 3, [1.5] * 3])
    assert level_scale(image + "/1") == (2, 2, 2) and level_scale(image + "/2") == (4, 4, 4)
    _translate(image, [[0.0] * 3, [0.0] * 3, [0.0] * 3])
    assert level_scale(image + "/2") == (4, 4, 4)
    _translate(image, [[100.0] * 3, [100.25] * 3, [100.75] * 3], scales=[[0.5] * 3, [1.0] * 3, [2.0] * 3])
    assert level_scale(image + "/1") == (2, 2, 2) and level_scale(image + "/2") == (4, 4, 4)
    ome_zarr = pytest.importorskip("ome_zarr.writer")  # what ome-zarr-py itself writes
    ome_zarr.write_image(np.zeros((32, 32, 32), np.uint8), zarr.open_group(str(tmp_path / "w.ome.zarr"), mode="w"),
                         axes="zyx", scale_factors=[{"z": 2, "y": 2, "x": 2}, {"z": 4, "y": 4, "x": 4}])
    assert level_scale(str(tmp_path / "w.ome.zarr/s2")) == (4, 4, 4)


def test_a_level_shifted_from_level_0_is_refused_not_read_misplaced(volume, tmp_path):
    """A level whose translation moves it by whole level-0 voxels (a level covering part of the image) would
    have its context (or mask) read from the wrong place: a MetadataError, unless the scale is given."""
    image = _pyramid(tmp_path, "img.ome.zarr", np.zeros(SHAPE, np.uint8), [(1, 1, 1), (2, 2, 2), (4, 4, 4)], fmt=2)
    _translate(image, [[0.0] * 3, [0.5] * 3, [1.5, 9.5, 1.5]])  # level 2: 8 level-0 voxels further on y
    assert level_scale(image + "/1") == (2, 2, 2)
    with pytest.raises(stoker.MetadataError, match=r"level '2' is translated 9.5 level-0 voxels .* axis 1.*scale"):
        level_scale(image + "/2")
    with pytest.raises(stoker.MetadataError, match="translated"):
        stoker.RandomCrops({"a": stoker.Field(image + "/0", (8, 8, 8)), "b": stoker.Field(image + "/2", (4, 4, 4))},
                           seed=0)
    with pytest.raises(stoker.MetadataError, match="translated"):
        stoker.RandomCrops({"labels": stoker.Field(volume["labels"], (8, 8, 8))}, seed=0,
                           mask=stoker.Mask(image + "/2", 0.25, field="labels"))
    given = stoker.RandomCrops({"b": stoker.Field(image + "/2", (4, 4, 4), scale=4)}, seed=0)
    assert given.volumes[0].volume.scales["b"] == (4, 4, 4)


# -- boxes, offsets, context -------------------------------------------------------------------------------


def test_every_box_inside_and_aligned_labels_centred_context_coarse(volume):
    src = stoker.RandomCrops(_fields(volume), seed=1, samples_per_epoch=400)
    labels = zarr.open_array(volume["labels"], mode="r")
    level2 = zarr.open_array(volume["image"] + "/2", mode="r")
    shapes = {"raw": SHAPE, "labels": SHAPE, "context": level2.shape}
    raw = volume["raw"]
    anchors = set()
    for s in _epoch(src):
        assert s.names == ("raw", "labels", "context")
        assert s.shape == {"raw": (32, 32, 32), "labels": (16, 16, 16), "context": (16, 16, 16)}
        for name, f in s.fields.items():
            assert all(0 <= lo and hi <= n for (lo, hi), n in zip(f.aabb, shapes[name])), (name, f)
        a = _anchor(s)
        anchors.add(a)
        assert all(x % 4 == 0 for x in a)  # on multiples of every field's scale (context: 4)
        assert [lo for lo, _ in s["labels"].aabb] == [x + 8 for x in a]
        assert [lo for lo, _ in s["context"].aabb] == [(x - 16) // 4 for x in a]
        # the labels are the centre of the raw crop; the context spans 64 reference voxels around it
        raw_crop = raw[tuple(slice(*p) for p in s["raw"].aabb)]
        np.testing.assert_array_equal(labels[tuple(slice(*p) for p in s["labels"].aabb)], raw_crop[8:24, 8:24, 8:24] % 7)
        ctx = level2[tuple(slice(*p) for p in s["context"].aabb)]
        np.testing.assert_array_equal(ctx, raw[tuple(slice(x - 16, x + 48, 4) for x in a)])
    assert len(anchors) > 50  # drawn all over the lattice, not a handful


def test_anchor_range_is_exactly_where_every_box_fits(volume):
    src = stoker.RandomCrops(_fields(volume), seed=0, samples_per_epoch=10)
    vol = src.volumes[0].volume
    # the context (offset -16) needs anchors >= 16; its level (24, 32, 28) ends them at 4 * (24 - 16) + 16 = 48,
    # 80, 64, before raw (96 - 32 = 64, 96, 80) and labels (96 - 16 - 8 = 72, 104, 88) would
    assert vol.step == (4, 4, 4)
    assert vol.anchor([0, 0, 0]) == (16, 16, 16)
    assert vol.anchor([c - 1 for c in vol.counts]) == (48, 80, 64) and vol.counts == [9, 17, 13]
    s = vol.sample((48, 80, 64))
    assert [hi for _, hi in s["context"].aabb] == [24, 32, 28]  # the last one ends at the level's end


def test_random_anchors_reach_both_ends_of_every_axis(volume):
    # uniform per axis over the whole lattice: the last anchor (the box that ends at the level's end) is drawn as
    # often as the first; the range is worked out from the arrays' shapes, not from the sampler
    level2 = zarr.open_array(volume["image"] + "/2", mode="r").shape
    lo = 16  # the context's offset -16
    hi = [min(n - 32, n - 16 - 8, 4 * (m - 16) + 16) for n, m in zip(SHAPE, level2)]  # raw, labels, context
    src = stoker.RandomCrops(_fields(volume), seed=3, samples_per_epoch=4000)
    drawn = np.array([_anchor(s) for s in _epoch(src)])
    for axis in range(3):
        values, counts = np.unique(drawn[:, axis], return_counts=True)
        assert values.tolist() == list(range(lo, hi[axis] + 1, 4)), axis
        expected = len(drawn) / len(values)
        assert counts.min() > expected / 2 and counts.max() < expected * 2, (axis, counts)


def test_field_errors_say_what_to_change(volume):
    with pytest.raises(stoker.InvalidArgument, match=r"offset -14 on axis 0, not a multiple of its scale 4.*-16 or -12"):
        stoker.RandomCrops({"raw": stoker.Field(volume["image"] + "/0", (8, 8, 8)),
                            "c": stoker.Field(volume["image"] + "/2", (4, 4, 4), offset=(-14, 0, 0))}, seed=0)
    with pytest.raises(stoker.InvalidArgument, match="same number of axes"):
        stoker.RandomCrops({"raw": stoker.Field(volume["labels"], (8, 8, 8)),
                            "b": stoker.Field(volume["labels"], (8, 8))}, seed=0)
    with pytest.raises(stoker.InvalidArgument, match="no anchor on axis 0 keeps every field's box inside"):
        stoker.RandomCrops({"raw": stoker.Field(volume["labels"], (90, 8, 8)),
                            "l": stoker.Field(volume["labels"], (8, 8, 8), offset=(-8, 0, 0))}, seed=0)
    with pytest.raises(stoker.InvalidArgument, match="leave sample_shape out"):
        stoker.RandomCrops({"raw": stoker.Field(volume["labels"], (8, 8, 8))}, (8, 8, 8))
    with pytest.raises(stoker.InvalidArgument, match="same field names, shapes"):
        stoker.RandomCrops([{"raw": stoker.Field(volume["labels"], (8, 8, 8))},
                            {"raw": stoker.Field(volume["labels"], (8, 8, 4))}], seed=0)
    with pytest.raises(stoker.InvalidArgument, match="scale"):
        stoker.Field(volume["labels"], (8, 8, 8), scale=0)


def test_several_volumes_weighted_by_anchors(volume, tmp_path):
    small = zarr.create_array(str(tmp_path / "small.zarr"), shape=(16, 16, 16), chunks=(8, 8, 8), dtype="uint8")
    small[:] = 1
    vols = [{"x": stoker.Field(volume["labels"], (8, 8, 8))}, {"x": stoker.Field(str(tmp_path / "small.zarr"), (8, 8, 8))}]
    src = stoker.RandomCrops(vols, seed=0, samples_per_epoch=4000)
    n = [89 * 121 * 105, 9 * 9 * 9]
    got = collections.Counter(s["x"].uri for s in _epoch(src))
    assert abs(got[volume["labels"]] / 4000 - n[0] / sum(n)) < 0.01
    only = stoker.RandomCrops(vols, seed=0, samples_per_epoch=20, weights=[0, 1])
    assert {s["x"].uri for s in _epoch(only)} == {str(tmp_path / "small.zarr")}
    # a mask for the first volume only: its qualifying anchors weigh it, the other keeps all of its own
    masked = stoker.RandomCrops(vols, seed=0, samples_per_epoch=4000,
                                mask=[stoker.Mask(volume["mask"], 0.5, field="x", scale=4), None])
    q = len(masked.volumes[0].qualifying)
    assert masked.volumes[1].qualifying is None and 0 < q < masked.volumes[0].volume.n_anchors
    drawn = _epoch(masked)
    first = [s for s in drawn if s["x"].uri == volume["labels"]]
    assert abs(len(first) / 4000 - q / (q + 729)) < 0.03
    assert all(_coverage(s, volume["mask_data"], field="x") >= 0.5 for s in first)


def test_arrays_form_keeps_its_identity(volume):
    """The forms that existed (arrays + sample_shape) keep their samples and identity, so saved states resume."""
    src = stoker.RandomCrops([volume["labels"]], (8, 8, 8), seed=2, samples_per_epoch=30)
    assert src.identity() == [[volume["labels"]], [SHAPE], (8, 8, 8), [1.0], 30, 2]
    rng = np.random.default_rng([2, 0, 0])  # the draw as it always was: array, then corners per axis
    rng.random(1024)
    corners = np.floor(rng.random((1024, 3)) * np.array([s - 7 for s in SHAPE])).astype(np.int64)
    assert [s.aabb for s in _epoch(src)] == [tuple((int(c), int(c) + 8) for c in row) for row in corners[:30]]
    grid = stoker.TileGrid([volume["labels"]], (32, 32, 32))
    assert grid.identity() == [[volume["labels"]], [SHAPE], (32, 32, 32), (32, 32, 32), False, 0, "cover-border"]


# -- TileGrid over fields ----------------------------------------------------------------------------------


def test_tile_grid_over_fields_covers_the_anchor_range(volume):
    fields = _fields(volume)
    grid = stoker.TileGrid(fields, stride=(16, 16, 16))
    vol = grid.volumes[0].volume
    tiles = _epoch(grid)
    anchors = sorted(_anchor(s) for s in tiles)
    per_axis = [sorted({a[d] for a in anchors}) for d in range(3)]
    first, last = vol.anchor([0, 0, 0]), vol.anchor([c - 1 for c in vol.counts])
    for d in range(3):  # every stride from the first anchor, the last one at the last anchor
        assert per_axis[d][0] == first[d] and per_axis[d][-1] == last[d]
        assert all(b - a <= 16 for a, b in zip(per_axis[d], per_axis[d][1:]))
    assert len(tiles) == math.prod(len(p) for p in per_axis) == len(set(tiles))
    default = stoker.TileGrid({"raw": stoker.Field(volume["labels"], (32, 32, 32))})
    covered = np.zeros(SHAPE, dtype=bool)
    for s in _epoch(default):  # the first field's extent as stride: its boxes tile its array
        covered[tuple(slice(*p) for p in s["raw"].aabb)] = True
    assert covered.all()
    with pytest.raises(stoker.InvalidArgument, match="not a multiple of the step"):
        stoker.TileGrid(fields, stride=(6, 16, 16))
    shuffled = stoker.TileGrid(fields, stride=(16, 16, 16), shuffle=True, seed=3)
    assert sorted(map(repr, _epoch(shuffled))) == sorted(map(repr, tiles)) and _epoch(shuffled) != tiles


def test_tile_grid_over_fields_refuses_a_default_stride_that_leaves_gaps(tmp_path):
    # A first field one voxel long beside a context at scale 2: its anchors lie every 2 voxels, so tiles at
    # the default stride (the step) would read voxels 0, 2, 4... and never 1, 3, 5: refused, naming the fix.
    # A box of 4 tiles every 4 voxels, every voxel covered.
    for name, n in (("raw", 8), ("ctx", 4)):
        zarr.create_array(str(tmp_path / name), shape=(n,), chunks=(4,), dtype="uint8", fill_value=0)[...] = 1
    ctx = stoker.Field(str(tmp_path / "ctx"), (2,), scale=2)
    with pytest.raises(stoker.InvalidArgument, match="less than the step"):
        stoker.TileGrid({"raw": stoker.Field(str(tmp_path / "raw"), (1,)), "ctx": ctx})
    grid = stoker.TileGrid({"raw": stoker.Field(str(tmp_path / "raw"), (4,)), "ctx": ctx})
    covered = np.zeros(8, dtype=bool)
    for s in _epoch(grid):
        covered[slice(*s["raw"].aabb[0])] = True
    assert covered.all() and grid.stride == (4,)


# -- the mask sampler --------------------------------------------------------------------------------------


def _coverage(s, mask: np.ndarray, scale=4, field="labels", field_scale=1) -> float:
    """The fraction of nonzero mask voxels in the field's box, from the mask as zarr-python reads it."""
    scales = scale if isinstance(scale, tuple) else (scale,) * len(s[field].aabb)
    box = [(lo * field_scale // m, hi * field_scale // m) for (lo, hi), m in zip(s[field].aabb, scales)]
    cells = math.prod(hi - lo for lo, hi in box)
    inside = tuple(slice(max(0, lo), min(n, hi)) for (lo, hi), n in zip(box, mask.shape))
    return int(np.count_nonzero(mask[inside])) / cells


def _brute_force(vol, mask: np.ndarray, min_fraction: float) -> set:
    """Every lattice anchor whose labels box covers >= min_fraction of the mask, by enumeration."""
    out = set()
    for k in np.ndindex(*vol.counts):
        s = vol.sample(vol.anchor(k))
        if _coverage(s, mask) >= min_fraction:
            out.add(vol.anchor(k))
    return out


@pytest.mark.parametrize("min_fraction", [0.05, 0.25, 0.6])
def test_mask_draws_exactly_the_anchors_that_cover_enough(volume, min_fraction):
    mask_data = zarr.open_array(volume["mask"], mode="r")[:]  # the mask as zarr-python reads it
    src = stoker.RandomCrops(_fields(volume), seed=0, samples_per_epoch=3000,
                             mask=stoker.Mask(volume["mask"], min_fraction=min_fraction, field="labels", scale=4))
    vol = src.volumes[0].volume
    want = _brute_force(vol, mask_data, min_fraction)
    assert 0 < len(want) < vol.n_anchors
    assert {vol.anchor(np.unravel_index(int(i), vol.counts)) for i in src.volumes[0].qualifying} == want
    drawn = collections.Counter(_anchor(s) for s in _epoch(src))
    assert all(_coverage(s, mask_data) >= min_fraction for s in _epoch(src)[:500])
    assert set(drawn) <= want
    if len(want) <= 300:  # uniform among them: every one drawn, none far from the mean
        assert set(drawn) == want
        mean = 3000 / len(want)
        assert max(drawn.values()) < mean + 6 * mean ** 0.5 + 3


def test_nan_in_a_float_mask_is_no_foreground(volume, tmp_path):
    """A float mask's NaN (a missing value: xarray's _FillValue, a float array's unwritten chunks) counted as
    nonzero, so anchors were drawn where the mask says nothing; it counts as zero: the NaN-filled mask
    qualifies exactly the anchors of the 0/1 one."""
    mask = volume["mask_data"].astype("f4")
    mask[mask == 0] = np.nan
    mask[0:12] = np.where(np.isnan(mask[0:12]), 0.0, mask[0:12])  # some zeros too
    uri = str(tmp_path / "nanmask.zarr")
    zarr.create_array(uri, shape=mask.shape, chunks=(8, 8, 8), dtype="f4", fill_value=np.nan)[:] = mask
    src = stoker.RandomCrops(_fields(volume), seed=0, samples_per_epoch=500,
                             mask=stoker.Mask(uri, min_fraction=0.25, field="labels", scale=4))
    plain = stoker.RandomCrops(_fields(volume), seed=0, samples_per_epoch=500,
                               mask=stoker.Mask(volume["mask"], min_fraction=0.25, field="labels", scale=4))
    np.testing.assert_array_equal(src.volumes[0].qualifying, plain.volumes[0].qualifying)
    assert len(src.volumes[0].qualifying) < src.volumes[0].volume.n_anchors


@pytest.mark.parametrize("dtype", ["i1", "f4"])
def test_a_masks_negative_values_are_foreground(volume, tmp_path, dtype):
    """Foreground is nonzero (Mask's docs), negative values too (a signed label map, a signed distance): a mask
    holding -1 (or -0.5) for half of the 0/1 mask's foreground qualifies exactly the anchors of the 0/1 one."""
    data = volume["mask_data"]
    signed = data.astype(dtype)
    negative = (data != 0) & (np.indices(data.shape).sum(0) % 2 == 1)
    signed[negative] = -1 if dtype == "i1" else -0.5
    assert (signed < 0).sum() > 0 and np.array_equal(signed != 0, data != 0)
    uri = str(tmp_path / "signed.zarr")
    zarr.create_array(uri, shape=signed.shape, chunks=(8, 8, 8), dtype=dtype)[:] = signed
    src = stoker.RandomCrops(_fields(volume), seed=0, samples_per_epoch=500,
                             mask=stoker.Mask(uri, min_fraction=0.25, field="labels", scale=4))
    plain = stoker.RandomCrops(_fields(volume), seed=0, samples_per_epoch=500,
                               mask=stoker.Mask(volume["mask"], min_fraction=0.25, field="labels", scale=4))
    np.testing.assert_array_equal(src.volumes[0].qualifying, plain.volumes[0].qualifying)
    assert 0 < len(src.volumes[0].qualifying) < src.volumes[0].volume.n_anchors


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("dtype,fill", [("u1", 255), ("u8", 2**64 - 1)])
def test_a_masks_cf_missing_value_is_no_foreground(volume, tmp_path, zarr_format, dtype, fill):
    """An integer mask written by xarray with ``_FillValue=255`` (its "no data") counted 255 as foreground; a
    stored value its CF attributes name missing counts as zero, as xarray reads it (NaN): such a mask
    qualifies exactly the anchors of the 0/1 one where it holds 255 for 0. Also uint64's 2**64 - 1, which
    a float64 fill (2**64) cast back to uint64 made 0."""
    xr = pytest.importorskip("xarray")
    data = volume["mask_data"].astype(dtype)
    assert set(np.unique(data)) == {0, 1}
    stored = np.where(data == 0, np.dtype(dtype).type(fill), data)
    stored[0:12] = data[0:12]  # some zeros too
    uri = str(tmp_path / "m.zarr")
    xr.Dataset({"m": (("z", "y", "x"), stored)}).to_zarr(uri, encoding={"m": {"_FillValue": np.dtype(dtype).type(fill)}},
                                                         zarr_format=zarr_format, consolidated=False)
    assert np.isnan(xr.open_zarr(uri, consolidated=False)["m"].values[stored == fill]).all()  # xarray: missing
    src = stoker.RandomCrops(_fields(volume), seed=0, samples_per_epoch=500,
                             mask=stoker.Mask(uri + "/m", min_fraction=0.25, field="labels", scale=4))
    plain = stoker.RandomCrops(_fields(volume), seed=0, samples_per_epoch=500,
                               mask=stoker.Mask(volume["mask"], min_fraction=0.25, field="labels", scale=4))
    np.testing.assert_array_equal(src.volumes[0].qualifying, plain.volumes[0].qualifying)
    assert len(src.volumes[0].qualifying) < src.volumes[0].volume.n_anchors


def test_mask_scale_from_its_ome_metadata(volume, tmp_path):
    full = np.repeat(np.repeat(np.repeat(volume["mask_data"], 4, 0), 4, 1), 4, 2)
    image = _pyramid(tmp_path, "fg.ome.zarr", full, [(1, 1, 1), (2, 2, 2), (4, 4, 4)], fmt=2)
    by_meta = stoker.RandomCrops(_fields(volume), seed=5, samples_per_epoch=200,
                                 mask=stoker.Mask(image + "/2", min_fraction=0.25, field="labels"))
    given = stoker.RandomCrops(_fields(volume), seed=5, samples_per_epoch=200,
                               mask=stoker.Mask(volume["mask"], min_fraction=0.25, field="labels", scale=4))
    assert _epoch(by_meta) == _epoch(given)
    # the full-resolution level of the same mask: finer positions, each still covering enough
    fine = stoker.RandomCrops(_fields(volume), seed=5, samples_per_epoch=300,
                              mask=stoker.Mask(image + "/0", min_fraction=0.25, field="labels"))
    assert all(_coverage(s, full, scale=1) >= 0.25 for s in _epoch(fine))


def test_mask_errors(volume, tmp_path):
    empty = zarr.create_array(str(tmp_path / "empty.zarr"), shape=(24, 32, 28), chunks=(8, 8, 8), dtype="uint8")
    empty[:] = 0
    with pytest.raises(stoker.InvalidArgument, match=r"no anchor qualifies under mask .*empty\.zarr.*at most 0 .*"
                                                     r"min_fraction=0\.25") as err:
        stoker.RandomCrops(_fields(volume), seed=0, mask=stoker.Mask(str(tmp_path / "empty.zarr"), scale=4))
    assert err.value.best == 0 and err.value.uri == str(tmp_path / "empty.zarr")
    sparse = zarr.create_array(str(tmp_path / "sparse.zarr"), shape=(24, 32, 28), chunks=(8, 8, 8), dtype="uint8")
    sparse[:] = 0
    sparse[10, 10, 10] = 1  # one mask voxel of the 4 * 4 * 4 a labels box covers: at most 1/64
    with pytest.raises(stoker.InvalidArgument, match=r"at most 0\.01562") as err:
        stoker.RandomCrops(_fields(volume), seed=0, mask=stoker.Mask(str(tmp_path / "sparse.zarr"), 0.02, scale=4))
    assert err.value.best == pytest.approx(1 / 64)
    with pytest.raises(stoker.InvalidArgument, match="does not cover whole mask voxels.*multiples of 16"):
        stoker.RandomCrops(_fields(volume), seed=0, mask=stoker.Mask(volume["mask"], scale=16))
    with pytest.raises(stoker.InvalidArgument, match="names field 'seg'"):
        stoker.RandomCrops(_fields(volume), seed=0, mask=stoker.Mask(volume["mask"], field="seg", scale=4))
    with pytest.raises(stoker.InvalidArgument, match="min_fraction"):
        stoker.Mask(volume["mask"], min_fraction=0)
    with pytest.raises(stoker.InvalidArgument, match="give the arrays as fields"):
        stoker.RandomCrops([volume["labels"]], (8, 8, 8), mask=stoker.Mask(volume["mask"]))


def test_a_mask_larger_than_its_volume_at_its_scale_is_refused(volume):
    """A full-resolution mask given scale=4 (the scale of the coarse mask the user meant) spans four times the
    volume: its voxels were read at the wrong positions and every anchor drawn covered no foreground, with
    min_fraction=0.5 asked, without a word. Refused now, naming the mask, the axis and the scale; a mask cut
    short of the volume is still taken (what lies past it counts as zero)."""
    with pytest.raises(stoker.InvalidArgument, match=r"labels\.zarr .*scale 4.*axis 0.*spans 384 .*96") as err:
        stoker.RandomCrops(_fields(volume), seed=0, mask=stoker.Mask(volume["labels"], 0.5, field="labels", scale=4))
    assert err.value.uri == volume["labels"]
    short = stoker.RandomCrops(_fields(volume), seed=0, samples_per_epoch=8,
                               mask=stoker.Mask(volume["mask"], 0.25, field="labels", scale=2))
    assert len(short) == 8


def test_a_finer_mask_of_a_volume_a_coarse_level_rounded_down_is_taken(tmp_path):
    """A volume of 101 reference voxels a side, its field read at scale 2 (50 voxels: rounded down, as
    pyramids round) and masked at full resolution (101 voxels, scale 1): the mask spans one reference voxel
    past the field's 100, within the rounding, and is taken (a finer mask gives finer positions); one a whole
    field voxel further is refused."""
    img = zarr.create_array(str(tmp_path / "img1.zarr"), shape=(50, 50), chunks=(25, 25), dtype="u1")
    img[:] = 1
    for n in (101, 102):
        m = zarr.create_array(str(tmp_path / f"mask{n}.zarr"), shape=(n, n), chunks=(64, 64), dtype="u1")
        m[:] = 1
    fields = {"img": stoker.Field(str(tmp_path / "img1.zarr"), (8, 8), scale=(2, 2))}
    src = stoker.RandomCrops(fields, seed=0, samples_per_epoch=4,
                             mask=stoker.Mask(str(tmp_path / "mask101.zarr"), 0.5, field="img", scale=1))
    assert len(src) == 4
    with pytest.raises(stoker.InvalidArgument, match="scale 1 on axis 0"):
        stoker.RandomCrops(fields, seed=0, samples_per_epoch=4,
                           mask=stoker.Mask(str(tmp_path / "mask102.zarr"), 0.5, field="img", scale=1))


@pytest.fixture(scope="module")
def masked(volume):
    return lambda seed=0, n=97: stoker.RandomCrops(
        _fields(volume), seed=seed, samples_per_epoch=n, mask=stoker.Mask(volume["mask"], 0.25, field="labels", scale=4))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 130), world=st.integers(1, 5),
       policy=st.sampled_from(partition.POLICIES))
def test_mask_sampler_deterministic_and_rank_exact(masked, seed, n, world, policy):
    src, again = masked(seed, n), masked(seed, n)
    order = _epoch(src, 2)
    assert order == _epoch(again, 2)  # the same samples in every process
    shares = [list(_position_iter(src.for_rank(r, world, policy, "drop"), 2)) for r in range(world)]
    assert len({len(s) for s in shares}) == 1  # every rank the same count
    flat = [p for s in shares for p in s]
    assert len(flat) == len(set(flat)) and n - len(flat) < world  # disjoint, the epoch less a short tail
    assert [src.sample(2, p) for p in shares[0]] == [order[p] for p in shares[0]]


def _position_iter(share, epoch):
    share.set_epoch(epoch)
    return iter(share.cursor.share())


@pytest.mark.parametrize("first,then", [(2, 3), (3, 1), (1, 4)])
def test_mask_sampler_resumes_on_another_world_size(volume, masked, first, then):
    src = masked(7, 101)
    epoch = _epoch(src, 1)
    seen = []
    runs = [src.for_rank(r, first) for r in range(first)]
    its = []
    for r in runs:
        r.set_epoch(1)
        its.append(iter(r))
    for it in its:
        seen += [next(it) for _ in range(9)]
    state = its[0].state_after(9)
    fresh = masked(7, 101)  # a new process: same source, state loaded on another world size
    for r in range(then):
        view = fresh.for_rank(r, then)
        view.load_state_dict(state)
        seen += list(view)
    # nothing of the epoch skipped, nothing repeated but the wrapped tail of the last split (< then samples)
    assert not collections.Counter(epoch) - collections.Counter(seen)
    assert sum((collections.Counter(seen) - collections.Counter(epoch)).values()) < then
    other = stoker.RandomCrops(_fields(volume), seed=7, samples_per_epoch=101,
                               mask=stoker.Mask(volume["mask"], 0.5, field="labels", scale=4))
    with pytest.raises(stoker.InvalidArgument, match="another sample list"):
        other.for_rank(0, 1).load_state_dict(state)  # another mask fraction: another list, refused


def test_mask_memory_independent_of_the_full_resolution_volume(tmp_path):
    """Fields over a 4096^3 volume (arrays with no chunk written), a mask at scale 16 (256^3 voxels, 16 MiB):
    the sampler is built from slabs of the mask and keeps the qualifying anchors only."""
    big = (4096, 4096, 4096)
    for name in ("raw.zarr", "labels.zarr"):
        zarr.create_array(str(tmp_path / name), shape=big, chunks=(256, 256, 256), dtype="uint16")
    m = zarr.create_array(str(tmp_path / "mask.zarr"), shape=(256, 256, 256), chunks=(64, 64, 64), dtype="uint8")
    rng = np.random.default_rng(3)
    for z in range(0, 256, 64):
        slab = np.zeros((64, 256, 256), dtype=np.uint8)
        for _ in range(6):  # a few blobs per slab: about 5% foreground
            c = rng.integers(8, 56), rng.integers(20, 236), rng.integers(20, 236)
            slab[c[0] - 8:c[0] + 8, c[1] - 18:c[1] + 18, c[2] - 18:c[2] + 18] = 1
        m[z:z + 64] = slab
    mask_data = m[:]
    fields = {"raw": stoker.Field(str(tmp_path / "raw.zarr"), (96, 96, 96)),
              "labels": stoker.Field(str(tmp_path / "labels.zarr"), (64, 64, 64), offset=(16, 16, 16))}
    tracemalloc.start()
    try:
        src = stoker.RandomCrops(fields, seed=0, samples_per_epoch=1000,
                                 mask=stoker.Mask(str(tmp_path / "mask.zarr"), 0.25, field="labels", scale=16))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    vol = src.volumes[0].volume
    assert vol.n_anchors == 251 ** 3 and src.volumes[0].qualifying.dtype == np.uint32
    assert 0 < len(src.volumes[0].qualifying) < vol.n_anchors // 4
    # the mask alone is 16 MiB, the anchors' lattice 16 M entries (127 MiB as int64): neither is held; what is
    # is the qualifying anchors (twice while they are joined) and a few MiB of slabs and planes
    kept = src.volumes[0].qualifying.nbytes
    assert peak < min(16 << 20, 2 * kept + (8 << 20)), f"peak {peak / 2**20:.1f} MiB, anchors {kept / 2**20:.1f} MiB"
    for s in _epoch(src)[:200]:
        assert _coverage(s, mask_data, scale=16) >= 0.25


def test_fields_and_mask_over_http_match_the_local_ones(volume, tmp_path):
    """The OME metadata and the mask are read through the object store path as well (a loopback HTTP server
    serving the same files): the same scales, qualifying anchors and samples, with remote URIs."""
    from range_server import RangeServer

    server = RangeServer(str(volume["root"]))
    try:
        local = str(volume["root"])

        def fields(base):
            return {"raw": stoker.Field(base + "/raw.ome.zarr/0", (32, 32, 32)),
                    "labels": stoker.Field(base + "/labels.zarr", (16, 16, 16), offset=(8, 8, 8)),
                    "context": stoker.Field(base + "/raw.ome.zarr/2", (16, 16, 16), offset=(-16, -16, -16))}

        remote = stoker.RandomCrops(fields(server.url), seed=4, samples_per_epoch=60,
                                    mask=stoker.Mask(server.url + "/mask.zarr", 0.25, field="labels", scale=4))
        here = stoker.RandomCrops(fields(local), seed=4, samples_per_epoch=60,
                                  mask=stoker.Mask(local + "/mask.zarr", 0.25, field="labels", scale=4))
        assert remote.volumes[0].volume.scales["context"] == (4, 4, 4)
        np.testing.assert_array_equal(remote.volumes[0].qualifying, here.volumes[0].qualifying)
        assert [repr(s).replace(server.url, local) for s in _epoch(remote)] == [repr(s) for s in _epoch(here)]
    finally:
        server.stop()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), ndim=st.integers(1, 3), slab=st.sampled_from([1, 50, 1 << 20]))
def test_mask_qualifying_set_is_exact_for_any_geometry(tmp_path_factory, data, ndim, slab):
    """Random masks, scales, boxes and offsets in 1 to 3 axes, the mask read in slabs of any size: the anchors
    kept are exactly those whose box covers min_fraction of the mask as zarr-python reads it."""
    from unittest import mock

    from stoker.sampling import mask as mask_module

    root = tmp_path_factory.mktemp("geom")
    scale = tuple(data.draw(st.sampled_from([1, 2, 3]), label="mask scale") for _ in range(ndim))
    mshape = tuple(data.draw(st.integers(4, 9), label="mask shape") for _ in range(ndim))
    width = tuple(data.draw(st.integers(1, 3), label="box, mask voxels") for _ in range(ndim))
    offset = tuple(s * data.draw(st.integers(-1, 1), label="offset, mask voxels") for s in scale)
    density = data.draw(st.sampled_from([0.1, 0.3, 0.6]), label="density")
    seed = data.draw(st.integers(0, 2**32 - 1), label="mask seed")
    mask = (np.random.default_rng(seed).random(mshape) < density).astype(np.uint8) * 7
    fraction = data.draw(st.sampled_from([0.1, 0.25, 0.5, 1.0]), label="min_fraction")
    # the arrays may reach past the mask (a mask cut short: what lies past it counts as zero)
    ref = tuple((m + data.draw(st.integers(0, 2), label="past the mask")) * s + data.draw(st.integers(0, 2))
                for m, s in zip(mshape, scale))
    for name, arr_shape in (("raw.zarr", ref), ("mask.zarr", mshape)):
        z = zarr.create_array(str(root / name), shape=arr_shape, chunks=tuple(max(1, n // 2) for n in arr_shape),
                              dtype="uint8")
        z[:] = mask if name == "mask.zarr" else 0
    box = tuple(w * s for w, s in zip(width, scale))
    fields = {"raw": stoker.Field(str(root / "raw.zarr"), box),
              "labels": stoker.Field(str(root / "raw.zarr"), box, offset=offset)}
    with mock.patch.object(mask_module, "SLAB_VOXELS", slab):
        try:
            src = stoker.RandomCrops(fields, seed=0, samples_per_epoch=40,
                                     mask=stoker.Mask(str(root / "mask.zarr"), fraction, field="labels", scale=scale))
        except stoker.InvalidArgument as exc:
            if "no anchor on axis" in str(exc):
                event("boxes do not fit")
                return  # the boxes do not fit this volume: nothing to draw
            assert "no anchor qualifies" in str(exc)
            vol = stoker.RandomCrops(fields, seed=0, samples_per_epoch=1).volumes[0].volume
            coverages = [_coverage(vol.sample(vol.anchor(k)), mask, scale=scale) for k in np.ndindex(*vol.counts)]
            assert max(coverages) < fraction and exc.best == pytest.approx(max(coverages))
            event("no anchor qualifies")
            return
    vol = src.volumes[0].volume
    want = set()
    for k in np.ndindex(*vol.counts):
        if _coverage(vol.sample(vol.anchor(k)), mask, scale=scale) >= fraction:
            want.add(vol.anchor(k))
    assert {vol.anchor(np.unravel_index(int(i), vol.counts)) for i in src.volumes[0].qualifying} == want
    assert {_anchor(s) for s in _epoch(src)} <= want
    event("some anchors qualify" if len(want) < vol.n_anchors else "every anchor qualifies")


def test_field_of_channels_and_a_boolean_mask(volume, tmp_path):
    other = zarr.create_array(str(tmp_path / "other.zarr"), shape=SHAPE, chunks=(16, 32, 32), dtype="float32")
    other[:] = 1.5
    fg = zarr.create_array(str(tmp_path / "fg.zarr"), shape=volume["mask_data"].shape, chunks=(8, 8, 8), dtype="bool")
    fg[:] = volume["mask_data"] != 0
    src = stoker.RandomCrops({"raw": stoker.Field([volume["labels"], str(tmp_path / "other.zarr")], (8, 8, 8)),
                              "labels": stoker.Field(volume["labels"], (8, 8, 8))}, seed=0, samples_per_epoch=30,
                             mask=stoker.Mask(str(tmp_path / "fg.zarr"), 0.5, field="labels", scale=4))
    for s in _epoch(src):
        assert s["raw"].channels == 2 and s["raw"].uris == (volume["labels"], str(tmp_path / "other.zarr"))
        assert s.shape["raw"] == (2, 8, 8, 8) and s["raw"].aabb == s["labels"].aabb
        assert _coverage(s, volume["mask_data"]) >= 0.5
    small = zarr.create_array(str(tmp_path / "small.zarr"), shape=(8, 8, 8), chunks=(8, 8, 8), dtype="uint8")
    small[:] = 0
    with pytest.raises(stoker.InvalidArgument, match="small.zarr.*must have one shape"):
        stoker.RandomCrops({"raw": stoker.Field([volume["labels"], str(tmp_path / "small.zarr")], (4, 4, 4))})
    with pytest.raises(stoker.InvalidArgument, match="box of 2 axes"):
        stoker.RandomCrops({"raw": stoker.Field(volume["labels"], (4, 4))})


def test_distributed_page_fields_example_runs(tmp_path, monkeypatch):
    """docs/distributed.md's example of fields, context and mask runs as written, on files it names."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
    block = next(b for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S) if "stoker.Field(" in b)
    n = 192  # the smallest volume where the 48^3 context at scale 4 fits around a 96^3 crop
    raw = np.random.default_rng(0).integers(0, 255, (n, n, n), dtype=np.uint8)
    _pyramid(tmp_path, "raw.ome.zarr", raw, [(1, 1, 1), (2, 2, 2), (4, 4, 4)], fmt=3, chunks=(64, 64, 64))
    zarr.create_array(str(tmp_path / "labels.zarr"), data=raw % 5, chunks=(64, 64, 64))
    fg = np.zeros((n // 4,) * 3, dtype=np.uint8)
    fg[10:30, 12:40, 5:25] = 1
    zarr.create_array(str(tmp_path / "foreground.zarr"), data=fg, chunks=(16, 16, 16))
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs", "stoker": stoker}
    exec(compile(block, str(page), "exec"), namespace)
    sample, source, grid = namespace["sample"], namespace["source"], namespace["grid"]
    assert sample.shape == {"raw": (96, 96, 96), "labels": (56, 56, 56), "context": (48, 48, 48)}
    assert source.volumes[0].volume.scales["context"] == (4, 4, 4)
    assert _coverage(sample, fg) >= 0.25
    assert len(grid) > 0 and grid.sample(0, 0)["labels"].aabb == ((68, 124),) * 3


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_fields_whose_dimensions_come_in_another_order_are_refused(tmp_path, zarr_format):
    """Fields share one anchor, and each box is placed on its arrays by axis position: an input field over a
    variable xarray wrote as (time, lat, lon) and a target over one written as (time, lon, lat) drew a target
    box transposed against the input's (its lat range taken on lon), without a word. RandomCrops and TileGrid
    over such fields (or a mask naming its dimensions in another order than its field's arrays) are an
    InvalidArgument naming both orders; fields in one order, or without names, are drawn as before."""
    xr = pytest.importorskip("xarray")
    a = np.arange(6 * 8 * 10, dtype="f4").reshape(6, 8, 10)
    xr.Dataset({"a": (("time", "lat", "lon"), a), "b": (("time", "lon", "lat"), a.transpose(0, 2, 1).copy()),
                "c": (("time", "lat", "lon"), a + 1), "m": (("lon", "lat", "time"), np.ones((10, 8, 6), "u1")),
                "n": (("time", "lat", "lon"), np.ones((6, 8, 10), "u1"))}).to_zarr(str(tmp_path / "d.zarr"),
                                                                                 zarr_format=zarr_format)
    uri = {v: str(tmp_path / "d.zarr" / v) for v in "abcmn"}
    crossed = {"x": stoker.Field(uri["a"], (2, 4, 4)), "y": stoker.Field(uri["b"], (1, 4, 4), offset=(2, 0, 0))}
    with pytest.raises(stoker.InvalidArgument, match=r"field 'y'.*\('time', 'lon', 'lat'\).*field 'x'.*"
                                                     r"\('time', 'lat', 'lon'\)") as err:
        stoker.RandomCrops(crossed, seed=0, samples_per_epoch=4)
    assert err.value.uri == uri["b"]
    with pytest.raises(stoker.InvalidArgument, match="another order"):
        stoker.TileGrid(crossed, stride=(2, 4, 4))
    same = {"x": stoker.Field(uri["a"], (2, 4, 4)), "y": stoker.Field(uri["c"], (1, 4, 4), offset=(2, 0, 0))}
    with pytest.raises(stoker.InvalidArgument, match=r"mask .*\('lon', 'lat', 'time'\)"):
        stoker.RandomCrops(same, seed=0, samples_per_epoch=4, mask=stoker.Mask(uri["m"], field="y"))
    s = stoker.RandomCrops(same, seed=0, samples_per_epoch=4, mask=stoker.Mask(uri["n"], field="y")).sample(0, 0)
    (t0, _), (y0, _), (x0, _) = s["x"].aabb
    assert s["y"].aabb == ((t0 + 2, t0 + 3), (y0, y0 + 4), (x0, x0 + 4))


@pytest.mark.timeout(60)
def test_remote_fields_dimension_names_are_read_at_once(tmp_path):
    """The fields' dimension-order check reads each remote v2 array's ``.zattrs`` (one GET each, and one for a
    mask) at sampler construction; one after the other they cost a round trip per field. They are asked at once
    (the server holds each ``.zattrs`` request until two are open together, or 3 s), once each, and fields in
    another order are still refused over HTTP."""
    from range_server import RangeServer

    root = tmp_path / "d.zarr"
    zarr.open_group(str(root), mode="w", zarr_format=2)
    for name, dims in [("a", ["lat", "lon"]), ("b", ["lat", "lon"]), ("c", ["lon", "lat"]), ("m", ["lat", "lon"])]:
        z = zarr.create_array(str(root / name), shape=(16, 16), chunks=(8, 8), dtype="u1", zarr_format=2)
        z[:] = 1
        z.attrs["_ARRAY_DIMENSIONS"] = dims
    server = RangeServer(str(tmp_path))
    try:
        url = server.url + "/d.zarr/"

        def fields(*names):  # scales given: no OME metadata looked up, so only the check reads .zattrs
            return {n: stoker.Field(url + n, (4, 4), scale=(1, 1)) for n in names}

        for mask in (None, stoker.Mask(url + "m", field="a", scale=1)):
            server.hold_until_in_flight(2, timeout_s=3.0, ending="/.zattrs")
            server.peak_in_flight, first = 0, len(server.paths)
            stoker.RandomCrops(fields("a", "b"), seed=0, samples_per_epoch=4, mask=mask)
            server.hold_until_in_flight(None)
            asked = [p for p in server.paths[first:] if p.endswith("/.zattrs")]
            assert sorted(asked) == sorted(f"/d.zarr/{n}/.zattrs" for n in ("a", "b") + (("m",) if mask else ()))
            assert server.peak_in_flight >= 2, "the fields' .zattrs were read one after the other"
        with pytest.raises(stoker.InvalidArgument, match=r"field 'c'.*\('lon', 'lat'\).*field 'a'"):
            stoker.TileGrid(fields("a", "c"), stride=(4, 4))
    finally:
        server.stop()
