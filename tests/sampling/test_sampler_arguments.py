"""Arguments of the sample sources: a value that would change what is drawn without saying so (a fraction
truncated, a 0 read as "the default", a negative seed failing at the first draw) is an InvalidArgument naming
the argument when the source is made."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import stoker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("args") / "a.zarr")
    zarr.create_array(path, shape=(20, 20), chunks=(8, 8), dtype="u1")
    return path


@pytest.mark.parametrize("count", [0, 2.7, True, "5", -1])
def test_an_epoch_length_that_is_not_a_positive_integer_is_refused(uri, count):
    """0 used to mean the default (25 crops here), 2.7 two samples, True one."""
    with pytest.raises(stoker.InvalidArgument, match="samples_per_epoch"):
        stoker.RandomCrops([uri], (4, 4), samples_per_epoch=count)


def test_an_epoch_length_of_a_numpy_integer_is_taken(uri):
    assert len(stoker.RandomCrops([uri], (4, 4), samples_per_epoch=np.int64(7))) == 7
    assert len(stoker.RandomCrops([uri], (4, 4), samples_per_epoch=None)) == 25  # the default: tiles the data once


def _sources(uri, seed):
    fields = {"raw": stoker.Field(uri, (4, 4))}
    return [lambda: stoker.RandomCrops([uri], (4, 4), seed=seed, samples_per_epoch=4),
            lambda: stoker.RandomCrops(fields, seed=seed, samples_per_epoch=4),
            lambda: stoker.TileGrid([uri], (4, 4), shuffle=True, seed=seed),
            lambda: stoker.TileGrid(fields, shuffle=True, seed=seed),
            lambda: stoker.SampleList([stoker.Sample(uri, [(0, 4), (0, 4)])] * 3, shuffle=True, seed=seed)]


@pytest.mark.parametrize("seed", [-1, 1.5, "3", None])
@pytest.mark.parametrize("which", range(5))
def test_a_seed_that_is_not_an_integer_from_0_is_refused_when_the_source_is_made(uri, seed, which):
    """A negative seed made a ValueError of numpy's at the first draw (in the pipeline's thread); 1.5 was seed 1."""
    with pytest.raises(stoker.InvalidArgument, match="seed"):
        _sources(uri, seed)[which]()


@pytest.mark.parametrize("which", range(5))
def test_seeds_of_numpy_integers_and_large_ones_draw(uri, which):
    for seed in (np.int64(3), 2**70):
        src = _sources(uri, seed)[which]()
        assert src.seed == int(seed) and src.sample(0, 0) == _sources(uri, int(seed))[which]().sample(0, 0)


@pytest.mark.parametrize("epoch", [-1, 1.5, "2"])
def test_an_epoch_that_is_not_an_integer_from_0_is_refused(uri, epoch):
    """set_epoch(-1) failed at the first draw with numpy's ValueError; set_epoch(1.5) ran epoch 1."""
    share = stoker.RandomCrops([uri], (4, 4), samples_per_epoch=4).for_rank(0, 1)
    with pytest.raises(stoker.InvalidArgument, match="epoch"):
        share.set_epoch(epoch)
    ds = stoker.CropDataset(share, stoker.Config(batch_size=2, device="cpu"))
    with pytest.raises(stoker.InvalidArgument, match="epoch"):
        ds.set_epoch(epoch)
    share.set_epoch(np.int64(2))
    assert share.epoch == 2 and type(share.epoch) is int


@pytest.mark.parametrize("make", [
    lambda uri: stoker.RandomCrops([uri], (2.5, 4)),
    lambda uri: stoker.RandomCrops([uri], "44"),
    lambda uri: stoker.TileGrid([uri], (2.5, 4)),
    lambda uri: stoker.TileGrid([uri], (4, 4), stride=(2.5, 4)),
    lambda uri: stoker.TileGrid([uri], (4, 4), stride=(True, 4)),
    lambda uri: stoker.TileGrid({"raw": stoker.Field(uri, (4, 4))}, stride=(2.5, 4)),
    lambda uri: stoker.Config(sample_shape=(2.5, 4)),
    lambda uri: stoker.Config(sample_shape="44"),
    lambda uri: stoker.Mask(uri, 0.5, scale=[2.5, 1]),
], ids=["crop", "crop-str", "tile", "stride", "stride-bool", "fields-stride", "config", "config-str", "mask-scale"])
def test_a_fractional_shape_stride_or_scale_is_refused_not_truncated(uri, make):
    """(2.5, 4) used to become (2, 4): crops, tiles or strides of another shape than asked, without a word."""
    with pytest.raises(stoker.InvalidArgument, match="integer"):
        make(uri)


def test_whole_numbers_of_any_integer_type_are_taken(uri):
    """numpy integers and floats that are whole numbers (a shape computed as 64 / 2) are the integers they hold."""
    assert stoker.RandomCrops([uri], (np.int64(4), 4.0), samples_per_epoch=1).sample_shape == (4, 4)
    grid = stoker.TileGrid([uri], (4, np.int32(4)), stride=(np.int64(2), 2.0))
    assert grid.sample_shape == (4, 4) and grid.stride == (2, 2) and all(type(s) is int for s in grid.stride)
    assert stoker.Config(sample_shape=(np.int64(4), 4.0)).sample_shape == (4, 4)
    assert stoker.Mask(uri, 0.5, scale=np.int64(2)).scale == 2  # an int per axis: numpy's too
    assert stoker.Mask(uri, 0.5, scale=[np.int64(2), 1]).scale == (2, 1)
    assert stoker.Field(uri, (4, 4), scale=np.int64(2)).scale == (2, 2)


@pytest.mark.parametrize("weights", [[float("inf"), 1.0], [np.nan, 1.0], [1.0, -1.0], [0, 0], [1.0], "ab"])
def test_weights_that_are_not_finite_non_negative_numbers_are_refused(uri, weights):
    """An infinite weight made an IndexError of numpy's (inf / inf is NaN: no volume had a weight left)."""
    with pytest.raises(stoker.InvalidArgument, match="weights"):
        stoker.RandomCrops([uri, uri], (4, 4), weights=weights, samples_per_epoch=4)


@pytest.mark.parametrize("kw", [dict(shape=(True, 4)), dict(shape=(4, 4), scale=(True, 2)),
                                dict(shape=(4, 4), offset=(False, 1)), dict(shape=(4, 4.5)),
                                dict(shape=(4, 4), offset=(0.5, 0))])
def test_field_bools_and_fractions_are_refused_as_the_samplers_refuse_them(uri, kw):
    """Field read its shape, offset and scale with its own int() check, which took True as 1 where RandomCrops,
    TileGrid and Mask refuse a bool: one rule for every per-axis argument now (checks.integers)."""
    with pytest.raises(stoker.InvalidArgument, match="integers"):
        stoker.Field(uri, **kw)
    f = stoker.Field(uri, (np.int64(4), 4.0), offset=(-2, np.int32(1)), scale=(2, 1))
    assert (f.shape, f.offset, f.scale) == ((4, 4), (-2, 1), (2, 1))


@pytest.mark.parametrize("shape", [(4,), (1, 4, 4)])
def test_a_sample_shape_of_another_rank_says_so(uri, shape):
    """RandomCrops over a 2-d array given a 1-d or 3-d sample_shape said the array "cannot hold crops of
    (1, 4, 4)", which reads as crops too large; a RankMismatch now names both numbers of axes (a channel axis
    is not part of sample_shape)."""
    with pytest.raises(stoker.RankMismatch, match=f"{len(shape)} axes .* 2 axes") as err:
        stoker.RandomCrops([uri], shape)
    assert err.value.uri == uri


def test_a_tile_grid_no_array_can_hold_names_the_shapes_and_pad(uri):
    """TileGrid([uri], (32, 8)) over a (20, 20) array said "no array can hold a (32, 8) tile", naming neither
    the array, its shape nor the way out; a tile of another rank said "rank 2 differs from sample rank 3"."""
    with pytest.raises(stoker.InvalidArgument, match=r"a\.zarr.*\(20, 20\).*pad="):
        stoker.TileGrid([uri], (32, 8))
    assert len(stoker.TileGrid([uri], (32, 8), pad="zero")) > 0
    with pytest.raises(stoker.RankMismatch, match="3 axes .* 2 axes") as err:
        stoker.TileGrid([uri], (1, 8, 8))
    assert err.value.uri == uri
