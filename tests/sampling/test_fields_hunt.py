"""Samples of named fields where data could go silently wrong: cases found by a bug hunt, each held to an
independent oracle (xarray's decoding, zarr-python reads, numpy).

Tiny arrays only: these run in a few seconds together."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import zarr

import stoker

pytestmark = pytest.mark.timeout(60)


def _anchors(src) -> set[tuple[int, ...]]:
    mv = src.volumes[0]
    return {mv.volume.anchor(np.unravel_index(int(i), mv.volume.counts)) for i in mv.qualifying}


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_unsigned_masks_missing_values_are_no_foreground(tmp_path, zarr_format):
    """A netCDF-style mask of unsigned bytes stored as int8 (``_Unsigned="true"``) marks "no data" with
    ``_FillValue=-1`` (255 read unsigned) and ``missing_value=200`` (stored -56): xarray reads both as NaN,
    no foreground. The mask counted them as foreground (its _Unsigned coding was dropped whole)."""
    xr = pytest.importorskip("xarray")
    stored = np.array([[-1, 0, 1, -56, 7], [2, -1, 0, 3, -1], [-56, 5, -1, 0, 1]], dtype="i1")
    g = zarr.open_group(str(tmp_path / "m.zarr"), mode="w", zarr_format=zarr_format)
    attrs = {"_Unsigned": "true", "_FillValue": -1, "missing_value": 200}
    if zarr_format == 2:
        g.create_array("m", shape=stored.shape, chunks=(2, 3), dtype="i1", fill_value=None,
                       attributes={**attrs, "_ARRAY_DIMENSIONS": ["y", "x"]})[:] = stored
    else:
        g.create_array("m", shape=stored.shape, chunks=(2, 3), dtype="i1", fill_value=0, attributes=attrs,
                       dimension_names=["y", "x"])[:] = stored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # xarray's about a missing_value other than the _FillValue
        read = xr.open_zarr(str(tmp_path / "m.zarr"), consolidated=False)["m"].values
    foreground = {tuple(int(i) for i in ix) for ix in np.argwhere((read != 0) & ~np.isnan(read))}
    assert len(foreground) == 6 and np.isnan(read).sum() == 6
    zarr.create_array(str(tmp_path / "raw.zarr"), shape=stored.shape, chunks=stored.shape, dtype="u1")
    src = stoker.RandomCrops({"labels": stoker.Field(str(tmp_path / "raw.zarr"), (1, 1))}, seed=0,
                             samples_per_epoch=8,
                             mask=stoker.Mask(str(tmp_path / "m.zarr" / "m"), 1.0, field="labels", scale=1))
    assert _anchors(src) == foreground


def test_an_unsigned_masks_fractional_fill_is_refused_as_the_cf_decode_refuses_it(tmp_path):
    """A fractional _FillValue of an integer mask marks no stored value; with _Unsigned it was dropped without
    a word, where the same fill without _Unsigned is a MetadataError (zarr.cf): now refused alike."""
    zarr.create_array(str(tmp_path / "m.zarr"), shape=(3, 5), chunks=(3, 5), dtype="i1", fill_value=0,
                      attributes={"_Unsigned": "true", "_FillValue": 0.5})[:] = 1
    zarr.create_array(str(tmp_path / "raw.zarr"), shape=(3, 5), chunks=(3, 5), dtype="u1")
    with pytest.raises(stoker.MetadataError, match="0.5.*not an integer"):
        stoker.RandomCrops({"labels": stoker.Field(str(tmp_path / "raw.zarr"), (1, 1))}, seed=0,
                           samples_per_epoch=8,
                           mask=stoker.Mask(str(tmp_path / "m.zarr"), 1.0, field="labels", scale=1))


def test_a_field_longer_than_its_arrays_leaves_no_anchor_without_pad(tmp_path):
    """Without pad, a field whose box is longer than its arrays on some axis fits at no anchor: the sampler says
    so when made. It drew anchors whose box covered the short axis (the rule of a padded crop), and the
    pipeline failed later with OutOfBounds; with pad such anchors are what is asked for."""
    zarr.create_array(str(tmp_path / "big.zarr"), shape=(20, 20), chunks=(5, 5), dtype="u1")
    zarr.create_array(str(tmp_path / "short.zarr"), shape=(4, 20), chunks=(5, 5), dtype="u1")
    fields = {"raw": stoker.Field(str(tmp_path / "big.zarr"), (8, 8)),
              "labels": stoker.Field(str(tmp_path / "short.zarr"), (6, 6), offset=(1, 1))}
    with pytest.raises(stoker.InvalidArgument, match="no anchor on axis 0.*field 'labels'"):
        stoker.RandomCrops(fields, seed=0)
    with pytest.raises(stoker.InvalidArgument, match="no anchor on axis 0"):
        stoker.RandomCrops({"labels": fields["labels"]}, seed=0)
    padded = stoker.RandomCrops({"labels": fields["labels"], "raw": fields["raw"]}, seed=0, pad="zero")
    assert all(s["labels"].aabb[0][0] <= 0 and s["labels"].aabb[0][1] >= 4 for s in padded)


@pytest.mark.parametrize("pad", ["zero", "fill", "edge", "reflect"])
def test_padding_an_empty_axis_is_a_constant_or_an_error_never_zeros(tmp_path, pad):
    """An axis of length 0 has no voxel to repeat or mirror: numpy.pad refuses "edge" and "reflect" there, and
    so must a sample (it delivered zeros, as if the array held them); the constants pad it as numpy does."""
    uri = str(tmp_path / "empty.zarr")
    zarr.create_array(uri, shape=(0, 4), chunks=(2, 2), dtype="u2", fill_value=9)
    raw = str(tmp_path / "raw.zarr")
    zarr.create_array(raw, shape=(4, 4), chunks=(2, 2), dtype="u2")[:] = 1
    sample = stoker.Sample({"raw": (raw, [(0, 2), (0, 4)]), "x": (uri, [(-1, 1), (0, 4)])}, pad=pad)
    with stoker.Pipeline(stoker.Config(batch_size=1, dtype="native", device="cpu", pop_timeout_s=20)) as p:
        p.push([sample])
        if pad in ("edge", "reflect"):
            with pytest.raises(stoker.OutOfBounds, match=r"empty\.zarr.*axis 0.*length 0"):
                p.pop()
            return
        with p.pop() as batch:
            got = torch.from_dlpack(batch["x"])[0].numpy()
    want = np.pad(np.zeros((0, 4), "u2"), [(1, 1), (0, 0)], constant_values=9 if pad == "fill" else 0)
    np.testing.assert_array_equal(got, want)


def test_a_2d_tissue_mask_under_a_channel_first_slide_names_its_axes_not_the_box(tmp_path):
    """A 2-D tissue mask 9x coarser (``scale=9``) under fields of (c, y, x) slides: the scale, spread over the
    fields' 3 axes, blamed field 'hi''s box on axis 2 (extent 3 "not whole mask voxels"), which told the user
    to change a box that was right; the mask's number of axes is what is wrong, and is said first."""
    zarr.create_array(str(tmp_path / "slide.zarr"), shape=(3, 90, 117), chunks=(3, 32, 32), dtype="u1")
    zarr.create_array(str(tmp_path / "tissue.zarr"), shape=(10, 13), chunks=(10, 13), dtype="u1")[:] = 1
    fields = {"hi": stoker.Field(str(tmp_path / "slide.zarr"), (3, 18, 18))}
    with pytest.raises(stoker.RankMismatch, match="2 axes .*'hi'.* 3") as err:
        stoker.RandomCrops(fields, seed=0, mask=stoker.Mask(str(tmp_path / "tissue.zarr"), 0.5, "hi", scale=9))
    assert "whole mask voxels" not in str(err.value)
    # Given the volume's axes (a channel axis of one voxel spanning the 3 channels), it is taken.
    zarr.create_array(str(tmp_path / "tissue3.zarr"), shape=(1, 10, 13), chunks=(1, 10, 13), dtype="u1")[:] = 1
    src = stoker.RandomCrops(fields, seed=0, samples_per_epoch=4,
                             mask=stoker.Mask(str(tmp_path / "tissue3.zarr"), 0.5, "hi", scale=(3, 9, 9)))
    assert len(_anchors(src)) == 9 * 12  # every (y, x) on the lattice of 9 whose 18x18 box fits in 90x117
